"""Random mini-batches inside compiled code: :func:`random_reference_data`."""

from __future__ import annotations

import functools
from typing import Any
from typing import Optional

import jax
import jax.numpy as jnp

from jax_data import pipeline as pl
from jax_data.host import PipelineReleasedError
from jax_data.loader import DataLoader
from jax_data.loader import DeviceDataLoader
from jax_data.types import CacheState
from jax_data.types import MiniBatchInformation


class LoaderRef:
  """Holds a device loader until the pipeline is released."""

  def __init__(self, loader: DataLoader):
    self._loader: Optional[DataLoader] = loader

  @property
  def loader(self) -> DataLoader:
    if self._loader is None:
      raise PipelineReleasedError(
          "this pipeline was released by its release_fn; create a new "
          "pipeline to draw more data")
    return self._loader

  def check_open(self) -> None:
    """Raises :class:`PipelineReleasedError` if the pipeline was released."""
    _ = self.loader

  def release(self) -> None:
    self._loader = None


def random_reference_data(data_loader: DataLoader, cached_batches_count: int,
                          mb_size: int, verify_calls: bool = False
                          ) -> pl.Pipeline:
  """Random mini-batches of a loader, drawn inside ``jit`` and ``lax.scan``.

  A host loader serves chunks of ``cached_batches_count`` batches through a
  host callback when the state's cache is used up. A state is a
  value: the same state gives the same batch, also under ``vmap``, ``pmap``
  and remat, and the host never advances a chain twice for one request.

  >>> import numpy as np
  >>> import jax
  >>> import jax_data
  >>> loader = jax_data.NumpyDataLoader(x=np.arange(10))
  >>> init_fn, batch_fn, release_fn = jax_data.random_reference_data(
  ...     loader, cached_batches_count=2, mb_size=3)
  >>> state = init_fn(seed=0, shuffle=True, in_epochs=True)
  >>> state, batch = jax.jit(batch_fn)(state)
  >>> sorted(batch["x"].tolist()) == sorted(set(batch["x"].tolist()))
  True
  >>> release_fn()

  Args:
    data_loader: A ``HostDataLoader`` or ``DeviceDataLoader``.
    cached_batches_count: Batches fetched per host call (the device cache).
    mb_size: Observations per batch.
    verify_calls: Warn when a chunk is requested again after the chain moved
      on (a state used twice or replayed), which costs regeneration.

  Returns:
    ``(init_fn, batch_fn, release_fn)``. ``init_fn(**kwargs)`` registers a
    chain (keywords go to the loader, e.g. ``seed``, ``shuffle``,
    ``in_epochs``) and returns its :class:`CacheState`;
    ``batch_fn(state, information=False, device_count=1)`` returns
    ``(state, batch)`` or ``(state, (batch, MiniBatchInformation))``;
    ``release_fn()`` drops the pipeline's references to the loader.

  Raises:
    TypeError, ValueError: bad arguments, named with their values.
  """
  loader = pl.check_loader(data_loader)
  verify_calls = pl.check_flag("verify_calls", verify_calls)
  count = loader.static_information["observation_count"]
  cache_size, mb_size = pl.check_sizes(loader, cached_batches_count, mb_size)
  if isinstance(loader, DeviceDataLoader):
    return _device_pipeline(LoaderRef(loader), mb_size, count,
                            pl.fingerprint(loader, 0, mb_size, count))
  pl.warn_large_cache(cache_size, mb_size, count)

  fingerprint = pl.fingerprint(loader, cache_size, mb_size, count)
  bridge = pl.make_bridge(loader, cache_size, mb_size, verify_calls)
  server = bridge.server
  batch_format, _ = loader.batch_format(cache_size, mb_size)
  expected = pl.make_state(0, cache_size, mb_size, batch_format)
  del loader, data_loader  # closures hold the bridge only

  def init_fn(**kwargs: Any) -> CacheState:
    chain = server.register("random", **kwargs)
    return pl.make_state(chain, cache_size, mb_size, batch_format)

  @functools.partial(jax.jit, static_argnums=1)
  def step(state: CacheState, device_count: int):
    cached, batches, mask = bridge.refresh(
        state.chain, state.chunk, state.cached_chunk, state.batches,
        state.mask, device_count)
    batch, batch_mask = pl.chunk_batch(batches, mask, state.position)
    position = state.position + 1
    wrap = position >= cache_size
    new_state = state._replace(
        chunk=jnp.where(wrap, state.chunk + 1, state.chunk),
        position=jnp.where(wrap, 0, position),
        cached_chunk=cached, batches=batches, mask=mask)
    return new_state, batch, batch_mask

  def batch_fn(state: CacheState, information: bool = False,
               device_count: int = 1):
    state = pl.check_state(state, expected, "batch_fn")
    information = pl.check_flag("information", information)
    device_count = pl.check_device_count(device_count)
    server.check_open()
    new_state, batch, batch_mask = step(state, device_count)
    if information:
      # Built outside the jitted step: its counts stay Python ints.
      return new_state, (batch, MiniBatchInformation(
          observation_count=count, mask=batch_mask, batch_size=mb_size))
    return new_state, batch

  def release_fn() -> None:
    server.release()

  return pl.Pipeline((init_fn, batch_fn, release_fn), bridge, "random",
                     expected, fingerprint)


def _device_pipeline(ref: LoaderRef, mb_size: int, count: int,
                     fingerprint) -> pl.Pipeline:
  """Random batches of a device-resident loader: no host calls."""
  expected = pl.make_state(-1, 0, mb_size)

  def init_fn(**kwargs: Any) -> CacheState:
    key = ref.loader.init_random_data(**kwargs)
    return pl.make_state(-1, 0, mb_size, key=key)

  def batch_fn(state: CacheState, information: bool = False,
               device_count: int = 1):
    state = pl.check_state(state, expected, "batch_fn")
    information = pl.check_flag("information", information)
    pl.check_device_count(device_count)
    key, (batch, info) = ref.loader.get_random_data(state.key, mb_size)
    new_state = state._replace(key=key)
    if information:
      return new_state, (batch, info)
    return new_state, batch

  return pl.Pipeline((init_fn, batch_fn, ref.release), None, "random",
                     expected, fingerprint)
