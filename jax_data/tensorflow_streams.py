"""The chains of :class:`~jax_data.tensorflow_loader.TensorflowDataLoader`:
where their rows come from and the order they are served in.

Random chains stream the observations through a shuffle buffer computed in
NumPy (:class:`~jax_data.sampling.BufferShuffle`), cut into batches; ordered
chains serve them in pipeline order, each pass padded up to whole batches.
Rows come either from the pipeline, read in order pass after pass
(:class:`PipelineRows`), or from NumPy arrays read once (:class:`MemoryRows`,
``in_memory=True``). A chain's position is the number of batches it served,
so restoring one replays less than one pass.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import threading
from typing import Any
from typing import Deque
from typing import Iterator
from typing import List
from typing import Optional
from typing import Tuple

import numpy as np
import tensorflow as tf

from jax_data.chains import ChainCursor
from jax_data.chains import Chunk
from jax_data.chains import ChunkLayout
from jax_data.chains import LeafFormat
from jax_data.chains import OrderedChain
from jax_data.chains import Position
from jax_data.chains import RandomChain
from jax_data.gather import Gatherer
from jax_data.gather import is_run
from jax_data.sampling import BufferShuffle
from jax_data.sampling import ObservationRange
from jax_data.sampling import OrderedStream
from jax_data.validation import check_int
from jax_data.validation import check_saved_state

# 2: random chains shuffle with sampling.BufferShuffle, not tf.data's op.
POSITION_VERSION = 2
MAX_SEED = 2**31 - 1

Rows = List[np.ndarray]  # one array per leaf, observations first


@dataclasses.dataclass(frozen=True)
class Reading:
  """What reading a loader's pipeline needs to know.

  Attributes:
    formats: The loader's leaves, in order, with their dtypes.
    name: The loader's repr, for messages.
    count: Observations in one pass; None if unknown.
    count_stated: Whether ``count`` was given by the user (the pipeline's
      own length is unknown).
  """
  formats: Tuple[LeafFormat, ...]
  name: str
  count: Optional[int]
  count_stated: bool

  def next_rows(self, iterator: Iterator, fresh: bool = False) -> Rows:
    """The next element of an iterator over the pipeline, as NumPy arrays
    in the loader's dtypes (read-only views where no conversion is due);
    ``fresh``: the iterator has yielded nothing yet."""
    try:
      element = next(iterator)
    except StopIteration:
      if fresh:
        raise RuntimeError(
            f"the pipeline of {self.name} is empty on this pass: it yielded "
            "no elements, though it had some when the loader was created; "
            "a pipeline must yield the same elements on every pass (e.g. "
            "from_generator needs a function that makes a new generator on "
            "every call)") from None
      raise RuntimeError(
          f"the pipeline of {self.name} ended early; does it yield fewer "
          "elements on later passes?") from None
    except tf.errors.FailedPreconditionError as e:
      if not self.count_stated:
        raise
      raise ValueError(
          f"observation_count={self.count} does not fit the pipeline: "
          f"{e.message}") from e
    return self.as_rows(element)

  def as_rows(self, element: Any) -> Rows:
    """An element of the pipeline as NumPy arrays in the loader's dtypes."""
    leaves = []
    for fmt, tensor in zip(self.formats, tf.nest.flatten(element)):
      array = np.asarray(tensor)  # a read-only view: no copy, unlike .numpy()
      leaves.append(array if array.dtype == fmt.dtype
                    else array.astype(fmt.dtype))
    return leaves


def in_order(dataset: tf.data.Dataset) -> Iterator:
  """An iterator over ``dataset`` with ``deterministic`` order set."""
  options = tf.data.Options()
  options.deterministic = True
  return iter(dataset.with_options(options))


