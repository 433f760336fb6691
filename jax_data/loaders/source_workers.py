"""Worker processes of :class:`~jax_data.SourceDataLoader` (``processes=True``).

The parent pickles ``(source, transform)`` once (:func:`pickle_for_workers`,
which explains what ``spawn``ed children could not find); each worker
process unpickles them in :func:`start_worker`, the pool's initializer, and
reads blocks of records with :func:`read_block`. :func:`submit`,
:func:`broke`, :func:`terminate` and :func:`wait` are how the parent hands
out blocks, notices a worker that died, ends a pool and stops waiting when
a pipeline is released.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import concurrent.futures.process
import concurrent.futures.thread
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import sys
import threading
import time
import types
import weakref
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data.errors import PipelineReleasedError
from jax_data.loaders.source_records import RecordError
from jax_data.loaders.source_records import RecordFormat
from jax_data.loaders.source_records import RecordReader
from jax_data.loaders.source_records import write_columns

USE_THREADS = "or use processes=False (worker threads)"

# The loaders' pools of worker processes, ended at the interpreter's exit
# before concurrent.futures joins them (see _end_pools_at_exit).
_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()
# Held to add to _LIVE_POOLS and _MANAGERS: the exit reads them while
# other threads may still add (a set that grows while it is listed raises).
_AT_EXIT_LOCK = threading.Lock()
_EXITING = threading.Event()
# The manager threads of the pools shut down (see shut_down), and how long
# the exit waits for them at most.
_MANAGERS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_EXIT_JOIN_SECONDS = 5.0


def shut_down(pool: concurrent.futures.Executor, **kwargs: Any) -> None:
  """``pool.shutdown(wait=False, **kwargs)``, its manager thread noted
  first for the interpreter's exit to wait for (shutdown forgets it)."""
  thread = getattr(pool, "_executor_manager_thread", None)
  if thread is not None:
    with _AT_EXIT_LOCK:
      _MANAGERS.add(thread)
  pool.shutdown(wait=False, **kwargs)


def _end_pools_at_exit() -> None:
  """Ends every worker process at the interpreter's exit, and starts no
  new ones. concurrent.futures joins its pools' threads from
  ``threading._register_atexit``, before any ``atexit`` hook, so a worker
  still reading a record (or stuck in one) held up the exit; registered
  after it, this runs first."""
  _EXITING.set()
  with _AT_EXIT_LOCK:
    pools = list(_LIVE_POOLS)
  for pool in pools:
    pool.end()
  # Then concurrent.futures' own hook wakes each pool's manager thread by
  # writing to its wake-up pipe, unlocked, while the thread of a pool shut
  # down just before (a pipeline released, a pool ended) may be closing
  # that pipe: the write then went to a closed descriptor ("OSError: Bad
  # file descriptor" at exit, 4 runs in 59 of a script that released its
  # pipeline and ended; 0 in 40 since), or to whatever had reused its
  # number. The threads of pools shut down end within moments (closing
  # the pipe marks it closed, and the hook skips it): waited for.
  deadline = time.monotonic() + _EXIT_JOIN_SECONDS
  with _AT_EXIT_LOCK:
    threads = list(_MANAGERS)
  for thread in threads:
    if thread is not threading.current_thread():
      thread.join(max(0.0, deadline - time.monotonic()))


_register = getattr(threading, "_register_atexit", None)
if _register is not None:  # CPython 3.9+
  _register(_end_pools_at_exit)
else:  # pragma: no cover
  atexit.register(_end_pools_at_exit)


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


def pickle_for_workers(source: Any, transform: Optional[Callable],
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
          "`python -`): run the script from a file, " + USE_THREADS)
  scan = workers and name is None and path is None
  buffer = io.BytesIO()
  pickler = _MainReferences(buffer) if scan else pickle.Pickler(buffer)
  try:
    pickler.dump((source, transform))
  except Exception as e:  # pylint: disable=broad-except
    try:  # which of the two: the advice differs
      pickle.dumps(source)
      culprit = ("the transform does not pickle", "define it at module "
                 "level")
    except Exception:  # pylint: disable=broad-except
      culprit = (f"the source ({type(source).__name__}) does not pickle",
                 "give it a __getstate__ that leaves out what it opened "
                 "(a file, a connection) and a __setstate__ that opens it "
                 "again by path in the worker")
    raise TypeError(
        "processes=True sends source and transform to worker processes, "
        f"but {culprit[0]}: {type(e).__name__}: {e}; {culprit[1]}, or use "
        "threads (processes=False)") from e
  if scan and pickler.names:
    names = ", ".join(f"__main__.{n}" for n in dict.fromkeys(pickler.names))
    raise TypeError(
        "processes=True sends source and transform to worker processes, "
        f"which find {names} by name in __main__; but this __main__ has no "
        "file (a notebook, `python -c`) that they could run again, so they "
        "cannot: define it in a module they can import (a .py file on "
        "sys.path, next to the notebook), " + USE_THREADS)
  return buffer.getvalue()


