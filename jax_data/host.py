"""Host side of the bridge: answers chunk requests from compiled code.

A request names a chain and a chunk index. The answer is a pure function of
the two (``spec/CALLBACKS.md``, rule 1): a request that comes again (remat
replay, a state used twice, every device of a replicated ``pmap``) gets the
same data and never advances the chain twice. Three pieces make this hold
with bounded memory:

* a small store of recent chunks per chain (futures, so concurrent requests
  for one chunk wait for a single production); a chunk asked for with
  ``device_count=N`` stays until N requests took it, within a hard cap;
* snapshots of the loader chain's position (``save_state``) taken before each
  chunk and thinned out logarithmically with age; a request for a chunk that
  is no longer stored restores the nearest earlier snapshot and replays;
* a background thread that produces the next chunk while the device consumes
  the current one.

Only NumPy runs here; nothing calls JAX.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import warnings
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data.loader import HostDataLoader

Leaves = List[np.ndarray]

# Snapshots newer than this many chunks are all kept; older ones thin out to
# about this many per doubling of age.
_RECENT_SNAPSHOTS = 16
# Hard limit of stored chunks per chain, whatever device_count says.
_MAX_STORED = 32
# Seconds the devices of one refresh wait for each other (see serve).
_ROUND_TIMEOUT = 10.0


@dataclasses.dataclass
class _Round:
  """The requests of one refresh made by several devices."""
  expected: int
  arrived: int = 0
  error: Optional[BaseException] = None
  done: bool = False


class HostLoaderError(RuntimeError):
  """A host loader failed while producing a chunk for compiled code."""


class PipelineReleasedError(RuntimeError):
  """A released pipeline was used."""


@dataclasses.dataclass
class _Entry:
  """A stored chunk and how many more requests are expected for it."""
  future: concurrent.futures.Future
  pending: Optional[int] = None  # None: prefetched, not yet requested


@dataclasses.dataclass
class _ChainRecord:
  """The bridge's bookkeeping for one chain."""
  chain_id: int
  kind: str  # "random" or "ordered"
  registration: Dict[str, Any]  # keywords that re-create the chain
  cycle: Optional[int]  # chunks per pass when requests wrap around
  snapshots: Dict[int, Any]  # chunk index -> loader state before it
  next_index: Optional[int]  # chunk the loader chain produces next
  chunks: "collections.OrderedDict[int, _Entry]"
  produce_lock: threading.Lock = dataclasses.field(
      default_factory=threading.Lock)
  pruned_size: int = 0
  devices: int = 1  # largest device_count a request for this chain named
  progress: Optional[Callable[[int], None]] = None  # told each chunk asked