class IteratorCloser:
  """Drops ``tf.data`` iterators in a background thread of its own.

  Dropping an iterator stops its pipeline's threads and can take seconds
  (more inside a host callback's thread, while compiled code waits), so
  the cursors never drop one where they run: the host trims an idle chain's
  cursor and a request must not wait for that. The thread starts when an
  iterator comes and ends when none is left; it is not a daemon, so the
  interpreter's exit waits for it (no TensorFlow code runs while the
  interpreter finalizes).

  Attributes:
    dropped: Iterators dropped so far (for tests and diagnostics).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._waiting: Deque[Iterator] = collections.deque()
    self._thread: Optional[threading.Thread] = None
    self.dropped = 0

  def close_later(self, iterators: List[Optional[Iterator]]) -> None:
    """Moves the iterators out of the list ``iterators`` and drops them in
    the background (Nones are skipped). The list must hold the caller's
    only references: one left elsewhere could be the last to go, and the
    iterator would then be dropped there."""
    with self._lock:
      self._waiting.extend(i for i in iterators if i is not None)
      iterators.clear()
      if self._thread is not None or not self._waiting:
        return
      thread = threading.Thread(target=self._work, daemon=False,
                                name="jax_data-tf-iterator-closer")
      self._thread = thread
    try:
      thread.start()
    except RuntimeError:  # the interpreter is exiting: drop them here
      self._work()

  def pending(self) -> int:
    """Iterators waiting to be dropped."""
    with self._lock:
      return len(self._waiting)

  def _work(self) -> None:
    while True:
      with self._lock:
        if not self._waiting:
          self._thread = None
          return
        iterator = self._waiting.popleft()
      del iterator  # the last reference: TensorFlow deletes it now
      with self._lock:
        self.dropped += 1


class MemoryRows:
  """A chain's observations held as NumPy arrays (``in_memory=True``).

  Rows are gathered by index; runs of consecutive rows, as ordered chains
  read them, are read-only views.
  """

  def __init__(self, arrays: Rows, shard: ObservationRange,
               gatherer: Gatherer):
    stop = shard.start + shard.count
    self._arrays = [array[shard.start:stop] for array in arrays]
    self._gatherer = gatherer
    self.count = shard.count

  def restart(self, first: int) -> None:
    """Nothing to do: rows are read by index."""
    del first

  def held_bytes(self) -> int:
    """Nothing beyond the loader's arrays, which stay."""
    return 0

  def rows(self, wanted: np.ndarray, keep: np.ndarray, out: Rows) -> Rows:
    """The rows of stream elements ``wanted`` (numbered along passes)."""
    del keep
    return self.gather(wanted % self.count, out)

  def gather(self, flat: np.ndarray, out: Rows) -> Rows:
    """The rows ``flat`` of the chain's observations."""
    if is_run(flat):
      first = int(flat[0])
      return [array[first:first + flat.size] for array in self._arrays]
    return [self._gatherer.take(array, flat, buffer)
            for array, buffer in zip(self._arrays, out)]


def _lookup(numbers: np.ndarray, wanted: np.ndarray
            ) -> Tuple[np.ndarray, np.ndarray]:
  """Where the ``wanted`` numbers are in the sorted ``numbers``: a row of
  ``numbers`` for each (clipped to the range where absent), and whether it
  is there."""
  at = np.minimum(np.searchsorted(numbers, wanted), numbers.size - 1)
  return at, numbers[at] == wanted


def _gather_from(blocks: List[Tuple[np.ndarray, Rows]], wanted: np.ndarray,
                 out: Rows) -> None:
  """Fills ``out`` with the rows of the elements ``wanted``, each held by
  one of the blocks; the block holding most is gathered in one pass."""
  found = [_lookup(numbers, wanted) for numbers, _ in blocks]
  counts = [np.count_nonzero(there) for _, there in found]
  if sum(counts) != wanted.size:  # blocks are disjoint
    raise RuntimeError(
        f"internal error: {wanted.size - sum(counts)} of the elements wanted "
        "are not held; please report it")
  most = int(np.argmax(counts))
  for b in [most] + [b for b in range(len(blocks)) if b != most]:
    at, there = found[b]
    rows = blocks[b][1]
    if b == most:  # every row; those held elsewhere are overwritten below
      for leaf, row in zip(out, rows):
        np.take(row, at, axis=0, out=leaf, mode="clip")
    elif there.any():
      positions = np.flatnonzero(there)
      for leaf, row in zip(out, rows):
        leaf[positions] = row[at[positions]]


