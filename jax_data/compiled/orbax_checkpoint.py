"""Data positions in Orbax checkpoints, saved with the model's parameters.

:class:`DataSave` and :class:`DataRestore` are Orbax checkpoint arguments
(registered with :class:`DataCheckpointHandler`), so a data position goes
into the same ``CheckpointManager`` step as the parameters:

>>> import tempfile
>>> import numpy as np
>>> import jax
>>> import orbax.checkpoint as ocp
>>> import jax_data
>>> loader = jax_data.NumpyDataLoader(x=np.arange(100.0))
>>> pipeline = jax_data.random_reference_data(loader, 4, 8)
>>> init_fn, batch_fn, release_fn = pipeline
>>> state, _ = batch_fn(init_fn(seed=1, shuffle=True))
>>> params = {"w": np.ones(3)}
>>> with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
...   _ = manager.save(0, args=ocp.args.Composite(
...       params=ocp.args.StandardSave(params),
...       data=jax_data.DataSave(pipeline, state)))
...   manager.wait_until_finished()
...   restored = manager.restore(0, args=ocp.args.Composite(
...       params=ocp.args.StandardRestore(params),
...       data=jax_data.DataRestore(pipeline)))
>>> _, expected = batch_fn(state)
>>> _, batch = batch_fn(restored.data)
>>> bool((batch["x"] == expected["x"]).all())
True
>>> release_fn()

The position is taken when ``save`` is called, also when the manager
writes asynchronously: the sampler may go on at once. Each process of a
``jax.distributed`` job writes the chains of its own states, in a file of
its own, and reads them back; a job of another number of processes (one
process, or more) restores each process's even share of all saved chains
instead: a chain is its seed and position, never a process. A pipeline of
global batches, whose state is the same chains in every process, restores
all saved chains in every process. A restore
checks what :func:`jax_data.restore_checkpoint` checks (the format
version, the fingerprint of the data, the batch and cache sizes) and
raises :class:`jax_data.CheckpointError` naming what
differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any
from typing import List
from typing import Optional
from typing import Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_data.compiled import checkpoint
from jax_data.compiled import pipeline as pl
from jax_data.errors import CheckpointError
from jax_data.types import CacheState
from jax_data.validation import check_int

_FILE = re.compile(r"data\.process-(\d+)-of-(\d+)\.npz")


def _file_name(index: int, count: int) -> str:
  return f"data.process-{index}-of-{count}.npz"


class DataCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
  """Saves and restores the data position of a pipeline's states (see the
  module's documentation); use it through :class:`DataSave` and
  :class:`DataRestore`."""

  def _tree(self, args: Any) -> dict:
    if not isinstance(args, DataSave):
      raise TypeError(
          "a jax_data data position is saved with args=jax_data.DataSave("
          f"pipeline, state), got args={args!r}")
    # Now, not when the write runs: the sampler may go on meanwhile.
    return checkpoint.state_to_pytree(args.pipeline, args.state)

  async def async_save(self, directory: Any, args: Any = None
                       ) -> Optional[List[Any]]:
    """Takes the position now; the returned future writes it."""
    tree = self._tree(args)
    name = _file_name(jax.process_index(), jax.process_count())

    async def write() -> None:
      _write(directory / name, tree)

    return [ocp.future.CommitFutureAwaitingContractedSignals(
        write(), name="jax_data_save")]

  def save(self, directory: Any, args: Any = None) -> None:
    """Writes the position of ``args.state`` into ``directory``."""
    tree = self._tree(args)
    _write(directory / _file_name(jax.process_index(), jax.process_count()),
           tree)

  def restore(self, directory: Any, args: Any = None) -> CacheState:
    """The state saved in ``directory``, its chains registered anew in
    ``args.pipeline``.

    Saved by as many processes as restore it: each restores its own
    chains. Saved by another number: each process restores its even share
    of all saved chains, in process order (or ``args.lanes`` of them); the
    global state of a pipeline with global batches (every process saved
    the same chains) is restored whole in every process. A pipeline with
    global batches, whose state is the same chains in every process,
    restores all saved chains (or ``args.lanes`` of them) in every
    process.

    Raises:
      CheckpointError: no position was saved there, or the chains do not
        split evenly over the processes (and no ``lanes`` were given), or
        the position does not fit the pipeline.
    """
    if not isinstance(args, DataRestore):
      raise TypeError(
          "a jax_data data position is restored with args=jax_data."
          f"DataRestore(pipeline), got args={args!r}")
    index, count = jax.process_index(), jax.process_count()
    saved = {}
    for path in directory.iterdir():
      match = _FILE.fullmatch(path.name)
      if match:
        saved.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    if not saved:
      raise CheckpointError(f"{directory} holds no jax_data data position")
    # A pipeline of global batches holds the same chains in every process.
    whole = pl.of(args.pipeline).global_state
    if count in saved and index in saved[count] and not whole:
      tree, lanes = _read(saved[count][index]), args.lanes
    else:
      if len(saved) > 1:
        if count not in saved:
          raise CheckpointError(
              f"{directory} holds the positions of jobs of {sorted(saved)} "
              "processes; restore it with one of these process counts")
        saved = {count: saved[count]}
      [(writers, paths)] = saved.items()
      if sorted(paths) != list(range(writers)):
        raise CheckpointError(
            f"{directory} holds the positions of processes {sorted(paths)} "
            f"of {writers}, not of all of them")
      tree = _read(paths[0])
      lanes = args.lanes
      if json.loads(tree["host"].tobytes()).get("global"):
        # A global state: every process saved the same chains, and every
        # process restores them all.
        return checkpoint.state_from_pytree(args.pipeline, tree, lanes)
      tree = checkpoint.concatenate_trees(
          [tree] + [_read(paths[i]) for i in range(1, writers)])
      if whole:  # every process's chains, in every process
        return checkpoint.state_from_pytree(args.pipeline, tree, lanes)
      if lanes is None:
        total = len(json.loads(tree["host"].tobytes())["chains"])
        if total % count:
          raise CheckpointError(
              f"the {total} chains saved by {writers} process(es) do not "
              f"split evenly over {count} processes; give each process "
              "its chains with DataRestore(pipeline, lanes=...)")
        share = total // count
        lanes = range(index * share, (index + 1) * share)
    return checkpoint.state_from_pytree(args.pipeline, tree, lanes)

  def metadata(self, directory: Any) -> None:
    del directory
    return None

  def finalize(self, directory: Any) -> None:
    del directory

  def close(self) -> None:
    pass


def _read(path: Any) -> dict:
  with path.open("rb") as f:
    return checkpoint.read_tree(f, os.fspath(path))


def _write(path: Any, tree: dict) -> None:
  with path.open("wb") as f:
    np.savez(f, **tree)


@ocp.args.register_with_handler(DataCheckpointHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
  """Orbax save arguments: the data position of ``state`` (stacked states
  too) of ``pipeline`` (the tuple a constructor returned, or its
  ``init_fn``)."""
  pipeline: Any
  state: CacheState

  def __post_init__(self):
    # At the call, not when the manager saves (in the background).
    pipeline = pl.of(self.pipeline)
    if not isinstance(self.state, CacheState):
      raise TypeError(
          "state must be a CacheState of the pipeline's init_fn (stacked "
          f"states too), got state of type {type(self.state).__name__}")
    pipeline.saved_lanes(self.state, "DataSave")  # this pipeline's


@ocp.args.register_with_handler(DataCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
  """Orbax restore arguments: restore into ``pipeline`` (built as the
  saved one was), only ``lanes`` if given (see
  :func:`jax_data.state_from_pytree`)."""
  pipeline: Any
  lanes: Optional[Sequence[int]] = None

  def __post_init__(self):
    pl.of(self.pipeline)
    if self.lanes is not None and (
        isinstance(self.lanes, (str, bytes))
        or not hasattr(self.lanes, "__iter__")):
      raise TypeError("lanes must be None or a sequence of lane numbers, "
                      f"got lanes={self.lanes!r}")
    if self.lanes is not None:
      self.lanes = list(self.lanes)  # a generator is read once
      if not self.lanes:
        raise ValueError(
            f"lanes must name at least one lane, got lanes={self.lanes!r}")
      for lane in self.lanes:
        check_int("lanes", lane, minimum=0)