# In a worker process (processes=True) only: the reader of the loader's
# source, transform and first record's format, set once by the pool's
# initializer; or why they could not be unpickled.
_WORKER: Dict[str, Any] = {}


def start_worker(pickled: bytes, first: RecordFormat) -> None:
  """The initializer of a worker process: a loader that reads records.

  Ctrl-C (SIGINT to the process group) is ignored: the parent decides
  what it interrupts. A source that cannot be unpickled here fails each
  block with the reason, not the whole pool with none.
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if hasattr(signal, "pthread_sigmask"):  # blocked until now: see submit
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
  parent = multiprocessing.parent_process()
  if parent is not None:  # a parent killed by a signal ends its workers
    threading.Thread(target=_exit_with, args=(parent.sentinel,),
                     name="jax_data-parent", daemon=True).start()
  try:
    source, transform = pickle.loads(pickled)
  except Exception as e:  # pylint: disable=broad-except
    _WORKER["error"] = RecordError(
        "a worker process (processes=True) cannot unpickle source and "
        f"transform: {type(e).__name__}: {e}; define them in a module the "
        "worker processes can import (not in a notebook, nor under `if "
        "__name__ == '__main__':`), " + USE_THREADS)
    return
  _WORKER["reader"] = RecordReader(source, transform, "SourceDataLoader",
                                   first)


def _exit_with(sentinel: int) -> None:
  """Ends this worker process once its parent has ended (an idle worker
  would otherwise wait for work forever, holding its copy of the
  source)."""
  multiprocessing.connection.wait([sentinel])
  os._exit(0)


def worker_ready() -> None:
  """Nothing, in a worker process that started (:func:`start_worker`)."""


def read_block(indices: np.ndarray) -> List[np.ndarray]:
  """Records ``indices``, read and checked in a worker process, stacked per
  leaf."""
  if "error" in _WORKER:
    raise _WORKER["error"]
  reader = _WORKER["reader"]
  columns = [np.empty((indices.size,) + shape, dtype) for shape, dtype in
             zip(reader.first.shapes, reader.first.dtypes)]
  reader.fill(indices, np.arange(indices.size), columns)
  return columns


def submit(pool: concurrent.futures.Executor, fn: Callable, *args: Any
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


def broke(future: concurrent.futures.Future) -> bool:
  """Whether a done future failed because a worker process died, or was
  cancelled (its block is read again as well). A pipe's error counts too:
  the pool's feeder thread fails a block it was sending with it when the
  workers are ended meanwhile (another read's worker died, and its pool
  with it); a source's own errors come back as ``RecordError``."""
  return future.cancelled() or isinstance(
      future.exception(), (concurrent.futures.process.BrokenProcessPool,
                           ConnectionError))


def _read_alone(pool: concurrent.futures.Executor, records: np.ndarray,
                stop: Optional[concurrent.futures.Future]
                ) -> Tuple[concurrent.futures.Future, Optional[int]]:
  """Records ``records`` read by ``pool`` (one worker) one after another:
  a future of their leaves stacked (or of the error a record raised), and
  the position of the record that ended the worker, if one did (-1: the
  worker ended before it read any)."""
  started = submit(pool, worker_ready)
  wait([started], stop, cancel=False, pool=pool)
  if broke(started):
    return started, -1
  stacked: List[List[np.ndarray]] = []
  for at in range(records.size):
    future = submit(pool, read_block, records[at:at + 1])
    wait([future], stop, cancel=False, pool=pool)
    if broke(future):
      return future, at
    if future.exception() is not None:
      return future, None
    stacked.append(future.result())
  done: concurrent.futures.Future = concurrent.futures.Future()
  done.set_result([np.concatenate(leaves) for leaves in zip(*stacked)])
  return done, None


_TERMINATING = threading.Lock()
_TERMINATED: "weakref.WeakSet[concurrent.futures.Executor]" = weakref.WeakSet()


