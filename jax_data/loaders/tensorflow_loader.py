"""Host loader over ``tf.data`` pipelines: :class:`TensorflowDataLoader`.

Importing this module imports TensorFlow (``import jax_data`` alone does
not). Before that import it sets ``TF_ENABLE_ONEDNN_OPTS=0`` unless the
user has set it (oneDNN speeds up TensorFlow's matrix kernels, which a data
pipeline rarely runs, and announces itself at start-up). TensorFlow's C++
log level is JAX's: importing JAX sets ``TF_CPP_MIN_LOG_LEVEL=1`` unless it
is set, which hides TensorFlow's informational messages but not its
warnings (a pipeline that raises logs one); set it to 2 before starting
Python to hide those too. The module also hides the GPUs from TensorFlow,
whose memory belongs to JAX.

Random chains stream the pipeline through a shuffle buffer computed in NumPy
(:class:`jax_data.streams.sampling.BufferShuffle`); ordered chains read it in
order. By default the rows come from ``tf.data`` pass after pass; with
``in_memory=True`` the pipeline is read once into NumPy arrays and chunks are
gathers from them. The host bridge asks for the next chunk from a background
thread while the device works. A chain's position is the number of batches it
has served, so a state is a few integers; restoring one replays less than one
pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import warnings
import weakref
from typing import Any
from typing import Dict
from typing import Iterable
from typing import Optional
from typing import Tuple

# Only effective before TensorFlow is first imported; a user's choice wins.
# (JAX, imported by jax_data before this, has set TF_CPP_MIN_LOG_LEVEL=1
# where it was unset: the level below applies only where it was removed.)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import jax
import numpy as np
import tensorflow as tf

from jax_data.loaders.chains import ChainCursor
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import OrderedChain
from jax_data.loaders.chains import RandomChain
from jax_data.loaders.gather import DIGEST_VERSION
from jax_data.loaders.gather import Gatherer
from jax_data.loaders.gather import digest_rows
from jax_data.loaders.gather import same_bytes
from jax_data.loaders.host_loader import HostDataLoader
from jax_data.loaders.indexed import IndexedCursor
from jax_data.loaders.tensorflow_reads import PipelineRows
from jax_data.loaders.tensorflow_reads import SharedReads
from jax_data.loaders.tensorflow_rows import IteratorCloser
from jax_data.loaders.tensorflow_rows import MemoryRows
from jax_data.loaders.tensorflow_rows import Reading
from jax_data.loaders.tensorflow_rows import Rows
from jax_data.loaders.tensorflow_rows import in_order
from jax_data.loaders.tensorflow_streams import OrderedMemoryCursor
from jax_data.loaders.tensorflow_streams import OrderedPipelineCursor
from jax_data.loaders.tensorflow_streams import ShuffleCursor
from jax_data.streams.sampling import ENDLESS
from jax_data.streams.sampling import ObservationRange
from jax_data.types import PyTree
from jax_data.validation import check_bool
from jax_data.validation import check_int


def _hide_gpus(config: Any = tf.config) -> None:
  """Keeps TensorFlow off the GPUs (``config``: ``tf.config``), so it takes
  no device memory from JAX."""
  try:
    config.set_visible_devices([], "GPU")
  except RuntimeError:  # TensorFlow was initialised before this import
    if config.get_visible_devices("GPU"):
      warnings.warn(
          "TensorFlow was initialised before jax_data.tensorflow_loader was "
          "imported and can still see the GPUs, so it may take device memory "
          "from JAX; call tf.config.set_visible_devices([], 'GPU') before "
          "using TensorFlow", UserWarning, stacklevel=2)


_hide_gpus()


def _leaf_format(path: str, top: str, spec: Any) -> jax.ShapeDtypeStruct:
  """One feature's format as a JAX array, or an error naming the feature."""
  hint = f"drop it with exclude_keys=[{top!r}]"
  if not isinstance(spec, tf.TensorSpec):
    raise TypeError(
        f"feature {path!r} is a {type(spec).__name__}, which cannot become "
        f"a JAX array; {hint}, or map it to a dense tensor of fixed shape")
  dtype = spec.dtype
  if dtype.is_quantized or not (dtype.is_bool or dtype.is_integer
                                or dtype.is_floating or dtype.is_complex):
    raise TypeError(
        f"feature {path!r} has dtype {dtype.name}, which cannot become a JAX "
        f"array; {hint}")
  if spec.shape.rank is None or None in spec.shape.as_list():
    raise ValueError(
        f"feature {path!r} has shape {spec.shape} with unknown (None) "
        f"dimensions, but JAX needs fixed shapes; {hint}, or give it a fixed "
        "shape in the pipeline (e.g. with tf.image.resize or tf.ensure_shape)")
  return jax.ShapeDtypeStruct(
      tuple(spec.shape.as_list()),
      jax.dtypes.canonicalize_dtype(dtype.as_numpy_dtype))


