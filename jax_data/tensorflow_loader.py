"""Host loader over ``tf.data`` pipelines: :class:`TensorflowDataLoader`.

Importing this module imports TensorFlow (``import jax_data`` alone does
not). Before that import it sets, unless the user has set them already,
``TF_CPP_MIN_LOG_LEVEL=2`` and ``TF_ENABLE_ONEDNN_OPTS=0``, which keep
TensorFlow's C++ start-up messages off the console (oneDNN speeds up
TensorFlow's matrix kernels, which a data pipeline rarely runs). It also
hides the GPUs from TensorFlow, whose memory belongs to JAX.

Every chunk is built by ``tf.data`` itself: the chain's element stream is
cut into ``cache_size * mb_size`` observations by one ``batch``, and each
feature of a chunk becomes a NumPy array without a copy. The host bridge
asks for the next chunk from a background thread while the device works.
A chain's position is the number of batches it has served, so a state is a
few integers; restoring one rebuilds the stream and skips less than one pass
over the data.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any
from typing import Dict
from typing import Iterable
from typing import Iterator
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
from jax_data.sampling import ObservationRange
from jax_data.types import PyTree
from jax_data.validation import check_int
from jax_data.validation import check_keywords
from jax_data.validation import check_saved_state
from jax_data.validation import check_sizes

_STATE_VERSION = 1
# A random chain's pass ``p`` is shuffled with the op seed
# ``seed * _PASS_SEEDS + p``: distinct for seeds below 2**31.
_PASS_SEEDS = 2**32
_MAX_SEED = 2**31 - 1


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


def _tf_global_seed() -> int:
  """TensorFlow's global seed (or its default): half of every shuffle seed."""
  return int(tf.compat.v1.random.get_seed(0)[0])


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


class _RandomPasses:
  """The element stream of a random chain.

  Pass ``p`` (``p = 0, 1, ...``) is the chain's observations shuffled with a
  buffer of ``shuffle_cache`` elements and the seed ``(seed, p)``; the
  passes follow one another. Batch ``j`` holds stream elements
  ``j * mb .. j * mb + mb - 1`` and may span two passes.
  """

  kind = "random"

  def __init__(self, data: tf.data.Dataset, count: int, mb_size: int,
               cache_size: int, shuffle_cache: int, seed: int):
    self._data = data
    self._count = count
    self._mb_size = mb_size
    self._shuffle_cache = shuffle_cache
    self.seed = seed
    self.tf_global_seed = _tf_global_seed()
    self._all_valid = np.ones((cache_size, mb_size), bool)
    self._all_valid.setflags(write=False)

  def elements(self, batch: int) -> tf.data.Dataset:
    """The stream from batch ``batch`` on; skips less than one pass."""
    if _tf_global_seed() != self.tf_global_seed:
      raise RuntimeError(
          "TensorFlow's global seed changed from "
          f"{self.tf_global_seed} to {_tf_global_seed()} (tf.random.set_seed) "
          "after this chain was registered, so its stream cannot be rebuilt; "
          "set the global seed before creating chains")
    first_pass, offset = divmod(batch * self._mb_size, self._count)
    base_seed = tf.constant(self.seed * _PASS_SEEDS, tf.int64)
    data, shuffle_cache = self._data, self._shuffle_cache

    def one_pass(index):
      return data.shuffle(shuffle_cache, seed=base_seed + index,
                          reshuffle_each_iteration=False)

    return tf.data.Dataset.counter(first_pass).flat_map(one_pass).skip(offset)

  def normalize(self, batch: int) -> int:
    return batch

  def mask(self, batch: int) -> np.ndarray:
    del batch
    return self._all_valid

  def fingerprint(self) -> Dict[str, Any]:
    """What a state must share with this stream to be loaded into it."""
    return {"kind": self.kind, "shuffle_cache": self._shuffle_cache,
            "tf_global_seed": self.tf_global_seed}

  def settings(self) -> Dict[str, Any]:
    """What a loaded state brings along: the seed."""
    return {"seed": self.seed}

  def adopt(self, state: Dict[str, Any]) -> bool:
    """Takes the settings of ``state``; whether anything changed."""
    seed = check_int("seed", state.get("seed"), minimum=0, maximum=_MAX_SEED)
    changed, self.seed = seed != self.seed, seed
    return changed


class _OrderedPasses:
  """The element stream of an ordered chain: padded passes, in order.

  Each pass is the chain's observations in pipeline order, padded up to a
  whole number of batches with its own first observations; the padding is
  masked out. The stream is periodic, so a position is a batch of a pass.
  """

  kind = "ordered"

  def __init__(self, data: tf.data.Dataset, count: int, mb_size: int,
               cache_size: int):
    self._mb_size = mb_size
    self._cache_size = cache_size
    self.batches_per_pass = math.ceil(count / mb_size)
    padding = self.batches_per_pass * mb_size - count  # < mb_size <= count
    self._pass = data.concatenate(data.take(padding)) if padding else data
    positions = np.arange(self.batches_per_pass * mb_size)
    self._pass_mask = (positions < count).reshape(self.batches_per_pass,
                                                  mb_size)

  def elements(self, batch: int) -> tf.data.Dataset:
    return self._pass.repeat().skip(batch * self._mb_size)

  def normalize(self, batch: int) -> int:
    return batch % self.batches_per_pass

  def mask(self, batch: int) -> np.ndarray:
    rows = (batch + np.arange(self._cache_size)) % self.batches_per_pass
    return self._pass_mask[rows]

  def fingerprint(self) -> Dict[str, Any]:
    return {"kind": self.kind}

  def settings(self) -> Dict[str, Any]:
    return {}

  def adopt(self, state: Dict[str, Any]) -> bool:
    del state
    return False


