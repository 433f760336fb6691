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
``jax.distributed`` job writes and reads the chains of its own states, in
a file of its own. A restore checks what :func:`jax_data.restore_checkpoint`
checks (the format version, the fingerprint of the data, the batch and
cache sizes) and raises :class:`jax_data.CheckpointError` naming what
differs.
"""

from __future__ import annotations

import dataclasses
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
from jax_data.errors import CheckpointError
from jax_data.types import CacheState

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

    Raises:
      CheckpointError: no position of this process was saved there (or by
        another number of processes), or it does not fit the pipeline.
    """
    if not isinstance(args, DataRestore):
      raise TypeError(
          "a jax_data data position is restored with args=jax_data."
          f"DataRestore(pipeline), got args={args!r}")
    index, count = jax.process_index(), jax.process_count()
    path = directory / _file_name(index, count)
    if not path.exists():
      saved = sorted({int(m.group(2)) for p in directory.iterdir()
                      if (m := _FILE.fullmatch(p.name))})
      raise CheckpointError(
          f"{directory} holds no data position of process {index} of "
          f"{count}: " + (f"it was saved by {saved[0]} process(es); restore "
                          "it with as many" if saved else
                          "no jax_data position was saved there"))
    with path.open("rb") as f:
      tree = checkpoint.read_tree(f, os.fspath(path))
    return checkpoint.state_from_pytree(args.pipeline, tree, args.lanes)

  def metadata(self, directory: Any) -> None:
    del directory
    return None

  def finalize(self, directory: Any) -> None:
    del directory

  def close(self) -> None:
    pass


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


@ocp.args.register_with_handler(DataCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
  """Orbax restore arguments: restore into ``pipeline`` (built as the
  saved one was), only ``lanes`` if given (see
  :func:`jax_data.state_from_pytree`)."""
  pipeline: Any
  lanes: Optional[Sequence[int]] = None