def _format(spec: Dict[str, Any], path: str = "", top: str = "") -> PyTree:
  """Nested dict of ``jax.ShapeDtypeStruct`` of a (nested) dict spec."""
  formats = {}
  for key, value in spec.items():
    name = f"{path}/{key}" if path else key
    top_key = top or key
    formats[key] = (_format(value, name, top_key) if isinstance(value, dict)
                    else _leaf_format(name, top_key, value))
  return formats


def _check_not_empty(pipeline: tf.data.Dataset, cardinality: int) -> None:
  """Raises if ``pipeline`` yields no elements: one of unknown or infinite
  length (after ``filter``, from a generator, a ``repeat`` of those) is
  asked for its first element."""
  if cardinality > 0:
    return
  if cardinality == 0:
    how = "its cardinality is 0"
  else:
    for _ in pipeline.take(1):
      return
    how = "asked for its first element, it ended"
  raise ValueError(
      f"pipeline is empty: it yielded no elements ({how}); a "
      f"TensorflowDataLoader needs at least one, got pipeline={pipeline!r}")


def _count(pipeline: tf.data.Dataset, observation_count: Optional[int]
           ) -> Tuple[Optional[int], bool]:
  """The observation count (None: unknown, and not stated), and whether it
  was stated by the user.

  Raises:
    ValueError: the pipeline is empty, or ``observation_count`` is not a
      positive int or differs from the pipeline's cardinality.
  """
  cardinality = int(pipeline.cardinality())
  if observation_count is not None:
    observation_count = check_int("observation_count", observation_count,
                                  minimum=1)
  _check_not_empty(pipeline, cardinality)
  if observation_count is not None:
    if cardinality >= 0 and cardinality != observation_count:
      fix = (f"leave it out, or use pipeline.take({observation_count})"
             if observation_count < cardinality else
             f"the pipeline has only {cardinality} elements: leave it out")
      raise ValueError(
          f"observation_count={observation_count} differs from the pipeline's "
          f"cardinality {cardinality}; {fix}")
    return observation_count, cardinality < 0
  if cardinality in (tf.data.INFINITE_CARDINALITY,
                     tf.data.UNKNOWN_CARDINALITY):
    return None, False  # random chains only: an endless stream
  return cardinality, False


def _read_all(pipeline: tf.data.Dataset, reading: Reading
              ) -> Tuple[Rows, Reading]:
  """Every observation of one pass, as arrays in the loader's dtypes, and
  ``reading`` with its count: a pipeline of unknown length is read to its
  end."""
  if reading.count is None:
    blocks = [reading.as_rows(element) for element in
              in_order(pipeline.batch(4096))]
    if not blocks:  # checked when created: it became empty since
      raise ValueError("pipeline is empty: it yielded no elements")
    arrays = [np.concatenate(leaf) for leaf in zip(*blocks)]
    reading = dataclasses.replace(reading, count=len(arrays[0]))
  else:
    arrays = [np.empty((reading.count,) + fmt.shape, fmt.dtype)
              for fmt in reading.formats]
    blocks = in_order(pipeline.batch(4096))
    filled = 0
    while filled < reading.count:
      rows = reading.next_rows(blocks)
      for array, leaf in zip(arrays, rows):
        array[filled:filled + len(leaf)] = leaf
      filled += len(rows[0])
  for array in arrays:  # chunks may be views of them: keep them intact
    array.setflags(write=False)
  return arrays, reading


