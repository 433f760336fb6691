"""The loop of a full-data pass inside compiled code.

:class:`PassPlan` splits a pass over ``count`` observations into chunks;
:func:`map_pass` scans over the chunks a ``fetch_chunk`` function brings in
and maps the applied function (:func:`applier`) over each chunk's batches,
with ``vmap`` where the function allows it and threads no carry, else with
a scan; :func:`progress_reporter` turns the ``progress`` argument into what
the host calls per chunk.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any
from typing import Callable
from typing import Optional
from typing import Tuple
from typing import Union

import jax
import jax.numpy as jnp
from jax import lax

from jax_data.types import MiniBatchInformation
from jax_data.types import PyTree
from jax_data.validation import check_jax_values

Progress = Union[None, bool, Callable[[int, int], object]]


def progress_reporter(progress: Progress, plan: "PassPlan",
                      devices: int = 1, total: Optional[int] = None
                      ) -> Optional[Callable[[int, int], None]]:
  """Turns the ``progress`` argument into the host's ``(participants,
  chunk) -> None``, called once per request for chunk ``chunk`` of a pass
  (the lanes of a vmapped request ask for it together); the
  ``participants`` requests of the devices that make one step together
  count as one. A pass split over ``devices`` (each with ``plan``, its
  block) reports the whole pass's batches, ``total``."""
  if progress is None or progress is False:
    return None
  if progress is True:
    progress = print_progress
  elif not callable(progress):
    raise TypeError(
        "progress must be None, True or a callable progress(done, total), "
        f"got progress={progress!r}")
  if total is None:
    total = plan.batches * devices
  lock = threading.Lock()
  step = [-1, 0]  # the chunk of the current step, its requests so far

  def report(participants: int, chunk: int) -> None:
    # Read off the chunk, not counted: a pass cut short (a failed read, an
    # error raised in fun, Ctrl-C) left a count partway through, and every
    # later pass's reports out of step.
    with lock:
      if chunk != step[0]:
        step[:] = [chunk, 0]
      step[1] += 1
      if step[1] < participants:
        return
      step[1] = 0
    done = chunk % plan.chunks + 1
    progress(min(done * plan.cache_size * devices, total), total)

  return report


def print_progress(done: int, total: int) -> None:
  end = "\n" if done >= total else ""
  print(f"\rfull-data pass: {done}/{total} batches", end=end,
        file=sys.stderr, flush=True)


class PassPlan:
  """How one pass over ``count`` observations splits into chunks."""

  def __init__(self, count: int, cache_size: int, mb_size: int):
    self.count = count
    self.mb_size = mb_size
    self.batches = math.ceil(count / mb_size)
    self.cache_size = min(cache_size, self.batches)
    self.full_chunks, self.tail = divmod(self.batches, self.cache_size)
    self.chunks = self.full_chunks + (1 if self.tail else 0)
    #: The batches of the pass's chunks, its padded last chunk whole.
    self.chunk_batches = self.chunks * self.cache_size

  def valid(self, chunk: jax.Array, shape: Tuple[int, ...]) -> Any:
    """Which places of chunk ``chunk`` of a pass (a mask of ``shape``,
    ``(cache_size, mb_size)``) hold observations: all but the fillers of
    the pass's last batch. A loader's mask says the same; a loader written
    the predecessor's way may return None for it, as the predecessor
    masked by position."""
    filled = self.count - (self.batches - 1) * self.mb_size
    if filled == self.mb_size:
      return True
    # In the chunk's dtype: an int64 arange under x64 broke strict
    # dtype promotion (jax_numpy_dtype_promotion="strict").
    batch = chunk * self.cache_size + jnp.arange(
        shape[0], dtype=jnp.result_type(chunk))[:, None]
    return ~((batch == self.batches - 1)
             & (jnp.arange(shape[1])[None, :] >= filled))


# The parts of what a pass's fun returns, as messages name them.
_PARTS = ("the result", "the carry")


def applier(fun: Callable, plan: PassPlan, masking: bool,
             information: bool) -> Callable:
  """``apply(carry, (batch, mask)) -> (carry, result)``: ``fun`` called the
  way ``masking`` and ``information`` say."""

  def apply(carry, batch_and_mask):
    batch, mask = batch_and_mask
    if information:
      batch = (batch, MiniBatchInformation(
          observation_count=plan.count, mask=mask, batch_size=plan.mb_size))
    out = fun(batch, mask, carry) if masking else fun(batch, carry)
    result, carry = pair("fun", fun, out, "(result, carry)", _PARTS)
    return carry, result

  return apply


def pair(name: str, fun: Callable, out: Any, what: str,
         parts: Optional[Tuple[str, str]] = None) -> Tuple[Any, Any]:
  """``out``, what the user's function ``fun`` (the argument ``name``)
  returned, as the pair ``what`` it must be (an array of two rows is not);
  with ``parts``, the names of its two parts, their leaves checked to be
  values JAX holds (:func:`~jax_data.validation.check_jax_values`).

  Raises:
    TypeError: it is not a pair, naming ``fun`` and what it returned; a
      leaf of a part is no array or number.
  """
  if isinstance(out, (tuple, list)) and len(out) == 2:
    for part, value in zip(parts or (), out):
      check_jax_values(part, value, f"{name}={fun!r}")
    return out[0], out[1]
  if isinstance(out, (tuple, list)):
    got = f"a {type(out).__name__} of {len(out)}"
  elif hasattr(out, "shape"):
    got = f"an array of shape {tuple(out.shape)}"
  else:
    got = f"{out!r:.100}"
  raise TypeError(f"{name} must return a pair {what}, got {got} from "
                  f"{name}={fun!r}")