def keep_snapshot(index: int, newest: int) -> bool:
  """Whether the snapshot before chunk ``index`` survives thinning.

  All of the last ``_RECENT_SNAPSHOTS`` are kept; older ones are kept at a
  spacing that doubles with age, so their number grows as ``log(newest)``.
  """
  age = newest - index
  if age < _RECENT_SNAPSHOTS or index == 0:
    return True
  spacing = 1 << max(0, (age // _RECENT_SNAPSHOTS).bit_length() - 1)
  return index % spacing == 0


class ChunkServer:
  """Serves chunks of one pipeline's chains to compiled code.

  Args:
    loader: The host loader.
    cache_size: Batches per chunk.
    mb_size: Observations per batch.
    leaf_formats: ``(shape, dtype)`` of each flattened batch leaf, with the
      leading ``(cache_size, mb_size)`` axes, in the order compiled code
      expects them.
    flatten: Turns a batch pytree of NumPy arrays into that list of leaves.
    prefetch: Produce the next chunk in a background thread.
    verify_calls: Warn when a request replays a chunk that is no longer
      stored (a state used twice), which costs regeneration.
    keep: Served chunks kept per chain besides the prefetched one. Chunks
      still awaited by some of ``device_count`` devices are kept too, up to
      ``keep + 1 + 2 * device_count`` (at most ``_MAX_STORED``) per chain.
  """

  def __init__(self, loader: HostDataLoader, cache_size: int, mb_size: int,
               leaf_formats: Sequence[Tuple[Tuple[int, ...], np.dtype]],
               flatten, prefetch: bool = True, verify_calls: bool = False,
               keep: int = 2):
    self._loader: Optional[HostDataLoader] = loader
    self._name = repr(loader)
    self.cache_size = cache_size
    self.mb_size = mb_size
    self._leaf_formats = [(tuple(s), np.dtype(d)) for s, d in leaf_formats]
    self._flatten = flatten
    self._verify_calls = verify_calls
    self._keep = keep
    self._records: Dict[int, _ChainRecord] = {}
    self._lock = threading.Lock()
    self._executor = (concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="jax_data-prefetch")
                      if prefetch else None)
    self._zeros: Optional[Leaves] = None
    self.requests = 0  # host calls served, for tests and diagnostics
    self._rounds: Dict[Tuple[int, int], _Round] = {}
    self._rounds_changed = threading.Condition(self._lock)
    self._rounds_enabled = True

  # -- chains -------------------------------------------------------------

  @property
  def loader(self) -> HostDataLoader:
    if self._loader is None:
      raise PipelineReleasedError(
          f"this pipeline over {self._name} was released by its release_fn; "
          "create a new pipeline to draw more data")
    return self._loader

  def check_open(self) -> None:
    """Raises :class:`PipelineReleasedError` if the pipeline was released."""
    _ = self.loader

  def register(self, kind: str, cycle: Optional[int] = None,
               progress: Optional[Callable[[int], None]] = None,
               **kwargs: Any) -> int:
    """Registers a chain on the loader and returns its id.

    ``progress(chunk)``, if given, is called on the host whenever compiled
    code asks for a chunk of this chain.
    """
    loader = self.loader
    if kind == "random":
      chain_id = loader.register_random_pipeline(
          cache_size=self.cache_size, mb_size=self.mb_size, **kwargs)
    else:
      chain_id = loader.register_ordered_pipeline(
          cache_size=self.cache_size, mb_size=self.mb_size, **kwargs)
    registration = dict(kwargs)
    fingerprint = loader.chain_fingerprint(chain_id)
    if "seed" in fingerprint:  # a default seed is resolved once, for good
      registration["seed"] = fingerprint["seed"]
    record = _ChainRecord(chain_id, kind, registration, cycle,
                          {0: loader.save_state(chain_id)}, 0,
                          collections.OrderedDict(), progress=progress)
    with self._lock:
      self._records[chain_id] = record
    return chain_id

  def record(self, chain_id: int) -> _ChainRecord:
    with self._lock:
      record = self._records.get(int(chain_id))
    if record is None:
      self.check_open()
      raise ValueError(
          f"chain {int(chain_id)} was not created by this pipeline's init_fn "
          f"(chains of this pipeline: {sorted(self._records)})")
    return record

  def snapshot_before(self, chain_id: int, index: int) -> Tuple[int, Any]:
    """The newest snapshot at or before chunk ``index``: (its index, state)."""
    record = self.record(chain_id)
    with record.produce_lock:
      base = max(i for i in record.snapshots if i <= index)
      return base, record.snapshots[base]

  def adopt_snapshot(self, chain_id: int, index: int, state: Any) -> None:
    """Adds a snapshot taken elsewhere (a checkpoint) to a chain."""
    record = self.record(chain_id)
    with record.produce_lock:
      record.snapshots[int(index)] = state

  # -- serving ------------------------------------------------------------

  def chunk(self, chain_id: int, index: int, device_count: int = 1,
            defer: Optional[List[Tuple[_ChainRecord, int]]] = None
            ) -> Tuple[Leaves, np.ndarray]:
    """Chunk ``index`` of a chain: flattened batch leaves and mask.

    ``device_count`` requests are expected for the chunk (one per device of
    a replicated state); it is kept until they all came, within the cap.

    The production of the next chunk starts now, or, if ``defer`` is a list
    and the chunk was ready when asked for (the device, not the host, sets
    the pace), is appended to ``defer`` for the caller to start once it has
    copied this chunk, so that the copy does not compete with it.
    """
    record = self.record(chain_id)
    if record.progress is not None:
      record.progress(index)
    future, produce = self._future(record, index, device_count)
    ready = future.done()
    if produce:
      self._produce_into(record, index, future)
    try:
      result = future.result()
    except HostLoaderError:
      with self._lock:
        entry = record.chunks.get(index)
        if entry is not None and entry.future is future:
          del record.chunks[index]  # a later request tries again
      raise
    if ready and defer is not None:
      defer.append((record, index))
    else:
      self.schedule_next(record, index)
    return result

  def _future(self, record: _ChainRecord, index: int, device_count: int):
    with self._lock:
      record.devices = max(record.devices, device_count)
      entry = record.chunks.get(index)
      if entry is not None:
        entry.pending = (device_count if entry.pending is None
                         else entry.pending) - 1
        record.chunks.move_to_end(index)
        return entry.future, False
      entry = _Entry(concurrent.futures.Future(), device_count - 1)
      record.chunks[index] = entry
      self._evict(record)
      return entry.future, True

  def _evict(self, record: _ChainRecord) -> None:
    """Drops served chunks beyond ``keep + 1`` (with ``_lock`` held).

    Chunks that some device has yet to take stay, up to the hard cap.
    """
    cap = min(_MAX_STORED, self._keep + 1 + 2 * record.devices)
    while len(record.chunks) > self._keep + 1:
      indices = list(record.chunks)[:-1]  # never the newest
      served = [i for i in indices if record.chunks[i].pending is not None
                and record.chunks[i].pending <= 0]
      if served:
        record.chunks.pop(served[0])
      elif len(record.chunks) > cap:
        record.chunks.pop(indices[0])
      else:
        break

  def schedule_next(self, record: _ChainRecord, index: int) -> None:
    """Starts producing the chunk after ``index`` in the background."""
    if self._executor is None or self._loader is None:
      return
    following = index + 1
    if record.cycle is not None:
      following %= record.cycle
    with self._lock:
      if following in record.chunks:
        return
      future = concurrent.futures.Future()
      record.chunks[following] = _Entry(future)
      self._evict(record)
    try:
      self._executor.submit(self._produce_into, record, following, future)
    except RuntimeError:  # the executor is shut down (release, exit)
      self._produce_into(record, following, future)

  def _produce_into(self, record: _ChainRecord, index: int,
                    future: concurrent.futures.Future) -> None:
    try:
      future.set_result(self._produce(record, index))
    except BaseException as e:  # every failure reaches the waiting request
      future.set_exception(self._wrap(record, index, e))

  def _wrap(self, record: _ChainRecord, index: int, e: BaseException):
    if isinstance(e, (HostLoaderError, PipelineReleasedError)):
      return e
    error = HostLoaderError(
        f"{self._name}, chain {record.chain_id}, chunk {index}: "
        f"{type(e).__name__}: {e}")
    error.__cause__ = e
    return error

  def _produce(self, record: _ChainRecord, index: int
               ) -> Tuple[Leaves, np.ndarray]:
    loader = self.loader
    with record.produce_lock:
      if record.next_index != index:
        base = max(i for i in record.snapshots if i <= index)
        if self._verify_calls and record.next_index is not None:
          warnings.warn(
              f"{self._name}, chain {record.chain_id}: chunk {index} was "
              f"requested again after chunk {record.next_index - 1}; "
              f"replaying from chunk {base}", stacklevel=2)
        loader.load_state(record.chain_id, record.snapshots[base])
        record.next_index = base
      while True:
        current = record.next_index
        if current not in record.snapshots:
          record.snapshots[current] = loader.save_state(record.chain_id)
        record.next_index = None  # unknown until get_batches returns
        batches, mask = loader.get_batches(record.chain_id)
        record.next_index = current + 1
        self._thin(record)
        if current == index:
          return self._check(record, batches, mask)

  def _thin(self, record: _ChainRecord) -> None:
    if len(record.snapshots) <= 2 * record.pruned_size + _RECENT_SNAPSHOTS:
      return
    newest = max(record.snapshots)
    record.snapshots = {i: s for i, s in record.snapshots.items()
                        if keep_snapshot(i, newest)}
    record.pruned_size = len(record.snapshots)

  def _check(self, record: _ChainRecord, batches: Any,
             mask: Optional[np.ndarray]) -> Tuple[Leaves, np.ndarray]:
    """Flattens a chunk and checks it against the pipeline's format."""
    leaves = self._flatten(batches)
    if len(leaves) != len(self._leaf_formats):
      raise ValueError(
          f"get_batches returned {len(leaves)} arrays, expected "
          f"{len(self._leaf_formats)} as in the loader's observation_format")
    checked = []
    for leaf, (shape, dtype) in zip(leaves, self._leaf_formats):
      leaf = np.asarray(leaf)
      if leaf.shape != shape:
        raise ValueError(
            f"get_batches returned an array of shape {leaf.shape}, expected "
            f"{shape} (cache_size, mb_size, ...)")
      checked.append(leaf if leaf.dtype == dtype else leaf.astype(dtype))
    shape = (self.cache_size, self.mb_size)
    if mask is None:
      mask = np.ones(shape, bool)
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != shape:
      raise ValueError(f"get_batches returned a mask of shape {mask.shape}, "
                       f"expected {shape}")
    return checked, mask

  def serve(self, chains: np.ndarray, chunks: np.ndarray, need: np.ndarray,
            device_count: int = 1, participants: int = 1
            ) -> Tuple[np.ndarray, ...]:
    """The callback body: chunks for ``L`` lanes, stacked on a leading axis.

    Lanes whose ``need`` is False get zeros; compiled code keeps their cache.
    See :meth:`lanes` for the arguments.
    """
    lanes = self.lanes(chains, chunks, need, device_count, participants)
    if len(lanes) == 1:
      leaves, mask = lanes[0]
      return tuple(leaf[None] for leaf in leaves) + (mask[None],)
    stacked = [np.stack([lane[0][i] for lane in lanes])
               for i in range(len(self._leaf_formats))]
    return tuple(stacked) + (np.stack([lane[1] for lane in lanes]),)

  def serve_into(self, outs: Sequence[np.ndarray], chains: np.ndarray,
                 chunks: np.ndarray, need: np.ndarray, device_count: int = 1,
                 participants: int = 1) -> None:
    """Like :meth:`serve`, but copies the lanes into ``outs`` (compiled
    code's own output buffers, a leading lane axis each): one copy per lane,
    made by NumPy without holding the GIL, so the prefetch thread runs
    meanwhile. When the chunks were ready before they were asked for, the
    next ones are produced after the copy, not during it (see
    :meth:`chunk`): the copy holds up the device, the production does not.
    """
    deferred: List[Tuple[_ChainRecord, int]] = []
    try:
      lanes = self.lanes(chains, chunks, need, device_count, participants,
                         deferred)
      for lane, (leaves, mask) in enumerate(lanes):
        for out, leaf in zip(outs, list(leaves) + [mask]):
          np.copyto(out[lane], leaf)
    finally:
      for record, index in deferred:
        self.schedule_next(record, index)

  def lanes(self, chains: np.ndarray, chunks: np.ndarray, need: np.ndarray,
            device_count: int = 1, participants: int = 1,
            defer: Optional[List[Tuple[_ChainRecord, int]]] = None
            ) -> List[Tuple[Leaves, np.ndarray]]:
    """The chunk (leaves, mask) of each of ``L`` lanes (``defer``: see
    :meth:`chunk`).

    Lanes whose ``need`` is False get zeros; compiled code keeps their cache.

    With ``participants > 1`` the request is one of several that devices
    make for the same refresh. A failure must then reach every one of them:
    a device that raised while the others go on to a collective would leave
    them waiting, and XLA aborts the process. So the participants meet here
    and, if one failed, all raise the failure.
    """
    chains = np.asarray(chains).reshape(-1)
    chunks = np.asarray(chunks).reshape(-1)
    need = np.asarray(need).reshape(-1)
    self.requests += 1
    lanes, error = [], None
    try:
      for chain, index, wanted in zip(chains, chunks, need):
        lanes.append(self.chunk(int(chain), int(index), device_count, defer)
                     if wanted else self._zero_chunk())
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if participants > 1 and need.any():
      error = self._meet(int(chunks[need].min()), participants, error)
    if error is not None:
      raise error
    return lanes

  def _meet(self, index: int, participants: int,
            error: Optional[BaseException]) -> Optional[BaseException]:
    """Waits for the other devices' requests of this refresh; returns the
    failure of any of them."""
    with self._lock:
      if not self._rounds_enabled:
        return error
      key = (index, participants)
      current = self._rounds.setdefault(key, _Round(participants))
      current.arrived += 1
      current.error = current.error or error
      if current.arrived >= current.expected:
        current.done = True
        del self._rounds[key]
        self._rounds_changed.notify_all()
      elif not self._rounds_changed.wait_for(lambda: current.done,
                                              _ROUND_TIMEOUT):
        self._rounds_enabled = False
        self._rounds.pop(key, None)
        warnings.warn(
            f"{self._name}: {participants} devices were expected to request "
            f"chunk {index} together, but {current.arrived} did within "
            f"{_ROUND_TIMEOUT:.0f} s; check device_count. Devices no longer "
            "wait for each other, so a loader failure on one device may "
            "leave the others waiting in a collective.", stacklevel=2)
      return current.error

  def _zero_chunk(self) -> Tuple[Leaves, np.ndarray]:
    if self._zeros is None:
      self._zeros = [np.zeros(s, d) for s, d in self._leaf_formats]
    return self._zeros, np.zeros((self.cache_size, self.mb_size), bool)

  # -- release ------------------------------------------------------------

  def release(self) -> None:
    """Drops the loader and every stored chunk; idempotent."""
    with self._lock:
      loader, self._loader = self._loader, None
      records, self._records = self._records, {}
    if self._executor is not None:
      self._executor.shutdown(wait=True, cancel_futures=True)
    if loader is not None:
      for chain_id in records:
        loader.release_chain(chain_id)
    self._zeros = None
