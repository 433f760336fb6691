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

Callback inputs are small int32 arrays with gradients stopped (per lane:
the pipeline that asks, the pipeline the state belongs to, its chain and the
chunk index); outputs are made device-varying inside ``shard_map`` by a
select against a varying value.

A bridge holds no host: the callback finds the asking pipeline's host by
its identity (``LIVE_HOSTS.host``), an operand of the compiled code, so
pipelines of the same formats share one bridge (:func:`shared`), and with it
their compiled steps.

With ``callback="auto"`` the callback on CPU is
``jax.experimental.buffer_callback``: the host copies each chunk straight
into XLA's output buffer with NumPy, which releases the GIL, so the prefetch
thread keeps working meanwhile. ``jax.pure_callback`` would copy the
returned arrays itself while holding the GIL, stalling the prefetch thread
for the whole copy. Other platforms, and ``callback="pure"`` everywhere, use
``pure_callback``.
"""

from __future__ import annotations

import contextvars
import functools
import math
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

from jax_data.compiled import huge_pages
from jax_data.lifetime import BRIDGES
from jax_data.lifetime import LIVE_HOSTS
from jax_data.types import CALLBACKS
from jax_data.types import Callback
from jax_data.types import PyTree
from jax_data.validation import check_choice

try:  # experimental in JAX; absent or moved, pure_callback serves all
  from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # pragma: no cover
  buffer_callback = None

def _varying(x) -> frozenset:
  """The mesh axes (of an enclosing ``shard_map``) that ``x`` varies over."""
  return frozenset(jax.typeof(x).manual_axis_type.varying)


def broadcast(axis_size: int, batched: Sequence[bool], args: Sequence[Any]
               ) -> List[Any]:
  """``args`` given a leading batch axis of ``axis_size`` where a
  ``custom_vmap`` rule received them unbatched."""
  return [a if b else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a))
          for a, b in zip(args, batched)]


def _lanes_rule(many: Callable[..., List[Any]]) -> Callable[..., Any]:
  """The ``custom_vmap`` rule that serves a vmapped call with ``many``, a
  function of lanes (see :func:`fold_lanes`): every input given the batch
  axis, every output batched."""

  def rule(axis_size, in_batched, *args):
    outs = many(*broadcast(axis_size, in_batched, args))
    return outs, [True] * len(outs)

  return rule


def fold_lanes(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a function of lane-major arrays so that ``vmap`` folds into lanes.

  ``fn`` takes and returns flat lists of arrays with a leading lane axis. A
  vmapped call with batch size ``B`` over ``L`` lanes calls ``fn`` once with
  ``B * L`` lanes.
  """
  wrapped = custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = broadcast(axis_size, in_batched, args)
    lanes = args[0].shape[1]
    flat = [a.reshape((axis_size * lanes,) + a.shape[2:]) for a in args]
    outs = wrapped(*flat)
    outs = [o.reshape((axis_size, lanes) + o.shape[1:]) for o in outs]
    return outs, [True] * len(outs)

  return wrapped


