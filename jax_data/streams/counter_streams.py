"""Counter-based index streams: a batch's indices are a pure function of
(seed, position), in O(1) memory, with no replay to reach any position.

Three modes, as the exact streams of :mod:`jax_data.streams.sampling` have:

* independent draws: position ``t`` of the stream is observation
  ``uniform(seed, t)``, a keyed hash reduced modulo ``n`` with the few
  hashes that would bias it rejected, so exactly uniform over
  ``0 .. n - 1``;
* shuffling: the stream is the concatenation of permutations, epoch ``e``
  being ``permute(seed, e, .)`` of ``0 .. n - 1``: position ``t`` is
  ``permute(seed, t // n, t % n)``;
* shuffling in epochs: epoch ``e`` is served in ``ceil(n / mb)`` batches,
  the last padded with observation 0 and masked.

For ``n`` above :data:`SORTED_UP_TO`, ``permute`` is a keyed bijection of
``[0, 2**b)``, ``2**b`` the power of two at or above ``n``, restricted to
``[0, n)`` by cycle-walking: an index that lands outside is permuted again
until it lands inside, which keeps a bijection of ``[0, n)``. The
bijection is a Feistel network on two halves of ``b // 2`` and
``b - b // 2`` bits that alternately XORs a keyed mix of one half into the
other, for :data:`ROUNDS` half-rounds. Such a network is an even
permutation, so a key's bit then swaps observations 0 and 1 (half the
epochs odd). Up to :data:`SORTED_UP_TO` observations, where a Feistel
network reaches few permutations, an epoch is the order of ``n`` keyed
hashes instead. ``docs/counter_streams.rst`` gives the argument and the
tests of quality.

Every operation is on ``uint32`` words (wrapping multiplication, shifts,
XOR), so NumPy on the host and ``jax.numpy`` on the device compute the same
indices bit for bit; only assembling an index above ``2**32`` needs 64-bit
integers, which only the host has.
"""

from __future__ import annotations

import operator
from typing import Any
from typing import Optional
from typing import Tuple

import numpy as np

from jax_data.validation import check_bool
from jax_data.validation import check_int

#: Half-rounds of the Feistel network: each half is mixed into the other
#: six times. With eight (four rounds of the classic network, Luby and
#: Rackoff's bound for random round functions) consecutive pairs of its
#: permutations of 8 elements failed a chi-square test (p = 2e-8); with
#: twelve they passed.
ROUNDS = 12
#: Epochs of at most this many observations are the order of ``n`` keyed
#: hashes (:func:`sorted_permutations`) rather than a Feistel network's:
#: on domains of 16 or fewer elements the network left epochs of 5 to 8
#: observations far from uniform over the ``n!`` permutations.
SORTED_UP_TO = 16

_U32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
# Tags that keep the hashes of the two modes and of their words apart.
TAG_PERMUTE = 0x243F6A88
TAG_PERMUTE_HI = 0x082EFA98
TAG_UNIFORM_LO = 0x85A308D3
TAG_UNIFORM_HI = 0x13198A2E
#: Above this many observations an independent draw's hash is that of
#: two 32-bit hashes of (seed, position, attempt) under two tags
#: (:func:`combined_hash`): the first alone is a bijection of the
#: position's low word, so draws from it alone would repeat an observation
#: less often than draws with replacement do, by the factor
#: ``1 - n / 2**32`` (at most 0.4 % here); and above ``2**32`` an index
#: needs more than its 32 bits.
PAIRED_ABOVE = 1 << 24
#: The version of the independent draws' hash: 2 since it absorbs the
#: seed's state again after the position (2026-11-28); 3 since above
#: :data:`PAIRED_ABOVE` observations its second word is a hash of the
#: draw's own (2026-11-30: it was a function of the first word, which left
#: a third of the observations unreachable at ``2**32`` and all but
#: ``2**32`` of them above); 4 since it absorbs the seed's words again,
#: not the 32-bit state they left (2026-11-30: seeds that left the same
#: state drew the same stream). Positions and checkpoints saved without a
#: version were drawn with 1.
UNIFORM_VERSION = 4
#: The version of the shuffled streams' permutations: 2 since epochs of at
#: most :data:`SORTED_UP_TO` observations are sorted hashes and a key's bit
#: swaps observations 0 and 1 of the others (2026-11-29); 3 since the keys
#: absorb the seed's state again after the epoch, and are keyed by two
#: hashes of 32 bits (2026-11-30: the epochs of two seeds were each
#: other's, at epoch numbers XORed by a constant). Positions and
#: checkpoints saved without a version were shuffled with 1.
PERMUTE_VERSION = 3


#: What each earlier version of the independent draws lacked, and of the
#: permutations (for the messages that refuse their positions).
UNIFORM_CHANGES = {
    1: "which no longer gives one seed's batches to another in another "
       "order",
    2: "whose draws over more than 2**24 observations are uniform, and "
       "whose seeds' streams are their own",
    3: "whose seeds' streams are their own (in version 3 a seed drew the "
       "stream of 2**32 - 1 others)"}
