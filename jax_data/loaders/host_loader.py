"""The host-loader interface: what a loader implements to feed compiled code.

A host loader describes its data (:attr:`~HostDataLoader.static_information`,
:attr:`~HostDataLoader.observation_format`) and opens *chains* from typed
specs (``jax_data.loaders.chains``). A chain is a stream of chunks, each
``cache_size`` batches of ``mb_size`` observations; the loader produces them
through a :class:`~jax_data.loaders.chains.ChainCursor`, whose position can
be saved and restored. That is the whole contract: registering chains,
keeping chunks, snapshots, prefetching, several devices and checkpoints are
the host side's work (``jax_data.serving``), the same for every loader.

A new loader subclasses :class:`HostDataLoader` and implements
``static_information``, ``observation_format`` and :meth:`open_chain`
(optionally :meth:`~HostDataLoader.content_digest`); the methods of the
predecessor's API (``register_random_pipeline``, ``get_batches``,
``save_state``, ``load_state``) then come for free. A loader written or
extended the predecessor's way (its class overrides ``get_batches``) is
served through those methods instead (``jax_data.loaders.legacy_loader``).

Only NumPy runs behind the cursors: the host calls them from its own threads
while compiled code waits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from typing import Any
from typing import Callable
from typing import ClassVar
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import jax
import numpy as np

from jax_data.loaders.chains import STREAMS
from jax_data.loaders.chains import ChainCursor
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import LeafFormat
from jax_data.loaders.chains import OrderedChain
from jax_data.loaders.chains import RandomChain
from jax_data.loaders.chains import RowsByIndexNeeded
from jax_data.loaders.chains import batch_rows
from jax_data.loaders.legacy_loader import LegacyCursor
from jax_data.loaders.legacy_loader import OwnChain
from jax_data.loaders.legacy_loader import PredecessorAdapter
from jax_data.loaders.loader import DataLoader
from jax_data.streams.sampling import ObservationRange
from jax_data.types import PyTree
from jax_data.validation import check_bool
from jax_data.validation import check_int
from jax_data.validation import check_keywords

#: Random chains over more observations than this draw counter-based
#: streams by default (``stream="auto"``): an exact shuffled chain keeps up
#: to two permutations of 8 bytes per observation (8 MiB each here) and
#: replays from snapshots to seek.
AUTO_COUNTER_ABOVE = 2**20


@dataclasses.dataclass(frozen=True)
class StoreLimits:
  """How much a pipeline's host keeps for its chains: a value each loader
  carries (:attr:`HostDataLoader.store_limits`) and the pipelines over it
  use.

  Attributes:
    recent_snapshots: Snapshots of a chain's position newer than this many
      chunks are all kept; older ones thin out to about this many per
      doubling of age.
    max_stored: Hard limit of stored chunks per chain, whatever the device
      count.
    ahead: Chunks of a chain produced ahead of its requests. Two, not one:
      the thread then goes on producing while the device copies and
      computes, and where producing a chunk takes about as long as the
      device takes to use one (random rows of a large array), requests do
      not wait on every chunk. Fewer, at least one, where this many for
      every vmapped chain of a request would pass ``store_bytes``.
    max_replay: The most chunks a request may make a chain replay from a
      snapshot: a state far beyond anything its chain produced (a crafted
      checkpoint) is refused rather than replayed for hours. Snapshots thin
      out to one per 1/16 of a chunk's age, so honest replays stay far
      below this.
    store_bytes: Stored chunks of all of a pipeline's chains together stay
      within this many bytes, or within ``keep + ahead`` chunks per lane of
      the largest request if that is more; the least recently used go
      first.
    held_requests: What the cursors of a pipeline's chains hold for reuse
      (permutations, read blocks) stays within ``store_bytes`` too, or
      within this many times what the chains of the largest request hold if
      that is more; the cursors of the chains produced for least recently
      are trimmed first, those of the chains of the last request never.
    page_locked: Where the process drives an NVIDIA GPU, the buffers of
      the host's answers and of its chunks (those it keeps for reuse, of
      1 MiB and more) are registered as page-locked memory, which the
      runtime copies to the device directly: 2.2x faster steps of 256
      vmapped chains on an H200 (:mod:`jax_data.loaders.pinning`). False
      keeps them in ordinary memory. Nothing changes where no GPU is
      driven.
  """
  recent_snapshots: int = 16
  max_stored: int = 32
  ahead: int = 2
  max_replay: int = 1 << 20
  store_bytes: int = 128 << 20
  held_requests: int = 4
  page_locked: bool = True


# The keywords of a chain that jax_data itself reads; a loader's others
# travel in the spec's ``options``.
_OWN_KEYWORDS = frozenset(("seed", "shuffle", "in_epochs", "shard_index",
                           "shard_count", "stream"))


class ChainNumbering:
  """Numbers a loader's chains, from 0, in the order they are added
  (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._count = 0

  def number(self, spec: ChainSpec,
             open_cursor: Callable[[int, ChainSpec], ChainCursor],
             fill_seed: bool = True) -> Tuple[int, ChainSpec, ChainCursor]:
    """The next number, the spec with a random chain's missing seed set to
    it (with ``fill_seed``), and ``open_cursor(number, spec)``; nothing is
    numbered if that raises."""
    with self._lock:
      number = self._count
      if fill_seed and isinstance(spec, RandomChain) and spec.seed is None:
        spec = dataclasses.replace(spec, seed=number)
      cursor = open_cursor(number, spec)
      self._count += 1
    return number, spec, cursor

  @property
  def count(self) -> int:
    """How many chains were numbered."""
    return self._count


class HostDataLoader(DataLoader):
  """Data on the host, served to compiled code in chunks of batches.

  Chains are numbered per loader, from 0, in the order they are added (by a
  pipeline's ``init_fn`` or by :meth:`register_random_pipeline`); a random
  chain's seed defaults to its number. The predecessor's methods
  (``register_*_pipeline``, ``get_batches``, ``save_state``,
  ``load_state``, ``release_chain``) are handed on to a
  :class:`~jax_data.loaders.legacy_loader.PredecessorAdapter` over the loader.

  Subclasses implement ``static_information``, ``observation_format`` and
  :meth:`open_chain`, and set :attr:`random_keywords` to the options their
  random chains take; those beyond jax_data's own reach ``open_chain`` in
  the spec's ``options`` (and a loader written the predecessor's way as
  ``register_random_pipeline`` keywords).
  """

  #: Keywords a random chain of this loader takes.
  random_keywords: ClassVar[Tuple[str, ...]] = (
      "seed", "shuffle", "in_epochs", "shard_index", "shard_count")
  #: Keywords an ordered chain of this loader takes.
  ordered_keywords: ClassVar[Tuple[str, ...]] = ("shard_index", "shard_count")
  #: With ``"stream"`` among the random keywords: ``stream="auto"`` draws
  #: counter-based streams above this many observations (None: never).
  auto_counter_above: ClassVar[Optional[int]] = AUTO_COUNTER_ABOVE
  #: Whether the cursors of the class's :meth:`open_chain` read rows by
  #: index (they serve a random chain's ``part`` and an ordered chain's
  #: ``batches``). See :attr:`chains_read_by_index`.
  reads_by_index: ClassVar[bool] = False
  #: What the pipelines over this loader keep (:class:`StoreLimits`); set
  #: another value on a loader before making pipelines over it.
  store_limits: StoreLimits = StoreLimits()
  #: Whether a row costs more to read than to copy (a Python call per
  #: record, decoding): ``cached_batches_count="auto"`` then keeps caches of
  #: at most ``AUTO_SLOW_BATCHES`` (100), so that a chain's first refresh
  #: waits for fewer rows.
  slow_rows: bool = False

  # -- the interface ------------------------------------------------------

  def open_chain(self, spec: ChainSpec, layout: ChunkLayout) -> ChainCursor:
    """A cursor before the first chunk of the chain ``spec``.

    Args:
      spec: What the chain draws; a random chain's seed is set.
      layout: The chunks' arrays; its leaves are the loader's
        ``observation_format``.
    """
    raise NotImplementedError(
        f"{type(self).__name__} implements neither open_chain nor the "
        "predecessor's get_batches; a host loader needs one of them")

  def content_digest(self) -> Optional[str]:
    """A cheap digest of the data (a sample of rows and the row count), so
    that a checkpoint is not restored into other data; None if unknown."""
    return None

  def earlier_digests(self) -> Tuple[str, ...]:
    """The digests earlier versions of jax_data computed for the data
    (a sample of fewer rows): checkpoints they saved carry those, and
    restore where one matches. None by default (an empty tuple)."""
    return ()

  def check_spec(self, spec: ChainSpec) -> None:
    """Raises if this loader cannot serve ``spec`` (called before the chain
    is numbered); the default accepts every spec."""
    del spec

  # -- what the interface gives -------------------------------------------

  def chunk_layout(self, cache_size: int, mb_size: int) -> ChunkLayout:
    """The layout of chunks of ``cache_size`` batches of ``mb_size``."""
    leaves = jax.tree_util.tree_leaves(self.observation_format)
    return ChunkLayout(cache_size, mb_size, tuple(
        LeafFormat(tuple(s.shape), np.dtype(s.dtype)) for s in leaves))

  def chain_spec(self, ordered: bool, **keywords: Any) -> ChainSpec:
    """The spec of a chain from ``init_fn`` keywords.

    Args:
      ordered: An ordered chain, else a random one.
      **keywords: ``shard_index``/``shard_count``; for random chains also
        the options in :attr:`random_keywords`.

    Returns:
      The spec; a random chain's ``seed`` is None when not given (it becomes
      the chain's number in :meth:`add_chain`).

    Raises:
      TypeError, ValueError: an unknown keyword or a bad value, named.
    """
    allowed = self.ordered_keywords if ordered else self.random_keywords
    kind = "an ordered" if ordered else "a random"
    # Loaders that read rows by index (loaders.indexed) take ``stream``.
    streams = "stream" in allowed
    stream = keywords.pop("stream", "auto") if streams else "exact"
    check_keywords(f"{kind} chain of {type(self).__name__}", keywords,
                   allowed)
    observations = self.observation_range(
        ordered, keywords.get("shard_index"), keywords.get("shard_count"))
    options = tuple(sorted((name, _option(value))
                           for name, value in keywords.items()
                           if name not in _OWN_KEYWORDS))
    if ordered:
      return OrderedChain(observations, options=options)
    seed = keywords.get("seed")
    shuffle = check_bool("shuffle", keywords.get("shuffle", False))
    in_epochs = check_bool("in_epochs", keywords.get("in_epochs", False))
    if in_epochs and not shuffle:
      raise ValueError("in_epochs=True needs shuffle=True, got shuffle=False")
    stream = _stream_kind(stream, observations, self.auto_counter_above)
    if shuffle and stream == "exact":
      _check_permutation_fits(observations.count)
    return RandomChain(
        None if seed is None else check_int(
            "seed", seed, minimum=0,
            maximum=None if stream == "exact" else 2**64 - 1),
        observations, shuffle, in_epochs, stream, options=options)

  def observation_range(self, ordered: bool, shard_index: Any,
                        shard_count: Any) -> ObservationRange:
    """The observations a chain draws from: all of them, or the shard the
    user's ``shard_index`` and ``shard_count`` name (checked).

    Raises:
      TypeError, ValueError: bad shard arguments, or a chain the loader
        cannot serve, named.
    """
    del ordered
    return ObservationRange.from_arguments(
        self.observation_count, shard_index,
        shard_count)

  def add_chain(self, spec: ChainSpec, layout: ChunkLayout
                ) -> Tuple[int, ChainSpec, ChainCursor]:
    """Numbers a chain and opens the cursor the host serves it through;
    nothing is numbered if that raises.

    The cursor is :meth:`open_chain`'s, unless the loader's class overrides
    ``get_batches`` (the predecessor's way to write or extend a loader):
    then the chain is served through ``get_batches``, ``save_state`` and
    ``load_state``.

    Returns:
      ``(number, spec, cursor)``; a random chain's seed, if None, is now
      the chain's number.

    Raises:
      ValueError: the batch size exceeds the chain's observations, or the
        loader cannot serve the spec.
    """
    return self.number_chain(
        spec, layout, lambda number, spec: self._host_cursor(
            number, spec, layout))

  def number_chain(self, spec: ChainSpec, layout: ChunkLayout,
                   open_cursor: Callable[[int, ChainSpec], ChainCursor]
                   ) -> Tuple[int, ChainSpec, ChainCursor]:
    """Numbers a chain (:class:`ChainNumbering`) whose spec the loader
    accepts (:meth:`check_spec`) and opens its cursor with
    ``open_cursor(number, spec)``; nothing is numbered if that raises."""
    # An ordered chain of ``batches`` (a device's share of a split pass, a
    # full-data pass padded to whole chunks) may be only a pass's last
    # batch, partial: its padding fills the batch. Its pipeline checks
    # the spec of a restored one (FullPipeline.check_saved_chain).
    share = getattr(spec, "batches", None) is not None
    self._check_observations(spec, share)
    fillers = getattr(spec, "fillers_from", None)
    if fillers is not None:  # the last batch's fillers lie in the data
      check_int("fillers_from", fillers, minimum=0,
                maximum=(self.observation_count or 0) - layout.mb_size,
                what="the observation count less mb_size")
    observations = spec.observations
    if (not share and observations.shard_count > 1
        and batch_rows(spec, layout.mb_size) > observations.count):
      raise ValueError(
          f"shard_count={observations.shard_count} leaves "
          f"shard_index={observations.shard_index} "
          f"{observations.count} observation(s), fewer than "
          f"mb_size={batch_rows(spec, layout.mb_size)}: use fewer shards "
          "or smaller batches")
    check_int("mb_size", batch_rows(spec, layout.mb_size), minimum=1,
              maximum=None if share else observations.count,
              what="the observation count")

    def checked_open(number: int, spec: ChainSpec) -> ChainCursor:
      self.check_spec(spec)
      cursor = open_cursor(number, spec)
      split = getattr(spec, "part", None) or getattr(spec, "batches", None)
      if split is not None and not cursor.serves_parts:
        cursor.close()
        readers = ("NumpyDataLoader, SourceDataLoader" if share else
                   "NumpyDataLoader, SourceDataLoader, TensorflowDataLoader("
                   "in_memory=True) with stream='counter'")
        raise RowsByIndexNeeded(
            f"{'passes' if share else 'global batches'} split the data "
            "over devices, which needs a loader that reads rows by index "
            f"({readers}); {type(self).__name__} serves this chain "
            f"through a {type(cursor).__name__}")
      return cursor

    # A loader written the predecessor's way registers its chains with the
    # keywords given, its own default seed where none was: the spec (and a
    # checkpoint's) keeps no seed then, so that a restore registers alike.
    return self._parts()[0].number(spec, checked_open,
                                   fill_seed=not self._predecessors())

  def _check_observations(self, spec: ChainSpec, share: bool) -> None:
    """Raises if ``spec``'s observations are not ones this loader gives a
    chain (a spec read back from a checkpoint may have been edited): the
    range of its shard, or for an ordered chain of ``batches`` (a device's
    share of a split pass, a padded full-data pass, whose pipeline checks
    more) a range within the data."""
    have = spec.observations
    if share:
      total = self.observation_count
      if total is None or have.start + have.count <= total:
        return
      want = f"within the loader's {total} observations"
    else:
      sharded = have.shard_count != 1
      try:
        expected = self.observation_range(
            isinstance(spec, OrderedChain),
            have.shard_index if sharded else None,
            have.shard_count if sharded else None)
      except (TypeError, ValueError) as e:
        raise ValueError(f"the chain's observations {have} do not fit "
                         f"{self!r}: {e}") from None
      if have == expected:
        return
      want = f"the loader's {expected}"
    raise ValueError(
        f"the chain's observations {have} are not {want} (a checkpoint of "
        "other data, or an edited one)")

  def chains_numbered(self) -> int:
    """How many chains this loader numbered, by pipelines' ``init_fn``
    and by :meth:`register_random_pipeline` and
    :meth:`register_ordered_pipeline`."""
    return self._parts()[0].count

  @property
  def chains_read_by_index(self) -> bool:
    """Whether this loader's chains read rows by index: its class's
    cursors do (:attr:`reads_by_index`), and it serves them, not a
    ``get_batches`` of its own (a subclass's chains then go through
    that). A full-data pass then ends in whole invalid batches of one row,
    not in batches of the next pass read to fill its last chunk; where a
    subclass's ``open_chain`` opens other cursors, the chain is refused
    (:class:`~jax_data.loaders.chains.RowsByIndexNeeded`) and the pass
    is not padded."""
    return (self.reads_by_index
            and type(self).get_batches is HostDataLoader.get_batches)

  @property
  def predecessor_style(self) -> bool:
    """Whether the loader is written the predecessor's way (its own
    ``get_batches``, no ``open_chain``): its chains may not go back to an
    earlier chunk, so a full-data pipeline gives each ``init_fn`` a chain
    of its own."""
    return self._predecessors()

  def _predecessors(self) -> bool:
    """Whether the loader is written the predecessor's way: its own
    ``get_batches`` and no ``open_chain``."""
    cls = type(self)
    return (cls.get_batches is not HostDataLoader.get_batches
            and cls.open_chain is HostDataLoader.open_chain)

  def _host_cursor(self, number: int, spec: ChainSpec, layout: ChunkLayout
                   ) -> ChainCursor:
    cls = type(self)
    if cls.get_batches is HostDataLoader.get_batches:
      return self.open_chain(spec, layout)
    if self._predecessors():
      return LegacyCursor.registered(
          self, spec, layout,
          saves=cls.save_state is not HostDataLoader.save_state)
    # A subclass of a loader of ours that overrides get_batches: its chain
    # is one of the loader's own, under the same number.
    self._parts()[1].adopt(number, OwnChain(self.open_chain(spec, layout),
                                            layout, spec))
    return LegacyCursor(self, number, layout)

  def _parts(self) -> Tuple[ChainNumbering, PredecessorAdapter]:
    # Made on first use: subclasses need not call an __init__ of ours.
    parts = self.__dict__.get("_chain_parts")
    if parts is None:  # setdefault: one of two racing threads wins
      parts = self.__dict__.setdefault(
          "_chain_parts", (ChainNumbering(), PredecessorAdapter(self)))
    return parts

  # -- the predecessor's API (handed on to a PredecessorAdapter) ----------

  def register_random_pipeline(self, cache_size: int = 1,
                               mb_size: Optional[int] = None,
                               **kwargs: Any) -> int:
    """Registers a chain of random batches and returns its id.

    Args:
      cache_size: Batches per chunk.
      mb_size: Observations per batch.
      **kwargs: The options in :attr:`random_keywords`: ``seed`` (default:
        the chain id), ``shard_index``/``shard_count`` to draw from one
        contiguous shard, and for the NumPy loader ``shuffle`` and
        ``in_epochs`` (``spec/SAMPLING.md``).
    """
    return self._parts()[1].register(False, cache_size, mb_size, kwargs)

  def register_ordered_pipeline(self, cache_size: int = 1,
                                mb_size: Optional[int] = None,
                                **kwargs: Any) -> int:
    """Registers a chain that visits every observation in order, pass after
    pass, the last batch of a pass padded and masked; returns its id.

    Args:
      cache_size: Batches per chunk.
      mb_size: Observations per batch.
      **kwargs: ``shard_index``/``shard_count`` to pass over one shard.
    """
    return self._parts()[1].register(True, cache_size, mb_size, kwargs)

  def get_batches(self, chain_id: int) -> Tuple[PyTree, Any]:
    """The chain's next chunk, and advances it.

    Returns:
      JAX arrays with leading axes ``(cache_size, mb_size)`` in the loader's
      ``observation_format``, and a bool JAX array mask of shape
      ``(cache_size, mb_size)``, as the predecessor returned them. (Compiled
      code receives chunks through the host callback, which works with
      NumPy arrays and does not call this method.)
    """
    return self._parts()[1].get_batches(chain_id)

  def save_state(self, chain_id: int) -> Dict[str, Any]:
    """The chain's position: a small dict, restorable by
    :meth:`load_state`: the chain's kind and sizes, and the fields of its
    cursor's position."""
    return self._parts()[1].save_state(chain_id)

  def load_state(self, chain_id: int, data: Dict[str, Any]) -> None:
    """Moves the chain to a position from :meth:`save_state`; ``data`` is
    not changed.

    Raises:
      TypeError: ``data`` is not a dict.
      ValueError: it belongs to a chain of another kind or size; the message
        shows both sides.
    """
    self._parts()[1].load_state(chain_id, data)

  def release_chain(self, chain_id: int) -> None:
    """Frees what the loader holds for a chain; its id is not reused."""
    self._parts()[1].release_chain(chain_id)


def _stream_kind(stream: Any, observations: ObservationRange,
                 auto_counter_above: Optional[int]) -> str:
  """``"exact"`` or ``"counter"`` for the ``stream`` keyword: ``"auto"`` is
  counter-based above ``auto_counter_above`` observations (an exact shuffled
  chain keeps O(n) permutations and seeks by replaying), exact otherwise
  (the predecessor's batches, or the loader's own stream)."""
  if not isinstance(stream, str) or stream not in ("auto",) + STREAMS:
    raise ValueError(
        f"stream must be 'auto', 'exact' or 'counter', got {stream=}")
  if stream == "auto":
    return ("counter" if auto_counter_above is not None
            and observations.count > auto_counter_above else "exact")
  return stream


def _option(value: Any) -> Any:
  """A loader's own keyword's value as a checkpoint saves and restores it
  where JSON can hold it (a NumPy or JAX scalar a Python number, a tuple a
  list), so that the chain gets the same value before and after a
  restore; other values as given (a checkpoint of the chain then names
  the keyword it cannot save)."""
  if isinstance(value, (np.generic, np.ndarray, jax.Array)) and (
      np.ndim(value) == 0):
    value = np.asarray(value).item()
  try:
    return json.loads(json.dumps(value))
  except (TypeError, ValueError):
    return value


#: The bytes per observation an exact shuffled chain takes at its peak: it
#: keeps up to two permutations of 8 bytes per observation (this epoch's
#: and the one before, for a replay), and drawing the next takes as much
#: again (31.9 bytes measured at 1e6 observations).
PERMUTATION_PEAK_BYTES = 32


def _check_permutation_fits(count: int) -> None:
  """Raises if what an exact shuffled chain of ``count`` observations takes
  at its peak (:data:`PERMUTATION_PEAK_BYTES` each) is larger than the
  machine's memory, rather than failing at a batch."""
  try:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, OSError, ValueError):  # not a POSIX system
    return
  peak = PERMUTATION_PEAK_BYTES * count
  if peak > memory > 0:
    raise ValueError(
        f"stream='exact' with shuffle=True draws permutations of 8 bytes "
        f"per observation and keeps up to two: "
        f"{PERMUTATION_PEAK_BYTES} bytes per observation while it draws "
        f"one, {peak / 2**30:,.1f} GiB for {count:,} observations, more "
        f"than this machine's {memory / 2**30:,.1f} GiB of memory; "
        "stream='counter' shuffles in O(1) memory")