class Bridge:
  """Compiled-code access to the hosts of pipelines of one chunk format.

  Every request names the pipeline that asks (``owner``, an int32 operand);
  the callback serves it from that pipeline's host. Pipelines of the same
  formats share a bridge (see :func:`shared`).

  Args:
    batch_format: Pytree of ``jax.ShapeDtypeStruct`` of one chunk, with
      leading axes ``(cache_size, mb_size)``.
    callback: ``"auto"`` or ``"pure"`` (see ``jax_data.types.CALLBACKS``).
  """

  def __init__(self, batch_format: PyTree, callback: Callback = "auto"):
    self.callback = check_choice("callback", callback, CALLBACKS)
    leaves, self.treedef = jax.tree_util.tree_flatten(batch_format)
    self.leaf_formats = [jax.ShapeDtypeStruct(s.shape, s.dtype)
                         for s in leaves]
    self.mask_format = jax.ShapeDtypeStruct(leaves[0].shape[:2], jnp.bool_)
    self._ops: Dict[Tuple[int, int], _Ops] = {}

  @property
  def in_place(self) -> bool:
    """Whether CPU devices receive chunks in place (``buffer_callback``):
    not for dtypes of fewer than 8 bits (int4, float4_e2m1fn), which XLA
    packs in its buffers but NumPy holds one to a byte."""
    return (self.callback == "auto" and buffer_callback is not None
            and all(jax.dtypes.itemsize_bits(s.dtype) >= 8
                    for s in self.leaf_formats))

  def ops(self, device_count: int, participants: int) -> "_Ops":
    """The callback wrappers for requests that ``participants`` devices
    make together, ``device_count`` of them alike."""
    key = (device_count, participants)
    if key not in self._ops:
      self._ops[key] = _Ops(self, device_count, participants)
    return self._ops[key]

  def fetch(self, owner: Any, pipeline: jax.Array, chain: jax.Array,
            chunk: jax.Array, device_count: int = 1
            ) -> Tuple[PyTree, jax.Array]:
    """Chunk ``chunk`` of chain ``chain`` of pipeline ``pipeline``, served
    by pipeline ``owner``: (batches, mask)."""
    return self.ops(device_count, _participants()).fetch(owner, pipeline,
                                                         chain, chunk)

  def fetch_over(self, owner: Any, pipeline: jax.Array, chain: jax.Array,
                 chunk: jax.Array, need: jax.Array, batches: PyTree,
                 mask: jax.Array, device_count: int = 1):
    """:meth:`fetch` where ``need``, into the buffers of a spent cache where
    the CPU allows: ``(batches, mask, spent_batches, spent_mask)`` (see
    ``_Ops``)."""
    return self.ops(device_count, _participants()).fetch_over(
        owner, pipeline, chain, chunk, need, batches, mask)

  def fetch_steps(self, owner: Any, pipeline: jax.Array, chain: jax.Array,
                  chunk: jax.Array, need: jax.Array, device_count: int = 1
                  ) -> List[Tuple[PyTree, jax.Array]]:
    """:meth:`fetch` where ``need``, a buffer for each step: ``[(batch,
    mask)]``, one per batch of the chunk (see ``_Ops``)."""
    return self.ops(device_count, _participants()).fetch_steps(
        owner, pipeline, chain, chunk, need)

  def refresh(self, owner, pipeline, chain, chunk, cached_chunk, batches,
              mask, device_count: int = 1):
    """Makes sure the cache holds ``chunk``: (cached_chunk, batches, mask)."""
    return self.ops(device_count, _participants()).refresh(
        owner, pipeline, chain, chunk, cached_chunk, batches, mask)


def shared(batch_format: PyTree, callback: Callback = "auto") -> Bridge:
  """The bridge of chunks of ``batch_format`` received the ``callback``
  way, one per process: pipelines of the same formats, cache and batch
  sizes trace, and so compile, the same code. A bridge holds only formats
  and the wrappers built on them."""
  callback = check_choice("callback", callback, CALLBACKS)
  leaves, treedef = jax.tree_util.tree_flatten(batch_format)
  # The dtype itself, not its ``.str``: ml_dtypes' types of one size share
  # one (bfloat16 is "<V2"; int4 and float8_e4m3fn are both "<V1").
  key = (treedef, tuple((tuple(s.shape), np.dtype(s.dtype))
                        for s in leaves), callback)
  return BRIDGES.get(key, lambda: Bridge(batch_format, callback))


def _manual_axes() -> tuple:
  """The mesh axes of the enclosing ``shard_map`` (or ``pmap``); none
  outside one. One device of this process may run per-device code of a
  mesh over the devices of several processes."""
  return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def in_per_device_code() -> bool:
  """Whether per-device code (``shard_map``, ``pmap``) is being traced."""
  return bool(_manual_axes())


#: The mesh whose per-device code is being traced (:func:`on_mesh`), where
#: a global pipeline knows it; ``None`` elsewhere.
_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jax_data_mesh", default=None)


def on_mesh(mesh: Any, fun: Callable) -> Callable:
  """``fun``, the per-device code of a ``shard_map`` over ``mesh``, traced
  knowing the mesh's devices: so that a mesh of some of this process's
  devices counts only those among the requests of one refresh."""
  @functools.wraps(fun)
  def traced(*args, **kwargs):
    token = _MESH.set(mesh)
    try:
      return fun(*args, **kwargs)
    finally:
      _MESH.reset(token)
  return traced


