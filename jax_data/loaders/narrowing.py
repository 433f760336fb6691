"""Integers served in the dtypes JAX keeps.

Without ``jax_enable_x64`` JAX keeps 64-bit integers as 32-bit ones, and
loaders serve integer leaves so. NumPy's cast wraps the values the
narrower dtype cannot hold without a word (3,000,000,000 became
-1,294,967,296 in int32), so loaders check such leaves before they cast
and name a value that does not fit.

Only NumPy: worker processes import this without JAX.
"""

from __future__ import annotations

from typing import Any
from typing import Optional
from typing import Tuple

import numpy as np


def narrows(dtype: np.dtype, target: np.dtype) -> bool:
  """Whether integers of ``dtype`` cast to ``target`` may not fit."""
  if dtype.kind not in "iu" or target.kind not in "iu" or dtype == target:
    return False
  have, fit = np.iinfo(dtype), np.iinfo(target)
  return have.min < fit.min or have.max > fit.max


def within(array: np.ndarray, bounds: np.iinfo) -> bool:
  """Whether every integer of ``array`` lies within ``bounds`` (one number
  compared as a Python int: a record's label costs no reduction)."""
  if array.size == 1:
    return bounds.min <= array.item() <= bounds.max
  return not array.size or (bounds.min <= array.min()
                            and array.max() <= bounds.max)


def first_outside(array: np.ndarray, dtype: np.dtype
                  ) -> Optional[Tuple[int, Any]]:
  """The first row of ``array`` (along its first axis) with an integer
  that ``dtype`` cannot hold, and that integer; None if all fit."""
  if not array.size:
    return None
  bounds = np.iinfo(dtype)
  outside = (array < bounds.min) | (array > bounds.max)
  if not outside.any():
    return None
  at = int(np.argmax(outside.reshape(array.shape[0], -1).any(axis=1)))
  return at, array[at].reshape(-1)[outside[at].reshape(-1)][0]


def cannot_hold(value: Any, dtype: np.dtype) -> str:
  """The end of the message that names ``value``: what to do instead."""
  return (f"{value}, which JAX's {dtype} (64-bit types are 32-bit without "
          "jax_enable_x64) cannot hold: enable jax_enable_x64 before making "
          "the loader (jax.config.update('jax_enable_x64', True)), or "
          f"values that {dtype} holds")
