"""A pipeline's chains on the host, and the chunks they produced.

A request names a chain and a chunk index; the answer is a pure function of
the two (``spec/CALLBACKS.md``, rule 1). A chunk asked for again (remat
replay, a state used twice, every device of a replicated ``pmap``) gets the
same data, and the chain never advances twice. Two things make that hold
with bounded memory:

* a few recent chunks per chain are kept, as futures, so that concurrent
  requests for one chunk wait for a single production; a chunk asked for
  with ``device_count=N`` stays until N requests took it, within a hard cap;
  the chunks of all chains together stay within a byte budget, least
  recently used first out, so memory does not grow with the number of
  chains created;
* the loader cursor's position is saved before each chunk, and the
  snapshots thin out logarithmically with age; a chunk no longer kept is
  produced again from the nearest earlier snapshot.

Only NumPy runs here; nothing calls JAX.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import threading
import warnings
from typing import Any
from typing import Callable
from typing import Dict
from typing import Hashable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data.chains import ChainCursor
from jax_data.chains import ChainSpec
from jax_data.chains import Chunk
from jax_data.chains import ChunkLayout
from jax_data.chains import Position
from jax_data.errors import HostLoaderError
from jax_data.errors import PipelineReleasedError
from jax_data.gather import BufferPool
from jax_data.host_loader import HostDataLoader

#: A chunk to produce: its chain, its index, the future its requests wait
#: on.
Job = Tuple["ChainRecord", int, concurrent.futures.Future]


def keep_snapshot(index: int, newest: int, recent: int) -> bool:
  """Whether the snapshot before chunk ``index`` survives thinning.

  All of the last ``recent`` are kept; older ones are kept at a spacing
  that doubles with age, so their number grows as ``log(newest)``.
  """
  age = newest - index
  if age < recent or index == 0:
    return True
  spacing = 1 << max(0, (age // recent).bit_length() - 1)
  return index % spacing == 0


@dataclasses.dataclass
class Entry:
  """A stored chunk and how many more requests are expected for it."""
  future: concurrent.futures.Future
  pending: Optional[int] = None  # None: produced ahead, not yet requested


@dataclasses.dataclass
class ChainRecord:
  """The host's bookkeeping of one chain.

  Attributes:
    number: The chain's number on its loader (``CacheState.chain``).
    spec: What it draws.
    cursor: The loader's cursor; it stands before chunk ``next_index``.
    snapshots: Chunk index -> the cursor's position before that chunk.
    next_index: The chunk the cursor produces next; None while unknown (a
      production failed half-way).
    chunks: Stored chunks by index, oldest first.
    produce_lock: Held while the cursor works.
    devices: The largest ``device_count`` a request for the chain named.
  """
  number: int
  spec: ChainSpec
  cursor: ChainCursor
  snapshots: Dict[int, Position]
  next_index: Optional[int]
  chunks: "collections.OrderedDict[int, Entry]" = dataclasses.field(
      default_factory=collections.OrderedDict)
  produce_lock: threading.Lock = dataclasses.field(
      default_factory=threading.Lock)
  pruned_size: int = 0
  devices: int = 1
  closed: bool = False
  keep: int = 2


class ChainStore:
  """The chains of one pipeline and their stored chunks.

  Args:
    loader: The host loader.
    layout: The chunks' arrays.
    name: The loader's repr, for messages.
    cycle: Chunks per pass of ordered chains whose requests wrap around
      (full-data passes); None for random chains.
    verify_calls: Warn when a chunk is produced again because a request
      came for one no longer stored (a state used twice).
    keep: Served chunks kept per chain besides the ``ahead`` produced ahead
      (none for chains whose cursors reach any chunk directly, counter-based
      streams: a chunk asked for again is produced again, as cheaply).
      Chunks still awaited by some of ``device_count`` devices are kept too,
      up to ``keep + ahead + 2 * device_count`` (at most ``max_stored``; the
      limits are the loader's :class:`~jax_data.host_loader.StoreLimits`).
  """

  def __init__(self, loader: HostDataLoader, layout: ChunkLayout, name: str,
               cycle: Optional[int] = None, verify_calls: bool = False,
               keep: int = 2):
    self._loader: Optional[HostDataLoader] = loader
    self.layout = layout
    self.name = name
    self.cycle = cycle
    self._verify_calls = verify_calls
    self._keep = keep
    self._limits = loader.store_limits
    self._records: Dict[int, ChainRecord] = {}
    self._lock = threading.Lock()
    self._buffers = BufferPool()
    # Every stored chunk, least recently used first: (chain, index) -> chain.
    self._stored: "collections.OrderedDict[Tuple[int, int], ChainRecord]" = (
        collections.OrderedDict())
    self._lanes = 1
    self._idle: List[ChainRecord] = []
    # Chains whose cursors hold something, least recently produced for
    # first: number -> bytes held; their sum; the most one chain held.
    self._held: "collections.OrderedDict[int, int]" = (
        collections.OrderedDict())
    self._held_total = 0
    self._held_most = 0

  # -- chains -------------------------------------------------------------

  @property
  def loader(self) -> HostDataLoader:
    loader = self._loader
    if loader is None:
      raise PipelineReleasedError(
          f"this pipeline over {self.name} was released by its release_fn; "
          "create a new pipeline to draw more data")
    return loader

  def add(self, spec: ChainSpec,
          snapshot: Optional[Tuple[int, Position]] = None) -> ChainRecord:
    """Adds a chain to the loader and to the store.

    Args:
      spec: The chain.
      snapshot: ``(index, position)``: the chain starts at the position
        saved before chunk ``index`` (a restored checkpoint); else at chunk
        0.

    Raises:
      ValueError: the loader refuses the spec or the position; nothing is
        added then.
    """
    number, spec, cursor = self.loader.add_chain(spec, self.layout)
    index = 0
    if snapshot is not None:
      index, position = snapshot
      try:
        cursor.seek(position)
      except BaseException:
        cursor.close()
        raise
    direct = cursor.position_at(index + 1) is not None
    record = ChainRecord(number, spec, cursor, {index: cursor.position()},
                         index, keep=0 if direct else self._keep)
    with self._lock:
      self._records[number] = record
    return record

  def numbers(self) -> List[int]:
    """The numbers of the chains in the store."""
    with self._lock:
      return sorted(self._records)

  def record(self, number: int) -> ChainRecord:
    """The chain ``number``; a clear error if this pipeline has none."""
    with self._lock:
      record = self._records.get(int(number))
    if record is None:
      _ = self.loader  # released pipelines say so
      raise ValueError(
          f"chain {int(number)} was not created by this pipeline's init_fn "
          f"(chains of this pipeline: {sorted(self._records)})")
    return record

  def remove(self, number: int) -> None:
    """Takes a chain out of the store and closes its cursor."""
    with self._lock:
      record = self._records.pop(int(number), None)
      if record is None:
        return
      self._held_total -= self._held.pop(record.number, 0)
      for index in list(record.chunks):
        self._drop(record, index)
    _close(record, blocking=True)

  def snapshot_before(self, record: ChainRecord, index: int
                      ) -> Tuple[int, Position]:
    """The newest snapshot at or before chunk ``index``: (its index,
    position)."""
    with record.produce_lock:
      base = max(i for i in record.snapshots if i <= index)
      return base, record.snapshots[base]

  def following(self, index: int) -> int:
    """The chunk requested after chunk ``index``."""
    following = index + 1
    return following if self.cycle is None else following % self.cycle

  # -- stored chunks ------------------------------------------------------

  def claim(self, record: ChainRecord, index: int, device_count: int
            ) -> Tuple[concurrent.futures.Future, bool]:
    """The future of chunk ``index`` for a request, and whether the caller
    must produce it (it was not stored)."""
    with self._lock:
      record.devices = max(record.devices, device_count)
      entry = record.chunks.get(index)
      if entry is not None:
        entry.pending = (device_count if entry.pending is None
                         else entry.pending) - 1
        record.chunks.move_to_end(index)
        self._stored.move_to_end((record.number, index))
        return entry.future, False
      self._store(record, index, Entry(concurrent.futures.Future(),
                                       device_count - 1))
      return record.chunks[index].future, True

  def claim_ahead(self, record: ChainRecord, index: int
                  ) -> Optional[concurrent.futures.Future]:
    """A future for producing chunk ``index`` before it is requested, or
    None if it is stored already."""
    with self._lock:
      if index in record.chunks:
        return None
      self._store(record, index, Entry(concurrent.futures.Future()))
      return record.chunks[index].future

  def forget(self, record: ChainRecord, index: int,
             future: concurrent.futures.Future) -> None:
    """Drops a failed chunk, so that a later request tries again."""
    with self._lock:
      entry = record.chunks.get(index)
      if entry is not None and entry.future is future:
        self._drop(record, index)

  def note_lanes(self, lanes: int) -> None:
    """A request asked for ``lanes`` chunks at once: the store keeps room
    for ``keep + ahead`` chunks per lane of the largest such request (the
    served ones kept and those produced ahead)."""
    self._lanes = max(self._lanes, lanes)

  def ahead(self) -> int:
    """Chunks produced ahead of each chain's requests: ``store_limits.
    ahead``, or fewer (at least one) where that many chunks for every lane
    of the largest request would pass ``store_bytes`` (1,024 vmapped
    chains, each chunk a large cache)."""
    limits = self._limits
    step = self._lanes * self.layout.nbytes
    return max(1, min(limits.ahead, limits.store_bytes // max(step, 1)))

  def reads_in_place(self, lanes: int) -> bool:
    """Whether a request of ``lanes`` chunks is read straight into compiled
    code's buffers, where its chains allow (:meth:`regenerates`), rather
    than produced ahead into the store's: when one chunk for every lane
    would pass ``store_bytes`` (hundreds of vmapped chains). Then nothing
    is kept between requests, and no chunk is copied once more."""
    return lanes * self.layout.nbytes > self._limits.store_bytes

  @staticmethod
  def regenerates(record: ChainRecord) -> bool:
    """Whether a chain's cursor reaches any chunk at once (a
    counter-based stream): its chunks need not be stored."""
    return record.keep == 0

  def holds(self, record: ChainRecord, index: int) -> bool:
    """Whether chunk ``index`` of a chain is stored or being produced."""
    with self._lock:
      return index in record.chunks

  def _store(self, record: ChainRecord, index: int, entry: Entry) -> None:
    """Stores an entry, then drops chunks beyond the bounds (with ``_lock``
    held)."""
    record.chunks[index] = entry
    self._stored[(record.number, index)] = record
    self._evict(record)
    self._evict_across_chains()

  def _drop(self, record: ChainRecord, index: int) -> None:
    del record.chunks[index]
    del self._stored[(record.number, index)]

  def _evict(self, record: ChainRecord) -> None:
    """Drops a chain's served chunks beyond its ``keep`` plus
    :meth:`ahead` (with ``_lock`` held). Chunks that some device has yet to
    take stay, up to the hard cap."""
    limits = self._limits
    kept = record.keep + self.ahead()
    cap = min(limits.max_stored, kept + 2 * record.devices)
    chunks = record.chunks
    while len(chunks) > kept:
      oldest, served, newest = None, None, next(reversed(chunks))
      for i, entry in chunks.items():  # oldest first
        if i == newest:
          break
        if oldest is None:
          oldest = i
        if entry.pending is not None and entry.pending <= 0:
          served = i
          break
      if served is not None:
        self._drop(record, served)
      elif len(chunks) > cap:
        self._drop(record, oldest)
      else:
        break

  def _evict_across_chains(self) -> None:
    """Drops the least recently used chunks of any chain while the store
    holds more than ``store_bytes``, or ``keep + ahead`` chunks per lane of
    the largest request if that is more (with ``_lock`` held). Chunks still
    being produced stay; a dropped chunk is produced again if asked for. A chain
    left with no chunk trims its cursor's caches."""
    limit = max(self._limits.store_bytes // max(self.layout.nbytes, 1),
                (self._keep + self._limits.ahead) * self._lanes)
    if len(self._stored) <= limit:
      return
    for number, index in list(self._stored):
      if len(self._stored) <= limit:
        break
      record = self._stored[(number, index)]
      if not record.chunks[index].future.done():
        continue
      self._drop(record, index)
      if not record.chunks:
        self._idle.append(record)

  def trim_idle(self) -> None:
    """Trims the cursors of chains whose chunks were all dropped for room,
    then those of the chains produced for least recently while all cursors
    hold more than the budget (see ``held_requests``); a cursor that is
    producing is passed over. Housekeeping: producing never trims, and the
    host calls this once a request has its chunks, in its prefetch thread
    (trimming may drop a ``tf.data`` iterator of another chain)."""
    with self._lock:
      idle, self._idle = self._idle, []
    for record in idle:
      if record.produce_lock.acquire(blocking=False):
        try:
          if not record.chunks and not record.closed:
            record.cursor.trim()
            self._note_held(record.number, record.cursor.held_bytes())
        finally:
          record.produce_lock.release()
    self._trim_held()

  # -- production ---------------------------------------------------------

  def produce_into(self, record: ChainRecord, index: int,
                   future: concurrent.futures.Future,
                   out: Optional[Chunk] = None) -> None:
    """Produces chunk ``index`` (into ``out`` if given, see
    :meth:`produce_many`) and sets ``future`` to it, or to the failure
    (named :class:`HostLoaderError`); a future that release failed
    meanwhile keeps its answer."""
    try:
      chunk = self._produce(record, index, out)
    except BaseException as e:  # every failure reaches the waiting request
      settle(future, error=self._wrap(record, index, e))
    else:
      settle(future, chunk)

  def produce_many(self, jobs: Sequence[Job],
                   into: Optional[Dict[int, Chunk]] = None) -> None:
    """Produces the chunks ``(chain, index, future)`` of ``jobs`` and
    settles their futures as :meth:`produce_into` does. The chains whose
    cursors share a :meth:`~jax_data.chains.ChainCursor.group_key` are
    produced together, in one :meth:`~jax_data.chains.ChainCursor.
    produce_group` call (the vmapped chains of one request); the others
    one by one.

    ``into`` maps a job's future (by ``id``) to the buffers its chunk is
    written into (compiled code's own, see :meth:`reads_in_place`) instead
    of the store's: a group whose buffers follow each other in memory, in
    chain order, is read into them in one piece. Such chunks are not
    stored."""
    groups: Dict[Hashable, List[Job]] = {}
    alone: List[Job] = []
    grouped = set()
    for job in jobs:
      key = job[0].cursor.group_key()
      if key is None or job[0].number in grouped:
        alone.append(job)  # a chain twice: its second chunk after
      else:
        grouped.add(job[0].number)
        groups.setdefault(key, []).append(job)
    into = into or {}
    for group in groups.values():
      if len(group) > 1:
        alone.extend(self._produce_group(group, into))
      else:
        alone.extend(group)
    for record, index, future in alone:
      self.produce_into(record, index, future, into.get(id(future)))

  def _produce_group(self, group: List[Job], into: Dict[int, Chunk]
                     ) -> List[Job]:
    """Produces a group's chunks in one call (with every chain's
    ``produce_lock`` held, taken in chain order); returns the jobs left to
    produce one by one (chains closed meanwhile, cursors that cannot
    seek directly)."""
    try:
      _ = self.loader  # not after release
    except PipelineReleasedError as e:
      for _, _, future in group:
        settle(future, error=e)
      return []
    group = sorted(group, key=lambda job: job[0].number)
    locked, ready, left = [], [], []
    try:
      for record, index, future in group:
        record.produce_lock.acquire()
        locked.append(record)
        try:
          stands = not record.closed and _stand_at(record, index)
        except BaseException as e:  # a seek refused: this chain's failure
          settle(future, error=self._wrap(record, index, e))
          continue
        (ready if stands else left).append((record, index, future))
      if ready:
        self._produce_ready(ready, into)
    finally:
      for record in locked:
        record.produce_lock.release()
      if self._loader is None:  # released while producing
        for record in locked:
          _close(record, blocking=True)
    return left

  def _produce_ready(self, ready: List[Job], into: Dict[int, Chunk]
                     ) -> None:
    """:meth:`_produce_group` once each cursor stands at its chunk."""
    cursors = [record.cursor for record, _, _ in ready]
    allocate = self._buffers.empty
    targets = [into.get(id(future)) for _, _, future in ready]
    if all(target is not None for target in targets):
      allocate = _Regions(targets, allocate)
    try:
      for record, index, _ in ready:
        if index not in record.snapshots:
          record.snapshots[index] = record.cursor.position()
        record.next_index = None  # unknown until the cursors return
      chunks = type(cursors[0]).produce_group(
          cursors, [index for _, index, _ in ready], self.layout, allocate)
      chunks = [self.layout.check(chunk) for chunk in chunks]
    except BaseException as e:  # every failure reaches the waiting requests
      for record, index, future in ready:
        settle(future, error=self._wrap(record, index, e))
      return
    for (record, index, future), chunk in zip(ready, chunks):
      record.next_index = index + 1
      self._thin(record)
      self._note_held(record.number, record.cursor.held_bytes())
      settle(future, chunk)

  def _wrap(self, record: ChainRecord, index: int, e: BaseException):
    if isinstance(e, (HostLoaderError, PipelineReleasedError)):
      return e
    error = HostLoaderError(
        f"{self.name}, chain {record.number}, chunk {index}: "
        f"{type(e).__name__}: {e}")
    error.__cause__ = e
    return error

  def _produce(self, record: ChainRecord, index: int,
               out: Optional[Chunk] = None) -> Chunk:
    _ = self.loader  # not after release
    try:
      with record.produce_lock:
        chunk = self._produce_locked(record, index, out)
        self._note_held(record.number, record.cursor.held_bytes())
    finally:
      if self._loader is None:  # released while producing
        _close(record, blocking=True)
    return chunk  # no trimming here: see trim_idle

  def _note_held(self, number: int, held: int) -> None:
    """Notes what chain ``number``'s cursor holds after producing for it
    (with its ``produce_lock`` held)."""
    with self._lock:
      self._held_total -= self._held.pop(number, 0)
      if held and number in self._records:
        self._held[number] = held
        self._held_total += held
        self._held_most = max(self._held_most, held)

  def _trim_held(self) -> None:
    """Trims the cursors of the chains produced for least recently while
    the cursors of all chains hold more than the budget (see
    ``held_requests``). A cursor that is producing is passed over; the
    chains of the last request never are trimmed."""
    with self._lock:
      protected = max(self._lanes, 1)
      limit = max(self._limits.store_bytes,
                  self._limits.held_requests * protected * self._held_most)
      if self._held_total <= limit:
        return
      excess = self._held_total - limit
      candidates = []
      for number, held in list(self._held.items())[:-protected]:
        if excess <= 0:
          break
        candidates.append(self._records[number])
        excess -= held
    for record in candidates:
      if not record.produce_lock.acquire(blocking=False):
        continue
      try:
        if not record.closed:
          record.cursor.trim()
          self._note_held(record.number, record.cursor.held_bytes())
      finally:
        record.produce_lock.release()

  def _produce_locked(self, record: ChainRecord, index: int,
                      out: Optional[Chunk] = None) -> Chunk:
    """Produces chunk ``index`` (with the chain's ``produce_lock`` held),
    moving the cursor back to a snapshot first if it stands elsewhere;
    into ``out`` if given."""
    cursor = record.cursor
    direct = (None if record.next_index == index
              else cursor.position_at(index))
    if direct is not None:  # a counter-based stream: no replay
      record.next_index = None
      cursor.seek(direct)
      record.next_index = index
    if record.next_index != index:
      base = max(i for i in record.snapshots if i <= index)
      if index - base > self._limits.max_replay:
        raise ValueError(
            f"chunk {index} of chain {record.number} is {index - base} "
            f"chunks past its nearest snapshot (chunk {base}), more than "
            f"the {self._limits.max_replay} a request may replay; the "
            "state's chunk counter does not come from this chain")
      if self._verify_calls and record.next_index is not None:
        warnings.warn(
            f"{self.name}, chain {record.number}: chunk {index} was "
            f"requested again after chunk {record.next_index - 1}; "
            f"replaying from chunk {base}", stacklevel=2)
      record.next_index = None
      cursor.seek(record.snapshots[base])
      record.next_index = base
    while True:
      current = record.next_index
      if current not in record.snapshots:
        record.snapshots[current] = cursor.position()
      record.next_index = None  # unknown until the cursor returns
      chunk = cursor.produce(current, out if out is not None and (
          current == index) else self.layout.new_chunk(self._buffers.empty))
      record.next_index = current + 1
      self._thin(record)
      if current == index:
        return self.layout.check(chunk)

  def _thin(self, record: ChainRecord) -> None:
    recent = self._limits.recent_snapshots
    if len(record.snapshots) <= 2 * record.pruned_size + recent:
      return
    newest = max(record.snapshots)
    record.snapshots = {i: s for i, s in record.snapshots.items()
                        if keep_snapshot(i, newest,
                                         self._limits.recent_snapshots)}
    record.pruned_size = len(record.snapshots)

  # -- release ------------------------------------------------------------

  def release(self, error: BaseException) -> None:
    """Drops the loader and every chain: requests still waiting for a chunk
    get ``error``, and cursors are cancelled and closed (a cursor that is
    producing stops soon and closes when it is done). Idempotent; does not
    wait for a production."""
    with self._lock:
      self._loader = None
      records, self._records = list(self._records.values()), {}
      waiting = [entry.future for record in records
                 for entry in record.chunks.values()]
      for record in records:
        record.chunks.clear()
      self._stored.clear()
      self._held.clear()
      self._held_total = 0
    for future in waiting:
      settle(future, error=error)
    for record in records:
      record.cursor.cancel()  # a production stops soon, and raises
      _close(record, blocking=False)  # if producing, it closes when done