PERMUTE_CHANGES = {
    1: "whose epochs of up to 16 observations are uniform and of more are "
       "odd as often as even, and whose seeds' epochs are their own",
    2: "whose seeds' epochs are their own (those of version 2 served "
       "another seed's epochs at other epoch numbers)"}


def domain_bits(n: int) -> int:
  """``b``: the bits of the bijection's domain ``[0, 2**b)``, the smallest
  power of two at or above ``n``, and at least 4 elements."""
  # Integer arithmetic: float log2 rounds n = 2**50 + 1 (and many above
  # 2**49) down to a whole number, a domain too small for n.
  return max(2, (operator.index(n) - 1).bit_length())


def _words(value: int) -> Tuple[int, int]:
  """Low and high 32-bit words of a non-negative integer below ``2**64``."""
  return value & _U32, (value >> 32) & _U32


def _mix(x: Any, xp: Any) -> Any:
  """MurmurHash3's 32-bit finaliser: a bijection of ``uint32`` whose every
  output bit depends on every input bit."""
  x = x ^ (x >> xp.uint32(16))
  x = x * xp.uint32(0x85EBCA6B)
  x = x ^ (x >> xp.uint32(13))
  x = x * xp.uint32(0xC2B2AE35)
  return x ^ (x >> xp.uint32(16))


def _absorb(words: Tuple[Any, ...], xp: Any) -> Any:
  """A 32-bit hash of several ``uint32`` words (arrays or scalars): each is
  XORed into the state and mixed."""
  h = xp.uint32(GOLDEN)
  for word in words:
    h = _mix((h ^ word) * xp.uint32(GOLDEN), xp)
  return h


def _u32(value: Any, xp: Any) -> Any:
  return xp.asarray(value, dtype=xp.uint32)


def _seed_words(seed: Any, xp: Any) -> Tuple[Any, Any]:
  """A seed's low and high ``uint32`` words: of a Python int below
  ``2**64``, or the two words of a (traced) ``uint32[2]`` array, as a
  device-resident chain's state holds them."""
  if isinstance(seed, (int, np.integer)):
    return tuple(_u32(w, xp) for w in _words(int(seed)))
  return seed[0].astype(xp.uint32), seed[1].astype(xp.uint32)


def round_keys(seed: int, epoch: Any, xp: Any = np) -> list:
  """The keys of the permutation of ``epoch`` of ``seed``: the
  :data:`ROUNDS` round keys of the network, then the finishing key, whose
  low bit swaps observations 0 and 1 (:func:`finish`).

  ``seed`` may be a Python int (below ``2**64``) or, with NumPy, a pair of
  ``uint32`` arrays of seeds' low and high words (one seed per epoch of an
  array ``epoch``). ``epoch`` may be a Python int (below ``2**64``), an
  int64 array (one epoch per index, NumPy) or, with ``xp`` =
  ``jax.numpy``, ``uint32`` (traced) values.
  """
  _check_seed(seed)
  seed_lo, seed_hi = _seed_words(seed, xp)
  if isinstance(epoch, (int, np.integer)):
    epoch_lo, epoch_hi = (_u32(w, xp) for w in _words(int(epoch)))
  elif xp is np:  # an array of epochs, one per offset
    epoch = np.asarray(epoch, np.int64).astype(np.uint64)
    epoch_lo = (epoch & np.uint64(_U32)).astype(np.uint32)
    epoch_hi = (epoch >> np.uint64(32)).astype(np.uint32)
  else:
    epoch_lo, epoch_hi = _u32(epoch, xp), _u32(0, xp)
  first, second = (_epoch_state(tag, seed_lo, seed_hi, epoch_lo, epoch_hi,
                                xp)
                   for tag in (TAG_PERMUTE, TAG_PERMUTE_HI))
  golden = xp.uint32(GOLDEN)
  return [_mix((_mix((first ^ _u32(r, xp)) * golden, xp) ^ second) * golden,
               xp) for r in range(ROUNDS + 1)]


def _epoch_state(tag: int, seed_lo: Any, seed_hi: Any, epoch_lo: Any,
                 epoch_hi: Any, xp: Any) -> Any:
  """A 32-bit hash of (seed, epoch) under ``tag``: the tag and the seed's
  words absorbed (the ``prefix``), the epoch's, then the prefix again.
  Without the last, the state after a seed XORed with the epoch's low
  word, so the epochs of two seeds were each other's at epoch numbers
  XORed by a constant; :func:`round_keys` derives the keys from two such
  hashes, 64 bits, so that epochs of different chains collide no more
  often than 64-bit keys do."""
  prefix = _absorb((_u32(tag, xp), seed_lo, seed_hi), xp)
  h = prefix
  for word in (epoch_lo, epoch_hi, prefix):
    h = _mix((h ^ word) * xp.uint32(GOLDEN), xp)
  return h