def chain_specs(loader: HostDataLoader, seeds: Sequence[Any],
                **keywords: Any) -> List[ChainSpec]:
  """The specs of the random chains of ``init_fn(seed=range(C))``, one per
  seed, every one checked before any chain is made: each is the loader's
  :meth:`~HostDataLoader.chain_spec` of its seed and the other keywords,
  except that ``stream="auto"`` (the default) draws counter-based streams
  wherever the loader's "auto" can (:attr:`~HostDataLoader.
  auto_counter_above` not None), whatever the observation count.

  Chains made together are vmapped together. Counter-based ones are drawn
  in one vectorised call and read in one gather for all of them, and a
  shuffled one keeps no permutation; exact ones are drawn chain by chain,
  and a shuffled one keeps up to two permutations of 8 bytes per
  observation. With the exact streams, 256 and 1,024 vmapped chains over
  1e5 observations took 1.6-1.7x the time per step on 2 cores. The exact
  streams, those of the guide's library, are for one chain per
  ``init_fn`` call, the only way that library made chains;
  ``stream="exact"`` keeps them here."""
  stream = keywords.get("stream", "auto")
  if ("stream" in loader.random_keywords
      and loader.auto_counter_above is not None
      and isinstance(stream, str) and stream == "auto"):
    keywords = {**keywords, "stream": "counter"}
  return [loader.chain_spec(False, **{**keywords, "seed": seed})
          for seed in seeds]