def map_pass(fetch_chunk: Callable[[jax.Array], Tuple[PyTree, jax.Array]],
              plan: PassPlan, apply: Callable, carry: PyTree, masking: bool
              ) -> Tuple[PyTree, PyTree]:
  """Scans over the chunks of one pass and over the batches of each chunk;
  ``apply`` is from :func:`applier`."""

  def scan_chunk(carry, batches, mask):
    return lax.scan(apply, carry, (batches, mask))

  def map_chunk(carry, batches, mask):
    # The carry comes back unchanged: the batches of a chunk are
    # independent, and one vectorised call maps them all.
    results = jax.vmap(lambda b, m: apply(carry, (b, m))[1])(batches, mask)
    return carry, results

  over_chunk = (scan_chunk if threads_carry(apply, carry, fetch_chunk)
                or not vmappable(map_chunk, carry, fetch_chunk)
                else map_chunk)

  def fetch(chunk):
    batches, mask = fetch_chunk(chunk)
    return batches, mask & plan.valid(chunk, mask.shape)

  def outer(carry, chunk):
    batches, mask = fetch(chunk)
    carry, results = over_chunk(carry, batches, mask)
    if not plan.tail:
      return carry, (results, None)
    # Zero, from the fetched mask: see the last chunk's request below.
    return carry, (results, jnp.minimum(mask[0, 0].astype(jnp.int32), 0))

  carry, (results, zeros) = lax.scan(
      outer, carry, jnp.arange(plan.full_chunks, dtype=jnp.int32))
  results = jax.tree_util.tree_map(
      lambda r: r.reshape((plan.full_chunks * plan.cache_size,) + r.shape[2:]),
      results)
  if plan.tail:
    # The last chunk's index depends on the loop's last fetch (plus a zero
    # that XLA cannot fold away; a barrier it removed), so its request
    # comes after the loop's. Independent of them, XLA asked for it first,
    # and a loader that cannot seek (tf.data) read the pass up to it, then
    # again from its start.
    batches, mask = fetch(jnp.int32(plan.full_chunks) + zeros[-1])
    head = lambda x: x[:plan.tail]
    carry, tail = over_chunk(carry, jax.tree_util.tree_map(head, batches),
                             head(mask))
    results = jax.tree_util.tree_map(
        lambda a, b: jnp.concatenate([a, b], axis=0), results, tail)
  if not masking:
    # One result per observation: drop the fillers of the last batch.
    results = jax.tree_util.tree_map(
        lambda r: r.reshape((plan.batches * plan.mb_size,) + r.shape[2:])[
            :plan.count], results)
  return results, carry


def vmappable(map_chunk: Callable, carry: PyTree,
               fetch_chunk: Callable[[jax.Array], Tuple[PyTree, jax.Array]]
               ) -> bool:
  """Whether ``map_chunk`` traces: ``fun`` may hold what ``vmap`` refuses,
  such as a ``pure_callback`` without ``vmap_method`` or an ordered
  ``io_callback``; such a ``fun`` is scanned over the batches instead."""
  try:
    jax.eval_shape(lambda c, k: map_chunk(c, *fetch_chunk(k)), carry,
                   jnp.int32(0))
  except Exception:  # noqa: BLE001 - the scan raises what fun itself does
    return False
  return True


def threads_carry(apply: Callable, carry: PyTree,
                   fetch_chunk: Callable[[jax.Array], Tuple[PyTree, jax.Array]]
                   ) -> bool:
  """Whether ``apply(carry, (batch, mask))`` returns a carry that is not
  the one it was given (traced once, abstractly)."""
  leaves = jax.tree_util.tree_leaves(carry)
  if not leaves:
    return False
  batches, mask = jax.eval_shape(fetch_chunk, jnp.int32(0))
  # One batch of the fetched type (varying inside shard_map where the
  # chunks do).
  one = lambda s: cast_varying(
      jnp.zeros(s.shape[1:], s.dtype),
      frozenset(getattr(s, "manual_axis_type", None).varying
                if getattr(s, "manual_axis_type", None) else ()))

  def step(carry, batch, mask):
    return jax.tree_util.tree_leaves(apply(carry, (batch, mask))[0])

  traced = jax.make_jaxpr(step)(carry, jax.tree_util.tree_map(one, batches),
                                one(mask)).jaxpr
  given = traced.invars[:len(leaves)]
  returned = traced.outvars
  return len(returned) != len(given) or any(
      r is not g for r, g in zip(returned, given))


def varying_axes(tree: PyTree) -> frozenset:
  """The mesh axes (of an enclosing ``shard_map``) that any leaf of
  ``tree`` varies over; none outside one."""
  return frozenset().union(*(jax.typeof(leaf).manual_axis_type.varying
                             for leaf in jax.tree_util.tree_leaves(tree)))


def cast_varying(x: jax.Array, axes: frozenset) -> jax.Array:
  """``x`` varying over ``axes`` (those it does not vary over already)."""
  missing = tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying))
  return lax.pcast(x, missing, to="varying") if missing else x


def vectorised(fun: Callable) -> Callable:
  """``fun(observation, carry)`` as a batched function (vmapped over a
  batch, keeping the carry of its first observation). A new wrapper per
  call compiles nothing new: passes are keyed by what they trace to."""
  # Checked for one observation: its shapes are fun's own.
  vmapped = jax.vmap(lambda o, c: pair("fun", fun, fun(o, c),
                                       "(result, carry)", _PARTS),
                     in_axes=(0, None))

  def batched_fun(batch, carry):
    results, carries = vmapped(batch, carry)
    return results, jax.tree_util.tree_map(lambda c: c[0], carries)

  return batched_fun
