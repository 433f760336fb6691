"""Data states: making them, checking them before tracing, and reading a
batch out of their cache inside compiled code."""

from __future__ import annotations

from typing import Any
from typing import Protocol
from typing import Sequence
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_data.errors import foreign_state
from jax_data.types import CacheState
from jax_data.types import PyTree


def check_state(state: Any, expected: CacheState, where: str) -> CacheState:
  """Checks that ``state`` is a state of the pipeline whose template is
  ``expected``, before anything is traced.

  A state whose ``pipeline`` field is known (not traced) must carry the
  pipeline's identity; structure, shapes and dtypes must match.

  Raises:
    ValueError: a state of another pipeline (its ``pipeline`` field known),
      whatever its shapes.
    TypeError: not a state of this pipeline's structure, shapes or dtypes.
  """
  if not isinstance(state, CacheState):
    raise TypeError(
        f"{where} expects a CacheState from this pipeline's init_fn, got "
        f"state of type {type(state).__name__}")
  # A state of another pipeline (of another cache or batch size, or a
  # full-data pass's) is named so, before its structure or shapes differ.
  ids = _known_values(state.pipeline)
  if ids is not None:
    check_identity(ids, int(expected.pipeline), where)
  got = jax.tree_util.tree_structure(state)
  want = jax.tree_util.tree_structure(expected)
  if got != want:
    raise TypeError(
        f"state does not belong to this pipeline: its structure is {got}, "
        f"expected {want}")
  paths, _ = jax.tree_util.tree_flatten_with_path(state)
  pairs = list(zip([leaf for _, leaf in paths],
                   jax.tree_util.tree_leaves(expected)))
  # Each field with the same extra leading axes: states stacked.
  stacked = {np.shape(g)[:np.ndim(g) - np.ndim(w)]
             if np.ndim(g) > np.ndim(w)
             and np.shape(g)[np.ndim(g) - np.ndim(w):] == np.shape(w)
             else None for g, w in pairs}
  if len(stacked) == 1 and None not in stacked:
    raise TypeError(
        f"{where} got the states of {' x '.join(map(str, stacked.pop()))} "
        "chains stacked (init_fn makes one per seed of a sequence, and a "
        "jax.random.PRNGKey given as seed is a sequence of two), where it "
        "takes one chain's: map it over them with jax.vmap, or give "
        "init_fn one integer seed")
  for (path, _), (g, w) in zip(paths, pairs):
    # Inside vmap/pmap a state has its unbatched shapes again.
    if np.shape(g) != np.shape(w) or dtype_of(g) != dtype_of(w):
      value = _known_values(g, kinds="iufb")
      shown = ("" if value is None or value.size > 8
               else f" ({value.tolist()})")
      raise TypeError(
          f"state does not belong to this pipeline: {where} got a state "
          f"whose state{jax.tree_util.keystr(path)} has shape {np.shape(g)} "
          f"and dtype {dtype_of(g)}{shown}, expected {np.shape(w)} and "
          f"{dtype_of(w)}: use the states of this pipeline's init_fn, "
          "batch_fn or restore_checkpoint")
  check_fits(state, expected, where)
  check_counters(state, np.shape(expected.mask)[0], where)
  return state


def _known_values(field: Any, kinds: str = "iu") -> Any:
  """A state field's values as a NumPy array if they are known (not
  traced) and of one of the dtype ``kinds`` (by default integers); else
  None."""
  if isinstance(field, jax.core.Tracer):
    return None
  try:
    values = np.asarray(field)
  except (TypeError, ValueError, jax.errors.TracerArrayConversionError):
    return None
  return values if values.dtype.kind in kinds else None


def dtype_of(leaf: Any) -> np.dtype:
  """A state field's dtype as JAX would take it, or NumPy's for what JAX
  takes for none (a string, None: a field set by hand), for messages."""
  try:
    return jnp.result_type(leaf)
  except (TypeError, ValueError):
    return np.asarray(leaf).dtype


#: The fields a checkpoint saves or names (the cache's are refetched).
COUNTERS = ("pipeline", "chain", "chunk", "position", "cached_chunk", "key")


def check_counter_fields(state: CacheState, expected: CacheState,
                         lanes: Tuple[int, ...], where: str) -> None:
  """Raises if a field of :data:`COUNTERS` is not of ``expected``'s dtype,
  and its shape, after leading ``lanes``: a checkpoint of a float or int64
  counter set by hand truncated or wrapped it, where ``batch_fn`` refuses
  the state."""
  for name in COUNTERS:
    got, want = getattr(state, name), getattr(expected, name)
    shape = lanes + np.shape(want)
    if np.shape(got) != shape or dtype_of(got) != dtype_of(want):
      raise TypeError(
          f"{where} got a state whose {name} has shape {np.shape(got)} and "
          f"dtype {dtype_of(got)}, expected {shape} and {dtype_of(want)}: "
          "use the states of this pipeline's init_fn, batch_fn or "
          "restore_checkpoint")
  check_fits(state, expected, where)


