"""Counter-based streams drawn on the device: :func:`device_batch`.

The same batches as :func:`jax_data.streams.counter_streams.stream_batches`
on the host, bit for bit, in ``jax.numpy`` with 32-bit integers only (a
device-resident loader's chains): positions are split into ``uint32`` words
and multiplied and divided without 64-bit integers.
"""

from __future__ import annotations

from typing import Any
from typing import Tuple

import numpy as np

from jax_data.streams.counter_streams import permute
from jax_data.streams.counter_streams import uniform
from jax_data.validation import check_int

#: Modes of :func:`device_batch`, in the order of its ``mode`` argument.
DEVICE_MODES = ("independent", "shuffle", "epochs")

#: A device loader's state names its chain's kind of stream in its
#: ``chain`` field: ``RANDOM_KIND`` a ``jax.random`` chain,
#: :func:`counter_kind` a counter-based one, down to ``LOWEST_KIND``.
RANDOM_KIND = -1
LOWEST_KIND = -1 - len(DEVICE_MODES)


def counter_kind(mode: int) -> int:
  """The kind of a counter-based chain of mode ``mode`` (an index into
  :data:`DEVICE_MODES`)."""
  return -2 - mode


def are_kinds(codes: np.ndarray) -> bool:
  """Whether every one of ``codes`` is a kind of stream (``LOWEST_KIND``
  to ``RANDOM_KIND``)."""
  codes = np.asarray(codes)
  return not ((codes > RANDOM_KIND) | (codes < LOWEST_KIND)).any()


def sizes_fit(mb_size: int, n: int) -> bool:
  """Whether :func:`device_batch` draws batches of ``mb_size`` of ``n``
  observations (its 32-bit words hold them)."""
  return mb_size < 2**16 and n < 2**32


def check_sizes(mb_size: int, n: int) -> None:
  """Raises ValueError, naming both, unless :func:`sizes_fit` and a batch
  is at most the observations (a shuffled batch then crosses at most one
  epoch's end, and an offset past ``n`` would cycle-walk for ever); a
  size that is not an integer raises TypeError."""
  mb_size = check_int("mb_size", mb_size, minimum=1)
  n = check_int("n", n, minimum=1)
  if mb_size > n:
    raise ValueError(
        f"counter streams on the device draw batches of at most the "
        f"observation count, got mb_size={mb_size} and an observation "
        f"count of {n}")
  if not sizes_fit(mb_size, n):
    raise ValueError(
        f"counter streams on the device need mb_size below 2**16 and fewer "
        f"than 2**32 observations, got mb_size={mb_size} and an observation "
        f"count of {n}; draw with jax.random (init_fn(key=...)) instead")


