"""Shuffled counter-based batches of many chains, drawn block by block.

:func:`jax_data.streams.counter_chains.chain_batches` draws a chunk of
every chain of a refresh at once. For shuffled chains (``shuffle=True``,
with or without ``in_epochs``) it calls :func:`shuffled_batches`: each
index is ``counter_streams.permute`` of the chain's seed, the epoch of its
position and its offset in that epoch, the same values bit for bit.

The indices are made a tile at a time (whole chains' chunks of about a
block of indices), positions, epochs and offsets included, from what all
chains' chunks share, so that the only array of the whole size is the
result (and the mask). Made whole, a refresh of 1,024 chains of 100
batches of 64 took 254 MiB of temporaries for its 50 MiB of indices;
tiled, 5 MiB. With the round functions' lookups reduced to two NumPy
calls a round, that refresh's draw took 162 against 315 ms in one thread
on 2 cores (152 against 177 ms in epochs); with the halves made from what
the chains share (:func:`permute_tabulated`), 122-124 ms on another
2-core machine.

Pure NumPy, on the host.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Tuple

import numpy as np

from jax_data.streams import counter_streams as cs

#: ``split(work, size, least)`` calls ``work(low, high)`` on parts of
#: ``0 .. size`` of at least ``least`` (all of it at once if smaller), maybe
#: in several threads at once (:meth:`jax_data.loaders.gather.Gatherer.split`).
Split = Callable[[Callable[[int, int], None], int, int], None]


def shuffled_batches(seeds: np.ndarray, firsts: np.ndarray, count: int,
                     mb_size: int, n: int, in_epochs: bool,
                     cols: np.ndarray, split: Optional[Split], block: int,
                     least: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
  """Indices (``(C, count, width)``, int64) and mask (None without
  ``in_epochs``) of batches ``firsts[c] .. firsts[c] + count - 1`` of the
  shuffled counter-based streams of ``seeds`` (``uint64``), columns
  ``cols`` (ascending) of each batch: what ``chain_batches`` returns.

  Drawn in blocks of ``block`` indices, through ``split`` (at least
  ``least`` blocks a part) when given. Without ``in_epochs`` the stream is
  the concatenation of the epochs' permutations; with it, each epoch is
  served in ``ceil(n / mb_size)`` batches, the last padded with
  observation 0, masked False."""
  chains, width = seeds.size, cols.size
  length = count * width
  per_epoch = -(-n // mb_size)
  lasts = firsts + (count - 1)
  if in_epochs:
    low, high = firsts // per_epoch, lasts // per_epoch
  else:
    low = (firsts * mb_size + int(cols[0])) // n
    high = (lasts * mb_size + int(cols[-1])) // n
  # Keys of entry c * span + k: those of chain c's epoch low[c] + k, hashed
  # once per (chain, epoch) that occurs.
  span = int((high - low).max()) + 1 if chains else 1
  seed_lo, seed_hi = (np.repeat(w, span) for w in uint32_words(seeds))
  with np.errstate(over="ignore"):  # uint32 arithmetic wraps
    table = cs.round_keys((seed_lo, seed_hi), (
        low[:, None] + np.arange(span)).reshape(-1), np)
  values = np.empty((chains, length), np.int64)
  mask = np.empty((chains, length), np.bool_) if in_epochs else None
  bits = cs.domain_bits(n)
  half = 1 << (bits - bits // 2)
  # What every chain's chunk shares: index i's batch (from the chain's
  # first) and its position from the chain's first batch's start.
  at = np.arange(length, dtype=np.int64)
  batch_of = at // width
  column_of = cols[at - batch_of * width]
  position_of = batch_of * mb_size + column_of
  base = np.arange(chains, dtype=np.int64) * span - low  # entry - epoch
  tiles = _tiles(chains, length, block)

  def draw(first: int, last: int) -> None:  # tiles first .. last - 1
    with np.errstate(over="ignore"):
      for c0, c1, i0, i1 in tiles[first:last]:
        rows = slice(c0, c1)
        # Chains that start their chunks together (vmapped chains do)
        # share the positions' epochs and offsets: made once, broadcast.
        starts = firsts[rows]
        if (starts == starts[0]).all():
          starts = starts[:1]
        starts = starts[:, None]
        if in_epochs:
          batch = starts + batch_of[None, i0:i1]
          epoch = batch // per_epoch
          offset = ((batch - epoch * per_epoch) * mb_size
                    + column_of[None, i0:i1])
          valid = offset < n
          offset[~valid] = 0
        else:
          position = starts * mb_size + position_of[None, i0:i1]
          # NumPy divides by a scalar through libdivide, about 8x faster
          # than its remainder.
          epoch = position // n
          offset = position - epoch * n
        part = _permuted(table, base[rows, None], epoch, offset, n, bits,
                         half)
        if in_epochs:
          np.copyto(part, 0, where=~valid)
          mask[rows, i0:i1] = valid
        values[rows, i0:i1] = part

  if split is None:
    draw(0, len(tiles))
  else:
    split(draw, len(tiles), least)
  shape = (chains, count, width)
  return values.reshape(shape), None if mask is None else mask.reshape(shape)


def _tiles(chains: int, length: int, block: int
           ) -> List[Tuple[int, int, int, int]]:
  """Parts ``(c0, c1, i0, i1)`` of the ``(chains, length)`` indices of
  about ``block`` indices each: whole chains' chunks where they are no
  larger, else parts of one chain's."""
  if not length:  # no batches: nothing to draw
    return []
  if length <= block:
    rows = block // length
    return [(c, min(chains, c + rows), 0, length)
            for c in range(0, chains, rows)]
  return [(c, c + 1, i, min(length, i + block))
          for c in range(chains) for i in range(0, length, block)]


