"""Device side of the bridge: fetching chunks from compiled code.

Every fetch goes through one host callback that takes a *lane* axis:
``L`` chains and chunk indices, answered by one host call. Two
``jax.custom_batching.custom_vmap`` wrappers keep it that way under ``vmap``
(``spec/CALLBACKS.md``):

* a vmapped call folds its batch axis into the lane axis, nested vmaps
  included, so all lanes are served by one host call;
* the refresh of a random chain is a ``lax.cond`` whose predicate stays
  unbatched (any lane needs a new chunk), so the host is called once per
  cache refresh, not on every step.

Callback inputs are small int32 arrays with gradients stopped; outputs are
made device-varying inside ``shard_map`` by a select against a varying value.

On CPU the callback is ``jax.experimental.buffer_callback``: the host copies
each chunk straight into XLA's output buffer with NumPy, which releases the
GIL, so the prefetch thread keeps working meanwhile. ``jax.pure_callback``
would copy the returned arrays itself while holding the GIL, stalling the
prefetch thread for the whole copy. Other platforms use ``pure_callback``.
"""

from __future__ import annotations

import math
import weakref
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Sequence
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap

from jax_data.host import ChunkServer
from jax_data.host import PipelineReleasedError
from jax_data.types import PyTree

try:  # experimental in JAX; absent or moved, pure_callback serves all
  from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # pragma: no cover
  buffer_callback = None


# Whether CPU devices are served in place (buffer_callback). Read when a
# pipeline's code is traced; tests turn it off to check the other path.
IN_PLACE = True


def _vma(x) -> frozenset:
  return frozenset(getattr(jax.typeof(x), "vma", ()) or ())


def _broadcast(axis_size: int, batched: Sequence[bool], args: Sequence[Any]
               ) -> List[Any]:
  return [a if b else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a))
          for a, b in zip(args, batched)]


