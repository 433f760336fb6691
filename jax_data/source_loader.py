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

import concurrent.futures
import concurrent.futures.process
import functools
import io
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import types
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import jax
import numpy as np

from jax_data.chains import ChainCursor
from jax_data.chains import ChainSpec
from jax_data.chains import ChunkLayout
from jax_data.errors import PipelineReleasedError
from jax_data.gather import digest_rows
from jax_data.gather import usable_cores
from jax_data.host_loader import HostDataLoader
from jax_data.indexed import IndexedCursor
from jax_data.types import PyTree
from jax_data.validation import check_bool
from jax_data.validation import check_int
from jax_data.validation import is_jax_dtype

# Chunks read with each candidate number of workers before choosing one.
_TRIALS = 2


class RecordError(ValueError):
  """A record of a source could not be read, or does not fit the format of
  the first record."""


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


class _Format:
  """The structure, key paths, shapes and dtypes of the first record."""

  def __init__(self, treedef, paths: List[str], leaves: List[np.ndarray]):
    self.treedef = treedef
    self.paths = paths
    self.shapes = [leaf.shape for leaf in leaves]
    self.dtypes = [leaf.dtype for leaf in leaves]
    # Records that are one array, or a dict, tuple or list of arrays: their
    # container and keys (positions), so that a batch of them is stacked
    # leaf by leaf in C.
    node = treedef.node_data()
    self.container: Optional[type] = None
    self.keys: Tuple[Any, ...] = ()
    self.stackable = treedef.num_nodes == 1 or (
        node is not None and node[0] in (dict, tuple, list)
        and all(child.num_nodes == 1 for child in treedef.children()))
    if treedef.num_nodes > 1 and self.stackable:
      self.container = node[0]
      self.keys = (tuple(node[1]) if node[0] is dict
                   else tuple(range(treedef.num_leaves)))

  def columns(self, records: List[Any]) -> Optional[List[List[Any]]]:
    """The records' leaves, one list per leaf, if every record has the
    first's structure at the top level (one array, or the same container
    with the same keys or length); else None."""
    if self.container is None:
      return [records]
    kind, count = self.container, len(self.keys)
    try:
      if not all(type(r) is kind and len(r) == count for r in records):
        return None
      return [[r[k] for r in records] for k in self.keys]
    except KeyError:
      return None

  def stack(self, records: List[Any]) -> Optional[List[np.ndarray]]:
    """The records stacked leaf by leaf, or None where one of them does
    not match the first record (the record-by-record path then names it).
    """
    columns = self.columns(records) if self.stackable else None
    if columns is None:
      return None
    stacked = []
    for column, shape, dtype in zip(columns, self.shapes, self.dtypes):
      try:
        array = np.stack(column)
      except (ValueError, TypeError):
        return None
      if array.shape[1:] != shape or array.dtype != dtype:
        return None
      stacked.append(array)
    return stacked

  def describe(self) -> str:
    return "{" + ", ".join(
        f"{path}: {dtype}{list(shape)}" for path, shape, dtype in
        zip(self.paths, self.shapes, self.dtypes)) + "}"


