"""Mapping a function over every observation inside compiled code:
:func:`full_reference_data` and :func:`full_data_mapper`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Callable
from typing import Dict
from typing import Hashable
from typing import Optional
from typing import Protocol
from typing import Tuple
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_data.compiled import device_loader
from jax_data.compiled import global_passes
from jax_data.compiled import pipeline as pl
from jax_data.compiled import states
from jax_data.compiled.bridge import Bridge
from jax_data.compiled.pass_keys import MAX_COMPILED
from jax_data.compiled.pass_keys import Traced
from jax_data.compiled.pass_loop import PassPlan
from jax_data.compiled.pass_loop import Progress
from jax_data.compiled.pass_loop import applier
from jax_data.compiled.pass_loop import cast_varying
from jax_data.compiled.pass_loop import map_pass
from jax_data.compiled.pass_loop import progress_reporter
from jax_data.compiled.pass_loop import varying_axes
from jax_data.compiled.pass_loop import vectorised
from jax_data.compiled.scan import promoted_carry
from jax_data.errors import CheckpointError
from jax_data.lifetime import PASSES
from jax_data.lifetime import Shared
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import OrderedChain
from jax_data.loaders.chains import RowsByIndexNeeded
from jax_data.loaders.chains import spec_from_json
from jax_data.loaders.chains import spec_to_json
from jax_data.loaders.host_loader import HostDataLoader
from jax_data.loaders.loader import DataLoader
from jax_data.loaders.loader import DeviceDataLoader
from jax_data.serving.host import Host
from jax_data.types import CacheState
from jax_data.types import Callback
from jax_data.types import MapperFn
from jax_data.types import OrderedBatch
from jax_data.types import PyTree
from jax_data.types import ReleaseFn
from jax_data.validation import check_bool
from jax_data.validation import check_jax_values
from jax_data.validation import check_keywords


def full_reference_data(data_loader: DataLoader,
                        cached_batches_count: int = 100,
                        mb_size: Optional[int] = None, *,
                        shard_index: Optional[int] = None,
                        shard_count: Optional[int] = None,
                        progress: Progress = None,
                        callback: Callback = "auto") -> OrderedBatch:
  """Maps functions over every observation, in order, inside compiled code.

  Each call of ``map_fn`` makes one pass over observations ``0 .. N - 1``
  in batches of ``mb_size``; the host serves ``cached_batches_count``
  batches per call, and the next chunk is prepared while the device works.

  >>> import jax.numpy as jnp
  >>> import jax_data
  >>> loader = jax_data.NumpyDataLoader(x=jnp.arange(10))
  >>> init_fn, map_fn, release_fn = jax_data.full_reference_data(
  ...     loader, cached_batches_count=2, mb_size=4)
  >>> state, (squares, _) = map_fn(lambda b, c: (b["x"] ** 2, c), init_fn(),
  ...                              None)
  >>> squares.tolist()
  [0, 1, 4, 9, 16, 25, 36, 49, 64, 81]

  Args:
    data_loader: A ``HostDataLoader`` or ``DeviceDataLoader``.
    cached_batches_count: Batches fetched per host call.
    mb_size: Observations per batch.
    shard_index: With ``shard_count``, pass over only this contiguous shard
      of the observations (e.g. ``jax.process_index()``).
    shard_count: Number of shards (e.g. ``jax.process_count()``).
    progress: Opt-in progress of long passes: a callable ``progress(done,
      total)`` called on the host with counts of batches as the device asks
      for each chunk, or True for a line on stderr. The device code is the
      same either way; None (default) costs nothing.
    callback: How compiled code receives chunks (see
      :func:`random_reference_data`).

  Returns:
    ``(init_fn, map_fn, release_fn)``. ``map_fn(fun, data_state, carry,
    masking=False, information=False, device_count=1)`` returns
    ``(data_state, (results, carry))``. With ``masking=True``,
    ``fun(batch, mask, carry)`` returns one result per batch; otherwise
    ``fun(batch, carry)`` returns one per observation and the results of
    fillers are dropped, so results have leading axis ``N``. With
    ``information=True``, ``batch`` is the pair ``(batch, info)`` (a
    :class:`~jax_data.MiniBatchInformation`), as ``batch_fn`` returns it:
    ``fun((batch, info), carry)``.
  """
  # Typed as the tuple it unpacks as (its functions' protocols).
  return cast(OrderedBatch, _full_pipeline(
      data_loader, cached_batches_count, mb_size, shard_index, shard_count,
      progress, callback, stacklevel=4))


def _full_pipeline(data_loader, cached_batches_count, mb_size, shard_index,
                   shard_count, progress, callback, stacklevel
                   ) -> "FullPipeline":
  config = pl.Config.checked(data_loader, cached_batches_count, mb_size,
                             callback, full=True, shard_index=shard_index,
                             shard_count=shard_count,
                             stacklevel=stacklevel + 1)
  loader, observations, mb_size = (config.loader, config.observations,
                                   config.mb_size)
  plan = PassPlan(observations.count, config.cache_size, mb_size)
  if isinstance(loader, DeviceDataLoader):
    if progress is not None:
      raise ValueError(
          "progress needs a host loader: a DeviceDataLoader makes no host "
          f"calls to report from, got progress={progress!r}")
    chunks = device_loader.FullChunks(loader, observations, plan.cache_size,
                                      mb_size)
  else:
    shard = ({} if shard_index is None else
             {"shard_index": shard_index, "shard_count": shard_count})
    chunks = HostChunks(loader, plan, shard, progress_reporter(progress,
                                                                plan),
                        config.callback)
  return FullPipeline(chunks, plan, loader)


class ChunkSource(Protocol):
  """Where a full-data pipeline's chunks come from: :class:`HostChunks`
  (a host loader, through the bridge) or ``device_loader.FullChunks``
  (slices of device-resident arrays).

  Attributes:
    host: The host side; None for device-resident data.
    id: The pipeline's identity, carried by its states.
    owner: ``id`` as the int32 operand of compiled passes.
    share_key: Pipelines with equal keys run the same compiled passes
      (the pipeline that asks is an operand); None: passes of their own
      (device-resident data are part of the code).
  """

  host: Optional[Host]
  id: int
  owner: Any
  share_key: Optional[Hashable]

  def init(self, **kwargs: Any) -> CacheState:
    """The state of a new ordered chain."""

  def fetch_fn(self, owner: Any, state: CacheState, chunk: jax.Array,
               device_count: int) -> Tuple[PyTree, jax.Array]:
    """Chunk ``chunk`` of a pass, inside compiled code: (batches, mask)."""

  def check_open(self) -> None:
    """Raises :class:`~jax_data.PipelineReleasedError` once released."""

  def release(self) -> None:
    """Drops what the source holds (idempotent)."""


class HostChunks:
  """The chunks of full-data passes over a host loader: ordered chains
  served through the bridge."""

  def __init__(self, loader: HostDataLoader, plan: PassPlan,
               shard: Dict[str, Any],
               progress: Optional[Callable[[int], None]], callback: Callback):
    self.host = pl.assemble(loader, plan.cache_size, plan.mb_size,
                            cycle=plan.chunks, progress=progress)
    self.id = self.host.id
    self.owner = np.int32(self.id)
    self._shard = shard
    self._plan = plan
    self._batch_format, _ = loader.batch_format(plan.cache_size,
                                                plan.mb_size)
    self._callback = callback
    self._chain: Optional[int] = None  # the chain init gives, once made

  @functools.cached_property
  def _bridge(self) -> Bridge:
    """The bridge to the host, found when first traced."""
    return pl.bridge(self._batch_format, self._callback)

  @property
  def share_key(self) -> Hashable:
    """The passes of pipelines with the same bridge and plan are the same
    code: the pipeline that asks is the ``owner`` operand."""
    plan = self._plan
    return (self._bridge, plan.count, plan.cache_size, plan.mb_size)

  @functools.cached_property
  def fetch_fn(self) -> Callable[..., Tuple[PyTree, jax.Array]]:
    """See :class:`ChunkSource`: a function of the bridge alone, as the
    compiled passes that other pipelines share must hold no host."""
    return functools.partial(_bridge_fetch, self._bridge)

  def init(self, **kwargs: Any) -> CacheState:
    """A pass's start. Every call gives the same host chain: its passes
    are the same data in the same order, so states stacked for
    ``jax.vmap`` (one per sampler chain) are served one read of each
    chunk for all lanes (256 such states read the data 256 times a pass
    and peaked at 1.70 GB above the start when each had its own). A
    loader written the predecessor's way gives each call its own chain:
    one without ``save_state`` cannot go back to a pass's start, which a
    fresh ``init_fn()`` per pass then did."""
    check_keywords("init_fn of a full-data pipeline", kwargs, ())
    self.host.check_open()
    chain = self._chain
    if chain is None:
      plain = self._spec()
      padded = self._padded(plain)
      try:
        chain = self.host.register(padded)
      except RowsByIndexNeeded:  # a subclass's open_chain wraps cursors
        if padded is plain:
          raise
        chain = self.host.register(plain)
      if not self.host.loader.predecessor_style:
        self._chain = chain
    return CacheState.start(self.id, chain, self._plan.mb_size)

  def _spec(self) -> ChainSpec:
    """The spec of the chain of a pass, unpadded."""
    return self.host.loader.chain_spec(True, **self._shard)

  def _padded(self, spec: ChainSpec) -> ChainSpec:
    """``spec`` padded to whole chunks where the loader's chains read rows
    by index: the pass's last chunk ends in invalid batches of one row
    (the pass's first, see ordered_batches). It read the next pass's first
    batches, up to a chunk more a pass (100 batches of 1,000 over 100,003
    rows: 199,004 rows read for the first pass)."""
    if (isinstance(spec, OrderedChain)
        and self.host.loader.chains_read_by_index):
      return dataclasses.replace(spec, batches=self._plan.chunk_batches)
    return spec

  def check_saved(self, saved: Any) -> None:
    """Raises :class:`~jax_data.CheckpointError` unless ``saved`` (a lane's
    chain in a checkpoint) holds the spec :meth:`init` registers, or the
    same unpadded (written before passes were padded to whole chunks):
    the loader checks only that a padded pass's observations lie in the
    data."""
    plain = self._spec()
    allowed = [spec_to_json(self._padded(plain)), spec_to_json(plain)]
    got = saved.get("spec") if isinstance(saved, dict) else None
    try:
      got = spec_to_json(spec_from_json(got))
    except (TypeError, ValueError):
      pass  # the chain's restore names what is wrong with it
    else:
      if got not in allowed:
        raise CheckpointError(
            f"the saved chain {got} is not this full-data pipeline's "
            f"chain {allowed[0]}: a checkpoint of another pipeline, or "
            "edited")

  def check_open(self) -> None:
    self.host.check_open()

  def release(self) -> None:
    self.host.release()


def _bridge_fetch(bridge: Bridge, owner: jax.Array, state: CacheState,
                  chunk: jax.Array, device_count: int
                  ) -> Tuple[PyTree, jax.Array]:
  return bridge.fetch(owner, state.pipeline, state.chain, chunk,
                      device_count)


def _pass(fetch_fn: Callable, plan: PassPlan, traced: Traced, owner: Any,
          data_state: CacheState, carry: PyTree, consts: list,
          masking: bool, device_count: int):
  results, carry = map_pass(
      lambda k: fetch_fn(owner, data_state, k, device_count), plan,
      functools.partial(traced.apply, consts), carry, masking)
  return data_state, (results, carry)


def varying_like(tree: PyTree, like: PyTree, example: bool = False
                 ) -> PyTree:
  """``tree`` varying over the mesh axes (of an enclosing ``shard_map``)
  that any leaf of ``like`` varies over: a carry that meets batches of a
  per-device chain (its chunks vary) takes their type, or the pass's loop
  would change the carry's type. With ``example``, ``tree`` holds shapes,
  and the result zeros of that type, to trace with (unused values)."""
  axes = varying_axes(like)
  if not axes:
    return tree
  return jax.tree_util.tree_map(lambda leaf: cast_varying(
      jnp.zeros(leaf.shape, leaf.dtype) if example else jnp.asarray(leaf),
      axes), tree)


def _check_per_observation(fun: Callable, results: PyTree,
                           mb_size: int) -> None:
  """With ``masking=False`` every result of a batch has one row per
  observation, the fillers of the last batch among them."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(results):
    if not leaf.shape or leaf.shape[0] != mb_size:
      where = (f"the result at {jax.tree_util.keystr(path)}" if path
               else "its result")
      raise ValueError(
          f"with masking=False, fun must return one result per observation "
          f"of a batch (a leading axis of mb_size={mb_size}), but for "
          f"fun={fun!r} {where} has shape {tuple(leaf.shape)}; for one "
          "result per batch pass masking=True, with fun(batch, mask, carry)")


class FullPipeline(pl.Pipeline):
  """Full-data passes; see :func:`full_reference_data`."""

  kind = "full"
  #: Compiled passes kept, one per ``fun`` (the least recently used goes).
  max_compiled = MAX_COMPILED

  def __init__(self, chunks: ChunkSource, plan: PassPlan,
               loader: DataLoader):
    self._chunks = chunks
    self._plan = plan
    super().__init__(chunks.host, CacheState.start(chunks.id, 0,
                                                   plan.mb_size),
                     loader, plan.cache_size, plan.mb_size, plan.count)
    self.sizes = (plan.cache_size, plan.mb_size, plan.count)
    # Restored stacked states share a chain, as init_fn's do.
    self.shares_chains = (isinstance(loader, HostDataLoader)
                          and not loader.predecessor_style)
    self._compiled = Shared(self.max_compiled)
    # One batch and its mask as fetched, by device_count and state shapes.
    self._batch_shapes: Dict[Any, Tuple[PyTree, jax.ShapeDtypeStruct]] = {}
    # By name: bound methods kept here would make a cycle that keeps a
    # released, dropped pipeline (and its device cache) until a collection.
    self.function_names = ("init_fn", "map_fn", "release_fn")

  def init_fn(self, **kwargs: Any) -> CacheState:
    """The state of a new ordered chain (no keywords)."""
    return self._chunks.init(**kwargs)

  def check_saved_chain(self, saved: Any) -> None:
    if isinstance(self._chunks, HostChunks):
      self._chunks.check_saved(saved)

  def data_digest(self) -> Optional[str]:
    if self.host is None:  # a device loader's passes
      return self._chunks.data_digest()
    return super().data_digest()

  def earlier_data_digests(self) -> Tuple[str, ...]:
    if self.host is None:
      return self._chunks.earlier_data_digests()
    return super().earlier_data_digests()

  def trace(self, fun: Callable, data_state: CacheState, carry: PyTree,
            masking: bool, information: bool = False, device_count: int = 1
            ) -> Traced:
    """``fun`` traced for one batch of ``data_state`` (its carry made
    varying like the state, as :meth:`run_traced` makes it).

    Raises:
      ValueError: with ``masking=False``, results that are not one per
        observation.
      TypeError: a leaf of ``carry`` that is no array or number."""
    check_jax_values("carry", carry)
    carry = varying_like(carry, data_state)
    shapes = (device_count, tuple(np.shape(leaf) for leaf in
                                  jax.tree_util.tree_leaves(data_state)))
    batch = self._batch_shapes.get(shapes)
    if batch is None:
      owner = self._chunks.owner
      batches, mask = jax.eval_shape(
          lambda s: self._chunks.fetch_fn(owner, s, jnp.int32(0),
                                          device_count), data_state)
      one = lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype)
      batch = self._batch_shapes[shapes] = (
          jax.tree_util.tree_map(one, batches), one(mask))
    # Inside shard_map a batch varies over the mesh axes where the state's
    # chain does (each device its own chunks): traced as such a value.
    batch = varying_like(batch, data_state, example=True)
    traced = Traced(applier(fun, self._plan, masking, information),
                    carry, *batch)
    # Named here, not in lax.scan's words; a pass that maps the batches of
    # a chunk (the carry unchanged) would drop a carry of another type.
    promoted_carry(carry, traced.carry_shapes, "fun", "carry")
    if not masking:
      _check_per_observation(fun, traced.result_shapes, self._plan.mb_size)
    return traced

  def run_traced(self, traced: Traced, data_state: CacheState,
                 carry: PyTree, consts: list, masking: bool,
                 device_count: int = 1):
    """The pass of a function :meth:`trace` traced, computing with
    ``consts`` in place of the arrays it read then: ``(data_state,
    (results, carry))``."""
    carry = varying_like(carry, data_state)
    compiled = self._shared(traced.key, lambda: jax.jit(
        functools.partial(_pass, self._chunks.fetch_fn, self._plan,
                          traced.lean()),
        static_argnums=(4, 5)))
    return compiled(self._chunks.owner, data_state, carry, consts, masking,
                    device_count)

  def _shared(self, key: Any, make: Callable[[], Callable]) -> Callable:
    """The compiled pass of ``key``, kept while it is among the
    ``max_compiled`` most recently used; host pipelines of the same formats
    and sizes share it while one of them keeps it."""

    def shared():
      share_key = self._chunks.share_key
      if share_key is None:  # device-resident data: its own pass
        return make()
      return PASSES.get((share_key, key), make)

    return self._compiled.get(key, shared)

  def map_fn(self, fun: Callable, data_state: CacheState, carry: PyTree,
             masking: bool = False, information: bool = False,
             device_count: int = 1):
    """One pass of ``fun`` over every observation."""
    if not callable(fun):
      raise TypeError(f"fun must be callable, got fun={fun!r}")
    data_state = states.check_state(data_state, self.template, "map_fn")
    if self.host is not None:  # else a device loader's passes
      states.check_chains(data_state.chain, self.host, "map_fn")
    call = pl.Call.checked(information, device_count, masking)
    masking, information, device_count = (call.masking, call.information,
                                           call.device_count)
    self._chunks.check_open()
    traced = self.trace(fun, data_state, carry, masking, information,
                        device_count)
    return self.run_traced(traced, data_state, carry, traced.consts,
                           masking, device_count)

  def release_fn(self) -> None:
    """Drops every reference the pipeline holds to the loader, and its
    compiled passes (a device loader's arrays are their constants)."""
    self._chunks.release()
    self._compiled.clear()


