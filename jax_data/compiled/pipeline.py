"""Pipeline assembly: one call builds a pipeline's host side, another
finds its bridge, and what every pipeline shares.

The in-jit access modules (``random_access``, ``full_access``) check their
arguments, call :func:`assemble` for a host loader, and return a
:class:`Pipeline`: an object whose functions (``init_fn``, ``batch_fn``,
...) unpack like a tuple. Checkpoints take a pipeline, or one of its
functions, and reach the host side through :attr:`Pipeline.host`.
"""

from __future__ import annotations

import abc
import collections.abc
import contextlib
import dataclasses
import json
import math
import secrets
import warnings
from typing import Any
from typing import Callable
from typing import ClassVar
from typing import ContextManager
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_data.compiled import bridge as bridge_lib
from jax_data.compiled import states
from jax_data.compiled.bridge import Bridge
from jax_data.lifetime import LIVE_HOSTS
from jax_data.loaders.chains import MAX_CACHE_BYTES
from jax_data.loaders.gather import usable_cache_bytes
from jax_data.loaders.host_loader import HostDataLoader
from jax_data.loaders.loader import DataLoader
from jax_data.loaders.loader import DeviceDataLoader
from jax_data.serving.host import Host
from jax_data.streams.sampling import ObservationRange
from jax_data.types import CALLBACKS
from jax_data.types import CacheState
from jax_data.types import Callback
from jax_data.types import PyTree
from jax_data.validation import check_bool
from jax_data.validation import check_choice
from jax_data.validation import check_int
from jax_data.validation import check_sizes as _check_sizes