class _Regions:
  """The ``allocate`` of a group produced into given chunks (see
  :meth:`ChainStore.produce_many`): a group's cursors ask for one buffer
  per leaf for all their rows, in leaf order; where the given chunks'
  leaves follow each other in memory, in the group's order, that buffer is
  the span of them, so the rows land in place. Other requests get
  ``fallback``'s buffers."""

  def __init__(self, chunks: Sequence[Chunk],
               fallback: Callable[..., np.ndarray]):
    self._spans = [_span([chunk.leaves[k] for chunk in chunks])
                   for k in range(len(chunks[0].leaves))]
    self._next = 0
    self._fallback = fallback

  def __call__(self, shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
    k, self._next = self._next, self._next + 1
    span = self._spans[k] if k < len(self._spans) else None
    if span is not None and span.size == math.prod(shape) and (
        span.dtype == np.dtype(dtype)):
      return span.reshape(shape)  # a view: the span is contiguous
    return self._fallback(shape, dtype)


def _span(arrays: Sequence[np.ndarray]) -> Optional[np.ndarray]:
  """One writable array over ``arrays`` (C-contiguous, alike, each
  starting where the one before ends), stacked on a new leading axis; None
  if they are not laid out so."""
  first = arrays[0]
  if not all(a.flags.c_contiguous and a.flags.writeable
             and a.shape == first.shape and a.dtype == first.dtype
             for a in arrays):
    return None
  start = first.__array_interface__["data"][0]
  if any(a.__array_interface__["data"][0] != start + g * first.nbytes
         for g, a in enumerate(arrays)):
    return None
  return np.lib.stride_tricks.as_strided(
      first, (len(arrays),) + first.shape, (first.nbytes,) + first.strides,
      writeable=True)


def _close(record: ChainRecord, blocking: bool) -> None:
  """Closes a chain's cursor once, unless it is producing and ``blocking``
  is False."""
  if not record.produce_lock.acquire(blocking=blocking):
    return
  try:
    if not record.closed:
      record.closed = True
      record.cursor.close()
  finally:
    record.produce_lock.release()


def _stand_at(record: ChainRecord, index: int) -> bool:
  """Moves a chain's cursor to chunk ``index`` if it can seek there
  directly (a counter-based stream), with its ``produce_lock`` held;
  whether it stands there."""
  if record.next_index == index:
    return True
  direct = record.cursor.position_at(index)
  if direct is None:
    return False
  record.next_index = None
  record.cursor.seek(direct)
  record.next_index = index
  return True


def settle(future: concurrent.futures.Future, result: Any = None,
           error: Optional[BaseException] = None) -> None:
  """Sets a future's result or error, unless it has one already."""
  try:
    if error is not None:
      future.set_exception(error)
    else:
      future.set_result(result)
  except concurrent.futures.InvalidStateError:
    pass

