"""Abstract data loaders: what every loader describes, and loaders that
keep the whole dataset on the device.

A :class:`DataLoader` describes a dataset: its size and the format of one
observation. A :class:`DeviceDataLoader` keeps the whole dataset on the
device; host loaders (``jax_data.loaders.host_loader.HostDataLoader``) keep
it on the host and serve it in chunks.
"""

from __future__ import annotations

import abc
import operator
from typing import Any
from typing import Mapping
from typing import Optional
from typing import Tuple

import jax
import jax.numpy as jnp

from jax_data.types import MiniBatchInformation
from jax_data.types import PyTree
from jax_data.validation import MAX_AXIS
from jax_data.validation import check_int


def _canonical(formats: PyTree) -> PyTree:
  """``formats`` (``jax.ShapeDtypeStruct`` leaves) with the dtypes that JAX
  gives arrays of theirs: a callback cannot return 64-bit arrays without
  ``jax_enable_x64``."""
  def canonical(s):
    dtype = jax.dtypes.canonicalize_dtype(s.dtype)
    return s if dtype == s.dtype else jax.ShapeDtypeStruct(s.shape, dtype)
  return jax.tree_util.tree_map(canonical, formats)


class DataLoader(metaclass=abc.ABCMeta):
  """Describes a dataset: its size and the format of one observation.

  A subclass written the predecessor's way names the format ``_format``, a
  property of the class (the predecessor declared it an abstract
  property): ``observation_format`` is then that property, its dtypes as
  JAX holds them (int64 a 32-bit int without ``jax_enable_x64``, as the
  predecessor's arrays were).
  """

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    # Before ABCMeta counts the abstract methods, which it does after this.
    if any("_format" in vars(k) for k in cls.__mro__) and getattr(
        cls.observation_format, "__isabstractmethod__", False):
      cls.observation_format = property(  # type: ignore[method-assign]
          lambda self: _canonical(self._format),
          doc="The predecessor's ``_format``.")

  @property
  @abc.abstractmethod
  def static_information(self) -> Mapping[str, Optional[int]]:
    """``{"observation_count": N}``."""

  @property
  def observation_count(self) -> Optional[int]:
    """N, the number of observations (``static_information``'s); None
    where the loader does not know it (a ``tf.data`` pipeline of unknown
    length). An integer of any kind the loader states (NumPy's, a JAX
    scalar as the predecessor's loaders gave) is a Python ``int`` here."""
    count = self.static_information["observation_count"]
    if count is None or type(count) is int:  # noqa: E721 (the fast path)
      return count
    try:
      return operator.index(count)
    except TypeError:
      raise TypeError(
          f"{type(self).__name__}.static_information['observation_count'] "
          f"must be an integer or None, got {count!r}") from None

  @property
  @abc.abstractmethod
  def observation_format(self) -> PyTree:
    """Pytree of ``jax.ShapeDtypeStruct`` of one observation."""

  def initializer_batch(self, mb_size: Optional[int] = None) -> PyTree:
    """An all-zero batch with the shapes and dtypes of real batches.

    Args:
      mb_size: Batch size; None gives a single observation without a leading
        batch axis.

    Returns:
      Pytree of ``jax.Array`` zeros.
    """
    if mb_size is not None:
      mb_size = check_int("mb_size", mb_size, minimum=1, maximum=MAX_AXIS)
    lead = () if mb_size is None else (mb_size,)
    return jax.tree_util.tree_map(
        lambda s: jnp.zeros(lead + tuple(s.shape), s.dtype),
        self.observation_format)

  def batch_format(self, cache_size: int, mb_size: int
                   ) -> Tuple[PyTree, MiniBatchInformation]:
    """Format of a cache of batches as served by the host.

    Args:
      cache_size: Number of batches in the cache.
      mb_size: Number of observations per batch.

    Returns:
      Pytree of ``jax.ShapeDtypeStruct`` with leading axes
      ``(cache_size, mb_size)``, and the batches' ``MiniBatchInformation``.
    """
    cache_size = check_int("cache_size", cache_size, minimum=1,
                           maximum=MAX_AXIS)
    mb_size = check_int("mb_size", mb_size, minimum=1, maximum=MAX_AXIS)
    fmt = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct((cache_size, mb_size) + tuple(s.shape),
                                       s.dtype),
        self.observation_format)
    info = MiniBatchInformation(
        observation_count=self.observation_count,
        mask=jnp.ones(mb_size, dtype=jnp.bool_),
        batch_size=mb_size)
    return fmt, info


class DeviceDataLoader(DataLoader):
  """The whole dataset on the device; batches drawn without host calls."""

  @abc.abstractmethod
  def init_random_data(self, **kwargs: Any) -> jax.Array:
    """The initial random state (a PRNG key) of a chain."""

  @abc.abstractmethod
  def get_random_data(self, state: jax.Array, batch_size: int
                      ) -> Tuple[jax.Array, Tuple[PyTree,
                                                  MiniBatchInformation]]:
    """Draws a batch; jit-able and free of side effects."""

  @abc.abstractmethod
  def get_full_data(self) -> PyTree:
    """The whole dataset as a pytree of device arrays."""