def _participants() -> int:
  """How many devices of this process run the current per-device code
  (pmap, shard_map): each of them makes the same refresh request at the
  same point, to this process's host. In a job of several processes the
  mesh of a global pipeline (:func:`on_mesh`) holds some devices of this
  process, counted; a mesh over every device (pmap's, a user's global
  shard_map's) holds all of them; the others ask their own processes'
  hosts."""
  mesh = jax.sharding.get_abstract_mesh()
  devices = math.prod(mesh.shape[a] for a in _manual_axes())
  if devices > 1 and jax.process_count() > 1:
    known = _MESH.get()
    local = (jax.local_device_count() if known is None else sum(
        d.process_index == jax.process_index() for d in known.devices.flat))
    return min(devices, local)
  return devices


class _Ops:
  """The callback and its ``custom_vmap`` wrappers for one device_count and
  number of participating devices."""

  def __init__(self, bridge: Bridge, device_count: int, participants: int):
    self.treedef = bridge.treedef
    self._in_place = bridge.in_place
    self._leaf_formats = bridge.leaf_formats
    self._mask_format = bridge.mask_format
    self._device_count = device_count
    self._participants = participants
    self._fetch_many = fold_lanes(self._fetch_lanes_flat)
    self._fetch_over_many = fold_lanes(self._fetch_over_lanes_flat)
    self._refresh_many = fold_lanes(self._refresh_lanes_flat)
    self._fetch_steps_many = fold_lanes(self._fetch_steps_lanes_flat)
    self.fetch = self._make_fetch()
    self.fetch_steps = self._make_fetch_steps()
    self.fetch_over = self._make_fetch_over()
    self.refresh = self._make_refresh()

  def _fetch_lanes(self, owners, pipelines, chains, chunks, need,
                   lanes_second: bool = False, spent: Sequence[Any] = ()
                   ) -> List[jax.Array]:
    """Each leaf's and the mask's chunks for ``L`` lanes, lane axis first.

    With ``lanes_second`` and several lanes, on CPU the host writes them
    with the lane axis second, ``(cache_size, L, ...)``, and they are
    presented moved to the front: a ``lax.scan`` over vmapped chunks moves
    the lane axis second again to scan over the first, so XLA then reads
    the callback's buffer as it is, where it would otherwise copy every
    chunk of every lane into that order at each refresh.

    With ``spent`` (caches of these lanes whose contents are no longer
    wanted, each leaf's then the mask's), on CPU the host writes into
    their buffers rather than fresh ones, and those buffers come back after
    the chunks, in the caches' shapes (holding the chunks in the order
    written: not a cache of them); elsewhere ``spent`` comes back as it
    is."""
    if spent and _manual_axes():
      # Inside shard_map the buffers written would come back typed
      # device-invariant, and a select to type them varying copies them:
      # fresh buffers, the caches as they are.
      return self._fetch_lanes(owners, pipelines, chains, chunks, need,
                               lanes_second) + list(spent)
    lanes = chains.shape[0]
    formats = self._leaf_formats + [self._mask_format]
    outs = [jax.ShapeDtypeStruct((lanes,) + s.shape, s.dtype)
            for s in formats]
    callback = _Callback(self._device_count, self._participants)
    args = (owners, pipelines, chains, chunks, need) + tuple(spent)
    aliases = {5 + i: i for i in range(len(spent))}

    def copied(*args):
      return list(jax.pure_callback(callback, outs, *args[:5],
                                    vmap_method="sequential")) + list(args[5:])

    if not self._in_place:
      return copied(*args)
    if lanes_second and lanes > 1:
      second = [jax.ShapeDtypeStruct(s.shape[:1] + (lanes,) + s.shape[1:],
                                     s.dtype) for s in formats]
      if spent:
        # The caches' own shapes, which the host reads as lanes second: an
        # operand reshaped to alias made XLA copy it first.
        written = buffer_callback(callback.into_lanes_second_as_first, outs,
                                  vmap_method="sequential",
                                  input_output_aliases=aliases)
      else:
        written = buffer_callback(callback.into_lanes_second, second,
                                  vmap_method="sequential")

      def in_place(*args):
        raw = written(*args)
        return [jnp.moveaxis(o.reshape(s.shape), 1, 0)
                for o, s in zip(raw, second)] + list(raw[:len(args) - 5])
    else:
      into = buffer_callback(callback.into, outs, vmap_method="sequential",
                             input_output_aliases=aliases)

      def in_place(*args):
        raw = list(into(*args))
        return raw + raw[:len(args) - 5]
    return lax.platform_dependent(*args, cpu=in_place, default=copied)

  def _fetch_lanes_flat(self, owners, pipelines, chains, chunks):
    need = jnp.ones(chains.shape, jnp.bool_)
    outs = self._fetch_lanes(owners, pipelines, chains, chunks, need,
                             lanes_second=True)
    return _varying_like(outs, chains == chains, _varying(pipelines)
                         | _varying(chains) | _varying(chunks))

  def _fetch_over_lanes_flat(self, owners, pipelines, chains, chunks, need,
                             *spent):
    outs = self._fetch_lanes(owners, pipelines, chains, chunks, need,
                             lanes_second=True, spent=spent)
    fetched = len(outs) - len(spent)
    return _varying_like(outs[:fetched], chains == chains,
                         _varying(pipelines) | _varying(chains)
                         | _varying(chunks) | _varying(need)) + outs[fetched:]

  def _fetch_steps_lanes_flat(self, owners, pipelines, chains, chunks,
                              need) -> List[jax.Array]:
    """:meth:`_fetch_lanes` with each batch of the chunk in buffers of its
    own: step ``k``'s leaves then its mask, for every ``k``, each with a
    leading lane axis. On CPU the host writes the rows straight into them,
    and a step's products read them there; sliced out of one chunk's
    buffer, each step's batch was copied first by XLA, every step (256
    vmapped chains of case (g): 2.2 MB a step). Not for per-device code
    (``RandomPipeline._by_step``), whose outputs would need marking
    device-varying."""
    formats = self._leaf_formats + [self._mask_format]
    steps = formats[0].shape[0]
    lanes = chains.shape[0]
    args = (owners, pipelines, chains, chunks, need)

    def copied(*args):
      chunk = self._fetch_lanes(*args)
      return [c[:, k] for k in range(steps) for c in chunk]

    if not self._in_place:
      return copied(*args)
    outs = [jax.ShapeDtypeStruct((lanes,) + s.shape[1:], s.dtype)
            for _ in range(steps) for s in formats]
    into = buffer_callback(functools.partial(
        _Callback(self._device_count, self._participants).into_steps,
        len(formats)), outs, vmap_method="sequential")
    return lax.platform_dependent(*args, cpu=lambda *a: list(into(*a)),
                                  default=copied)

  def _fetch_over_one(self, owner, pipeline, chain, chunk, need, *spent):
    """:meth:`_fetch_over_lanes_flat` for one chain, outside ``vmap``: on
    CPU into its caches as they are (a lane axis added to them in compiled
    code made XLA copy them before the host wrote into them)."""
    args = (owner, pipeline, chain, chunk, need) + spent

    def as_lanes(*args):  # fresh buffers, or the caches passed through
      return [o[0] for o in self._fetch_over_many(*[a[None] for a in args])]

    if not self._in_place or _manual_axes():
      return as_lanes(*args)
    formats = self._leaf_formats + [self._mask_format]
    into = buffer_callback(
        _Callback(self._device_count, self._participants).into_one,
        formats, vmap_method="sequential",
        input_output_aliases={5 + i: i for i in range(len(spent))})

    def in_place(*args):
      written = list(into(*args))
      return written + written

    return lax.platform_dependent(*args, cpu=in_place, default=as_lanes)

  def _merge_lanes(self, owners, pipelines, chains, chunks, need, old
                   ) -> List[jax.Array]:
    """The caches ``old`` (each leaf, then the mask, a leading lane axis)
    with the lanes that ``need`` it refreshed. On CPU the host writes those
    lanes into the caches' own buffers (``buffer_callback`` with each cache
    aliased to its output), so a refresh of many vmapped chains needs no
    second cache-sized buffer and no select over the caches; elsewhere the
    fetched lanes are selected into the old caches."""

    def copied(owners, pipelines, chains, chunks, need, *old):
      new = self._fetch_lanes(owners, pipelines, chains, chunks, need)
      return [jnp.where(need.reshape(need.shape + (1,) * (n.ndim - 1)), n, o)
              for n, o in zip(new, old)]

    args = (owners, pipelines, chains, chunks, need, *old)
    if not self._in_place:
      return copied(*args)
    callback = _Callback(self._device_count, self._participants)
    outs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in old]
    kept = buffer_callback(
        callback.into_kept, outs, vmap_method="sequential",
        input_output_aliases={5 + i: i for i in range(len(old))})

    def in_place(*args):
      # Inside shard_map: the device-varying type of the inputs, as the
      # select of the other branch gives it.
      axes = frozenset().union(*(_varying(a) for a in args))
      return _varying_like(list(kept(*args)), args[2] == args[2], axes)

    return lax.platform_dependent(*args, cpu=in_place, default=copied)

  def _refresh_lanes_flat(self, owners, pipelines, chains, chunks,
                          cached_chunks, mask, *leaves):
    need = _needs(cached_chunks, chunks)

    def fetch(loop):
      round_, cached_chunks, *caches = loop
      # From the loop's own values: a request of values from outside the
      # loop alone XLA hoisted out of it, and asked for every step.
      need = _needs(cached_chunks, chunks)
      merged = self._merge_lanes(owners, pipelines, chains, chunks, need,
                                 caches)
      return [round_ + 1, jnp.where(need, chunks, cached_chunks)] + merged

    # A loop of one round where a lane needs its chunk, of none otherwise,
    # not a lax.cond: XLA copied the caches after the host wrote into them
    # in a branch of a cond (83 MiB per refresh at 1,024 vmapped chains),
    # where a loop's carry stays in place.
    _, cached_chunks, *caches = lax.while_loop(
        lambda loop: loop[0] < jnp.any(need).astype(jnp.int32), fetch,
        [jnp.int32(0), cached_chunks] + list(leaves) + [mask])
    return [cached_chunks] + caches

  def _make_fetch(self):
    @custom_vmap
    def fetch(owner, pipeline, chain, chunk):
      outs = self._fetch_many(owner[None], pipeline[None], chain[None],
                              chunk[None])
      return [o[0] for o in outs]

    fetch.def_vmap(_lanes_rule(self._fetch_many))

    def fetch_chunk(owner: Any, pipeline: jax.Array, chain: jax.Array,
                    chunk: jax.Array) -> Tuple[PyTree, jax.Array]:
      """Chunk ``chunk`` of chain ``chain``: (batches, mask)."""
      args = [lax.stop_gradient(jnp.asarray(a, jnp.int32))
              for a in (owner, pipeline, chain, chunk)]
      *leaves, mask = fetch(*args)
      return self.treedef.unflatten(leaves), mask

    return fetch_chunk

  def _make_fetch_steps(self):
    @custom_vmap
    def fetch(owner, pipeline, chain, chunk, need):
      outs = self._fetch_steps_many(owner[None], pipeline[None],
                                    chain[None], chunk[None], need[None])
      return [o[0] for o in outs]

    fetch.def_vmap(_lanes_rule(self._fetch_steps_many))

    def fetch_steps(owner: Any, pipeline: jax.Array, chain: jax.Array,
                    chunk: jax.Array, need: jax.Array
                    ) -> List[Tuple[PyTree, jax.Array]]:
      """Chunk ``chunk`` of chain ``chain`` where ``need`` (else batches
      not to be used), each batch in buffers of its own: ``[(batch,
      mask)]``, one per step."""
      args = [lax.stop_gradient(jnp.asarray(a, jnp.int32))
              for a in (owner, pipeline, chain, chunk)]
      outs = fetch(*args, jnp.asarray(need, jnp.bool_))
      width = len(self._leaf_formats) + 1
      return [(self.treedef.unflatten(outs[k:k + width - 1]),
               outs[k + width - 1]) for k in range(0, len(outs), width)]

    return fetch_steps

  def _make_fetch_over(self):
    @custom_vmap
    def fetch(owner, pipeline, chain, chunk, need, *spent):
      return self._fetch_over_one(owner, pipeline, chain, chunk, need,
                                  *spent)

    fetch.def_vmap(_lanes_rule(self._fetch_over_many))

    def fetch_over(owner: Any, pipeline: jax.Array, chain: jax.Array,
                   chunk: jax.Array, need: jax.Array, batches: PyTree,
                   mask: jax.Array
                   ) -> Tuple[PyTree, jax.Array, PyTree, jax.Array]:
      """Chunk ``chunk`` of chain ``chain`` where ``need`` (else nothing
      is fetched, and the batches are not to be used), written where the
      CPU allows into the buffers of a cache whose contents are spent
      (``batches``, ``mask``): ``(batches, mask, spent_batches,
      spent_mask)``, the last two the cache's arrays to carry on (holding
      no chunk), or the cache as it was."""
      args = [lax.stop_gradient(jnp.asarray(a, jnp.int32))
              for a in (owner, pipeline, chain, chunk)]
      spent = [lax.stop_gradient(a) for a in
               self.treedef.flatten_up_to(batches) + [mask]]
      outs = fetch(*args, jnp.asarray(need, jnp.bool_), *spent)
      *leaves, new_mask = outs[:len(spent)]
      *buffers, buffer_mask = outs[len(spent):]
      return (self.treedef.unflatten(leaves), new_mask,
              self.treedef.unflatten(buffers), buffer_mask)

    return fetch_over

  def _make_refresh(self):
    @custom_vmap
    def refresh(owner, pipeline, chain, chunk, cached_chunk, mask, *leaves):
      def fetch(ops):
        owner, pipeline, chain, chunk, cached_chunk, mask, *leaves = ops
        need = _needs(cached_chunk, chunk)
        new = [n[0] for n in self._fetch_lanes(
            owner[None], pipeline[None], chain[None], chunk[None],
            need[None])]
        if not _manual_axes():  # outside shard_map: no varying types
          return [chunk] + new
        # Inside shard_map, merging with the old cache (a select over the
        # cache) gives the outputs the device-varying type of the state.
        merged = [jnp.where(need, n, o)
                  for n, o in zip(new, list(leaves) + [mask])]
        return [jnp.where(need, chunk, cached_chunk)] + merged

      def keep(ops):
        _, _, _, _, cached_chunk, mask, *leaves = ops
        return [cached_chunk] + list(leaves) + [mask]

      ops = [owner, pipeline, chain, chunk, cached_chunk, mask] + list(leaves)
      return lax.cond(_needs(cached_chunk, chunk), fetch, keep, ops)

    refresh.def_vmap(_lanes_rule(self._refresh_many))

    def refresh_cache(owner, pipeline, chain, chunk, cached_chunk, batches,
                      mask):
      """Makes sure the cache holds ``chunk``: (cached_chunk, batches, mask)."""
      leaves = self.treedef.flatten_up_to(batches)
      owner = jnp.asarray(owner, jnp.int32)
      args = [owner, pipeline, chain, chunk, cached_chunk, mask] + list(leaves)
      args = [lax.stop_gradient(a) for a in args]
      cached_chunk, *rest = refresh(*args)
      *leaves, mask = rest
      return cached_chunk, self.treedef.unflatten(leaves), mask

    return refresh_cache


