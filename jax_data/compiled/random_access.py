"""Random mini-batches inside compiled code: :func:`random_reference_data`."""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
import weakref
from typing import Any
from typing import Callable
from typing import Iterator
from typing import List
from typing import Optional
from typing import Tuple
from typing import Union
from typing import cast

import jax
import numpy as np
from jax.sharding import Mesh

from jax_data.compiled import device_loader
from jax_data.compiled import global_batches
from jax_data.compiled import pipeline as pl
from jax_data.compiled import scan as scan_lib
from jax_data.compiled import states
from jax_data.compiled.bridge import Bridge
from jax_data.compiled.bridge import in_per_device_code
from jax_data.lifetime import STEPS
from jax_data.loaders.host_loader import HostDataLoader
from jax_data.loaders.host_loader import chain_specs
from jax_data.loaders.loader import DataLoader
from jax_data.types import CacheState
from jax_data.types import Callback
from jax_data.types import MiniBatchInformation
from jax_data.types import RandomBatch
from jax_data.validation import MAX_AXIS
from jax_data.validation import check_bool
from jax_data.validation import seed_list

# jax_data.scan unrolls a chunk's steps over a buffer per step for caches
# of at most this many batches, where all chains' batches of a step take
# at least STEP_BYTES (RandomPipeline._by_step).
STEPS_UNROLLED = 8
STEP_BYTES = 1 << 20


