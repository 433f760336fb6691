"""Reading rows by index into chunk buffers: what several host loaders share.

Pure NumPy. A chunk is ``cache_size * mb_size`` rows picked by index from
arrays (:mod:`jax_data.loaders.file_rows` reads those on disk):

* :func:`is_run` tells when the rows are consecutive, so a slice reads them;
* :class:`Gatherer` copies rows of an in-memory array, or a whole chunk,
  into a buffer, split over the cores when the chunk is large (NumPy's
  ``take`` and ``copyto`` release the GIL);
* :func:`digest_rows` digests a fixed sample of rows, so that checkpoints
  are not restored into other data.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import itertools
import os
import sys
import threading
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np


def is_run(flat: np.ndarray) -> bool:
  """Whether the indices are consecutive (rows a slice can read)."""
  return (int(flat[-1]) - int(flat[0]) == flat.size - 1
          and bool((np.diff(flat) == 1).all()))


def usable_cores() -> int:
  """The cores this process may run on."""
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def _read(folder: str, name: str) -> str:
  with open(os.path.join(folder, name)) as f:
    return f.read().strip()


def _cache_bytes(size: str) -> int:
  """Bytes of a sysfs cache size: ``"1024K"``, ``"2M"``, ``"512"``."""
  size = size.strip().upper()
  scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
  return int(size[:-1] if scale > 1 else size) * scale


@functools.lru_cache(maxsize=None)  # read once: a call per init_fn
def usable_cache_bytes(level: int = 3, root: str = "/sys/devices/system/cpu"
                       ) -> Optional[int]:
  """The bytes of data cache of ``level`` that the cores this process may
  run on hold together, each cache counted once (a cache shared by several
  cores as one), as Linux describes them under ``root``; None where they
  cannot be read (another system, a container without sysfs) or there is
  none of that level. Read once per ``level`` and ``root``.

  >>> usable_cache_bytes(3, "/no/such/directory") is None
  True
  """
  try:
    cores = sorted(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return None
  caches: Dict[str, int] = {}
  try:
    for core in cores:
      folder = os.path.join(root, f"cpu{core}", "cache")
      for entry in sorted(os.listdir(folder)):
        if not entry.startswith("index"):
          continue
        cache = os.path.join(folder, entry)
        if (_read(cache, "level") != str(level)
            or _read(cache, "type") == "Instruction"):
          continue
        try:
          shared = _read(cache, "shared_cpu_list")
        except OSError:
          shared = str(core)
        caches[shared] = _cache_bytes(_read(cache, "size"))
  except (OSError, ValueError):
    return None
  return sum(caches.values()) or None


# Parts per thread of a split gather or copy: the threads take them in
# turn, so one that gets a core late does fewer.
_PARTS_PER_THREAD = 3
# Cores from which a loader draws indices in more threads, and beside its
# reads (Gatherer.draw_threads, Gatherer.draws_early).
_MANY_CORES = 8


class Gatherer:
  """Copies rows of in-memory arrays into buffers.

  A large gather or copy is split into parts of at least ``part_bytes``,
  a few per thread, which the caller's thread and up to ``threads - 1``
  helper threads (started on first use, ended by :meth:`close`) take in
  turn: a helper that gets a core late, on a busy machine, takes fewer
  parts, or none, and is not waited for. Below ``part_bytes`` a part costs
  more to hand to another thread than it saves (a 1.3 MB copy took 1.24x
  as long in two threads as in one, measured on 2 cores; a 13 MB copy
  0.62x).

  Args:
    threads: Threads per gather; default: the usable cores, at most 8.
    part_bytes: The least bytes a thread copies.
  """

  def __init__(self, threads: Optional[int] = None,
               part_bytes: int = 2 << 20):
    self._many_cores = usable_cores() >= _MANY_CORES
    self._threads = (min(8, usable_cores()) if threads is None
                     else max(1, threads))
    self._part_bytes = part_bytes
    self._lock = threading.Lock()
    self._helper: Optional[concurrent.futures.ThreadPoolExecutor] = None

  def _parts(self, size: int, most: int, threads: int) -> int:
    """How many parts work of ``size`` units splits into, at most ``most``
    (units of at least the least part): 1 for no split."""
    return 1 if threads < 2 else min(threads * _PARTS_PER_THREAD, most,
                                     size)

  def _bounds(self, out: np.ndarray) -> Optional[np.ndarray]:
    """Where ``out``'s rows split into parts, or None for one part."""
    if out.ndim == 0:
      return None
    parts = self._parts(out.shape[0], out.nbytes // self._part_bytes,
                        self._threads)
    if parts < 2:
      return None
    return np.linspace(0, out.shape[0], parts + 1).astype(int)

  def _split(self, work: Callable[[int, int], Any], bounds: np.ndarray,
             threads: Optional[int] = None) -> None:
    """``work(low, high)`` for every part between ``bounds``, in the
    caller's thread and up to ``threads - 1`` helpers. Each thread takes
    the next part not taken yet; a helper that has not started when the
    caller runs out of parts is cancelled, not waited for."""
    parts = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    taken = itertools.count()  # next() is atomic in CPython

    def run() -> None:
      for i in taken:
        if i >= len(parts):
          return
        work(*parts[i])

    pool = self._helper_pool()
    helpers = []
    for _ in range(min(self._threads if threads is None else threads,
                       len(parts)) - 1):
      try:
        helpers.append(pool.submit(run))
      except RuntimeError:  # the interpreter exits: no new threads' work
        break  # the caller takes the parts
    try:
      run()
    finally:
      for helper in helpers:
        if not helper.cancel():
          helper.result()

  def split(self, work: Callable[[int, int], Any], size: int,
            least: int) -> None:
    """``work(low, high)`` on parts of ``0 .. size`` of at least ``least``
    each, in the caller's thread and at most :attr:`draw_threads` - 1
    helper threads: work of many NumPy calls of tens of microseconds (the
    hash of many chains' counter streams). Each call releases the GIL, but
    the Python between calls holds it, so more threads wait for it more
    than they gain: the draw of 1,024 chains took 41, 28, 35, 42 and 51 ms
    in 1, 2, 4, 8 and 16 threads on 16 cores (9.1, 8.7, 11, 15 and 19 ms
    for 256 chains on 2 cores), in blocks of 65,536 indices. Split, a
    draw takes blocks four times as large (``counter_chains``), so each
    call does more per hold of the GIL: 256 chains took 16, 13, 9.9, 12
    and 13 ms then on an H100 machine's 16 cores."""
    threads = min(self._threads, self.draw_threads)
    parts = self._parts(size, size // max(1, least), threads)
    if parts < 2:
      work(0, size)
      return
    self._split(work, np.linspace(0, size, parts + 1).astype(int), threads)

  @property
  def draw_threads(self) -> int:
    """The threads :meth:`split` uses: 4 on 8 cores or more, else 2."""
    return 4 if self._many_cores else 2

  @property
  def draws_early(self) -> bool:
    """Whether a group's next indices are drawn beside its read of this
    chunk's rows, split over threads
    (:class:`~jax_data.loaders.indexed.IndexedCursor`): on 8 cores or
    more, where the read leaves cores idle. On 2 cores that draw runs
    after the read in one thread: beside the read it only took the read's
    second thread, and split it took compiled code's."""
    return self._many_cores

  def submit(self, work: Callable[[], Any]
             ) -> Optional[concurrent.futures.Future]:
    """Runs ``work()`` in a helper thread, where the parts of later splits
    wait for it (work to overlap with what the caller does next);
    None, and nothing runs, with one thread or while the interpreter
    shuts down (a pool ended by :meth:`close` is started again)."""
    if self._threads < 2:
      return None
    try:
      return self._helper_pool().submit(work)
    except RuntimeError:  # the interpreter shuts down
      return None

  def take(self, array: np.ndarray, flat: np.ndarray,
           out: np.ndarray) -> np.ndarray:
    """``np.take(array, flat, axis=0)`` written into ``out`` (returned).

    ``out`` has ``flat.size`` rows; its dtype may differ from the array's,
    then rows are converted as ``astype`` would.
    """
    self.take_all([(array, out)], flat)
    return out

  def take_all(self, pairs: Sequence[Tuple[np.ndarray, np.ndarray]],
               flat: np.ndarray) -> None:
    """:meth:`take` of rows ``flat`` of every ``(array, out)`` pair, split
    over threads by rows: each part takes its rows of every array, so a
    small leaf (a label per row) is split with the large one, and the
    threads are handed work once for all leaves. At 16 chains of case (g)
    the labels' 0.4 MB took 0.19 ms after the features' 13 MB took 1.06
    ms, one leaf after the other."""
    same = []
    for array, out in pairs:
      if out.dtype == array.dtype:
        same.append((array, out))
      else:
        np.copyto(out, np.take(array, flat, axis=0), casting="unsafe")
    if not same:
      return
    # Indices come from the streams, always in range: no bounds checks.
    parts = self._parts(flat.size, sum(out.nbytes for _, out in same)
                        // self._part_bytes, self._threads)
    if parts < 2:
      for array, out in same:
        np.take(array, flat, axis=0, out=out, mode="clip")
      return

    def work(low: int, high: int) -> None:
      for array, out in same:
        np.take(array, flat[low:high], axis=0, out=out[low:high],
                mode="clip")

    self._split(work, np.linspace(0, flat.size, parts + 1).astype(int))

  def copy(self, out: np.ndarray, source: np.ndarray) -> None:
    """``np.copyto(out, source)``, split over threads when ``out`` is large
    (a copy from memory that is not in a core's cache runs at about 1.6
    times the bytes/s in two threads than in one)."""
    self.copy_all([(out, source)])

  def copy_all(self, pairs: Sequence[Tuple[np.ndarray, np.ndarray]]
               ) -> None:
    """``np.copyto(out, source)`` for every pair, split over threads by
    bytes: a large pair in parts of its rows (:meth:`_bounds`), small ones
    together (the chunks of many lanes, each too small to split alone: 16
    lanes of 840 KiB took 1.7 ms in one thread)."""
    pieces = []
    for out, source in pairs:
      bounds = self._bounds(out) if np.shape(source) == out.shape else None
      if bounds is None:
        pieces.append((out, source))
      else:
        pieces += [(out[a:b], source[a:b])
                   for a, b in zip(bounds[:-1], bounds[1:])]

    def work(low: int, high: int) -> None:
      for out, source in pieces[low:high]:
        np.copyto(out, source)

    parts = 1  # one small copy: no NumPy calls to plan it
    if len(pieces) > 1:
      sizes = np.cumsum([out.nbytes for out, _ in pieces])
      total = int(sizes[-1])
      parts = self._parts(len(pieces), total // self._part_bytes,
                          self._threads)
    if parts < 2:
      work(0, len(pieces))
      return
    # Each part ends at the piece where its share of the bytes is reached.
    shares = np.linspace(0, total, parts + 1)[1:-1]
    ends = np.searchsorted(sizes, shares) + 1
    self._split(work, np.concatenate([[0], ends, [len(pieces)]]))

  def _helper_pool(self) -> concurrent.futures.ThreadPoolExecutor:
    with self._lock:
      if self._helper is None:
        self._helper = concurrent.futures.ThreadPoolExecutor(
            self._threads - 1, thread_name_prefix="jax_data-gather")
      return self._helper

  def close(self, wait: bool = True) -> None:
    """Ends the helper threads, if they were started (a later use starts
    them again); with ``wait``, waits for them."""
    with self._lock:
      helper, self._helper = self._helper, None
    if helper is not None:
      helper.shutdown(wait=wait)


class BufferPool:
  """Chunk buffers used again once nothing else references them.

  Gathering a large chunk into fresh memory costs a page fault per page;
  a recycled buffer does not. A buffer is free when only the pool holds it
  (the chunk store dropped the chunk and XLA copied it), which
  ``sys.getrefcount`` tells exactly. Buffers are looked at round robin
  from the one after the last given out, at most 64 at a time: they come
  free in about the order they were given out, so a pool of thousands
  costs no more than a small one.

  It keeps six buffers of each format (shape and dtype) of the last
  eight formats used; :meth:`reserve` raises that, for a chunk's formats,
  to what many vmapped chains have in use at once, and keeps them.
  Chunks allocated fresh and freed, thousands a refresh, from threads
  with arenas of their own, left 1,024 chains 160 MiB of fragmented heap
  beyond what they used. The chunks of chains served as they come ready
  have a row count for each group size: a pool that kept every format
  held 759 MiB of them after 16 calls of 1,024 memmap chains.

  Args:
    pin: Called once on each buffer the pool keeps, before its first use
      (:func:`jax_data.loaders.pinning.pin`: page-locked memory for the
      runtime's copies to a GPU); default: none.
  """

  _PER_FORMAT = 6
  # Formats not reserved whose buffers are kept, the most recently used.
  _FORMATS = 8
  # Buffers looked at for a free one before a new one is made: more than
  # a few held for long (a cache's chunks kept) hide, and few enough that a
  # pool where all are in use costs little to grow.
  _LOOK = 64

  def __init__(self, pin: Optional[Callable[[np.ndarray], Any]] = None):
    self._free: Dict[Tuple[Tuple[int, ...], np.dtype], List[np.ndarray]] = {}
    self._at: Dict[Tuple[Tuple[int, ...], np.dtype], int] = {}
    self._capacity: Dict[Tuple[Tuple[int, ...], np.dtype], int] = {}
    # Formats not reserved, least recently used first (values unused).
    self._recent: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self._pin = pin

  def reserve(self, buffers: int, formats: Sequence[Tuple[Any, Any]]
              ) -> None:
    """Keeps up to ``buffers`` of each of ``formats`` (shape, dtype pairs:
    those of one chunk) from now on; other formats keep six."""
    with self._lock:
      for shape, dtype in formats:
        key = (tuple(shape), np.dtype(dtype))
        self._capacity[key] = max(self._capacity.get(key, 0), buffers)
        self._recent.pop(key, None)

  def empty(self, shape, dtype) -> np.ndarray:
    """An array of that shape and dtype, recycled if one is free."""
    key = (tuple(shape), np.dtype(dtype))
    with self._lock:
      if key not in self._capacity:
        self._recent[key] = None
        self._recent.move_to_end(key)
        if len(self._recent) > self._FORMATS:
          oldest, _ = self._recent.popitem(last=False)
          self._free.pop(oldest, None)
          self._at.pop(oldest, None)
      pool = self._free.setdefault(key, [])
      at = self._at.get(key, 0)
      looked = min(len(pool), self._LOOK)
      for i in range(looked):
        j = (at + i) % len(pool)
        buffer = pool[j]
        # References: the pool's list, this variable, the argument.
        if sys.getrefcount(buffer) <= 3:
          self._at[key] = j + 1
          return buffer
      buffer = np.empty(shape, dtype)
      if len(pool) < self._capacity.get(key, self._PER_FORMAT):
        pool.append(buffer)
        if self._pin is not None:
          self._pin(buffer)
      # The next call looks at the buffers after these (a few held long
      # at the front must not make every call a new buffer).
      self._at[key] = (at + looked) % len(pool) if pool else 0
      return buffer


#: The sample :func:`digest_rows` reads (see :func:`sample_rows`).
DIGEST_VERSION = 2
#: Rows in a digest's sample: every row of data of this many or fewer.
SAMPLED_ROWS = 32


def sample_rows(count: int, version: int = DIGEST_VERSION) -> np.ndarray:
  """The rows :func:`digest_rows` reads of ``count``, sorted: every row up
  to :data:`SAMPLED_ROWS`, else that many distinct rows, half evenly spaced
  and half drawn with a seed fixed by the count. Version 1 (jax_data's
  checkpoints before 2026-12-01) took 16 evenly spaced and 16 drawn rows
  that could coincide: 17-32 distinct ones, and rows 1, 3, 7, ... of 32
  never counted."""
  rng = np.random.default_rng(count)
  evenly = np.linspace(0, count - 1, min(count, 16)).astype(np.int64)
  if version == 1:
    return np.unique(np.concatenate([evenly,
                                     rng.integers(0, count, min(count, 16))]))
  if count <= SAMPLED_ROWS:
    return np.arange(count, dtype=np.int64)
  rows = set(evenly.tolist())
  while len(rows) < SAMPLED_ROWS:
    rows.update(rng.integers(0, count, SAMPLED_ROWS - len(rows)).tolist())
  return np.array(sorted(rows), np.int64)


def same_bytes(a: Any, b: Any) -> bool:
  """Whether two arrays hold the same dtype, shape and bytes: NaN (a
  missing value) equal to itself in every dtype, where ``array_equal``
  takes it for a value that differs (bfloat16's kind is "V", and
  ``equal_nan`` does not apply to it)."""
  a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and (
      a.tobytes() == b.tobytes())


def digest_rows(count: int, read_row: Callable[[int], Sequence[Any]],
                dtypes: Sequence[np.dtype], version: int = DIGEST_VERSION
                ) -> str:
  """A digest of the row count and of a fixed sample of rows
  (:func:`sample_rows` of ``version``): O(1) in the number of rows, so
  memmaps and sources are not read whole.

  ``read_row(i)`` returns the leaves of row ``i``; each is taken in the
  loader's dtype (``dtypes``), so the same data gives the same digest
  however it is held.
  """
  digest = hashlib.sha256(f"rows={count}".encode())
  for row in sample_rows(count, version):
    for leaf, dtype in zip(read_row(int(row)), dtypes):
      value = np.ascontiguousarray(leaf, dtype=dtype)
      # ml_dtypes' types are "<V1" or "<V2" in .str (int4 and float8 alike):
      # their names tell them apart.
      kind = value.dtype.name if value.dtype.kind == "V" else value.dtype.str
      digest.update(f"{kind}{value.shape}".encode())
      digest.update(value.tobytes())
  return digest.hexdigest()[:32]
