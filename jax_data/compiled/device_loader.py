"""Everything about data kept on the device: :class:`DeviceNumpyDataLoader`
and the pipelines of device-resident loaders.

A :class:`~jax_data.DeviceDataLoader` keeps the whole dataset on the device,
so its pipelines make no host calls: random batches are drawn with
``jax.random`` inside compiled code, and full-data passes slice the arrays.
"""

from __future__ import annotations

import functools
import threading
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap

from jax_data.compiled import bridge
from jax_data.compiled import pass_loop
from jax_data.compiled import pipeline as pl
from jax_data.errors import PipelineReleasedError
from jax_data.loaders.gather import DIGEST_VERSION
from jax_data.loaders.gather import digest_rows
from jax_data.loaders.gather import sample_rows
from jax_data.loaders.loader import DataLoader
from jax_data.loaders.loader import DeviceDataLoader
from jax_data.loaders.narrowing import narrows
from jax_data.loaders.numpy_loader import ArrayData
from jax_data.loaders.numpy_loader import check_narrowed
from jax_data.loaders.numpy_loader import observation_format_of
from jax_data.loaders.numpy_loader import prepare_arrays
from jax_data.streams import device_streams
from jax_data.streams.sampling import ObservationRange
from jax_data.streams.sampling import ordered_batches
from jax_data.types import CacheState
from jax_data.types import MiniBatchInformation
from jax_data.types import PyTree
from jax_data.validation import MAX_AXIS
from jax_data.validation import check_bool
from jax_data.validation import check_int
from jax_data.validation import check_keywords
from jax_data.validation import seed_list


