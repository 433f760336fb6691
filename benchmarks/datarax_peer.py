"""Datarax as a contender: the same SGLD sampler fed by Datarax sources.

Datarax (``pip install datarax``; measured with 0.1.4, the release on the
package index here) is a data-pipeline framework for JAX built on Flax NNX.
Two of its sources run inside a jitted ``lax.scan``, which is what an
SG-MCMC sampler needs, through their stateless ``get_batch_at(start, size,
key)``:

* ``MemorySource`` keeps the data on the device; with ``shuffle=True`` a
  batch's indices are the slice ``[start, start + size)`` of
  ``jax.random.permutation(key, N)``. The sampler scans over epochs, and
  within an epoch over its batches with the epoch's key (Datarax's
  ``scan`` mode; XLA computes the permutation once per epoch);
* ``StreamingDiskSource`` reads a ``.npy`` file through one
  ``jax.experimental.io_callback`` per batch; in 0.1.4 it reads in order
  (``get_batch_at`` ignores ``key``: no shuffling), so its batches are
  consecutive windows of the file, x and y packed in one array.

Datarax 0.1.4 pins ``tensorflow<2.21`` and ``protobuf<6``, which conflict
with the ``tensorflow-cpu`` of the ``benchmarks`` extra, so it is not in an
extra: install it next to them with ``pip install --no-deps datarax==0.1.4``
and ``pip install flax jaxtyping tomli-w`` (it imports TensorFlow only in
its command line).
Without it these contenders are left out.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

MEMORY = "Datarax MemorySource"
DISK = "Datarax StreamingDiskSource"


def available() -> bool:
  """Whether Datarax imports."""
  try:
    import datarax.sources  # noqa: F401
  except ImportError:
    return False
  return True


def memory_batches(data: dict[str, np.ndarray], mb: int, seed: int = 0):
  """A shuffled ``MemorySource`` over ``data`` (on the device).

  Returns:
    ``(batch_at, source_state)``: ``batch_at(source_state, start, key)``
    is the batch of ``mb`` observations at ``start`` of the epoch whose
    permutation ``key`` gives, traced inside ``jit`` with the source's
    state an argument (not a constant of the program).
  """
  from datarax.sources import MemorySource
  from datarax.sources import MemorySourceConfig
  from flax import nnx

  source = MemorySource(MemorySourceConfig(shuffle=True),
                        {k: jnp.asarray(v) for k, v in data.items()},
                        rngs=nnx.Rngs(seed))
  graphdef, state = nnx.split(source)

  def batch_at(state, start, key):
    return nnx.merge(graphdef, state).get_batch_at(start, mb, key)

  return batch_at, state


def memory_sampler(batch_at: Callable, n: int, mb: int, epochs: int,
                   update: Callable, steps: Optional[int] = None
                   ) -> Callable:
  """``run(theta, source_state, data_key, key)``: ``epochs`` epochs of
  ``n // mb`` SGLD steps (or their first ``steps``), the Datarax way
  (``scan`` mode): a scan over the batches of an epoch, the epoch's key
  (split off ``data_key``) fixed within it. XLA then computes the epoch's
  permutation once, not per batch; with a key per batch (``fold_in(data_key,
  epoch)`` in the step) a step over N=1e4 observations took 4.7 ms instead
  of 46 us here. Under ``jax.vmap`` the source's state (the data) is shared:
  ``in_axes`` and ``out_axes`` None."""
  per_epoch = n // mb if steps is None else steps

  def one(theta, source_state, data_key, key):
    def epoch(carry, _):
      theta, data_key, key = carry
      data_key, epoch_key = jax.random.split(data_key)

      def step(carry, b):
        theta, key = carry
        batch = batch_at(source_state, b * mb, epoch_key)
        return update(theta, key, batch), None

      (theta, key), _ = jax.lax.scan(step, (theta, key),
                                     jnp.arange(per_epoch))
      return (theta, data_key, key), None

    (theta, data_key, key), _ = jax.lax.scan(
        epoch, (theta, data_key, key), None, length=epochs)
    return theta, source_state, data_key, key

  return one


def disk_batches(data: dict[str, np.ndarray], mb: int, directory: str):
  """A ``StreamingDiskSource`` over x and y packed in one ``.npy`` file.

  Returns:
    ``batch_at(start) -> {"x", "y"}``, traced inside ``jit``.
  """
  from datarax.sources.streaming_disk_source import StreamingDiskSource
  from datarax.sources.streaming_disk_source import StreamingDiskSourceConfig

  x, y = data["x"], data["y"]
  path = os.path.join(directory, "xy.npy")
  np.save(path, np.concatenate([x, y[:, None].astype(x.dtype)], axis=1))
  source = StreamingDiskSource(StreamingDiskSourceConfig(path=path,
                                                         feature_key="xy"))
  features = x.shape[1]

  def batch_at(start):
    xy = source.get_batch_at(start, mb)["xy"]
    return {"x": xy[:, :features], "y": xy[:, features].astype(y.dtype)}

  return batch_at


def disk_sampler(batch_at: Callable, mb: int, steps: int,
                 update: Callable) -> Callable:
  """``run(theta, step, key)``: ``steps`` SGLD steps over consecutive
  windows of the file."""

  @jax.jit
  def run(theta, position, key):
    def step(carry, _):
      theta, position, key = carry
      theta, key = update(theta, key, batch_at(position * mb))
      return (theta, position + 1, key), None

    carry, _ = jax.lax.scan(step, (theta, position, key), None,
                            length=steps)
    return carry

  return run


def temporary_directory() -> tempfile.TemporaryDirectory:
  """Where the disk source's file goes (removed with the object)."""
  return tempfile.TemporaryDirectory(prefix="jax_data_datarax_")
