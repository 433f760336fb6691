"""Host loader over random-access sources: :class:`SourceDataLoader`.

A random-access source has ``len(source)`` and ``source[i]``: Grain's
protocol, met by Grain data sources and ``MapDataset``, ArrayRecord files,
``tfds.data_source``, Hugging Face ``datasets.Dataset`` and PyTorch-style
map datasets. Its chains are the NumPy loader's index streams
(``spec/SAMPLING.md``), so a source gives exactly the batches a
``NumpyDataLoader`` over the stacked records gives; a chunk's records are
read, transformed and checked by a pool of worker threads.
"""

from __future__ import annotations

import collections.abc
import concurrent.futures
import functools
import threading
import time
import warnings
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import jax
import numpy as np

from jax_data.errors import PipelineReleasedError
from jax_data.lifetime import give_back_heap
from jax_data.loaders.chains import ChainCursor
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.file_rows import check_mapped_file
from jax_data.loaders.file_rows import file_bytes_needed
from jax_data.loaders.gather import DIGEST_VERSION
from jax_data.loaders.gather import digest_rows
from jax_data.loaders.gather import usable_cores
from jax_data.loaders.host_loader import HostDataLoader
from jax_data.loaders.indexed import IndexedCursor
from jax_data.loaders.source_records import RecordError
from jax_data.loaders.source_records import RecordReader
from jax_data.loaders.source_workers import WorkerPool
from jax_data.loaders.source_workers import exiting
from jax_data.loaders.source_workers import pickle_for_workers
from jax_data.loaders.source_workers import stopped
from jax_data.loaders.source_workers import wait
from jax_data.types import PyTree
from jax_data.types import RandomAccessSource
from jax_data.validation import check_bool
from jax_data.validation import check_int

# Chunks read with each candidate number of workers before choosing one.
_TRIALS = 2


#: The most workers a loader takes: beyond it a thread or process each
#: buys no speed, and tens of thousands failed to start inside compiled
#: code, leaving those already started behind.
MAX_WORKERS = 1024


def default_workers() -> int:
  """Worker threads by default: the cores this process may use, at most 8."""
  return min(8, usable_cores())


class _WorkerChoice:
  """How many workers read a chunk: one, or the whole pool.

  Threads speed up records whose work releases the GIL (decompression,
  NumPy, reading files) and slow down records whose work is Python code,
  which they fight over the GIL for (two threads decoding small PNG images
  with PIL read 0.59x as many as one, measured on 2 cores). So the first
  chunks alternate between one worker and the pool, timed, and the faster
  is kept. The records and their order do not depend on the choice.
  """

  def __init__(self, pool_size: int):
    self._candidates = [1, pool_size] if pool_size > 1 else [1]
    self._rates: Dict[int, List[float]] = {k: [] for k in self._candidates}
    self._chosen: Optional[int] = (None if len(self._candidates) > 1
                                   else self._candidates[0])
    self._lock = threading.Lock()

  def next(self) -> int:
    """The number of workers for the next chunk."""
    with self._lock:
      if self._chosen is not None:
        return self._chosen
      return min(self._candidates, key=lambda k: len(self._rates[k]))

  def observe(self, workers: int, records: int, seconds: float) -> None:
    """Notes how fast ``workers`` read ``records``."""
    with self._lock:
      if self._chosen is not None:
        return
      self._rates[workers].append(records / max(seconds, 1e-9))
      if all(len(r) >= _TRIALS for r in self._rates.values()):
        self._chosen = max(self._candidates,
                           key=lambda k: float(np.median(self._rates[k])))

  @property
  def chosen(self) -> Optional[int]:
    return self._chosen


def _by_record_number(source: Any) -> bool:
  """False where ``source[0]`` is no record: a mapping whose keys are not
  record numbers (a dict of arrays), or a table of columns (a pandas
  DataFrame, whose ``[0]`` is a column). A sequence that also has a
  ``keys()`` (its fields' names) is read as a source."""
  if hasattr(source, "columns") and hasattr(source, "iloc"):
    return False
  if not isinstance(source, collections.abc.Mapping):
    return True
  try:
    return 0 in source
  except Exception:  # pylint: disable=broad-except
    return True  # read as a source: its first record says what is wrong