class DeviceNumpyDataLoader(ArrayData, DeviceDataLoader):
  """The same arrays as :class:`NumpyDataLoader`, kept on the device.

  Random batches are independent draws with ``jax.random`` (keyword ``key``
  of ``init_fn``), or with ``init_fn(seed=..., shuffle=..., in_epochs=...,
  stream="counter")`` the counter-based streams that the host loaders draw
  for the same keywords (:doc:`counter_streams`), computed on the device;
  no host calls are made.

  Args:
    copy: Copy the arrays before moving them to the device.
    **reference_data: The arrays, one per keyword.
  """

  def __init__(self, copy: bool = True, **reference_data: Any):
    # Counter-based chains made (seeded or not): the next one's default
    # seed, as a host loader's chains default to their number.
    self._made = 0
    self._made_lock = threading.Lock()
    arrays, self._count = prepare_arrays(type(self).__name__, copy,
                                         reference_data)
    self._format = observation_format_of(arrays)
    for k, v in arrays.items():
      if (type(v) is not np.ndarray
          and narrows(v.dtype, self._format[k].dtype)):
        # A memmap or HDF5 dataset of copy=False (prepare_arrays checked
        # those in memory): NumpyDataLoader checks the rows it reads;
        # moved whole, all are checked before the cast.
        check_narrowed(k, v, self._format[k].dtype)
    # jnp.asarray of a memmap on a CPU device can alias the file's pages,
    # which would die with SIGBUS if the file shrank: copy it.
    self._arrays = {
        k: (jnp.array(v, dtype=self._format[k].dtype, copy=True)
            if isinstance(v, np.memmap)
            else jnp.asarray(v, dtype=self._format[k].dtype))
        for k, v in arrays.items()}
    self._digest: Optional[str] = None

  def content_digest(self) -> str:
    """A digest of the row count and a fixed sample of rows, as
    ``NumpyDataLoader.content_digest``: a checkpoint is refused by the
    pipelines of other data of the same size."""
    if self._digest is None:
      self._digest = self._digest_of(DIGEST_VERSION)
    return self._digest

  def earlier_digests(self) -> Tuple[str, ...]:
    """See ``HostDataLoader.earlier_digests``."""
    return (self._digest_of(1),)

  def _digest_of(self, version: int) -> str:
    rows = sample_rows(self._count, version)
    # The sample's rows copied to the host at once, one leaf each.
    taken = [np.asarray(jnp.take(a, jnp.asarray(rows), axis=0))
             for a in self._arrays.values()]
    where = {int(row): i for i, row in enumerate(rows)}
    return digest_rows(
        self._count, lambda row: [t[where[row]] for t in taken],
        [f.dtype for f in self._format.values()], version)

  def init_random_data(self, **kwargs: Any) -> jax.Array:
    """A chain's PRNG key data: keyword ``key`` (default ``key(0)``), a
    ``threefry2x32`` key (:data:`KEY_IMPL`) whatever
    ``jax_default_prng_impl`` is."""
    check_keywords("a random chain of DeviceNumpyDataLoader", kwargs,
                   ("key",))
    key = kwargs.get("key")
    if key is None:
      return jax.random.key_data(jax.random.key(0, impl=KEY_IMPL))
    return key_data(key)

  def made_chains(self, count: int) -> int:
    """Notes ``count`` counter-based chains made (every check passed);
    the number made before them."""
    with self._made_lock:
      before = self._made
      self._made += count
    return before

  def counter_chain(self, kwargs: Dict[str, Any]
                    ) -> Optional[Tuple[int, np.ndarray]]:
    """For ``init_fn`` keywords of a counter-based chain (``seed``, by
    default the number of such chains made before on this loader: see
    :meth:`made_chains`; ``shuffle``, ``in_epochs``, ``stream="counter"``),
    checked: its mode (an index
    into :data:`~jax_data.streams.device_streams.DEVICE_MODES`) and its seed's
    words (``uint32``, low and high); None for a ``jax.random`` chain
    (``key``, or no keyword)."""
    if not set(kwargs) & {"seed", "shuffle", "in_epochs", "stream"}:
      return None
    check_keywords("a counter-based chain of DeviceNumpyDataLoader", kwargs,
                   ("seed", "shuffle", "in_epochs", "stream"))
    if kwargs.get("stream") not in (None, "counter"):
      raise ValueError(
          "stream must be 'counter' on a DeviceNumpyDataLoader (its "
          "counter-based streams are the host loaders'; the exact ones are "
          f"drawn on the host only), got stream={kwargs['stream']!r}")
    if kwargs.get("stream") != "counter":
      given = ", ".join(f"{name}={value!r}"
                        for name, value in sorted(kwargs.items()))
      raise ValueError(
          "DeviceNumpyDataLoader draws counter-based streams "
          "(init_fn(seed=..., shuffle=..., stream='counter')) or jax.random "
          f"ones (init_fn(key=...)), got init_fn({given}); seed, shuffle "
          "and in_epochs need stream='counter'")
    seed = (self._made if kwargs.get("seed") is None else
            check_int("seed", kwargs["seed"], minimum=0, maximum=2**64 - 1))
    shuffle = check_bool("shuffle", kwargs.get("shuffle", False))
    in_epochs = check_bool("in_epochs", kwargs.get("in_epochs", False))
    if in_epochs and not shuffle:
      raise ValueError("in_epochs=True needs shuffle=True, got shuffle=False")
    mode = 2 if in_epochs else int(shuffle)
    return mode, np.asarray([seed & 0xFFFFFFFF, seed >> 32], np.uint32)

  def draw(self, state: CacheState, batch_size: int
           ) -> Tuple[CacheState, Tuple[PyTree, MiniBatchInformation]]:
    """The next batch of a chain of either kind (``state.chain``: -1 for
    ``jax.random``, ``-2 - mode`` for a counter-based stream, whose
    ``chunk`` counts its batches); under ``vmap``, see :func:`kind_draw`."""
    args = [lax.stop_gradient(a) for a in
            (-state.chain - 1, state.key, state.chunk)]
    key, chunk, indices, mask = kind_draw(self._count, batch_size)(*args)
    batch = jax.tree_util.tree_map(lambda a: jnp.take(a, indices, axis=0),
                                   self._arrays)
    info = MiniBatchInformation(observation_count=self._count, mask=mask,
                                batch_size=batch_size)
    return state._replace(key=key, chunk=chunk), (batch, info)

  def get_random_data(self, state: jax.Array, batch_size: int):
    # The batch's shape: a concrete int, as for init_fn's mb_size.
    batch_size = check_int("batch_size", batch_size, minimum=1,
                           maximum=MAX_AXIS)
    try:
      typed = is_typed(state)
    except TypeError:
      typed = None
    if typed is None or (not typed and (not isinstance(
        state, (jax.Array, np.ndarray)) or np.shape(state) not in ((2,), (4,))
        or not jnp.issubdtype(state.dtype, jnp.unsignedinteger))):
      raise TypeError(
          "state must be a PRNG key (a chain's key data, as init_random_data "
          f"returns it, or a typed key), got state={state!r:.200}")
    if typed or np.shape(state) != (2,):
      # A key as the caller's JAX makes them: typed, or the raw data of
      # another default impl (rbg's has 4 words).
      key, split = jax.random.split(state)
    else:
      key, split = jax.random.split(
          jax.random.wrap_key_data(state, impl=KEY_IMPL))
      key = jax.random.key_data(key)
    indices = jax.random.randint(split, (batch_size,), 0, self._count)
    batch = jax.tree_util.tree_map(lambda a: jnp.take(a, indices, axis=0),
                                   self._arrays)
    info = MiniBatchInformation(observation_count=self._count,
                                mask=jnp.ones(batch_size, jnp.bool_),
                                batch_size=batch_size)
    return key, (batch, info)

  def get_full_data(self) -> Dict[str, jax.Array]:
    return self._arrays


