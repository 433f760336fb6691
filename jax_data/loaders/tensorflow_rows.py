"""Where the rows of the chains of
:class:`~jax_data.loaders.tensorflow_loader.TensorflowDataLoader` come from.

Either the pipeline, read in order pass after pass
(:mod:`jax_data.loaders.tensorflow_reads`, through iterators made by
:func:`in_order`, read by a :class:`Reader` in the loader's
:class:`ReadThreads` and dropped in a background thread by an
:class:`IteratorCloser`, since dropping one can take seconds), or NumPy
arrays read once (:class:`MemoryRows`, ``in_memory=True``). The cursors of
:mod:`jax_data.loaders.tensorflow_streams` take rows from them.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any
from typing import Callable
from typing import Deque
from typing import Hashable
from typing import Iterator
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple
from typing import Union

import numpy as np
import tensorflow as tf

from jax_data.errors import PipelineReleasedError
from jax_data.loaders.chains import LaterRows
from jax_data.loaders.chains import LeafFormat
from jax_data.loaders.gather import Gatherer
from jax_data.loaders.gather import is_run
from jax_data.loaders.narrowing import cannot_hold
from jax_data.loaders.narrowing import first_outside
from jax_data.loaders.narrowing import narrows
from jax_data.streams.sampling import Held
from jax_data.streams.sampling import HeldRows
from jax_data.streams.sampling import ObservationRange

Rows = List[np.ndarray]  # one array per leaf, observations first


@dataclasses.dataclass(frozen=True)
class Reading:
  """What reading a loader's pipeline needs to know.

  Attributes:
    formats: The loader's leaves, in order, with their dtypes.
    name: The loader's repr, for messages.
    count: Observations in one pass; None if unknown.
    count_stated: Whether ``count`` was given by the user (the pipeline's
      own length is unknown).
    threads: The threads that the loader's chains read in.
    paths: The leaves' key paths, for messages.
  """
  formats: Tuple[LeafFormat, ...]
  name: str
  count: Optional[int]
  count_stated: bool
  threads: "ReadThreads" = dataclasses.field(
      default_factory=lambda: ReadThreads(), compare=False, repr=False)
  paths: Tuple[str, ...] = ()

  def reader(self) -> "Reader":
    """A new :class:`Reader` for a chain's iterators, in ``threads``."""
    return Reader(self.threads)

  def next_rows(self, iterator: Iterator, fresh: bool = False,
                reader: Optional["Reader"] = None) -> Rows:
    """The next element of an iterator over the pipeline, as NumPy arrays
    in the loader's dtypes (read-only views where no conversion is due);
    ``fresh``: the iterator has yielded nothing yet. With a ``reader``,
    read in its thread: a release need not wait for the pipeline."""
    try:
      element = next(iterator) if reader is None else reader.next(iterator)
    except StopIteration:
      if fresh:
        raise RuntimeError(
            f"the pipeline of {self.name} is empty on this pass: it yielded "
            "no elements, though it had some when the loader was created; "
            "a pipeline must yield the same elements on every pass (e.g. "
            "from_generator needs a function that makes a new generator on "
            "every call)") from None
      raise RuntimeError(
          f"the pipeline of {self.name} ended early; does it yield fewer "
          "elements on later passes?") from None
    except tf.errors.FailedPreconditionError as e:
      if not self.count_stated:
        raise
      raise ValueError(
          f"observation_count={self.count} does not fit the pipeline: "
          f"{e.message}") from e
    return self.as_rows(element)

  def as_rows(self, element: Any) -> Rows:
    """An element of the pipeline as NumPy arrays in the loader's dtypes."""
    leaves = []
    for k, (fmt, tensor) in enumerate(zip(self.formats,
                                          tf.nest.flatten(element))):
      array = np.asarray(tensor)  # a read-only view: no copy, unlike .numpy()
      if array.dtype != fmt.dtype:
        if narrows(array.dtype, fmt.dtype):
          self._check_fits(k, array, fmt.dtype)
        array = array.astype(fmt.dtype)
      leaves.append(array)
    return leaves

  def _check_fits(self, k: int, array: np.ndarray, dtype: np.dtype) -> None:
    """Raises if leaf ``k`` of an element holds integers that the loader's
    ``dtype`` (JAX's) cannot: the cast would wrap them without a word."""
    found = first_outside(array, dtype)
    if found is not None:
      path = self.paths[k] if k < len(self.paths) else f"leaf {k}"
      raise ValueError(
          f"the pipeline of {self.name} yields {path} = "
          f"{cannot_hold(found[1], dtype)} (the pipeline's map can make "
          "them)")