class SourceDataLoader(HostDataLoader):
  """Host loader over a random-access source: ``len(source)`` and
  ``source[i]``.

  A record is a dict (or any pytree) of array-likes, or what
  ``transform(record)`` turns into one; its format comes from the first
  record, and every record read is checked against it. The streams are
  exactly those of a :class:`~jax_data.NumpyDataLoader` over the stacked
  records, for the same seeds and options.

  Records are read, transformed and checked by up to ``workers`` threads,
  each writing its records into fixed rows of the chunk, so the order never
  depends on the threads' timing. Work that releases the GIL (decompression,
  NumPy, reading files) runs in parallel; Python code does not, and threads
  fighting over the GIL are slower than one, so the first chunks are read
  with one worker and with all of them, and the faster is kept. A chunk is
  produced by the pipeline's prefetch thread while the device works (or by
  the request itself when it is not ready), and that thread hands the
  chunk's records to the workers. A source with ``__getitems__(indices)``
  is read a batch of indices at a time. Each distinct record of a chunk is
  read once. A ``numpy.memmap`` as the source has its file checked before
  each read, as :class:`~jax_data.NumpyDataLoader` checks its memmaps (a
  file truncated meanwhile then raises ``OSError``, where a read past its
  end would kill the process); ``NumpyDataLoader(copy=False, x=memmap)``
  reads such rows faster. Leaves are served in the dtypes JAX keeps
  (64-bit ones as 32-bit without ``jax_enable_x64``); a record read with
  an integer that such a dtype cannot hold raises a ``RecordError`` that
  names it, where NumPy's cast would wrap it.

  >>> import numpy as np
  >>> import jax_data
  >>> records = [{"x": np.full(2, i, np.float32), "y": i % 3}
  ...            for i in range(10)]
  >>> loader = jax_data.SourceDataLoader(records)
  >>> loader
  SourceDataLoader(list of 10 records; {['x']: float32[2], ['y']: int64[]})
  >>> init_fn, batch_fn, release_fn = jax_data.random_reference_data(
  ...     loader, cached_batches_count=2, mb_size=4)
  >>> _, batch = batch_fn(init_fn(seed=0))
  >>> batch["x"].shape, str(batch["y"].dtype)
  ((4, 2), 'int32')
  >>> release_fn()

  Args:
    source: Has ``__len__`` and ``__getitem__(int)``.
    transform: Turns a record into a pytree of array-likes (e.g. decodes an
      image); None takes records as they are.
    workers: Threads that may read and transform records: the first
      chunks are read with one and with all of them, and the faster is
      kept; 0 reads in the thread that produces the chunk, which then
      cannot be answered before its record returns, also when the
      pipeline is released meanwhile. Default: the usable cores, at most
      8; at most :data:`MAX_WORKERS` (1,024).
    processes: The workers are processes instead (started with ``spawn``
      when the first chain opens), for transforms whose Python work holds
      the GIL; ``source`` and ``transform`` must pickle, and each worker
      receives them once. The streams are the same. A worker that dies is
      replaced and its records read again; workers ignore Ctrl-C (SIGINT),
      which the parent process handles. More worker processes than usable
      cores get a warning: they read no faster, and each costs the memory
      of a Python process (about 30 MiB of RSS with NumPy and a source
      whose module and records need no JAX, about 160 MiB where the
      script or the source imports JAX: docs/sources.rst).

  Raises:
    TypeError: ``source`` lacks ``len`` or indexing, ``transform`` is not
      callable, or the first record has a leaf that is not numeric (a
      string: drop or transform it); with ``processes=True``, source and
      transform do not pickle, or worker processes could not unpickle them
      (defined in the ``__main__`` of a notebook or of ``python -``).
    ValueError: the source is empty.
    RecordError: the first record cannot be read.
  """

  random_keywords = HostDataLoader.random_keywords + ("stream",)
  reads_by_index = True
  slow_rows = True  # a __getitem__ (and transform) per record

  def __init__(self, source: RandomAccessSource,
               transform: Optional[Callable] = None, *,
               workers: Optional[int] = None, processes: bool = False):
    if not isinstance(source, RandomAccessSource):
      raise TypeError(
          "source must have len(source) and source[i] (a random-access "
          f"source), got source={source!r} of type {type(source).__name__}")
    if not _by_record_number(source):
      # A dict of arrays (NumpyDataLoader's data), a DataFrame: source[0]
      # is not the first record.
      raise TypeError(
          "source must be indexed by record number (source[0] the first "
          f"record), got source={source!r:.200} of type "
          f"{type(source).__name__} with keys {list(source.keys())[:8]}; a "
          "dict of arrays, one per field, is NumpyDataLoader(**source), and "
          "a DataFrame's columns NumpyDataLoader(**{c: df[c].to_numpy() for "
          "c in df})")
    if transform is not None and not callable(transform):
      raise TypeError(
          f"transform must be callable or None, got transform={transform!r}")
    self._source = source
    # A memmap as the source: its file is checked before each read, as
    # NumpyDataLoader checks its memmaps (a read past the end of a file
    # truncated meanwhile kills the process with SIGBUS).
    self._file_bytes = (file_bytes_needed(source)
                        if isinstance(source, np.memmap) else None)
    try:
      length = len(source)
    except (TypeError, ValueError) as e:  # a 0-d array; __len__() < 0
      raise TypeError(
          f"source must have a length, len(source) failed for "
          f"source={source!r:.200} of type {type(source).__name__}: "
          f"{type(e).__name__}: {e}") from None
    self._count = check_int("len(source)", length, minimum=0)
    if self._count == 0:
      raise ValueError(f"source {source!r} is empty (len(source) == 0)")
    self._workers = default_workers() if workers is None else check_int(
        "workers", workers, minimum=0, maximum=MAX_WORKERS)
    self._processes = check_bool("processes", processes)
    if self._processes and self._workers > usable_cores():
      warnings.warn(
          f"SourceDataLoader(workers={self._workers}, processes=True) may "
          f"start up to {self._workers} worker processes (one per record "
          f"read at once), more than the {usable_cores()} cores this "
          "process may use: each imports NumPy and the source, and more "
          "processes than cores read no faster. Give workers at most the "
          "cores, or leave it to its default.", stacklevel=2)
    pickled = (pickle_for_workers(source, transform, self._workers > 0)
               if self._processes else b"")
    self._reader = RecordReader(source, transform, type(self).__name__)
    self._first = self._reader.first
    self._format = self._first.treedef.unflatten([
        jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype))
        for shape, dtype in zip(self._first.shapes, self._first.dtypes)])
    self._pool = WorkerPool(
        self._workers, self._processes, pickled, self._first,
        f"{type(self).__name__} over {type(source).__name__}")
    self._choice = _WorkerChoice(1 if processes else self._workers)
    self._digest: Optional[str] = None

  def __repr__(self) -> str:
    return (f"{type(self).__name__}({type(self._source).__name__} of "
            f"{self._count} records; {self._first.describe()})")

  @property
  def static_information(self) -> Dict[str, int]:
    return {"observation_count": self._count}

  @property
  def observation_format(self) -> PyTree:
    return self._format

  def _read(self, flat: np.ndarray, out: List[np.ndarray],
            stop: Optional[concurrent.futures.Future] = None
            ) -> List[np.ndarray]:
    """Records ``flat`` into ``out``: each distinct record read once, at
    fixed rows, by one worker or the pool (:class:`_WorkerChoice`); then the
    rows of repeated indices.

    The calling thread only waits for the workers (with ``workers=0`` it
    reads itself): once ``stop`` is done, it raises
    :class:`~jax_data.PipelineReleasedError` at once, and the workers stop
    before their next record (a record being read finishes in the
    background).
    """
    self._check_file()
    unique, first, inverse = _distinct(flat)
    if stop is not None and stop.done():
      raise stopped()
    pool = self._pool.threads
    processes = self._pool.processes
    # As the interpreter exits, worker processes are ended and thread
    # pools take no work; a thread that Python waits for (not a daemon)
    # reads its records itself and finishes its run.
    here = exiting() or (not processes and pool is None)  # or workers=0
    if processes and not here:
      try:
        self._pool.read(unique, first, out, stop)
      except (PipelineReleasedError, RecordError):
        if not exiting() or (stop is not None and stop.done()):
          raise
        here = True  # the workers were ended by the exit meanwhile
    # Timed as the choice it was: a chunk of fewer records than the pool
    # reads them with fewer workers.
    choice = 0 if here or processes else self._choice.next()
    workers = min(choice, unique.size)  # processes are not timed
    start = time.perf_counter()
    if here:
      self._reader.fill(unique, first, out, stop)
    elif workers:
      parts = np.array_split(np.arange(unique.size), workers)
      futures = []
      for part in parts:
        try:
          futures.append(pool.submit(self._reader.fill, unique[part],
                                     first[part], out, stop))
        except RuntimeError:  # "cannot schedule new futures after
          # (interpreter) shutdown": the interpreter exits (its hook may
          # run before ours), or the pool was ended meanwhile
          self._reader.fill(unique[part], first[part], out, stop)
      wait(futures, stop)
      for future in futures:
        future.result()  # the first failure, by row order
      self._choice.observe(choice, unique.size, time.perf_counter() - start)
    if stop is not None and stop.done():
      raise stopped()
    if inverse is not None:
      _copy_repeated(first, inverse, out)
    del unique, first, inverse
    if flat.size >= TRIM_ROWS:
      give_back_heap()
    return out

  def _check_file(self) -> None:
    """Raises if the source is a memmap whose file is now shorter than the
    bytes it touches."""
    if self._file_bytes is not None:
      check_mapped_file(self._source,  # type: ignore[arg-type]
                        self._file_bytes, "the source")

  @property
  def workers_used(self) -> Optional[int]:
    """How many workers read a chunk, once the first chunks have chosen
    (None before)."""
    if self._processes:
      return self._workers
    return self._choice.chosen if self._workers > 1 else self._workers

  # -- chains -------------------------------------------------------------

  def open_chain(self, spec: ChainSpec, layout: ChunkLayout) -> ChainCursor:
    """A cursor with the NumPy loader's streams over the records; the
    worker threads run while any cursor is open."""
    self._pool.opened()
    return _SourceCursor(spec, layout, self, self._pool.closed)

  def content_digest(self) -> str:
    """A digest of the record count and a fixed sample of 32 records
    (every record of 32 or fewer)."""
    if self._digest is None:
      self._digest = self._digest_of(DIGEST_VERSION)
    return self._digest

  def earlier_digests(self) -> Tuple[str, ...]:
    """The digests earlier versions gave, of the records' own dtypes
    (where the loader serves others: 64-bit leaves as 32-bit): of fewer
    rows (version 1), and of this version's rows."""
    earlier = [self._digest_of(version, served=False)
               for version in (1, DIGEST_VERSION)]
    return tuple(dict.fromkeys(d for d in earlier
                               if d != self.content_digest()))

  def _digest_of(self, version: int, served: bool = True) -> str:
    """The digest of the sample of ``version``, its leaves taken in the
    dtypes the loader serves (``served``: the same records of int64 and of
    int32 are the same data), or else in the first record's own."""
    self._check_file()
    dtypes = ([leaf.dtype for leaf in jax.tree.leaves(self._format)]
              if served else self._first.dtypes)
    return digest_rows(
        self._count, lambda row: self._reader.leaves(
            row, self._reader.records(np.array([row]))[0]),
        dtypes, version)