def check_fits(state: CacheState, expected: CacheState, where: str) -> None:
  """Raises if a field of :data:`COUNTERS` given as a NumPy (or Python)
  integer of another dtype than ``expected``'s (64 bits, which JAX takes
  as 32 without x64) holds a value that dtype cannot: JAX would wrap it
  (a chunk of 2**32 + 3 served chunk 3). JAX arrays, of the dtype
  already, are not read."""
  for name in COUNTERS:
    got = getattr(state, name)
    if isinstance(got, (jax.Array, jax.core.Tracer)):
      continue  # first: an eager batch_fn's state has only JAX arrays
    want = np.dtype(dtype_of(getattr(expected, name)))
    values = np.asarray(got)
    if values.dtype == want or values.dtype.kind not in "iu":
      continue
    fits = np.iinfo(want)
    if values.size and (values.min() < fits.min or values.max() > fits.max):
      raise ValueError(
          f"{where} got a state whose {name} is {values.tolist()}, outside "
          f"{want}'s {fits.min} .. {fits.max}: use the states of this "
          "pipeline's init_fn, batch_fn or restore_checkpoint")


def check_identity(field: Any, pipeline: int, where: str) -> None:
  """Raises if a known ``pipeline`` field (of stacked states too) is not
  ``pipeline``; traced fields are checked on the host instead."""
  try:
    ids = np.asarray(field)
  except jax.errors.TracerArrayConversionError:
    return
  foreign = sorted(set(ids[ids != pipeline].tolist()))
  if foreign:
    raise foreign_state(where, foreign[0], pipeline)


class ChainHolder(Protocol):
  """What :func:`check_chains` asks of a pipeline's host."""

  def check_open(self) -> None: ...

  def has_chain(self, number: int) -> bool: ...

  def chains(self) -> Sequence[int]: ...


def check_chains(field: Any, host: ChainHolder, where: str) -> None:
  """Raises if ``host``'s pipeline was released
  (:class:`~jax_data.PipelineReleasedError`, also where another thread
  released it during the check), or if a known ``chain`` field (of stacked
  states too) names a chain the host does not have (its chains are then
  listed); traced fields are checked on the host instead."""
  host.check_open()  # a released pipeline has no chains: says so
  try:
    numbers = np.asarray(field)
  except jax.errors.TracerArrayConversionError:
    return
  # A lookup per distinct chain: eager calls pay O(1) for one state, not a
  # listing of every chain the pipeline ever made.
  unknown = sorted(n for n in set(numbers.reshape(-1).tolist())
                   if not host.has_chain(n))
  if unknown:
    host.check_open()  # released by another thread meanwhile
    have = host.chains()
    shown = ", ".join(map(str, have[:8])) + (", ..." if len(have) > 8
                                             else "")
    raise ValueError(
        f"{where} got a state of chain {unknown[0]}, which this pipeline's "
        f"init_fn did not create (its chains: {shown or 'none'}); use the "
        "states of this pipeline's init_fn, batch_fn or restore_checkpoint")


#: What a negative chunk counter of a state made by batch_fn means.
WRAPPED = ("a chain's int32 chunk counter goes negative only past "
           "2**31 - 1 chunks of cached_batches_count batches (batches, on "
           "a device loader), where it wraps; a chain goes on past that "
           "from a new init_fn state")


def check_concrete(state: CacheState, where: str) -> None:
  """Raises if ``state`` is traced: ``where`` (a checkpoint's save) reads
  its values on the host."""
  if any(isinstance(leaf, jax.core.Tracer)
         for leaf in jax.tree_util.tree_leaves(state)):
    raise TypeError(
        f"{where} needs a concrete state, got a traced one (inside jax.jit, "
        "vmap or scan): save the state that the compiled function returns, "
        "outside it")


def check_counters(state: CacheState, cache_size: int, where: str) -> None:
  """Raises if known counters of a state are out of range (a state built by
  hand, or from a crafted checkpoint)."""
  try:
    chunk, position, cached = (np.asarray(state.chunk),
                               np.asarray(state.position),
                               np.asarray(state.cached_chunk))
  except jax.errors.TracerArrayConversionError:
    return
  top = max(cache_size, 1) - 1
  # (A 64-bit NumPy counter past int32 is refused by check_fits.)
  for name, value, low, high in (("chunk", chunk, 0, None),
                                 ("position", position, 0, top),
                                 ("cached_chunk", cached, -1, None)):
    if (value < low).any() or (high is not None and (value > high).any()):
      bound = f"at least {low}" if high is None else f"in {low} .. {high}"
      raise ValueError(
          f"{where} got a state with {name}={value.tolist()}, which must be "
          f"{bound}; use the states of this pipeline's init_fn, batch_fn or "
          "restore_checkpoint"
          + (f" ({WRAPPED})" if name == "chunk" else ""))


def batch_at(batches: PyTree, mask: jax.Array, position: jax.Array):
  """Batch ``position`` of a cache: (batch, mask)."""
  pick = lambda x: jax.lax.dynamic_index_in_dim(x, position, keepdims=False)
  return jax.tree_util.tree_map(pick, batches), pick(mask)


def advanced(state: CacheState, steps: Any, cache_size: int) -> CacheState:
  """``state`` with its chunk counter and cache position moved ``steps``
  batches on (the cache itself unchanged): the one place that wraps a
  position past the end of a cache into the next chunk."""
  end = state.position + steps
  return state._replace(
      chunk=(state.chunk + end // cache_size).astype(jnp.int32),
      position=(end % cache_size).astype(jnp.int32))