def _check_exclude_keys(exclude_keys: Any, spec: Dict[str, Any]
                        ) -> frozenset:
  if exclude_keys is None:
    return frozenset()
  if isinstance(exclude_keys, (str, bytes)) or not isinstance(
      exclude_keys, Iterable):
    raise TypeError(
        "exclude_keys must be a list of feature names, got "
        f"exclude_keys={exclude_keys!r}")
  excluded = frozenset(exclude_keys)
  unknown = sorted(map(repr, excluded - set(spec)))
  if unknown:
    raise ValueError(
        f"exclude_keys names {', '.join(unknown)}, which the pipeline does "
        f"not have; its features are {sorted(spec)}")
  return excluded


class TensorflowDataLoader(HostDataLoader):
  """Host loader over a ``tf.data.Dataset`` of dicts, e.g. from ``tfds.load``.

  Random chains pass over the data again and again, each pass shuffled with
  a buffer of ``shuffle_cache`` observations and its own seed, and cut into
  batches. Ordered chains (for :func:`jax_data.full_reference_data`) pass
  over it in pipeline order, the last batch of a pass padded and masked.
  Features keep their dtype as JAX keeps it: 64-bit ones come out as
  32-bit unless x64 is enabled (an ``int64`` label as ``int32``), others
  (``uint8`` images, ``int16``, ``bool``) as they are.

  Streams are reproducible: the same seed gives the same batches, given the
  same pipeline order. The shuffle buffer works as ``tf.data``'s ``shuffle``
  does, but is computed in NumPy
  (:class:`jax_data.streams.sampling.BufferShuffle`), so streams do not
  depend on TensorFlow's seeds or version. Options of the pipeline are kept,
  except that ``deterministic`` is set.

  By default every pass reads the pipeline again, so data larger than
  memory work and random augmentations in the pipeline stay random. Random
  chains of one shard that stand at the same place in their streams (the
  chains of ``init_fn(seed=range(C))``, stepped together under ``vmap``)
  read one iterator between them: the pipeline runs once for all of them,
  and only their shuffle buffers differ. A random augmentation then draws
  once per element and pass for all of them; with ``share_reads=False``
  each chain reads its own iterator and draws its own. With
  ``in_memory=True`` the loader reads the pipeline once, when it is
  created, keeps the observations as NumPy arrays (in the loader's dtypes)
  and serves chains from them: several times faster, with the same streams,
  but it needs the memory and freezes random augmentations.

  >>> import numpy as np
  >>> import tensorflow as tf
  >>> from jax_data.loaders.tensorflow_loader import TensorflowDataLoader
  >>> pipeline = tf.data.Dataset.from_tensor_slices(
  ...     {"x": np.arange(10), "name": [b"obs"] * 10})
  >>> loader = TensorflowDataLoader(pipeline, exclude_keys=["name"])
  >>> loader
  TensorflowDataLoader(x; 10 observations, shuffle_cache=100)
  >>> chain = loader.register_ordered_pipeline(cache_size=2, mb_size=4)
  >>> batches, mask = loader.get_batches(chain)
  >>> batches["x"].tolist(), str(batches["x"].dtype)
  ([[0, 1, 2, 3], [4, 5, 6, 7]], 'int32')
  >>> batches, mask = loader.get_batches(chain)
  >>> batches["x"].tolist()
  [[8, 9, 0, 1], [0, 1, 2, 3]]
  >>> mask.tolist()
  [[True, True, False, False], [True, True, True, True]]

  Args:
    pipeline: A finite ``tf.data.Dataset`` whose elements are dicts of
      tensors with fixed shapes (nested dicts are allowed). Its order must
      be deterministic for ordered chains and reproducible streams.
    shuffle_cache: Shuffle buffer size of random chains, in observations.
    exclude_keys: Top-level keys to drop, e.g. string features like
      ``"id"``.
    observation_count: Observations in one pass, when the pipeline's
      cardinality is unknown (e.g. after ``filter``, from a generator) or
      infinite: its first ``observation_count`` elements are then the data
      set, and a pipeline that turns out shorter is an error when the chunk
      is drawn. Without it such a pipeline serves random chains only (see
      below), and ``static_information["observation_count"]`` is None.
    in_memory: Read the pipeline once, now, and serve from NumPy arrays
      (the count of a pipeline of unknown length is then known).
    share_reads: Random chains that read the same shard at the same place
      read one iterator between them (without ``in_memory``). False: every
      chain reads its own (256 chains: 544 threads, 15.7 ms a step and
      373 MiB, against 35 threads, 1.04 ms and 212 MiB shared; see
      :doc:`tensorflow`).

  A pipeline of unknown or infinite length, without ``observation_count``,
  serves random chains as the predecessor did: the pipeline repeated, as one
  endless stream through the shuffle buffer (a pass boundary is never
  known, so the buffer is never emptied). Random access needs no count;
  the ``MiniBatchInformation`` of its batches has ``observation_count``
  None (scale a likelihood by your own ``N``). Ordered chains (full-data
  passes), shards and the count need ``observation_count``, and say so.
  Restoring such a chain reads the stream again from its start; with
  ``observation_count`` it reads less than one pass. Such a pipeline is
  asked for its first element when the loader is created, so that an empty
  one is an error now, not inside compiled code.

  Raises:
    TypeError: ``pipeline`` is not a dataset of dicts, a feature cannot
      become a JAX array (strings, ragged or sparse tensors), or
      ``in_memory`` or ``share_reads`` is not a bool.
    ValueError: the pipeline is empty, a feature has unknown dimensions, an
      unknown key in ``exclude_keys``, or ``in_memory=True`` for an
      infinite pipeline.
  """

  random_keywords = ("seed", "shard_index", "shard_count")
  # In memory, stream="counter" draws the counter-based streams of the NumPy
  # loaders (with shuffle and in_epochs); "auto" keeps the shuffle buffer.
  auto_counter_above = None

  def __init__(self, pipeline: tf.data.Dataset, shuffle_cache: int = 100,
               exclude_keys: Optional[Iterable[str]] = None,
               observation_count: Optional[int] = None,
               in_memory: bool = False, share_reads: bool = True):
    if not isinstance(pipeline, tf.data.Dataset):
      raise TypeError(
          "pipeline must be a tf.data.Dataset (e.g. from tfds.load), got "
          f"pipeline={pipeline!r} of type {type(pipeline).__name__}")
    self._shuffle_cache = check_int("shuffle_cache", shuffle_cache,
                                    minimum=1)
    self._share_reads = check_bool("share_reads", share_reads)
    spec = pipeline.element_spec
    if not isinstance(spec, dict):
      raise TypeError(
          "pipeline must yield dicts of features (as tfds.load does), got "
          f"elements of the form {spec}; map them to dicts, e.g. "
          "pipeline.map(lambda x, y: {'x': x, 'y': y})")
    excluded = _check_exclude_keys(exclude_keys, spec)
    kept = [key for key in spec if key not in excluded]
    if not kept:
      raise ValueError(
          f"exclude_keys={sorted(excluded)!r} drops every feature of the "
          "pipeline; keep at least one")
    self._format = _format({key: spec[key] for key in kept})
    self._count, stated = _count(pipeline, observation_count)
    in_memory = check_bool("in_memory", in_memory)
    self.slow_rows = not in_memory  # rows from the pipeline's iterator
    if in_memory and self._count is None and int(
        pipeline.cardinality()) == tf.data.INFINITE_CARDINALITY:
      raise ValueError(
          "in_memory=True reads the whole pipeline, but it is infinite (e.g. "
          "it ends in repeat()); pass observation_count=N to keep its first "
          "N elements")
    if stated:
      pipeline = pipeline.take(self._count).apply(
          tf.data.experimental.assert_cardinality(self._count))
    if excluded:
      pipeline = pipeline.map(lambda element: {k: element[k] for k in kept})
    self._pipeline = pipeline
    self._arrays: Optional[Rows] = None
    self._gatherer = Gatherer()
    # Drops the chains' tf.data iterators off the threads that serve them.
    self._closer = IteratorCloser()
    self._digest: Optional[str] = None
    # Each shard's shared reads, by (start, count, rows a read).
    self._shared: "weakref.WeakValueDictionary[Any, SharedReads]" = (
        weakref.WeakValueDictionary())
    self._shared_lock = threading.Lock()
    self._reading = Reading(
        self.chunk_layout(1, 1).leaves, repr(self), self._count, stated,
        paths=tuple(jax.tree_util.keystr(path) for path, _ in
                    jax.tree_util.tree_flatten_with_path(
                        self.observation_format)[0]))
    if in_memory:
      self._arrays, self._reading = _read_all(self._pipeline, self._reading)
      self._count = self._reading.count
      self._reading = dataclasses.replace(self._reading, name=repr(self))
      self.random_keywords = type(self).random_keywords + (
          "shuffle", "in_epochs", "stream")
    # After an in-memory read, which counts a pipeline of unknown length.
    _check_buffer_fits(self._shuffle_cache, self._count,
                       self.chunk_layout(1, 1).nbytes)

  def __repr__(self) -> str:
    keys = ", ".join(map(str, self._format))
    memory = ", in memory" if self._arrays is not None else ""
    count = ("unknown number of" if self._count is None
             else f"{self._count}")
    return (f"{type(self).__name__}({keys}; {count} observations, "
            f"shuffle_cache={self._shuffle_cache}{memory})")

  @property
  def static_information(self) -> Dict[str, Optional[int]]:
    """``observation_count``: None for a pipeline of unknown length given
    without ``observation_count``."""
    return {"observation_count": self._count}

  @property
  def observation_format(self) -> PyTree:
    return self._format

  # -- chains -------------------------------------------------------------

  def observation_range(self, ordered: bool, shard_index: Any,
                        shard_count: Any) -> ObservationRange:
    """As :meth:`HostDataLoader.observation_range`; a random chain of a
    pipeline of unknown length reads the endless stream.

    Raises:
      ValueError: an ordered chain or a shard of a pipeline of unknown
        length, naming ``observation_count``.
    """
    if self._count is not None:
      return super().observation_range(ordered, shard_index, shard_count)
    needs = ("an ordered chain (a full-data pass)" if ordered else
             "a shard" if shard_index is not None or shard_count is not None
             else None)
    if needs is not None:
      raise ValueError(
          f"{needs} of {self!r} needs the number of observations, which a "
          "pipeline of unknown length does not tell; pass "
          "TensorflowDataLoader(pipeline, observation_count=N). Random "
          "chains work without it")
    return ObservationRange(0, ENDLESS)

  def check_spec(self, spec: ChainSpec) -> None:
    """Seeds of random chains are non-negative integers of any size, as
    for the NumPy loaders' exact streams (counter-based ones take seeds
    below 2**64); ``shuffle`` and ``in_epochs`` choose among counter-based
    streams only."""
    if isinstance(spec, OrderedChain):
      return
    if spec.stream == "counter":
      if self._arrays is None:  # a checkpoint's spec: init_fn refuses it
        raise ValueError(
            f"the chain draws a counter-based stream (stream='counter'), "
            f"which {type(self).__name__} draws only in memory: restore it "
            f"into a {type(self).__name__}(..., in_memory=True) over the "
            "same pipeline")
      return
    check_int("seed", spec.seed, minimum=0)
    if spec.shuffle or spec.in_epochs:
      raise ValueError(
          f"shuffle and in_epochs choose among the counter-based streams "
          f"(stream='counter') of {type(self).__name__}(in_memory=True); "
          f"its own random chains stream through a shuffle buffer, got "
          f"shuffle={spec.shuffle}, in_epochs={spec.in_epochs}")

  def open_chain(self, spec: ChainSpec, layout: ChunkLayout) -> ChainCursor:
    """A cursor over the chain: random chains stream the shard through a
    shuffle buffer of ``shuffle_cache`` observations, pass after pass;
    ordered chains visit it in pipeline order, the last batch of a pass
    padded with the pass's first observations, masked False (as
    ``spec/SAMPLING.md`` for NumPy). A chunk may span two passes."""
    shard = spec.observations
    if self._arrays is not None:
      if isinstance(spec, RandomChain) and spec.stream == "counter":
        rows = MemoryRows(self._arrays, ObservationRange(0, self._count),
                          self._gatherer)
        # Grouped by loader: every such chain reads the same rows.
        return IndexedCursor(spec, layout, rows.gather, rows=self,
                             split=self._gatherer.split,
                             ahead=self._gatherer.submit,
                             early=self._gatherer.draws_early,
                             in_memory=lambda: True)
      source = MemoryRows(self._arrays, shard, self._gatherer)
      if isinstance(spec, OrderedChain):
        return OrderedMemoryCursor(source, spec, layout)
      return ShuffleCursor(source, spec, layout, self._shuffle_cache)
    data = self._shard(shard)
    if isinstance(spec, OrderedChain):
      return OrderedPipelineCursor(data, spec, layout, self._reading,
                                   self._closer)
    per_read = layout.cache_size * layout.mb_size
    shared = None
    if self._share_reads:
      key = (shard.start, shard.count, per_read)
      with self._shared_lock:
        shared = self._shared.get(key)
        if shared is None:
          # Held by its chains' rows; gone with the last of them.
          shared = SharedReads(data, shard.count, per_read, self._reading,
                               self._closer,
                               buffer=min(self._shuffle_cache, shard.count))
          self._shared[key] = shared
    source = PipelineRows(data, shard.count, per_read, self._reading,
                          self._closer, shared)
    return ShuffleCursor(source, spec, layout, self._shuffle_cache)

  def _shard(self, shard: ObservationRange) -> tf.data.Dataset:
    data = self._pipeline
    if self._count is not None and shard.count != self._count:
      data = data.skip(shard.start).take(shard.count)
    return data

  def content_digest(self) -> str:
    """A digest of the observation count and of the pipeline's first 32
    observations (read on first use), the same in both modes.

    A pipeline with randomness of its own (a random augmentation, a
    ``shuffle`` without a seed) gives other values at every read, and a
    new loader over it, in a new process, reads other first observations:
    they are read once more, and where the two reads differ the digest
    covers the count and the observations' formats only. Checkpoints of
    such a pipeline then restore into a new loader over it, and are
    refused for data of other formats or count, not of other values."""
    if self._digest is None:
      self._digest = self._digests((DIGEST_VERSION,))[0]
    return self._digest

  def earlier_digests(self) -> Tuple[str, ...]:
    """The digest of jax_data's checkpoints before 2026-12-01, whose
    sample left out 8 of the first 32 observations."""
    return self._digests((1,))

  def _digests(self, versions: Tuple[int, ...]) -> Tuple[str, ...]:
    count = f"/{'unknown' if self._count is None else self._count}"
    read = lambda: self._reading.next_rows(
        in_order(self._pipeline.take(32).batch(32)))
    if self._arrays is not None:
      first = min(self._count, 32)
      leaves = [array[:first] for array in self._arrays]
    else:
      leaves = read()
      first = len(leaves[0])
    if not _same_rows(leaves, read()):
      formats = repr(self.observation_format).encode()
      return ("formats " + hashlib.sha256(formats).hexdigest()[:32]
              + count,) * len(versions)
    dtypes = [fmt.dtype for fmt in self._reading.formats]
    return tuple(digest_rows(first, lambda row: [leaf[row] for leaf in leaves],
                             dtypes, version) + count
                 for version in versions)


def _check_buffer_fits(shuffle_cache: int, count: Optional[int],
                       row_bytes: int) -> None:
  """Raises, naming ``shuffle_cache``, if a random chain's shuffle buffer
  (at most the pipeline's ``count`` observations) would take more than the
  machine's memory: it failed with a MemoryError at the first batch,
  inside the host callback (2**40 observations: 8 TiB)."""
  held = shuffle_cache if count is None else min(shuffle_cache, count)
  try:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, OSError, ValueError):  # no sysconf: unchecked
    return
  # Each buffered observation's row, and its place in the buffer.
  needed = held * (row_bytes + 8)
  if needed > memory:
    raise ValueError(
        f"shuffle_cache={shuffle_cache} observations of {row_bytes} bytes "
        f"take {needed:,} bytes per random chain, more than this machine's "
        f"{memory:,} bytes of memory; use a smaller shuffle_cache")


def _same_rows(leaves, again) -> bool:
  """Whether two reads of a pipeline's first rows gave the same bytes
  (:func:`~jax_data.loaders.gather.same_bytes`: a bfloat16 NaN among them
  made the loader take the pipeline for a random one)."""
  return len(leaves) == len(again) and all(
      same_bytes(a, b) for a, b in zip(leaves, again))