def mix_int(x: int) -> int:
  """:func:`_mix` of a Python int below ``2**32``: the same value, without
  NumPy's per-call cost (a key is 17 of them)."""
  x ^= x >> 16
  x = (x * 0x85EBCA6B) & _U32
  x ^= x >> 13
  x = (x * 0xC2B2AE35) & _U32
  return x ^ (x >> 16)


def round_keys_int(seed: int, epoch: int) -> list:
  """:func:`round_keys` of one epoch, as Python ints (the same values):
  the hashes of the words they share are taken once."""
  states = []
  for tag in (TAG_PERMUTE, TAG_PERMUTE_HI):
    prefix = GOLDEN
    for word in (tag, *_words(seed)):
      prefix = mix_int(((prefix ^ word) * GOLDEN) & _U32)
    h = prefix
    for word in (*_words(epoch), prefix):
      h = mix_int(((h ^ word) * GOLDEN) & _U32)
    states.append(h)
  first, second = states
  return [mix_int(((mix_int(((first ^ r) * GOLDEN) & _U32) ^ second)
                   * GOLDEN) & _U32) for r in range(ROUNDS + 1)]


# A chunk whose offsets fall in at most this many epochs is permuted epoch
# by epoch with scalar keys; more (tiny n), with one key per offset.
_EPOCHS_ONE_BY_ONE = 8