class Pipeline(collections.abc.Sequence):
  """What a pipeline constructor returns: its functions, which unpack like
  a tuple (``init_fn, batch_fn, release_fn = pipeline``).

  Args:
    host: The host side; None for device-resident loaders.
    template: A state of the pipeline's shapes, positioned at the start.
    loader: The loader (only its type and size are kept).
    cache_size: Batches per chunk (0 for device-resident random batches).
    mb_size: Observations per batch.
    observation_count: Observations a pass visits.

  Attributes:
    kind: ``"random"``, ``"full"`` or ``"mapper"``.
    host: The host side; None for device-resident loaders.
    id: The pipeline's identity, carried by its states.
    template: A state of the pipeline's shapes, positioned at the start.
  """

  kind: ClassVar[str]
  #: The names of its functions, in order (a subclass sets them).
  function_names: Tuple[str, ...]
  #: Whether a state is one global state of a ``jax.distributed`` job,
  #: the same chains in every process (global batches), rather than each
  #: process's own chains.
  global_state: ClassVar[bool] = False
  #: Whether lanes restored with the same saved chain at the same chunk
  #: share one host chain, as the states of a full-data pipeline's
  #: ``init_fn`` do (see :meth:`restore_lanes`).
  shares_chains: bool = False

  def __init__(self, host: Optional[Host], template: CacheState,
               loader: DataLoader, cache_size: int, mb_size: int,
               observation_count: int):
    self.host = host
    self.template = template
    self.id = int(template.pipeline)
    self._shape = (type(loader).__name__, cache_size, mb_size,
                   observation_count)
    self._digest: Optional[str] = None

  @property
  def fingerprint(self) -> Dict[str, Any]:
    """What a checkpoint of this pipeline must match (see
    :func:`fingerprint`); the data's digest is computed on first use."""
    if self._digest is None:
      self._digest = self.data_digest()
    return fingerprint(self.kind, *self._shape, self._digest)

  def data_digest(self) -> Optional[str]:
    """The digest of the loader's data (``content_digest``), or None."""
    return None if self.host is None else self.host.loader.content_digest()

  def earlier_data_digests(self) -> Tuple[str, ...]:
    """The digests earlier versions of jax_data computed for the loader's
    data (``earlier_digests``), which their checkpoints carry."""
    return () if self.host is None else earlier_digests_of(self.host.loader)

  def saved_lanes(self, state: Any, where: str = "state_to_pytree"
                  ) -> Tuple[Tuple[int, ...], Dict[str, np.ndarray]]:
    """What a checkpoint saves of ``state``: its lane shape (``()``, or the
    vmap/pmap axes) and its fields ``chain`` (a host chain per lane, or a
    device chain's kind), ``chunk``, ``position`` and ``key`` as NumPy
    arrays with that leading shape (``where``: the function named in an
    error).

    Raises:
      TypeError, ValueError: not a state of this pipeline.
    """
    if not isinstance(state, CacheState):
      raise TypeError(f"state must be a CacheState, got {type(state).__name__}")
    states.check_concrete(state, where)
    lanes = np.shape(state.chain)
    if np.shape(state.key)[len(lanes):] != np.shape(self.template.key):
      raise TypeError("state does not belong to this pipeline")
    states.check_counter_fields(state, self.template, lanes, where)
    states.check_identity(state.pipeline, self.id, where)
    states.check_counters(state, np.shape(self.template.mask)[0], where)
    return lanes, {f: np.asarray(getattr(state, f))
                   for f in ("chain", "chunk", "position", "key")}

  def restore_lanes(self, saved: List[Dict[str, Any]],
                    arrays: Dict[str, np.ndarray], lanes: Tuple[int, ...],
                    chain: np.ndarray) -> CacheState:
    """A state of the checked saved lanes: each lane's chain (``saved``,
    from :meth:`Host.save_chain`) registered anew at its ``chunk``, or
    ``chain`` (device chains' kinds) without a host; no chain is left
    registered if one fails. Where the pipeline :attr:`shares_chains`,
    lanes of equal saved chains at the same chunk get one chain: 64
    stacked full-pass states restored read the data once a pass, not 64
    times."""
    if self.host is not None:
      chain, restored = chain.copy(), []
      made: Dict[Tuple[str, int], int] = {}
      for one in saved:
        self.check_saved_chain(one)
      try:
        for lane, one in zip(np.ndindex(*lanes), saved):
          chunk = int(arrays["chunk"][lane])
          key = (json.dumps(one, sort_keys=True, default=repr), chunk)
          if not self.shares_chains or key not in made:
            made[key] = self.host.restore_chain(one, chunk)
            restored.append(made[key])
          chain[lane] = made[key]
      except BaseException:
        for number in restored:
          self.host.remove_chain(number)
        raise
    # Every lane at once, from NumPy: no per-lane JAX operations (a stack
    # of 1,024 lanes would compile a 1,024-operand concatenation). One
    # lane gets copies: broadcast to its own shape, the template itself,
    # which a jitted call the state is donated to deleted.
    stacked = jax.tree_util.tree_map(
        lambda x: (jnp.broadcast_to(x, lanes + np.shape(x)) if lanes
                   else jnp.array(x, copy=True)), self.template)
    return stacked._replace(
        chain=jnp.asarray(chain, jnp.int32),
        chunk=jnp.asarray(arrays["chunk"], jnp.int32),
        position=jnp.asarray(arrays["position"], jnp.int32),
        cached_chunk=jnp.full(lanes, -1, jnp.int32),
        key=jnp.asarray(arrays["key"], jnp.uint32))

  def lanes_refused(self, count: int) -> str:
    """Why this pipeline cannot restore ``count`` chains as one state (a
    chain axis they do not fill), or "" where it can (the default)."""
    del count
    return ""

  def prepare_restore(self, fingerprint: Any, lanes: Any) -> None:
    """Called before a checkpoint of ``fingerprint`` (its saved
    :attr:`fingerprint`, unchecked) with ``lanes`` (its saved lane shape,
    unchecked) is checked and restored into this pipeline; a pipeline
    whose sizes are chosen when its first chains are made chooses them
    here. The default does nothing."""
    del fingerprint, lanes

  def fit_hint(self, fingerprint: Any) -> str:
    """What to do, where a checkpoint of ``fingerprint`` does not fit this
    pipeline because of a size it chose itself; the default: nothing."""
    del fingerprint
    return ""

  def restoring(self) -> ContextManager[None]:
    """The context in which a checkpoint is checked and restored into this
    pipeline: sizes that :meth:`prepare_restore` chose are undone if the
    restore fails. The default does nothing."""
    return contextlib.nullcontext()

  def check_saved_chain(self, saved: Any) -> None:
    """Raises :class:`~jax_data.CheckpointError` if ``saved`` (a lane's
    chain in a checkpoint, from :meth:`Host.save_chain`) is not one this
    pipeline makes, where the loader's own checks of a restored chain do
    not tell; the default checks nothing more."""
    del saved

  def check_open(self) -> None:
    """Raises :class:`~jax_data.PipelineReleasedError` once released."""
    if self.host is not None:
      self.host.check_open()

  @property
  def functions(self) -> Tuple[Callable[..., Any], ...]:
    """Its functions (``init_fn, batch_fn, release_fn`` or others), bound
    anew at each access."""
    return tuple(getattr(self, name) for name in self.function_names)

  def __getitem__(self, index):
    return self.functions[index]

  def __len__(self) -> int:
    return len(self.functions)

  def __repr__(self) -> str:
    names = ", ".join(f.__name__ for f in self.functions)
    return f"<{type(self).__name__} ({names})>"


