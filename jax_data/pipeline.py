"""What the random and full-data pipelines share: set-up checks, the host
server and bridge, and the returned tuple type."""

from __future__ import annotations

import functools
import math
import types
import warnings
from typing import Any
from typing import Dict
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_data import validation
from jax_data.bridge import Bridge
from jax_data.host import ChunkServer
from jax_data.loader import DataLoader
from jax_data.loader import DeviceDataLoader
from jax_data.loader import HostDataLoader
from jax_data.types import CacheState
from jax_data.validation import check_bool
from jax_data.validation import check_int


class Pipeline(tuple):
  """The tuple a pipeline constructor returns, e.g. ``(init_fn, batch_fn,
  release_fn)``; it unpacks like a plain tuple.

  Checkpoints take the pipeline or any of its functions (each carries the
  attribute ``jax_data_pipeline``).

  Attributes:
    bridge: The host bridge; None for device-resident loaders.
    kind: "random", "full" or "mapper".
    template: A state of the pipeline's shapes, positioned at the start.
    fingerprint: What a checkpoint of this pipeline must match.
  """

  def __new__(cls, functions, bridge: Optional[Bridge], kind: str,
              template: CacheState, fingerprint: Dict[str, Any]):
    self = super().__new__(cls, tuple(_as_function(f) for f in functions))
    self.bridge = bridge
    self.kind = kind
    self.template = template
    self.fingerprint = fingerprint
    for function in self:
      function.jax_data_pipeline = self
    return self

  def __getnewargs__(self):
    return (tuple(self), self.bridge, self.kind, self.template,
            self.fingerprint)


def _as_function(function):
  """A plain function (bound methods cannot carry attributes)."""
  if isinstance(function, types.FunctionType):
    return function

  @functools.wraps(function)
  def wrapper(*args, **kwargs):
    return function(*args, **kwargs)

  return wrapper


def fingerprint(loader: DataLoader, cache_size: int, mb_size: int,
                observation_count: int) -> Dict[str, Any]:
  """What identifies a pipeline's batches, for checking checkpoints."""
  return {"loader": type(loader).__name__, "cache_size": cache_size,
          "mb_size": mb_size, "observation_count": observation_count}


def check_loader(data_loader: Any) -> DataLoader:
  if not isinstance(data_loader, (HostDataLoader, DeviceDataLoader)):
    raise TypeError(
        "data_loader must be a HostDataLoader or DeviceDataLoader (for "
        "example NumpyDataLoader), got "
        f"data_loader={data_loader!r} of type {type(data_loader).__name__}")
  return data_loader


def check_sizes(data_loader: DataLoader, cache_size: Any, mb_size: Any,
                observation_count: Optional[int] = None):
  """Checks the cache and batch sizes of a pipeline against the data."""
  if observation_count is None:
    observation_count = data_loader.static_information["observation_count"]
  return validation.check_sizes(cache_size, mb_size, observation_count,
                                cache_name="cached_batches_count")


def warn_large_cache(cache_size: int, mb_size: int, observation_count: int,
                     stacklevel: int = 3):
  """Warns when the cache holds more batches than one pass over the data."""
  needed = math.ceil(observation_count / mb_size)
  if cache_size > needed:
    warnings.warn(
        f"the cache holds {cache_size} batches of {mb_size}, more than the "
        f"{needed} that hold all {observation_count} observations; consider "
        "a smaller cache or a DeviceNumpyDataLoader", UserWarning,
        stacklevel=stacklevel)


def make_bridge(loader: HostDataLoader, cache_size: int, mb_size: int,
                verify_calls: bool = False) -> Bridge:
  batch_format, _ = loader.batch_format(cache_size, mb_size)
  leaves, treedef = jax.tree_util.tree_flatten(batch_format)
  formats = [(s.shape, np.dtype(s.dtype)) for s in leaves]
  server = ChunkServer(loader, cache_size, mb_size, formats,
                       flatten=treedef.flatten_up_to,
                       verify_calls=verify_calls)
  return Bridge(server, batch_format)


def make_state(chain: int, cache_size: int, mb_size: int,
               batch_format=None, key=None) -> CacheState:
  """A state positioned before a chain's first batch, with an empty cache."""
  if batch_format is None:
    batches, mask = {}, jnp.zeros((0, mb_size), jnp.bool_)
  else:
    batches = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                     batch_format)
    mask = jnp.zeros((cache_size, mb_size), jnp.bool_)
  if key is None:
    key = jnp.zeros((2,), jnp.uint32)
  return CacheState(chain=jnp.int32(chain), chunk=jnp.int32(0),
                    position=jnp.int32(0), cached_chunk=jnp.int32(-1),
                    batches=batches, mask=mask, key=key)


def check_state(state: Any, expected: CacheState, where: str) -> CacheState:
  """Checks that ``state`` has the structure and shapes of this pipeline's
  states, before anything is traced."""
  if not isinstance(state, CacheState):
    raise TypeError(
        f"{where} expects a CacheState from this pipeline's init_fn, got "
        f"state of type {type(state).__name__}")
  got = jax.tree_util.tree_structure(state)
  want = jax.tree_util.tree_structure(expected)
  if got != want:
    raise TypeError(
        f"state does not belong to this pipeline: its structure is {got}, "
        f"expected {want}")
  for g, w in zip(jax.tree_util.tree_leaves(state),
                  jax.tree_util.tree_leaves(expected)):
    # Inside vmap/pmap a state has its unbatched shapes again.
    if np.shape(g) != np.shape(w) or jnp.result_type(g) != jnp.result_type(w):
      raise TypeError(
          f"state does not belong to this pipeline: a field has shape "
          f"{np.shape(g)} and dtype {jnp.result_type(g)}, expected "
          f"{np.shape(w)} and {jnp.result_type(w)}")
  return state


def check_device_count(device_count: Any) -> int:
  return check_int("device_count", device_count, minimum=1)


def check_flag(name: str, value: Any) -> bool:
  return check_bool(name, value)


def chunk_batch(batches, mask, position):
  """Batch ``position`` of a cache."""
  pick = lambda x: jax.lax.dynamic_index_in_dim(x, position, keepdims=False)
  return jax.tree_util.tree_map(pick, batches), pick(mask)

