"""Full-data passes split over a mesh axis: ``full_data_mapper(...,
mesh=, batch_axis=)`` (:class:`GlobalMapperPipeline`).

A pass of ``B`` batches splits into contiguous blocks of batches, one per
device along the axis (:class:`PassSplit`): device ``d`` passes over its
block, padded to the same number of batches with fully masked ones, through
an ordered chain of its own (``OrderedChain.batches``) on its process's
host. Its batches are the single-process pass's batches, so its results
are too: the devices' results, put back in pass order by a static gather,
are the single-process results, and a sum of them is the full-data value,
inside ``jit``, on one device or over the processes of a
``jax.distributed`` job.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_data.compiled import pipeline as pl
from jax_data.compiled.bridge import on_mesh
from jax_data.compiled.global_batches import MeshAxes
from jax_data.compiled.pass_keys import Traced
from jax_data.compiled.pass_loop import vectorised
from jax_data.lifetime import Shared
from jax_data.loaders.chains import OrderedChain
from jax_data.loaders.loader import DataLoader
from jax_data.streams.sampling import ObservationRange
from jax_data.validation import check_bool
from jax_data.validation import check_jax_values


@dataclasses.dataclass(frozen=True)
class PassSplit:
  """A pass over ``count`` observations in batches of ``mb_size``, split
  into ``devices`` contiguous blocks of batches whose sizes differ by at
  most one, each padded to :attr:`per_device` batches."""
  count: int
  mb_size: int
  devices: int

  @property
  def batches(self) -> int:
    return math.ceil(self.count / self.mb_size)

  @property
  def per_device(self) -> int:
    return math.ceil(self.batches / self.devices)

  def block(self, device: int) -> range:
    """The batches of the pass that ``device`` passes over."""
    return range(device * self.batches // self.devices,
                 (device + 1) * self.batches // self.devices)

  def observations(self, device: int, start: int = 0) -> ObservationRange:
    """The observations of ``device``'s block (of observations
    ``start ..``)."""
    block = self.block(device)
    first = block.start * self.mb_size
    return ObservationRange(start + first,
                            min(block.stop * self.mb_size, self.count)
                            - first)

  def order(self, per_observation: bool) -> np.ndarray:
    """Where the pass's batches (or observations) lie among the devices'
    results, one after the other: the static gather back to pass order."""
    rows = self.mb_size if per_observation else 1
    spots = [d * self.per_device * rows + np.arange(len(self.block(d)) * rows)
             for d in range(self.devices)]
    spots = np.concatenate(spots)
    return spots[:self.count] if per_observation else spots


class GlobalMapperPipeline(pl.Pipeline):
  """A :func:`jax_data.full_data_mapper` whose passes are split over a
  mesh axis; see its ``mesh`` and ``batch_axis``.

  Args:
    full: The pass of one device's block: a ``FullPipeline`` (which
      ``full_access`` builds and hands in) whose pass is
      ``split.per_device`` batches.
    chunk_batches: The batches of the chunks of that pass
      (``PassPlan.chunk_batches``): each device's share is padded to them.
    axes: The mesh and its batch axis (no chain axis).
    split: How the pass splits.
    start: The first observation of the pass.
    loader: The loader.
  """

  kind = "mapper"

  def __init__(self, full: pl.Pipeline, chunk_batches: int, axes: MeshAxes,
               split: PassSplit, start: int, loader: DataLoader):
    self._full, self._axes, self._split = full, axes, split
    host = full.host
    super().__init__(host, full.template, loader, full.sizes[0],
                     split.mb_size, split.count)

    # The chain of each of this process's devices along the axis (-1 for
    # the others'): a constant of this process's code, which each device
    # reads at its axis index (a global array would span other processes'
    # devices, which code that closes over the pipeline may not hold).
    here = jax.process_index()
    # Each share padded to whole chunks: its last chunk's batches past the
    # share are invalid batches of one row, not the share's first ones.
    # The last share's fillers are the pass's first observations, as they
    # are without a mesh (they were the share's own first).
    self._chains = np.array(
        [host.register(OrderedChain(split.observations(d, start),
                                    chunk_batches, fillers_from=start))
         if device.process_index == here else -1
         for d, device in enumerate(axes.mesh.devices.reshape(-1))],
        np.int32)
    self._passes = Shared(full.max_compiled)
    # By name: bound methods kept here would make a cycle that keeps a
    # released, dropped pipeline (and its device cache) until a collection.
    self.function_names = ("mapper_fn", "release_fn")

  def mapper_fn(self, fun: Callable, carry: Any, masking: bool = False,
                information: bool = False, batched: bool = True,
                device_count: int = 1):
    """One pass of ``fun`` over every observation, split over the devices:
    ``(results, carries)``. The results are those of the pass without a
    mesh; each device threads the carry through its own batches, and the
    carries come back with a leading axis of the devices."""
    if not callable(fun):
      raise TypeError(f"fun must be callable, got fun={fun!r}")
    call = pl.Call.checked(information, device_count, masking)
    if call.information or call.device_count != 1:
      raise ValueError(
          "a pass split over a mesh takes neither information=True (the "
          "mask comes with masking=True) nor device_count, got "
          f"information={information!r}, device_count={device_count!r}")
    if not check_bool("batched", batched):
      if call.masking:
        raise ValueError(
            "masking=True needs a batched fun (batched=True): vectorise fun "
            "and take the mask as its second argument")
      fun = vectorised(fun)
    check_jax_values("carry", carry)
    self.check_open()
    traced = self._trace(fun, carry, call.masking)
    run = self._passes.get((traced.key, call.masking), lambda: jax.jit(
        functools.partial(_split_pass, self._full, self._axes,
                          self._split, traced.lean(), call.masking,
                          self._chains)))
    return run(carry, traced.consts)

  def _trace(self, fun: Callable, carry: Any, masking: bool) -> Traced:
    """``fun`` traced for one batch of a device's block, inside the
    pass's ``shard_map`` (so with its batches' device-varying types): the
    compiled passes are kept by what the function does, and compute with
    the arrays it reads now, passed in, as ``FullPipeline.map_fn``'s are."""
    traced = []

    def local(carry):
      state = self._full.template._replace(chain=jnp.asarray(self._chains)[
          lax.axis_index(self._axes.batch_axis)])
      traced.append(self._full.trace(fun, state, carry, masking))
      return jnp.zeros((1,), jnp.int32)

    try:
      jax.eval_shape(lambda carry: jax.shard_map(
          on_mesh(self._axes.mesh, local), mesh=self._axes.mesh, in_specs=P(),
          out_specs=P(self._axes.batch_axis))(_replicated(self._axes,
                                                         carry)), carry)
    except NotImplementedError as e:
      if "Closing over inputs to shard_map" not in str(e):
        raise
      raise ValueError(
          "fun reads an array placed on a mesh of explicit axes (sharded "
          "or replicated), which JAX cannot close over inside the pass's "
          "shard_map, not even as an argument of the enclosing jit: pass "
          "it in the carry, or close over a NumPy array instead. "
          f"JAX said: {str(e).splitlines()[0]}") from e
    except ValueError as e:
      if "should match the mesh of sharding" not in str(e):
        raise
      raise ValueError(
          "fun indexes an array placed on the mesh (sharded or "
          "replicated), which JAX cannot close over inside the pass's "
          "shard_map: pass it in the carry, call mapper_fn inside a jitted "
          "function that takes it as an argument, or close over a NumPy "
          f"array instead. JAX said: {str(e).splitlines()[0]}") from e
    return traced[0]

  def release_fn(self) -> None:
    """Drops every reference the pipeline holds to the loader."""
    self._full.release_fn()
    self._passes.clear()


