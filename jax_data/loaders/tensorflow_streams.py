"""The chains of
:class:`~jax_data.loaders.tensorflow_loader.TensorflowDataLoader`:
where their rows come from and the order they are served in.

Random chains stream the observations through a shuffle buffer computed in
NumPy (:class:`~jax_data.streams.sampling.BufferShuffle`), cut into batches;
ordered chains serve them in pipeline order, each pass padded up to whole
batches. Rows come either from the pipeline, read in order pass after pass
(:class:`~jax_data.loaders.tensorflow_reads.PipelineRows`), or from NumPy
arrays read once (:class:`~jax_data.loaders.tensorflow_rows.MemoryRows`,
``in_memory=True``). A chain's position is the number of batches it served,
so restoring one replays less than one pass.
"""

from __future__ import annotations

import abc
from typing import Any
from typing import Callable
from typing import Hashable
from typing import Iterator
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np
import tensorflow as tf

from jax_data.loaders.chains import ChainCursor
from jax_data.loaders.chains import Chunk
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import GroupKey
from jax_data.loaders.chains import LaterRows
from jax_data.loaders.chains import OrderedChain
from jax_data.loaders.chains import Position
from jax_data.loaders.chains import RandomChain
from jax_data.loaders.chains import Span
from jax_data.loaders.chains import readable
from jax_data.loaders.tensorflow_rows import IteratorCloser
from jax_data.loaders.tensorflow_rows import MemoryRows
from jax_data.loaders.tensorflow_rows import Reading
from jax_data.loaders.tensorflow_rows import Rows
from jax_data.loaders.tensorflow_rows import Wanted
from jax_data.loaders.tensorflow_rows import in_order
from jax_data.streams.sampling import BufferShuffle
from jax_data.streams.sampling import Held
from jax_data.streams.sampling import ObservationRange
from jax_data.streams.sampling import OrderedStream
from jax_data.validation import MAX_AXIS
from jax_data.validation import check_int
from jax_data.validation import check_saved_state

# 2: random chains shuffle with sampling.BufferShuffle, not tf.data's op.
POSITION_VERSION = 2

def _flat(out: Chunk, rows: int) -> Rows:
  """Views of a chunk's leaves with one axis of ``rows`` observations."""
  return [leaf.reshape((rows,) + leaf.shape[2:]) for leaf in out.leaves]


def _shaped(rows: Rows, layout: ChunkLayout) -> Rows:
  return [leaf.reshape(shape) for leaf, shape in
          zip(rows, layout.leaf_shapes())]