def terminate(pool: concurrent.futures.Executor) -> None:
  """Shuts a process pool down without waiting, and ends its workers, so
  that none stuck in a source outlives it (and holds up the interpreter's
  exit).

  Not Python 3.14's ``terminate_workers``: it shuts the pool down with
  ``cancel_futures=True``, and another thread's read waits for its blocks
  to be answered or to fail with BrokenProcessPool (then read again, see
  :meth:`WorkerPool.read`). Emulated on 3.11, a read of a thread running
  at the interpreter's exit then waited for ever (1 run in 7)."""
  # Once per pool: reads of several threads may each find the same pool
  # broken, or the watch of wait end it while they do. Two threads closing
  # the results' pipe below at once can both close its descriptor (a
  # Connection forgets its handle only after it closed it), the second time
  # a number the first close freed and something else may hold by then. A
  # CI run met a pool's wake-up pipe closed under it (BrokenPipeError in
  # shutdown, "Bad file descriptor" in its manager thread) in a test where
  # two reads meet one broken pool, and then that test process crashed.
  with _TERMINATING:
    if pool in _TERMINATED:
      return
    _TERMINATED.add(pool)
  # The pool's dict, taken before shutdown, which forgets it, and read
  # after: shutdown waits for a submit that is starting a worker, which
  # lands in the dict. Futures are not cancelled (see wait): those left
  # fail with BrokenProcessPool.
  processes = getattr(pool, "_processes", None)
  results = getattr(pool, "_result_queue", None)
  shut_down(pool)
  for process in list((processes or {}).values()):
    process.terminate()
  # A worker ended while it wrote a result leaves half a message in the
  # results' pipe, which the pool's manager thread then waits on for ever,
  # and the interpreter's exit with it (10 of 22 runs of a released
  # pipeline's process pool): the pool's own end for writing keeps the
  # pipe open. Closed (the pool never writes there), the rest reads as the
  # pipe's end once the workers are gone, and the thread ends the pool as
  # broken.
  writer = getattr(results, "_writer", None)
  if writer is not None:
    writer.close()


# How often a read of worker processes looks for one that died, and how
# long after it finds one it waits for the pool to fail its blocks before
# it ends the pool (see wait).
_WATCH_SECONDS = 0.5
_STUCK_SECONDS = 5.0


def _died(pool: concurrent.futures.Executor) -> bool:
  """Whether a worker process of ``pool`` has ended: the pool never ends
  one itself until it is shut down."""
  processes = getattr(pool, "_processes", None) or {}
  return any(process.exitcode is not None
             for process in list(processes.values()))


def wait(futures: Sequence[concurrent.futures.Future],
          stop: Optional[concurrent.futures.Future],
          cancel: bool = True,
          pool: Optional[concurrent.futures.Executor] = None) -> None:
  """Waits until every future is done, or ``stop`` is: then (if
  ``cancel``) the futures not started are cancelled, those running finish
  in the background, and :class:`~jax_data.PipelineReleasedError` is
  raised. (A process pool's futures are not cancelled: its manager thread
  may fail them at the same time, and fails on a cancelled one.)

  With ``pool``, the process pool the futures came from: a worker that
  died while it wrote a result (killed for memory, say) leaves half a
  message in the results' pipe, which the pool's manager thread then reads
  for ever, and the futures were never done. A pool that has not failed
  them within a few seconds of a worker's end is ended (:func:`terminate`),
  which fails them as broken: read again, as for any worker that died."""
  pending = [f for f in futures if not f.done()]
  died_at: Optional[float] = None
  ended = False
  while pending and not (stop is not None and stop.done()):
    concurrent.futures.wait(pending + ([] if stop is None else [stop]),
                            timeout=None if pool is None else _WATCH_SECONDS,
                            return_when=concurrent.futures.FIRST_COMPLETED)
    pending = [f for f in pending if not f.done()]
    if pending and pool is not None and not ended:
      if died_at is None:
        died_at = time.monotonic() if _died(pool) else None
      elif time.monotonic() - died_at > _STUCK_SECONDS:
        terminate(pool)
        ended = True
  if stop is not None and stop.done():
    for future in futures if cancel else ():
      future.cancel()
    raise stopped()


def exiting() -> bool:
  """Whether the interpreter exits: :func:`_end_pools_at_exit` ended the
  worker processes, or concurrent.futures' own exit hooks (which may run
  first, when it was imported after jax_data) stopped its pools from
  taking work."""
  return (_EXITING.is_set()
          or getattr(concurrent.futures.thread, "_shutdown", False)
          or getattr(concurrent.futures.process, "_global_shutdown", False))


def stopped() -> PipelineReleasedError:
  if exiting():
    return PipelineReleasedError(
        "reading records stopped: the interpreter is exiting")
  return PipelineReleasedError(
      "reading records stopped: the chain's pipeline was released")


