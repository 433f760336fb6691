"""Splitting the observations across processes."""

from __future__ import annotations

from typing import TypedDict

import jax


class ProcessShard(TypedDict):
  """The keywords of :func:`process_shard`."""
  shard_index: int
  shard_count: int


def process_shard() -> ProcessShard:
  """This process's shard of the observations, for several JAX processes.

  Returns ``{"shard_index": jax.process_index(), "shard_count":
  jax.process_count()}``; pass it on with ``**`` to a random chain's
  ``init_fn`` or to :func:`~jax_data.full_reference_data` /
  :func:`~jax_data.full_data_mapper`. Shards are contiguous, disjoint and
  cover every observation; their sizes differ by at most one.

  >>> import jax_data
  >>> jax_data.process_shard()  # a single process holds everything
  {'shard_index': 0, 'shard_count': 1}
  """
  return {"shard_index": jax.process_index(),
          "shard_count": jax.process_count()}
