"""Global mini-batches: one chain's batch as a global ``jax.Array`` split
along its batch axis over a mesh axis (:class:`GlobalPipeline`).

Every device along the batch axis holds the same chain position and its
own part of the chain's cache: the rows ``[d * n, (d + 1) * n)`` of every
batch, ``n = mb_size / parts``. It asks its process's host for chunk ``k``
of its *part chain*: a chain with the whole chain's seed and stream whose
cursor draws the whole batch's indices and reads only its rows
(:class:`~jax_data.loaders.chains.BatchPart`). So each process reads only
the rows of its addressable devices, and the global batch equals the batch
of the same seed in one process, whatever the number of processes and
devices. On a 2-D mesh a second axis holds chains.

The state is a :class:`~jax_data.types.CacheState` of global arrays: its
``chain`` field holds the part chains' numbers (shape ``(parts,)``, split
over the batch axis; each process fills in those of its own devices), its
cache is split along the batch axis, the counters are replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import threading
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_data.compiled import pipeline as pl
from jax_data.compiled import scan as scan_lib
from jax_data.compiled import states
from jax_data.compiled.bridge import on_mesh
from jax_data.loaders.chains import BatchPart
from jax_data.loaders.host_loader import chain_specs
from jax_data.types import CacheState
from jax_data.types import MiniBatchInformation
from jax_data.validation import seed_list


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """Where a global pipeline's batches and chains lie on a mesh.

  Attributes:
    mesh: The mesh (of every process's devices in a ``jax.distributed``
      job).
    batch_axis: The axis each batch is split along.
    chain_axis: The axis chains are split along; None: one chain per state.
  """
  mesh: Mesh
  batch_axis: str
  chain_axis: Optional[str] = None

  @property
  def parts(self) -> int:
    """Devices along the batch axis: the parts of each batch."""
    return int(self.mesh.shape[self.batch_axis])

  @property
  def chain_devices(self) -> int:
    """Devices along the chain axis (1 without one)."""
    return 1 if self.chain_axis is None else int(
        self.mesh.shape[self.chain_axis])

  @classmethod
  def checked(cls, mesh: Any, batch_axis: Any, chain_axis: Any,
              mb_size: Optional[int]) -> "MeshAxes":
    """The checked axes of a pipeline of batches of ``mb_size`` (None: a
    pass split by whole batches).

    Raises:
      TypeError, ValueError: not a mesh, an axis it lacks, an axis that is
        neither the batch nor the chain axis, or a batch size that does not
        split evenly; named with their values.
    """
    if not isinstance(mesh, Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh, got mesh={mesh!r}")
    names = tuple(mesh.axis_names)
    for name, axis in (("batch_axis", batch_axis), ("chain_axis", chain_axis)):
      if (axis is not None or name == "batch_axis") and axis not in names:
        raise ValueError(
            f"{name} must be one of the mesh's axes {names}, got "
            f"{name}={axis!r}")
    if chain_axis == batch_axis:
      raise ValueError(
          f"chain_axis and batch_axis must differ, both are {batch_axis!r}")
    others = [a for a in names if a not in (batch_axis, chain_axis)]
    if others:
      raise ValueError(
          f"every axis of the mesh must be batch_axis={batch_axis!r} or "
          f"chain_axis={chain_axis!r}, but mesh has axes {names}; make a "
          "mesh of those axes only")
    axes = cls(mesh, batch_axis, chain_axis)
    if mb_size is not None and mb_size % axes.parts:
      raise ValueError(
          f"mb_size={mb_size} must split evenly over the "
          f"{axes.parts} devices of batch_axis={batch_axis!r}")
    return axes

  def state_specs(self) -> CacheState:
    """The partition spec of each field of a state."""
    c = () if self.chain_axis is None else (self.chain_axis,)
    return CacheState(pipeline=P(*c), chain=P(*c, self.batch_axis),
                      chunk=P(*c), position=P(*c), cached_chunk=P(*c),
                      batches=P(*c, None, self.batch_axis),
                      mask=P(*c, None, self.batch_axis), key=P(*c))

  def batch_spec(self) -> P:
    """The partition spec of a batch's leaves and mask."""
    c = () if self.chain_axis is None else (self.chain_axis,)
    return P(*c, self.batch_axis)