# How often a read that waits for its element looks at its stop event.
_STOP_POLL_S = 0.05
# Seconds a reading thread waits for another job before it ends.
_IDLE_S = 2.0
_RELEASED = ("this pipeline was released by its release_fn while a chunk "
             "was read from its tf.data pipeline")


def released_error() -> PipelineReleasedError:
  """The error of a read given up on because its pipeline was released."""
  return PipelineReleasedError(_RELEASED)


class ReadThreads:
  """The threads that run a loader's :class:`Reader` jobs: as many as
  readers wait for one at once, started when a job finds none idle, each
  ending after ``_IDLE_S`` seconds without a job (a job wakes the thread
  idle the shortest time, so that those beyond what the jobs need end).
  The host reads its chains one after another, so one or two threads
  read for any number of chains. A thread that has called into TensorFlow
  keeps memory of its own there: 1,024 iterators read each in a thread of
  its own held 686 MiB, read by one or two threads 161-165 MiB
  (TensorFlow 2.21, 2 cores). A read that never returns keeps its thread;
  the next job starts another."""

  def __init__(self):
    self._lock = threading.Lock()
    self._ready: Deque[Reader] = collections.deque()  # to run a job of
    # The waits of idle threads, the one idle the shortest time last.
    self._sleeping: List[threading.Condition] = []
    self._idle = 0  # threads not running a job
    self.started = 0  # threads started so far (for tests)

  def schedule(self, reader: "Reader") -> None:
    """Runs ``reader``'s next job in one of the threads.

    Raises:
      RuntimeError: no thread was idle and none could be started (the
        interpreter is exiting, or too many threads); the job is not
        queued.
    """
    with self._lock:
      self._ready.append(reader)
      if self._idle >= len(self._ready):
        if self._sleeping:
          self._sleeping.pop().notify()
        return
      self._idle += 1
      self.started += 1
    try:
      threading.Thread(target=self._work, name="jax_data-tf-read",
                       daemon=True).start()
    except BaseException:
      with self._lock:
        self._idle -= 1
        self.started -= 1
        try:
          self._ready.remove(reader)
        except ValueError:  # an idle thread took it after all
          return
      raise

  def _work(self) -> None:
    wait = threading.Condition(self._lock)
    reader, more = None, False
    while True:
      with self._lock:
        if reader is not None:
          self._idle += 1
          if more:  # after the jobs of the readers that waited
            self._ready.append(reader)
          reader = None
        while not self._ready:
          self._sleeping.append(wait)
          if not wait.wait(_IDLE_S):
            if wait in self._sleeping:
              self._sleeping.remove(wait)
            if not self._ready:
              self._idle -= 1
              return
        reader = self._ready.popleft()
        self._idle -= 1
      more = reader.run_next()


