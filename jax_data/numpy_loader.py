"""Loaders over NumPy arrays: on the host (:class:`NumpyDataLoader`) or on
the device (:class:`DeviceNumpyDataLoader`)."""

from __future__ import annotations

import concurrent.futures
import copy as copy_module
import dataclasses
import mmap
import os
import sys
import threading
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

from jax_data import sampling
from jax_data.loader import ChainList
from jax_data.loader import DeviceDataLoader
from jax_data.loader import HostDataLoader
from jax_data.types import MiniBatchInformation
from jax_data.types import PyTree
from jax_data.validation import check_bool
from jax_data.validation import check_int
from jax_data.validation import check_keywords
from jax_data.validation import check_saved_state
from jax_data.validation import check_sizes

_STATE_VERSION = 1


def _as_host_array(name: str, value: Any, copy: bool) -> np.ndarray:
  """One keyword argument as a NumPy array, checked and with JAX's dtype."""
  if isinstance(value, np.memmap) and not copy:
    array = value  # stays on disk; rows are read per chunk
  elif isinstance(value, jax.Array):
    array = np.asarray(value)
  else:
    try:
      array = np.array(value) if copy else np.asarray(value)
    except (TypeError, ValueError) as e:
      raise TypeError(
          f"array {name!r} cannot become an array: {type(e).__name__}: {e}"
      ) from e
  if array.dtype.kind not in "biufc":
    raise TypeError(
        f"array {name!r} has dtype {array.dtype}, which cannot become a JAX "
        "array; pass numeric or boolean arrays only")
  if array.ndim == 0:
    raise ValueError(
        f"array {name!r} must have a first axis of observations, got a "
        f"scalar {name}={value!r}")
  target = jax.dtypes.canonicalize_dtype(array.dtype)
  if copy and array.dtype != target:
    array = array.astype(target)
  return array


def _prepare(loader: str, copy: Any, arrays: Dict[str, Any]
             ) -> Tuple[Dict[str, np.ndarray], int]:
  check_bool("copy", copy)
  if not arrays:
    raise ValueError(
        f"{loader} needs at least one array as a keyword argument, e.g. "
        f"{loader}(x=x, y=y); got none")
  prepared = {k: _as_host_array(k, v, copy) for k, v in arrays.items()}
  lengths = {k: v.shape[0] for k, v in prepared.items()}
  if len(set(lengths.values())) > 1:
    raise ValueError(
        "all arrays must have the same length along their first axis, got "
        + ", ".join(f"{k}: {n}" for k, n in lengths.items()))
  count = next(iter(lengths.values()))
  if count == 0:
    raise ValueError(
        f"{loader} got empty arrays (observation count 0): "
        + ", ".join(f"{k}.shape={v.shape}" for k, v in prepared.items()))
  return prepared, count


# Random rows of a memmap are read this many at a time, and their pages
# dropped after each group: a page fault can map a whole large folio of the
# page cache (up to MiBs) around each row, so a chunk of thousands of random
# rows read at once would map most of a large file for a moment.
_ROWS_PER_READ = 128


def _read_rows(array: np.memmap, flat: np.ndarray) -> np.ndarray:
  """Rows ``flat`` of a memmap, read in file order in small groups."""
  order = np.argsort(flat, kind="stable")
  rows = np.empty((flat.size,) + array.shape[1:], array.dtype)
  for start in range(0, flat.size, _ROWS_PER_READ):
    part = order[start:start + _ROWS_PER_READ]
    rows[part] = array[flat[part]]
    _drop_pages(array)
  return rows


def is_run(flat: np.ndarray) -> bool:
  """Whether the indices are consecutive (rows a slice can read)."""
  return (int(flat[-1]) - int(flat[0]) == flat.size - 1
          and bool((np.diff(flat) == 1).all()))