class _Callback:
  """The host function compiled code calls.

  It holds no host: it serves each request from the host of the pipeline
  that asks (the ``owners`` operand), looked up in ``LIVE_HOSTS``, so that
  compiled code shared by pipelines of the same formats serves each from its
  own host, and compiled code kept in JAX's caches keeps no pipeline alive.
  """

  def __init__(self, device_count: int, participants: int):
    self._device_count = device_count
    self._participants = participants

  def __call__(self, owners, pipelines, chains, chunks, need):
    """``pure_callback``: returns the lanes' arrays."""
    with _request():
      return LIVE_HOSTS.host(_owner(owners)).serve(
          pipelines, chains, chunks, need, self._device_count,
          self._participants)

  def into(self, context, outs, owners, pipelines, chains, chunks, need,
           *spent) -> None:
    """``buffer_callback``: writes the lanes into XLA's buffers ``outs``
    (the lanes that ``need`` nothing get zeros, or into ``spent`` buffers
    are left as they are)."""
    del context
    self._serve_into(outs, owners, pipelines, chains, chunks, need,
                     bool(spent))

  def into_one(self, context, outs, owner, pipeline, chain, chunk, need,
               *spent) -> None:
    """:meth:`into` for one chain's buffers and scalars, no lane axis (the
    ``spent`` caches aliased to ``outs``)."""
    del context, spent
    lane = [np.asarray(a).reshape(1) for a in (owner, pipeline, chain, chunk,
                                               need)]
    self._serve_into([np.asarray(o)[None] for o in outs], *lane, True)

  def into_lanes_second(self, context, outs, owners, pipelines, chains,
                        chunks, need) -> None:
    """:meth:`into` for buffers whose lane axis is second."""
    del context
    outs = [np.moveaxis(np.asarray(o), 1, 0) for o in outs]
    self._serve_into(outs, owners, pipelines, chains, chunks, need, False)

  def into_lanes_second_as_first(self, context, outs, owners, pipelines,
                                 chains, chunks, need, *spent) -> None:
    """:meth:`into_lanes_second` for buffers shaped lane axis first (the
    ``spent`` caches aliased to ``outs``, their contents spent): their
    bytes are written lane axis second; lanes that ``need`` nothing are
    left as they are."""
    del context, spent
    outs = [np.asarray(out) for out in outs]
    lanes = [np.asarray(a) for a in (pipelines, chains, chunks, need)]
    with _request():
      host = LIVE_HOSTS.host(_owner(owners))
      tried = self._device_count * self._participants == 1
      if tried and host.serve_group_lanes_second(outs, *lanes):
        return
      views = []
      for out in outs:
        second = out.reshape(out.shape[1:2] + out.shape[:1] + out.shape[2:])
        views.append(np.moveaxis(second, 1, 0))
      host.serve_into(views, *lanes, self._device_count, self._participants,
                      keep_others=True, cpu=True, group_tried=tried)

  def into_steps(self, width: int, context, outs, owners, pipelines, chains,
                 chunks, need) -> None:
    """``buffer_callback`` into a buffer per step (step ``k``'s ``width``
    buffers, its leaves then its mask, for every ``k``, a leading lane axis
    each; :meth:`Host.serve_steps_into`): lanes that ``need`` nothing get
    zeros."""
    del context
    outs = [np.asarray(o) for o in outs]
    steps = [outs[k:k + width] for k in range(0, len(outs), width)]
    with _request():
      LIVE_HOSTS.host(_owner(owners)).serve_steps_into(
          steps, np.asarray(pipelines), np.asarray(chains),
          np.asarray(chunks), np.asarray(need), self._device_count,
          self._participants)

  def into_kept(self, context, outs, owners, pipelines, chains, chunks, need,
                *kept) -> None:
    """``buffer_callback`` with the caches aliased to ``outs``: writes the
    lanes that ``need`` a chunk, and leaves the others as they are."""
    del context, kept
    self._serve_into(outs, owners, pipelines, chains, chunks, need, True)

  def _serve_into(self, outs, owners, pipelines, chains, chunks, need,
                  keep: bool) -> None:
    outs = [np.asarray(o) for o in outs]
    if not keep:  # fresh buffers of this call, not yet written
      huge_pages.advise(outs)
    with _request():
      LIVE_HOSTS.host(_owner(owners)).serve_into(
          outs, np.asarray(pipelines),
          np.asarray(chains), np.asarray(chunks), np.asarray(need),
          self._device_count, self._participants, keep_others=keep,
          cpu=True)


class _request:  # pylint: disable=invalid-name
  """A callback's request to a host: counted while it runs
  (``LIVE_HOSTS.begin_request``), its failure noted. A class, not a
  generator's context manager: it runs on every refresh."""

  def __enter__(self) -> None:
    LIVE_HOSTS.begin_request()

  def __exit__(self, kind, value, traceback) -> None:
    try:
      if kind is not None:
        LIVE_HOSTS.note_failed_callback()
    finally:
      LIVE_HOSTS.end_request()


def _owner(owners) -> int:
  """The pipeline that asks: every lane of a request names the same one
  (one pipeline's function made it; vmap only repeats it)."""
  owners = np.asarray(owners).reshape(-1)
  return int(owners[0]) if owners.size else 0


def _needs(cached_chunk: jax.Array, chunk: jax.Array) -> jax.Array:
  """Whether a cache must be fetched: it holds another chunk, or the chunk
  counter is negative (a state built by hand; the host refuses it, where
  the -1 of an empty cache would match it)."""
  return (cached_chunk != chunk) | (chunk < 0)


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