def _fold_lanes(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a function of lane-major arrays so that ``vmap`` folds into lanes.

  ``fn`` takes and returns flat lists of arrays with a leading lane axis. A
  vmapped call with batch size ``B`` over ``L`` lanes calls ``fn`` once with
  ``B * L`` lanes.
  """
  wrapped = custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = _broadcast(axis_size, in_batched, args)
    lanes = args[0].shape[1]
    flat = [a.reshape((axis_size * lanes,) + a.shape[2:]) for a in args]
    outs = wrapped(*flat)
    outs = [o.reshape((axis_size, lanes) + o.shape[1:]) for o in outs]
    return outs, [True] * len(outs)

  return wrapped


class Bridge:
  """Compiled-code access to a :class:`ChunkServer`.

  Args:
    server: The host side.
    batch_format: Pytree of ``jax.ShapeDtypeStruct`` of one chunk, with
      leading axes ``(cache_size, mb_size)``.
  """

  def __init__(self, server: ChunkServer, batch_format: PyTree):
    self.server = server
    leaves, self.treedef = jax.tree_util.tree_flatten(batch_format)
    self.leaf_formats = [jax.ShapeDtypeStruct(s.shape, s.dtype)
                         for s in leaves]
    self.mask_format = jax.ShapeDtypeStruct(
        (server.cache_size, server.mb_size), jnp.bool_)
    self._ops: Dict[Tuple[int, int], _Ops] = {}

  def ops(self, device_count: int, participants: int) -> "_Ops":
    """The callback wrappers for requests that ``participants`` devices
    make together, ``device_count`` of them alike."""
    key = (device_count, participants)
    if key not in self._ops:
      self._ops[key] = _Ops(self, device_count, participants)
    return self._ops[key]

  def fetch(self, chain: jax.Array, chunk: jax.Array, device_count: int = 1
            ) -> Tuple[PyTree, jax.Array]:
    """Chunk ``chunk`` of chain ``chain``: (batches, mask)."""
    return self.ops(device_count, _participants()).fetch(chain, chunk)

  def refresh(self, chain, chunk, cached_chunk, batches, mask,
              device_count: int = 1):
    """Makes sure the cache holds ``chunk``: (cached_chunk, batches, mask)."""
    return self.ops(device_count, _participants()).refresh(
        chain, chunk, cached_chunk, batches, mask)


def _participants() -> int:
  """How many devices run the current per-device code (pmap, shard_map):
  each of them makes the same refresh request at the same point."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in getattr(mesh, "manual_axes", ()))


class _Ops:
  """The callback and its ``custom_vmap`` wrappers for one device_count and
  number of participating devices."""

  def __init__(self, bridge: Bridge, device_count: int, participants: int):
    self.server = bridge.server
    self.treedef = bridge.treedef
    self._leaf_formats = bridge.leaf_formats
    self._mask_format = bridge.mask_format
    self._device_count = device_count
    self._participants = participants
    self._fetch_many = _fold_lanes(self._fetch_lanes_flat)
    self._refresh_many = _fold_lanes(self._refresh_lanes_flat)
    self.fetch = self._make_fetch()
    self.refresh = self._make_refresh()

  def _fetch_lanes(self, chains, chunks, need) -> List[jax.Array]:
    lanes = chains.shape[0]
    outs = [jax.ShapeDtypeStruct((lanes,) + s.shape, s.dtype)
            for s in self._leaf_formats + [self._mask_format]]
    callback = _Callback(self.server, self._device_count, self._participants)

    def copied(chains, chunks, need):
      return list(jax.pure_callback(callback, outs, chains, chunks, need,
                                    vmap_method="sequential"))

    if not IN_PLACE or buffer_callback is None:
      return copied(chains, chunks, need)

    in_place = buffer_callback(callback.into, outs, vmap_method="sequential")
    return lax.platform_dependent(chains, chunks, need, cpu=in_place,
                                  default=copied)

  def _fetch_lanes_flat(self, chains, chunks):
    need = jnp.ones(chains.shape, jnp.bool_)
    outs = self._fetch_lanes(chains, chunks, need)
    return _varying_like(outs, chains == chains, _vma(chains) | _vma(chunks))

  def _refresh_lanes_flat(self, chains, chunks, cached_chunks, mask,
                          *leaves):
    need = cached_chunks != chunks

    def fetch(ops):
      chains, chunks, cached_chunks, mask, *leaves = ops
      need = cached_chunks != chunks
      new = self._fetch_lanes(chains, chunks, need)
      old = list(leaves) + [mask]
      merged = [jnp.where(need.reshape(need.shape + (1,) * (n.ndim - 1)), n, o)
                for n, o in zip(new, old)]
      return [jnp.where(need, chunks, cached_chunks)] + merged

    def keep(ops):
      chains, chunks, cached_chunks, mask, *leaves = ops
      return [cached_chunks] + list(leaves) + [mask]

    ops = [chains, chunks, cached_chunks, mask] + list(leaves)
    return lax.cond(jnp.any(need), fetch, keep, ops)

  def _make_fetch(self):
    @custom_vmap
    def fetch(chain, chunk):
      outs = self._fetch_many(chain[None], chunk[None])
      return [o[0] for o in outs]

    @fetch.def_vmap
    def _rule(axis_size, in_batched, chain, chunk):
      chain, chunk = _broadcast(axis_size, in_batched, (chain, chunk))
      outs = self._fetch_many(chain, chunk)
      return outs, [True] * len(outs)

    def fetch_chunk(chain: jax.Array, chunk: jax.Array
                    ) -> Tuple[PyTree, jax.Array]:
      """Chunk ``chunk`` of chain ``chain``: (batches, mask)."""
      chain = lax.stop_gradient(jnp.asarray(chain, jnp.int32))
      chunk = lax.stop_gradient(jnp.asarray(chunk, jnp.int32))
      *leaves, mask = fetch(chain, chunk)
      return self.treedef.unflatten(leaves), mask

    return fetch_chunk

  def _make_refresh(self):
    @custom_vmap
    def refresh(chain, chunk, cached_chunk, mask, *leaves):
      def fetch(ops):
        chain, chunk, cached_chunk, mask, *leaves = ops
        need = cached_chunk != chunk
        new = [n[0] for n in self._fetch_lanes(chain[None], chunk[None],
                                                need[None])]
        if _participants() == 1:  # no manual axes: no varying types
          return [chunk] + new
        # Inside shard_map, merging with the old cache (a select over the
        # cache) gives the outputs the device-varying type of the state.
        merged = [jnp.where(need, n, o)
                  for n, o in zip(new, list(leaves) + [mask])]
        return [jnp.where(need, chunk, cached_chunk)] + merged

      def keep(ops):
        chain, chunk, cached_chunk, mask, *leaves = ops
        return [cached_chunk] + list(leaves) + [mask]

      ops = [chain, chunk, cached_chunk, mask] + list(leaves)
      return lax.cond(cached_chunk != chunk, fetch, keep, ops)

    @refresh.def_vmap
    def _rule(axis_size, in_batched, *args):
      args = _broadcast(axis_size, in_batched, args)
      outs = self._refresh_many(*args)
      return outs, [True] * len(outs)

    def refresh_cache(chain, chunk, cached_chunk, batches, mask):
      """Makes sure the cache holds ``chunk``: (cached_chunk, batches, mask)."""
      leaves = self.treedef.flatten_up_to(batches)
      args = [chain, chunk, cached_chunk, mask] + list(leaves)
      args = [lax.stop_gradient(a) for a in args]
      cached_chunk, *rest = refresh(*args)
      *leaves, mask = rest
      return cached_chunk, self.treedef.unflatten(leaves), mask

    return refresh_cache


class _Callback:
  """The host function compiled code calls.

  It holds its server weakly: compiled executables keep their callbacks,
  and JAX's caches keep executables while their functions live, so a strong
  reference would keep every pipeline alive for good.
  """

  def __init__(self, server: ChunkServer, device_count: int,
               participants: int):
    self._server = weakref.ref(server)
    self._device_count = device_count
    self._participants = participants

  def _live_server(self) -> ChunkServer:
    server = self._server()
    if server is None:
      raise PipelineReleasedError(
          "compiled code called a jax_data pipeline that no longer exists")
    return server

  def __call__(self, chains, chunks, need):
    """``pure_callback``: returns the lanes' arrays."""
    return self._live_server().serve(chains, chunks, need,
                                     self._device_count, self._participants)

  def into(self, context, outs, chains, chunks, need) -> None:
    """``buffer_callback``: writes the lanes into XLA's buffers ``outs``."""
    del context
    self._live_server().serve_into(
        [np.asarray(o) for o in outs], np.asarray(chains),
        np.asarray(chunks), np.asarray(need), self._device_count,
        self._participants)


def _varying_like(outs, predicate, axes) -> List[jax.Array]:
  """Marks callback outputs device-varying when their inputs are.

  Inside ``shard_map`` a callback's outputs are typed device-invariant even
  when its inputs vary; a select against a varying (always true) predicate
  gives them the varying type without a collective.
  """
  if not axes:
    return outs
  marked = []
  for o in outs:
    pred = predicate.reshape(predicate.shape + (1,) * (o.ndim - predicate.ndim))
    marked.append(jnp.where(pred, o, jnp.zeros((), o.dtype)))
  return marked