def _split_pass(full: pl.Pipeline, axes: MeshAxes, split: PassSplit,
                traced: Traced, masking: bool, chains: np.ndarray,
                carry: Any, consts: list):
  """The pass: each device's block through ``full``'s pass of ``traced``
  (computing with ``consts``), inside ``shard_map``; its results gathered
  back to pass order."""
  axis = axes.batch_axis

  def local(carry, consts):
    # Each device's chain, and so its carry, goes its own way from here.
    state = full.template._replace(
        chain=jnp.asarray(chains)[lax.axis_index(axis)])
    _, (results, carry) = full.run_traced(traced, state, carry, consts,
                                          masking)
    return results, jax.tree_util.tree_map(lambda c: c[None], carry)

  results, carries = jax.shard_map(
      on_mesh(axes.mesh, local), mesh=axes.mesh, in_specs=(P(), P()),
      out_specs=(P(axis), P(axis)))(_replicated(axes, carry),
                                    _replicated(axes, consts))
  order = split.order(per_observation=not masking)
  return jax.tree_util.tree_map(
      lambda r: r[order], _replicated(axes, results)), carries


def _replicated(axes: MeshAxes, tree: Any) -> Any:
  """``tree`` replicated over the mesh where it has explicit axes
  (jax.make_mesh's default), which type arrays by their sharding: the
  carry and the arrays ``fun`` reads, maybe sharded over the batch axis,
  enter every device's block whole, and the blocks' results are gathered
  back to pass order (each of these failed with a sharding error). On
  other meshes, ``tree`` as it is."""
  if not any(kind == jax.sharding.AxisType.Explicit
             for kind in getattr(axes.mesh, "axis_types", ())):
    return tree
  whole = jax.sharding.NamedSharding(axes.mesh, P())
  return jax.tree_util.tree_map(lambda a: jax.sharding.reshard(a, whole),
                                tree)


def split_axes(mesh: Any, batch_axis: Any, sharded: bool) -> MeshAxes:
  """The checked mesh axes of a split pass.

  Raises:
    TypeError, ValueError: see :meth:`MeshAxes.checked` (a mesh with
      another axis among them); ``shard_index``/``shard_count`` given too.
  """
  if sharded:
    raise ValueError(
        "a pass split over a mesh (mesh, batch_axis) visits every "
        "observation; shard_index and shard_count do not apply")
  return MeshAxes.checked(mesh, batch_axis, None, None)


def checked_split(count: int, mb_size: int, axes: MeshAxes) -> PassSplit:
  """The split of a pass over ``axes``' batch axis.

  Raises:
    ValueError: fewer batches than devices.
  """
  split = PassSplit(count, mb_size, axes.parts)
  if split.batches < axes.parts:
    raise ValueError(
        f"a pass of {split.batches} batches of mb_size={mb_size} does not "
        f"split over the {axes.parts} devices of batch_axis="
        f"{axes.batch_axis!r}; use a smaller mb_size")
  return split
