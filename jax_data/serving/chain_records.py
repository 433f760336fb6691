"""The host's bookkeeping of a pipeline's chains.

A :class:`ChainRecord` is one chain of a pipeline on the host: its spec, its
loader cursor, the snapshots of the cursor's position and the chunks kept
for it (futures, so that concurrent requests for one chunk wait for a single
production). The :class:`Shelf` holds the chunks of all chains within their
bounds, and the :class:`ChainTable` the chains by number.

Only NumPy runs here; nothing calls JAX.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from jax_data.errors import CheckpointError
from jax_data.errors import PipelineReleasedError
from jax_data.loaders.chains import UNPORTABLE
from jax_data.loaders.chains import UNSAVED
from jax_data.loaders.chains import ChainCursor
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import Position
from jax_data.loaders.chains import RandomChain
from jax_data.loaders.chains import spec_from_json
from jax_data.loaders.chains import spec_to_json
from jax_data.loaders.host_loader import HostDataLoader
from jax_data.loaders.host_loader import StoreLimits
from jax_data.validation import check_int

#: A chunk to produce: its chain, its index, the future its requests wait
#: on (a :class:`StoredFuture` or an :class:`Answer`).
Job = Tuple["ChainRecord", int, Any]


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


class Answer:
  """The future of a chunk that the requesting thread produces itself (read
  straight into compiled code's buffers, see ``ChainStore.chunks``): no
  other thread waits for it, so it needs no lock, and asked before it has
  an answer it raises ``InvalidStateError``. A
  ``concurrent.futures.Future`` makes a condition variable, 1,024 of them
  per refresh of 1,024 lanes."""

  __slots__ = ("_settled", "_value", "_error")

  def __init__(self):
    self._settled = False
    self._value: Any = None
    self._error: Optional[BaseException] = None

  def done(self) -> bool:
    return self._settled

  def set_result(self, value: Any) -> None:
    self._settle(value, None)

  def set_exception(self, error: BaseException) -> None:
    self._settle(None, error)

  def exception(self) -> Optional[BaseException]:
    """Its error (None if it has a result), once it has either."""
    self._wait()
    return self._error

  def result(self) -> Any:
    """Its result once it has one, or raises its error."""
    self._wait()
    if self._error is not None:
      raise self._error
    return self._value

  def _settle(self, value: Any, error: Optional[BaseException]) -> None:
    if self._settled:
      raise concurrent.futures.InvalidStateError("the chunk has an answer")
    # Settled last: nothing reads the answer of an unsettled future.
    self._value, self._error, self._settled = value, error, True

  def _wait(self) -> None:
    if not self._settled:
      raise concurrent.futures.InvalidStateError("the chunk has no answer")


class StoredFuture(Answer):
  """The future of a stored chunk, which requests in other threads may
  wait for. The futures of one :class:`Shelf` share its condition
  variable: a ``concurrent.futures.Future`` makes one of its own, ten
  objects for the garbage collector (a condition, its lock and deque,
  their bound methods), 10,000 per refresh of 1,024 lanes. Their full
  collections, over the ~500,000 objects of a process that imported
  TensorFlow, took 145 ms each, 2.3 s of a 13 s run of 1,024 vmapped
  chains."""

  __slots__ = ("_changed", "_waited")

  def __init__(self, changed: threading.Condition):
    super().__init__()
    self._changed = changed
    self._waited = False  # a thread waits, or waited, for its answer

  def _settle(self, value: Any, error: Optional[BaseException]) -> None:
    with self._changed:
      super()._settle(value, error)
      if self._waited:  # most are answered before anyone asks
        self._changed.notify_all()

  def _wait(self) -> None:
    if not self._settled:
      with self._changed:
        while not self._settled:
          self._waited = True
          self._changed.wait()


def settle(future: Any, result: Any = None,
           error: Optional[BaseException] = None) -> None:
  """Sets a future's result or error, unless it has one already."""
  try:
    if error is not None:
      future.set_exception(error)
    else:
      future.set_result(result)
  except concurrent.futures.InvalidStateError:
    pass


@dataclasses.dataclass(slots=True)
class Entry:
  """A stored chunk and how many more requests are expected for it."""
  future: StoredFuture
  pending: Optional[int] = None  # None: produced ahead, not yet requested
  ahead: bool = False  # produced ahead of any request (claim_ahead)


@dataclasses.dataclass
class ChainRecord:
  """The host's bookkeeping of one chain.

  Attributes:
    number: The chain's number on its loader (``CacheState.chain``).
    spec: What it draws.
    cursor: The loader's cursor; it stands before chunk ``next_index``.
    snapshots: Chunk index -> the cursor's position before that chunk:
      the chain's first, and where the cursor cannot compute positions
      (:attr:`computes`), some of those after it (:meth:`note_position`).
    next_index: The chunk the cursor produces next; None while unknown (a
      production failed half-way).
    chunks: Stored chunks by index, oldest first.
    produce_lock: Held while the cursor works.
    devices: The largest ``device_count`` a request for the chain named.
    requested: The chunk of the chain's latest request (None before one):
      chunks are produced ahead only after it, and only it warns when
      produced again (``verify_calls``).
    keep: Served chunks kept besides those produced ahead; 0 for a random
      chain whose cursor reaches any chunk at once, a counter-based one
      (:attr:`regenerates`).
    computes: Whether the cursor computes the position of any later chunk
      from an earlier one (``ChainCursor.position_after``): it then seeks
      there straight, and keeps no snapshot per chunk (1,024 tf.data chains
      kept 70 each after 120 chunks, 28 MiB, more as they run).
    reached: The furthest chunk the cursor stood before: its first, or the
      one after the furthest it produced (:meth:`note_position`).
    closing: A close was asked for (the pipeline's release). One that came
      while ``produce_lock`` was held and did not wait for it is done by
      the holder once it lets go (:meth:`let_go`).
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
  requested: Optional[int] = None
  closed: bool = False
  keep: int = 2
  computes: bool = False
  reached: int = 0
  closing: bool = False

  @property
  def regenerates(self) -> bool:
    """Whether the chain's chunks need not be stored: a random chain whose
    cursor reaches any chunk at once (a counter-based stream). An ordered
    chain's cursor may reach any chunk too, but it keeps its served
    chunks, which the next pass asks for again."""
    return self.keep == 0

  def close(self, blocking: bool) -> None:
    """Closes the cursor once; if it is at work and ``blocking`` is False,
    whoever holds it closes it when done (:meth:`let_go`)."""
    # Noted before the lock is tried: a holder that lets go after the try
    # then sees it.
    self.closing = True
    if not self.produce_lock.acquire(blocking=blocking):
      return
    try:
      if not self.closed:
        self.closed = True
        self.cursor.close()
    finally:
      self.produce_lock.release()

  def let_go(self) -> None:
    """Releases ``produce_lock``, and closes the cursor if a close came
    while it was held (a release does not wait for a cursor at work)."""
    self.produce_lock.release()
    if self.closing:
      self.close(blocking=True)

  def stand_at(self, index: int) -> bool:
    """Moves the cursor to chunk ``index`` if it can seek there directly (a
    counter-based stream, an ordered one over rows read by index, a cursor
    that computes positions), with ``produce_lock`` held; whether it
    stands there."""
    if self.next_index == index:
      return True
    direct = self.cursor.position_at(index)
    if direct is None and self.computes and min(self.snapshots) <= index:
      base, position = self.nearest_snapshot(index)
      direct = position if base == index else None
    if direct is None:
      return False
    self.next_index = None
    self.cursor.seek(direct)
    self.next_index = index
    return True

  def note_position(self, index: int) -> None:
    """Keeps the position the cursor stands at, before chunk ``index``, as
    a snapshot, unless the chain needs none: its cursor reaches any chunk
    at once (:attr:`regenerates`) or computes positions (:attr:`computes`).
    """
    self.reached = max(self.reached, index + 1)  # once it produced it
    if not (self.regenerates or self.computes or index in self.snapshots):
      self.snapshots[index] = self.cursor.position()

  def nearest_snapshot(self, index: int) -> Tuple[int, Position]:
    """The newest snapshot at or before chunk ``index`` (its index,
    position); where the cursor computes positions, chunk ``index``'s own.

    Raises:
      ValueError: none is at or before ``index``.
    """
    base = max(i for i in self.snapshots if i <= index)
    if self.computes and base < index:
      computed = self.cursor.position_after(self.snapshots[base], index - base)
      if computed is not None:
        return index, computed
    return base, self.snapshots[base]

  def thin(self, recent: int) -> None:
    """Thins the snapshots out (:func:`keep_snapshot`) once they doubled
    since the last thinning."""
    if len(self.snapshots) <= 2 * self.pruned_size + recent:
      return
    newest = max(self.snapshots)
    self.snapshots = {i: s for i, s in self.snapshots.items()
                      if keep_snapshot(i, newest, recent)}
    self.pruned_size = len(self.snapshots)

  def snapshot_before(self, index: int) -> Tuple[int, Position]:
    """The newest snapshot at or before chunk ``index``: (its index,
    position)."""
    self.produce_lock.acquire()
    try:
      return self.nearest_snapshot(index)
    finally:
      self.let_go()


# Bytes a stored chunk costs besides its arrays (its future, entry, chunk
# and array objects: 2.4 KB of Python objects measured, more in RSS), so
# that chunks of a few bytes do not fill the store by the million.
CHUNK_OVERHEAD = 4096


class Shelf:
  """The stored chunks of a pipeline's chains, within per-chain and byte
  bounds (used with the store's lock held, but for :meth:`ahead` and
  :meth:`reads_in_place`).

  Args:
    layout: The chunks' arrays.
    limits: The loader's :class:`~jax_data.loaders.host_loader.StoreLimits`.
    keep: Served chunks kept per chain that cannot regenerate them.
  """

  def __init__(self, layout: ChunkLayout, limits: StoreLimits, keep: int):
    self._nbytes = max(layout.nbytes, 1)
    self._limits = limits
    self.keep = keep
    # Every stored chunk, least recently used first: (chain, index) -> chain.
    self._stored: "collections.OrderedDict[Tuple[int, int], ChainRecord]" = (
        collections.OrderedDict())
    self.lanes = 1
    self.idle: List[ChainRecord] = []
    # What waits for its futures: one condition for all of them.
    self._changed = threading.Condition(threading.Lock())

  def ahead(self) -> int:
    """Chunks produced ahead of each chain's requests: ``store_limits.
    ahead``, or fewer (at least one) where that many chunks for every lane
    of the largest request would pass ``store_bytes`` (1,024 vmapped
    chains, each chunk a large cache)."""
    limits = self._limits
    return max(1, min(limits.ahead,
                      limits.store_bytes // (self.lanes * self._nbytes)))

  def reads_in_place(self, lanes: int) -> bool:
    """Whether a request of ``lanes`` chunks is read straight into compiled
    code's buffers, where its chains allow (``ChainRecord.regenerates``),
    rather than produced ahead into the store's: when one chunk for every
    lane would pass ``store_bytes`` (hundreds of vmapped chains). Then
    nothing is kept between requests, and no chunk is copied once more."""
    return lanes * self._nbytes > self._limits.store_bytes

  def claim(self, record: ChainRecord, index: int, device_count: int
            ) -> Tuple[StoredFuture, bool]:
    """The future of chunk ``index`` for a request, and whether the caller
    must produce it (it was not stored, or failed before any request)."""
    record.devices = max(record.devices, device_count)
    record.requested = index
    entry = record.chunks.get(index)
    if (entry is not None and entry.pending is None and entry.future.done()
        and entry.future.exception() is not None):
      # Failed while produced ahead, before any request: asked for now,
      # it is tried again (the loader may have recovered since).
      self.drop(record, index)
      entry = None
    if entry is not None:
      entry.pending = (device_count if entry.pending is None
                       else entry.pending) - 1
      record.chunks.move_to_end(index)
      self._stored.move_to_end((record.number, index))
      return entry.future, False
    self.put(record, index, Entry(StoredFuture(self._changed),
                                  device_count - 1))
    return record.chunks[index].future, True

  def put(self, record: ChainRecord, index: int, entry: Entry) -> None:
    """Stores an entry, then drops chunks beyond the bounds."""
    record.chunks[index] = entry
    self._stored[(record.number, index)] = record
    self._evict(record)
    self._evict_across_chains()

  def claim_done(self, records: Sequence[Optional[ChainRecord]],
                 indices: Sequence[int]) -> Optional[List[Any]]:
    """Claims chunk ``indices[i]`` of each chain ``records[i]`` for a
    one-device request and returns them if all were produced; None, and
    nothing claimed, if one was not or failed."""
    futures = []
    for record, index in zip(records, indices):
      entry = None if record is None else record.chunks.get(index)
      if entry is None or not entry.future.done():
        return None
      futures.append(entry.future)
    try:
      chunks = [future.result() for future in futures]
    except Exception:  # pylint: disable=broad-except
      return None
    for record, index in zip(records, indices):
      self.claim(record, index, 1)
    return chunks

  def claim_ahead(self, records: Sequence[ChainRecord],
                  indices: Sequence[int]) -> List[Job]:
    """Stores a future for chunk ``indices[i]`` of each chain
    ``records[i]`` not stored yet, to be produced before it is requested;
    the jobs that produce them (one per chunk named twice: its future is
    stored at the first)."""
    jobs = []
    for record, index in zip(records, indices):
      if index not in record.chunks:
        entry = Entry(StoredFuture(self._changed), ahead=True)
        self.put(record, index, entry)
        jobs.append((record, index, entry.future))
    return jobs

  def forget(self, record: ChainRecord, index: int,
             future: StoredFuture) -> None:
    """Drops a failed chunk if ``future`` is still its entry's."""
    entry = record.chunks.get(index)
    if entry is not None and entry.future is future:
      self.drop(record, index)

  def drop(self, record: ChainRecord, index: int) -> None:
    del record.chunks[index]
    del self._stored[(record.number, index)]

  def clear(self) -> None:
    self._stored.clear()

  def _evict(self, record: ChainRecord) -> None:
    """Drops a chain's served chunks beyond its ``keep`` plus
    :meth:`ahead`. Chunks that some device has yet to take stay, up to the
    hard cap."""
    kept = record.keep + self.ahead()
    cap = min(self._limits.max_stored, kept + 2 * record.devices)
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
        self.drop(record, served)
      elif len(chunks) > cap:
        self.drop(record, oldest)
      else:
        break

  def _evict_across_chains(self) -> None:
    """Drops the least recently used chunks of any chain while the store
    holds more than ``store_bytes``; where that cannot keep ``keep +
    ahead`` chunks for every lane of the largest request, while it holds
    more than the :meth:`ahead` chunks per lane: served chunks kept beyond
    the budget would grow with the chains (1,024 vmapped chains keeping 3
    chunks each held 3 times their device caches), and kept for some lanes
    only they serve little. Served chunks go first, then those produced
    ahead and not asked for yet (a request for a dropped one produces it
    again, by replay where the chain cannot reach it directly); chunks
    still being produced stay. A chain left with no chunk is noted
    :attr:`idle`, to trim its cursor's caches."""
    limit = self._limits.store_bytes // (self._nbytes + CHUNK_OVERHEAD)
    if limit < (self.keep + self.ahead()) * self.lanes:
      # No room to keep served chunks for every lane: none are kept.
      limit = self.ahead() * self.lanes
    excess = len(self._stored) - limit
    if excess <= 0:
      return
    # Chosen in walks from the oldest that stop once enough are found: a
    # walk over every stored chunk on each put cost 1,024 chains a third
    # of their step. A claim moves a served chunk to the newest end, so
    # the oldest may be chunks produced ahead that a lane needs next.
    chosen: List[Tuple[ChainRecord, int]] = []
    for served in (True, False):
      for (_, index), record in self._stored.items():
        if len(chosen) == excess:
          break
        entry = record.chunks[index]
        if entry.future.done() and (entry.pending is not None) == served:
          chosen.append((record, index))
    for record, index in chosen:
      self.drop(record, index)
      if not record.chunks:
        self.idle.append(record)


def _seek_checked(cursor: ChainCursor, index: int, position: Position
                  ) -> None:
  """Moves a new chain's ``cursor`` to ``position``, saved before chunk
  ``index``. Where the cursor computes chunk ``index``'s position from its
  spec (counter-based and ordered streams), the saved one must be that
  position: a seed or batch that disagrees with the spec and the chunk
  (an edited checkpoint) would otherwise be taken, or overridden later, in
  silence.

  Raises:
    ValueError: the cursor refuses ``position``, or it is not chunk
      ``index``'s of the spec's chain.
  """
  own = cursor.position_at(index)
  cursor.seek(position)
  foreign = cursor.foreign(position)
  if foreign is not None:
    raise ValueError(f"the saved position {position!r}: {foreign}: the "
                     "chain's spec and its snapshot disagree")
  if own is None:
    return
  saved = cursor.position()
  cursor.seek(own)  # as the cursor holds it (an ordered batch within a pass)
  if cursor.position() != saved:
    raise ValueError(
        f"the saved position {position!r} is not the chain's position "
        f"before chunk {index}, {cursor.position()!r}: the chain's spec and "
        "its snapshot disagree")


class ChainTable:
  """The chains of one pipeline by number, over its loader (thread-safe).

  Args:
    loader: The host loader.
    layout: The chunks' arrays.
    name: The loader's repr, for messages.
    keep: Served chunks a chain keeps if its cursor cannot regenerate them
      (``ChainRecord.keep``).
  """

  def __init__(self, loader: HostDataLoader, layout: ChunkLayout, name: str,
               keep: int = 2):
    self._loader: Optional[HostDataLoader] = loader
    self.layout = layout
    self.name = name
    self.keep = keep
    self._records: Dict[int, ChainRecord] = {}
    self._lock = threading.Lock()

  @property
  def loader(self) -> HostDataLoader:
    """The loader; :class:`PipelineReleasedError` once released."""
    loader = self._loader
    if loader is None:
      raise PipelineReleasedError(
          f"this pipeline over {self.name} was released by its release_fn; "
          "create a new pipeline to draw more data")
    return loader

  def add(self, spec: ChainSpec,
          snapshot: Optional[Tuple[int, Position]] = None) -> ChainRecord:
    """Adds a chain to the loader and to the table.

    Args:
      spec: The chain.
      snapshot: ``(index, position)``: the chain starts at the position
        saved before chunk ``index`` (a restored checkpoint); else at chunk
        0.

    Raises:
      ValueError: the loader refuses the spec or the position; nothing is
        added then.
      PipelineReleasedError: the pipeline was released, also while the
        cursor opened (it is closed then).
    """
    number, spec, cursor = self.loader.add_chain(spec, self.layout)
    index = 0
    if snapshot is not None:
      index, position = snapshot
      try:
        _seek_checked(cursor, index, position)
      except BaseException:
        cursor.close()
        raise
    # A counter-based chain's chunks are produced again as cheaply as
    # kept; an ordered one (full-data passes) keeps its served chunks, as
    # the next pass asks for them again, even where its cursor seeks.
    regenerates = (isinstance(spec, RandomChain)
                   and cursor.position_at(index + 1) is not None)
    position = cursor.position()
    record = ChainRecord(number, spec, cursor, {index: position}, index,
                         keep=0 if regenerates else self.keep,
                         computes=cursor.position_after(position, 0)
                         is not None, reached=index)
    with self._lock:
      # Released while the cursor opened (a file, a tf.data iterator):
      # release closed the cursors it found, not this one.
      released = self._loader is None
      if not released:
        self._records[number] = record
    if released:
      cursor.close()
      _ = self.loader  # raises PipelineReleasedError
    return record

  def save(self, number: int, chunk: int) -> Dict[str, Any]:
    """What restores chain ``number`` at chunk ``chunk``: its spec and the
    snapshot of its position at or before that chunk (JSON-compatible)."""
    record = self.record(number)
    index, position = record.snapshot_before(chunk)
    if isinstance(position, dict) and UNSAVED in position:
      raise CheckpointError(
          f"chain {number} of {self.name} cannot be saved: "
          f"{position[UNSAVED]}; a loader written the predecessor's way "
          "needs save_state and load_state for checkpoints")
    if isinstance(position, dict) and UNPORTABLE in position:
      raise CheckpointError(
          f"chain {number} of {self.name} cannot be saved: "
          f"{position[UNPORTABLE]}; a checkpoint holds numbers, strings, "
          "lists, tuples, dicts and NumPy arrays")
    return {"spec": spec_to_json(record.spec), "snapshot_index": index,
            "snapshot": position}

  def restore(self, saved: Dict[str, Any], chunk: int) -> ChainRecord:
    """Adds a chain from :meth:`save`'s dict, for a state at chunk
    ``chunk``.

    Raises:
      CheckpointError: the dict is not one of :meth:`save`, ``chunk`` is
        not at or after its snapshot (within the loader's
        ``store_limits.max_replay`` chunks), or the loader refuses the spec
        or position; no chain is added then.
    """
    if not isinstance(saved, dict) or not {"spec", "snapshot_index",
                                            "snapshot"} <= set(saved):
      raise CheckpointError(
          "a saved chain is a dict with spec, snapshot_index and snapshot, "
          f"got {saved!r}")
    try:
      spec = spec_from_json(saved["spec"])
      index = check_int("snapshot_index", saved["snapshot_index"],
                        minimum=0)
      # A counter-based stream reaches any chunk at once: no replay bound.
      counter = isinstance(spec, RandomChain) and spec.stream == "counter"
      replay = None if counter else self.loader.store_limits.max_replay
      if chunk < index or (replay is not None and chunk > index + replay):
        raise ValueError(
            f"the state's chunk={chunk} must be at least the chain's "
            f"snapshot_index={index}" if replay is None else
            f"the state's chunk={chunk} must be between the chain's "
            f"snapshot_index={index} and {index + replay} (the snapshot "
            f"plus max_replay={replay} chunks)")
      return self.add(spec, (index, saved["snapshot"]))
    except (TypeError, ValueError) as e:
      raise CheckpointError(f"saved chain does not fit {self.name}: {e}"
                            ) from e

  def closing_error(self) -> PipelineReleasedError:
    """The error of work cancelled because the pipeline closes."""
    try:
      _ = self.loader
    except PipelineReleasedError as e:
      return e
    return PipelineReleasedError(f"the pipeline over {self.name} is closing")

  def numbers(self) -> List[int]:
    """The numbers of the chains."""
    with self._lock:
      return sorted(self._records)

  def get(self, number: int) -> Optional[ChainRecord]:
    """The chain ``number``, or None."""
    with self._lock:
      return self._records.get(number)

  def record(self, number: int) -> ChainRecord:
    """The chain ``number``; a clear error if this pipeline has none."""
    record = self.get(int(number))
    if record is None:
      _ = self.loader  # released pipelines say so
      raise ValueError(
          f"chain {int(number)} was not created by this pipeline's init_fn "
          f"(chains of this pipeline: {self.numbers()})")
    return record

  def pop(self, number: int) -> Optional[ChainRecord]:
    """Takes chain ``number`` out of the table; None if it is not in it."""
    with self._lock:
      return self._records.pop(int(number), None)

  def release(self) -> List[ChainRecord]:
    """Drops the loader; returns every chain, taken out of the table."""
    with self._lock:
      self._loader = None
      records, self._records = list(self._records.values()), {}
    return records
