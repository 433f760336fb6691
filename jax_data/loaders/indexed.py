"""Chains of loaders that read rows by index: the index streams of
``spec/SAMPLING.md`` and a function that reads the rows.

The NumPy loader (arrays and memmaps) and the in-memory TensorFlow loader
share it: a loader supplies ``read(flat_indices, out_leaves) -> leaves``
and gets cursors whose streams are exactly the NumPy loader's.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
from typing import Any
from typing import Callable
from typing import Hashable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple
from typing import Union

import numpy as np

from jax_data.loaders.chains import ChainCursor
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import Chunk
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import GroupKey
from jax_data.loaders.chains import OrderedChain
from jax_data.loaders.chains import Position
from jax_data.loaders.chains import Span
from jax_data.loaders.chains import batch_rows
from jax_data.loaders.chains import readable
from jax_data.streams.counter_chains import CounterStream
from jax_data.streams.counter_chains import Split
from jax_data.streams.counter_chains import chain_batches
from jax_data.streams.sampling import OrderedStream
from jax_data.streams.sampling import RandomStream

# Reads rows ``flat`` (int64 indices into the loader's observations) and
# returns one array per leaf with ``flat.size`` rows: the given buffers
# filled, or read-only views of the data (of memory-mapped files too: then
# the cursor's ``check`` tells whether they can still be read).
ReadRows = Callable[[np.ndarray, List[np.ndarray]], List[np.ndarray]]

# Runs work in another thread: its future, or None if it cannot.
Ahead = Callable[[Callable[[], Any]], Optional[concurrent.futures.Future]]

_POSITION_VERSION = 1


def stream_of(spec: ChainSpec, mb_size: int
              ) -> Union[RandomStream, CounterStream, OrderedStream]:
  """The index stream of a chain (``spec/SAMPLING.md``)."""
  if isinstance(spec, OrderedChain):
    return OrderedStream(spec.observations, mb_size, spec.batches,
                         spec.fillers_from)
  stream = CounterStream if spec.stream == "counter" else RandomStream
  return stream(spec.observations, mb_size, spec.seed, spec.shuffle,
                spec.in_epochs)


class IndexedCursor(ChainCursor):
  """A chain whose chunks are rows picked by an index stream.

  Chains with counter-based streams produce their chunks together
  (:meth:`produce_group`): all chains' indices in one vectorised draw
  (:func:`jax_data.streams.counter_chains.chain_batches`), all their rows in one
  call of ``read``.

  Args:
    spec: The chain.
    layout: Its chunks.
    read: Reads rows by index (see :data:`ReadRows`).
    check: Each chunk's :attr:`~jax_data.loaders.chains.Chunk.check`.
    rows: Identifies the rows ``read`` reads, for grouping: the cursors
      of chains over the same rows (and with the same ``check``) may read
      them through each other's ``read``. Default: ``read`` itself (a
      loader's bound method).
    split: Draws a group's indices in parts, in several threads (a
      loader's :meth:`~jax_data.loaders.gather.Gatherer.split`); default:
      all at once.
    ahead: Runs work in another thread and returns its future, or None (a
      loader's :meth:`~jax_data.loaders.gather.Gatherer.submit`): a group
      draws its next chunk's indices there, in one thread, once it has
      read this chunk's rows, while compiled code works through them.
      Default: none drawn ahead.
    early: Start that draw before the read, beside it, and split it
      through ``split`` (a loader's
      :attr:`~jax_data.loaders.gather.Gatherer.draws_early`: where cores
      are to spare).
    in_memory: Whether ``read`` now reads rows as fast as from memory
      (arrays in memory, a memmap's pages in the page cache; no disk, no
      decoding): reading them while compiled code waits costs no more than
      reading them ahead (see ``Host.serve_into``). Default: never.
    closed: Called once when the cursor closes (a loader ends its threads
      when its last cursor closes).
  """

  def __init__(self, spec: ChainSpec, layout: ChunkLayout, read: ReadRows,
               check: Callable[[], None] = readable,
               rows: Optional[Hashable] = None,
               split: Optional[Split] = None,
               ahead: Optional[Ahead] = None, early: bool = False,
               in_memory: Optional[Callable[[], bool]] = None,
               closed: Optional[Callable[[], None]] = None):
    part = getattr(spec, "part", None)
    self._stream = stream_of(spec, batch_rows(spec, layout.mb_size))
    # The spec's seed (an exact stream takes a snapshot's: see foreign).
    self._seed = getattr(self._stream, "seed", None)
    # A part of each batch: its columns of the whole batch's indices.
    self._columns = None if part is None else slice(
        part.index * layout.mb_size, (part.index + 1) * layout.mb_size)
    self._layout = layout
    self._read = read
    self._check = check
    self._rows = read if rows is None else rows
    self._split = split
    self._ahead = ahead
    self._early = early
    self._in_memory = in_memory
    self._closed = closed
    # A group's next indices, drawn once it had read its last chunk (on
    # the group's first cursor): ((seeds, firsts), their future).
    self._drawn: Optional[Tuple[Hashable, concurrent.futures.Future]] = None
    self._group_key: Optional[GroupKey] = None  # see group_key
    self._all_valid = np.ones(layout.lead, bool)
    self._all_valid.setflags(write=False)

  serves_parts = True

  @property
  def seed(self) -> int:
    """The seed of the chain's stream."""
    return self._stream.seed

  @property
  def check(self) -> Callable[[], None]:
    """Each chunk's :attr:`~jax_data.loaders.chains.Chunk.check`."""
    return self._check

  def produce(self, index: int, out: Chunk) -> Chunk:
    del index
    if isinstance(self._stream, CounterStream):  # only a part's columns
      indices, mask = self._stream.draw(self._layout.cache_size,
                                        self._columns)
    else:
      indices, mask = self._stream.draw(self._layout.cache_size)
      if self._columns is not None:
        indices = indices[:, self._columns]
        mask = None if mask is None else mask[:, self._columns]
    rows = indices.size
    flat_out = [leaf.reshape((rows,) + leaf.shape[2:]) for leaf in out.leaves]
    leaves = self._read(indices.reshape(-1), flat_out)
    leaves = [leaf.reshape(shape) for leaf, shape in
              zip(leaves, self._layout.leaf_shapes())]
    return Chunk(leaves, self._all_valid if mask is None else mask,
                 self._check)

  def reads_memory(self) -> bool:
    """Whether rows are now read as fast as from memory (``in_memory``)."""
    return self._in_memory is not None and self._in_memory()

  def group_key(self) -> Optional[Hashable]:
    # Made once: a refresh of 1,024 chains asks each of them, and hashing
    # the layout anew took microseconds per chain.
    if self._group_key is None and isinstance(self._stream, CounterStream):
      self._group_key = GroupKey((
          IndexedCursor, self._rows, self._check, self._layout,
          self._stream.observations, self._stream.mode,
          None if self._columns is None else self._columns.start))
    return self._group_key

  @classmethod
  def produce_group(cls, cursors: Sequence[ChainCursor],
                    indices: Sequence[int], layout: ChunkLayout,
                    allocate: Callable[..., np.ndarray]) -> List[Chunk]:
    """The chunks of counter-based chains over the same rows, each cursor
    moved past its chunk: :meth:`read_group` of the first."""
    del indices  # each cursor stands at its chunk
    streams = [cursor._stream for cursor in cursors]  # pylint: disable=protected-access
    seeds = np.asarray([stream.seed for stream in streams], np.uint64)
    firsts = np.asarray([stream.advance(layout.cache_size)
                         for stream in streams], np.int64)
    lead: IndexedCursor = cursors[0]  # type: ignore[assignment]
    span = Span(*lead.read_group(seeds, firsts, allocate))
    return span.chunks([cursor._check for cursor in cursors])  # pylint: disable=protected-access

  def read_group(self, seeds: np.ndarray, firsts: np.ndarray,
                 allocate: Callable[..., np.ndarray],
                 later: Optional[List[Callable[[], None]]] = None
                 ) -> Tuple[List[np.ndarray], np.ndarray]:
    """The chunks of the chains of this cursor's group (counter-based
    streams of ``seeds``, this one's mode, rows and columns) from batches
    ``firsts``: one draw of every chain's indices, one ``read`` of all
    their rows into one buffer per leaf from ``allocate``; each leaf and
    the mask with a leading lane axis. Cursors stay where they are.

    Once the rows are read, the indices of the group's next chunks are
    drawn in another thread (``ahead``), while compiled code works through
    these: a refresh of 256 chains read in place (N = 1e5, 100 batches)
    then need not wait for an 11 ms draw before its read. On 2 cores that
    made a step 4-10 % faster at 256 and 1,024 chains; drawn during the
    read instead, it only took the read's second thread (no faster).
    Where cores are to spare (``early``), the draw starts before the read,
    beside it: on a GPU, whose compiled code works through a refresh in
    about a millisecond, the next refresh otherwise waits for the whole
    draw. Given ``later``, a list, the draw after the read is not started
    but appended to it, for the caller to start once it has done the rest
    of its work: the draw's thread holds the GIL between its NumPy calls,
    and slowed what the caller did next. Started last, on 2 cores, a step
    of 1,024 chains of one batch took 2,472 and 2,700 us against 2,580 and
    2,874; 256 chains of 7 batches 790 and 801 against 856 and 853."""
    stream, layout = self._stream, self._layout
    assert isinstance(stream, CounterStream)
    count = layout.cache_size
    draw = functools.partial(
        chain_batches, count=count, mb_size=stream.mb_size,
        n=stream.observations.count, shuffle=stream.shuffle,
        in_epochs=stream.in_epochs, start=stream.observations.start,
        columns=self._columns)
    drawn = self._take_drawn(seeds, firsts)
    indices, mask = drawn or draw(seeds, firsts, split=self._split)
    interleaved = bool(getattr(allocate, "interleaved", False))
    if self._early:
      self._draw_ahead(seeds, firsts + count, draw, interleaved)
    flat_out = [allocate((indices.size,) + leaf.shape, leaf.dtype)
                for leaf in layout.leaves]
    # Compiled code's buffers with the lane axis second take the rows
    # batch by batch, every chain's batch j before any batch j + 1.
    lanes, shapes = len(seeds), layout.leaf_shapes()
    if all(isinstance(out, StepRows) for out in flat_out):
      leaves = _read_steps(self._read, indices, flat_out, self._split)
    elif interleaved:
      leaves = _read_interleaved(self._read, indices, flat_out)
      leaves = [leaf.reshape(shape[:1] + (lanes,) + shape[1:]).swapaxes(0, 1)
                for leaf, shape in zip(leaves, shapes)]
    else:
      leaves = self._read(indices.reshape(-1), flat_out)
      leaves = [leaf.reshape((lanes,) + shape)
                for leaf, shape in zip(leaves, shapes)]
    if not self._early:
      start = functools.partial(self._draw_ahead, seeds, firsts + count,
                                draw, interleaved)
      if later is None:
        start()
      else:
        later.append(start)
    return leaves, (np.broadcast_to(np.True_, (lanes,) + layout.lead)
                    if mask is None else mask)

  def _take_drawn(self, seeds: np.ndarray, firsts: np.ndarray
                  ) -> Optional[Tuple[np.ndarray, Any]]:
    """The indices drawn ahead for these seeds and first batches, or None
    (others: the group's chains moved elsewhere; or the draw failed, and
    is done again in the caller's thread); drops them."""
    drawn, self._drawn = self._drawn, None
    if drawn is None or drawn[0] != (seeds.tobytes(), firsts.tobytes()):
      return None
    try:
      return drawn[1].result()
    except Exception:  # pylint: disable=broad-except
      return None

  def _draw_ahead(self, seeds: np.ndarray, firsts: np.ndarray,
                  draw: Callable[..., Tuple[np.ndarray, Any]],
                  interleaved: bool) -> None:
    """Draws the group's next indices in another thread; for a read into
    buffers with the lane axis second (``interleaved``), small enough to
    read at once, laid out batch by batch there too (see
    :func:`_interleaved_order`)."""
    if self._ahead is not None:
      # Split only where cores are to spare: on 2 cores a split draw
      # ahead took the second core from compiled code (1,024 shuffled
      # chains: 3,328 against 3,035 us per step in one thread).
      split = self._split if self._early else None

      def ahead() -> Tuple[np.ndarray, Any]:
        indices, mask = draw(seeds, firsts, split=split)
        return (_interleaved_order(indices) if interleaved else indices,
                mask)

      future = self._ahead(ahead)
      self._drawn = None if future is None else (
          (seeds.tobytes(), firsts.tobytes()), future)

  def close(self) -> None:
    self._drawn = None
    closed, self._closed = self._closed, None
    if closed is not None:
      closed()

  def trim(self) -> None:
    self._stream.trim()
    self._drawn = None

  def held_bytes(self) -> int:
    drawn = self._drawn
    ahead = 0
    if drawn is not None and drawn[1].done() and not drawn[1].exception():
      ahead = sum(a.nbytes for a in drawn[1].result() if a is not None)
    return self._stream.held_bytes() + ahead

  def position(self) -> Position:
    return {"version": _POSITION_VERSION, "stream": self._stream.get_state()}

  def foreign(self, position: Position) -> Optional[str]:
    # Counter-based and ordered positions are compared whole (position_at);
    # an exact stream's position is its generator's state, which does not
    # show the seed it was drawn from, and the seed it carries.
    if not isinstance(self._stream, RandomStream):
      return None
    stream = position.get("stream") if isinstance(position, dict) else None
    seed = stream.get("seed") if isinstance(stream, dict) else None
    if seed != self._seed:
      return f"its seed={seed!r} is not the chain's seed={self._seed}"
    return None

  def position_at(self, index: int) -> Optional[Position]:
    # Counter-based and ordered streams reach any batch from its index
    # (an ordered one modulo its pass); exact random ones do not.
    if not isinstance(self._stream, (CounterStream, OrderedStream)):
      return None
    state = self._stream.get_state()
    state["batch"] = index * self._layout.cache_size
    return {"version": _POSITION_VERSION, "stream": state}

  def seek(self, position: Position) -> None:
    if not isinstance(position, dict) or position.get(
        "version") != _POSITION_VERSION or "stream" not in position:
      raise ValueError(
          f"position {position!r} is not one of an indexed chain (version "
          f"{_POSITION_VERSION})")
    others = sorted(set(position) - {"version", "stream"}, key=str)
    if others:  # a field meant for the stream, say, would be ignored
      raise ValueError(
          f"position {position!r} has fields {others} besides version and "
          "stream, which an indexed chain's position does not have")
    self._stream.set_state(copy.deepcopy(position["stream"]))


# Rows a read of an interleaved group takes at most (a few steps' rows of
# every chain): its indices are put in that order a read at a time, not
# all at once (52 MB more at 1,024 chains of 6,400 rows); 2 MB of them.
_INTERLEAVED_ROWS = 262_144


def _interleaved_order(indices: np.ndarray) -> np.ndarray:
  """``indices`` (``(C, steps, width)``), the same values, laid out step by
  step in memory where :func:`_read_interleaved` reads them in one piece:
  its order is then a view, not a copy made while compiled code waits
  (64 us of a 1.6 ms refresh of 16 chains of case (g))."""
  if indices.size > _INTERLEAVED_ROWS:
    return indices
  return np.ascontiguousarray(indices.transpose(1, 0, 2)).transpose(1, 0, 2)


class StepRows(list):
  """A leaf's buffers of rows, one per step of a chunk (each every chain's
  rows of that step, in order): what ``read_group``'s ``allocate`` may
  return instead of one buffer, to read the rows step by step into them."""


def _read_steps(read: ReadRows, indices: np.ndarray, out: List[StepRows],
                split: Optional[Split] = None) -> List[StepRows]:
  """``read`` of the rows ``indices`` (``(C, steps, width)``) into ``out``,
  step ``j`` of every chain into each leaf's ``j``-th buffer; the steps
  split over threads by ``split``: a step's read alone is often too small
  for :class:`~jax_data.loaders.gather.Gatherer` to split (256 vmapped
  chains of 7 batches: 291 us a step read step by step in one thread, 233
  split over the steps, where one read of all the steps took 160 us; the
  step itself was faster by more than the difference)."""
  def steps(low: int, high: int) -> None:
    for j in range(low, high):
      parts = [o[j] for o in out]
      for part, leaf in zip(parts, read(indices[:, j].reshape(-1), parts)):
        if leaf is not part:  # a view of the data (a run of rows)
          part[...] = leaf

  count = indices.shape[1]
  if split is None or count < 2:
    steps(0, count)
  else:
    split(steps, count, 1)
  return out


def _read_interleaved(read: ReadRows, indices: np.ndarray,
                      out: List[np.ndarray]) -> List[np.ndarray]:
  """``read`` of the rows ``indices`` (``(C, steps, width)``) into ``out``
  in step-major order: step ``j`` of every chain before step ``j + 1``."""
  chains, steps, width = indices.shape
  per_step = chains * width
  group = max(1, _INTERLEAVED_ROWS // max(1, per_step))
  for first in range(0, steps, group):
    block = slice(first * per_step, min(steps, first + group) * per_step)
    parts = [o[block] for o in out]
    flat = indices[:, first:first + group].transpose(1, 0, 2).reshape(-1)
    for part, leaf in zip(parts, read(flat, parts)):
      if leaf is not part:  # a view of the data (a run of rows)
        part[...] = leaf
  return out
