"""Host loader over ``tf.data`` pipelines: :class:`TensorflowDataLoader`.

Importing this module imports TensorFlow (``import jax_data`` alone does
not). Before that import it sets, unless the user has set them already,
``TF_CPP_MIN_LOG_LEVEL=2`` and ``TF_ENABLE_ONEDNN_OPTS=0``, which keep
TensorFlow's C++ start-up messages off the console (oneDNN speeds up
TensorFlow's matrix kernels, which a data pipeline rarely runs). It also
hides the GPUs from TensorFlow, whose memory belongs to JAX.

Random chains stream the pipeline through a shuffle buffer computed in
NumPy (:class:`jax_data.sampling.BufferShuffle`); ordered chains read it in
order. By default the rows come from ``tf.data`` pass after pass; with
``in_memory=True`` the pipeline is read once into NumPy arrays and chunks are
gathers from them. The host bridge asks for the next chunk from a background
thread while the device works. A chain's position is the number of batches
it has served, so a state is a few integers; restoring one replays less than
one pass.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any
from typing import Dict
from typing import Iterable
from typing import Iterator
from typing import List
from typing import Optional
from typing import Tuple

# Only effective before TensorFlow is first imported; a user's choice wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import jax
import numpy as np
import tensorflow as tf

from jax_data.loader import ChainList
from jax_data.loader import HostDataLoader
from jax_data.numpy_loader import BufferPool
from jax_data.numpy_loader import is_run
from jax_data.sampling import BufferShuffle
from jax_data.sampling import ObservationRange
from jax_data.sampling import OrderedStream
from jax_data.types import PyTree
from jax_data.validation import check_bool
from jax_data.validation import check_int
from jax_data.validation import check_keywords
from jax_data.validation import check_saved_state
from jax_data.validation import check_sizes

# 2: random chains shuffle with sampling.BufferShuffle, not tf.data's op.
_STATE_VERSION = 2
_MAX_SEED = 2**31 - 1

Rows = List[np.ndarray]  # one array per feature, observations first


def _hide_gpus() -> None:
  """Keeps TensorFlow off the GPUs, so it takes no device memory from JAX."""
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:  # TensorFlow was initialised before this import
    if tf.config.get_visible_devices("GPU"):
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


def _count(pipeline: tf.data.Dataset, observation_count: Optional[int]
           ) -> Tuple[int, bool]:
  """The observation count, and whether it was stated by the user."""
  cardinality = int(pipeline.cardinality())
  if observation_count is not None:
    observation_count = check_int("observation_count", observation_count,
                                  minimum=1)
    if cardinality >= 0 and cardinality != observation_count:
      raise ValueError(
          f"observation_count={observation_count} differs from the pipeline's "
          f"cardinality {cardinality}; leave it out, or use "
          f"pipeline.take({observation_count})")
    return observation_count, cardinality < 0
  if cardinality == tf.data.INFINITE_CARDINALITY:
    raise ValueError(
        "the pipeline is infinite (e.g. it ends in repeat()), so one pass "
        "over the data is not defined; pass observation_count=N to use its "
        "first N elements as the data set")
  if cardinality == tf.data.UNKNOWN_CARDINALITY:
    raise ValueError(
        "the pipeline's number of elements is unknown (e.g. after filter()); "
        "pass observation_count=N, the number of elements of one pass")
  if cardinality == 0:
    raise ValueError("the pipeline is empty (cardinality 0)")
  return cardinality, False


def _next(iterator: Iterator, loader: "TensorflowDataLoader") -> Any:
  """The next element of a tf.data iterator over the loader's pipeline."""
  try:
    return next(iterator)
  except StopIteration:
    raise RuntimeError(
        f"the pipeline of {loader!r} ended early; does it yield fewer "
        "elements on later passes?") from None
  except tf.errors.FailedPreconditionError as e:
    if not loader._count_stated:
      raise
    raise ValueError(
        f"observation_count={loader._count} does not fit the pipeline: "
        f"{e.message}") from e