def _permuted(table: list, chain_base: np.ndarray, epoch: np.ndarray,
              offset: np.ndarray, n: int, bits: int, half: int
              ) -> np.ndarray:
  """``permute`` of each offset with the keys of its entry, ``chain_base``
  (``(k, 1)``, a chain's entry of epoch 0) plus its ``epoch`` (``(k, L)``,
  or ``(1, L)`` shared by the chains): a ``(k, L)`` array. Entries are
  non-decreasing in row-major order, so a tile's are one range; their
  round functions are tabulated where the tables (entries times the values
  of a half) are no larger than the tile: 256 chains of 6,400 shuffled
  indices over 1e5 then took 48-60 against 68-74 ms on 2 cores, 1,024
  chains 176-192 against 271-274 ms."""
  shape = np.broadcast_shapes(chain_base.shape, epoch.shape)
  size = shape[0] * shape[1]
  e0 = int(chain_base[0, 0] + epoch[0, 0])
  e1 = int(chain_base[-1, 0] + epoch[-1, -1]) + 1
  if n <= cs.SORTED_UP_TO or (half <= cs.TABLE_MAX
                               and (e1 - e0) * half <= size):
    return permute_tabulated([k[e0:e1] for k in table], chain_base - e0,
                             epoch, offset, n, bits)
  entry = (chain_base + epoch).reshape(-1)
  offset = np.broadcast_to(offset, shape).reshape(-1)
  return cs.permute_keyed([np.take(k, entry) for k in table], offset, n,
                          bits).reshape(shape)


def permute_tabulated(keys: list, chain_entry: np.ndarray,
                      epoch: np.ndarray, offset: np.ndarray, n: int,
                      bits: int) -> np.ndarray:
  """``permute`` of offsets, each with the keys of its entry, through
  those entries' round functions tabulated (``n`` at most ``2**24``).

  Args:
    keys: the :func:`~jax_data.streams.counter_streams.round_keys` of
      ``E`` entries, ``ROUNDS + 1`` arrays of ``E`` ``uint32`` keys.
    chain_entry: ``(k, 1)`` integers, a chain's entry at epoch 0 (maybe
      negative: only ``chain_entry + epoch`` is an entry).
    epoch: ``(k, L)`` integers, or ``(1, L)`` where the chains share them.
    offset: the offsets in their epochs, shaped as ``epoch``.
    n: the epoch's observations.
    bits: ``domain_bits(n)``.

  Returns:
    The ``(k, L)`` permuted offsets, ``uint32``.

  Each half carries its entry in the bits above it, where the tables of
  the rounds that read it put that entry's function: a half-round is then
  one lookup and one XOR (the tables' values fit the half they write, so
  the entry's bits stay). The halves are made from what the chains share
  in one broadcast sum (uint32 sums wrap, so the two terms' high bits
  cancel), and cycle-walking goes on with the values outside ``[0, n)``
  alone: 1,024 chains of 6,400 shuffled indices over 1e5 took 122-124
  against 142-147 ms on 2 cores, 16 chains 2.9 against 4.3 ms. The few
  values below 2 then take their entry's finishing key
  (:func:`~jax_data.streams.counter_streams.finish`). Up to
  :data:`~jax_data.streams.counter_streams.SORTED_UP_TO` observations each
  entry's permutation is made whole and looked up instead.
  """
  shape = np.broadcast_shapes(chain_entry.shape, epoch.shape)

  def entries(at: Any) -> np.ndarray:  # the entries of flat positions
    row, column = np.unravel_index(at, shape)
    return (chain_entry[row, 0]
            + epoch[row if epoch.shape[0] > 1 else 0, column])

  if n <= cs.SORTED_UP_TO:
    orders = cs.sorted_permutations(keys[0], keys[1], n)
    entry = (chain_entry + epoch).reshape(-1)
    offset = np.broadcast_to(offset, shape).reshape(-1)
    return orders[entry, offset].astype(np.uint32).reshape(shape)
  tables = cs.round_tables(keys, bits)
  low = bits - bits // 2  # the right half's bits; the left has the rest
  left_mask, right_mask = (1 << (bits // 2)) - 1, (1 << low) - 1

  def halves(shift: int, value: np.ndarray) -> np.ndarray:
    # Entry chain_entry + epoch above a half's ``shift`` bits.
    return ((chain_entry << shift).astype(np.uint32)
            + ((epoch << shift) | value).astype(np.uint32)).reshape(-1)

  left = halves(bits // 2, offset >> low)
  right = halves(low, offset & right_mask)
  looked_up = np.empty_like(left)

  def joined(left, right):
    value = left & np.uint32(left_mask)
    value <<= np.uint32(low)
    value |= right & np.uint32(right_mask)
    return value

  cs.feistel_tables_into(left, right, tables, looked_up)
  values = joined(left, right)
  # Cycle-walking: those outside [0, n) go round the permutation of
  # [0, 2**b) again; each lands inside with probability n / 2**b, above
  # 1/2 for n of 3 or more.
  at = np.flatnonzero(values >= n)
  left, right = left[at], right[at]
  while at.size:
    cs.feistel_tables_into(left, right, tables, looked_up[:at.size])
    again = joined(left, right)
    values[at] = again
    outside = again >= n
    at, left, right = at[outside], left[outside], right[outside]
  at = np.flatnonzero(values < 2)
  values[at] ^= keys[cs.ROUNDS][entries(at)] & np.uint32(1)
  return values.reshape(shape)


def uint32_words(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Low and high ``uint32`` words of non-negative integers (``uint64``)."""
  values = values.astype(np.uint64)
  return ((values & np.uint64(0xFFFFFFFF)).astype(np.uint32),
          (values >> np.uint64(32)).astype(np.uint32))
