"""Argument checks shared by the public functions.

Every check runs eagerly in Python, before anything is traced, and names the
argument, its value and what was expected.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any
from typing import Iterable
from typing import List
from typing import Mapping
from typing import Optional
from typing import Tuple

import jax
import numpy as np


def check_int(name: str, value: Any, minimum: Optional[int] = None,
              maximum: Optional[int] = None, what: str = "") -> int:
  """Returns ``value`` as an int, or raises naming ``name`` and ``value``.
  A 0-d integer array (NumPy's, a concrete JAX one) is an integer."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    if not _integer_scalar(value):
      raise TypeError(f"{name} must be an integer, got {name}={value!r}")
    try:
      value = operator.index(value)
    except Exception:  # a traced value  # pylint: disable=broad-except
      raise TypeError(f"{name} must be a concrete integer, got "
                      f"{name}={value!r}") from None
  value = int(value)
  if minimum is not None and value < minimum:
    raise ValueError(_range_message(name, value, minimum, maximum, what))
  if maximum is not None and value > maximum:
    raise ValueError(_range_message(name, value, minimum, maximum, what))
  return value


def check_jax_values(name: str, tree: Any, returned_by: str = "") -> None:
  """Raises naming ``name`` (with the leaf's path) and the value if a leaf
  of ``tree`` is not something JAX takes as an array (a string, None in a
  list, an object); ``returned_by``: the function that returned ``tree``,
  named in the message.

  Raises:
    TypeError: such a leaf.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    try:
      jax.typeof(leaf)
    except TypeError:
      by = f" (returned by {returned_by})" if returned_by else ""
      raise TypeError(
          f"{name}{jax.tree_util.keystr(path)} must be an array or a number"
          f"{by}, got {leaf!r:.100} of type {type(leaf).__name__}"
          ) from None


def _integer_scalar(value: Any) -> bool:
  """Whether ``value`` is a 0-d array of an integer dtype."""
  try:
    return (getattr(value, "shape", None) == ()
            and np.dtype(value.dtype).kind in "iu")
  except TypeError:  # a dtype NumPy does not know
    return False


def _range_message(name, value, minimum, maximum, what):
  if maximum is None:
    return f"{name} must be at least {minimum}, got {name}={value}"
  bound = f"{maximum}" if not what else f"{what} {maximum}"
  return f"{name} must be between {minimum} and {bound}, got {name}={value}"


def check_choice(name: str, value: Any, choices: Tuple[Any, ...]) -> Any:
  """Returns ``value`` if it is one of ``choices`` (a ``Literal`` option's
  values), or raises naming ``name`` and ``value``."""
  if not isinstance(value, str) or value not in choices:
    raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}"
                     f", got {name}={value!r}")
  return value


def check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, (bool,)) and not (
      hasattr(value, "dtype") and getattr(value, "shape", None) == ()
      and value.dtype == bool):
    raise TypeError(f"{name} must be True or False, got {name}={value!r}")
  if isinstance(value, jax.core.Tracer):  # it decides what is traced
    raise TypeError(f"{name} must be a concrete True or False, got "
                    f"{name}={value!r}")
  return bool(value)


def native_dtype(dtype: Any) -> np.dtype:
  """``dtype`` in the machine's byte order (a big-endian ``>f4`` of a file
  written elsewhere becomes ``float32``)."""
  dtype = np.dtype(dtype)
  return dtype if dtype.isnative else dtype.newbyteorder("=")


def is_jax_dtype(dtype: Any) -> bool:
  """Whether arrays of ``dtype`` can become JAX arrays (in the machine's
  byte order): booleans and numbers, those of ``ml_dtypes`` too (bfloat16,
  float8, int4); not objects, strings, records, dates or raw bytes."""
  try:
    jax.dtypes.result_type(jax.dtypes.canonicalize_dtype(native_dtype(dtype)))
  except TypeError:
    return False
  return True


def check_keywords(where: str, kwargs: Mapping[str, Any],
                   allowed: Iterable[str]) -> None:
  """Unknown keyword arguments are errors, not silently ignored."""
  allowed = tuple(allowed)
  unknown = sorted(set(kwargs) - set(allowed))
  if unknown:
    raise TypeError(
        f"{where} got unknown keyword argument(s) "
        f"{', '.join(f'{k}={kwargs[k]!r}' for k in unknown)}; "
        f"expected any of: {', '.join(allowed) or 'none'}")


#: The largest size of an array axis (a cache's batches, a batch's rows, a
#: scan's steps): XLA's shapes and JAX's loop counters are int32 on CPU.
MAX_AXIS = 2**31 - 1


def check_sizes(cache_size: Any, mb_size: Any,
                observation_count: Optional[int],
                cache_name: str = "cache_size") -> Tuple[int, int]:
  """Checks a cache size (1 to :data:`MAX_AXIS`) and a batch size (1 to
  the number of observations, if known, and :data:`MAX_AXIS`); returns
  them as ints."""
  cache_size = check_int(cache_name, cache_size, minimum=1, maximum=MAX_AXIS)
  if mb_size is None:
    raise ValueError("mb_size must be given, got mb_size=None")
  if observation_count is None or observation_count > MAX_AXIS:
    mb_size = check_int("mb_size", mb_size, minimum=1, maximum=MAX_AXIS)
  else:
    mb_size = check_int("mb_size", mb_size, minimum=1,
                        maximum=observation_count,
                        what="the observation count")
  return cache_size, mb_size


def check_saved_state(data: Any, expected: Mapping[str, Any],
                      where: str) -> None:
  """Checks a ``save_state`` dict against what a chain expects.

  Raises:
    TypeError: ``data`` is not a dict.
    ValueError: some fields differ; the message shows both sides.
  """
  if not isinstance(data, dict):
    raise TypeError(f"data must be a dict from save_state, got {data!r}")
  differ = {k: (data.get(k), v) for k, v in expected.items()
            if data.get(k) != v}
  if differ:
    raise ValueError(
        f"state does not fit {where}: " + ", ".join(
            f"{k} is {got!r} in the state but {want!r} here"
            for k, (got, want) in differ.items()))


def seed_list(seed: Any) -> Optional[List[Any]]:
  """The seeds of a sequence ``seed`` (a list, tuple, range or 1-D array),
  or None for one seed.

  Raises:
    ValueError: an empty sequence, or an array of more than one axis.
  """
  if isinstance(seed, jax.core.Tracer):
    raise TypeError(f"seed must be concrete integers (a chain's seed is "
                    f"fixed when init_fn makes it), got seed={seed!r}")
  if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(
      seed.dtype, jax.dtypes.prng_key):
    raise TypeError(
        f"seed must be an integer or a sequence of integers, got typed "
        f"PRNG keys of shape {seed.shape}: seed=range(C) makes C chains "
        "(DeviceNumpyDataLoader's jax.random chains take key=)")
  if isinstance(seed, (np.ndarray, jax.Array)):
    if np.ndim(seed) == 0:
      return None
    if np.ndim(seed) != 1:
      raise ValueError(
          f"seed must be one seed or a sequence of them, got an array of "
          f"shape {np.shape(seed)}")
    seed = np.asarray(seed).tolist()
  if not isinstance(seed, (list, tuple, range)):
    return None
  if len(seed) == 0:
    raise ValueError(f"seed must name at least one chain, got seed={seed!r}")
  return list(seed)