class GlobalPipeline(pl.RandomPipeline):
  """Random batches, each a global array split over a mesh axis; see
  :func:`jax_data.random_reference_data` (``mesh``, ``batch_axis``).

  Args:
    local: The pipeline of each device's part: batches of
      ``mb_size / parts`` rows, through which its part chains are served.
    axes: The mesh and its axes.
    mb_size: Observations per (global) batch.
  """

  global_state = True

  def __init__(self, local: Any, axes: MeshAxes, mb_size: int):
    self._local = local
    self._axes = axes
    self._mb_size = mb_size
    host = local.host
    cache_size = local.template.mask.shape[0]
    self._count = host.loader.observation_count
    template = local.template._replace(
        chain=np.zeros((axes.parts,), np.int32),
        batches=jax.tree_util.tree_map(
            lambda s: np.zeros((cache_size, mb_size) + tuple(s.shape),
                               s.dtype), host.loader.observation_format),
        mask=np.zeros((cache_size, mb_size), np.bool_))
    super().__init__(host, template, host.loader, cache_size, mb_size,
                     self._count)
    self._lock = threading.Lock()
    self._numbers = itertools.count()
    self._parts: Dict[Tuple[int, int], int] = {}  # (global chain, part)
    self._step = _global_step(local.advance, axes)
    # By name: bound methods kept here would make a cycle that keeps a
    # released, dropped pipeline (and its device cache) until a collection.
    self.function_names = ("init_fn", "batch_fn", "release_fn")

  @property
  def axes(self) -> MeshAxes:
    return self._axes

  def init_fn(self, **kwargs: Any) -> CacheState:
    """Registers a chain (with ``chain_axis``: a chain per seed of the
    sequence ``seed``, by default of counter-based streams, as for
    ``random_reference_data``) and returns its global state; other
    keywords go to the loader as for ``random_reference_data``
    (``shuffle``, ``in_epochs``, ``stream``, ``shard_index``,
    ``shard_count``). This
    process registers the parts of its own devices only. In a job of
    several processes every process calls it alike.

    Raises:
      TypeError, ValueError: bad keywords; with ``chain_axis``, ``seed``
        not a sequence whose length the chain axis divides; without it, a
        sequence (several chains on a mesh need ``chain_axis``).
    """
    seeds = self._seeds(kwargs.pop("seed", None))
    loader = self.host.loader
    specs = ([loader.chain_spec(False, seed=seeds[0], **kwargs)]
             if self._axes.chain_axis is None
             else chain_specs(loader, seeds, **kwargs))
    with self._lock:
      chains = [next(self._numbers) for _ in specs]
    specs = [spec if spec.seed is not None else
             dataclasses.replace(spec, seed=chain)
             for spec, chain in zip(specs, chains)]
    lead = () if self._axes.chain_axis is None else (len(specs),)
    zeros = np.zeros(lead, np.int32)
    part = lambda row, index: self._part(chains[row], specs[row], index)
    try:
      return global_state(self._axes, self.template, lead, part, zeros,
                          zeros, np.zeros(lead + np.shape(self.template.key),
                                          np.uint32))
    except BaseException:
      # Ended early (a Ctrl-C, a failed placement): the parts registered
      # so far belong to no state.
      numbers = set(chains)
      with self._lock:
        made = [key for key in self._parts if key[0] in numbers]
        parts = [self._parts.pop(key) for key in made]
      for number in parts:
        self.host.remove_chain(number)
      raise

  def _seeds(self, seed: Any) -> List[Optional[int]]:
    if self._axes.chain_axis is None:
      if seed_list(seed) is not None:
        raise TypeError(
            f"seed must be an integer, got seed={seed!r}; a sequence of "
            "seeds makes several chains, which on a mesh need chain_axis "
            f"(a mesh axis besides batch_axis={self._axes.batch_axis!r})")
      return [seed]
    # A list, tuple, range or 1-D array, as without a mesh.
    seeds = None if isinstance(seed, str) else seed_list(seed)
    if seeds is None or len(seeds) % self._axes.chain_devices:
      raise ValueError(
          f"with chain_axis={self._axes.chain_axis!r}, init_fn takes a "
          "sequence of seeds, one per chain, whose length the "
          f"{self._axes.chain_devices} devices of the chain axis divide, got "
          f"seed={seed!r}")
    return seeds

  def _part(self, chain: int, spec: Any, part: int) -> int:
    """The number of the part chain ``part`` of global chain ``chain``,
    registered on first use."""
    with self._lock:
      number = self._parts.get((chain, part))
      if number is None:
        number = self.host.register(dataclasses.replace(
            spec, part=BatchPart(part, self._axes.parts)))
        self._parts[(chain, part)] = number
    return number

  def batch_fn(self, state: CacheState, information: bool = False,
               device_count: int = 1):
    """The next global batch of the state's chain (chains), and the
    advanced state: leaves of shape ``(mb_size, ...)`` (with
    ``chain_axis``: ``(chains, mb_size, ...)``) split over the batch axis."""
    state = self.check_state(state, "batch_fn")
    call = pl.Call.checked(information, device_count)
    if call.device_count != 1:
      raise ValueError(
          "device_count does not apply to global batches (the mesh says "
          f"which devices hold what), got device_count={device_count}")
    self.host.check_open()
    new_state, batch, batch_mask = self._step(state)
    if call.information:
      return new_state, (batch, MiniBatchInformation(
          observation_count=self._count, mask=batch_mask,
          batch_size=self._mb_size))
    return new_state, batch

  def check_state(self, state: Any, where: str) -> CacheState:
    """``state``, checked against the template (a leading chain axis with
    ``chain_axis``) before anything is traced. Global arrays of several
    processes are checked by this process's shards."""
    if not isinstance(state, CacheState):
      raise TypeError(
          f"{where} expects a CacheState from this pipeline's init_fn, got "
          f"state of type {type(state).__name__}")
    got = jax.tree_util.tree_structure(state)
    want = jax.tree_util.tree_structure(self.template)
    if got != want:
      raise TypeError(
          f"state does not belong to this pipeline: its structure is {got}, "
          f"expected {want}")
    chained = self._axes.chain_axis is not None
    leads = set()
    for g, w in zip(jax.tree_util.tree_leaves(state),
                    jax.tree_util.tree_leaves(self.template)):
      shape = np.shape(g)
      leads.add(shape[:1] if chained else ())
      if (shape[1:] if chained else shape) != np.shape(w) or (
          states.dtype_of(g) != states.dtype_of(w)):
        lead = "a leading chain axis and " if chained else ""
        raise TypeError(
            f"state does not belong to this pipeline: a field has shape "
            f"{shape} and dtype {states.dtype_of(g)}, expected {lead}shape "
            f"{np.shape(w)} and {states.dtype_of(w)}")
    if len(leads) > 1:
      raise TypeError(
          "the fields of a state of several chains must share their leading "
          f"(chain) axis, got leading axes {sorted(leads)}")
    states.check_fits(state, self.template, where)
    if not isinstance(state.pipeline, jax.core.Tracer):
      values, held = _local(state.pipeline)
      states.check_identity(values[held], self.id, where)
    # As a pipeline without a mesh checks them: a position past the cache
    # moved the chain to another chunk, a chain or chunk out of range
    # failed only inside the host callback.
    counters = ("chunk", "position", "cached_chunk")
    if not any(isinstance(getattr(state, name), jax.core.Tracer)
               for name in counters):
      held = {name: _local(getattr(state, name)) for name in counters}
      states.check_counters(state._replace(**{
          name: values[where_held] for name, (values, where_held)
          in held.items()}), self.template.mask.shape[0], where)
    if not isinstance(state.chain, jax.core.Tracer):
      values, held = _local(state.chain)
      states.check_chains(values[held], self.host, where)
    return state

  def scan_batches(self, f: Callable[..., Any], init: Any,
                   state: CacheState, xs: Any, length: int,
                   information: bool, device_count: int) -> Any:
    """The loop of :func:`jax_data.scan`: with one chain per state, each
    chunk's global batches scanned over as elements
    (:func:`jax_data.compiled.scan.chunked_scan`, each device fetching its
    part); with ``chain_axis``, ``batch_fn`` step by step."""
    if self._axes.chain_axis is not None:
      return super().scan_batches(f, init, state, xs, length, information,
                                  device_count)
    axes, local = self._axes, self._local
    specs, rows = axes.state_specs(), P(None, axes.batch_axis)
    own = lambda state: state._replace(chain=state.chain[0])
    fetched = jax.shard_map(
        on_mesh(axes.mesh,
                lambda state, chunk: local.fetch(own(state), chunk)),
        mesh=axes.mesh,
        in_specs=(specs, P()), out_specs=(rows, rows))

    def fetch(state, chunk, need):  # into fresh buffers: the cache stays
      del need  # every device's part fetched
      return fetched(state, chunk) + (state,)
    refresh = jax.shard_map(
        on_mesh(axes.mesh, lambda state: local.refresh(own(state))._replace(
            chain=state.chain)),
        mesh=axes.mesh, in_specs=(specs,), out_specs=specs)
    return scan_lib.chunked_scan(
        f, init, state, xs, length, information, 1, fetch=fetch,
        refresh=refresh, observation_count=self._count,
        mb_size=self._mb_size, plain=lambda: super(
            GlobalPipeline, self).scan_batches(f, init, state, xs, length,
                                               information, device_count))

  def saved_lanes(self, state: Any, where: str = "state_to_pytree"
                  ) -> Tuple[Tuple[int, ...], Dict[str, np.ndarray]]:
    """What a checkpoint saves: a lane per chain (``()`` without a chain
    axis), each with one of this process's part chains, whose position is
    the whole chain's (the checkpoint holds whole chains, so it restores
    on any mesh, and without one).

    Raises:
      TypeError, ValueError: not a state of this pipeline; this process
        holds no part of some chain (a chain axis across processes).
    """
    states.check_concrete(state, where)
    state = self.check_state(state, where)
    lead = np.shape(state.chunk)
    numbers, held = _local(state.chain)
    held = held.reshape(lead + (-1,))
    if not held.any(axis=-1).all():
      raise ValueError(
          "this process holds no part of some chains of the state (its "
          f"parts: {held.tolist()}): save a global state where every chain "
          "has a device in each process, or save each process's own chains "
          "from a pipeline without chain_axis")
    first = held.argmax(axis=-1)[..., None]
    numbers = np.take_along_axis(numbers.reshape(held.shape), first, -1)
    return lead, {"chain": numbers[..., 0],
                  **{f: _local(getattr(state, f))[0]
                     for f in ("chunk", "position", "key")}}

  def lanes_refused(self, count: int) -> str:
    if self._axes.chain_axis is None:
      return "" if count == 1 else (
          "a global pipeline without chain_axis restores one chain")
    devices = self._axes.chain_devices
    return "" if count % devices == 0 else (
        "a global pipeline with chain_axis restores chains whose number "
        f"the {devices} devices of the chain axis divide")

  def restore_lanes(self, saved: List[Dict[str, Any]],
                    arrays: Dict[str, np.ndarray], lanes: Tuple[int, ...],
                    chain: np.ndarray) -> CacheState:
    """A global state of the saved whole chains: this process registers
    the part chains of its devices, each at its chain's position."""
    del chain
    count = math.prod(lanes)
    refused = self.lanes_refused(count)
    if refused:
      enough = self._axes.chain_devices if self._axes.chain_axis else 1
      raise ValueError(
          f"the checkpoint's state has lanes {lanes}, which do not fit: "
          f"{refused}" + (
              "; pick them with lanes=[...]" if count >= enough else
              "; it holds fewer chains: restore it onto a mesh with "
              "fewer devices along the chain axis"))
    lanes = (count,) if self._axes.chain_axis is not None else ()
    arrays = {name: value.reshape(lanes + value.shape[value.ndim - (
        1 if name == "key" else 0):]) for name, value in arrays.items()}
    registered: List[int] = []
    chunks = arrays["chunk"].reshape(-1)

    def number(row: int, part: int) -> int:
      one = dict(saved[row], spec=dict(saved[row]["spec"], part={
          "index": part, "count": self._axes.parts}))
      registered.append(self.host.restore_chain(one, int(chunks[row])))
      return registered[-1]

    try:
      state = global_state(self._axes, self.template, lanes, number,
                           arrays["chunk"], arrays["position"], arrays["key"])
    except BaseException:
      for registered_number in registered:
        self.host.remove_chain(registered_number)
      raise
    # Numbered as init_fn's are (every process alike): a chain init_fn
    # makes next without a seed does not draw a restored chain's seed.
    with self._lock:
      for _ in range(math.prod(lanes)):
        next(self._numbers)
    return state

  def release_fn(self) -> None:
    """Drops every reference the pipeline holds to the loader."""
    self._local.release_fn()