class PipelineRows:
  """A chain's observations read from the pipeline in order, pass after
  pass (the default, ``in_memory=False``).

  Elements are numbered along the passes (element ``i`` of pass ``p`` is
  ``p * count + i``). The source holds the blocks it read and still needs:
  the elements a shuffle buffer holds (copied into one small block) and
  those read ahead (views of the last block read).
  """

  def __init__(self, data: tf.data.Dataset, count: int, rows_per_read: int,
               reading: Reading, closer: IteratorCloser):
    self._data = data
    self._rows_per_read = rows_per_read
    self._reading = reading
    self._closer = closer
    self.count = count
    self._iterator: Optional[Iterator] = None
    self.restart(0)

  def restart(self, first: int) -> None:
    """Reads again from element ``first``, the start of a pass; the
    iterator read so far is dropped in the background."""
    held, self._iterator = [self._iterator], None
    self._closer.close_later(held)
    self._blocks: List[Tuple[np.ndarray, Rows]] = []  # numbers, rows
    self._next = first  # the number of the element read next

  def held_bytes(self) -> int:
    """The bytes of the rows held (the whole blocks that views keep
    alive)."""
    arrays = {id(a): a for numbers, rows in self._blocks
              for a in [numbers] + [_base(row) for row in rows]}
    return sum(a.nbytes for a in arrays.values())

  def _read(self) -> None:
    fresh = self._iterator is None
    if fresh:
      self._iterator = in_order(
          self._data.repeat().batch(self._rows_per_read))
    rows = self._reading.next_rows(self._iterator, fresh)
    size = len(rows[0])
    self._blocks.append((np.arange(self._next, self._next + size), rows))
    self._next += size

  def rows(self, wanted: np.ndarray, keep: np.ndarray, out: Rows) -> Rows:
    """The rows of elements ``wanted`` written into ``out``; afterwards only
    the elements ``keep`` and those after all ``wanted`` and ``keep`` stay
    held."""
    keep = np.sort(keep)  # numbers of a block are sorted, for _lookup
    frontier = int(max(wanted.max(), keep[-1] if keep.size else -1)) + 1
    while self._next < frontier:
      self._read()
    held = [np.empty((keep.size,) + fmt.shape, fmt.dtype)
            for fmt in self._reading.formats]
    blocks, self._blocks = self._blocks, []
    _gather_from(blocks, wanted, out)
    if keep.size:
      _gather_from(blocks, keep, held)
    for numbers, rows in blocks:
      ahead = np.searchsorted(numbers, frontier)
      if ahead < numbers.size:
        self._blocks.append((numbers[ahead:], [r[ahead:] for r in rows]))
    if keep.size:
      self._blocks.insert(0, (keep, held))
    return out


def _base(array: np.ndarray) -> np.ndarray:
  """The array whose memory ``array`` views (itself if it owns it)."""
  while isinstance(array.base, np.ndarray):
    array = array.base
  return array


def _flat(out: Chunk, rows: int) -> Rows:
  """Views of a chunk's leaves with one axis of ``rows`` observations."""
  return [leaf.reshape((rows,) + leaf.shape[2:]) for leaf in out.leaves]


def _shaped(rows: Rows, layout: ChunkLayout) -> Rows:
  return [leaf.reshape(shape) for leaf, shape in
          zip(rows, layout.leaf_shapes())]


