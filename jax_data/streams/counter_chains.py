"""Counter-based batches drawn on the host, for one chain or many at once.

:mod:`jax_data.streams.counter_streams` defines the streams: a batch's
indices as a pure function of (seed, position), for any positions, on the
host and on the device. This module draws what a host cursor asks for, the
same values bit for bit, faster:

* a refresh of ``C`` vmapped chains asks for a chunk of every chain at
  once. Drawn chain by chain, each chunk costs about a hundred NumPy calls
  on a few thousand indices, and 1,024 chains pay the calls' overhead 1,024
  times. :func:`chain_batches` draws all chains in one pass: the same NumPy
  calls on ``C`` times as many indices, the round keys of each (chain,
  epoch) hashed once (shuffled chains block by block:
  :mod:`jax_data.streams.shuffled_chains`);
* independent draws hash runs of consecutive positions: the words of the
  seed are hashed once per chain, the positions' words are made from the
  run's start without 64-bit arithmetic, and the hash is computed in place
  on blocks that stay in the CPU's caches (:func:`uniform_runs`);
* with a ``split`` (:data:`~jax_data.streams.shuffled_chains.Split`, a
  loader's gather threads), the blocks of many chains are drawn in several
  threads: NumPy releases the GIL in each call, and compiled code waits
  for the draw.

:class:`CounterStream` is a chain's stream as a cursor holds it.

Pure NumPy, on the host.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data.streams import counter_streams as cs
from jax_data.streams.sampling import position_fields
from jax_data.streams.sampling import random_mode
from jax_data.streams.shuffled_chains import Split
from jax_data.streams.shuffled_chains import shuffled_batches
from jax_data.streams.shuffled_chains import uint32_words
from jax_data.validation import check_int

# Indices permuted per pass: the temporaries of one pass (a few dozen
# arrays of this many words) stay in the caches; 1,024 chunks of 640
# indices took 0.75x the time of one pass over all of them.
_BLOCK = 65_536
# Words hashed in place per block of uniform_runs (two uint32 buffers of
# this many words stay in the L2 cache). The draw of 256 chains of 6,400
# took 12.7 ms in blocks of 16,384, 8.4-10.8 ms in blocks of 65,536 (and
# 8.4 ms in two threads); blocks of about 100,000 were slower again.
_HASH_BLOCK = 65_536
# Blocks of a draw split over threads are this many times as large (of
# both kinds): each NumPy call then does more per hold of the GIL. The
# draw of 1,024 chains took 26 ms in two threads in blocks of 65,536 on 2
# cores, 13 ms in blocks of 262,144 (18 ms in one thread); 256 chains took
# 9.9 ms in four threads on 16 cores, 22 ms in blocks of 65,536. Only
# draws of at least two parts of such blocks: a block that large leaves
# the L2 cache (16 chains took 0.91 against 0.28 ms in one block).
_SPLIT_BLOCKS = 4
# A chain's draws of fewer indices than this are made this many at a time
# (several chunks' worth, kept for the chunks that follow, within the
# store's budget for cursors): each of the hash's few dozen NumPy calls
# then does more work per call. For chunks of 6,400 indices, a draw of
# 16,384 took 0.65x the time per index; in case (a), one chain's
# jax_data.scan with counter / exact streams was 1.19x, 1.13x, 1.06x and
# 1.06x with draws of 1, 2, 5 and 10 chunks (N = 1e4, 9 paired repeats).
_DRAW_WORDS = 32_768
_U32 = 0xFFFFFFFF

# The least hash blocks (of _HASH_BLOCK or _BLOCK indices) a thread draws.
_BLOCKS_PER_PART = 2


def _in_one_part(work: Callable[[int, int], None], size: int,
                 least: int) -> None:
  del least
  work(0, size)


def _scale(split: Optional[Split], size: int) -> int:
  """How many times the usual block a draw of ``size`` indices takes."""
  large = _SPLIT_BLOCKS * _BLOCK * _BLOCKS_PER_PART * 2
  return _SPLIT_BLOCKS if split is not None and size >= large else 1


def _prefix(tag: int, seed: int) -> int:
  """The hash state after absorbing ``tag`` and the seed's two words
  (``counter_streams._absorb``'s first three steps), as a Python int."""
  h = cs.GOLDEN
  for word in (tag, seed & _U32, seed >> 32):
    h = cs.mix_int(((h ^ word) * cs.GOLDEN) & _U32)
  return h


def _absorb_into(x: np.ndarray, word: Any, tmp: np.ndarray) -> None:
  """``x = mix((x ^ word) * GOLDEN)`` in place (``word``: a scalar or an
  array that broadcasts to ``x``; 0 is skipped, XOR with it changes
  nothing)."""
  if not (np.ndim(word) == 0 and int(word) == 0):
    np.bitwise_xor(x, word, out=x)
  np.multiply(x, np.uint32(cs.GOLDEN), out=x)
  np.right_shift(x, np.uint32(16), out=tmp)
  np.bitwise_xor(x, tmp, out=x)
  np.multiply(x, np.uint32(0x85EBCA6B), out=x)
  np.right_shift(x, np.uint32(13), out=tmp)
  np.bitwise_xor(x, tmp, out=x)
  np.multiply(x, np.uint32(0xC2B2AE35), out=x)
  np.right_shift(x, np.uint32(16), out=tmp)
  np.bitwise_xor(x, tmp, out=x)


def _remainder(x: np.ndarray, n: Any, out: np.ndarray) -> np.ndarray:
  """``x % n`` into ``out`` for unsigned ``x`` and ``n``: NumPy divides by
  a scalar through libdivide, about 8x faster than its remainder."""
  np.floor_divide(x, n, out=out)
  np.multiply(out, n, out=out)
  return np.subtract(x, out, out=out)


# Rejected hashes drawn again one by one with Python ints up to this many
# (a few per draw of 16,384 at n = 1e6): NumPy's calls on a few values cost
# more than the arithmetic, about 50 us for the hash's 70 calls.
_FEW_REJECTED = 64


def _redrawn(seeds: Sequence[int], starts: Sequence[int], chain: np.ndarray,
             column: np.ndarray, n: int) -> np.ndarray:
  """``uniform(seeds[c], starts[c] + k, n)`` at the rejected ``(c, k)``:
  the first later attempt whose hash is below the limit, reduced."""
  if chain.size > _FEW_REJECTED:
    return cs.uniform(uint32_words(np.asarray(seeds, np.uint64)[chain]),
                      np.asarray(starts, np.int64)[chain] + column, n)
  wide = n > 2**32
  span = 2**64 if wide else 2**32
  limit = span - span % n
  values = []
  for c, k in zip(chain.tolist(), column.tolist()):
    position = starts[c] + k
    tail = (position & _U32, position >> 32)
    low = _prefix(cs.TAG_UNIFORM_LO, seeds[c])
    high = _prefix(cs.TAG_UNIFORM_HI, seeds[c])
    seed = (seeds[c] & _U32, seeds[c] >> 32)
    attempt, h = 0, limit
    while h >= limit:
      attempt += 1
      h = _absorbed_int(low, tail + (attempt,) + seed)
      if n > cs.PAIRED_ABOVE:
        h = cs.combined_hash(h, _absorbed_int(high, tail + (attempt,) + seed),
                             n)
    values.append(h % n)
  # As uniform's astype: n above 2**63 is beyond int64 (and any index).
  return np.asarray(values, np.uint64).astype(np.int64)


def _absorbed_int(h: int, words: Sequence[int]) -> int:
  """The hash state ``h`` after absorbing ``words`` (``_absorb``'s steps,
  on Python ints)."""
  for word in words:
    h = cs.mix_int(((h ^ word) * cs.GOLDEN) & _U32)
  return h


def uniform_runs(seeds: Sequence[int], starts: Sequence[int], length: int,
                 n: int, split: Optional[Split] = None) -> np.ndarray:
  """``uniform(seeds[c], starts[c] + arange(length), n)`` for every ``c``
  (:func:`jax_data.streams.counter_streams.uniform`, the same values): shape
  ``(C, length)``, int64, the chains' blocks drawn through ``split``
  (default: all at once). ``seeds`` and ``starts`` may be arrays (uint64,
  int64): nothing then runs per chain in Python.
  ``starts[c] + length`` must stay below ``2**63``."""
  seeds, starts = _uint64(seeds), np.asarray(_uint64(starts), np.int64)
  chains = seeds.size
  out = np.empty((chains, length), np.int64)
  if not chains or not length:
    return out
  wide = n > 2**32
  span = 2**64 if wide else 2**32
  limit = span - span % n
  prefix = _prefixes(cs.TAG_UNIFORM_LO, seeds)
  paired = n > cs.PAIRED_ABOVE
  prefix_high = _prefixes(cs.TAG_UNIFORM_HI, seeds) if paired else None
  seed_lo, seed_hi = uint32_words(seeds)
  lows = (starts & _U32).astype(np.uint32)
  highs = (starts >> 32).astype(np.uint32)
  # A run whose low words wrap past 2**32 changes its high word midway:
  # those few chains take the general function.
  crossing = np.flatnonzero((starts & _U32) + length > 2**32).tolist()
  block = _HASH_BLOCK * _scale(split, chains * length)
  rows = max(1, min(chains, block // length))
  cols = min(length, block)
  count = np.arange(length, dtype=np.uint32)
  rejected = []  # (chains, columns) of hashes at or above limit

  def draw(first: int, last: int) -> None:  # chains first .. last - 1
    x = np.empty((rows, cols), np.uint32)
    tmp = np.empty_like(x)
    y = np.empty_like(x) if paired else None
    with np.errstate(over="ignore"):
      for c0 in range(first, last, rows):
        c1 = min(last, c0 + rows)
        for k0 in range(0, length, cols):
          k1 = min(length, k0 + cols)
          h, t = x[:c1 - c0, :k1 - k0], tmp[:c1 - c0, :k1 - k0]
          words = (count[k0:k1], lows[c0:c1, None], highs[c0:c1, None],
                   seed_lo[c0:c1, None], seed_hi[c0:c1, None])
          _hash_into(h, t, *words, prefix[c0:c1, None])
          if paired:
            h = cs.combined_hash(h, _hash_into(
                y[:c1 - c0, :k1 - k0], t, *words,
                prefix_high[c0:c1, None]), n)
          if wide:
            reduced, dtype = _remainder(h, np.uint64(n), np.empty_like(h)), (
                np.uint64)
          else:
            dtype = np.uint32
            reduced = h if n == span else _remainder(
                h, np.uint32(n), tmp[:c1 - c0, :k1 - k0])
          out[c0:c1, k0:k1] = reduced
          # Drawn again below: rare (below n / 2**32 of them). The maximum
          # first, and flat positions: of a block of 16,384, max took 2 us,
          # flatnonzero 4 us and a two-dimensional nonzero 36 us.
          if limit < span and h.max() >= dtype(limit):
            at_rows, at_cols = np.divmod(np.flatnonzero(h >= dtype(limit)),
                                         k1 - k0)
            rejected.append((at_rows + c0, at_cols + k0))

  (split or _in_one_part)(draw, chains, rows * _BLOCKS_PER_PART)
  if rejected:
    chain, column = (np.concatenate(parts) for parts in zip(*rejected))
    out[chain, column] = _redrawn(seeds.tolist(), starts.tolist(), chain,
                                  column, n)
  for c in crossing:
    out[c] = cs.uniform(int(seeds[c]), int(starts[c]) + np.arange(length), n)
  return out


def _hash_into(h: np.ndarray, tmp: np.ndarray, count: np.ndarray,
               lows: np.ndarray, highs: np.ndarray, seed_lo: np.ndarray,
               seed_hi: np.ndarray, prefix: np.ndarray) -> np.ndarray:
  """:func:`~jax_data.streams.counter_streams.uniform_hash` of attempt 0
  at positions ``lows + count`` (low words, wrapping like uint32) and
  ``highs`` of the seeds of words ``seed_lo`` and ``seed_hi``, whose
  ``prefix`` is given, into ``h`` (returned)."""
  np.add(count, lows, out=h)
  np.bitwise_xor(h, prefix, out=h)
  # (prefix ^ low) then the mix: _absorb_into with the XOR done.
  _absorb_into(h, 0, tmp)
  _absorb_into(h, highs if highs.any() else 0, tmp)
  _absorb_into(h, 0, tmp)  # attempt 0
  _absorb_into(h, seed_lo, tmp)  # the seed's words again
  _absorb_into(h, seed_hi if seed_hi.any() else 0, tmp)
  return h


def _uint64(values: Sequence[int]) -> np.ndarray:
  """Non-negative integers as a uint64 array (Python ints one by one: a
  list may hold values above 2**63)."""
  if isinstance(values, np.ndarray):
    return values.astype(np.uint64, copy=False)
  return np.asarray([int(v) for v in values], np.uint64)


def _prefixes(tag: int, seeds: np.ndarray) -> np.ndarray:
  """:func:`_prefix` of every seed (uint64), as uint32: 1,024 chains'
  prefixes in Python took 1.5 ms, most of a draw of one batch each."""
  h = np.full(seeds.shape, cs.GOLDEN, np.uint32)
  tmp = np.empty_like(h)
  with np.errstate(over="ignore"):
    for word in (np.uint32(tag),) + uint32_words(seeds):
      _absorb_into(h, word, tmp)
  return h


def chain_batches(seeds: Sequence[int], firsts: Sequence[int], count: int,
                  mb_size: int, n: int, shuffle: bool, in_epochs: bool,
                  start: int = 0, columns: Optional[slice] = None,
                  split: Optional[Split] = None
                  ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
  """Indices (``(C, count, mb_size)``, int64) and mask (the same shape, or
  None when every position is valid) of batches ``firsts[c] ..
  firsts[c] + count - 1`` of the counter-based stream of seed ``seeds[c]``,
  for ``C`` chains that share the rest: row ``c`` equals
  ``stream_batches(seeds[c], firsts[c], count, mb_size, n, shuffle,
  in_epochs, start)``. With ``columns`` (a slice of ``0 .. mb_size``),
  only those columns of each batch, computed alone: what one device's part
  of a batch needs. Many chains' indices are drawn through ``split``.
  """
  if shuffle and len(seeds) == 1:
    # One chain: epoch by epoch, tabulated.
    indices, mask = cs.stream_batches(int(seeds[0]), int(firsts[0]), count,
                                      mb_size, n, shuffle, in_epochs, start,
                                      columns=columns)
    return indices[None], None if mask is None else mask[None]
  seeds = _uint64(seeds)
  firsts = np.asarray(_uint64(firsts), np.int64)
  chains = seeds.size
  cols = np.arange(mb_size, dtype=np.int64)[
      slice(None) if columns is None else columns]
  width = cols.size
  if shuffle:
    block = _BLOCK * _scale(split, chains * count * width)
    indices, mask = shuffled_batches(seeds, firsts, count, mb_size, n,
                                     in_epochs, cols, split, block,
                                     _BLOCKS_PER_PART)
  else:
    with np.errstate(over="ignore"):  # uint32 arithmetic wraps
      if columns is None:  # a run per chain
        indices = uniform_runs(seeds, firsts * mb_size, count * mb_size, n,
                               split)
      else:  # a run per batch, of its consecutive columns
        if columns.step not in (None, 1):
          raise ValueError(f"columns must be consecutive, got {columns}")
        batches = firsts[:, None] + np.arange(count, dtype=np.int64)
        indices = uniform_runs(np.repeat(seeds, count),
                               (batches * mb_size + cols[0]).reshape(-1),
                               width, n, split)
    indices, mask = indices.reshape(chains, count, width), None
  if start:
    indices += start
  return indices, mask


def _changed_stream(saved: str, verb: str, version: int,
                    why: Optional[str], before: str) -> str:
  """The message that refuses a position of a stream that has changed."""
  return (f"the position was saved with {saved} (jax_data before {before}), "
          f"and this jax_data {verb} version {version}, "
          f"{why or 'another stream'}; from it the chain would go on with "
          "other batches than it would have. Start the chain anew")


class CounterStream:
  """Random mini-batch indices of a counter-based stream: batch ``j`` is a
  pure function of (seed, ``j``), so the position is the batch count and
  any position is reached at once. The interface of
  :class:`jax_data.streams.sampling.RandomStream`, in O(1) memory.
  """

  def __init__(self, observations: Any, mb_size: int, seed: int,
               shuffle: bool, in_epochs: bool):
    self.observations = observations
    self.mb_size = mb_size
    self.seed = seed
    self.shuffle = shuffle
    self.in_epochs = in_epochs
    self._batch = 0
    # Batches drawn ahead: (first batch, columns, indices, mask or None).
    self._drawn: Optional[Tuple[int, Optional[slice], np.ndarray,
                                Optional[np.ndarray]]] = None

  @property
  def mode(self) -> str:
    return random_mode(self.shuffle, self.in_epochs)

  def get_state(self) -> dict:
    state = {"stream": "counter", "mode": self.mode, "seed": self.seed,
             "batch": self._batch}
    # Each mode's stream changed once: the independent draws' hash, the
    # shuffled streams' permutations.
    if self.shuffle:
      state["permutation"] = cs.PERMUTE_VERSION
    else:
      state["draws"] = cs.UNIFORM_VERSION
    return state

  def set_state(self, state: dict) -> None:
    position_fields(state)  # a dict
    if state.get("stream") != "counter":
      raise ValueError(
          "the position is one of an exact stream (stream='exact'), but "
          "this chain draws a counter-based stream (stream='counter')")
    if state.get("mode") != self.mode:
      raise ValueError(
          f"state is for a chain in mode {state.get('mode')!r}, but this "
          f"chain is in mode {self.mode!r}")
    draws = check_int("draws", state.get("draws", 1), minimum=1)
    if not self.shuffle and draws != cs.UNIFORM_VERSION:
      raise ValueError(_changed_stream(
          f"version {draws} of the counter-based independent draws",
          "draws", cs.UNIFORM_VERSION, cs.UNIFORM_CHANGES.get(draws),
          "2026-11-28" if draws == 1 else "2026-11-30"))
    permutation = check_int("permutation", state.get("permutation", 1),
                            minimum=1)
    if self.shuffle and permutation != cs.PERMUTE_VERSION:
      raise ValueError(_changed_stream(
          f"version {permutation} of the counter-based shuffled streams",
          "shuffles with", cs.PERMUTE_VERSION,
          cs.PERMUTE_CHANGES.get(permutation),
          "2026-11-29" if permutation == 1 else "2026-11-30"))
    seed, batch = position_fields(state, "seed", "batch")
    seed = check_int("seed", seed, minimum=0, maximum=2**64 - 1)
    # Positions of the stream (batch * mb_size) are int64.
    # last_batch + 1: the stream's end, after its last batch.
    batch = check_int("batch", batch, minimum=0,
                      maximum=self.last_batch + 1)
    self.seed, self._batch = seed, batch
    self._drawn = None  # another seed, perhaps

  def seek_batch(self, batch: int) -> None:
    """Moves to batch ``batch`` of the stream."""
    self._batch = batch

  def trim(self) -> None:
    """Drops the batches drawn ahead."""
    self._drawn = None

  def held_bytes(self) -> int:
    drawn = self._drawn
    return 0 if drawn is None else sum(
        a.nbytes for a in drawn[2:] if a is not None)

  @property
  def last_batch(self) -> int:
    """The stream's last batch: positions (batch * mb_size) are int64."""
    return (2**63 - 1) // self.mb_size

  def advance(self, count: int) -> int:
    """Moves past the next ``count`` batches; returns the first of them
    (whose indices :func:`stream_batches` then gives).

    Raises:
      ValueError: the stream ends before them (:attr:`last_batch`).
    """
    if self._batch + count > self.last_batch + 1:
      raise ValueError(
          f"a counter-based stream ends at batch {self.last_batch} (its "
          f"positions, batch * mb_size, are int64); batches {self._batch} "
          f"to {self._batch + count - 1} were asked for")
    first, self._batch = self._batch, self._batch + count
    return first

  def draw(self, count: int, columns: Optional[slice] = None
           ) -> Tuple[np.ndarray, Any]:
    """Indices of the next ``count`` batches (only ``columns`` of each, if
    given), and their mask (None when every position is valid)."""
    first = self.advance(count)
    drawn = self._drawn
    if drawn is None or drawn[1] != columns or not (
        drawn[0] <= first and first + count <= drawn[0] + len(drawn[2])):
      # The same values as drawn one call at a time: batch j's indices are
      # a function of (seed, j) alone.
      width = len(range(self.mb_size)[columns or slice(None)])
      ahead = min(max(1, _DRAW_WORDS // max(1, count * width)) * count,
                  self.last_batch + 1 - first)
      indices, mask = chain_batches(
          [self.seed], [first], ahead, self.mb_size,
          self.observations.count, self.shuffle, self.in_epochs,
          self.observations.start, columns)
      drawn = self._drawn = (first, columns, indices[0],
                             None if mask is None else mask[0])
    at = slice(first - drawn[0], first - drawn[0] + count)
    return drawn[2][at], None if drawn[3] is None else drawn[3][at]