class Reader:
  """Reads the elements of a chain's iterators in the threads of its
  loader's :class:`ReadThreads`, one job after another in the order they
  came, so that a read can be given up on: :meth:`cancel` (a release)
  makes a read that waits for its element, and every later one, raise
  :class:`~jax_data.PipelineReleasedError` at once. A pipeline's ``next``
  cannot be interrupted; the thread finishes its read, and being a daemon
  does not hold up the interpreter's exit. One chain's 2,000-step call
  (20 reads of 6,400 rows) took 1-3 % longer than with reads in the
  caller's thread; with a thread started per read, 3-20 %."""

  def __init__(self, threads: ReadThreads):
    self._threads = threads
    self._lock = threading.Lock()
    self._jobs: Deque[Tuple[Callable[[], Any], Optional[threading.Event],
                            Optional[List[Any]]]] = collections.deque()
    self._scheduled = False  # a job of its waits for or runs in a thread
    self._stop = threading.Event()

  def next(self, iterator: Iterator) -> Any:
    """``next(iterator)``, read in a thread of the reader's."""
    if self._stop.is_set():
      raise released_error()
    done, outcome = threading.Event(), []
    self._put((iterator.__next__, done, outcome))
    del iterator
    while not done.wait(_STOP_POLL_S):
      if self._stop.is_set():
        raise released_error()
    ok, value = outcome.pop()
    if not ok:
      try:
        raise value
      finally:
        # The error's traceback holds this frame: without its reference
        # to the error, the two (and the iterator that the traceback's
        # frames hold) go when the caller drops the error, not at the
        # next garbage collection.
        del value
    return value

  def submit(self, work: Callable[[], None]) -> None:
    """Runs ``work()`` in a thread of the reader's, after the reads and
    work queued before; nothing waits for it, and it handles its own
    errors."""
    self._put((work, None, None))

  def _put(self, job: Tuple[Callable[[], Any], Optional[threading.Event],
                            Optional[List[Any]]]) -> None:
    with self._lock:
      self._jobs.append(job)
      if self._scheduled:
        return
      self._scheduled = True
    try:
      self._threads.schedule(self)
    except BaseException:
      with self._lock:  # not queued: the job was its only one
        self._jobs.clear()
        self._scheduled = False
      raise

  def run_next(self) -> bool:
    """Runs its oldest job (in a thread of its :class:`ReadThreads`);
    returns whether it has another."""
    with self._lock:
      work, done, outcome = self._jobs.popleft()
    try:
      value = work()
      if done is not None:
        outcome.append((True, value))
    except BaseException as e:  # pylint: disable=broad-except
      if outcome is not None:
        outcome.append((False, e))
      else:  # submitted work handles its errors: report a bug, go on
        threading.excepthook(threading.ExceptHookArgs(
            (type(e), e, e.__traceback__, threading.current_thread())))
    finally:
      # The iterator's last reference may be the job's; the thread
      # drops it, not the caller.
      del work
      value = None
    if done is not None:
      done.set()
    with self._lock:
      self._scheduled = bool(self._jobs)
      return self._scheduled

  def cancel(self) -> None:
    self._stop.set()


def in_order(dataset: tf.data.Dataset, one_of_many: bool = False
             ) -> Iterator:
  """An iterator over :func:`chain_dataset` of ``dataset``."""
  return iter(chain_dataset(dataset, one_of_many))


def chain_dataset(dataset: tf.data.Dataset, one_of_many: bool = False
                  ) -> tf.data.Dataset:
  """``dataset`` as a chain's iterator reads it: in ``deterministic``
  order, and without the prefetch TensorFlow adds at the end of a
  pipeline (``inject_prefetch``) unless the pipeline's own options ask for
  it. A thread of jax_data's reads the elements ahead already; with
  TensorFlow's prefetch and autotuning, each chain's iterator kept one
  more thread and batch, and dropping iterators slowed down with their
  number: 64 took 3 s, 256 took 80 s (one 41 s) and 1,024 did not end in
  400 s, where a process with 1,024 chains waited at exit; without it 256
  took 0.04 s and 1,024 0.16 s (TensorFlow 2.21, 2 cores).

  ``one_of_many``: the iterator of one chain, of which there may be
  many (``share_reads=False``): autotuning is off too, unless the
  pipeline's options set it (``AUTOTUNE`` parallelism then stays at the
  cores' count, up to 16). Each iterator's tuner kept a thread and tuned
  as if its pipeline had the machine alone; 1,024 iterators of
  ``from_tensor_slices(...).batch(640)`` held 3,072 threads and 201 MiB
  with it, 2,048 threads and 182 MiB without, and a read took 195 µs
  instead of 342 µs."""
  options = tf.data.Options()
  options.deterministic = True
  own = dataset.options()
  if own.experimental_optimization.inject_prefetch is None:
    options.experimental_optimization.inject_prefetch = False
  if one_of_many and own.autotune.enabled is None:
    options.autotune.enabled = False
  return dataset.with_options(options)