class RandomPipeline(Pipeline):
  """A pipeline of random mini-batches, host or device-resident: what
  :func:`jax_data.scan` runs over. A subclass gives ``batch_fn`` and may
  give a faster loop than a ``lax.scan`` calling it (:meth:`scan_batches`).
  """

  kind = "random"

  @abc.abstractmethod
  def batch_fn(self, state: CacheState, information: bool = False,
               device_count: int = 1) -> Tuple[CacheState, Any]:
    """The next batch of the state's chain, and the advanced state."""

  def check_state(self, state: Any, where: str) -> CacheState:
    """``state``, checked before anything is traced
    (:func:`jax_data.compiled.states.check_state`).

    Raises:
      TypeError, ValueError: not a state of this pipeline, named.
    """
    return states.check_state(state, self.template, where)

  def scan_batches(self, f: Callable[..., Any], init: Any,
                   state: CacheState, xs: Any, length: int,
                   information: bool, device_count: int) -> Any:
    """The loop of :func:`jax_data.scan` over checked arguments: here a
    ``lax.scan`` whose body calls :meth:`batch_fn` (device-resident data
    has no cache to scan over)."""
    def body(carry, x):
      carry, state = carry
      state, batch = self.batch_fn(state, information, device_count)
      carry, y = f(carry, batch if xs is None else (batch, x))
      return (carry, state), y

    return lax.scan(body, (init, state), xs, length=length)


def of(handle: Any) -> Pipeline:
  """The pipeline of ``handle``: a pipeline, one of its functions, or a
  tuple of its functions (``(init_fn, batch_fn, release_fn)`` packed again).

  Raises:
    TypeError: ``handle`` is none of these.
  """
  found = getattr(handle, "__self__", handle)
  if isinstance(handle, tuple) and not isinstance(handle, Pipeline):
    owners = {getattr(f, "__self__", None) for f in handle}
    found = owners.pop() if len(owners) == 1 else None
  if not isinstance(found, Pipeline):
    raise TypeError(
        "pipeline must be what random_reference_data, full_reference_data "
        "or full_data_mapper returned (or one of its functions), got "
        f"pipeline={handle!r}")
  return found


def new_id() -> int:
  """A new pipeline identity: a random positive int32, so that states of
  pipelines of other processes (a pickled state) are refused too; none of
  this process's live pipelines has it."""
  while True:
    pipeline_id = secrets.randbelow(2**31 - 1) + 1
    if not LIVE_HOSTS.taken(pipeline_id):
      return pipeline_id