def _rows_each(chains: Sequence[ShuffleCursor], wanted: np.ndarray,
               keeps: Sequence[Held], out: Rows, layout: ChunkLayout,
               interleaved: bool) -> None:
  """The rows of a group's chunks (see :meth:`ShuffleCursor.produce_group`)
  read chain by chain, each copied into its place in ``out``; where one
  fails, the sources of those before it moved past their chunks (they
  read again from the start of their pass)."""
  sources = [chain._source for chain in chains]  # pylint: disable=protected-access
  lanes, cache, mb = len(sources), layout.cache_size, layout.mb_size
  lead = (cache, lanes, mb) if interleaved else (lanes, cache, mb)
  places = [leaf.reshape(lead + leaf.shape[1:]) for leaf in out]
  spare = [np.empty((cache * mb,) + leaf.shape[1:], leaf.dtype)
           for leaf in out]
  for lane, source in enumerate(sources):
    try:
      rows = source.rows(wanted[lane], keeps[lane], spare)
    except BaseException:
      for chain in chains[:lane]:  # their sources gave their rows
        chain._source_step = None  # pylint: disable=protected-access
      raise
    for place, row in zip(places, rows):
      target = place[:, lane] if interleaved else place[lane]
      target[...] = row.reshape((cache, mb) + row.shape[1:])


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
    self._seed = spec.seed
    self._batch = 0  # batches served
    # The step the source stands at (it gave the rows of the steps before
    # it, and holds what the shuffle buffer needs there); None: unknown.
    self._source_step: Optional[int] = None
    self._all_valid = np.ones(layout.lead, bool)
    self._all_valid.setflags(write=False)
    self._group_key: Optional[GroupKey] = None  # see group_key

  def produce(self, index: int, out: Chunk) -> Chunk:
    del index
    wanted, keep = self._draw()
    try:
      # A source that raises has not moved (it gave no rows).
      rows = self._source.rows(wanted, keep, _flat(out, self._size))
    except BaseException:
      self._shuffle.position = None  # drew the chunk: draws it again
      raise
    self._moved()
    return Chunk(_shaped(rows, self._layout), self._all_valid)

  def _draw(self) -> Tuple[np.ndarray, Held]:
    """The element numbers of its next chunk, and those its shuffle buffer
    holds afterwards; the shuffle moves past them."""
    self._stand()
    return self._shuffle.take(self._size), self._shuffle.held()

  def _stand(self) -> None:
    """Its shuffle at its next chunk's step. A source elsewhere reads again
    from the start of the pass (not after a failed chunk, which it has
    not given)."""
    step = self._batch * self._layout.mb_size
    shuffle = self._shuffle
    if shuffle.position != step:
      shuffle.seek(step)
    if self._source_step != step:
      start = step // shuffle.count * shuffle.count
      held = shuffle.held()  # empty at a pass's start
      self._source.restart(start, held.min() if held.size else start)
      self._source_step = step

  def _moved(self) -> None:
    """Past its chunk, the source too."""
    self._batch += self._layout.cache_size
    self._source_step = self._batch * self._layout.mb_size

  def group_key(self) -> Optional[Hashable]:
    if self._group_key is None:
      source = self._source.group_key()
      if source is not None:
        self._group_key = GroupKey((ShuffleCursor, source, self._layout,
                                    self._shuffle_cache))
    return self._group_key

  @classmethod
  def produce_group(cls, cursors: Sequence[ChainCursor],
                    indices: Sequence[int], layout: ChunkLayout,
                    allocate: Callable[..., np.ndarray]) -> List[Chunk]:
    """The chunks of chains of one shard, each cursor moved past its
    chunk: each chain's shuffle draws its elements, and the rows of all
    of them are gathered at once (the source's ``rows_together``), or,
    where the source cannot (chains of a pipeline that do not all read
    its shared reads now), chain by chain. Produced into the store's
    buffers, the rows are read when served where the source can
    (``tensorflow_rows.read_later``), straight into compiled code's
    buffers."""
    del indices  # each cursor stands at its chunk
    lanes, cache, mb = len(cursors), layout.cache_size, layout.mb_size
    chains: List[ShuffleCursor] = list(cursors)  # type: ignore[arg-type]
    size = cache * mb
    interleaved = bool(getattr(allocate, "interleaved", False))
    try:
      for chain in chains:
        chain._stand()  # pylint: disable=protected-access
      shuffles = [chain._shuffle for chain in chains]  # pylint: disable=protected-access
      taken = BufferShuffle.take_and_hold_together(shuffles, size)
      if taken is None:
        numbers: Any = np.stack([shuffle.take(size) for shuffle in shuffles])
        keeps: Sequence[Held] = [shuffle.held() for shuffle in shuffles]
      else:  # every chain's numbers and buffer as a row of one array each
        numbers, keeps = taken
      out = [allocate((lanes * size,) + leaf.shape, leaf.dtype)
             for leaf in layout.leaves]
      # Compiled code's buffers with the lane axis second take the rows
      # batch by batch, every chain's batch j before any batch j + 1.
      wanted = Wanted(numbers, mb, interleaved)
      sources = [chain._source for chain in chains]  # pylint: disable=protected-access
      # Into the store's buffers, not compiled code's (which say how their
      # rows are laid out), rows may be read when served.
      shapes = (None if hasattr(allocate, "interleaved")
                else [leaf.shape for leaf in layout.leaves])
      read = type(sources[0]).rows_together(sources, wanted, keeps, out,
                                            shapes)
      if not read:
        _rows_each(chains, wanted.numbers, keeps, out, layout, interleaved)
      later = read if isinstance(read, LaterRows) else None
    except BaseException:
      for chain in chains:  # drew their chunks: they draw them again
        chain._shuffle.position = None  # pylint: disable=protected-access
      raise
    for chain in chains:
      chain._moved()  # pylint: disable=protected-access
    shapes = layout.leaf_shapes()
    if interleaved:
      leaves = [leaf.reshape(shape[:1] + (lanes,) + shape[1:]).swapaxes(0, 1)
                for leaf, shape in zip(out, shapes)]
    else:
      leaves = [leaf.reshape((lanes,) + shape)
                for leaf, shape in zip(out, shapes)]
    mask = np.broadcast_to(np.True_, (lanes,) + layout.lead)
    return Span(leaves, mask, later).chunks([readable] * lanes)

  def trim(self) -> None:
    """Drops the pipeline iterator (in the background), the rows held and
    the shuffle's draws; the next chunk seeks again from the start of its
    pass."""
    self._shuffle.trim()
    self._source.restart(0)
    self._source_step = None

  def close(self) -> None:
    self.trim()
    self._source.close()

  def cancel(self) -> None:
    self._source.cancel()

  def held_bytes(self) -> int:
    return self._source.held_bytes() + self._shuffle.held_bytes()

  def position(self) -> Position:
    return {"version": POSITION_VERSION, "shuffle_cache": self._shuffle_cache,
            "shard": list(self._shard), "seed": self._shuffle.seed,
            "position": self._batch}

  def position_after(self, position: Position, chunks: int) -> Position:
    # A chunk is cache_size batches; seek replays the pass's draws.
    return {**position, "shard": list(position["shard"]),
            "position": position["position"] + chunks * self._layout.cache_size}

  def seek(self, position: Position) -> None:
    check_saved_state(position, {"version": POSITION_VERSION,
                                 "shuffle_cache": self._shuffle_cache,
                                 "shard": self._shard}, "this random chain")
    # A chain's chunks are numbered by an int32 counter: its batches reach
    # 2**31 chunks at most.
    batch = check_int("position", position.get("position"), minimum=0,
                      maximum=MAX_AXIS * self._layout.cache_size)
    # The seed of a chain is its spec's: a position of another seed is
    # another chain's (an edited checkpoint), not this one's.
    seed = check_int("seed", position.get("seed"), minimum=0)
    if seed != self._shuffle.seed:  # another stream: its source too
      self._shuffle.seed, self._shuffle.position = seed, None
      self._source_step = None
    self._batch = batch

  def foreign(self, position: Position) -> Optional[str]:
    seed = position.get("seed") if isinstance(position, dict) else None
    if seed != self._seed:
      return f"its seed={seed!r} is not the chain's seed={self._seed}"
    return None


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

  def position_after(self, position: Position, chunks: int) -> Position:
    # Periodic: a batch of a pass.
    return {**position, "shard": list(position["shard"]),
            "position": (position["position"] + chunks
                         * self._layout.cache_size) % self.batches_per_pass}

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
    self._reader = reading.reader()

  def trim(self) -> None:
    """Drops the pipeline iterator (in the background)."""
    held, self._iterator, self._next_batch = [self._iterator], None, None
    self._closer.close_later(held)

  def close(self) -> None:
    self.trim()

  def cancel(self) -> None:
    self._reader.cancel()

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
    rows = self._reading.next_rows(self._iterator, fresh, self._reader)
    self._next_batch = (batch + self._layout.cache_size
                        ) % self.batches_per_pass
    return rows