def _feistel(left: Any, right: Any, keys: list, bits: int, xp: Any
             ) -> Tuple[Any, Any]:
  """The network on halves ``left`` (``bits // 2`` bits) and ``right``
  (the rest), with the round keys of :func:`round_keys`'s ``keys``."""
  low = bits - bits // 2
  left_mask = xp.uint32((1 << (bits // 2)) - 1)
  right_mask = xp.uint32((1 << low) - 1)
  for r, key in enumerate(keys[:ROUNDS]):
    if r % 2 == 0:
      left = left ^ (_mix(right ^ key, xp) & left_mask)
    else:
      right = right ^ (_mix(left ^ key, xp) & right_mask)
  return left, right


#: The most values of a half (2**(bits - bits // 2)) for which the host
#: tabulates the round functions of an epoch (see round_tables).
TABLE_MAX = 1 << 12


def round_tables(keys: list, bits: int) -> list:
  """The round functions of :func:`_feistel` for one epoch's keys as
  tables over every value of the half they read: a half-round is then one
  lookup and one XOR instead of eleven NumPy calls. The same values, for
  halves of at most 12 bits (``n`` up to ``2**24``), where the tables are
  small next to a chunk's indices. With keys that are arrays of ``E``
  (one per (chain, epoch) entry), round ``r``'s table holds every entry's
  function, entry ``e``'s at ``e * 2**half`` onwards (flat)."""
  low = bits - bits // 2
  words = np.asarray(keys[:ROUNDS], np.uint32)[..., None]
  # Even half-rounds read the right half and write the left; odd ones the
  # other way round. All rounds of a kind in one (rounds, ..., values)
  # array.
  even = _mix(np.arange(1 << low, dtype=np.uint32) ^ words[0::2], np) & (
      np.uint32((1 << (bits // 2)) - 1))
  odd = _mix(np.arange(1 << (bits // 2), dtype=np.uint32) ^ words[1::2],
             np) & np.uint32((1 << low) - 1)
  return [(even if r % 2 == 0 else odd)[r // 2].reshape(-1)
          for r in range(ROUNDS)]


def finish(values: Any, key: Any, xp: Any = np) -> Any:
  """The network's permuted ``values`` with observations 0 and 1 swapped
  where the finishing ``key`` (:func:`round_keys`'s last; a scalar or one
  per value) is odd. A Feistel network whose round functions are XORed
  into halves of two bits or more is an even permutation of ``[0, 2**b)``,
  and cycle-walking left the parity of other ``n`` lopsided (22 % to 97 %
  odd): with the swap half the epochs are odd. NumPy arrays change in
  place (the few values below 2 are found first); ``jax.numpy`` returns
  the new values."""
  if xp is not np:
    return values ^ xp.where(values < 2, key & xp.uint32(1),
                             xp.uint32(0)).astype(values.dtype)
  at = np.flatnonzero(values.reshape(-1) < 2)
  if at.size:
    flat = values.reshape(-1)
    odd = key[at] if np.ndim(key) else key
    flat[at] ^= (np.asarray(odd) & 1).astype(values.dtype)
  return values


def sorted_permutations(first: Any, second: Any, n: int) -> np.ndarray:
  """Permutations of ``0 .. n - 1`` (``n`` at most :data:`SORTED_UP_TO`),
  one per pair of keys ``first`` and ``second`` (:func:`round_keys`'s
  first two, arrays of any shape): ``(..., n)`` int64, the order of the
  ``n`` hashes of the indices (:func:`_index_hashes`). That hash is a
  bijection of the index for given keys, so the ``n`` hashes differ and
  their order is one permutation; the device counts ranks instead of
  sorting (:func:`_sorted_at`), the same values. Keyed by 64 bits, it
  reaches every permutation of up to 16 elements (``16!`` is below
  ``2**45``); over 2,000,000 epochs the permutations of 2 to 8 elements
  passed a chi-square test of uniformity."""
  return np.argsort(_index_hashes(first, second, n, np), axis=-1)


def _index_hashes(first: Any, second: Any, n: int, xp: Any) -> Any:
  """``(..., n)``: the hash of each index ``0 .. n - 1`` under each pair
  of keys, a bijection of the index."""
  index = xp.arange(n, dtype=xp.uint32)
  golden = xp.uint32(GOLDEN)
  h = _mix((xp.asarray(first)[..., None] ^ index) * golden, xp)
  return _mix((h ^ xp.asarray(second)[..., None]) * golden, xp)


def _sorted_at(first: Any, second: Any, offsets: Any, n: int) -> Any:
  """:func:`sorted_permutations`' element at each of ``offsets`` (one
  pair of keys each), in ``jax.numpy``: the index whose hash has
  ``offset`` hashes below it. XLA's sort on the CPU took 58-206 µs a step
  for 16 chains' batches of 8-16 over 12-16 observations; counting ranks,
  ``n**2`` comparisons an offset, takes a few."""
  import jax.numpy as jnp
  h = _index_hashes(first, second, n, jnp)
  rank = (h[..., None, :] < h[..., :, None]).sum(-1, dtype=jnp.uint32)
  return jnp.sum(jnp.where(rank == offsets[..., None],
                           jnp.arange(n, dtype=jnp.uint32), jnp.uint32(0)),
                 axis=-1, dtype=jnp.uint32)


def feistel_tables_into(left: np.ndarray, right: np.ndarray, tables: list,
                        looked_up: np.ndarray) -> None:
  """:func:`_feistel` through :func:`round_tables`, on ``left`` and
  ``right`` in place (``looked_up``: an array of their size to look up
  into): a half-round is one lookup and one XOR, two NumPy calls."""
  for r, table in enumerate(tables):
    read, write = (right, left) if r % 2 == 0 else (left, right)
    np.take(table, read, out=looked_up, mode="clip")
    np.bitwise_xor(write, looked_up, out=write)


def _feistel_tables(left: np.ndarray, right: np.ndarray, tables: list
                    ) -> Tuple[np.ndarray, np.ndarray]:
  """:func:`feistel_tables_into` on copies of the halves."""
  left, right = left.copy(), right.copy()
  feistel_tables_into(left, right, tables, np.empty_like(left))
  return left, right


def _split(values: Any, bits: int, xp: Any) -> Tuple[Any, Any]:
  low = bits - bits // 2
  if xp is np:
    values = values.astype(np.uint64)
    return ((values >> np.uint64(low)).astype(np.uint32),
            (values & np.uint64((1 << low) - 1)).astype(np.uint32))
  values = values.astype(xp.uint32)
  return values >> xp.uint32(low), values & xp.uint32((1 << low) - 1)


def _join(left: Any, right: Any, bits: int, xp: Any) -> Any:
  low = bits - bits // 2
  if xp is np:
    return ((left.astype(np.uint64) << np.uint64(low))
            | right.astype(np.uint64)).astype(np.int64)
  return ((left << xp.uint32(low)) | right).astype(xp.uint32)


def permute(seed: int, epoch: Any, offsets: Any, n: int, xp: Any = np
            ) -> Any:
  """``permute(seed, epoch, offsets)``: the observations at ``offsets`` (in
  ``0 .. n - 1``) of epoch ``epoch``'s permutation of ``0 .. n - 1``.

  NumPy returns int64; ``jax.numpy`` (``n`` at most ``2**32``) uint32.
  Traced offsets (inside ``jit``) cannot be checked: those outside
  ``0 .. n - 1`` give unspecified values.

  Raises:
    ValueError: concrete offsets outside ``0 .. n - 1`` (one past the
      domain cycle-walked for ever, one in ``[n, 2**b)`` gave an
      observation twice), or an epoch or a seed outside
      ``0 .. 2**64 - 1``; with ``jax.numpy``, concrete epochs in an array
      past ``2**32 - 1`` (uint32 there).
    TypeError: offsets, or a seed, that are not integers.
  """
  n = _check_n(n)
  bits = domain_bits(n)
  _check_size(n, bits, xp)
  _check_seed(seed)
  _check_range("offsets", offsets, n - 1, f"n - 1 (n={n})")
  _check_epoch(epoch)
  if np.ndim(epoch):
    try:
      np.broadcast_shapes(np.shape(epoch), np.shape(offsets))
    except ValueError:
      raise ValueError(
          f"epoch and offsets must broadcast together, got epoch of shape "
          f"{np.shape(epoch)} and offsets of shape {np.shape(offsets)}"
          ) from None
  if xp is not np and not isinstance(epoch, (int, np.integer)):
    # Arrays of epochs are uint32 on the device: 2**33 was epoch 0.
    _check_range("epoch", epoch, 2**32 - 1,
                 "2**32 - 1 as an array with jax.numpy (a Python int "
                 "takes all 64 bits)")
  if xp is np:
    offsets = np.asarray(offsets)
    if np.ndim(epoch):
      epoch = np.broadcast_to(epoch, offsets.shape).reshape(-1)
    with np.errstate(over="ignore"):
      return _permute_host(seed, epoch, offsets.reshape(-1), n,
                           bits).reshape(offsets.shape)
  keys = round_keys(seed, epoch, xp)
  if n <= SORTED_UP_TO:
    offsets = offsets.astype(xp.uint32)
    return _sorted_at(*(xp.broadcast_to(k, offsets.shape) for k in keys[:2]),
                      offsets, n)
  # A traced offset outside [0, n) might never walk back inside (one past
  # the domain never does): it starts from 0 instead.
  # The last offset, not n, bounds them: n = 2**32 is no uint32.
  last = xp.uint32(n - 1)
  offsets = offsets.astype(xp.uint32)
  offsets = xp.where(offsets <= last, offsets, xp.uint32(0))
  left, right = _split(offsets, bits, xp)
  left, right = _feistel(left, right, keys, bits, xp)
  from jax import lax

  def walk(halves):
    left, right = halves
    outside = _join(left, right, bits, xp) > last
    l2, r2 = _feistel(left, right, keys, bits, xp)
    return xp.where(outside, l2, left), xp.where(outside, r2, right)

  left, right = lax.while_loop(
      lambda h: xp.any(_join(h[0], h[1], bits, xp) > last), walk,
      (left, right))
  return finish(_join(left, right, bits, xp), keys[ROUNDS], xp)


def _permute_host(seed: int, epoch: Any, offsets: np.ndarray, n: int,
                  bits: int) -> np.ndarray:
  if n <= SORTED_UP_TO and np.ndim(epoch):
    # One permutation per epoch that occurs; each offset is looked up in
    # its epoch's.
    epochs, which = np.unique(epoch, return_inverse=True)
    keys = round_keys(seed, epochs, np)
    return sorted_permutations(keys[0], keys[1], n)[which, offsets]
  if not np.ndim(epoch):
    return permute_keyed(round_keys_int(int(seed), int(epoch)), offsets,
                         n, bits)
  low, high = (int(e) for e in (epoch.min(), epoch.max())) if epoch.size \
      else (0, 0)
  if high - low >= _EPOCHS_ONE_BY_ONE:
    return permute_keyed(round_keys(seed, epoch, np), offsets, n, bits)
  values = np.empty(offsets.shape, np.int64)
  for each in range(low, high + 1):
    chosen = np.flatnonzero(epoch == each) if high > low else slice(None)
    values[chosen] = permute_keyed(round_keys_int(int(seed), each),
                                   offsets[chosen], n, bits)
  return values


def permute_keyed(keys: list, offsets: np.ndarray, n: int, bits: int
                  ) -> np.ndarray:
  """The network on ``offsets`` (flat, on the host), with cycle-walking:
  ``permute`` once the round keys are known. ``keys``: the
  :func:`round_keys` of one epoch as Python ints (whose round functions
  are tabulated where a half's values are few next to the offsets), or
  arrays with one key per offset. ``bits``: ``domain_bits(n)``."""
  if n <= SORTED_UP_TO:
    first, second = (np.asarray(k, np.uint32) for k in keys[:2])
    if not first.ndim:
      return sorted_permutations(first, second, n)[offsets]
    return np.take_along_axis(sorted_permutations(first, second, n),
                              offsets[:, None], axis=-1)[:, 0]
  left, right = _split(offsets, bits, np)
  low = bits - bits // 2

  def network(left, right, at):  # ``at``: the offsets' positions, or None
    if tables is not None:
      return _feistel_tables(left, right, tables)
    some = keys if at is None else [k[at] if np.ndim(k) else k
                                    for k in keys]
    return _feistel(left, right, some, bits, np)

  tables = None
  if not np.ndim(keys[0]) and offsets.size >= (1 << low) <= TABLE_MAX:
    tables = round_tables(keys, bits)
  left, right = network(left, right, None)
  values = _join(left, right, bits, np)
  outside = np.flatnonzero(values >= n)
  while outside.size:
    # Cycle-walking: those outside [0, n) go round the permutation of
    # [0, 2**b) again; each lands inside with probability n / 2**b, above
    # 1/2 for n of 3 or more.
    l2, r2 = network(left[outside], right[outside], outside)
    left[outside], right[outside] = l2, r2
    again = _join(l2, r2, bits, np)
    values[outside] = again
    outside = outside[again >= n]
  return finish(values, keys[ROUNDS])


def uniform(seed: Any, positions: Any, n: int, xp: Any = np) -> Any:
  """Observations drawn uniformly from ``0 .. n - 1`` (with replacement) at
  stream ``positions``: a keyed hash of (seed, position, attempt) of 32 bits
  (64 for ``n`` above ``2**32``) reduced modulo ``n``; an attempt at or
  above the largest multiple of ``n`` the hash can reach is rejected and
  the next taken, so the draw is exactly uniform (a rejection has
  probability below ``n / 2**32``).

  A hash (:func:`uniform_hash`) absorbs the seed's state again after the
  position: without that, the stream of one seed was the stream of another
  with positions XORed by a constant (chains drawing each other's batches
  in another order). Above :data:`PAIRED_ABOVE` observations it is
  :func:`combined_hash` of two such hashes: no longer a bijection of the
  position, and of 64 bits above ``2**32`` observations.

  NumPy takes int64 positions below ``2**63`` and a Python int seed, or a
  pair of ``uint32`` arrays of the seeds' low and high words, one seed per
  position; ``jax.numpy`` ``uint32`` positions, or a pair of arrays of
  their low and high ``uint32`` words, and ``n`` below ``2**32``.

  Raises:
    ValueError: concrete positions below 0 (they wrapped round to others),
      or past ``2**32 - 1`` with ``jax.numpy`` (uint32 there; a pair of
      words takes more), or a seed outside ``0 .. 2**64 - 1`` (it was
      another seed, modulo ``2**64``).
    TypeError: positions, or a seed, that are not integers.
  """
  n = _check_n(n)
  _check_size(n, domain_bits(n), xp)
  _check_seed(seed)
  if isinstance(positions, tuple) and xp is np:
    raise TypeError(
        "positions given as a tuple are their (low, high) uint32 words, "
        "which only jax.numpy takes; NumPy takes int64 positions: give a "
        f"list or an array, got positions={positions!r:.200}")
  if not isinstance(positions, tuple):
    _check_range("positions", positions, 2**63 - 1, "2**63 - 1")
    if xp is not np:
      # uint32 on the device: 2**32 + 1 was position 1.
      _check_range("positions", positions, 2**32 - 1,
                   "2**32 - 1 with jax.numpy (or give their (low, high) "
                   "uint32 words as a tuple)")
  if xp is np:
    positions = np.asarray(positions, np.int64)
    with np.errstate(over="ignore"):
      return _uniform(seed, positions.reshape(-1), n,
                      np).reshape(positions.shape)
  return _uniform(seed, positions, n, xp)


def _uniform(seed: Any, positions: Any, n: int, xp: Any) -> Any:
  seed_lo, seed_hi = _seed_words(seed, xp)
  if isinstance(positions, tuple):  # the device's (low, high) words
    pos_lo, pos_hi = positions
  elif xp is np:
    positions = positions.astype(np.uint64)
    pos_lo = (positions & np.uint64(_U32)).astype(np.uint32)
    pos_hi = (positions >> np.uint64(32)).astype(np.uint32)
  else:
    pos_lo = positions.astype(xp.uint32)
    pos_hi = xp.zeros_like(pos_lo)
  wide = n > 2**32  # the host only
  span = 2**64 if wide else 2**32
  limit = span - span % n  # hashes below it reduce uniformly

  def draw(attempt: Any, some=None):
    words = (seed_lo, seed_hi, pos_lo, pos_hi)
    if some is not None:  # seeds are scalars, or arrays like the positions
      words = tuple(w if w.ndim == 0 else w[some] for w in words)
    low = uniform_hash(TAG_UNIFORM_LO, *words, attempt, xp)
    if n <= PAIRED_ABOVE:
      return low
    return combined_hash(low, uniform_hash(TAG_UNIFORM_HI, *words, attempt,
                                           xp), n, xp)

  if xp is np:
    hashes = draw(np.uint32(0))
    dtype = np.uint64 if wide else np.uint32
    outside = (np.flatnonzero(hashes >= dtype(limit)) if limit < span
               else np.empty(0, np.int64))
    attempt = 0
    while outside.size:  # rare: at most n / 2**32 of the draws
      attempt += 1
      again = draw(np.uint32(attempt), outside)
      hashes[outside] = again
      outside = outside[again >= dtype(limit)]
    if n < span:  # n = 2**32 keeps the hash as it is
      hashes = hashes % dtype(n)
    return hashes.astype(np.int64)
  from jax import lax

  if limit == span:  # n a power of two: no hash is rejected
    hashes = draw(xp.uint32(0))
    return hashes if n == span else hashes % xp.uint32(n)

  def step(carry):
    attempt, hashes = carry
    fresh = draw(attempt + xp.uint32(1))
    return attempt + xp.uint32(1), xp.where(hashes >= xp.uint32(limit),
                                             fresh, hashes)

  _, hashes = lax.while_loop(
      lambda c: xp.any(c[1] >= xp.uint32(limit)), step,
      (xp.uint32(0), draw(xp.uint32(0))))
  return hashes % xp.uint32(n)


def uniform_hash(tag: int, seed_lo: Any, seed_hi: Any, pos_lo: Any,
                 pos_hi: Any, attempt: Any, xp: Any) -> Any:
  """The 32-bit hash of an independent draw: ``tag``, the seed's words,
  the position's words and the attempt absorbed, then the seed's words
  again. Absorbed again, the 32-bit state the seed left (version 3) made
  two seeds that left the same state draw the same stream (seed 1 and
  2658119697165189120, and any seed with 2**32 - 1 others); before that
  (version 1), a seed's stream was another's at positions XORed by a
  constant."""
  h = _absorb((_u32(tag, xp), seed_lo, seed_hi), xp)
  for word in (pos_lo, pos_hi, attempt, seed_lo, seed_hi):
    h = _mix((h ^ word) * xp.uint32(GOLDEN), xp)
  return h


def combined_hash(low: Any, high: Any, n: int, xp: Any = np) -> Any:
  """An independent draw's hash over ``n`` observations, above
  :data:`PAIRED_ABOVE`, from its two :func:`uniform_hash` words ``low``
  (tag :data:`TAG_UNIFORM_LO`) and ``high`` (:data:`TAG_UNIFORM_HI`),
  Python ints or arrays: up to ``2**32`` observations ``low ^ high``,
  which is not a bijection of the position (an observation repeats as
  with replacement); above, the 64-bit ``high << 32 | low ^ high`` (a
  bijection of the pair, with low bits of that kind too). (Up to
  :data:`PAIRED_ABOVE` the hash is ``low`` alone.)"""
  if isinstance(low, int):
    return (low ^ high) if n <= 2**32 else (high << 32) | (low ^ high)
  if n <= 2**32:
    return low ^ high
  return ((high.astype(np.uint64) << np.uint64(32))
          | (low ^ high).astype(np.uint64))


def _traced(value: Any) -> bool:
  import jax
  return isinstance(value, jax.core.Tracer)


def _check_range(name: str, values: Any, high: int, bound: str) -> None:
  """Raises unless the integers ``values`` (NumPy's, concrete JAX ones)
  are in ``0 .. high`` (``bound`` spells ``high``), naming ``name`` and
  those outside: one min and one max. Traced values cannot be read, and
  pass."""
  if _traced(values):
    return
  values = np.asarray(values)
  if values.dtype.kind not in "iu":
    raise TypeError(f"{name} must be integers, got {name} of dtype "
                    f"{values.dtype}: {name}={values!r}")
  if not values.size or (values.min() >= 0 and values.max() <= high):
    return
  if values.size <= 8:
    shown = f"{name}={values.tolist()}"
  else:
    bad = np.unique(values[(values < 0) | (values > high)])
    shown = (f"{values.size} {name} of which {bad[:5].tolist()}"
             f"{' and more' if bad.size > 5 else ''} lie outside")
  raise ValueError(f"{name} must be in 0 .. {bound}, got {shown}")


def _check_seed(seed: Any) -> None:
  """Raises for a seed that is neither an integer in ``0 .. 2**64 - 1``
  nor seeds' ``uint32`` words (a pair of arrays, or an array of the two
  words, as the chains hold them): -1 was seed ``2**64 - 1``, ``2**64 + 7``
  seed 7, and a float or a string failed deep inside."""
  if isinstance(seed, tuple):
    if len(seed) != 2 or not all(
        hasattr(word, "dtype") and np.dtype(word.dtype).kind == "u"
        for word in seed):
      raise TypeError(
          "seed given as a tuple must be the seeds' (low, high) uint32 "
          f"words, two arrays, got seed={seed!r:.200}")
    return
  if np.ndim(seed) > 0 and hasattr(seed, "dtype"):
    return
  check_int("seed", seed, minimum=0, maximum=2**64 - 1)


def _check_n(n: Any) -> int:
  """``n`` as an int, or raises naming it: a float or a string failed
  deep inside, and True was taken for 1."""
  return check_int("n", n)


def _check_epoch(epoch: Any) -> None:
  """Raises for a concrete epoch below 0 or above ``2**64 - 1`` (it stood
  for another epoch, modulo ``2**64``)."""
  if _traced(epoch):
    return
  if np.ndim(epoch):
    _check_range("epoch", epoch, 2**64 - 1, "2**64 - 1")
  else:
    check_int("epoch", epoch, minimum=0, maximum=2**64 - 1)


def _check_size(n: int, bits: int, xp: Any) -> None:
  """Raises for an ``n`` the host's int64 indices cannot hold (they would
  come out negative), or above the device's ``2**32``."""
  if not 0 < n < 2**63:
    raise ValueError(
        f"counter streams need 1 <= n < 2**63 observations (int64 "
        f"indices), got n={n}")
  if xp is not np and bits > 32:
    raise ValueError(
        f"counter streams on the device need at most 2**32 observations, "
        f"got n={n}")


def stream_batches(seed: int, first: Any, count: int, mb_size: int, n: int,
                   shuffle: bool, in_epochs: bool, start: int = 0,
                   xp: Any = np, columns: Optional[slice] = None
                   ) -> Tuple[Any, Any]:
  """Indices (``(count, mb_size)``) and mask (None: all valid) of batches
  ``first .. first + count - 1`` of a counter-based stream; with
  ``columns`` (NumPy only), only those columns of each batch.

  NumPy takes a Python int ``first``; ``jax.numpy`` a ``uint32`` (traced)
  value, with ``n`` at most ``2**32`` and positions below ``2**32``; its
  indices are int32, or uint32 where ``start + n`` passes ``2**31``.

  Raises:
    ValueError: a seed outside ``0 .. 2**64 - 1``, a negative ``count``
      or ``first`` (NumPy), ``mb_size`` below 1, or with ``jax.numpy``
      ``start + n`` past ``2**32``.
    TypeError: a seed, ``count``, ``mb_size`` or ``first`` that is not an
      integer, or ``shuffle`` or ``in_epochs`` not True or False.
  """
  _check_seed(seed)
  n = _check_n(n)
  count = check_int("count", count, minimum=0)
  mb_size = check_int("mb_size", mb_size, minimum=1)
  shuffle = check_bool("shuffle", shuffle)
  in_epochs = check_bool("in_epochs", in_epochs)
  start = check_int("start", start, minimum=0)
  if columns is not None and (xp is not np
                              or not isinstance(columns, slice)):
    raise TypeError(
        "columns must be a slice of each batch's columns, with NumPy only "
        f"(xp=numpy), got columns={columns!r}" + (
            "" if xp is np else f" with xp={getattr(xp, '__name__', xp)}"))
  if xp is np:
    first = check_int("first", first, minimum=0)
    if (first + count) * mb_size > 2**63 - 1:
      raise ValueError(
          f"batches first .. first + count - 1 of mb_size observations "
          f"have positions past 2**63 - 1 (int64), got first={first}, "
          f"count={count} and mb_size={mb_size}")
    steps = np.arange(count * mb_size, dtype=np.int64).reshape(count,
                                                               mb_size)
    if columns is not None:
      steps = steps[:, columns]
  else:
    if start + n > 2**32:  # uint32 indices there
      raise ValueError(
          f"counter streams with jax.numpy draw indices below 2**32, got "
          f"start={start} and n={n} (start + n = {start + n})")
    steps = xp.arange(count * mb_size, dtype=xp.uint32).reshape(count,
                                                                mb_size)
  if not shuffle:
    indices = uniform(seed, first * mb_size + steps, n, xp)
    return _shifted(indices, start, n, xp), None
  if not in_epochs:
    positions = first * mb_size + steps
    epochs, offsets = _divmod(positions, n, xp)
    return _shifted(permute(seed, epochs, offsets, n, xp), start, n,
                    xp), None
  per_epoch = -(-n // mb_size)
  batches = first + (xp.arange(count, dtype=np.int64 if xp is np
                               else xp.uint32))
  epochs, within = _divmod(batches, per_epoch, xp)
  positions = within[:, None] * mb_size + steps[:1]
  if xp is np:
    valid = positions < n
  else:
    # A batch's first position is below n; its padding may pass 2**32
    # (n near it), where uint32 wraps: valid is told without the sum.
    valid = steps[:1] <= xp.uint32(n - 1) - within[:, None] * xp.uint32(
        mb_size)
  indices = permute(seed, epochs[:, None] + 0 * positions,
                    xp.where(valid, positions, 0), n, xp)
  return _shifted(xp.where(valid, indices, 0), start, n, xp), valid


# On the device (uint32 values), n and the batches of an epoch may pass
# int32 (a Python int above 2**31 - 1 was parsed as one: an OverflowError)
# and reach 2**32 (no uint32): these take them as uint32 or, at 2**32, by
# what they are.
def _divmod(values: Any, n: int, xp: Any) -> Tuple[Any, Any]:
  if xp is np:
    return values // n, values % n
  if n == 2**32:  # every uint32 is below it
    return xp.zeros_like(values), values
  return values // xp.uint32(n), values % xp.uint32(n)


def _shifted(indices: Any, start: int, n: int, xp: Any) -> Any:
  if xp is np:
    return indices + start if start else indices
  if start + n <= 2**31:
    return indices.astype(xp.int32) + start
  # Indices past int32: uint32 (int32 gave them negative).
  return indices.astype(xp.uint32) + xp.uint32(start)
