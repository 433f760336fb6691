"""Abstract data loaders: where the data lives and how batches are formed.

A :class:`HostDataLoader` keeps the data on the host and serves *chunks* of
``cache_size`` batches per chain through :meth:`HostDataLoader.get_batches`.
The host bridge (``jax_data.host``) calls it from its own threads; calls for
different chains may run concurrently, calls for one chain never do.

A :class:`DeviceDataLoader` keeps the whole dataset on the device.
"""

from __future__ import annotations

import abc
import threading
import weakref
from typing import Any
from typing import Callable
from typing import Dict
from typing import Generic
from typing import List
from typing import Optional
from typing import Tuple
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_data.types import MiniBatchInformation
from jax_data.types import PyTree
from jax_data.validation import check_int

Chain = TypeVar("Chain")


class ChainList(Generic[Chain]):
  """The chains a host loader registered, by id.

  Ids count registrations from 0 and are never reused; registration is one
  at a time, so concurrent callers get distinct ids.

  Args:
    owner: The loader, named in errors (held weakly).
  """

  def __init__(self, owner: Any):
    self._owner = weakref.ref(owner)
    self._chains: List[Optional[Chain]] = []
    self._lock = threading.RLock()

  def add(self, make_chain: Callable[[int], Chain]) -> int:
    """Registers ``make_chain(chain_id)`` and returns the id; nothing is
    registered if it raises."""
    with self._lock:
      chain_id = len(self._chains)
      self._chains.append(make_chain(chain_id))
    return chain_id

  def get(self, chain_id: int) -> Chain:
    """The chain ``chain_id``; a clear error if released or unknown."""
    chain_id = check_int("chain_id", chain_id, minimum=0)
    chain = self._chains[chain_id] if chain_id < len(self._chains) else None
    if chain is None:
      state = "was released" if chain_id < len(self._chains) else (
          f"does not exist ({len(self._chains)} chains registered)")
      raise ValueError(f"chain_id={chain_id} of {self._owner()!r} {state}")
    return chain

  def release(self, chain_id: int) -> None:
    """Frees a chain; its id stays taken."""
    if 0 <= chain_id < len(self._chains):
      self._chains[chain_id] = None


class DataLoader(metaclass=abc.ABCMeta):
  """Describes a dataset: its size and the format of one observation."""

  @property
  @abc.abstractmethod
  def static_information(self) -> Dict[str, int]:
    """``{"observation_count": N}``."""

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
      mb_size = check_int("mb_size", mb_size, minimum=1)
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
    cache_size = check_int("cache_size", cache_size, minimum=1)
    mb_size = check_int("mb_size", mb_size, minimum=1)
    fmt = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct((cache_size, mb_size) + tuple(s.shape),
                                       s.dtype),
        self.observation_format)
    info = MiniBatchInformation(
        observation_count=self.static_information["observation_count"],
        mask=jnp.ones(mb_size, dtype=jnp.bool_),
        batch_size=mb_size)
    return fmt, info


class HostDataLoader(DataLoader):
  """Data on the host, served in chunks of batches per chain.

  Chain ids count the chains registered on a loader, random and ordered
  alike, from 0.
  """

  @abc.abstractmethod
  def register_random_pipeline(self, cache_size: int = 1,
                               mb_size: Optional[int] = None,
                               **kwargs: Any) -> int:
    """Registers a chain of random batches and returns its id."""

  @abc.abstractmethod
  def register_ordered_pipeline(self, cache_size: int = 1,
                                mb_size: Optional[int] = None,
                                **kwargs: Any) -> int:
    """Registers a chain that passes over the data in order; returns its id."""

  @abc.abstractmethod
  def get_batches(self, chain_id: int) -> Tuple[PyTree, Optional[np.ndarray]]:
    """The chain's next chunk and advances it.

    Returns:
      NumPy arrays with leading axes ``(cache_size, mb_size)`` and a bool
      mask of shape ``(cache_size, mb_size)`` (None means all valid).
    """

  @abc.abstractmethod
  def save_state(self, chain_id: int) -> Any:
    """The chain's position: small, picklable, restorable by ``load_state``."""

  @abc.abstractmethod
  def load_state(self, chain_id: int, data: Any) -> None:
    """Moves the chain to a position from ``save_state``; ``data`` is kept
    unchanged."""

  def release_chain(self, chain_id: int) -> None:
    """Frees what the loader holds for a chain; its id is not reused."""
    del chain_id

  def chain_fingerprint(self, chain_id: int) -> Dict[str, Any]:
    """What identifies the chain's stream, for checking checkpoints."""
    del chain_id
    return {"loader": type(self).__name__,
            "observation_count": self.static_information["observation_count"]}


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