def full_data_mapper(data_loader: DataLoader, cached_batches_count: int = 1,
                     mb_size: int = 1, *, shard_index: Optional[int] = None,
                     shard_count: Optional[int] = None,
                     progress: Progress = None,
                     callback: Callback = "auto",
                     mesh: Optional[Mesh] = None,
                     batch_axis: Optional[str] = None
                     ) -> Tuple[MapperFn, ReleaseFn]:
  """Like :func:`full_reference_data`, but no data state is threaded through.

  >>> import jax.numpy as jnp
  >>> import jax_data
  >>> loader = jax_data.NumpyDataLoader(x=jnp.arange(10.0))
  >>> mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 4)
  >>> sums, _ = mapper_fn(lambda b, m, c: (jnp.sum(b["x"] * m), c), None,
  ...                     masking=True)
  >>> float(sums.sum())
  45.0

  Args:
    data_loader: A ``HostDataLoader`` or ``DeviceDataLoader``.
    cached_batches_count: Batches fetched per host call.
    mb_size: Observations per batch.
    shard_index: See :func:`full_reference_data`.
    shard_count: See :func:`full_reference_data`.
    progress: See :func:`full_reference_data`.
    callback: See :func:`random_reference_data`.
    mesh: With ``batch_axis``: split each pass over the devices of the
      mesh axis ``batch_axis`` (of every process in a ``jax.distributed``
      job), a contiguous block of batches each; the results are the
      results without a mesh, and each device's carry comes back along a
      leading axis of the devices (:doc:`/distributed`). The pass needs at
      least a batch per device; ``information=True`` does not apply (the
      mask comes with ``masking=True``).
    batch_axis: The mesh axis a pass is split along.

  Returns:
    ``(mapper_fn, release_fn)``. ``mapper_fn(fun, carry, masking=False,
    information=False, batched=True, device_count=1)`` returns
    ``(results, carry)``; with ``batched=False``, ``fun(observation, carry)``
    is vmapped over each batch and the carry of the batch's first
    observation is kept. With ``information=True``, ``fun`` gets the pair
    ``(batch, info)`` in place of ``batch``, as for
    :func:`full_reference_data`.
  """
  if mesh is not None or batch_axis is not None:
    axes = global_passes.split_axes(
        mesh, batch_axis, shard_index is not None or shard_count is not None)
    config = pl.Config.checked(data_loader, cached_batches_count, mb_size,
                               callback, full=True, stacklevel=4)
    if config.on_device:
      raise TypeError(
          "a pass split over a mesh (mesh, batch_axis) needs a host loader, "
          f"got data_loader={config.loader!r}")
    split = global_passes.checked_split(config.observation_count,
                                        config.mb_size, axes)
    plan = PassPlan(split.per_device * split.mb_size, config.cache_size,
                    split.mb_size)
    chunks = HostChunks(config.loader, plan, {}, progress_reporter(
        progress, plan, split.devices, split.batches), config.callback)
    pipeline: pl.Pipeline = global_passes.GlobalMapperPipeline(
        FullPipeline(chunks, plan, config.loader), plan.chunk_batches, axes,
        split, config.observations.start, config.loader)
  else:
    pipeline = MapperPipeline(_full_pipeline(
        data_loader, cached_batches_count, mb_size, shard_index, shard_count,
        progress, callback, stacklevel=4), data_loader)
  # Typed as the tuple it unpacks as (its functions' protocols).
  return cast(Tuple[MapperFn, ReleaseFn], pipeline)


