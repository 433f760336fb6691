"""The host loader over NumPy arrays and memmaps: :class:`NumpyDataLoader`.

Its chains are the index streams of ``spec/SAMPLING.md``; a chunk is a
gather of rows (a slice for runs of consecutive rows).
"""

from __future__ import annotations

import threading
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import jax
import numpy as np

from jax_data.loaders.chains import ChainCursor
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.file_rows import MappedRows
from jax_data.loaders.file_rows import check_mapped_file
from jax_data.loaders.file_rows import file_bytes_needed
from jax_data.loaders.file_rows import map_hdf5
from jax_data.loaders.file_rows import read_sliced_rows
from jax_data.loaders.gather import DIGEST_VERSION
from jax_data.loaders.gather import Gatherer
from jax_data.loaders.gather import digest_rows
from jax_data.loaders.gather import is_run
from jax_data.loaders.host_loader import HostDataLoader
from jax_data.loaders.indexed import IndexedCursor
from jax_data.loaders.narrowing import cannot_hold
from jax_data.loaders.narrowing import first_outside
from jax_data.loaders.narrowing import narrows
from jax_data.types import PyTree
from jax_data.validation import check_bool
from jax_data.validation import is_jax_dtype
from jax_data.validation import native_dtype


def is_lazy_array(value: Any) -> bool:
  """Whether ``value`` is an array on disk read by slicing, as an h5py or
  zarr dataset: it has ``shape``, a NumPy ``dtype`` and ``__getitem__``
  but is not a NumPy or JAX array (a TensorFlow or PyTorch tensor, whose
  dtype is its framework's, is converted with ``np.asarray``)."""
  return (not isinstance(value, (np.ndarray, jax.Array))
          and isinstance(getattr(value, "dtype", None), np.dtype)
          and all(hasattr(value, a) for a in ("shape", "__getitem__")))


def _as_host_array(name: str, value: Any, copy: bool) -> np.ndarray:
  """One keyword argument as a NumPy array, checked and with JAX's dtype;
  with ``copy=False`` memmaps and lazy arrays (h5py) stay on disk."""
  if hasattr(value, "keys") and not hasattr(value, "shape"):
    raise TypeError(
        f"array {name!r} is a {type(value).__name__} of arrays, not an "
        f"array; pass its arrays as keywords (**{{k: {name}[k] for k in "
        f"{name}}}), got {name}={value!r}")
  if isinstance(value, np.memmap):
    # Reading past the end of a truncated file kills the process with
    # SIGBUS; copied now or read later, the file must hold every row.
    needed = file_bytes_needed(value)
    if needed is not None:
      check_mapped_file(value, needed, f"array {name!r}")
  if isinstance(value, np.memmap) and not copy:
    array = value  # stays on disk; rows are read per chunk
  elif is_lazy_array(value) and not copy:
    # An HDF5 dataset stored contiguously is mapped like a memmap; others
    # are read by slices per chunk.
    mapped = map_hdf5(value)
    array = value if mapped is None else mapped
  elif isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"array {name!r} must be concrete, got a traced array (inside "
        "jax.jit, vmap or scan): make the loader outside, of the arrays "
        "themselves")
  elif isinstance(value, jax.Array):
    array = np.asarray(value)
  else:
    try:
      array = np.array(value) if copy else np.asarray(value)
    except (TypeError, ValueError) as e:
      raise TypeError(
          f"array {name!r} cannot become an array: {type(e).__name__}: {e}"
      ) from e
  if not is_jax_dtype(array.dtype):
    raise TypeError(
        f"array {name!r} has dtype {array.dtype}, which cannot become a JAX "
        "array; pass numeric or boolean arrays only (ml_dtypes' bfloat16, "
        "float8 and int4 too)")
  if array.ndim == 0:
    raise ValueError(
        f"array {name!r} must have a first axis of observations, got a "
        f"scalar {name}={value!r}")
  target = jax.dtypes.canonicalize_dtype(native_dtype(array.dtype))
  if copy and array.dtype != target:
    check_narrowed(name, array, target)
    array = array.astype(target)
  elif array.dtype != target and type(array) is np.ndarray:
    check_narrowed(name, array, target)  # in memory: checked once, now
  return array


# Rows of an array checked for integers too wide per block: a memmap or an
# HDF5 dataset checked whole is read block by block, not into one copy.
_CHECKED_BYTES = 64 << 20