def device_batch(seed: Any, batch: Any, mb_size: int, n: int, mode: int
                 ) -> Tuple[Any, Any]:
  """Indices (uint32, ``(mb_size,)``) and mask of batch ``batch`` of a
  counter-based stream, in ``jax.numpy`` with 32-bit integers only: what
  ``stream_batches(seed, batch, 1, ...)`` gives on the host, for ``batch``
  below ``2**31``, ``mb_size`` below ``2**16`` and ``n`` below ``2**32``.

  Args:
    seed: The seed's words, ``uint32[2]`` (low, high).
    batch: The batch number (traced int32 or uint32).
    mb_size: Observations per batch.
    n: Observations.
    mode: Index into :data:`DEVICE_MODES` (a Python int: only that
      mode's stream is computed).
  """
  import jax
  import jax.numpy as jnp

  # An index into DEVICE_MODES.
  mode = check_int("mode", mode, minimum=0, maximum=len(DEVICE_MODES) - 1)
  check_sizes(mb_size, n)
  if np.shape(seed) != (2,) or jnp.result_type(seed) != jnp.uint32:
    raise TypeError(
        "seed must be the seed's two uint32 words (low, high), got seed of "
        f"shape {np.shape(seed)} and dtype {jnp.result_type(seed)}")
  if np.shape(batch) != () or not jnp.issubdtype(jnp.result_type(batch),
                                                 jnp.integer):
    raise TypeError(
        "batch must be one integer (int32 or uint32 where traced), got "
        f"batch of shape {np.shape(batch)} and dtype "
        f"{jnp.result_type(batch)}")
  if not isinstance(batch, jax.core.Tracer):
    check_int("batch", batch, minimum=0, maximum=2**31 - 1)
  batch = jnp.asarray(batch).astype(jnp.uint32)
  steps = jnp.arange(mb_size, dtype=jnp.uint32)
  everything = jnp.ones(mb_size, bool)

  def independent():
    return uniform(seed, _times_plus(batch, mb_size, steps), n,
                   jnp), everything

  def shuffled():
    # Position t = batch * mb + step, as epoch t // n and offset t % n
    # without 64-bit integers: batch = q * n + r, then r * mb = p * n + s.
    q, r = batch // jnp.uint32(n), batch % jnp.uint32(n)
    p, s = _times_divmod(r, mb_size, n)
    wraps = s >= jnp.uint32(n) - steps
    offset = jnp.where(wraps, s - (jnp.uint32(n) - steps), s + steps)
    epoch = q * jnp.uint32(mb_size) + p + wraps.astype(jnp.uint32)
    return permute(seed, epoch, offset, n, jnp), everything

  def in_epochs():
    per_epoch = -(-n // mb_size)
    epoch = batch // jnp.uint32(per_epoch)
    # The batch's first offset is below n; its last may pass 2**32 (n
    # near it), where uint32 wraps: valid is told without the sum.
    start = (batch % jnp.uint32(per_epoch)) * jnp.uint32(mb_size)
    valid = steps < jnp.uint32(n) - start
    positions = jnp.where(valid, start + steps, jnp.uint32(0))
    indices = permute(seed, jnp.broadcast_to(epoch, positions.shape),
                      positions, n, jnp)
    return jnp.where(valid, indices, jnp.uint32(0)), valid

  return (independent, shuffled, in_epochs)[mode]()


def _times_plus(batch: Any, mb_size: int, steps: Any) -> Tuple[Any, Any]:
  """Low and high words of ``batch * mb_size + steps`` (``batch`` below
  ``2**31``, ``mb_size`` below ``2**16``), in ``uint32``."""
  import jax.numpy as jnp
  mb = jnp.uint32(mb_size)
  upper = (batch >> jnp.uint32(16)) * mb  # below 2**31
  lower = (batch & jnp.uint32(0xFFFF)) * mb  # below 2**32
  low = upper << jnp.uint32(16)
  high = upper >> jnp.uint32(16)
  summed = low + lower
  high = high + (summed < low).astype(jnp.uint32)
  final = summed + steps
  high = high + (final < summed).astype(jnp.uint32)
  return final, jnp.broadcast_to(high, final.shape)


def _times_divmod(r: Any, mb_size: int, n: int) -> Tuple[Any, Any]:
  """``divmod(r * mb_size, n)`` for ``r`` below ``n`` (below ``2**32``), in
  ``uint32``: double-and-add over the bits of ``mb_size``, the remainder
  kept below ``n`` throughout."""
  import jax.numpy as jnp
  n32 = jnp.uint32(n)
  quotient = jnp.zeros_like(r)
  remainder = jnp.zeros_like(r)

  def add(quotient, remainder, value):
    carry = remainder >= n32 - value
    remainder = jnp.where(carry, remainder - (n32 - value), remainder + value)
    return quotient + carry.astype(jnp.uint32), remainder

  for bit in bin(mb_size)[2:]:
    quotient, remainder = add(quotient + quotient, remainder, remainder)
    if bit == "1":
      quotient, remainder = add(quotient, remainder, r)
  return quotient, remainder