# The PRNG of jax.random chains: their states hold its key data (two
# words), whatever jax_default_prng_impl is (rbg's keys have four).
KEY_IMPL = "threefry2x32"


def is_typed(key: Any) -> bool:
  """Whether ``key`` is a typed key (``jax.random.key``), not key data."""
  return jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key)


def key_data(key: Any) -> jax.Array:
  """The data of a :data:`KEY_IMPL` key, typed or raw (``PRNGKey``).

  Raises:
    TypeError: not a key, or a key of another impl, named.
  """
  how = (f"jax.random.key(seed, impl={KEY_IMPL!r}), or "
         f"jax.random.PRNGKey(seed) where jax_default_prng_impl is "
         f"{KEY_IMPL!r}")
  try:
    typed = is_typed(key)
  except TypeError:
    raise TypeError(f"key must be a PRNG key ({how}), got key={key!r:.200}"
                    ) from None
  if typed:
    impl = jax.random.key_impl(key)
    name = str(impl)
    if name != KEY_IMPL or np.shape(key) != ():
      raise TypeError(
          f"key must be one {KEY_IMPL} key ({how}); DeviceNumpyDataLoader's "
          f"jax.random chains draw with {KEY_IMPL}; got a key of impl "
          f"{name} and shape {np.shape(key)}")
    return jax.random.key_data(key)
  data = jnp.asarray(key)
  if data.shape != (2,) or data.dtype != jnp.uint32:
    default = jax.config.jax_default_prng_impl
    raise TypeError(
        f"key must be a {KEY_IMPL} key ({how}), got key data with shape "
        f"{data.shape} and dtype {data.dtype}"
        + ("" if default == KEY_IMPL else
           f" (jax_default_prng_impl is {default!r}: PRNGKey makes its "
           "keys)"))
  return data


def _kinds(count: int, batch_size: int) -> List[Callable[..., Any]]:
  """A chain's draw of ``[key, chunk, indices, mask]`` from its ``kind``,
  ``key`` and ``chunk``, per kind (``-1 - state.chain``): ``jax.random``,
  then the counter-based modes of :data:`~jax_data.streams.device_streams.
  DEVICE_MODES`. Inside ``shard_map`` every output varies over the devices
  that any input varies over, so that the kinds' outputs agree as a
  switch's branches must."""

  def by_key(key, chunk):
    key, split = jax.random.split(jax.random.wrap_key_data(key,
                                                           impl=KEY_IMPL))
    indices = jax.random.randint(split, (batch_size,), 0, count)
    return (jax.random.key_data(key), chunk, indices.astype(jnp.uint32),
            jnp.ones(batch_size, jnp.bool_))

  def counter(mode):
    def branch(key, chunk):
      indices, mask = device_streams.device_batch(key, chunk, batch_size,
                                                  count, mode)
      return key, chunk + 1, indices, mask
    return branch

  def agreeing(draw):
    def kind_of_draw(kind, key, chunk):
      axes = pass_loop.varying_axes((kind, key, chunk))
      return [pass_loop.cast_varying(out, axes) for out in draw(key, chunk)]
    return kind_of_draw

  # Sizes beyond the counter streams' words have jax.random chains only
  # (init_fn refuses counter-based ones there).
  modes = (range(len(device_streams.DEVICE_MODES))
           if device_streams.sizes_fit(batch_size, count) else ())
  return [agreeing(draw) for draw in
          [by_key] + [counter(mode) for mode in modes]]