def global_state(axes: MeshAxes, template: CacheState,
                 lead: Tuple[int, ...], number: Callable[[int, int], int],
                 chunk: np.ndarray, position: np.ndarray, key: np.ndarray
                 ) -> CacheState:
  """A global state of ``lead`` chains (``()``: one) at the given counters,
  with an empty cache, whose other fields are ``template``'s (one chain's,
  unsplit); ``number(row, part)`` registers the part chains of this
  process's devices (each once) and numbers them."""
  shardings = CacheState(*(NamedSharding(axes.mesh, spec)
                           for spec in axes.state_specs()))
  numbers: Dict[Tuple[int, int], int] = {}

  def chain(index):
    rows = np.arange(max(lead, default=1))[index[0]] if lead else [0]
    parts = np.arange(axes.parts)[index[-1]]
    for row, part in itertools.product(rows, parts):
      if (row, part) not in numbers:
        numbers[(row, part)] = number(int(row), int(part))
    table = np.array([[numbers[(row, part)] for part in parts]
                      for row in rows], np.int32)
    return table if lead else table[0]

  def global_array(value, sharding):
    return jax.make_array_from_callback(np.shape(value), sharding,
                                        lambda index: value[index])

  whole = lambda v: np.broadcast_to(np.asarray(v), lead + np.shape(v))
  fields = CacheState(
      pipeline=whole(template.pipeline), chain=None,
      chunk=chunk.astype(np.int32), position=position.astype(np.int32),
      cached_chunk=np.full(lead, -1, np.int32),
      batches=jax.tree_util.tree_map(whole, template.batches),
      mask=whole(template.mask), key=key.astype(np.uint32))
  return CacheState(*(
      jax.make_array_from_callback(lead + (axes.parts,), sharding,
                                   chain) if value is None else
      jax.tree_util.tree_map(
          functools.partial(global_array, sharding=sharding), value)
      for value, sharding in zip(fields, shardings)))


def _local(x: Any) -> Tuple[np.ndarray, np.ndarray]:
  """The value of ``x`` where this process holds it (its own shards of a
  global array), and where it does: ``(values, held)``, both of ``x``'s
  shape."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    value = np.asarray(x)
    return value, np.ones(value.shape, bool)
  values, held = np.zeros(x.shape, x.dtype), np.zeros(x.shape, bool)
  for shard in x.addressable_shards:
    values[shard.index] = np.asarray(shard.data)
    held[shard.index] = True
  return values, held


def _global_step(advance: Any, axes: MeshAxes):
  """The jitted global step: on every device, its part chain's step."""
  def one(state: CacheState):
    state, batch, mask = advance(state._replace(chain=state.chain[0]))
    return state._replace(chain=state.chain[None]), batch, mask

  def local(state: CacheState):
    return one(state) if axes.chain_axis is None else jax.vmap(one)(state)

  batch = axes.batch_spec()
  return jax.jit(jax.shard_map(on_mesh(axes.mesh, local), mesh=axes.mesh,
                               in_specs=(axes.state_specs(),),
                               out_specs=(axes.state_specs(), batch, batch)))