@dataclasses.dataclass
class _Chain:
  """Host-side bookkeeping of one registered chain."""
  cache_size: int
  mb_size: int
  shard: ObservationRange
  stream: Any  # _RandomPasses or _OrderedPasses: the chain's elements
  position: int  # batches served (within the pass for ordered chains)
  iterator: Optional[Iterator] = None  # None: rebuilt at the next chunk


class TensorflowDataLoader(HostDataLoader):
  """Host loader over a ``tf.data.Dataset`` of dicts, e.g. from ``tfds.load``.

  Random chains pass over the data again and again, each pass shuffled with
  a buffer of ``shuffle_cache`` observations and its own seed, and cut into
  batches. Ordered chains (for :func:`jax_data.full_reference_data`) pass
  over it in pipeline order, the last batch of a pass padded and masked.
  Integer and float features come out as JAX's default types (int32 and
  float32 unless x64 is enabled); ``uint8`` and ``bool`` stay as they are.

  Streams are reproducible: the same seed gives the same batches, given the
  same pipeline order and TensorFlow global seed (``tf.random.set_seed``).
  Options of the pipeline are kept, except that ``deterministic`` is set.

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
               observation_count: Optional[int] = None):
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
    self._chains: ChainList[_Chain] = ChainList(self)

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
    return (f"{type(self).__name__}({keys}; {self._count} observations, "
            f"shuffle_cache={self._shuffle_cache})")

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
      stream = _RandomPasses(data, shard.count, mb_size, cache_size,
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
    stream = _OrderedPasses(data, shard.count, mb_size, cache_size)
    return self._chains.add(
        lambda _: _Chain(cache_size, mb_size, shard, stream, 0))

  def _chain(self, chain_id: int) -> _Chain:
    return self._chains.get(chain_id)

  def release_chain(self, chain_id: int) -> None:
    self._chains.release(chain_id)

  # -- serving ------------------------------------------------------------

  def _chunks(self, chain: _Chain) -> Iterator:
    size = chain.cache_size * chain.mb_size
    options = tf.data.Options()
    options.deterministic = True
    # No prefetch: the host bridge already asks for the next chunk from a
    # background thread while the device works, and a tf.data prefetch
    # thread on top of it only adds a hand-off per chunk (measured slower).
    # A sequential batch: a parallel one is faster alone, but inside a
    # pipeline its threads compete with the device for the cores (measured
    # 2x slower).
    chunks = chain.stream.elements(chain.position).batch(
        size, drop_remainder=True)
    return iter(chunks.with_options(options))

  def get_batches(self, chain_id: int) -> Tuple[Dict[str, np.ndarray],
                                                np.ndarray]:
    """The chain's next ``cache_size`` batches and their mask.

    Returns:
      A dict of NumPy arrays with leading axes ``(cache_size, mb_size)`` and
      the loader's dtypes, and a bool mask of shape ``(cache_size,
      mb_size)``.
    """
    chain = self._chain(chain_id)
    # Until a draw succeeds the iterator's position is unknown: a failed
    # draw leaves the chain without one, to be rebuilt at its position.
    iterator, chain.iterator = chain.iterator or self._chunks(chain), None
    try:
      chunk = next(iterator)
    except StopIteration:
      raise RuntimeError(
          f"the pipeline of {self!r} ended although chains repeat it; does "
          "it yield fewer elements on later passes?") from None
    except tf.errors.FailedPreconditionError as e:
      if not self._count_stated:
        raise
      raise ValueError(
          f"observation_count={self._count} does not fit the pipeline: "
          f"{e.message}") from e
    chain.iterator = iterator
    lead = (chain.cache_size, chain.mb_size)

    def to_numpy(fmt, tensor):
      array = np.asarray(tensor)  # a read-only view: no copy, unlike .numpy()
      array = array.reshape(lead + array.shape[1:])
      return array if array.dtype == fmt.dtype else array.astype(fmt.dtype)

    batches = jax.tree_util.tree_map(to_numpy, self._format, chunk)
    mask = chain.stream.mask(chain.position)
    chain.position = chain.stream.normalize(chain.position + chain.cache_size)
    return batches, mask

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
    if chain.stream.adopt(data) or position != chain.position:
      chain.position, chain.iterator = position, None

  def chain_fingerprint(self, chain_id: int) -> Dict[str, Any]:
    chain = self._chain(chain_id)
    return {"loader": type(self).__name__, **self._fingerprint(chain),
            **chain.stream.settings()}