@functools.lru_cache(maxsize=64)
def kind_draw(count: int, batch_size: int) -> Callable[..., List[Any]]:
  """``draw(kind, key, chunk) -> [key, chunk, indices, mask]`` for chains
  of ``count`` observations and batches of ``batch_size``.

  A chain switches on its kind. Under ``vmap`` the kind is batched, and a
  switch on a batched index computes every kind for every lane and then
  selects: 16 vmapped chains of independent counter streams took 137-249
  µs a step instead of 20-27 on a 2-core CPU, mostly in the shuffled
  kinds' Feistel network. So a vmapped draw (nested vmaps folded into one lane
  axis, as the bridge's fetches are) runs the one kind that all its lanes
  share; only lanes of several kinds select among every kind.
  """
  kinds = _kinds(count, batch_size)

  def each_lane(kind, key, chunk):
    return lax.switch(kind, kinds, kind, key, chunk)

  def lanes(kind, key, chunk):
    if not kind.shape[0]:  # no lanes: any kind gives the empty outputs
      return list(jax.vmap(kinds[0])(kind, key, chunk))
    shared = jnp.all(kind == kind[0])
    return list(lax.switch(jnp.where(shared, kind[0], len(kinds)),
                           [jax.vmap(draw) for draw in kinds + [each_lane]],
                           kind, key, chunk))

  many = bridge.fold_lanes(lanes)

  @custom_vmap
  def draw(kind, key, chunk):
    return list(each_lane(kind, key, chunk))

  @draw.def_vmap
  def _rule(axis_size, in_batched, *args):
    outs = many(*bridge.broadcast(axis_size, in_batched, args))
    return outs, [True] * len(outs)

  return draw


def _check_kinds(chain: Any, where: str) -> None:
  """Raises if a known ``chain`` field of a device loader's state (of
  stacked states too) is not a kind of stream, -1 (``init_random_data``'s
  key) to -4 (a counter-based stream's modes: ``device_streams``'
  ``RANDOM_KIND`` to ``LOWEST_KIND``); traced fields pass."""
  try:
    kinds = np.asarray(chain)
  except jax.errors.TracerArrayConversionError:
    return
  if not device_streams.are_kinds(kinds):
    raise ValueError(
        f"{where} got a state with chain={kinds.tolist()}, where a device "
        "loader's state names its kind of stream, "
        f"{device_streams.RANDOM_KIND} to {device_streams.LOWEST_KIND}: use "
        "the states of this pipeline's init_fn, batch_fn or "
        "restore_checkpoint")


class LoaderRef:
  """Holds a device loader until the pipeline is released."""

  def __init__(self, loader: DataLoader):
    self._loader: Optional[DataLoader] = loader
    # Named in the error once the loader is dropped, as a host's is.
    self._name = repr(loader)

  @property
  def loader(self) -> DataLoader:
    if self._loader is None:
      raise PipelineReleasedError(
          f"this pipeline over {self._name} was released by its "
          "release_fn; create a new pipeline to draw more data")
    return self._loader

  def check_open(self) -> None:
    """Raises :class:`PipelineReleasedError` if the pipeline was released."""
    _ = self.loader

  def release(self) -> None:
    self._loader = None