class IteratorCloser:
  """Drops ``tf.data`` iterators in a background thread of its own.

  Dropping an iterator stops its pipeline's threads and can take seconds
  (more inside a host callback's thread, while compiled code waits), so
  the cursors never drop one where they run: the host trims an idle chain's
  cursor and a request must not wait for that. The thread starts when an
  iterator comes and ends when none is left; it is not a daemon, so the
  interpreter's exit waits for it (no TensorFlow code runs while the
  interpreter finalizes).

  Attributes:
    dropped: Iterators dropped so far (for tests and diagnostics).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._waiting: Deque[Iterator] = collections.deque()
    self._thread: Optional[threading.Thread] = None
    self.dropped = 0

  def close_later(self, iterators: List[Optional[Iterator]]) -> None:
    """Moves the iterators out of the list ``iterators`` and drops them in
    the background (Nones are skipped). The list must hold the caller's
    only references: one left elsewhere could be the last to go, and the
    iterator would then be dropped there."""
    with self._lock:
      self._waiting.extend(i for i in iterators if i is not None)
      iterators.clear()
      if self._thread is not None or not self._waiting:
        return
      thread = threading.Thread(target=self._work, daemon=False,
                                name="jax_data-tf-iterator-closer")
      self._thread = thread
    try:
      thread.start()
    except RuntimeError:  # the interpreter is exiting: drop them here
      self._work()

  def pending(self) -> int:
    """Iterators waiting to be dropped."""
    with self._lock:
      return len(self._waiting)

  def _work(self) -> None:
    while True:
      with self._lock:
        if not self._waiting:
          self._thread = None
          return
        iterator = self._waiting.popleft()
      del iterator  # the last reference: TensorFlow deletes it now
      with self._lock:
        self.dropped += 1


class Wanted:
  """The element numbers of the chunks of chains read together, a row per
  chain, and the order the rows of the group's buffers take them in:
  chain after chain, or, ``interleaved`` (compiled code's buffers with the
  lane axis second), batch by batch, every chain's batch ``j`` before any
  batch ``j + 1``.

  Args:
    numbers: int64, a row per chain; or, for chains stepped together
      within one pass, :class:`~jax_data.streams.sampling.HeldRows`
      (numbers within the pass: sources that read by row number need no
      other, and int32 copies cost half).
    mb_size: The rows of a batch.
    interleaved: The order of the buffers' rows.
  """

  def __init__(self, numbers: Any, mb_size: int, interleaved: bool):
    self._within = numbers if isinstance(numbers, HeldRows) else None
    self._numbers = None if self._within is not None else numbers
    self._lanes, self._size = numbers.local.shape if self._within \
        is not None else numbers.shape
    self._run = mb_size if interleaved else self._size  # a lane's rows
    self._mb_size = mb_size
    self._interleaved = interleaved

  def __len__(self) -> int:
    return self._lanes

  @property
  def numbers(self) -> np.ndarray:
    """The element numbers, int64, a row per chain (made once)."""
    if self._numbers is None:
      self._numbers = self._within.numbers()
    return self._numbers

  def laid_out(self, interleaved: bool) -> "Wanted":
    """The same numbers, in the order of buffers laid out so."""
    if interleaved == self._interleaved:
      return self
    return Wanted(self._within if self._within is not None
                  else self._numbers, self._mb_size, interleaved)

  def least(self) -> int:
    """The least element number."""
    if self._within is not None:
      return int(self._within.local.min()) + self._within.base
    return int(self._numbers.min())

  def max_each(self) -> np.ndarray:
    """Each chain's greatest element number (int64)."""
    if self._within is not None:
      return self._within.max_each()
    return self._numbers.max(axis=1)

  def flat(self, minus: int = 0) -> np.ndarray:
    """Every element number less ``minus`` (int64), in the order of the
    buffers' rows: a new array."""
    if self._within is not None:
      return np.subtract(self._ordered(self._within.local),
                         minus - self._within.base, dtype=np.int64)
    return np.subtract(self._ordered(self._numbers), minus)

  def rows(self, count: int) -> np.ndarray:
    """The elements' row numbers in passes of ``count`` rows, in the order
    of the buffers' rows: where the chains stand in one pass, the numbers
    within it as they are."""
    if self._within is not None:
      return self._ordered(self._within.local)
    return np.remainder(self._ordered(self._numbers), count)

  def lane_of(self, at: np.ndarray) -> np.ndarray:
    """The chains of positions ``at`` of :meth:`flat`."""
    return at // self._run % self._lanes

  def _ordered(self, rows: np.ndarray) -> np.ndarray:
    if not self._interleaved:
      return rows.reshape(-1)
    return rows.reshape(self._lanes, -1, self._run).swapaxes(0, 1).reshape(-1)


