"""Index streams of host chains: which observations each batch holds.

Pure NumPy, no JAX. A stream draws the indices of the next ``count`` batches,
and its whole position is a small, JSON-compatible dict (``get_state`` /
``set_state``), so the host bridge can snapshot it cheaply before every chunk
and regenerate any chunk later. The streams follow ``spec/SAMPLING.md``
exactly: users moving from the data-loading guide's library get the same
batches for the same seeds.

A stream works on the observations ``start .. start + count - 1`` of its
loader, so a chain can be restricted to one shard of the data.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data.validation import check_int

Indices = np.ndarray  # shape=(count, mb_size), int64
Mask = np.ndarray  # shape=(count, mb_size), bool


def default_rng(seed: int) -> np.random.Generator:
  """The generator of a random chain with seed ``seed`` (SAMPLING.md)."""
  return np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])


def position_fields(state: Any, *names: str) -> Tuple[Any, ...]:
  """The values of ``names`` in a stream's position ``state`` (from a
  checkpoint or ``load_state``: a dict that may have been edited).

  Raises:
    ValueError: ``state`` is not a dict, or lacks one of ``names``.
  """
  if not isinstance(state, dict):
    raise ValueError(f"a stream's position is a dict, got {state!r:.200}")
  missing = [name for name in names if name not in state]
  if missing:
    raise ValueError(f"the stream's position {state!r:.200} has no "
                     + ", ".join(map(repr, missing)))
  return tuple(state[name] for name in names)


def checked_rng(value: Any) -> Dict[str, Any]:
  """A copy of ``value`` if it is the state of a PCG64 generator (the
  ``rng`` of an exact stream's position).

  Raises:
    ValueError: it is not, naming it.
  """
  probe = np.random.PCG64(0)  # seeded: no draw from the OS's entropy
  try:
    probe.state = value
  except (TypeError, ValueError, KeyError, OverflowError) as e:
    raise ValueError(f"rng must be the state of a PCG64 generator, got "
                     f"rng={value!r:.200} ({type(e).__name__}: {e})"
                     ) from None
  return copy.deepcopy(value)


def _state_key(state: Dict[str, Any]) -> Tuple[int, ...]:
  inner = state["state"]
  return (inner["state"], inner["inc"], state["has_uint32"],
          state["uinteger"])


#: The length of the endless stream that a random chain reads from a source
#: of unknown length (``TensorflowDataLoader`` over a pipeline of unknown
#: or infinite cardinality): its passes, one after the other, as one pass
#: that never ends. Large enough never to be reached.
ENDLESS = 2**62


@dataclasses.dataclass(frozen=True)
class ObservationRange:
  """The observations a chain draws from: ``start .. start + count - 1``,
  shard ``shard_index`` of ``shard_count`` (0 of 1: all of them)."""
  start: int
  count: int
  shard_index: int = 0
  shard_count: int = 1

  @classmethod
  def from_arguments(cls, observation_count: int, shard_index: Any,
                     shard_count: Any) -> "ObservationRange":
    """All observations, or the shard named by user arguments (checked).

    Raises:
      ValueError, TypeError: only one of the two given, or out of range.
    """
    if shard_index is None and shard_count is None:
      return cls(0, observation_count)
    if shard_index is None or shard_count is None:
      raise ValueError(
          "shard_index and shard_count go together, got "
          f"shard_index={shard_index!r}, shard_count={shard_count!r}")
    shard_count = check_int("shard_count", shard_count, minimum=1,
                            maximum=observation_count,
                            what="the observation count")
    shard_index = check_int("shard_index", shard_index, minimum=0,
                            maximum=shard_count - 1,
                            what="shard_count - 1 =")
    return cls.shard(observation_count, shard_index, shard_count)

  @classmethod
  def shard(cls, observation_count: int, shard_index: int,
            shard_count: int) -> "ObservationRange":
    """Contiguous shard ``shard_index`` of ``shard_count`` equal-sized parts.

    Shards are disjoint and cover all observations; their sizes differ by at
    most one.
    """
    start = shard_index * observation_count // shard_count
    stop = (shard_index + 1) * observation_count // shard_count
    return cls(start, stop - start, shard_index, shard_count)


def random_mode(shuffle: bool, in_epochs: bool) -> str:
  """The name of a random chain's mode, as its stream's position holds it
  (exact and counter-based streams alike)."""
  if not shuffle:
    return "independent"
  return "epochs" if in_epochs else "shuffle"


class RandomStream:
  """Random mini-batch indices in one of three modes (SAMPLING.md).

  * independent draws (``shuffle=False``): ``rng.integers(0, n, mb)`` per
    batch, which equals ``rng.choice(n, mb, replace=True)``;
  * shuffling (``shuffle=True``): concatenated permutations
    ``rng.choice(n, n, replace=False)``, cut into batches of ``mb``;
  * shuffling in epochs (``shuffle=True, in_epochs=True``): one permutation
    per epoch, the last batch padded with observation 0 and masked.

  The position is ``(rng state before the current permutation, offset)``;
  the current permutation is re-drawn from that state when needed, so a
  snapshot never copies an O(n) array.
  """

  _PERMUTATIONS_KEPT = 2

  def __init__(self, observations: ObservationRange, mb_size: int, seed: int,
               shuffle: bool, in_epochs: bool):
    self.observations = observations
    self.mb_size = mb_size
    self.seed = seed
    self.shuffle = shuffle
    self.in_epochs = in_epochs
    self._rng = default_rng(seed)
    # For the shuffle modes: state before the current permutation is drawn,
    # and the next unserved position in it (a batch index in epoch mode).
    self._epoch_state = self._rng.bit_generator.state
    self._offset = 0
    # rng-state key -> (permutation, rng state after drawing it)
    self._permutations: Dict[Tuple[int, ...], Tuple[np.ndarray, Dict]] = {}

  @property
  def mode(self) -> str:
    return random_mode(self.shuffle, self.in_epochs)

  def get_state(self) -> Dict[str, Any]:
    """The stream's position as a small JSON-compatible dict (a copy)."""
    if self.shuffle:
      rng_state = copy.deepcopy(self._epoch_state)
    else:
      rng_state = self._rng.bit_generator.state
    return {"mode": self.mode, "seed": self.seed, "rng": rng_state,
            "offset": self._offset}

  def set_state(self, state: Dict[str, Any]) -> None:
    """Moves the stream to a position from ``get_state`` (not mutated).

    Raises:
      TypeError, ValueError: the position is not one of this chain's, or
        a field is missing, not an integer or out of range (named); the
        stream did not move.
    """
    position_fields(state)  # a dict
    if state.get("stream", "exact") != "exact":
      raise ValueError(
          "the position is one of a counter-based stream "
          "(stream='counter'), but this chain draws the exact stream "
          "(stream='exact')")
    if state.get("mode") != self.mode:
      raise ValueError(
          f"state is for a chain in mode {state.get('mode')!r}, but this "
          f"chain is in mode {self.mode!r}")
    seed, rng, offset = position_fields(state, "seed", "rng", "offset")
    seed = check_int("seed", seed, minimum=0)
    rng = checked_rng(rng)
    n = self.observations.count
    # The next position in the permutation; in epochs, the next batch.
    offsets = math.ceil(n / self.mb_size) if self.in_epochs else n
    offset = check_int("offset", offset, minimum=0,
                       maximum=offsets - 1 if self.shuffle else 0)
    self.seed = seed
    if self.shuffle:
      self._epoch_state, self._offset = rng, offset
    else:
      self._rng.bit_generator.state = rng

  def trim(self) -> None:
    """Drops the permutations kept for reuse (O(n) each); they are drawn
    again when needed."""
    self._permutations.clear()

  def held_bytes(self) -> int:
    """The bytes of the permutations kept for reuse."""
    return sum(perm.nbytes for perm, _ in self._permutations.values())

  def _permutation(self, rng_state: Dict) -> Tuple[np.ndarray, Dict]:
    """The permutation drawn from ``rng_state`` and the state after it."""
    key = _state_key(rng_state)
    cached = self._permutations.get(key)
    if cached is None:
      self._rng.bit_generator.state = rng_state
      n = self.observations.count
      perm = self._rng.choice(n, size=n, replace=False)
      cached = (perm, self._rng.bit_generator.state)
      if len(self._permutations) >= self._PERMUTATIONS_KEPT:
        self._permutations.pop(next(iter(self._permutations)))
      self._permutations[key] = cached
    return cached

  def draw(self, count: int) -> Tuple[Indices, Optional[Mask]]:
    """Indices of the next ``count`` batches, and their mask.

    The mask is None when every position is valid (all modes but epochs).
    """
    if not self.shuffle:
      # One call for all batches gives the same indices as one call per
      # batch (PCG64 keeps its spare 32 bits in its state), 20x faster.
      n, mb = self.observations.count, self.mb_size
      rows = self._rng.integers(0, n, size=(count, mb))
      if self.observations.start:
        rows += self.observations.start
      return rows, None
    if self.in_epochs:
      return self._draw_epochs(count)
    return self._draw_shuffled(count)

  def _draw_shuffled(self, count: int) -> Tuple[Indices, None]:
    n, mb = self.observations.count, self.mb_size
    needed = count * mb
    parts = []
    while needed > 0:
      perm, after = self._permutation(self._epoch_state)
      take = min(needed, n - self._offset)
      parts.append(perm[self._offset:self._offset + take])
      self._offset += take
      needed -= take
      if self._offset == n:
        self._epoch_state, self._offset = after, 0
    indices = np.concatenate(parts).reshape(count, mb)
    return indices + self.observations.start, None

  def _draw_epochs(self, count: int) -> Tuple[Indices, Mask]:
    n, mb = self.observations.count, self.mb_size
    batches_per_epoch = math.ceil(n / mb)
    indices = np.zeros((count, mb), dtype=np.int64)
    mask = np.zeros((count, mb), dtype=bool)
    for row in range(count):
      perm, after = self._permutation(self._epoch_state)
      first = self._offset * mb
      part = perm[first:first + mb]
      indices[row, :part.size] = part
      mask[row, :part.size] = True
      self._offset += 1
      if self._offset == batches_per_epoch:
        self._epoch_state, self._offset = after, 0
    # Padding is observation 0 of the chain's range, masked out.
    return indices + self.observations.start, mask


class OrderedStream:
  """Batches in order: every pass starts at observation 0 (SAMPLING.md).

  Batch ``j`` of a pass covers ``j * mb .. j * mb + mb - 1`` modulo the
  observation count; positions past the end are marked invalid. The position
  is the batch index within the current pass, so any chunk can be produced
  directly.
  """

  def __init__(self, observations: ObservationRange, mb_size: int,
               batches_per_pass: Optional[int] = None,
               fillers_from: Optional[int] = None):
    self.observations = observations
    self.mb_size = mb_size
    self.fillers_from = fillers_from  # see ordered_batches
    # More batches than the observations fill: the rest are all invalid
    # (a full-data pass padded to whole chunks, a device's share of a pass
    # split over a mesh axis).
    self.batches_per_pass = batches_per_pass or math.ceil(
        observations.count / mb_size)
    self._batch = 0

  def trim(self) -> None:
    """Nothing is kept: every batch is computed from its index."""

  def held_bytes(self) -> int:
    return 0

  def get_state(self) -> Dict[str, Any]:
    return {"mode": "ordered", "batch": self._batch}

  def set_state(self, state: Dict[str, Any]) -> None:
    position_fields(state)  # a dict
    if state.get("mode") != "ordered":
      raise ValueError(
          f"state is for a chain in mode {state.get('mode')!r}, but this "
          "chain is ordered")
    (batch,) = position_fields(state, "batch")
    self._batch = check_int("batch", batch, minimum=0) % self.batches_per_pass

  def draw(self, count: int) -> Tuple[Indices, Mask]:
    first, mb = self._batch, self.mb_size
    if (first + count) * mb <= self.observations.count:
      # Within the pass and all valid: a range, as ordered_batches gives it
      # but 10x faster (100 batches of 1,000: 0.48 ms of the producer's time
      # per chunk).
      low = self.observations.start + first * mb
      indices = np.arange(low, low + count * mb).reshape(count, mb)
      mask = np.ones((count, mb), bool)
    else:
      indices, mask = ordered_batches(first, count, mb, self.observations,
                                      batches_per_pass=self.batches_per_pass,
                                      fillers_from=self.fillers_from)
    self._batch = int((first + count) % self.batches_per_pass)
    return indices, mask


def ordered_batches(first: Any, count: int, mb_size: int,
                    observations: ObservationRange, xp: Any = np,
                    batches_per_pass: Optional[int] = None,
                    fillers_from: Optional[int] = None
                    ) -> Tuple[Any, Any]:
  """Indices and mask of ``count`` batches of the ordered stream, from
  batch ``first`` of a pass on (:class:`OrderedStream`).

  ``xp`` is the array module: NumPy on the host, ``jax.numpy`` for a
  device-resident loader (``first`` may then be traced). A pass of
  more ``batches_per_pass`` than the observations fill (a full-data pass
  padded to whole chunks, a device's share of a split pass) ends in whole
  invalid batches of its first observation alone, one row to read, not
  rows wrapped round to the pass's start. The fillers of the last batch
  are the observations from ``fillers_from`` on (a device's share of a
  split pass: the whole pass's first, as without a mesh); None: from the
  chain's first.
  """
  n = observations.count
  batches_per_pass = batches_per_pass or -(-n // mb_size)
  # Traced, in first's dtype: an int64 arange under x64 broke strict
  # dtype promotion (jax_numpy_dtype_promotion="strict").
  index = getattr(first, "dtype", None)
  batch = (first + xp.arange(count, dtype=index)) % batches_per_pass
  positions = (batch[:, None] * mb_size
               + xp.arange(mb_size, dtype=index)[None, :])
  indices = positions % n
  if fillers_from is not None:
    indices = xp.where(positions >= n,
                       positions - n + (fillers_from - observations.start),
                       indices)
  if batches_per_pass * mb_size >= n + mb_size:  # whole invalid batches
    indices = xp.where(batch[:, None] * mb_size >= n, 0 * indices, indices)
  return indices + observations.start, positions < n



class Held:
  """The element numbers a shuffle buffer holds: ``base + local``, where
  ``local`` (read-only, in the buffer's own integer type) numbers them
  within their pass and ``base`` is the pass's first element number. The
  buffer's array itself while it fills: 1,024 chains of 10,000 slots need
  no copy each of 80 KB to say what they hold.

  Args:
    local: The numbers within the pass, any order.
    base: The pass's first element number.
  """

  __slots__ = ("local", "base")

  def __init__(self, local: np.ndarray, base: int):
    self.local = local
    self.base = base

  @property
  def size(self) -> int:
    return self.local.size

  def max(self) -> int:
    """The greatest (there must be one)."""
    return int(self.local.max()) + self.base

  def min(self) -> int:
    """The least (there must be one)."""
    return int(self.local.min()) + self.base

  def numbers(self) -> np.ndarray:
    """The element numbers, int64, in the order held."""
    return np.add(self.local, self.base, dtype=np.int64)

  def split(self, horizon: int) -> Tuple[np.ndarray, Optional[int]]:
    """Those before element ``horizon``, sorted (int64), and the least of
    the others (None if none)."""
    before = self.local < _within(horizon - self.base, self.local.dtype)
    kept = np.add(np.sort(self.local[before]), self.base, dtype=np.int64)
    return kept, (None if kept.size == self.size
                  else int(self.local[~before].min()) + self.base)


class HeldRows:
  """Element numbers of one pass for several shuffles stepped together (the
  chains of a ``vmap``): row ``i`` of ``local`` plus ``base`` (see
  :class:`Held`), as one array; what each buffer holds, or what each
  emitted."""

  __slots__ = ("local", "base")

  def __init__(self, local: np.ndarray, base: int):
    self.local = local
    self.base = base

  def __len__(self) -> int:
    return len(self.local)

  def __getitem__(self, lane: int) -> Held:
    return Held(self.local[lane], self.base)

  def numbers(self) -> np.ndarray:
    """The element numbers, int64, a row each."""
    return np.add(self.local, self.base, dtype=np.int64)

  def max_each(self) -> np.ndarray:
    """Each row's greatest element number (int64)."""
    return np.add(self.local.max(axis=1), self.base, dtype=np.int64)

  def split_each(self, horizons: np.ndarray
                 ) -> Tuple[np.ndarray, np.ndarray, List[Optional[int]]]:
    """:meth:`Held.split` of each buffer at ``horizons[i]``, in a few array
    calls: those before, sorted and concatenated in buffer order (int64),
    how many each has there, and the least of each one's others."""
    local, base = self.local, self.base
    top = np.iinfo(local.dtype).max
    at = np.clip(np.asarray(horizons, np.int64) - base, -1, top)
    before = local < at.astype(local.dtype)[:, None]
    counts = np.count_nonzero(before, axis=1).astype(np.int64)
    ends = np.where(before, top, local).min(axis=1)
    rests = [None if count == local.shape[1] else end + base
             for count, end in zip(counts.tolist(), ends.tolist())]
    if not counts.any():
      return np.empty(0, np.int64), counts, rests
    # Those before first in each row, in order (few: the buffers' oldest).
    ordered = np.sort(np.where(before, local, top), axis=1)
    kept = ordered[np.arange(ordered.shape[1]) < counts[:, None]]
    return np.add(kept, base, dtype=np.int64), counts, rests


def _within(value: int, dtype: np.dtype) -> int:
  """``value`` clipped to ``dtype``'s range, less one below: the same
  comparisons with numbers of a pass (0 or more), without an integer too
  large for ``dtype``."""
  info = np.iinfo(dtype)
  return max(-1, min(value, int(info.max)))


def _fill_rows(buffers: np.ndarray, slots: np.ndarray, first_new: int
               ) -> np.ndarray:
  """Fill steps of shuffle buffers stepped together, a row each: step ``t``
  of row ``i`` emits the element in slot ``slots[i, t]`` of ``buffers[i]``
  and reads element ``first_new + t`` in its place (numbers within the
  pass). Returns what each step emits (row, step; the buffers' type) and
  leaves each buffer as its steps do.

  In a few array calls over all rows, not two per step: sorted by slot
  (stably, so in step order within a slot), the first draw of a slot
  emits what the buffer held, each later one the element read at the draw
  before, and the last leaves the element read then. 1,024 rows of 100
  slots took 6.8 ms for 640 steps in 20 calls against 6.4 ms in 1,280,
  and each call that releases the GIL may wait for it as long again
  beside busy threads. (The counts cost rows x slots: a chain stepped
  alone, whose buffer may be large, sorts its steps in
  ``BufferShuffle._fill``, whose cost is in its steps only.)"""
  lanes, steps = slots.shape
  size = buffers.shape[1]
  slot_type = np.int32 if lanes * size < 2**31 else np.int64
  # The draws of each slot of each row, and where they end sorted by slot.
  counts = np.bincount(
      (slots + np.arange(0, lanes * size, size, dtype=slot_type)[:, None]
       ).reshape(-1), minlength=lanes * size)
  ends = np.cumsum(counts)
  drawn = np.flatnonzero(counts)
  order = np.argsort(slots, axis=1, kind="stable")  # row: steps by slot
  read = order.astype(buffers.dtype).reshape(-1)  # read at each sorted draw
  read += first_new
  flat = buffers.reshape(-1)
  emitted = np.empty(lanes * steps, buffers.dtype)
  emitted[1:] = read[:-1]
  emitted[(ends - counts)[drawn]] = flat[drawn]
  flat[drawn] = read[ends[drawn] - 1]
  order += np.arange(0, lanes * steps, steps)[:, None]
  out = np.empty((lanes, steps), buffers.dtype)
  out.reshape(-1)[order.reshape(-1)] = emitted
  return out


class _Together:
  """What shuffles stepped together (chains of one ``vmap``,
  :meth:`BufferShuffle.take_and_hold_together`) keep, one array of each
  kind for all of them: each buffer is row ``lane`` of ``buffers`` (the
  shuffle's own buffer is a view of that row), and the slots drawn for
  their next fill steps, the same steps for all, are columns ``start ..``
  of ``ahead`` (block ``block``'s steps up to ``drawn``). A refresh of
  1,024 chains then costs a few array calls, not a few per chain (5-6 ms
  of Python and NumPy calls to take each chain's slots and stack its
  buffer, and as much to copy them back).

  Valid while its members move together: one that moves alone leaves
  (:meth:`BufferShuffle._leave`), taking its rows, and the others leave
  before they are stepped together again. ``broken``: a step failed part
  way, so its members' generators may stand anywhere in the block.
  """

  __slots__ = ("members", "buffers", "ahead", "start", "drawn", "block",
               "valid", "broken")

  def __init__(self, members: List["BufferShuffle"], buffers: np.ndarray,
               ahead: np.ndarray, drawn: int, block: Tuple[int, int]):
    self.members = members
    self.buffers = buffers
    self.ahead = ahead
    self.start = 0
    self.drawn = drawn
    self.block = block
    self.valid = True
    self.broken = False

  def holds(self, shuffles: Sequence["BufferShuffle"]) -> bool:
    """Whether it is valid and ``shuffles`` are its members, in order."""
    return (self.valid and len(shuffles) == len(self.members)
            and all(a is b for a, b in zip(shuffles, self.members)))

  def slots(self, k: int) -> np.ndarray:
    """The slots of every member's next ``k`` fill steps (member, step),
    in the block; more are drawn, ``BufferShuffle._AHEAD_BYTES`` or more a
    member, when those drawn run out."""
    if self.start + k > self.ahead.shape[1]:
      first = self.members[0]
      more = self.start + k - self.ahead.shape[1]
      more = min(max(more, first._AHEAD_BYTES // self.ahead.itemsize),  # pylint: disable=protected-access
                 first._BLOCK - self.drawn)  # pylint: disable=protected-access
      drawn = np.empty((len(self.members), more), self.ahead.dtype)
      for lane, member in enumerate(self.members):  # int64 one at a time
        drawn[lane] = member._rng.integers(0, member.buffer_size, more)  # pylint: disable=protected-access
      self.ahead = np.concatenate([self.ahead[:, self.start:], drawn],
                                  axis=1)
      self.start, self.drawn = 0, self.drawn + more
    slots = self.ahead[:, self.start:self.start + k]
    self.start += k
    return slots

  def nbytes_each(self) -> int:
    """A member's share of the bytes kept."""
    return (self.buffers.nbytes + self.ahead.nbytes) // len(self.members)


class BufferShuffle:
  """The order of a shuffle buffer over passes of ``count`` elements.

  Each pass streams the elements ``0 .. count - 1`` (in the source's order)
  through a buffer of ``buffer_size`` slots, as ``tf.data``'s ``shuffle``
  does: the buffer starts with the first ``buffer_size`` elements; each step
  emits the element of a uniformly drawn slot and puts the next element in
  its place; once the pass has no more elements, the buffer is emptied in
  a random order. Every pass emits every element exactly once, and step
  ``t`` only elements ``0 .. t + buffer_size - 1``. The buffer starts empty
  at each pass, so passes are independent.

  The slot drawn at fill step ``t`` of pass ``p`` is entry ``t % 2**16`` of
  ``default_rng([seed, p, 0, t // 2**16]).integers(0, buffer_size, 2**16)``
  and the emptying order is ``default_rng([seed, p, 1]).permutation(
  buffer_size)``, so a step's draw does not depend on how steps are
  grouped into chunks. Steps are computed a segment at a time with NumPy.

  Elements are numbered along the stream: element ``i`` of pass ``p`` is
  ``p * count + i``, the ``p * count + i``-th element a source reading
  pass after pass in order gives. The buffer holds ``i`` in the least
  signed type that holds the numbers of a pass (int32 below 2**31
  elements): 1,024 chains of 10,000 slots hold 39 MiB, not 78.
  """

  _BLOCK = 2**16

  def __init__(self, count: int, buffer_size: int, seed: int):
    self.count = count
    self.buffer_size = min(buffer_size, count)
    self.seed = seed
    # The generator of the slot draws of block ``_block`` (a (pass, block)
    # pair) and how many it has drawn; None: none yet.
    self._block: Optional[Tuple[int, int]] = None
    self._rng: Optional[np.random.Generator] = None
    self._drawn = 0
    self._slot_type = np.min_scalar_type(self.buffer_size - 1)
    # Slots drawn ahead: those of the block's fill steps _drawn -
    # _ahead.size .. _drawn - 1.
    self._ahead = np.empty(0, self._slot_type)
    self.position: Optional[int] = None  # steps emitted; None: unknown
    self._pass = 0
    self._step = 0
    # Per slot, the number within its pass of the element it holds.
    self._buffer: Optional[np.ndarray] = None
    # Every number of a pass below the type's greatest, which a horizon
    # past the pass is clipped to (Held.split).
    self._local_type = np.dtype(np.int32 if count < 2**31 else np.int64)
    # Stepped together with others: their state and this one's lane there.
    self._together: Optional[Tuple[_Together, int]] = None

  def seek(self, position: int) -> None:
    """Moves to step ``position`` of the stream (replays its pass)."""
    self._leave()
    self.position = None
    self._pass, step = divmod(position, self.count)
    self._step, self._buffer = 0, None
    self._advance(step)
    self.position = position

  def take(self, steps: int) -> np.ndarray:
    """The element numbers emitted by the next ``steps`` steps.

    Raises:
      RuntimeError: the position is unknown; :meth:`seek` first.
    """
    if self.position is None:
      raise RuntimeError("the stream's position is unknown; seek first")
    self._leave()
    position, self.position = self.position, None
    parts = self._advance(steps)
    self.position = position + steps
    return np.concatenate(parts) if parts else np.empty(0, np.int64)

  def held(self) -> Held:
    """The element numbers read into the buffer and not yet emitted, in no
    particular order: read-only, and valid until the stream moves (a view
    of the buffer while it fills)."""
    if self._buffer is None:
      return Held(np.empty(0, self._local_type), 0)
    base = self._pass * self.count
    drained = max(0, self._step - (self.count - self.buffer_size))
    if drained:
      order = self._drain_order()
      return Held(self._buffer[order[drained:]], base)
    view = self._buffer.view()
    view.setflags(write=False)
    return Held(view, base)

  # Shuffles stepped together (take_together) from this many on, with
  # their buffers' slots together at most this many (4 MiB of int32):
  # 1,024 of 100 slots took 8.4 against 22 ms for 640 steps (13.4 before
  # slots were drawn ahead), 256 4.8 against 5.8; 64 took 1.7 against
  # 1.4 ms, as a step costs a few NumPy calls.
  _TOGETHER_FROM = 256
  _TOGETHER_SLOTS = 2**20

  @classmethod
  def take_together(cls, shuffles: Sequence["BufferShuffle"], steps: int
                    ) -> Optional[np.ndarray]:
    """:meth:`take_and_hold_together`'s element numbers taken (int64)."""
    taken = cls.take_and_hold_together(shuffles, steps)
    return None if taken is None else taken[0].numbers()

  @classmethod
  def take_and_hold_together(cls, shuffles: Sequence["BufferShuffle"],
                             steps: int
                             ) -> Optional[Tuple[HeldRows, HeldRows]]:
    """The element numbers the next ``steps`` steps of each of
    ``shuffles`` emit (row ``i``: ``shuffles[i].take(steps)``, numbered
    within the pass in the buffers' type: half the bytes), computed for
    all of them at once in a few array calls (:class:`_Together`): where
    many shuffles (chains of one ``vmap``) stand at the same fill step of
    one pass, within one block of draws, and their buffers are small
    enough to stack. None otherwise, with nothing moved (take them one by
    one). With them, each buffer's element numbers afterwards (row ``i``:
    ``shuffles[i].held()``), one array for all of them.

    Raises:
      RuntimeError: a shuffle's position is unknown; :meth:`seek` first.
    """
    first = shuffles[0]
    if any(shuffle.position is None for shuffle in shuffles):
      raise RuntimeError("the stream's position is unknown; seek first")
    size, step = first.buffer_size, first._step
    if (len(shuffles) < cls._TOGETHER_FROM
        or len(shuffles) * size > cls._TOGETHER_SLOTS
        or step + steps > first.count - size  # the pass drains
        or step % cls._BLOCK + steps > cls._BLOCK):
      return None
    together = first._together
    group = None if together is None else together[0]
    if group is None or not group.holds(shuffles) or group.block != (
        first._pass, step // cls._BLOCK):
      group = cls._join(shuffles, steps)
      if group is None:
        return None
    try:
      out = _fill_rows(group.buffers, group.slots(steps), size + step)
    except BaseException:
      group.valid, group.broken = False, True
      for shuffle in shuffles:  # drew slots: they seek again
        shuffle.position = None
      raise
    for shuffle in shuffles:
      shuffle._step += steps
      shuffle.position += steps
    base = first._pass * first.count
    held = group.buffers.view()
    held.setflags(write=False)
    return HeldRows(out, base), HeldRows(held, base)

  @classmethod
  def _join(cls, shuffles: Sequence["BufferShuffle"], steps: int
            ) -> Optional[_Together]:
    """The shuffles stepped together from now on, at the same step of one
    pass (None if they are not: take them one by one): each leaves the
    group it was in, and the slots each drew ahead, topped up to the
    farthest draw, and the buffers become the new group's arrays."""
    first = shuffles[0]
    key = (first.count, first.buffer_size, first._pass, first._step,
           first.position)
    if any((shuffle.count, shuffle.buffer_size, shuffle._pass, shuffle._step,
            shuffle.position) != key for shuffle in shuffles):
      return None
    members = list(shuffles)
    try:
      rows = []
      for shuffle in members:
        shuffle._leave()
        if shuffle._buffer is None:
          shuffle._fill_buffer()
        rows.append(shuffle._slots(steps, draw_ahead=True))
      drawn = max(shuffle._drawn for shuffle in members)
      for lane, shuffle in enumerate(members):
        rows[lane] = np.concatenate([rows[lane], shuffle._ahead,
                                     shuffle._rng.integers(
                                         0, shuffle.buffer_size,
                                         drawn - shuffle._drawn).astype(
                                             shuffle._slot_type)])
      group = _Together(members, np.stack([shuffle._buffer
                                           for shuffle in members]),
                        np.stack(rows), drawn, first._block)
    except BaseException:
      for shuffle in members:  # drew slots: they seek again
        shuffle.position = None
      raise
    for lane, shuffle in enumerate(members):
      shuffle._buffer = group.buffers[lane]
      shuffle._together = (group, lane)
      # The group's now (its generator draws for the group).
      shuffle._block, shuffle._drawn = None, 0
      shuffle._ahead = np.empty(0, shuffle._slot_type)
    return group

  def _leave(self) -> None:
    """Out of the group it was stepped together with (if any), which ends:
    its buffer and the slots drawn for its next steps its own again."""
    together, self._together = self._together, None
    if together is None:
      return
    group, lane = together
    group.valid = False
    if self._buffer is not None:
      self._buffer = self._buffer.copy()
    if group.broken:  # the generator may stand anywhere: drawn anew
      self._block, self._rng, self._drawn = None, None, 0
      self._ahead = np.empty(0, self._slot_type)
    else:
      self._block, self._drawn = group.block, group.drawn
      self._ahead = group.ahead[lane, group.start:].copy()

  def trim(self) -> None:
    """Drops the buffer's slots (4 bytes each), the generator of slot
    draws and the draws made ahead; the position becomes unknown:
    :meth:`seek` computes them again."""
    self._leave()
    self.position = None
    self._block, self._rng, self._drawn = None, None, 0
    self._ahead = np.empty(0, self._slot_type)
    self._buffer = None

  def held_bytes(self) -> int:
    """The bytes of the buffer slots and the draws ahead kept (see
    :meth:`trim`); in a group stepped together, its share of the group's."""
    if self._together is not None:
      return self._together[0].nbytes_each()
    ahead = self._ahead
    held = (ahead if ahead.base is None else ahead.base).nbytes
    return held if self._buffer is None else held + self._buffer.nbytes

  def buffered(self) -> np.ndarray:
    """:meth:`held`'s element numbers, int64 (a copy: 80 KB a chain with
    10,000 slots)."""
    return self.held().numbers()

  def _advance(self, steps: int) -> List[np.ndarray]:
    parts = []
    size = self.buffer_size
    fill_steps = self.count - size
    while steps > 0:
      if self._buffer is None:
        self._fill_buffer()
      if self._step < fill_steps:
        in_block = self._BLOCK - self._step % self._BLOCK
        k = min(steps, fill_steps - self._step, in_block)
        parts.append(self._fill(k))
      else:
        drained = self._step - fill_steps
        k = min(steps, size - drained)
        parts.append(np.add(
            self._buffer[self._drain_order()[drained:drained + k]],
            self._pass * self.count, dtype=np.int64))
      self._step += k
      steps -= k
      if self._step == self.count:
        self._pass, self._step, self._buffer = self._pass + 1, 0, None
    return parts

  def _fill_buffer(self) -> None:
    """The buffer at its pass's start: the pass's first elements."""
    self._buffer = np.arange(self.buffer_size, dtype=self._local_type)

  def _drain_order(self) -> np.ndarray:
    return np.random.default_rng([self.seed, self._pass, 1]).permutation(
        self.buffer_size)

  # Slot draws made ahead by chains stepped together, at least this many
  # bytes' worth a chain: a call of ``integers`` cost about 5 us whatever
  # it drew, 5 ms a refresh of 1,024 chains that each drew the 640 slots
  # of a chunk. (Not for a chain stepped alone, whose steps cost more than
  # the call: 1,024 chains of 10,000 slots, too many to step together,
  # held 6-8 MiB more with them.)
  _AHEAD_BYTES = 4096

  def _slots(self, k: int, draw_ahead: bool = False) -> np.ndarray:
    """The slots drawn at the next ``k`` fill steps, all in one block
    (read-only); with ``draw_ahead``, more are drawn for the next steps.

    The block's draws come from a generator kept between calls, in pieces
    of ``k`` or more (the rest kept for the next steps): NumPy's
    ``integers`` draws one value after another from the bit generator,
    whose state carries any bits left over, so the pieces are the block's
    ``integers(0, buffer_size, 2**16)`` exactly. A chain keeps a
    generator and a few KiB of draws, not the block's 2**16 draws (64-512
    KiB, 64 MiB for 1,024 chains)."""
    block, first = divmod(self._step, self._BLOCK)
    ahead = self._ahead
    if (self._block != (self._pass, block)
        or self._drawn - ahead.size > first):
      self._block = (self._pass, block)
      self._rng = np.random.default_rng([self.seed, self._pass, 0, block])
      self._drawn, ahead = 0, np.empty(0, self._slot_type)
    if self._drawn < first:  # a seek within the block: draws passed over
      self._rng.integers(0, self.buffer_size, first - self._drawn)
      self._drawn, ahead = first, np.empty(0, self._slot_type)
    start = first - (self._drawn - ahead.size)  # step first in ahead
    if first + k > self._drawn:
      more = first + k - self._drawn
      if draw_ahead:
        more = min(max(more, self._AHEAD_BYTES // ahead.itemsize),
                   self._BLOCK - self._drawn)
      # In the least integer type that holds a slot: _fill's stable
      # argsort of them is then a radix sort.
      drawn = self._rng.integers(0, self.buffer_size, more).astype(
          self._slot_type)
      ahead = np.concatenate([ahead[start:], drawn]) if start < ahead.size \
          else drawn
      self._drawn += more
      start = 0
    slots = ahead[start:start + k]
    rest = ahead[start + k:]
    # The rest alone, not the whole draw of a long take it is the end of.
    self._ahead = rest.copy() if ahead.size > 2 * (
        self._AHEAD_BYTES // ahead.itemsize) else rest
    slots.setflags(write=False)
    return slots

  def _fill(self, k: int) -> np.ndarray:
    """``k`` fill steps: each emits a slot and refills it."""
    slots = self._slots(k)
    # Step t reads element first_new + t. Sorted by slot (stably, so in
    # step order within a slot), a draw of a slot drawn just before emits
    # the element read at that draw, and the last draw of each slot leaves
    # the element read then in it.
    # (Numbers within the pass.)
    first_new = self.buffer_size + self._step
    order = np.argsort(slots, kind="stable")
    ordered = slots[order]
    again = ordered[1:] == ordered[:-1]
    emitted = self._buffer[ordered]
    np.copyto(emitted[1:], order[:-1] + first_new, where=again)
    out = np.empty(emitted.size, np.int64)
    out[order] = emitted
    out += self._pass * self.count
    last = np.append(~again, True)
    self._buffer[ordered[last]] = order[last] + first_new
    return out