class RandomPipeline(pl.RandomPipeline):
  """Random batches of a device loader: no host calls."""

  def __init__(self, loader: DeviceDataLoader, mb_size: int):
    self._ref = LoaderRef(loader)
    self._mb_size = mb_size
    count = loader.observation_count
    super().__init__(None, CacheState.start(pl.new_id(), -1, mb_size),
                     loader, 0, mb_size, count)
    # By name: bound methods kept here would make a cycle that keeps a
    # released, dropped pipeline (and its device cache) until a collection.
    self.function_names = ("init_fn", "batch_fn", "release_fn")

  def init_fn(self, **kwargs: Any) -> CacheState:
    """A chain's state; keywords go to ``init_random_data`` (``key``), or
    make a counter-based chain of a ``DeviceNumpyDataLoader``. A sequence
    of seeds gives the chains' states stacked for ``jax.vmap``, as for
    host loaders, and as there their stream is counter-based unless
    ``stream`` says otherwise: ``init_fn(seed=range(C))`` draws the
    batches a host loader's gives."""
    seeds = seed_list(kwargs.get("seed"))
    loader = self._ref.loader
    if seeds is not None and isinstance(loader, DeviceNumpyDataLoader):
      stream = kwargs.get("stream", "auto")
      if isinstance(stream, str) and stream == "auto":
        kwargs = {**kwargs, "stream": "counter"}
      # Every seed checked before any state is made, then one state for
      # all (1,024 states made one by one and stacked took 1.2 s).
      for seed in seeds:
        loader.counter_chain({**kwargs, "seed": 0 if seed is None else seed})
      device_streams.check_sizes(self._mb_size, loader.observation_count)
      # Unseeded lanes take their numbers, as a host loader's chains do:
      # each counter_chain read the same count, and all took seed 0.
      first = loader.made_chains(len(seeds))
      chains = [loader.counter_chain(
          {**kwargs, "seed": first + lane if seed is None else seed})
                for lane, seed in enumerate(seeds)]
      states = CacheState.start_chains(
          self.id, [device_streams.counter_kind(mode) for mode, _ in chains],
          self._mb_size, 0, None)
      return states._replace(key=jnp.asarray(
          np.stack([words for _, words in chains])))
    if seeds is not None:
      made = [self.init_fn(**{**kwargs, "seed": seed}) for seed in seeds]
      return jax.tree_util.tree_map(lambda *s: jnp.stack(s), *made)
    if isinstance(loader, DeviceNumpyDataLoader):
      counter = loader.counter_chain(kwargs)
      if counter is not None:
        device_streams.check_sizes(self._mb_size, loader.observation_count)
        if kwargs.get("seed") is None:  # its number, unless taken meanwhile
          counter = loader.counter_chain(
              {**kwargs, "seed": loader.made_chains(1)})
        else:
          loader.made_chains(1)
        mode, seed = counter
        return CacheState.start(self.id, device_streams.counter_kind(mode),
                                self._mb_size, key=jnp.asarray(seed))
    key = loader.init_random_data(**kwargs)
    return CacheState.start(self.id, device_streams.RANDOM_KIND,
                            self._mb_size, key=key)

  def restore_lanes(self, saved: List[Dict[str, Any]],
                    arrays: Dict[str, np.ndarray], lanes: Tuple[int, ...],
                    chain: np.ndarray) -> CacheState:
    """As :meth:`Pipeline.restore_lanes`; restored counter-based chains
    are counted as made, as a host loader registers each restored chain,
    so that the unseeded chains made after them take the host's numbers
    (they took the restored chains' numbers)."""
    state = super().restore_lanes(saved, arrays, lanes, chain)
    loader = self._ref.loader
    if isinstance(loader, DeviceNumpyDataLoader):
      loader.made_chains(int(
          (np.asarray(chain) < device_streams.RANDOM_KIND).sum()))
    return state

  def check_state(self, state: Any, where: str) -> CacheState:
    """As :meth:`Pipeline.check_state`, and a known ``chain`` field must
    name a kind of stream (-1 to -4): another value drew some kind's
    batches, and its checkpoint could not be restored."""
    state = super().check_state(state, where)
    _check_kinds(state.chain, where)
    return state

  def saved_lanes(self, state: Any, where: str = "state_to_pytree"):
    """See :meth:`Pipeline.saved_lanes`; ``chain`` a kind of stream."""
    lanes, arrays = super().saved_lanes(state, where)
    _check_kinds(arrays["chain"], where)
    return lanes, arrays

  def batch_fn(self, state: CacheState, information: bool = False,
               device_count: int = 1):
    """The next batch, drawn on the device, and the advanced state."""
    state = self.check_state(state, "batch_fn")
    information = pl.Call.checked(information, device_count).information
    loader = self._ref.loader
    if isinstance(loader, DeviceNumpyDataLoader):
      new_state, (batch, info) = loader.draw(state, self._mb_size)
    else:
      key, (batch, info) = loader.get_random_data(state.key, self._mb_size)
      new_state = state._replace(key=key)
    if information:
      return new_state, (batch, info)
    return new_state, batch

  def check_open(self) -> None:
    self._ref.check_open()

  def data_digest(self) -> Optional[str]:
    return _digest_of(self._ref.loader)

  def earlier_data_digests(self) -> Tuple[str, ...]:
    return pl.earlier_digests_of(self._ref.loader)

  def release_fn(self) -> None:
    """Drops the pipeline's reference to the loader."""
    self._ref.release()