def _leaves(formats: List[jax.ShapeDtypeStruct], element: Any) -> Rows:
  """The features of a batch of elements as NumPy arrays, in the order of
  the loader's format leaves, with the loader's dtypes."""
  leaves = []
  for fmt, tensor in zip(formats, jax.tree_util.tree_leaves(element)):
    array = np.asarray(tensor)  # a read-only view: no copy, unlike .numpy()
    leaves.append(array if array.dtype == fmt.dtype
                  else array.astype(fmt.dtype))
  return leaves


def _in_order(dataset: tf.data.Dataset) -> Iterator:
  """An iterator over ``dataset`` with ``deterministic`` order set."""
  options = tf.data.Options()
  options.deterministic = True
  return iter(dataset.with_options(options))


class _InMemory:
  """A chain's observations held as NumPy arrays (``in_memory=True``).

  Rows are gathered by index into recycled buffers; runs of consecutive
  rows, as ordered chains read them, are slices.
  """

  def __init__(self, arrays: Rows, shard: ObservationRange,
               buffers: BufferPool):
    stop = shard.start + shard.count
    self._arrays = [array[shard.start:stop] for array in arrays]
    self._buffers = buffers
    self.count = shard.count

  def restart(self, first: int) -> None:
    """Nothing to do: rows are read by index."""
    del first

  def rows(self, wanted: np.ndarray, keep: np.ndarray) -> Rows:
    """The rows of stream elements ``wanted`` (numbered along passes)."""
    del keep
    return self.gather(wanted % self.count)

  def gather(self, flat: np.ndarray) -> Rows:
    """The rows ``flat`` of the chain's observations."""
    if is_run(flat):
      first = int(flat[0])
      return [array[first:first + flat.size] for array in self._arrays]
    return [self._buffers.take(array, flat) for array in self._arrays]


def _lookup(numbers: np.ndarray, wanted: np.ndarray
            ) -> Tuple[np.ndarray, np.ndarray]:
  """Where the ``wanted`` numbers are in the sorted ``numbers``: a row of
  ``numbers`` for each (clipped to the range where absent), and whether it
  is there."""
  at = np.minimum(np.searchsorted(numbers, wanted), numbers.size - 1)
  return at, numbers[at] == wanted


def _gather_from(blocks: List[Tuple[np.ndarray, Rows]], wanted: np.ndarray,
                 out: Rows) -> None:
  """Fills ``out`` with the rows of the elements ``wanted``, each held by
  one of the blocks; the block holding most is gathered in one pass."""
  found = [_lookup(numbers, wanted) for numbers, _ in blocks]
  counts = [np.count_nonzero(there) for _, there in found]
  if sum(counts) != wanted.size:  # blocks are disjoint
    raise RuntimeError(
        f"internal error: {wanted.size - sum(counts)} of the elements wanted "
        "are not held; please report it")
  most = int(np.argmax(counts))
  for b in [most] + [b for b in range(len(blocks)) if b != most]:
    at, there = found[b]
    rows = blocks[b][1]
    if b == most:  # every row; those held elsewhere are overwritten below
      for leaf, row in zip(out, rows):
        np.take(row, at, axis=0, out=leaf, mode="clip")
    elif there.any():
      positions = np.flatnonzero(there)
      for leaf, row in zip(out, rows):
        leaf[positions] = row[at[positions]]