class DaemonThreads(concurrent.futures.Executor):
  """Worker threads that the interpreter's exit does not wait for: a
  ``ThreadPoolExecutor``'s are joined at exit, so a worker stuck in a
  source's read (a stalled network file) held the process up for as long
  as the read took, after its pipeline was released. Like one, it refuses
  work once shut down or once the interpreter exits, and its threads end
  when it is shut down or dropped.

  Args:
    count: How many threads at most (one started for a ``submit`` that
      finds none idle, until there are as many).
    name: Their names' prefix.
  """

  def __init__(self, count: int, name: str):
    self._count = count
    self._name = name
    self._jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._threads: List[threading.Thread] = []
    self._idle = threading.Semaphore(0)  # a release per thread waiting
    self._shut = False
    # The threads hold the queue, not the pool: a pool dropped without
    # shutdown (its loader dropped) ends them.
    weakref.finalize(self, _end_threads, self._jobs, count)

  def submit(self, fn: Callable, /, *args: Any, **kwargs: Any
             ) -> concurrent.futures.Future:
    with self._lock:
      if self._shut or exiting():
        raise RuntimeError("cannot schedule new futures after shutdown")
      future: concurrent.futures.Future = concurrent.futures.Future()
      self._jobs.put((future, fn, args, kwargs))
      if not self._idle.acquire(timeout=0) and (
          len(self._threads) < self._count):
        thread = threading.Thread(
            target=_run_jobs, args=(self._jobs, self._idle), daemon=True,
            name=f"{self._name}_{len(self._threads)}")
        thread.start()
        self._threads.append(thread)
    return future

  def shutdown(self, wait: bool = True, *, cancel_futures: bool = False
               ) -> None:
    with self._lock:
      if not self._shut:
        self._shut = True
        for _ in self._threads:
          self._jobs.put(None)  # each thread ends after the jobs before
      threads = list(self._threads)
    if cancel_futures:
      while True:
        try:
          job = self._jobs.get_nowait()
        except queue.Empty:
          break
        if job is None:
          self._jobs.put(None)  # keep it for its thread, and stop here
          break
        job[0].cancel()
    if wait:
      for thread in threads:
        if thread is not threading.current_thread():
          thread.join()


def _run_jobs(jobs: "queue.SimpleQueue[Any]",
              idle: threading.Semaphore) -> None:
  """A thread of :class:`DaemonThreads`: runs the jobs of ``jobs`` until
  it takes ``None``."""
  while True:
    job = jobs.get()
    if job is None:
      return
    future, fn, args, kwargs = job
    if not future.set_running_or_notify_cancel():
      continue
    try:
      result = fn(*args, **kwargs)
    except BaseException as e:  # pylint: disable=broad-except
      future.set_exception(e)
    else:
      future.set_result(result)
    del job, future, fn, args, kwargs  # nothing kept while waiting
    idle.release()


def _end_threads(jobs: "queue.SimpleQueue[Any]", count: int) -> None:
  for _ in range(count):
    jobs.put(None)


