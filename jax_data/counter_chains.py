"""The counter-based batches of many chains in one vectorised draw.

A refresh of ``C`` vmapped chains asks for a chunk of every chain at once.
Drawn chain by chain (:func:`jax_data.counter_streams.stream_batches`),
each chunk costs about a hundred NumPy calls on a few hundred indices, so
the calls' overhead, not the arithmetic, sets the pace, and 1,024 chains
pay it 1,024 times. :func:`chain_batches` draws the same indices, bit for
bit, for all chains in one pass: the same NumPy calls on ``C`` times as
many indices, the round keys of each (chain, epoch) hashed once.

Pure NumPy, on the host.
"""

from __future__ import annotations

from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data import counter_streams as cs

# Indices permuted per pass: the temporaries of one pass (a few dozen
# arrays of this many words) stay in the caches; 1,024 chunks of 640
# indices took 0.75x the time of one pass over all of them.
_BLOCK = 65_536


def _words(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Low and high ``uint32`` words of non-negative integers (``uint64``)."""
  values = values.astype(np.uint64)
  return ((values & np.uint64(0xFFFFFFFF)).astype(np.uint32),
          (values >> np.uint64(32)).astype(np.uint32))


def chain_batches(seeds: Sequence[int], firsts: Sequence[int], count: int,
                  mb_size: int, n: int, shuffle: bool, in_epochs: bool,
                  start: int = 0) -> Tuple[np.ndarray, Optional[np.ndarray]]:
  """Indices (``(C, count, mb_size)``, int64) and mask (the same shape, or
  None when every position is valid) of batches ``firsts[c] ..
  firsts[c] + count - 1`` of the counter-based stream of seed ``seeds[c]``,
  for ``C`` chains that share the rest: row ``c`` equals
  ``stream_batches(seeds[c], firsts[c], count, mb_size, n, shuffle,
  in_epochs, start)``.
  """
  seeds = np.asarray([int(s) for s in seeds], np.uint64)
  firsts = np.asarray([int(f) for f in firsts], np.int64)
  chains = seeds.size
  with np.errstate(over="ignore"):  # uint32 arithmetic wraps
    if not in_epochs:
      steps = np.arange(count * mb_size, dtype=np.int64)
      positions = firsts[:, None] * mb_size + steps  # (C, rows)
      if shuffle:
        indices = _permute(seeds, positions // n, positions % n, n)
      else:
        seed_lo, seed_hi = (np.repeat(w, positions.shape[1])
                            for w in _words(seeds))
        indices = cs.uniform((seed_lo, seed_hi), positions.reshape(-1), n)
      mask = None
    else:
      per_epoch = -(-n // mb_size)
      batches = firsts[:, None] + np.arange(count, dtype=np.int64)
      epochs = np.repeat(batches // per_epoch, mb_size, axis=1)
      offsets = ((batches % per_epoch)[:, :, None] * mb_size
                 + np.arange(mb_size)).reshape(chains, -1)
      mask = offsets < n
      indices = _permute(seeds, epochs, np.where(mask, offsets, 0), n)
      indices = np.where(mask.reshape(-1), indices, 0)
      mask = mask.reshape(chains, count, mb_size)
  indices = indices.reshape(chains, count, mb_size)
  return (indices + start if start else indices), mask


def _permute(seeds: np.ndarray, epochs: np.ndarray, offsets: np.ndarray,
             n: int) -> np.ndarray:
  """``permute(seeds[c], epochs[c, i], offsets[c, i], n)`` for every ``c``
  and ``i``, flat. The round keys are hashed once per (chain, epoch) that
  occurs, a chain's epochs being consecutive: ``epochs[c]`` is
  non-decreasing and spans few values unless ``n`` is tiny."""
  chains = seeds.size
  low = epochs.min(axis=1)
  width = int((epochs.max(axis=1) - low).max()) + 1
  # Table entry c * width + k: the keys of chain c's epoch low[c] + k.
  seed_lo, seed_hi = (np.repeat(w, width) for w in _words(seeds))
  table_epochs = (low[:, None] + np.arange(width)).reshape(-1)
  table = cs.round_keys((seed_lo, seed_hi), table_epochs, np)
  entry = (np.arange(chains)[:, None] * width + (epochs - low[:, None])
           ).reshape(-1)
  offsets, bits = offsets.reshape(-1), cs.domain_bits(n)
  values = np.empty(offsets.size, np.int64)
  for low in range(0, offsets.size, _BLOCK):
    part = slice(low, low + _BLOCK)
    values[part] = cs.permute_keyed([np.take(k, entry[part]) for k in table],
                                    offsets[part], n, bits)
  return values