class _Streamed:
  """A chain's observations read from the pipeline in order, pass after
  pass (the default, ``in_memory=False``).

  Elements are numbered along the passes (element ``i`` of pass ``p`` is
  ``p * count + i``). The source holds the blocks it read and still needs:
  the elements a shuffle buffer holds (copied into one small block) and
  those read ahead (views of the last block read).
  """

  def __init__(self, data: tf.data.Dataset, count: int, rows_per_read: int,
               loader: "TensorflowDataLoader"):
    self._data = data
    self._rows_per_read = rows_per_read
    self._loader = loader
    self._buffers = loader._buffers
    self.count = count
    self.restart(0)

  def restart(self, first: int) -> None:
    """Reads again from element ``first``, the start of a pass."""
    self._iterator: Optional[Iterator] = None
    self._blocks: List[Tuple[np.ndarray, Rows]] = []  # numbers, rows
    self._next = first  # the number of the element read next

  def _read(self) -> None:
    if self._iterator is None:
      self._iterator = _in_order(
          self._data.repeat().batch(self._rows_per_read))
    formats = self._loader._leaf_formats
    rows = _leaves(formats, _next(self._iterator, self._loader))
    size = len(rows[0])
    self._blocks.append((np.arange(self._next, self._next + size), rows))
    self._next += size

  def rows(self, wanted: np.ndarray, keep: np.ndarray) -> Rows:
    """The rows of elements ``wanted``; afterwards only the elements
    ``keep`` and those after all ``wanted`` and ``keep`` stay held."""
    keep = np.sort(keep)  # numbers of a block are sorted, for _lookup
    frontier = int(max(wanted.max(), keep[-1] if keep.size else -1)) + 1
    while self._next < frontier:
      self._read()
    formats = self._loader._leaf_formats
    out = [self._buffers.empty((wanted.size,) + fmt.shape, fmt.dtype)
           for fmt in formats]
    held = [np.empty((keep.size,) + fmt.shape, fmt.dtype) for fmt in formats]
    blocks, self._blocks = self._blocks, []
    _gather_from(blocks, wanted, out)
    if keep.size:
      _gather_from(blocks, keep, held)
    for numbers, rows in blocks:
      ahead = np.searchsorted(numbers, frontier)
      if ahead < numbers.size:
        self._blocks.append((numbers[ahead:], [r[ahead:] for r in rows]))
    if keep.size:
      self._blocks.insert(0, (keep, held))
    return out