def assemble(loader: HostDataLoader, cache_size: int, mb_size: int, *,
             cycle: Optional[int] = None,
             progress: Optional[Callable[[int, int], None]] = None,
             verify_calls: bool = False) -> Host:
  """Builds the host side of a pipeline over ``loader`` (its chains and
  store are made on first use); compiled code reaches it through the
  bridge of its formats, found at the first trace (:func:`bridge`).

  Args:
    loader: The host loader.
    cache_size: Batches per chunk.
    mb_size: Observations per batch.
    cycle: Chunks per pass of a full-data pipeline's ordered chains.
    progress: Told ``(participants, chunk)`` for each request of a chunk
      of a pass (see :func:`~jax_data.compiled.pass_loop.progress_reporter`).
    verify_calls: Warn when a chunk is produced again (see ``Host``).
  """
  return Host(loader, loader.chunk_layout(cache_size, mb_size), new_id(),
              cycle=cycle, progress=progress, verify_calls=verify_calls)


def bridge(batch_format: PyTree, callback: Callback) -> Bridge:
  """The bridge that brings chunks of ``batch_format`` (leading axes
  ``(cache_size, mb_size)``) to compiled code the ``callback`` way, which
  pipelines of the same formats share (``bridge.shared``)."""
  return bridge_lib.shared(batch_format, callback)


def fingerprint(kind: str, loader: str, cache_size: int, mb_size: int,
                observation_count: int, digest: Optional[str]
                ) -> Dict[str, Any]:
  """What identifies a pipeline's batches, for checking checkpoints: its
  kind, the loader's type, the sizes, and a cheap digest of the loader's
  data (``HostDataLoader.content_digest``: a sample of rows and the row
  count), so that a checkpoint is not restored into other data of the same
  size."""
  return {"kind": kind, "loader": loader, "cache_size": cache_size,
          "mb_size": mb_size, "observation_count": observation_count,
          "data": digest}


@dataclasses.dataclass(frozen=True)
class Config:
  """A constructor's arguments, checked before anything is traced or
  allocated (:meth:`checked`): what :func:`jax_data.random_reference_data`,
  :func:`jax_data.full_reference_data` and the device loaders build from.

  Attributes:
    loader: The data loader.
    cache_size: Batches per chunk (``cached_batches_count``); None for
      ``"auto"``, chosen when the chains are known (:func:`auto_cache_size`).
    mb_size: Observations per batch.
    callback: How compiled code receives chunks.
    observation_count: The observations drawn from (a random chain) or
      passed over (a full-data pass, its shard); None if unknown.
    observations: The observations a full-data pass visits; None for random
      chains.
  """
  loader: DataLoader
  cache_size: Optional[int]
  mb_size: int
  callback: Callback
  observation_count: Optional[int]
  observations: Optional[ObservationRange] = None

  @property
  def on_device(self) -> bool:
    """Whether the data are on the device (a ``DeviceDataLoader``)."""
    return isinstance(self.loader, DeviceDataLoader)

  @classmethod
  def checked(cls, data_loader: Any, cached_batches_count: Any, mb_size: Any,
              callback: Any, *, full: bool = False, shard_index: Any = None,
              shard_count: Any = None, stacklevel: int = 4) -> "Config":
    """The checked configuration of a random (or, ``full``, full-data)
    pipeline over ``data_loader``. A random pipeline's
    ``cached_batches_count`` may be ``"auto"`` (``cache_size`` None).

    Raises:
      TypeError, ValueError: an argument is wrong, named with its value;
        a cache over :data:`MAX_CACHE_BYTES`; a full-data pass over data of
        unknown length.
    """
    loader = check_loader(data_loader)
    callback = check_choice("callback", callback, CALLBACKS)
    count, observations = loader.observation_count, None
    if full:
      if count is None:
        raise ValueError(
            "full-data passes visit every observation once, so they need "
            "the number of observations, which "
            f"data_loader={loader!r} does not know (a pipeline of unknown "
            "length); give it, e.g. "
            "TensorflowDataLoader(pipeline, observation_count=N)")
      observations = ObservationRange.from_arguments(count, shard_index,
                                                     shard_count)
      count = observations.count
      if (observations.shard_count > 1 and mb_size is not None
          and check_int("mb_size", mb_size, minimum=1) > count):
        raise ValueError(
            f"shard_count={observations.shard_count} leaves "
            f"shard_index={observations.shard_index} {count} "
            f"observation(s), fewer than mb_size={mb_size}: use fewer "
            "shards or smaller batches")
    if isinstance(cached_batches_count, str) and cached_batches_count == AUTO:
      if full:
        raise ValueError(
            "cached_batches_count='auto' chooses a random pipeline's cache "
            "by its number of chains; a full-data pass takes a number of "
            "batches, got cached_batches_count='auto'")
      _, mb_size = check_sizes(loader, 1, mb_size, count)
      config = cls(loader, None, mb_size, callback, count, observations)
      row = row_bytes(loader)
      if not config.on_device and mb_size * row > MAX_CACHE_BYTES:
        # A cache of one batch at least: only mb_size can make it fit.
        raise ValueError(
            f"cached_batches_count='auto': one batch of mb_size={mb_size} "
            f"observations of {row} bytes takes {_mib(mb_size * row)}, over"
            f" the limit of {_mib(MAX_CACHE_BYTES, mb_size * row)} per chain "
            "(jax_data.pipeline.MAX_CACHE_BYTES); use a smaller mb_size")
      return config
    if isinstance(cached_batches_count, str) and not full:
      raise TypeError(
          "cached_batches_count must be an integer or 'auto', got "
          f"cached_batches_count={cached_batches_count!r}")
    cache_size, mb_size = check_sizes(loader, cached_batches_count, mb_size,
                                      count)
    config = cls(loader, cache_size, mb_size, callback, count, observations)
    if full or not config.on_device:  # a device loader's chains cache none
      passed = math.ceil(count / mb_size) if full else cache_size
      check_cache_bytes(loader, min(cache_size, passed), mb_size)
    if not config.on_device:
      warn_large_cache(cache_size, mb_size, count, stacklevel)
    return config


