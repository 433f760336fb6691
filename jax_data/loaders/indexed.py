"""Chains of loaders that read rows by index: the index streams of
``spec/SAMPLING.md`` and a function that reads the rows.

The NumPy loader (arrays and memmaps) and the in-memory TensorFlow loader
share it: a loader supplies ``read(flat_indices, out_leaves) -> leaves``
and gets cursors whose streams are exactly the NumPy loader's.
"""

from __future__ import annotations

import copy
from typing import Callable
from typing import Hashable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Union

import numpy as np

from jax_data.loaders.chains import ChainCursor
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import Chunk
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import OrderedChain
from jax_data.loaders.chains import Position
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

_POSITION_VERSION = 1


def stream_of(spec: ChainSpec, mb_size: int
              ) -> Union[RandomStream, CounterStream, OrderedStream]:
  """The index stream of a chain (``spec/SAMPLING.md``)."""
  if isinstance(spec, OrderedChain):
    return OrderedStream(spec.observations, mb_size, spec.batches)
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
  """

  def __init__(self, spec: ChainSpec, layout: ChunkLayout, read: ReadRows,
               check: Callable[[], None] = readable,
               rows: Optional[Hashable] = None,
               split: Optional[Split] = None):
    part = getattr(spec, "part", None)
    self._stream = stream_of(spec, batch_rows(spec, layout.mb_size))
    # A part of each batch: its columns of the whole batch's indices.
    self._columns = None if part is None else slice(
        part.index * layout.mb_size, (part.index + 1) * layout.mb_size)
    self._layout = layout
    self._read = read
    self._check = check
    self._rows = read if rows is None else rows
    self._split = split
    self._all_valid = np.ones(layout.lead, bool)
    self._all_valid.setflags(write=False)

  serves_parts = True

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

  def group_key(self) -> Optional[Hashable]:
    stream = self._stream
    if not isinstance(stream, CounterStream):
      return None
    return (IndexedCursor, self._rows, self._check, self._layout,
            stream.observations, stream.mode,
            None if self._columns is None else self._columns.start)

  @classmethod
  def produce_group(cls, cursors: Sequence[ChainCursor],
                    indices: Sequence[int], layout: ChunkLayout,
                    allocate: Callable[..., np.ndarray]) -> List[Chunk]:
    """The chunks of counter-based chains over the same rows: one draw of
    every chain's indices, one ``read`` of all their rows into one buffer
    per leaf, of which each chunk is a slice."""
    del indices  # each cursor stands at its chunk
    streams = [cursor._stream for cursor in cursors]  # pylint: disable=protected-access
    first = streams[0]
    count = layout.cache_size
    columns = cursors[0]._columns  # pylint: disable=protected-access
    indices, mask = chain_batches(
        [stream.seed for stream in streams],
        [stream.advance(count) for stream in streams], count,
        first.mb_size, first.observations.count, first.shuffle,
        first.in_epochs, first.observations.start, columns,
        cursors[0]._split)  # pylint: disable=protected-access
    rows = count * layout.mb_size
    flat_out = [allocate((indices.size,) + leaf.shape, leaf.dtype)
                for leaf in layout.leaves]
    # Compiled code's buffers with the lane axis second take the rows
    # batch by batch, every cursor's batch j before any batch j + 1.
    interleaved = getattr(allocate, "interleaved", False)
    if interleaved:
      leaves = _read_interleaved(cursors[0]._read, indices, flat_out)  # pylint: disable=protected-access
    else:
      leaves = cursors[0]._read(indices.reshape(-1), flat_out)  # pylint: disable=protected-access
    chunks = []
    for g, cursor in enumerate(cursors):
      if interleaved:
        part = [leaf.reshape(shape[:1] + (len(cursors),) + shape[1:])[:, g]
                for leaf, shape in zip(leaves, layout.leaf_shapes())]
      else:
        part = [leaf[g * rows:(g + 1) * rows].reshape(shape)
                for leaf, shape in zip(leaves, layout.leaf_shapes())]
      valid = cursor._all_valid if mask is None else mask[g]  # pylint: disable=protected-access
      chunks.append(Chunk(part, valid, cursor._check))  # pylint: disable=protected-access
    return chunks

  def trim(self) -> None:
    self._stream.trim()

  def held_bytes(self) -> int:
    return self._stream.held_bytes()

  def position(self) -> Position:
    return {"version": _POSITION_VERSION, "stream": self._stream.get_state()}

  def position_at(self, index: int) -> Optional[Position]:
    if not isinstance(self._stream, CounterStream):
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
    self._stream.set_state(copy.deepcopy(position["stream"]))


# Rows a read of an interleaved group takes at most (a few steps' rows of
# every chain): its indices are put in that order a read at a time, not
# all at once (52 MB more at 1,024 chains of 6,400 rows); 2 MB of them.
_INTERLEAVED_ROWS = 262_144


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