class _RandomPasses:
  """The batches of a random chain: the chain's observations streamed
  through a shuffle buffer of ``shuffle_cache`` slots, pass after pass
  (:class:`jax_data.sampling.BufferShuffle`), cut into batches. Batch ``j``
  holds stream steps ``j * mb .. j * mb + mb - 1`` and may span two passes.
  """

  kind = "random"

  def __init__(self, source, mb_size: int, cache_size: int,
               shuffle_cache: int, seed: int):
    self._source = source
    self._mb_size = mb_size
    self._size = cache_size * mb_size
    self._shuffle_cache = shuffle_cache
    self._shuffle = BufferShuffle(source.count, shuffle_cache, seed)
    self._all_valid = np.ones((cache_size, mb_size), bool)
    self._all_valid.setflags(write=False)

  @property
  def seed(self) -> int:
    return self._shuffle.seed

  def chunk(self, batch: int) -> Tuple[Rows, np.ndarray]:
    """The rows of batches ``batch .. batch + cache_size - 1``, and their
    mask; a position other than the last chunk's end replays less than a
    pass."""
    step = batch * self._mb_size
    shuffle = self._shuffle
    if shuffle.position != step:
      shuffle.seek(step)
      self._source.restart(step // shuffle.count * shuffle.count)
    wanted = shuffle.take(self._size)
    try:
      rows = self._source.rows(wanted, shuffle.buffered())
    except BaseException:
      shuffle.position = None  # the source's state is unknown
      raise
    return rows, self._all_valid

  def normalize(self, batch: int) -> int:
    return batch

  def fingerprint(self) -> Dict[str, Any]:
    """What a state must share with this stream to be loaded into it."""
    return {"kind": self.kind, "shuffle_cache": self._shuffle_cache}

  def settings(self) -> Dict[str, Any]:
    """What a loaded state brings along: the seed."""
    return {"seed": self.seed}

  def adopt(self, state: Dict[str, Any]) -> None:
    """Takes the settings of ``state``."""
    seed = check_int("seed", state.get("seed"), minimum=0, maximum=_MAX_SEED)
    if seed != self._shuffle.seed:
      self._shuffle.seed, self._shuffle.position = seed, None


class _OrderedPasses:
  """The batches of an ordered chain: padded passes, in order.

  Each pass is the chain's observations in pipeline order, padded up to a
  whole number of batches with its own first observations; the padding is
  masked out (``spec/SAMPLING.md``'s ordered stream). The stream is
  periodic, so a position is a batch of a pass.
  """

  kind = "ordered"

  def __init__(self, source, data: tf.data.Dataset, mb_size: int,
               cache_size: int):
    self._source = source
    self._mb_size = mb_size
    self._cache_size = cache_size
    self._indices = OrderedStream(ObservationRange(0, source.count),
                                  mb_size)
    self.batches_per_pass = self._indices.batches_per_pass
    count = source.count
    padding = self.batches_per_pass * mb_size - count  # < mb_size <= count
    self._pass = data.concatenate(data.take(padding)) if padding else data
    self._iterator: Optional[Iterator] = None
    self._next_batch: Optional[int] = None  # where the iterator stands

  def chunk(self, batch: int) -> Tuple[Rows, np.ndarray]:
    """The rows of batches ``batch .. batch + cache_size - 1`` of the
    padded passes, and their mask."""
    self._indices.set_state({"mode": "ordered", "batch": batch})
    indices, mask = self._indices.draw(self._cache_size)
    if isinstance(self._source, _InMemory):
      return self._source.gather(indices.reshape(-1)), mask
    if self._next_batch != batch:
      size = self._cache_size * self._mb_size
      self._iterator = _in_order(self._pass.repeat().skip(
          batch * self._mb_size).batch(size, drop_remainder=True))
    # Until a draw succeeds the iterator's position is unknown.
    self._next_batch = None
    loader = self._source._loader
    rows = _leaves(loader._leaf_formats, _next(self._iterator, loader))
    self._next_batch = self.normalize(batch + self._cache_size)
    return rows, mask

  def normalize(self, batch: int) -> int:
    return batch % self.batches_per_pass

  def fingerprint(self) -> Dict[str, Any]:
    return {"kind": self.kind}

  def settings(self) -> Dict[str, Any]:
    return {}

  def adopt(self, state: Dict[str, Any]) -> None:
    del state


@dataclasses.dataclass
class _Chain:
  """Host-side bookkeeping of one registered chain."""
  cache_size: int
  mb_size: int
  shard: ObservationRange
  stream: Any  # _RandomPasses or _OrderedPasses: the chain's batches
  position: int  # batches served (within the pass for ordered chains)


class TensorflowDataLoader(HostDataLoader):
  """Host loader over a ``tf.data.Dataset`` of dicts, e.g. from ``tfds.load``.

  Random chains pass over the data again and again, each pass shuffled with
  a buffer of ``shuffle_cache`` observations and its own seed, and cut into
  batches. Ordered chains (for :func:`jax_data.full_reference_data`) pass
  over it in pipeline order, the last batch of a pass padded and masked.
  Integer and float features come out as JAX's default types (int32 and
  float32 unless x64 is enabled); ``uint8`` and ``bool`` stay as they are.

  Streams are reproducible: the same seed gives the same batches, given the
  same pipeline order. The shuffle buffer works as ``tf.data``'s ``shuffle``
  does, but is computed in NumPy (:class:`jax_data.sampling.BufferShuffle`),
  so streams do not depend on TensorFlow's seeds or version. Options of the
  pipeline are kept, except that ``deterministic`` is set.

  By default every pass reads the pipeline again, so data larger than
  memory work and random augmentations in the pipeline stay random. With
  ``in_memory=True`` the loader reads the pipeline once, when it is
  created, keeps the observations as NumPy arrays (in the loader's dtypes)
  and serves chains from them: several times faster, with the same streams,
  but it needs the memory and freezes random augmentations.

  >>> import numpy as np
  >>> import tensorflow as tf
  >>> from jax_data.tensorflow_loader import TensorflowDataLoader
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
    observation_count: Observations in one pass. Needed only when the
      pipeline's cardinality is unknown (e.g. after ``filter``) or infinite;
      then its first ``observation_count`` elements are the data set, and a
      pipeline that turns out shorter is an error when the chunk is drawn.
    in_memory: Read the pipeline once, now, and serve from NumPy arrays.

  Raises:
    TypeError: ``pipeline`` is not a dataset of dicts, or a feature cannot
      become a JAX array (strings, ragged or sparse tensors).
    ValueError: a feature has unknown dimensions, an unknown key in
      ``exclude_keys``, or an unknown or infinite cardinality without
      ``observation_count``.
  """

  _RANDOM_KEYWORDS = ("seed", "shard_index", "shard_count")
  _ORDERED_KEYWORDS = ("shard_index", "shard_count")

  def __init__(self, pipeline: tf.data.Dataset, shuffle_cache: int = 100,
               exclude_keys: Optional[Iterable[str]] = None,
               observation_count: Optional[int] = None,
               in_memory: bool = False):
    if not isinstance(pipeline, tf.data.Dataset):
      raise TypeError(
          "pipeline must be a tf.data.Dataset (e.g. from tfds.load), got "
          f"pipeline={pipeline!r} of type {type(pipeline).__name__}")
    self._shuffle_cache = check_int("shuffle_cache", shuffle_cache,
                                    minimum=1)
    spec = pipeline.element_spec
    if not isinstance(spec, dict):
      raise TypeError(
          "pipeline must yield dicts of features (as tfds.load does), got "
          f"elements of the form {spec}; map them to dicts, e.g. "
          "pipeline.map(lambda x, y: {'x': x, 'y': y})")
    excluded = self._check_exclude_keys(exclude_keys, spec)
    kept = [key for key in spec if key not in excluded]
    if not kept:
      raise ValueError(
          f"exclude_keys={sorted(excluded)!r} drops every feature of the "
          "pipeline; keep at least one")
    self._format = _format({key: spec[key] for key in kept})
    self._count, stated = _count(pipeline, observation_count)
    self._count_stated = stated
    if stated:
      pipeline = pipeline.take(self._count).apply(
          tf.data.experimental.assert_cardinality(self._count))
    if excluded:
      pipeline = pipeline.map(lambda element: {k: element[k] for k in kept})
    self._pipeline = pipeline
    self._leaf_formats, self._treedef = jax.tree_util.tree_flatten(
        self._format)
    self._buffers = BufferPool()
    self._arrays: Optional[Rows] = None
    if check_bool("in_memory", in_memory):
      self._arrays = self._read_all()
    self._chains: ChainList[_Chain] = ChainList(self)

  def _read_all(self) -> Rows:
    """Every observation of one pass, as arrays in the loader's dtypes."""
    arrays = [np.empty((self._count,) + fmt.shape, fmt.dtype)
              for fmt in self._leaf_formats]
    blocks = _in_order(self._pipeline.batch(4096))
    filled = 0
    while filled < self._count:
      rows = _leaves(self._leaf_formats, _next(blocks, self))
      for array, leaf in zip(arrays, rows):
        array[filled:filled + len(leaf)] = leaf
      filled += len(rows[0])
    for array in arrays:  # chunks may be views of them: keep them intact
      array.setflags(write=False)
    return arrays

  @staticmethod
  def _check_exclude_keys(exclude_keys, spec) -> frozenset:
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

  def __repr__(self) -> str:
    keys = ", ".join(self._format)
    memory = ", in memory" if self._arrays is not None else ""
    return (f"{type(self).__name__}({keys}; {self._count} observations, "
            f"shuffle_cache={self._shuffle_cache}{memory})")

  @property
  def static_information(self) -> Dict[str, int]:
    return {"observation_count": self._count}

  @property
  def observation_format(self) -> PyTree:
    return self._format

  # -- chains -------------------------------------------------------------

  def _shard(self, kwargs) -> Tuple[ObservationRange, tf.data.Dataset]:
    shard = ObservationRange.from_arguments(
        self._count, kwargs.get("shard_index"), kwargs.get("shard_count"))
    data = self._pipeline
    if shard.count != self._count:
      data = data.skip(shard.start).take(shard.count)
    return shard, data

  def register_random_pipeline(self, cache_size: int = 1,
                               mb_size: Optional[int] = None,
                               **kwargs: Any) -> int:
    """Registers a chain of shuffled batches.

    Args:
      cache_size: Batches per chunk.
      mb_size: Observations per batch.
      **kwargs: ``seed`` (an integer in ``[0, 2**31)``; default: the chain
        id), and ``shard_index``/``shard_count`` to draw from one contiguous
        shard of the pipeline.

    Returns:
      The chain id.
    """
    check_keywords(f"a random chain of {type(self).__name__}", kwargs,
                   self._RANDOM_KEYWORDS)
    seed = kwargs.get("seed")
    if seed is not None:
      seed = check_int("seed", seed, minimum=0, maximum=_MAX_SEED)
    shard, data = self._shard(kwargs)
    cache_size, mb_size = check_sizes(cache_size, mb_size, shard.count)

    def make_chain(chain_id):
      source = self._source(shard, data, cache_size * mb_size)
      stream = _RandomPasses(source, mb_size, cache_size,
                             self._shuffle_cache,
                             chain_id if seed is None else seed)
      return _Chain(cache_size, mb_size, shard, stream, 0)

    return self._chains.add(make_chain)

  def register_ordered_pipeline(self, cache_size: int = 1,
                                mb_size: Optional[int] = None,
                                **kwargs: Any) -> int:
    """Registers a chain that visits every observation in pipeline order,
    pass after pass; the last batch of a pass is padded with the pass's
    first observations, masked False (as ``spec/SAMPLING.md`` for NumPy).

    Args:
      cache_size: Batches per chunk; a chunk may span two passes.
      mb_size: Observations per batch.
      **kwargs: ``shard_index``/``shard_count`` to pass over one shard.

    Returns:
      The chain id.
    """
    check_keywords(f"an ordered chain of {type(self).__name__}", kwargs,
                   self._ORDERED_KEYWORDS)
    shard, data = self._shard(kwargs)
    cache_size, mb_size = check_sizes(cache_size, mb_size, shard.count)
    stream = _OrderedPasses(
        self._source(shard, data, cache_size * mb_size), data, mb_size,
        cache_size)
    return self._chains.add(
        lambda _: _Chain(cache_size, mb_size, shard, stream, 0))

  def _source(self, shard: ObservationRange, data: tf.data.Dataset,
              rows_per_read: int):
    """Where a chain's rows come from: memory or the pipeline."""
    if self._arrays is None:
      return _Streamed(data, shard.count, rows_per_read, self)
    return _InMemory(self._arrays, shard, self._buffers)

  def _chain(self, chain_id: int) -> _Chain:
    return self._chains.get(chain_id)

  def release_chain(self, chain_id: int) -> None:
    self._chains.release(chain_id)

  # -- serving ------------------------------------------------------------

  def get_batches(self, chain_id: int) -> Tuple[Dict[str, np.ndarray],
                                                np.ndarray]:
    """The chain's next ``cache_size`` batches and their mask.

    Returns:
      A dict of NumPy arrays with leading axes ``(cache_size, mb_size)`` and
      the loader's dtypes, and a bool mask of shape ``(cache_size,
      mb_size)``.
    """
    chain = self._chain(chain_id)
    rows, mask = chain.stream.chunk(chain.position)
    lead = (chain.cache_size, chain.mb_size)
    leaves = [leaf.reshape(lead + leaf.shape[1:]) for leaf in rows]
    chain.position = chain.stream.normalize(chain.position + chain.cache_size)
    return jax.tree_util.tree_unflatten(self._treedef, leaves), mask

  # -- checkpoints --------------------------------------------------------

  def _fingerprint(self, chain: _Chain) -> Dict[str, Any]:
    return {"version": _STATE_VERSION, **chain.stream.fingerprint(),
            "cache_size": chain.cache_size, "mb_size": chain.mb_size,
            "observation_count": self._count,
            "shard": [chain.shard.start, chain.shard.count]}

  def save_state(self, chain_id: int) -> Dict[str, Any]:
    """The chain's position: a small dict of Python ints and strings."""
    chain = self._chain(chain_id)
    return {**self._fingerprint(chain), **chain.stream.settings(),
            "position": chain.position}

  def load_state(self, chain_id: int, data: Dict[str, Any]) -> None:
    """Moves the chain to a position from :meth:`save_state`.

    The stream is rebuilt at the next chunk, unless the chain is at that
    position already. ``data`` is not changed.

    Raises:
      ValueError: the state belongs to a chain of another kind, sizes, data
        set or shuffle settings; the message names what differs.
    """
    chain = self._chain(chain_id)
    check_saved_state(data, self._fingerprint(chain),
                      f"chain {chain_id} of {self!r}")
    position = chain.stream.normalize(
        check_int("position", data.get("position"), minimum=0))
    chain.stream.adopt(data)
    chain.position = position

  def chain_fingerprint(self, chain_id: int) -> Dict[str, Any]:
    chain = self._chain(chain_id)
    return {"loader": type(self).__name__, **self._fingerprint(chain),
            **chain.stream.settings()}