class MapperPipeline(pl.Pipeline):
  """Full-data passes whose state stays on the host; see
  :func:`full_data_mapper`."""

  kind = "mapper"

  def __init__(self, full: FullPipeline, loader: DataLoader):
    self._full = full
    self._state = full.init_fn()
    super().__init__(full.host, full.template, loader, *full.sizes)
    # By name: bound methods kept here would make a cycle that keeps a
    # released, dropped pipeline (and its device cache) until a collection.
    self.function_names = ("mapper_fn", "release_fn")

  def mapper_fn(self, fun: Callable, carry: PyTree, masking: bool = False,
                information: bool = False, batched: bool = True,
                device_count: int = 1):
    """One pass of ``fun`` over every observation: (results, carry)."""
    if not callable(fun):
      raise TypeError(f"fun must be callable, got fun={fun!r}")
    masking = check_bool("masking", masking)
    information = check_bool("information", information)
    if not check_bool("batched", batched):
      if masking:
        raise ValueError(
            "masking=True needs a batched fun (batched=True): vectorise fun "
            "and take the mask as its second argument")
      if information:
        raise ValueError(
            "information=True needs a batched fun (batched=True), got "
            "batched=False")
      fun = vectorised(fun)
    _, (results, carry) = self._full.map_fn(
        fun, self._state, carry, masking=masking, information=information,
        device_count=device_count)
    return results, carry

  def release_fn(self) -> None:
    """Drops every reference the pipeline holds to the loader."""
    self._full.release_fn()