class BufferPool:
  """Chunk buffers used again once nothing else references them.

  Gathering a large chunk into fresh memory costs a page fault per page;
  a recycled buffer does not. A buffer is free when only the pool holds it
  (the chunk store dropped the chunk and XLA copied it), which
  ``sys.getrefcount`` tells exactly. Large gathers run in two threads
  (NumPy's ``take`` releases the GIL).
  """

  _PER_FORMAT = 4
  _SPLIT_BYTES = 4 << 20

  def __init__(self):
    self._free: Dict[Tuple[Tuple[int, ...], np.dtype], List[np.ndarray]] = {}
    self._lock = threading.Lock()
    self._helper: Optional[concurrent.futures.ThreadPoolExecutor] = None

  def take(self, array: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """``np.take(array, flat, axis=0)`` into a recycled buffer."""
    shape = (flat.size,) + array.shape[1:]
    out = self.empty(shape, array.dtype)
    # Indices come from the streams, always in range: no bounds checks.
    if out.nbytes < self._SPLIT_BYTES:
      return np.take(array, flat, axis=0, out=out, mode="clip")
    with self._lock:
      if self._helper is None:
        self._helper = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="jax_data-gather")
      helper = self._helper
    half = flat.size // 2
    other = helper.submit(np.take, array, flat[half:], 0, out[half:], "clip")
    np.take(array, flat[:half], axis=0, out=out[:half], mode="clip")
    other.result()
    return out

  def empty(self, shape, dtype) -> np.ndarray:
    """An array of that shape and dtype, recycled if one is free."""
    with self._lock:
      pool = self._free.setdefault((shape, np.dtype(dtype)), [])
      for buffer in pool:
        # References: the pool's list, this loop variable, the argument.
        if sys.getrefcount(buffer) <= 3:
          return buffer
      buffer = np.empty(shape, dtype)
      if len(pool) < self._PER_FORMAT:
        pool.append(buffer)
      return buffer


def _drop_pages(array: np.memmap) -> None:
  """Unmaps the pages a memmap read touched from this process.

  They stay in the kernel's page cache, but no longer count in the
  process's resident memory, so out-of-core data does not fill it up.
  """
  if getattr(array, "mode", None) == "c":
    return  # copy-on-write: dropping pages would discard the user's edits
  mapped = getattr(array, "_mmap", None)
  advice = getattr(mmap, "MADV_DONTNEED", None)
  if mapped is not None and advice is not None:
    try:
      mapped.madvise(advice)
    except (OSError, ValueError):  # not supported here: pages stay mapped
      pass


def _all_valid(cache_size: int, mb_size: int) -> np.ndarray:
  """A read-only all-True mask of one chunk."""
  mask = np.ones((cache_size, mb_size), bool)
  mask.setflags(write=False)
  return mask


def _observation_format(arrays: Dict[str, np.ndarray]) -> Dict[str, Any]:
  return {k: jax.ShapeDtypeStruct(v.shape[1:],
                                  jax.dtypes.canonicalize_dtype(v.dtype))
          for k, v in arrays.items()}


@dataclasses.dataclass
class _Chain:
  """Host-side bookkeeping of one registered chain."""
  kind: str  # "random" or "ordered"
  cache_size: int
  mb_size: int
  stream: Union[sampling.RandomStream, sampling.OrderedStream]
  settings: Dict[str, Any]
  all_valid: np.ndarray  # shape=(cache_size, mb_size), bool, read-only


class _ArrayData:
  """What both NumPy loaders know of their arrays."""

  _arrays: Dict[str, Any]
  _count: int
  _format: Dict[str, jax.ShapeDtypeStruct]

  def __repr__(self) -> str:
    keys = ", ".join(self._arrays)
    return f"{type(self).__name__}({keys}; {self._count} observations)"

  @property
  def static_information(self) -> Dict[str, int]:
    return {"observation_count": self._count}

  @property
  def observation_format(self) -> PyTree:
    return self._format