@dataclasses.dataclass(frozen=True)
class Call:
  """The options of a ``batch_fn`` or ``map_fn`` call, checked
  (:meth:`checked`)."""
  information: bool = False
  device_count: int = 1
  masking: bool = False

  @classmethod
  def checked(cls, information: Any = False, device_count: Any = 1,
              masking: Any = False) -> "Call":
    return cls(check_bool("information", information),
               check_int("device_count", device_count, minimum=1),
               check_bool("masking", masking))


def check_loader(data_loader: Any) -> DataLoader:
  if not isinstance(data_loader, (HostDataLoader, DeviceDataLoader)):
    raise TypeError(
        "data_loader must be a HostDataLoader or DeviceDataLoader (for "
        "example NumpyDataLoader), got "
        f"data_loader={data_loader!r} of type {type(data_loader).__name__}")
  return data_loader


def check_sizes(data_loader: DataLoader, cache_size: Any, mb_size: Any,
                observation_count: Optional[int] = None) -> Tuple[int, int]:
  """Checks the cache and batch sizes of a pipeline against the data."""
  if observation_count is None:
    observation_count = data_loader.observation_count
  return _check_sizes(cache_size, mb_size, observation_count,
                      cache_name="cached_batches_count")


def earlier_digests_of(loader: DataLoader) -> Tuple[str, ...]:
  """``loader.earlier_digests()``, or none where a loader has no such
  method (a device loader, a user's loader of its own)."""
  earlier = getattr(loader, "earlier_digests", None)
  return () if earlier is None else tuple(earlier())


def row_bytes(data_loader: DataLoader) -> int:
  """The bytes a cache holds per observation: its leaves and its mask."""
  return 1 + sum(int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype)
                 .itemsize for s in
                 jax.tree_util.tree_leaves(data_loader.observation_format))


def _mib(size: int, over: Optional[int] = None) -> str:
  """``size`` bytes in MiB, or in bytes where a size over
  :data:`MAX_CACHE_BYTES` (``over``, by default ``size``) would round to
  the limit in MiB (4 bytes past it read "256 MiB, over the limit of 256
  MiB"): the limit then too."""
  if round((size if over is None else over) / 2**20) <= MAX_CACHE_BYTES >> 20:
    return f"{size:,} bytes"
  return f"{size / 2**20:,.0f} MiB"