class FullChunks:
  """The chunks of full-data passes over a device loader: slices of its
  arrays, in the ordered stream's order (``spec/SAMPLING.md``).

  Args:
    loader: The device loader.
    observations: The observations a pass visits.
    cache_size: Batches per chunk.
    mb_size: Observations per batch.
  """

  host = None
  #: Passes over device-resident data are compiled per pipeline (the data
  #: are part of the code), not shared with pipelines of the same sizes.
  share_key = None

  def __init__(self, loader: DeviceDataLoader, observations: ObservationRange,
               cache_size: int, mb_size: int):
    self._ref = LoaderRef(loader)
    self._observations = observations
    self._cache_size = cache_size
    self._mb_size = mb_size
    self.id = pl.new_id()
    self.owner = np.int32(self.id)
    self._counted = False  # see init

  def init(self, **kwargs: Any) -> CacheState:
    check_keywords("init_fn of a full-data pipeline", kwargs, ())
    loader = self._ref.loader
    if isinstance(loader, DeviceNumpyDataLoader) and not self._counted:
      # Counted once, as a host loader registers a full-data pipeline's
      # one ordered chain, so that the unseeded counter chains made after
      # it take the host's numbers.
      self._counted = True
      loader.made_chains(1)
    return CacheState.start(self.id, -1, self._mb_size)

  def fetch_fn(self, owner: Any, state: CacheState, chunk: jax.Array,
               device_count: int) -> Tuple[PyTree, jax.Array]:
    """Chunk ``chunk`` of a pass: (batches, mask), varying over the mesh
    axes (of an enclosing ``shard_map``) that ``state`` varies over, as a
    host loader's chunks of a per-device state do: the mapped function was
    traced with batches of that type."""
    del owner, device_count
    data = self._ref.loader.get_full_data()
    indices, mask = ordered_batches(chunk * self._cache_size,
                                    self._cache_size, self._mb_size,
                                    self._observations, xp=jnp)
    batches = jax.tree_util.tree_map(lambda a: jnp.take(a, indices, axis=0),
                                     data)
    axes = pass_loop.varying_axes(state)
    if not axes:
      return batches, mask
    return jax.tree_util.tree_map(
        lambda leaf: pass_loop.cast_varying(leaf, axes), (batches, mask))

  def check_open(self) -> None:
    self._ref.check_open()

  def data_digest(self) -> Optional[str]:
    """The loader's ``content_digest``, if it has one."""
    return _digest_of(self._ref.loader)

  def earlier_data_digests(self) -> Tuple[str, ...]:
    """The loader's ``earlier_digests``, if it has them."""
    return pl.earlier_digests_of(self._ref.loader)

  def release(self) -> None:
    self._ref.release()


def _digest_of(loader: DataLoader) -> Optional[str]:
  digest = getattr(loader, "content_digest", None)
  return None if digest is None else digest()