def _flatten(record: Any) -> Tuple[List[str], List[Any], Any]:
  """Key paths, leaves and treedef of a record."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(record)
  paths = [jax.tree_util.keystr(path) or "record" for path, _ in with_paths]
  return paths, [leaf for _, leaf in with_paths], treedef


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
  read once.

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
      8.
    processes: The workers are processes instead (started with ``spawn``
      when the first chain opens), for transforms whose Python work holds
      the GIL; ``source`` and ``transform`` must pickle, and each worker
      receives them once. The streams are the same. A worker that dies is
      replaced and its records read again; workers ignore Ctrl-C (SIGINT),
      which the parent process handles.

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

  def __init__(self, source: Any, transform: Optional[Callable] = None, *,
               workers: Optional[int] = None, processes: bool = False):
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
      raise TypeError(
          "source must have len(source) and source[i] (a random-access "
          f"source), got source={source!r} of type {type(source).__name__}")
    if transform is not None and not callable(transform):
      raise TypeError(
          f"transform must be callable or None, got transform={transform!r}")
    self._source = source
    self._transform = transform
    self._count = check_int("len(source)", len(source), minimum=0)
    if self._count == 0:
      raise ValueError(f"source {source!r} is empty (len(source) == 0)")
    self._workers = default_workers() if workers is None else check_int(
        "workers", workers, minimum=0)
    self._processes = check_bool("processes", processes)
    if self._processes:
      self._pickled = _pickle_for_workers(source, transform,
                                          self._workers > 0)
    self._batched = self._batched_read(source)
    # Read as chunks read (sources may type a batched read differently).
    paths, leaves, treedef = _flatten(self._records(np.zeros(1, int))[0])
    self._first = _Format(treedef, paths, self._check_first(paths, leaves))
    self._format = treedef.unflatten([
        jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype))
        for shape, dtype in zip(self._first.shapes, self._first.dtypes)])
    self._lock = threading.Lock()
    self._pool: Optional[concurrent.futures.Executor] = None
    self._choice = _WorkerChoice(1 if processes else self._workers)
    self._open_cursors = 0
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

  # -- records ------------------------------------------------------------

  @staticmethod
  def _batched_read(source: Any) -> Optional[Callable[[List[int]], Any]]:
    """The source's ``__getitems__``, if it has one that works: a list of
    indices gives a list of as many records (PyTorch's convention, met by
    Hugging Face, ArrayRecord and TFDS sources). One that raises on a probe
    (a mocked TFDS source binds it wrongly) is not used."""
    batched = getattr(source, "__getitems__", None)
    if not callable(batched):
      return None
    try:
      probe = batched([0])
      if len(probe) != 1:
        return None
    except Exception:  # pylint: disable=broad-except
      return None
    return batched

  def _load(self, index: int) -> Any:
    """Record ``index``, transformed; a failure names the index."""
    try:
      record = self._source[index]
      return record if self._transform is None else self._transform(record)
    except Exception as e:  # pylint: disable=broad-except
      raise RecordError(
          f"{type(self).__name__} over {type(self._source).__name__}: "
          f"record {index}: {type(e).__name__}: {e}") from e

  def _check_first(self, paths: List[str], leaves: List[Any]
                   ) -> List[np.ndarray]:
    arrays = []
    for path, leaf in zip(paths, leaves):
      array = np.asarray(leaf)
      if not is_jax_dtype(array.dtype):
        raise TypeError(
            f"record 0 has {path} of dtype {array.dtype} ({type(leaf).__name__}"
            "), which cannot become a JAX array; drop it or turn it into "
            "numbers with transform=")
      arrays.append(array)
    if not arrays:
      raise TypeError("record 0 has no array leaves: " + repr(leaves))
    return arrays

  def _leaves(self, index: int, record: Any) -> List[np.ndarray]:
    """The leaves of record ``index``, checked against the first record
    (key paths are computed only for a message)."""
    first = self._first
    leaves, treedef = jax.tree_util.tree_flatten(record)
    if treedef != first.treedef:
      paths, _, _ = _flatten(record)
      raise RecordError(
          f"record {index} has the keys {', '.join(paths)}, but record 0 "
          f"has {', '.join(first.paths)}: records must share one format; "
          f"record 0 is {first.describe()}")
    arrays = []
    for leaf, shape, dtype in zip(leaves, first.shapes, first.dtypes):
      array = leaf if type(leaf) is np.ndarray else np.asarray(leaf)
      if array.shape != shape or array.dtype != dtype:
        self._wrong_leaf(index, record)
      arrays.append(array)
    return arrays

  def _wrong_leaf(self, index: int, record: Any) -> None:
    """Raises the error that names a leaf of another shape or dtype."""
    first = self._first
    paths, leaves, _ = _flatten(record)
    for path, leaf, shape, dtype in zip(paths, leaves, first.shapes,
                                        first.dtypes):
      array = np.asarray(leaf)
      if array.shape != shape or array.dtype != dtype:
        raise RecordError(
            f"record {index} has {path} of dtype {array.dtype} and shape "
            f"{list(array.shape)}, but record 0 has {dtype}{list(shape)}: "
            f"records must share one format; record 0 is "
            f"{first.describe()}")

  def _records(self, indices: np.ndarray) -> List[Any]:
    """The transformed records of ``indices``, batched where the source
    reads batches."""
    if self._batched is None:
      return [self._load(int(i)) for i in indices]
    try:
      records = list(self._batched([int(i) for i in indices]))
    except Exception as e:  # pylint: disable=broad-except
      raise RecordError(
          f"{type(self).__name__} over {type(self._source).__name__}: "
          f"records {indices.tolist()[:8]}{'...' if indices.size > 8 else ''}"
          f": {type(e).__name__}: {e}") from e
    if len(records) != indices.size:
      raise RecordError(
          f"__getitems__ of {type(self._source).__name__} returned "
          f"{len(records)} records for {indices.size} indices")
    if self._transform is None:
      return records
    out = []
    for index, record in zip(indices, records):
      try:
        out.append(self._transform(record))
      except Exception as e:  # pylint: disable=broad-except
        raise RecordError(
            f"{type(self).__name__} over {type(self._source).__name__}: "
            f"record {int(index)}: {type(e).__name__}: {e}") from e
    return out

  def _fill(self, indices: np.ndarray, rows: np.ndarray,
            out: Sequence[np.ndarray],
            stop: Optional[concurrent.futures.Future] = None) -> None:
    """Reads records ``indices`` into rows ``rows`` of ``out``; once
    ``stop`` is done (the chain's pipeline was released), it returns before
    the next record, leaving the rest unwritten."""
    if self._batched is not None:
      records = self._records(indices)
      stacked = self._first.stack(records) if len(records) > 1 else None
      if stacked is not None:  # all alike: written leaf by leaf
        for leaf, array in zip(out, stacked):
          leaf[rows] = array
        return
    else:  # one by one: a stop takes effect before the next
      records = (self._load(int(i)) for i in indices)
    for index, row, record in zip(indices, rows, records):
      for leaf, array in zip(out, self._leaves(int(index), record)):
        leaf[row] = array
      if stop is not None and stop.done():
        return

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
    unique, first, inverse = np.unique(flat, return_index=True,
                                       return_inverse=True)
    if stop is not None and stop.done():
      raise _stopped()
    pool = self._pool
    processes = self._processes and self._workers > 0
    if processes:
      self._read_in_processes(unique, first, out, stop)
      workers = 0  # not timed: processes are always used
    else:
      workers = 0 if pool is None else min(self._choice.next(), unique.size)
    start = time.perf_counter()
    if not processes and pool is None:  # workers=0
      self._fill(unique, first, out, stop)
    elif workers:
      parts = np.array_split(np.arange(unique.size), workers)
      futures = [pool.submit(self._fill, unique[part], first[part], out, stop)
                 for part in parts]
      _wait(futures, stop)
      for future in futures:
        future.result()  # the first failure, by row order
      self._choice.observe(workers, unique.size, time.perf_counter() - start)
    if stop is not None and stop.done():
      raise _stopped()
    repeated = first[inverse] != np.arange(flat.size)
    if repeated.any():
      rows = np.flatnonzero(repeated)
      for leaf in out:
        leaf[rows] = leaf[first[inverse[rows]]]
    return out

  def _read_in_processes(self, unique: np.ndarray, first: np.ndarray,
                         out: Sequence[np.ndarray],
                         stop: Optional[concurrent.futures.Future]) -> None:
    """Reads records in the worker processes, a block per task; each block
    comes back stacked per leaf and is written at its rows.

    A worker that dies (killed, out of memory, ``os._exit`` in the source)
    breaks its pool: a new pool reads the blocks lost again, one at a
    time, and a block that ends a worker again is named. A stop (a
    released pipeline) ends the pool's workers, still reading for nobody.
    """
    parts = np.array_split(np.arange(unique.size),
                           max(1, min(unique.size, 4 * self._workers)))
    pool = self._process_pool()
    futures = [_submit(pool, _read_block, unique[part]) for part in parts]
    try:
      _wait(futures, stop, cancel=False)
    except PipelineReleasedError:
      if not all(f.done() for f in futures):
        self._retire(pool)
      raise
    lost = [i for i, future in enumerate(futures) if _broke(future)]
    if lost:
      pool = self._process_pool(broken=pool)
    for i in lost:
      futures[i] = _submit(pool, _read_block, unique[parts[i]])
      try:
        _wait(futures[i:i + 1], stop, cancel=False)
      except PipelineReleasedError:
        self._retire(pool)
        raise
      if _broke(futures[i]):
        self._retire(pool)
        raise RecordError(
            f"{type(self).__name__} over {type(self._source).__name__}: "
            "worker processes ended abruptly while reading records "
            f"{unique[parts[i]].tolist()}, also when a new worker read them "
            "alone: reading one of them ends its process (os._exit, a crash "
            "in native code, memory exhausted?)") from futures[i].exception()
    for part, future in zip(parts, futures):
      for leaf, block in zip(out, future.result()):
        leaf[first[part]] = block

  def _process_pool(self, broken: Optional[concurrent.futures.Executor] = None
                    ) -> concurrent.futures.Executor:
    """The pool of worker processes, started if there is none (or only
    ``broken``, which is ended)."""
    with self._lock:
      if broken is not None and self._pool is broken:
        self._pool = None
      if self._pool is None and self._open_cursors > 0:
        self._pool = concurrent.futures.ProcessPoolExecutor(
            self._workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker, initargs=(self._pickled,
                                                 self._first))
      pool = self._pool
    if broken is not None:
      _terminate(broken)
    if pool is None:  # every chain closed
      raise _stopped()
    return pool

  def _retire(self, pool: concurrent.futures.Executor) -> None:
    """Ends ``pool``; the next read starts another."""
    with self._lock:
      if self._pool is pool:
        self._pool = None
    _terminate(pool)

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
    with self._lock:
      if (self._pool is None and not self._processes
          and self._workers > 0):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self._workers, thread_name_prefix="jax_data-source")
      self._open_cursors += 1
    if self._processes and self._workers > 0:
      self._process_pool()
    return _SourceCursor(spec, layout, self)

  def _cursor_closed(self) -> None:
    with self._lock:
      self._open_cursors -= 1
      pool = self._pool if self._open_cursors == 0 else None
      if pool is not None:
        self._pool = None
    if pool is not None:
      pool.shutdown(wait=False, cancel_futures=True)

  def content_digest(self) -> str:
    """A digest of the record count and a fixed sample of 32 records."""
    if self._digest is None:
      self._digest = digest_rows(
          self._count, lambda row: self._leaves(
              row, self._records(np.array([row]))[0]), self._first.dtypes)
    return self._digest


# -- worker processes -------------------------------------------------------

_USE_THREADS = "or use processes=False (worker threads)"


class _MainReferences(pickle.Pickler):
  """Pickles, noting the classes and functions of ``__main__`` that the
  pickle refers to by name."""

  def __init__(self, file):
    super().__init__(file)
    self.names: List[str] = []

  def reducer_override(self, obj):
    if (isinstance(obj, (type, types.FunctionType))
        and getattr(obj, "__module__", None) == "__main__"):
      self.names.append(obj.__qualname__)
    return NotImplemented


def _pickle_for_workers(source: Any, transform: Optional[Callable],
                        workers: bool) -> bytes:
  """``(source, transform)`` pickled for worker processes started with
  ``spawn``, checked as a spawned child would see them.

  A child runs the parent's main module again, by name or from its file,
  then unpickles; with neither (a notebook, ``python -c``) it has no
  ``__main__`` to find the classes and functions defined there in.

  Raises:
    TypeError: they do not pickle; or, if ``workers``, the main module is
      not a file the children could run (``python -`` reads it from
      stdin), or it has no file and they refer to what it defines.
  """
  main = sys.modules.get("__main__")
  name = getattr(getattr(main, "__spec__", None), "name", None)
  path = None if name is not None else getattr(main, "__file__", None)
  if workers and path is not None:
    if not os.path.isabs(path) and multiprocessing.process.ORIGINAL_DIR:
      path = os.path.join(multiprocessing.process.ORIGINAL_DIR, path)
    if not os.path.isfile(path):
      raise TypeError(
          "processes=True starts worker processes with spawn, which run the "
          "main module again from its file, but __main__.__file__="
          f"{main.__file__!r} is no file (a script read from stdin, as by "
          "`python -`): run the script from a file, " + _USE_THREADS)
  scan = workers and name is None and path is None
  buffer = io.BytesIO()
  pickler = _MainReferences(buffer) if scan else pickle.Pickler(buffer)
  try:
    pickler.dump((source, transform))
  except Exception as e:  # pylint: disable=broad-except
    raise TypeError(
        "processes=True sends source and transform to worker processes, "
        f"but they do not pickle: {type(e).__name__}: {e}; define the "
        "transform at module level, or use threads") from e
  if scan and pickler.names:
    names = ", ".join(f"__main__.{n}" for n in dict.fromkeys(pickler.names))
    raise TypeError(
        "processes=True sends source and transform to worker processes, "
        f"which find {names} by name in __main__; but this __main__ has no "
        "file (a notebook, `python -c`) that they could run again, so they "
        "cannot: define it in a module they can import (a .py file on "
        "sys.path, next to the notebook), " + _USE_THREADS)
  return buffer.getvalue()


# In a worker process (processes=True) only: the loader's source, transform
# and first record's format, set once by the pool's initializer; or why
# they could not be unpickled.
_WORKER: Dict[str, Any] = {}


def _start_worker(pickled: bytes, first: _Format) -> None:
  """The initializer of a worker process: a loader that reads records.

  Ctrl-C (SIGINT to the process group) is ignored: the parent decides
  what it interrupts. A source that cannot be unpickled here fails each
  block with the reason, not the whole pool with none.
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if hasattr(signal, "pthread_sigmask"):  # blocked until now: see _submit
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
  try:
    source, transform = pickle.loads(pickled)
  except Exception as e:  # pylint: disable=broad-except
    _WORKER["error"] = RecordError(
        "a worker process (processes=True) cannot unpickle source and "
        f"transform: {type(e).__name__}: {e}; define them in a module the "
        "worker processes can import (not in a notebook, nor under `if "
        "__name__ == '__main__':`), " + _USE_THREADS)
    return
  loader = SourceDataLoader.__new__(SourceDataLoader)
  loader._source, loader._transform = source, transform  # pylint: disable=protected-access
  loader._batched = SourceDataLoader._batched_read(source)  # pylint: disable=protected-access
  loader._first = first  # pylint: disable=protected-access
  _WORKER["loader"] = loader


def _read_block(indices: np.ndarray) -> List[np.ndarray]:
  """Records ``indices``, read and checked in a worker process, stacked per
  leaf."""
  if "error" in _WORKER:
    raise _WORKER["error"]
  loader = _WORKER["loader"]
  columns = [np.empty((indices.size,) + shape, dtype) for shape, dtype in
             zip(loader._first.shapes, loader._first.dtypes)]  # pylint: disable=protected-access
  loader._fill(indices, np.arange(indices.size), columns)  # pylint: disable=protected-access
  return columns


def _submit(pool: concurrent.futures.Executor, fn: Callable, *args: Any
            ) -> concurrent.futures.Future:
  """``pool.submit(fn, *args)`` to a process pool; a pool found broken, or
  ended by another thread, gives a future that failed with
  ``BrokenProcessPool``.

  The submitting thread starts the workers it needs, with SIGINT blocked:
  a worker inherits the mask, so a Ctrl-C while it starts up (importing
  jax) is held until its initializer ignores SIGINT, not raised.
  """
  mask = hasattr(signal, "pthread_sigmask")
  if mask:
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  try:
    return pool.submit(fn, *args)
  except (concurrent.futures.process.BrokenProcessPool, RuntimeError) as e:
    future: concurrent.futures.Future = concurrent.futures.Future()
    error = concurrent.futures.process.BrokenProcessPool(str(e))
    error.__cause__ = e
    future.set_exception(error)
    return future
  finally:
    if mask:
      signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _broke(future: concurrent.futures.Future) -> bool:
  """Whether a done future failed because a worker process died."""
  return not future.cancelled() and isinstance(
      future.exception(), concurrent.futures.process.BrokenProcessPool)


def _terminate(pool: concurrent.futures.Executor) -> None:
  """Shuts a process pool down without waiting, and ends its workers, so
  that none stuck in a source outlives it (and holds up the interpreter's
  exit)."""
  terminate = getattr(pool, "terminate_workers", None)  # Python >= 3.14
  if terminate is not None:
    terminate()
    return
  # Before shutdown, which forgets them. Futures are not cancelled (see
  # _wait): those left fail with BrokenProcessPool.
  processes = list((getattr(pool, "_processes", None) or {}).values())
  pool.shutdown(wait=False)
  for process in processes:
    process.terminate()


def _wait(futures: Sequence[concurrent.futures.Future],
          stop: Optional[concurrent.futures.Future],
          cancel: bool = True) -> None:
  """Waits until every future is done, or ``stop`` is: then (if
  ``cancel``) the futures not started are cancelled, those running finish
  in the background, and :class:`~jax_data.PipelineReleasedError` is
  raised. (A process pool's futures are not cancelled: its manager thread
  may fail them at the same time, and fails on a cancelled one.)"""
  pending = [f for f in futures if not f.done()]
  while pending and not (stop is not None and stop.done()):
    concurrent.futures.wait(pending + ([] if stop is None else [stop]),
                            return_when=concurrent.futures.FIRST_COMPLETED)
    pending = [f for f in pending if not f.done()]
  if stop is not None and stop.done():
    for future in futures if cancel else ():
      future.cancel()
    raise _stopped()


def _stopped() -> PipelineReleasedError:
  return PipelineReleasedError(
      "reading records stopped: the chain's pipeline was released")


class _SourceCursor(IndexedCursor):
  """An indexed cursor that tells its loader when it closes, and stops
  reading records when cancelled."""

  def __init__(self, spec: ChainSpec, layout: ChunkLayout,
               loader: SourceDataLoader):
    # Done once cancelled: reads stop between records, and their waits end.
    self._stop: concurrent.futures.Future = concurrent.futures.Future()
    super().__init__(spec, layout, functools.partial(
        loader._read, stop=self._stop))  # pylint: disable=protected-access
    self._loader: Optional[SourceDataLoader] = loader

  def cancel(self) -> None:
    try:
      self._stop.set_result(None)
    except concurrent.futures.InvalidStateError:
      pass  # cancelled before

  def close(self) -> None:
    loader, self._loader = self._loader, None
    if loader is not None:
      loader._cursor_closed()  # pylint: disable=protected-access