#: Rows of repeated indices copied at a time from where their records were
#: read: 1,024 chains' refresh of 10 batches of 64 over 1e5 records has
#: 555,000 repeats, whose rows copied at once took a 70 MiB temporary.
COPY_BLOCK = 1 << 16
#: Reads of at least this many rows give the freed heap back after them
#: (:func:`give_back_heap`): those of many chains (1,024 chains' refresh
#: of 10 batches of 64 is 655,360 rows). Not smaller ones: malloc_trim
#: took 20 ms a call on a heap of 1.8 GB with 1.5 million free chunks.
TRIM_ROWS = 1 << 18


def _copy_repeated(first: np.ndarray, inverse: np.ndarray,
                   out: List[np.ndarray]) -> None:
  """Copies into each row whose index repeats an earlier one's the row
  where that index's record was read (``first[inverse[row]]``, always a
  row that was read, never a copy), :data:`COPY_BLOCK` rows at a time."""
  for low in range(0, inverse.size, COPY_BLOCK):
    source = first[inverse[low:low + COPY_BLOCK]]
    rows = np.flatnonzero(source != np.arange(low, low + source.size))
    if rows.size:
      source = source[rows]
      rows += low
      for leaf in out:
        leaf[rows] = leaf[source]


def _distinct(flat: np.ndarray
              ) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
  """The distinct indices of ``flat`` in increasing order (records are read
  in that order), a row where each occurs, and for every row its distinct
  index's place (None when all are distinct). One unstable argsort: a
  third of the time of ``np.unique``'s three answers, whose stable sort
  finds each index's first row (655,360 indices: 40 ms against 120 ms)."""
  order = np.argsort(flat)
  ordered = flat[order]
  new = np.ones(flat.size, bool)
  np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
  if new.all():
    return ordered, order, None
  places = np.cumsum(new, dtype=np.int64)
  places -= 1
  inverse = np.empty(flat.size, np.int64)
  inverse[order] = places
  return ordered[new], order[new], inverse


class _SourceCursor(IndexedCursor):
  """An indexed cursor that tells its loader when it closes, and stops
  reading records when cancelled."""

  def __init__(self, spec: ChainSpec, layout: ChunkLayout,
               loader: SourceDataLoader, closed: Callable[[], None]):
    # Done once cancelled: reads stop between records, and their waits end.
    self._stop: concurrent.futures.Future = concurrent.futures.Future()
    # Grouped by loader: chains read together read through the first
    # one's stop, and release cancels them all.
    super().__init__(spec, layout, functools.partial(
        loader._read, stop=self._stop),  # pylint: disable=protected-access
                     rows=loader, closed=closed)

  def cancel(self) -> None:
    try:
      self._stop.set_result(None)
    except concurrent.futures.InvalidStateError:
      pass  # cancelled before