def check_narrowed(name: str, array: Any, target: np.dtype) -> None:
  """Raises if integers of ``array`` (in memory, a memmap or an HDF5
  dataset) do not fit ``target`` (int64 served as int32 without
  ``jax_enable_x64``), naming the range and the first row outside it:
  NumPy's cast wraps them, and 2**40 became 0 without a word."""
  if not (array.dtype.kind in "iu" and target.kind in "iu"
          and np.prod(array.shape)):
    return
  bounds = np.iinfo(target)
  row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:]))
  rows = max(1, _CHECKED_BYTES // max(row_bytes, 1))
  low = high = first = None
  for start in range(0, array.shape[0], rows):
    block = np.asarray(array[start:start + rows])
    if not block.size:
      continue
    block_low, block_high = block.min(), block.max()
    if first is None and (block_low < bounds.min or block_high > bounds.max):
      at, value = first_outside(block, target)
      first = (start + at, value)
    low = block_low if low is None else min(low, block_low)
    high = block_high if high is None else max(high, block_high)
  if first is not None:
    raise ValueError(
        f"array {name!r} holds integers from {low} to {high} (the first "
        f"outside at row {first[0]}: {first[1]}), which JAX's {target} "
        "(64-bit types are 32-bit without jax_enable_x64) cannot hold: "
        "enable jax_enable_x64 before making the loader "
        "(jax.config.update('jax_enable_x64', True)), or pass values that "
        f"{target} holds")


def prepare_arrays(loader: str, copy: Any, arrays: Dict[str, Any]
             ) -> Tuple[Dict[str, np.ndarray], int]:
  if hasattr(copy, "keys") and not hasattr(copy, "shape"):
    # NumpyDataLoader(data): the dict of arrays took the place of copy.
    raise TypeError(
        f"{loader} takes its arrays as keyword arguments; pass a dict of "
        f"arrays as {loader}(**data), got a {type(copy).__name__} with keys "
        f"{list(copy)} as its first positional argument, which is copy")
  if not isinstance(copy, (bool, np.bool_)) and np.ndim(copy) > 0:
    # NumpyDataLoader(x): the array took the place of copy.
    raise TypeError(
        f"{loader} takes its arrays as keyword arguments, e.g. "
        f"{loader}(x=x, y=y); got an array of shape {np.shape(copy)} as its "
        "first positional argument, which is copy")
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


def observation_format_of(arrays: Dict[str, np.ndarray]) -> Dict[str, Any]:
  return {k: jax.ShapeDtypeStruct(
      v.shape[1:], jax.dtypes.canonicalize_dtype(native_dtype(v.dtype)))
          for k, v in arrays.items()}


class ArrayData:
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


class NumpyDataLoader(ArrayData, HostDataLoader):
  """Host loader over arrays with equal first axes.

  Each keyword becomes a key of the batch dict. Arrays may be lists, NumPy
  or JAX arrays, ``numpy.memmap`` files, or datasets of an HDF5 file
  (``h5py``) or other arrays read by slicing; with ``copy=False`` a memmap
  or dataset is not read into memory: each chunk reads only its rows.

  Rows on disk are read at the speed of memory when the file's pages are in
  the kernel's page cache, and with many reads in flight when they are not.
  Pages read stay mapped (they are the kernel's page cache, reclaimed under
  memory pressure, and count in RSS as ``RssFile``, not in the memory the
  process allocates); ``drop_file_pages=True`` unmaps them as it reads.
  An HDF5 dataset stored contiguously and unfiltered (h5py's default) is
  mapped like a memmap; a chunked or compressed one is read a run of
  consecutive rows at a time.

  >>> import numpy as np
  >>> from jax_data import NumpyDataLoader
  >>> loader = NumpyDataLoader(x=np.arange(10), y=np.zeros((10, 4, 3)))
  >>> zero = loader.initializer_batch(4)
  >>> {k: (v.shape, str(v.dtype)) for k, v in zero.items()}
  {'x': ((4,), 'int32'), 'y': ((4, 4, 3), 'float32')}

  Random chains take ``seed``, ``shuffle``, ``in_epochs``
  (``spec/SAMPLING.md``) and ``stream`` (``"auto"``, ``"exact"``,
  ``"counter"``: see the user guide), and every chain
  ``shard_index``/``shard_count``.

  Args:
    copy: Copy the arrays (default). With False, arrays are referenced and
      memmaps stay on disk. Either way leaves are served in the dtypes JAX
      keeps (64-bit ones as 32-bit without ``jax_enable_x64``); integers
      such a dtype cannot hold are refused (below), those of a memmap by
      the read that meets them (a ``ValueError`` naming the array, row and
      value), as it is not read whole up front.
    drop_file_pages: Unmap the pages of memmaps (and mapped HDF5 datasets)
      as they are read (a few rows at a time), so they do not count in the
      process's RSS (on Linux; elsewhere the kernel may keep them). Every
      read then faults its pages in again: several times slower.
    **reference_data: The arrays, one per keyword.

  Raises:
    ValueError: no arrays, empty arrays, first axes of different lengths,
      or integers of an array in memory that JAX's dtype for it cannot hold
      (2**40 in int64 without ``jax_enable_x64``).
    TypeError: an array that cannot become a JAX array (strings, objects).
  """

  random_keywords = HostDataLoader.random_keywords + ("stream",)
  reads_by_index = True

  def __init__(self, copy: bool = True, drop_file_pages: bool = False,
               **reference_data: Any):
    check_bool("drop_file_pages", drop_file_pages)
    self._arrays, self._count = prepare_arrays(type(self).__name__, copy,
                                         reference_data)
    self._format = observation_format_of(self._arrays)
    # Arrays in the order of the format's leaves (sorted keys).
    self._names = jax.tree_util.tree_leaves({k: k for k in self._arrays})
    self._leaves = [self._arrays[k] for k in self._names]
    self._gatherer = Gatherer()
    self._mapped = [MappedRows(leaf, self._gatherer, drop_file_pages)
                    if isinstance(leaf, np.memmap) else None
                    for leaf in self._leaves]
    self._cursors = 0  # open; the last to close ends the threads
    self._cursors_lock = threading.Lock()
    self._digest: Optional[str] = None
    self._file_bytes = {k: needed for k, v in self._arrays.items()
                        if isinstance(v, np.memmap)
                        and (needed := file_bytes_needed(v)) is not None}
    self._check_files()

  def open_chain(self, spec: ChainSpec, layout: ChunkLayout) -> ChainCursor:
    """A cursor over the chain's rows (``spec/SAMPLING.md``); the loader's
    gather and reading threads run while any cursor is open."""
    with self._cursors_lock:
      self._cursors += 1
    return IndexedCursor(spec, layout, self._read, self._check_files,
                         split=self._gatherer.split,
                         ahead=self._gatherer.submit,
                         early=self._gatherer.draws_early,
                         in_memory=self._reads_memory,
                         closed=self._cursor_closed)

  def _reads_memory(self) -> bool:
    """Whether every leaf's rows are now read as fast as from memory:
    arrays in memory, memmaps whose reads come from the page cache."""
    return all(type(leaf) is np.ndarray if mapped is None
               else mapped.reads_page_cache()
               for leaf, mapped in zip(self._leaves, self._mapped))

  def _cursor_closed(self) -> None:
    """A cursor closed; the last one ends the idle threads (a loader kept
    for later pipelines keeps none; they start again when needed)."""
    with self._cursors_lock:
      self._cursors -= 1
      if self._cursors:
        return
    self._gatherer.close(wait=False)
    for mapped in self._mapped:
      if mapped is not None:
        mapped.close(wait=False)

  def content_digest(self) -> str:
    if self._digest is None:
      self._digest = self._digest_of(DIGEST_VERSION)
    return self._digest

  def earlier_digests(self) -> Tuple[str, ...]:
    return (self._digest_of(1),)

  def _digest_of(self, version: int) -> str:
    self._check_files()
    dtypes = [leaf.dtype for leaf in self.chunk_layout(1, 1).leaves]
    return digest_rows(
        self._count, lambda row: [leaf[row] for leaf in self._leaves],
        dtypes, version)

  def _check_files(self) -> None:
    """Raises if a memmap's file is now shorter than the bytes the array
    touches: reading past its end would kill the process with SIGBUS
    instead of raising."""
    for key, needed in self._file_bytes.items():
      check_mapped_file(self._arrays[key], needed, f"array {key!r}")

  def _read(self, flat: np.ndarray, out: List[np.ndarray]
            ) -> List[np.ndarray]:
    """Rows ``flat`` of every array: views for runs of rows (as ordered
    chains read them) in memory or in a memmap, else written into ``out``.
    """
    self._check_files()
    run = is_run(flat)
    first = int(flat[0])
    leaves = []
    taken = []  # gathered together, in one split over the threads
    narrowed = []  # leaves read in their own dtype, checked, then cast
    for k, (array, mapped, buffer) in enumerate(zip(self._leaves,
                                                    self._mapped, out)):
      if narrows(array.dtype, buffer.dtype):  # not copied (copy=False)
        narrowed.append((k, buffer))
        buffer = np.empty(buffer.shape, array.dtype)
      if mapped is not None:
        leaves.append(mapped.read(flat, buffer, run))
      elif not isinstance(array, np.ndarray):
        leaves.append(read_sliced_rows(array, flat, buffer))
      elif run and array.dtype == buffer.dtype:
        leaves.append(array[first:first + flat.size])
      else:
        taken.append((array, buffer))
        leaves.append(buffer)
    if taken:
      self._gatherer.take_all(taken, flat)
    for k, buffer in narrowed:
      found = first_outside(leaves[k], buffer.dtype)
      if found is not None:
        raise ValueError(
            f"array {self._names[k]!r} holds at row {int(flat[found[0]])} "
            f"the integer {cannot_hold(found[1], buffer.dtype)}")
      np.copyto(buffer, leaves[k], casting="unsafe")
      leaves[k] = buffer
    return leaves