def check_cache_bytes(data_loader: DataLoader, cache_size: int,
                      mb_size: int) -> None:
  """Raises, before anything is allocated, if a cache of ``cache_size``
  batches of ``mb_size`` takes more than :data:`MAX_CACHE_BYTES`."""
  row = row_bytes(data_loader)
  size = cache_size * mb_size * row
  if size > MAX_CACHE_BYTES:
    raise ValueError(
        f"cached_batches_count={cache_size} batches of mb_size={mb_size} "
        f"observations of {row} bytes make a cache of {_mib(size)} per "
        f"chain, over the limit of {_mib(MAX_CACHE_BYTES, size)} "
        "(jax_data.pipeline.MAX_CACHE_BYTES); use fewer cached batches")


#: What ``cached_batches_count`` may be instead of a number: chosen by
#: :func:`auto_cache_size` when the pipeline's first chains are made.
AUTO = "auto"
#: The bytes that all chains' caches of ``cached_batches_count="auto"``
#: hold together on a CPU device whose usable cores share at least
#: :data:`AUTO_L3_BYTES` of level-3 cache, where the caches, the chunk read
#: ahead and the rows they come from can stay in it between the host's
#: write and XLA's read (the likely reason, not measured apart): on an
#: Intel Xeon virtual machine (2 cores, 2 MiB of L2 each, 480 MiB of L3 as
#: Linux reports it) 16-32 MiB ran fastest from 16 to 1,024 chains, 64 MiB
#: and more 1.1-1.5x slower (docs/benchmarks.md).
AUTO_CPU_BYTES = 16 << 20
#: The least level-3 cache of the usable cores together for which "auto"
#: keeps all caches within :data:`AUTO_CPU_BYTES` on a CPU; with less,
#: within :data:`AUTO_CPU_LARGE_BYTES`. On an AMD EPYC virtual machine of
#: 32 MiB of L3 (2 cores), which small caches do not stay in either, a
#: refresh's fixed part weighed more: 256 MiB's choices ran 256 and 1,024
#: chains 15-35 % faster than 16 MiB's (docs/benchmarks.md). Between those
#: two machines' 32 and 480 MiB the threshold is not measured. Where the
#: L3 cannot be read, :data:`AUTO_CPU_BYTES`.
AUTO_L3_BYTES = 64 << 20
#: The bytes of all caches of "auto" on a CPU of less L3 than
#: :data:`AUTO_L3_BYTES`: what a refresh of 124 batches of 256 chains of
#: case (g) takes (2.2 MB a batch of all chains), where 64-200 ran fastest.
AUTO_CPU_LARGE_BYTES = 256 << 20
#: The same on other devices (not measured there): it bounds the device
#: memory that the caches take beside the sampler's.
AUTO_DEVICE_BYTES = 256 << 20
#: The most batches a cache of ``cached_batches_count="auto"`` holds: one
#: chain's step took 20-37 % less time with 1,000 than with 100 (fewer
#: refreshes, each with a fixed part), the largest size measured
#: (docs/benchmarks.md). Loaders of slow rows get fewer
#: (:data:`AUTO_SLOW_BATCHES`).
AUTO_MAX_BATCHES = 1000
#: The least batches a cache of ``cached_batches_count="auto"`` holds for
#: chains that refresh one by one (exact streams, tf.data shuffle buffers),
#: where it fits: each chain's refresh has a fixed part of Python. 256 such
#: chains took 4.3 ms a step with 7 batches, 1.0 ms with 100 (exact
#: streams), and 2.9 against 0.78 ms with one batch and 100 (shuffle
#: buffers); 10 and 100 batches were alike there.
AUTO_APART_BATCHES = 100
#: The most batches a cache of ``cached_batches_count="auto"`` holds over a
#: loader whose rows are slow to read (``HostDataLoader.slow_rows``: a
#: Python ``__getitem__`` per record, a decoding tf.data pipeline). A
#: chain's first refresh reads a whole cache, and reading dominates: one
#: chain over case (e)'s bz2 records took 1.27-1.30 s for its first
#: 200-step call with the pass of 313 batches that "auto" chose before,
#: 0.64-0.68 s with 100, and 5.4-5.9 s against 4.6-4.9 s for ten more.
AUTO_SLOW_BATCHES = 100