class WorkerPool:
  """A loader's workers: threads or spawned processes, running while any
  of its cursors is open (:meth:`opened`, :meth:`closed`).

  Args:
    workers: How many (0: the reading thread reads).
    processes: Worker processes rather than threads.
    pickled: The source and transform (:func:`pickle_for_workers`), for
      processes.
    first: The first record's format, for processes.
    describe: Names the loader and its source, for messages.
  """

  def __init__(self, workers: int, processes: bool, pickled: bytes,
               first: RecordFormat, describe: str):
    self.workers = workers
    self.processes = processes and workers > 0
    self._pickled = pickled
    self._first = first
    self._describe = describe
    self._lock = threading.Lock()
    self._pool: Optional[concurrent.futures.Executor] = None
    self._own: set = set()  # pools of one read's own (see read)
    self._open = 0
    if self.processes:
      with _AT_EXIT_LOCK:
        _LIVE_POOLS.add(self)

  def end(self) -> None:
    """Ends the worker processes at once (the interpreter exits); reads
    in progress fail, and none starts another."""
    with self._lock:
      pool, self._pool = self._pool, None
      own, self._own = list(self._own), set()
    for ended in own + ([pool] if pool is not None and self.processes
                        else []):
      terminate(ended)

  @property
  def threads(self) -> Optional[concurrent.futures.Executor]:
    """The worker threads; None with processes or ``workers=0``."""
    return None if self.processes else self._pool

  def opened(self) -> None:
    """A cursor opened: the workers start if they are not running."""
    with self._lock:
      if self._pool is None and not self.processes and self.workers > 0:
        self._pool = DaemonThreads(self.workers, "jax_data-source")
      self._open += 1
    if self.processes:
      self._process_pool()

  def closed(self) -> None:
    """A cursor closed; the last one ends the workers."""
    with self._lock:
      self._open -= 1
      pool = self._pool if self._open == 0 else None
      if pool is not None:
        self._pool = None
    if pool is not None:
      shut_down(pool, cancel_futures=True)

  def read(self, unique: np.ndarray, first: np.ndarray,
           out: Sequence[np.ndarray],
           stop: Optional[concurrent.futures.Future]) -> None:
    """Reads records ``unique`` in the worker processes, a block per task,
    into rows ``first`` of ``out``; each block comes back stacked per leaf.

    A worker that dies (killed, out of memory, ``os._exit`` in the source)
    breaks its pool: a new pool reads the blocks lost again, one at a
    time, and a block that ends a worker again is named. A stop (a
    released pipeline) ends the pool's workers, still reading for nobody.
    """
    parts = np.array_split(np.arange(unique.size),
                           max(1, min(unique.size, 4 * self.workers)))
    pool = self._process_pool()
    futures = [submit(pool, read_block, unique[part]) for part in parts]
    try:
      wait(futures, stop, cancel=False, pool=pool)
    except PipelineReleasedError:
      if not all(f.done() for f in futures):
        self._retire(pool)
      raise
    lost = [i for i, future in enumerate(futures) if broke(future)]
    if lost:
      self._process_pool(broken=pool)  # a new one for the other reads
    # Each lost block read again by one worker of this read's own, a
    # record at a time: a block of another read that ends a worker cannot
    # break it and be blamed on this read's records, and the record that
    # ends it is the one it was reading.
    alone = self._own_pool() if lost else None
    try:
      for i in lost:
        futures[i], ended_at = _read_alone(alone, unique[parts[i]], stop)
        if ended_at is not None:
          self._name_ending_record(unique[parts[i]], ended_at, futures[i])
    finally:
      if alone is not None:
        self._end_own(alone)
    for part, future in zip(parts, futures):
      write_columns(self._describe, self._first.paths, unique[part],
                    first[part], out, future.result())

  def _name_ending_record(self, records: np.ndarray, ended_at: int,
                          future: concurrent.futures.Future) -> None:
    """Raises the error of a worker that ended while it read record
    ``records[ended_at]`` alone (-1: before it had started)."""
    if ended_at >= 0:
      what = (f"record {records[ended_at]} ended the worker process that "
              "read it, also a new worker that read it alone (os._exit, a "
              "crash in native code, memory exhausted?)")
    else:
      listed = records.tolist()
      named = (listed if len(listed) <= 8 else
               f"{listed[:8]}... ({len(listed)} records)")
      what = (f"worker processes ended abruptly while reading records "
              f"{named}, and a new worker ended before it read any: the "
              "workers fail to start. They start by importing the main "
              "script (multiprocessing's spawn), so a script's own loaders "
              "must be under if __name__ == '__main__':")
    raise RecordError(f"{self._describe}: {what}") from future.exception()

  def _process_pool(self, broken: Optional[concurrent.futures.Executor] = None
                    ) -> concurrent.futures.Executor:
    """The pool of worker processes, started if there is none (or only
    ``broken``, which is ended)."""
    with self._lock:
      if broken is not None and self._pool is broken:
        self._pool = None
      if self._pool is None and self._open > 0 and not exiting():
        self._pool = concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=start_worker, initargs=(self._pickled, self._first))
      pool = self._pool
    if broken is not None:
      terminate(broken)
    if pool is None:  # every chain closed
      raise stopped()
    return pool

  def _own_pool(self) -> concurrent.futures.Executor:
    """A pool of one worker process for one read's use alone, ended by
    :meth:`_end_own` (or at the interpreter's exit)."""
    with self._lock:
      if exiting() or self._open == 0:
        raise stopped()
      pool = concurrent.futures.ProcessPoolExecutor(
          1, mp_context=multiprocessing.get_context("spawn"),
          initializer=start_worker, initargs=(self._pickled, self._first))
      self._own.add(pool)
    return pool

  def _end_own(self, pool: concurrent.futures.Executor) -> None:
    with self._lock:
      self._own.discard(pool)
    terminate(pool)

  def _retire(self, pool: concurrent.futures.Executor) -> None:
    """Ends ``pool``; the next read starts another."""
    with self._lock:
      if self._pool is pool:
        self._pool = None
    terminate(pool)
