"""Reading rows of arrays on disk into chunk buffers.

Pure NumPy (``ctypes`` for ``mincore``). What :class:`NumpyDataLoader`
reads with ``copy=False``:

* :class:`MappedRows` reads rows of a ``numpy.memmap`` (or of an HDF5
  dataset stored contiguously, mapped the same way by :func:`map_hdf5`).
  When the rows' pages are in the page cache it gathers as from memory (a
  run of rows is a view, no copy); when they are not (a gather was as slow
  as a disk, and ``mincore`` says a sample of the next chunk's pages is not
  cached), it reads them in file order from several threads, so that the
  disk has many reads in flight. The kernel is told that random rows are
  read at random (no readahead of neighbouring pages) and that a run of
  rows is needed whole.
* :func:`read_sliced_rows` reads other arrays on disk (chunked or
  compressed HDF5 datasets, zarr) a run of consecutive rows at a time.
* :func:`file_bytes_needed` and :func:`mapped_file_size` tell whether a
  memmap's file was truncated, which would kill the process on read.

File pages are page cache: the kernel's memory, shared, and reclaimed
under pressure. They stay mapped after a read (they count in the process's
RSS as ``RssFile``, not in the memory it allocates, ``RssAnon``), because
dropping them after each read makes every later read fault them in again
(9x slower). ``MappedRows(drop_pages=True)`` drops them all the same.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import threading
import time
import weakref
from typing import Any
from typing import Optional
from typing import Sequence

import numpy as np

from jax_data.loaders.gather import Gatherer
from jax_data.loaders.gather import is_run
from jax_data.loaders.gather import same_bytes

# Reads in flight when rows are not in the page cache. A disk serves random
# reads faster the more it has queued (measured here with os.pread of 128-byte
# rows: 20k reads/s from one thread, 47k from 4, 93k from 16, 103k from 32);
# the threads wait on the disk, not on the cores.
IO_THREADS = 16

# A gather from the page cache takes about 20 ns a row plus the bytes at
# several GB/s; a read from disk at least tens of µs a row. A gather slower
# than this many seconds a row plus bytes at this rate was read from disk.
_SLOW_ROW_SECONDS = 5e-6
_SLOW_BYTES_PER_SECOND = 1e9

# With ``drop_pages``, random rows are read this many at a time and their
# pages dropped after each group: a page fault can map a whole large folio of
# the page cache (up to MiBs) around each row, so a chunk of thousands of
# random rows read at once would map most of a large file for a moment.
ROWS_PER_DROP = 128

# Rows whose pages are checked (about 1 µs each) once rows were read from
# disk: if all are in the page cache, the chunk is gathered as from memory.
_PROBES = 8

_PAGE = mmap.PAGESIZE


def _libc_mincore():
  """``mincore(2)``, or None where there is none (not Linux/BSD)."""
  try:
    function = ctypes.CDLL(None, use_errno=True).mincore
  except (OSError, AttributeError, TypeError):  # TypeError: Windows
    return None
  function.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.POINTER(ctypes.c_ubyte)]
  function.restype = ctypes.c_int
  return function


_MINCORE = _libc_mincore()


def pages_resident(addresses: Sequence[int]) -> bool:
  """Whether the pages at these addresses (of a mapping) are all in the
  page cache; True where that cannot be told."""
  if _MINCORE is None:
    return True
  flag = ctypes.c_ubyte()
  pointer = ctypes.byref(flag)
  for address in addresses:
    if _MINCORE(address - address % _PAGE, _PAGE, pointer) != 0:
      return True  # not a mapping mincore knows: assume resident
    if not flag.value & 1:
      return False
  return True


def _advise(array: np.ndarray, advice_name: str, start: int = 0,
            length: Optional[int] = None) -> None:
  """``madvise`` over the bytes ``[start, start + length)`` of a memmap's
  data (the whole mapping by default), where the platform has it."""
  mapped = getattr(array, "_mmap", None)
  advice = getattr(mmap, advice_name, None)
  if mapped is None or advice is None or len(mapped) == 0:
    return
  base = np.frombuffer(mapped, np.uint8).ctypes.data
  if length is None:
    low, high = 0, len(mapped)
  else:
    low = array.ctypes.data - base + start
    high = min(len(mapped), low + length)
    low -= low % _PAGE
  try:
    mapped.madvise(advice, low, high - low)
  except (OSError, ValueError):  # not supported here: advice only
    pass


def drop_pages(array: np.memmap) -> None:
  """Unmaps the pages a memmap read touched from this process.

  They stay in the kernel's page cache, but no longer count in the
  process's resident memory. Not for copy-on-write memmaps: their pages
  hold the user's edits.
  """
  if getattr(array, "mode", None) != "c":
    _advise(array, "MADV_DONTNEED")


class MappedRows:
  """Reads rows of one memmap into buffers.

  Args:
    array: The memmap (or a view of one), rows along its first axis.
    gatherer: Gathers and copies of rows in the page cache.
    drop_pages: Unmap the pages read, a few rows at a time (see the module
      docstring): RSS stays low, but every read faults its pages in again
      (several times slower).
    io_threads: Reads in flight when rows are not in the page cache.
  """

  def __init__(self, array: np.ndarray, gatherer: Gatherer,
               drop_pages: bool = False, io_threads: int = IO_THREADS):
    self._array = array
    self._gatherer = gatherer
    self._drop = drop_pages and getattr(array, "mode", None) != "c"
    self._io_threads = max(1, io_threads)
    self._address = array.ctypes.data  # of row 0
    # Whether the last gather read from disk: then the next chunk's pages
    # are checked, and read in file order if they are not cached. Until a
    # gather has shown otherwise, rows may be on disk.
    self._from_disk = True
    self._stride = array.strides[0] if array.ndim else 0
    self._lock = threading.Lock()
    self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
    # Random rows: no readahead of the pages around each one (a read of
    # a 128-byte row would otherwise bring in up to 128 KiB).
    _advise(array, "MADV_RANDOM")

  def read(self, flat: np.ndarray, out: np.ndarray,
           run: Optional[bool] = None) -> np.ndarray:
    """Rows ``flat``, cast to ``out``'s dtype: a read-only view of the
    mapping for a run of rows in that dtype (as for arrays in memory: no
    copy), else written into ``out`` (returned).

    A view is read later: whoever reads it must first check that the file
    was not truncated (a read past the end of a file kills the process).
    ``run``: whether ``flat`` is a run
    (:func:`~jax_data.loaders.gather.is_run`), if the caller knows.
    """
    if run is None:
      run = bool(flat.size) and is_run(flat)
    if run:
      first = int(flat[0])
      rows = self._array[first:first + flat.size]
      if rows.strides[0] > 0 and not pages_resident(
          [self._address + first * self._stride,
           self._address + (first + flat.size - 1) * self._stride]):
        # Not cached: ask for all the run's pages at once.
        _advise(self._array, "MADV_WILLNEED", first * rows.strides[0],
                flat.size * rows.strides[0])
      if out.dtype == rows.dtype and not self._drop:
        view = rows.view(np.ndarray)
        view.flags.writeable = False
        return view
      if out.dtype == rows.dtype:
        self._gatherer.copy(out, rows)
      else:
        np.copyto(out, rows, casting="unsafe")
    elif self._drop:
      order = np.argsort(flat, kind="stable")
      for start in range(0, flat.size, ROWS_PER_DROP):
        part = order[start:start + ROWS_PER_DROP]
        out[part] = self._array[flat[part]]
        drop_pages(self._array)
    elif self._from_disk and not self._in_page_cache(flat):
      self.read_in_file_order(flat, out)
    else:
      start = time.perf_counter()
      self._gatherer.take(self._array, flat, out)
      self._from_disk = time.perf_counter() - start > (
          flat.size * _SLOW_ROW_SECONDS + out.nbytes / _SLOW_BYTES_PER_SECOND)
    if self._drop:
      drop_pages(self._array)
    return out

  def reads_page_cache(self) -> bool:
    """Whether reads come from the page cache, as fast as from memory:
    the last gather of random rows took no longer than one in memory
    would, and pages are not dropped after each read."""
    return not (self._drop or self._from_disk)

  def _in_page_cache(self, flat: np.ndarray) -> bool:
    """Whether a sample of the rows is in the page cache."""
    step = max(1, flat.size // _PROBES)
    return pages_resident([self._address + row * self._stride
                           for row in flat[::step].tolist()])

  def read_in_file_order(self, flat: np.ndarray, out: np.ndarray
                         ) -> np.ndarray:
    """Rows ``flat`` written into ``out`` (returned), read in file order in
    parts from several threads: how rows not in the page cache are read."""
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    gathered = np.empty((flat.size,) + self._array.shape[1:],
                        self._array.dtype)
    bounds = np.linspace(0, flat.size, min(self._io_threads, flat.size) + 1
                         ).astype(int)

    def read_part(low: int, high: int) -> None:
      np.take(self._array, ordered[low:high], axis=0,
              out=gathered[low:high], mode="clip")

    pool = self._io_pool()
    parts = []
    for low, high in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
      if high > low:
        try:
          parts.append(pool.submit(read_part, low, high))
        except RuntimeError:  # the interpreter exits: no new threads' work
          read_part(low, high)
    for part in parts:
      part.result()
    if out.dtype == gathered.dtype:
      out[order] = gathered
    else:
      out[order] = gathered.astype(out.dtype)
    return out

  def _io_pool(self) -> concurrent.futures.ThreadPoolExecutor:
    with self._lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self._io_threads, thread_name_prefix="jax_data-read")
        weakref.finalize(self, self._pool.shutdown, wait=False)
      return self._pool

  def close(self, wait: bool = True) -> None:
    """Ends the reading threads, if they were started (a later use starts
    them again); with ``wait``, waits for them."""
    with self._lock:
      pool, self._pool = self._pool, None
    if pool is not None:
      pool.shutdown(wait=wait)


def map_hdf5(dataset: Any) -> Optional[np.memmap]:
  """An HDF5 dataset as a read-only memmap of its file, or None.

  A dataset stored contiguously and without filters (h5py's default for a
  dataset written whole) is a plain array at an offset of its file; mapped,
  its rows are read like a memmap's instead of through h5py (one call per
  run of rows). Chunked, compressed, in-memory or not yet written datasets
  give None. The mapping is checked against h5py's own reads of a few rows.
  """
  try:
    if (dataset.chunks is not None or dataset.compression is not None
        or dataset.file.driver not in ("sec2", "stdio")
        or dataset.dtype.kind not in "biufc" or dataset.size == 0
        or len(dataset.shape) == 0):  # a scalar: refused by the caller
      return None
    offset = dataset.id.get_offset()
    if offset is None:
      return None
    mapped = np.memmap(dataset.file.filename, dtype=dataset.dtype, mode="r",
                       offset=offset, shape=dataset.shape)
  except (AttributeError, OSError, TypeError, ValueError):
    return None
  count = dataset.shape[0]
  for row in sorted({0, count // 2, count - 1}):
    # Byte for byte: a dataset with a NaN in these rows was read through
    # h5py.
    if not same_bytes(mapped[row], dataset[row]):
      return None
  return mapped


#: Why the reads of an h5py dataset whose file was closed fail (h5py says
#: "identifier is not of specified type"), and what to do.
CLOSED_HDF5 = ("its HDF5 file was closed: keep the h5py.File open while the "
               "loader reads (a with block that ends before the run closes "
               "it), and close it after release_fn")


def closed_hdf5(array: Any) -> bool:
  """Whether ``array`` is an h5py dataset whose file was closed."""
  ident = getattr(array, "id", None)
  return (type(array).__module__.split(".")[0] == "h5py"
          and ident is not None and not getattr(ident, "valid", True))


def read_sliced_rows(array: Any, flat: np.ndarray, out: np.ndarray
                     ) -> np.ndarray:
  """Rows ``flat`` of an array read by slicing (an h5py dataset) written
  into ``out``: in file order, each run of consecutive rows one slice.

  h5py reads a list of indices far more slowly than the same rows one
  slice at a time (640 ms against 30 ms for 6,400 random rows of a float32
  (1e6, 32) dataset, measured here).
  """
  if closed_hdf5(array):
    raise OSError(f"an h5py dataset the loader reads: {CLOSED_HDF5}")
  order = np.argsort(flat, kind="stable")
  ordered = flat[order]
  starts = np.flatnonzero(np.diff(ordered) > 1) + 1
  for run in np.split(np.arange(flat.size), starts):
    low, high = int(ordered[run[0]]), int(ordered[run[-1]]) + 1
    block = np.asarray(array[low:high])
    out[order[run]] = block[ordered[run] - low]
  return out


def file_bytes_needed(array: np.memmap) -> Optional[int]:
  """The size a memmap's file must have for every byte the array (or view
  of a memmap: a slice, a strided or reversed view) touches; None if it is
  not mapped from a file.

  Reading past the end of a mapped file kills the process with SIGBUS, so
  this is checked before each read, against the size of the mapped file
  itself (not its path, which may have been unlinked or replaced).
  """
  mapped = getattr(array, "_mmap", None)
  if mapped is None or array.size == 0:
    return None
  base = np.frombuffer(mapped, np.uint8).ctypes.data  # where the map starts
  start = array.ctypes.data
  high = start + array.itemsize + sum(
      max(0, stride * (dim - 1)) for stride, dim in
      zip(array.strides, array.shape))
  # numpy maps from the allocation boundary at or before the offset.
  first = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY
  return first + (high - base)


def mapped_file_size(array: np.memmap) -> int:
  """The current size of the file a memmap maps (``fstat`` of the
  mapping's own descriptor)."""
  return array._mmap.size()  # pylint: disable=protected-access


def check_mapped_file(array: np.memmap, needed: int, what: str) -> None:
  """Raises ``OSError`` if the file of memmap ``array`` (``what``, for
  the message) is now shorter than the ``needed`` bytes
  (:func:`file_bytes_needed`): a read would kill the process with SIGBUS
  instead."""
  size = mapped_file_size(array)
  if size < needed:
    raise OSError(
        f"the file of {what} ({array.filename}) was truncated to {size} "
        f"bytes; the memmap needs {needed}")