def random_reference_data(data_loader: DataLoader,
                          cached_batches_count: Union[int, str],
                          mb_size: int, verify_calls: bool = False, *,
                          callback: Callback = "auto",
                          mesh: Optional[Mesh] = None,
                          batch_axis: Optional[str] = None,
                          chain_axis: Optional[str] = None) -> RandomBatch:
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
    cached_batches_count: Batches fetched per host call (the device
      cache), or ``"auto"``: chosen when the first chains are made, for
      their number (``init_fn(seed=range(C))``: C; one seed: one), so that
      all their caches hold about 16 MiB together on a CPU device whose
      cores share 64 MiB of L3 or more (256 MiB on others, and on CPUs of
      less L3: :func:`~jax_data.compiled.pipeline.auto_budget`), 1 to
      1,000 batches each (at least 100, where they fit,
      for chains that are not of counter-based streams, whose refreshes
      pay a fixed part per chain)
      (:func:`~jax_data.compiled.pipeline.auto_cache_size`). Chains made
      later get the same size (a warning says when so many are made, or
      held at once, that ``"auto"`` would choose half the batches or
      fewer for them); a restored checkpoint keeps its own.
    mb_size: Observations per batch.
    verify_calls: Warn when a chunk of an exact stream is requested again
      after the chain moved on (a state used twice or replayed), which
      costs regeneration; counter-based chains make any chunk again at the
      cost of its first making, and do not warn.
    callback: How compiled code receives chunks: ``"auto"`` (written in
      place into XLA's buffer on CPU, ``jax.pure_callback`` elsewhere) or
      ``"pure"`` (``jax.pure_callback`` everywhere).
    mesh: With ``batch_axis``: global batches. Each batch is a global
      ``jax.Array`` split along its first axis over the mesh axis
      ``batch_axis``; each process reads only its devices' rows, and the
      batch equals the batch of the same seed without a mesh. See
      :doc:`/distributed`.
    batch_axis: The mesh axis each batch is split along.
    chain_axis: A second mesh axis that chains are split along: then
      ``init_fn(seed=[...])`` makes one state of a chain per seed.

  Returns:
    ``(init_fn, batch_fn, release_fn)``. ``init_fn(**kwargs)`` registers a
    chain (keywords go to the loader, e.g. ``seed``, ``shuffle``,
    ``in_epochs``, ``stream``) and returns its :class:`CacheState`; with a
    sequence of seeds (``seed=range(C)``), a chain per seed, their states
    stacked for ``jax.vmap``, by default of counter-based streams;
    ``batch_fn(state, information=False, device_count=1)`` returns
    ``(state, batch)`` or ``(state, (batch, MiniBatchInformation))``;
    ``release_fn()`` drops the pipeline's references to the loader.

  Raises:
    TypeError, ValueError: bad arguments, named with their values.
  """
  config = pl.Config.checked(data_loader, cached_batches_count, mb_size,
                             callback)
  verify_calls = check_bool("verify_calls", verify_calls)
  if mesh is not None or batch_axis is not None or chain_axis is not None:
    if config.on_device:
      raise TypeError(
          "global batches (mesh, batch_axis) need a host loader, got "
          f"data_loader={config.loader!r}")
    if config.cache_size is None:
      raise ValueError(
          "global batches (mesh, batch_axis) lay their caches out when "
          "made, before the chains are known: give cached_batches_count a "
          "number, got cached_batches_count='auto'")
    axes = global_batches.MeshAxes.checked(mesh, batch_axis, chain_axis,
                                           config.mb_size)
    pipeline: pl.Pipeline = global_batches.GlobalPipeline(RandomPipeline(
        config.loader, config.cache_size, config.mb_size // axes.parts,
        verify_calls, config.callback), axes, config.mb_size)
  elif config.on_device:
    pipeline = device_loader.RandomPipeline(config.loader, config.mb_size)
  else:
    pipeline = RandomPipeline(config.loader, config.cache_size,
                              config.mb_size, verify_calls, config.callback)
  # Typed as the tuple it unpacks as (its functions' protocols).
  return cast(RandomBatch, pipeline)


class RandomPipeline(pl.RandomPipeline):
  """Random batches of a host loader; see :func:`random_reference_data`.

  With ``cache_size`` None (``cached_batches_count="auto"``) its sizes, and
  so its host side, its id and its template, are laid out when its first
  chains are made (:meth:`init_fn`) or restored (:meth:`prepare_restore`).
  """

  kind = "random"

  def __init__(self, loader: HostDataLoader, cache_size: Optional[int],
               mb_size: int, verify_calls: bool, callback: Callback):
    self._count = loader.observation_count
    self._mb_size = mb_size
    self._callback = callback
    # By name: bound methods kept here would make a cycle that keeps a
    # released, dropped pipeline (and its device cache) until a collection.
    self.function_names = ("init_fn", "batch_fn", "release_fn")
    #: The loader and ``verify_calls`` until the pipeline is laid out.
    self._unlaid: Optional[Tuple[HostDataLoader, bool]] = (loader,
                                                           verify_calls)
    #: For "auto": the chain count the caches were sized for, whether a
    #: later init_fn was told that it makes more (:meth:`_check_more`),
    #: and the states init_fn returned (a weak reference to each one's
    #: mask, its chains, whether they refresh apart) until then.
    self._sized_for: Optional[int] = None
    self._told = cache_size is not None
    self._held: List[Tuple[Any, int, bool]] = []
    self._pruned = 8  # the notes' count after the last pruning, or 8
    # Held while "auto" lays the pipeline out: two threads' first init_fn
    # calls (or a restore beside one) would each build a host of their own,
    # and one's states would belong to no pipeline.
    self._laying = threading.RLock()
    if cache_size is not None:
      self._lay_out(cache_size)

  def _lay_out(self, cache_size: int) -> None:
    """Builds the host side, the template and the id for caches of
    ``cache_size`` batches."""
    assert self._unlaid is not None
    loader, verify_calls = self._unlaid
    host = pl.assemble(loader, cache_size, self._mb_size,
                       verify_calls=verify_calls)
    self._cache_size = cache_size
    self._batch_format, _ = loader.batch_format(cache_size, self._mb_size)
    template = CacheState.start(host.id, 0, self._mb_size, cache_size,
                                self._batch_format)
    super().__init__(host, template, loader, cache_size, self._mb_size,
                     self._count)
    self._owner = np.int32(self.id)
    self._unlaid = None

  def _lay_out_for(self, chain_count: int, together: bool = True) -> None:
    """Lays an ``"auto"`` pipeline out for ``chain_count`` chains, which
    refresh ``together`` or not
    (:func:`~jax_data.compiled.pipeline.auto_cache_size` on the default
    device's platform); one laid out already stays as it is."""
    if self._unlaid is None:
      return
    with self._laying:
      if self._unlaid is not None:  # not laid out by another thread since
        self._lay_out(pl.auto_cache_size(self._unlaid[0], self._mb_size,
                                         chain_count, jax.default_backend(),
                                         together))
        self._sized_for = chain_count

  def _check_more(self, chain_count: int, together: bool) -> None:
    """Warns, once, when the chains of an ``"auto"`` pipeline's
    ``init_fn`` call, or those of the states its calls returned that are
    still held (kept to stack for ``vmap``) with them, are so many more
    than its caches were sized for that ``"auto"`` would choose at most
    half their batches for them: their caches then hold twice its budget
    or more. The state of the last call is left out of those held: a
    variable bound again to a new state still holds it during the call."""
    if self._told:
      return
    platform = jax.default_backend()
    loader = self.host.loader
    origin = (f"for the {self._sized_for} chain(s) of its first init_fn "
              "call" if self._sized_for is not None else
              "from the checkpoint restored into it")
    wanted = pl.auto_cache_size(loader, self._mb_size, chain_count,
                                platform, together)
    if 2 * wanted <= self._cache_size:
      told = (f"this init_fn call makes {chain_count} chains, for which it "
              f"chooses {wanted}. To size the caches for them, make them "
              "with the first init_fn call of a new pipeline, or give "
              "cached_batches_count a number")
    else:
      # Dead references are pruned only where the chains noted (an upper
      # bound of those held) would warn, or the list has doubled: a
      # thousand init_fn calls do not each look at every state. Chains
      # that refresh apart only raise the size chosen, so the bound
      # leaves them out: a dead note's must not silence the warning.
      most = chain_count + sum(lanes for _, lanes, _ in self._held[:-1])
      wanted = pl.auto_cache_size(loader, self._mb_size, most, platform,
                                  together)
      if 2 * wanted > self._cache_size:
        if len(self._held) > 2 * self._pruned:
          self._prune()
        return
      self._prune()
      earlier = self._held[:-1]
      together = together and not any(apart for _, _, apart in earlier)
      total = chain_count + sum(lanes for _, lanes, _ in earlier)
      wanted = pl.auto_cache_size(loader, self._mb_size, total, platform,
                                  together)
      if 2 * wanted > self._cache_size:
        return
      told = (f"with this init_fn call's, the chains of the states its "
              f"calls returned and still held number {total}, for which it "
              f"chooses {wanted}. To size the caches for many chains, make "
              "them with one init_fn(seed=range(C)) call, the first of a "
              "new pipeline, or give cached_batches_count a number")
    self._told = True
    self._held = []
    warnings.warn(
        f"cached_batches_count='auto' sized this pipeline's caches at "
        f"{self._cache_size} batches {origin}; {told}", UserWarning,
        stacklevel=3)

  def _prune(self) -> None:
    """Drops the notes of states no longer held (the last call's stays
    last)."""
    *earlier, last = self._held or [None]
    self._held = [note for note in earlier if _still_held(note[0])]
    if last is not None:
      self._held.append(last)
    self._pruned = max(len(self._held), 8)

  def _hold(self, state: CacheState, lanes: int, together: bool) -> None:
    """Notes the chains of a state ``init_fn`` returned, while it is held
    (see :meth:`_check_more`); not those of a state made while tracing."""
    mask = state.mask
    if (not self._told and isinstance(mask, jax.Array)
        and not isinstance(mask, jax.core.Tracer)):
      self._held.append((weakref.ref(mask), lanes, not together))

  def prepare_restore(self, fingerprint: Any, lanes: Any) -> None:
    """An ``"auto"`` pipeline not laid out yet takes the checkpoint's cache
    size, where it is one this pipeline can hold, so that the state is
    restored exactly; else the size for its lanes (and the fingerprint's
    check then says what differs)."""
    if self._unlaid is None:
      return
    with self._laying:
      if self._unlaid is None:  # laid out by another thread since
        return
      size = fingerprint.get("cache_size") if isinstance(fingerprint,
                                                         dict) else None
      if (isinstance(size, int) and not isinstance(size, bool)
          and 1 <= size <= MAX_AXIS and size * self._mb_size * pl.row_bytes(
              self._unlaid[0]) <= pl.MAX_CACHE_BYTES):
        self._lay_out(size)  # _sized_for stays None: the checkpoint's
      else:
        valid = isinstance(lanes, list) and all(
            isinstance(n, int) and n >= 0 for n in lanes)
        self._lay_out_for(math.prod(lanes) if valid else 1)

  def fit_hint(self, fingerprint: Any) -> str:
    """Where ``"auto"`` chose another cache size at this pipeline's first
    ``init_fn`` call than the checkpoint's: how to restore it."""
    saved = fingerprint.get("cache_size") if isinstance(fingerprint,
                                                        dict) else None
    if self._sized_for is None or saved == self._cache_size:
      return ""
    return (f"; cached_batches_count='auto' chose {self._cache_size} "
            f"batches for the {self._sized_for} chain(s) of this pipeline's "
            "first init_fn call: restore into a new pipeline before any "
            f"init_fn call (it takes the checkpoint's size), or give "
            f"cached_batches_count={saved!r}")

  @contextlib.contextmanager
  def restoring(self) -> Iterator[None]:
    """An ``"auto"`` pipeline that was not laid out yet is not laid out
    again if the restore fails: :meth:`prepare_restore` took the
    checkpoint's size, and a refused checkpoint must not choose the size
    of the chains ``init_fn`` makes next."""
    # Held throughout: another thread's init_fn must neither lay the
    # pipeline out meanwhile nor have its layout undone.
    with self._laying:
      unlaid = dict(self.__dict__) if self._unlaid is not None else None
      try:
        yield
      except BaseException:
        if unlaid is not None and self._unlaid is None:
          host = self.host
          self.__dict__.clear()
          self.__dict__.update(unlaid)
          host.release()
        raise

  @functools.cached_property
  def _bridge(self) -> Bridge:
    """The bridge to the host, found when first traced."""
    return pl.bridge(self._batch_format, self._callback)

  @functools.cached_property
  def _step(self) -> Callable[..., Any]:
    """The jitted step, shared by the pipelines of the same formats and
    sizes: a new pipeline compiles nothing its like compiled before."""
    return _shared_step(self._bridge, self._cache_size)

  def init_fn(self, **kwargs: Any) -> CacheState:
    """Registers a random chain; keywords go to the loader (``seed``,
    ``shuffle``, ``in_epochs``, ``shard_index``, ``shard_count``).

    A sequence of seeds (``seed=range(C)``) registers a chain per seed and
    returns their states stacked for ``jax.vmap``, the same as stacking
    ``init_fn(seed=s, stream=...)`` of each with the same ``stream``, made
    with one cache buffer for all chains (stacking C states holds C caches
    and then their stack). Their default stream is counter-based wherever
    the loader draws such streams
    (:func:`~jax_data.loaders.host_loader.chain_specs`)."""
    seeds = seed_list(kwargs.get("seed"))
    loader = (self.host.loader if self._unlaid is None
              else self._unlaid[0])
    if seeds is None:
      spec = loader.chain_spec(False, **kwargs)
      together = getattr(spec, "stream", None) == "counter"
      self._lay_out_for(1, together)
      self._check_more(1, together)
      with self._registering() as chains:
        chains.append(self.host.register(spec))
        state = CacheState.start(self.id, chains[0], self._mb_size,
                                 self._cache_size, self._batch_format)
      self._hold(state, 1, together)
      return state
    # Every seed checked before any chain is registered (or the sizes of
    # "auto" are chosen).
    specs = chain_specs(loader, seeds, **kwargs)
    # Chains of counter-based streams refresh together, with no Python per
    # chain; others pay a fixed part per chain and refresh.
    together = all(getattr(spec, "stream", None) == "counter"
                   for spec in specs)
    self._lay_out_for(len(specs), together)
    self._check_more(len(specs), together)
    with self._registering() as chains:
      chains.extend(self.host.register(spec) for spec in specs)
      state = CacheState.start_chains(self.id, chains, self._mb_size,
                                      self._cache_size, self._batch_format)
    self._hold(state, len(specs), together)
    return state

  @contextlib.contextmanager
  def _registering(self) -> Iterator[List[int]]:
    """The list ``init_fn`` adds the numbers of the chains it registers
    to: if anything ends the call before their state is made (a Ctrl-C
    among 1,024 seeds, a cache too large to allocate), they are taken out
    again, so that no chain without a state stays in the pipeline."""
    chains: List[int] = []
    try:
      yield chains
    except BaseException:
      for chain in chains:
        self.host.remove_chain(chain)
      raise

  def batch_fn(self, state: CacheState, information: bool = False,
               device_count: int = 1):
    """The next batch of the state's chain, and the advanced state."""
    state = self.check_state(state, "batch_fn")
    call = pl.Call.checked(information, device_count)
    information, device_count = call.information, call.device_count
    new_state, batch, batch_mask = self._step(self._owner, state,
                                              device_count)
    if information:
      # Built outside the jitted step: its counts stay Python ints.
      return new_state, (batch, MiniBatchInformation(
          observation_count=self._count, mask=batch_mask,
          batch_size=self._mb_size))
    return new_state, batch

  def check_state(self, state: Any, where: str) -> CacheState:
    """``state``, checked before anything is traced, its chain too where
    it is known (:func:`jax_data.compiled.states.check_chains`)."""
    if self._unlaid is not None:
      if not isinstance(state, CacheState):
        states.check_state(state, None, where)  # raises: no state at all
      raise TypeError(
          f"state does not belong to this pipeline: {where} got a state, "
          "and this pipeline (cached_batches_count='auto') has made no "
          "chain yet; make its states with its init_fn")
    state = super().check_state(state, where)
    states.check_chains(state.chain, self.host, where)
    return state

  def advance(self, state: CacheState, device_count: int = 1):
    """``batch_fn``'s step for a checked state: ``(state, batch, mask)``;
    what pipelines built over this one call (global batches)."""
    return self._step(self._owner, state, device_count)

  def scan_batches(self, f, init, state: CacheState, xs, length: int,
                   information: bool, device_count: int):
    """The loop of :func:`jax_data.scan` over this pipeline's chunks: each
    chunk's batches scanned over as elements (:func:`jax_data.scan.
    chunked_scan`)."""
    return scan_lib.chunked_scan(
        f, init, state, xs, length, information, device_count,
        fetch=functools.partial(self.fetch_over, device_count=device_count),
        refresh=functools.partial(self.refresh, device_count=device_count),
        observation_count=self._count, mb_size=self._mb_size,
        plain=lambda: super(RandomPipeline, self).scan_batches(
            f, init, state, xs, length, information, device_count),
        fetch_steps=(self.fetch_steps if device_count == 1
                     and self._by_step() else None))

  def _by_step(self) -> bool:
    """Whether :func:`jax_data.scan` unrolls each chunk's steps over a
    buffer per step (:meth:`fetch_steps`): on a CPU, for caches of 2 to
    :data:`STEPS_UNROLLED` batches (one batch is read where it is written
    already), where the chains made so far read at
    least :data:`STEP_BYTES` a step together (below that XLA's copy of the
    step's batch out of the chunk stays in a core's cache)."""
    bridge = self._bridge
    cache_size = bridge.mask_format.shape[0]
    step_bytes = sum(math.prod(s.shape[1:]) * s.dtype.itemsize
                     for s in bridge.leaf_formats)
    return (bridge.in_place and 2 <= cache_size <= STEPS_UNROLLED
            and jax.default_backend() == "cpu" and not in_per_device_code()
            and len(self.host.chains()) * step_bytes >= STEP_BYTES)

  def fetch_steps(self, state: CacheState, chunk: jax.Array,
                  need: jax.Array):
    """Chunk ``chunk`` of the state's chain where ``need``, each batch in
    buffers of its own: ``[(batch, mask)]`` (for
    :func:`jax_data.compiled.scan.chunked_scan`)."""
    return self._bridge.fetch_steps(self._owner, state.pipeline,
                                    state.chain, chunk, need)

  def fetch(self, state: CacheState, chunk: jax.Array,
            device_count: int = 1):
    """Chunk ``chunk`` of the state's chain, inside compiled code:
    ``(batches, mask)`` (for :func:`jax_data.compiled.scan.chunked_scan`)."""
    return self._bridge.fetch(self._owner, state.pipeline, state.chain,
                              chunk, device_count)

  def fetch_over(self, state: CacheState, chunk: jax.Array,
                 need: jax.Array, device_count: int = 1):
    """:meth:`fetch` where ``need``, written into the buffers of the
    state's cache, whose contents are spent, where the CPU allows:
    ``(batches, mask, state)``, the state's cache those buffers (for
    :func:`jax_data.compiled.scan.chunked_scan`, which marks it empty)."""
    batches, mask, spent, spent_mask = self._bridge.fetch_over(
        self._owner, state.pipeline, state.chain, chunk, need, state.batches,
        state.mask, device_count)
    return batches, mask, state._replace(batches=spent, mask=spent_mask)

  def refresh(self, state: CacheState, device_count: int = 1) -> CacheState:
    """``state`` with the chunk it points at in its cache."""
    return _refresh(self._bridge, self._owner, state, device_count)

  def saved_lanes(self, state: Any, where: str = "state_to_pytree"):
    """See :meth:`Pipeline.saved_lanes`; an ``"auto"`` pipeline that made
    no chain yet has no states to save."""
    if self._unlaid is not None:
      raise TypeError(
          "state does not belong to this pipeline: this pipeline "
          "(cached_batches_count='auto') has made no chain yet")
    return super().saved_lanes(state, where)

  def check_open(self) -> None:
    """See :meth:`Pipeline.check_open`."""
    if self._unlaid is None:
      super().check_open()

  def release_fn(self) -> None:
    """Drops every reference the pipeline holds to the loader."""
    self._lay_out_for(1)  # and so, released, refuses chains as others do
    self.host.release()


def _still_held(ref: Any) -> bool:
  """Whether the array of weak reference ``ref`` is still held, not
  donated."""
  array = ref()
  return array is not None and not array.is_deleted()


def _refresh(bridge: Bridge, owner: Any, state: CacheState,
             device_count: int) -> CacheState:
  """``state`` with the chunk it points at in its cache."""
  cached, batches, mask = bridge.refresh(
      owner, state.pipeline, state.chain, state.chunk, state.cached_chunk,
      state.batches, state.mask, device_count)
  return state._replace(cached_chunk=cached, batches=batches, mask=mask)


def _advance(bridge: Bridge, cache_size: int, owner: jax.Array,
             state: CacheState, device_count: int):
  """One ``batch_fn`` step, served by pipeline ``owner``: the next state,
  the batch and its mask."""
  state = _refresh(bridge, owner, state, device_count)
  batch, batch_mask = states.batch_at(state.batches, state.mask,
                                      state.position)
  return states.advanced(state, 1, cache_size), batch, batch_mask


def _shared_step(bridge: Bridge, cache_size: int) -> Callable[..., Any]:
  """The jitted step of the pipelines of ``bridge``'s formats and
  ``cache_size``: one function, so one compilation, for all of them; the
  pipeline that asks is an operand. Bridges and steps hold only formats
  (``bridge.shared``), one per format in a process (``lifetime.STEPS``)."""
  return STEPS.get((bridge, cache_size), lambda: jax.jit(
      functools.partial(_advance, bridge, cache_size), static_argnums=2))