class NumpyDataLoader(_ArrayData, HostDataLoader):
  """Host loader over arrays with equal first axes.

  Each keyword becomes a key of the batch dict. Arrays may be lists, NumPy
  or JAX arrays, or ``numpy.memmap`` files; with ``copy=False`` a memmap is
  not read into memory: each chunk reads only its rows.

  >>> import numpy as np
  >>> from jax_data import NumpyDataLoader
  >>> loader = NumpyDataLoader(x=np.arange(10), y=np.zeros((10, 4, 3)))
  >>> zero = loader.initializer_batch(4)
  >>> {k: (v.shape, str(v.dtype)) for k, v in zero.items()}
  {'x': ((4,), 'int32'), 'y': ((4, 4, 3), 'float32')}

  Args:
    copy: Copy the arrays (default). With False, arrays are referenced and
      memmaps stay on disk.
    **reference_data: The arrays, one per keyword.

  Raises:
    ValueError: no arrays, empty arrays, or first axes of different lengths.
    TypeError: an array that cannot become a JAX array (strings, objects).
  """

  _RANDOM_KEYWORDS = ("seed", "shuffle", "in_epochs", "shard_index",
                      "shard_count")
  _ORDERED_KEYWORDS = ("shard_index", "shard_count")

  def __init__(self, copy: bool = True, **reference_data: Any):
    self._arrays, self._count = _prepare(type(self).__name__, copy,
                                         reference_data)
    self._format = _observation_format(self._arrays)
    self._chains: ChainList[_Chain] = ChainList(self)
    self._buffers = BufferPool()

  def _observations(self, shard_index, shard_count
                    ) -> sampling.ObservationRange:
    return sampling.ObservationRange.from_arguments(self._count, shard_index,
                                                    shard_count)

  def register_random_pipeline(self, cache_size: int = 1,
                               mb_size: Optional[int] = None,
                               **kwargs: Any) -> int:
    """Registers a random chain (SAMPLING.md).

    Args:
      cache_size: Batches per chunk.
      mb_size: Observations per batch.
      **kwargs: ``seed`` (default: the chain id), ``shuffle``, ``in_epochs``,
        and ``shard_index``/``shard_count`` to draw from one contiguous shard.

    Returns:
      The chain id.
    """
    check_keywords("a random chain of NumpyDataLoader", kwargs,
                   self._RANDOM_KEYWORDS)
    return self._chains.add(
        lambda chain_id: self._random_chain(chain_id, cache_size, mb_size,
                                            kwargs))

  def _random_chain(self, chain_id, cache_size, mb_size, kwargs) -> _Chain:
    seed = kwargs.get("seed")
    seed = chain_id if seed is None else check_int("seed", seed, minimum=0)
    shuffle = check_bool("shuffle", kwargs.get("shuffle", False))
    in_epochs = check_bool("in_epochs", kwargs.get("in_epochs", False))
    if in_epochs and not shuffle:
      raise ValueError(
          "in_epochs=True needs shuffle=True, got shuffle=False")
    observations = self._observations(kwargs.get("shard_index"),
                                      kwargs.get("shard_count"))
    cache_size, mb_size = check_sizes(cache_size, mb_size, observations.count)
    stream = sampling.RandomStream(observations, mb_size, seed, shuffle,
                                   in_epochs)
    settings = {"seed": seed, "shuffle": shuffle, "in_epochs": in_epochs,
                "shard": [observations.start, observations.count]}
    return _Chain("random", cache_size, mb_size, stream, settings,
                  _all_valid(cache_size, mb_size))

  def register_ordered_pipeline(self, cache_size: int = 1,
                                mb_size: Optional[int] = None,
                                **kwargs: Any) -> int:
    """Registers a chain that visits every observation in order, pass after
    pass; the last batch of a pass is padded and masked (SAMPLING.md).

    Args:
      cache_size: Batches per chunk.
      mb_size: Observations per batch.
      **kwargs: ``shard_index``/``shard_count`` to pass over one shard.

    Returns:
      The chain id.
    """
    check_keywords("an ordered chain of NumpyDataLoader", kwargs,
                   self._ORDERED_KEYWORDS)
    observations = self._observations(kwargs.get("shard_index"),
                                      kwargs.get("shard_count"))
    cache_size, mb_size = check_sizes(cache_size, mb_size, observations.count)
    stream = sampling.OrderedStream(observations, mb_size)
    settings = {"shard": [observations.start, observations.count]}
    return self._chains.add(lambda _: _Chain(
        "ordered", cache_size, mb_size, stream, settings,
        _all_valid(cache_size, mb_size)))

  def _chain(self, chain_id: int) -> _Chain:
    return self._chains.get(chain_id)

  def get_batches(self, chain_id: int) -> Tuple[Dict[str, np.ndarray],
                                                np.ndarray]:
    chain = self._chain(chain_id)
    indices, mask = chain.stream.draw(chain.cache_size)
    return self._gather(indices), (chain.all_valid if mask is None else mask)

  def _check_files(self) -> None:
    """Raises if a memmap's file shrank: reading past its end would kill
    the process with SIGBUS instead of raising."""
    for key, array in self._arrays.items():
      if not isinstance(array, np.memmap) or array.filename is None:
        continue
      needed = array.offset + array.nbytes
      size = os.stat(array.filename).st_size
      if size < needed:
        raise OSError(
            f"the file of array {key!r} ({array.filename}) was truncated to "
            f"{size} bytes; the memmap needs {needed}")

  def _gather(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
    self._check_files()
    flat = indices.reshape(-1)
    # Ordered chains read runs of consecutive rows: a slice, not a gather.
    first = int(flat[0])
    contiguous = is_run(flat)
    batches = {}
    for key, array in self._arrays.items():
      if contiguous:
        rows = array[first:first + flat.size]
        if isinstance(array, np.memmap):
          rows = np.array(rows)  # read now, before the pages are dropped
      elif isinstance(array, np.memmap):
        rows = _read_rows(array, flat)
      else:
        rows = self._buffers.take(array, flat)
      if isinstance(array, np.memmap):
        _drop_pages(array)
      rows = rows.reshape(indices.shape + array.shape[1:])
      target = self._format[key].dtype
      batches[key] = rows if rows.dtype == target else rows.astype(target)
    return batches

  def save_state(self, chain_id: int) -> Dict[str, Any]:
    chain = self._chain(chain_id)
    return {"version": _STATE_VERSION, "kind": chain.kind,
            "cache_size": chain.cache_size, "mb_size": chain.mb_size,
            "observation_count": self._count,
            "stream": chain.stream.get_state()}

  def load_state(self, chain_id: int, data: Dict[str, Any]) -> None:
    chain = self._chain(chain_id)
    expected = {"version": _STATE_VERSION, "kind": chain.kind,
                "cache_size": chain.cache_size, "mb_size": chain.mb_size,
                "observation_count": self._count}
    check_saved_state(data, expected, f"chain {chain_id} of {self!r}")
    chain.stream.set_state(copy_module.deepcopy(data["stream"]))

  def release_chain(self, chain_id: int) -> None:
    self._chains.release(chain_id)

  def chain_fingerprint(self, chain_id: int) -> Dict[str, Any]:
    chain = self._chain(chain_id)
    return {"loader": type(self).__name__,
            "observation_count": self._count, "kind": chain.kind,
            "cache_size": chain.cache_size, "mb_size": chain.mb_size,
            **chain.settings}


class DeviceNumpyDataLoader(_ArrayData, DeviceDataLoader):
  """The same arrays as :class:`NumpyDataLoader`, kept on the device.

  Random batches are independent draws with ``jax.random`` (keyword ``key``
  of ``init_fn``); no host calls are made.

  Args:
    copy: Copy the arrays before moving them to the device.
    **reference_data: The arrays, one per keyword.
  """

  def __init__(self, copy: bool = True, **reference_data: Any):
    arrays, self._count = _prepare(type(self).__name__, copy, reference_data)
    self._format = _observation_format(arrays)
    self._arrays = {k: jnp.asarray(v, dtype=self._format[k].dtype)
                    for k, v in arrays.items()}

  def init_random_data(self, **kwargs: Any) -> jax.Array:
    """A chain's PRNG key: keyword ``key`` (default ``PRNGKey(0)``)."""
    check_keywords("a random chain of DeviceNumpyDataLoader", kwargs,
                   ("key",))
    key = kwargs.get("key")
    if key is None:
      return jax.random.PRNGKey(0)
    if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
      key = jax.random.key_data(key)
    key = jnp.asarray(key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
      raise TypeError(
          f"key must be a PRNG key (jax.random.PRNGKey or jax.random.key), "
          f"got key with shape {key.shape} and dtype {key.dtype}")
    return key

  def get_random_data(self, state: jax.Array, batch_size: int):
    key, split = jax.random.split(state)
    indices = jax.random.randint(split, (batch_size,), 0, self._count)
    batch = jax.tree_util.tree_map(lambda a: jnp.take(a, indices, axis=0),
                                   self._arrays)
    info = MiniBatchInformation(observation_count=self._count,
                                mask=jnp.ones(batch_size, jnp.bool_),
                                batch_size=batch_size)
    return key, (batch, info)

  def get_full_data(self) -> Dict[str, jax.Array]:
    return self._arrays