class ShuffleCursor(ChainCursor):
  """A random chain: the chain's observations streamed through a shuffle
  buffer of ``shuffle_cache`` slots, pass after pass, cut into batches.
  Batch ``j`` holds stream steps ``j * mb .. j * mb + mb - 1`` and may span
  two passes.

  Args:
    source: :class:`MemoryRows` or :class:`PipelineRows` over the chain's
      observations.
    spec: The chain (its seed is set).
    layout: Its chunks.
    shuffle_cache: Slots of the shuffle buffer.
  """

  def __init__(self, source: Any, spec: RandomChain, layout: ChunkLayout,
               shuffle_cache: int):
    self._source = source
    self._layout = layout
    self._size = layout.cache_size * layout.mb_size
    self._shuffle_cache = shuffle_cache
    self._shard = [spec.observations.start, spec.observations.count]
    self._shuffle = BufferShuffle(source.count, shuffle_cache, spec.seed)
    self._batch = 0  # batches served
    self._all_valid = np.ones(layout.lead, bool)
    self._all_valid.setflags(write=False)

  def produce(self, index: int, out: Chunk) -> Chunk:
    del index
    step = self._batch * self._layout.mb_size
    shuffle = self._shuffle
    if shuffle.position != step:
      shuffle.seek(step)
      self._source.restart(step // shuffle.count * shuffle.count)
    wanted = shuffle.take(self._size)
    try:
      rows = self._source.rows(wanted, shuffle.buffered(),
                               _flat(out, self._size))
    except BaseException:
      shuffle.position = None  # the source's state is unknown
      raise
    self._batch += self._layout.cache_size
    return Chunk(_shaped(rows, self._layout), self._all_valid)

  def trim(self) -> None:
    """Drops the pipeline iterator (in the background), the rows held and
    the shuffle's draws; the next chunk seeks again from the start of its
    pass."""
    self._shuffle.trim()
    self._source.restart(0)

  def close(self) -> None:
    self.trim()

  def held_bytes(self) -> int:
    return self._source.held_bytes() + self._shuffle.held_bytes()

  def position(self) -> Position:
    return {"version": POSITION_VERSION, "shuffle_cache": self._shuffle_cache,
            "shard": list(self._shard), "seed": self._shuffle.seed,
            "position": self._batch}

  def seek(self, position: Position) -> None:
    check_saved_state(position, {"version": POSITION_VERSION,
                                 "shuffle_cache": self._shuffle_cache,
                                 "shard": self._shard}, "this random chain")
    batch = check_int("position", position.get("position"), minimum=0)
    seed = check_int("seed", position.get("seed"), minimum=0,
                     maximum=MAX_SEED)
    if seed != self._shuffle.seed:
      self._shuffle.seed, self._shuffle.position = seed, None
    self._batch = batch


class _OrderedCursor(ChainCursor):
  """An ordered chain: padded passes in order (``spec/SAMPLING.md``'s
  ordered stream over the chain's observations). The stream is periodic,
  so a position is a batch of a pass."""

  def __init__(self, spec: OrderedChain, layout: ChunkLayout):
    self._layout = layout
    count = spec.observations.count
    self._shard = [spec.observations.start, count]
    self._indices = OrderedStream(ObservationRange(0, count), layout.mb_size)
    self.batches_per_pass = self._indices.batches_per_pass
    self._batch = 0

  def produce(self, index: int, out: Chunk) -> Chunk:
    del index
    batch = self._batch
    self._indices.set_state({"mode": "ordered", "batch": batch})
    indices, mask = self._indices.draw(self._layout.cache_size)
    rows = self._rows(batch, indices.reshape(-1),
                      _flat(out, indices.size))
    self._batch = (batch + self._layout.cache_size) % self.batches_per_pass
    return Chunk(_shaped(rows, self._layout), mask)

  @abc.abstractmethod
  def _rows(self, batch: int, flat: np.ndarray, out: Rows) -> Rows:
    """The rows of batches ``batch ..``: observations ``flat`` of the
    chain, written into ``out`` or fresh."""

  def position(self) -> Position:
    return {"version": POSITION_VERSION, "shard": list(self._shard),
            "position": self._batch}

  def seek(self, position: Position) -> None:
    check_saved_state(position, {"version": POSITION_VERSION,
                                 "shard": self._shard}, "this ordered chain")
    self._batch = check_int("position", position.get("position"),
                            minimum=0) % self.batches_per_pass


class OrderedMemoryCursor(_OrderedCursor):
  """An ordered chain over observations held in memory."""

  def __init__(self, source: MemoryRows, spec: OrderedChain,
               layout: ChunkLayout):
    super().__init__(spec, layout)
    self._source = source

  def _rows(self, batch: int, flat: np.ndarray, out: Rows) -> Rows:
    del batch
    return self._source.gather(flat, out)


class OrderedPipelineCursor(_OrderedCursor):
  """An ordered chain read from the pipeline: one ``batch`` per chunk of a
  pipeline that repeats the padded pass."""

  def __init__(self, data: tf.data.Dataset, spec: OrderedChain,
               layout: ChunkLayout, reading: Reading, closer: IteratorCloser):
    super().__init__(spec, layout)
    self._reading = reading
    self._closer = closer
    count = spec.observations.count
    padding = self.batches_per_pass * layout.mb_size - count  # < mb <= count
    self._pass = data.concatenate(data.take(padding)) if padding else data
    self._iterator: Optional[Iterator] = None
    self._next_batch: Optional[int] = None  # where the iterator stands

  def trim(self) -> None:
    """Drops the pipeline iterator (in the background)."""
    held, self._iterator, self._next_batch = [self._iterator], None, None
    self._closer.close_later(held)

  def close(self) -> None:
    self.trim()

  def _rows(self, batch: int, flat: np.ndarray, out: Rows) -> Rows:
    del flat, out  # a tf.data batch is fresh memory: served as it is
    fresh = self._next_batch != batch
    if fresh:
      self.trim()
      size = self._layout.cache_size * self._layout.mb_size
      self._iterator = in_order(self._pass.repeat().skip(
          batch * self._layout.mb_size).batch(size, drop_remainder=True))
    # Until a draw succeeds the iterator's position is unknown.
    self._next_batch = None
    rows = self._reading.next_rows(self._iterator, fresh)
    self._next_batch = (batch + self._layout.cache_size
                        ) % self.batches_per_pass
    return rows