def read_later(wanted: Wanted, shapes: Sequence[Tuple[int, ...]],
               gather: Callable[[Wanted, Rows], None]) -> LaterRows:
  """The reading of ``wanted``'s rows when served (see
  :class:`~jax_data.loaders.chains.LaterRows`): ``gather(wanted, out)``
  into the served buffers as one block of rows per leaf (leaves of
  ``shapes``), the numbers in their order.

  A group's chunks produced ahead then keep only their rows' numbers,
  read when served straight into compiled code's buffers rather than into
  the store's and copied (84 MB a refresh of 1,024 chains of 10 batches
  of 64 rows of 32 floats; a step of those chains in memory took 3.75 ms
  rather than 4.47, compute alone 1.0)."""

  def take(outs: Sequence[np.ndarray], interleaved: bool) -> None:
    # Laid out without gaps (LaterRows.read_into): views, not copies.
    flat = [(out.swapaxes(0, 1) if interleaved else out).reshape(
        (-1,) + tuple(shape)) for out, shape in zip(outs, shapes)]
    gather(wanted.laid_out(interleaved), flat)

  return LaterRows(take)


class MemoryRows:
  """A chain's observations held as NumPy arrays (``in_memory=True``).

  Rows are gathered by index; runs of consecutive rows, as ordered chains
  read them, are read-only views.
  """

  def __init__(self, arrays: Rows, shard: ObservationRange,
               gatherer: Gatherer):
    stop = shard.start + shard.count
    self._arrays = [array[shard.start:stop] for array in arrays]
    self._gatherer = gatherer
    self.count = shard.count
    # The same for the chains of one shard of one loader's arrays (alive
    # while they are).
    self._key = (MemoryRows, id(arrays), shard.start, shard.count,
                 id(gatherer))

  def restart(self, first: int, mark: Optional[int] = None) -> None:
    """Nothing to do: rows are read by index."""
    del first, mark

  def close(self) -> None:
    """Nothing to do: the arrays are the loader's."""

  def cancel(self) -> None:
    """Nothing to do: a gather is not given up on."""

  def held_bytes(self) -> int:
    """Nothing beyond the loader's arrays, which stay."""
    return 0

  def rows(self, wanted: np.ndarray, keep: Held, out: Rows) -> Rows:
    """The rows of stream elements ``wanted`` (numbered along passes)."""
    del keep
    return self.gather(wanted % self.count, out)

  def group_key(self) -> Hashable:
    """Equal for the chains of one shard of the loader's arrays, whose rows
    :meth:`rows_together` gathers at once."""
    return self._key

  @staticmethod
  def rows_together(sources: Sequence[MemoryRows], wanted: Wanted,
                    keeps: Sequence[Held], out: Rows,
                    later: Optional[Sequence[Tuple[int, ...]]] = None
                    ) -> Union[bool, LaterRows]:
    """:meth:`rows` of chains of one :meth:`group_key` at once (see
    :meth:`~jax_data.loaders.tensorflow_reads.PipelineRows.rows_together`):
    one gather of every chain's rows into ``out``, or, with ``later``,
    their reading when served (the arrays do not change)."""
    del keeps
    first = sources[0]

    def gather(wanted: Wanted, out: Rows) -> None:
      first._gatherer.take_all(list(zip(first._arrays, out)),  # pylint: disable=protected-access
                               wanted.rows(first.count))

    if later is not None:
      return read_later(wanted, later, gather)
    gather(wanted, out)
    return True

  def gather(self, flat: np.ndarray, out: Rows) -> Rows:
    """The rows ``flat`` of the chain's observations."""
    if is_run(flat):
      first = int(flat[0])
      return [array[first:first + flat.size] for array in self._arrays]
    self._gatherer.take_all(list(zip(self._arrays, out)), flat)
    return list(out)