def auto_budget(platform: str, l3_bytes: Optional[int] = None) -> int:
  """The bytes that all chains' caches of ``cached_batches_count="auto"``
  hold together on a device of ``platform``: :data:`AUTO_DEVICE_BYTES` off
  a CPU; on a CPU :data:`AUTO_CPU_BYTES`, or :data:`AUTO_CPU_LARGE_BYTES`
  where the usable cores share less than :data:`AUTO_L3_BYTES` of level-3
  cache together (``l3_bytes``; default: this machine's, where it can be
  read).

  >>> auto_budget("cpu", l3_bytes=480 << 20) == AUTO_CPU_BYTES
  True
  >>> auto_budget("cpu", l3_bytes=32 << 20) == AUTO_CPU_LARGE_BYTES
  True
  """
  if platform != "cpu":
    return AUTO_DEVICE_BYTES
  if l3_bytes is None:
    l3_bytes = usable_cache_bytes(3)
  if l3_bytes is not None and l3_bytes < AUTO_L3_BYTES:
    return AUTO_CPU_LARGE_BYTES
  return AUTO_CPU_BYTES


def auto_cache_size(data_loader: DataLoader, mb_size: int, chain_count: int,
                    platform: str, together: bool = True,
                    budget: Optional[int] = None) -> int:
  """The batches per cache that ``cached_batches_count="auto"`` chooses for
  ``chain_count`` chains on a device of ``platform`` (``"cpu"``, ...): as
  many as keep all chains' caches within ``budget`` bytes (default:
  :func:`auto_budget` of the platform on this machine), between 1 and
  :data:`AUTO_MAX_BATCHES`, and no more than a pass over the data holds
  (where its length is known) or :data:`MAX_CACHE_BYTES` allows. Chains
  that do not refresh ``together`` (all of counter-based streams, drawn
  and read in one call) get at least :data:`AUTO_APART_BATCHES` within
  those two bounds; a loader whose rows are slow to read
  (``slow_rows``) at most :data:`AUTO_SLOW_BATCHES`.

  >>> import numpy as np
  >>> from jax_data import NumpyDataLoader
  >>> loader = NumpyDataLoader(x=np.zeros((100_000, 33), np.float32))
  >>> [auto_cache_size(loader, 64, c, "cpu", budget=AUTO_CPU_BYTES)
  ...  for c in (1, 16, 256, 1024)]
  [1000, 123, 7, 1]
  >>> [auto_cache_size(loader, 64, c, "cpu", budget=AUTO_CPU_LARGE_BYTES)
  ...  for c in (1, 16, 256, 1024)]
  [1000, 1000, 123, 30]
  >>> auto_cache_size(loader, 64, 1024, "cpu", together=False,
  ...                 budget=AUTO_CPU_BYTES)
  100
  """
  batch = mb_size * row_bytes(data_loader)
  if budget is None:
    budget = auto_budget(platform)
  size = min(budget // (max(chain_count, 1) * batch), AUTO_MAX_BATCHES)
  most = MAX_CACHE_BYTES // batch
  count = data_loader.observation_count
  if count is not None:
    most = min(most, math.ceil(count / mb_size))
  if not together:
    size = max(size, AUTO_APART_BATCHES)
  if getattr(data_loader, "slow_rows", False):
    size = min(size, AUTO_SLOW_BATCHES)
  return max(int(min(size, most)), 1)


def warn_large_cache(cache_size: int, mb_size: int,
                     observation_count: Optional[int],
                     stacklevel: int = 3) -> None:
  """Warns when the cache holds more batches than one pass over the data
  (of a known length)."""
  if observation_count is None:
    return
  needed = math.ceil(observation_count / mb_size)
  if cache_size > needed:
    warnings.warn(
        f"the cache holds {cache_size} batches of {mb_size}, more than the "
        f"{needed} that hold all {observation_count} observations; consider "
        "a smaller cache or a DeviceNumpyDataLoader", UserWarning,
        stacklevel=stacklevel)
