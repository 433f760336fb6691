"""A pipeline's chains on the host, and the chunks they produced.

A request names a chain and a chunk index; the answer is a pure function of
the two (``spec/CALLBACKS.md``, rule 1). A chunk asked for again (remat
replay, a state used twice, every device of a replicated ``pmap``) gets the
same data, and the chain never advances twice. Two things make that hold
with bounded memory:

* a few recent chunks per chain are kept, as futures, so that concurrent
  requests for one chunk wait for a single production; a chunk asked for
  with ``device_count=N`` stays until N requests took it, within a hard cap;
  the chunks of all chains together stay within a byte budget, least
  recently used first out, so memory does not grow with the number of
  chains created (:class:`~jax_data.serving.chain_records.Shelf`);
  a chain keeps ``keep`` served chunks besides the ``ahead`` produced
  ahead (none for random chains whose cursors reach any chunk directly,
  counter-based streams: a chunk asked for again is produced again, as
  cheaply), and chunks still awaited by some of ``device_count`` devices,
  up to ``keep + ahead + 2 * device_count`` (at most ``max_stored``: the
  loader's :class:`~jax_data.loaders.host_loader.StoreLimits`);
* the loader cursor's position is saved before each chunk, and the
  snapshots thin out logarithmically with age; a chunk no longer kept is
  produced again from the nearest earlier snapshot, or at once where the
  cursor reaches any chunk (counter-based and ordered streams over rows
  read by index)
  (:class:`~jax_data.serving.production.Producer`).

:class:`ChainStore` is the one owner of serving: it answers "chunk k of
chain c" and schedules the chunks that come after through the
:class:`Scheduler` it is given: the host's :class:`Prefetcher`, one
background thread that produces each chain's next chunk while the device
works through the current one. Its jobs run one at a time, in the order
they came, and claim the chunks they produce when they start: a request
finds its chunk either stored (done, or being produced: it waits for that
one production) or not, and then produces it itself rather than wait
behind other chains. :meth:`Prefetcher.close` ends the thread: jobs not
started yet are cancelled, and since none has claimed a chunk, no request
waits on one that will never be produced; the running job finishes on its
own.

Only NumPy runs here; nothing calls JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import warnings
from typing import Any
from typing import Callable
from typing import Deque
from typing import Dict
from typing import List
from typing import Optional
from typing import Protocol
from typing import Sequence
from typing import Set
from typing import Tuple

from jax_data.loaders.chains import Chunk
from jax_data.serving.chain_records import Answer
from jax_data.serving.chain_records import ChainRecord
from jax_data.serving.chain_records import ChainTable
from jax_data.serving.chain_records import Job
from jax_data.serving.chain_records import Shelf
from jax_data.serving.chain_records import settle
from jax_data.serving.cursor_budget import CursorBudget
from jax_data.serving.production import Producer
from jax_data.serving.production import interrupted


class Served:
  """Served chunks whose following ones are to be produced ahead (see
  :meth:`ChainStore.schedule_next`): their chains and indices, in two
  lists. A ``(chain, index)`` tuple per lane, 1,024 a refresh of 1,024
  lanes, lived until the production job ran, long enough for the garbage
  collector to go over each one and move it to an older generation."""

  __slots__ = ("records", "indices")

  def __init__(self):
    self.records: List[ChainRecord] = []
    self.indices: List[int] = []

  def add(self, record: ChainRecord, index: int) -> None:
    self.records.append(record)
    self.indices.append(index)

  def extend(self, records: Sequence[ChainRecord], indices: Sequence[int]
             ) -> None:
    self.records.extend(records)
    self.indices.extend(indices)

  def __len__(self) -> int:
    return len(self.records)


class Scheduler(Protocol):
  """Where the store runs work in the background (:class:`Prefetcher`)."""

  def submit(self, run: Callable[[], None],
             cancel: Callable[[BaseException], None]) -> bool:
    """Queues ``run``; False if closed."""

  def wait_idle(self, timeout: float) -> bool:
    """Whether the queue emptied within ``timeout`` seconds."""

  def close(self, error: BaseException) -> None:
    """Cancels the jobs not started with ``error``."""

  def join(self, timeout: float) -> None:
    """Waits up to ``timeout`` seconds for the running job (after
    :meth:`close`)."""


@dataclasses.dataclass
class _Job:
  run: Callable[[], None]
  cancel: Callable[[BaseException], None]


class Prefetcher:
  """One background thread that runs production jobs in order.

  Args:
    owner: What the jobs serve (a loader), for messages.
    name: The thread's name.
  """

  def __init__(self, owner: str = "", name: str = "jax_data-prefetch"):
    self._owner = owner
    self._name = name
    self._jobs: Deque[_Job] = collections.deque()
    self._changed = threading.Condition()
    self._thread: Optional[threading.Thread] = None
    self._closed = False
    self._running = False

  def submit(self, run: Callable[[], None],
             cancel: Callable[[BaseException], None]) -> bool:
    """Queues ``run()``; if the prefetcher closes before it starts,
    ``cancel(error)`` is called instead.

    Returns:
      False, and nothing is queued, if the prefetcher is closed.
    """
    with self._changed:
      if self._closed:
        return False
      self._jobs.append(_Job(run, cancel))
      if self._thread is None:
        # A daemon: the interpreter's exit does not wait for it.
        self._thread = threading.Thread(target=self._work, name=self._name,
                                        daemon=True)
        self._thread.start()
      self._changed.notify_all()  # the thread, and wait_idle's waiters
    return True

  def _work(self) -> None:
    while True:
      with self._changed:
        while not self._jobs and not self._closed:
          self._changed.wait()
        if not self._jobs:
          return
        job = self._jobs.popleft()
        self._running = True
      try:
        job.run()
      except Exception as e:  # pylint: disable=broad-except
        # A job answers its requests' failures itself; one that raises
        # (housekeeping) must not end the thread, and with it every later
        # job: they would queue for ever.
        warnings.warn(f"jax_data: background work for {self._owner} "
                      f"failed and was skipped: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=1)
      finally:
        # Not kept while waiting for the next: a finished job's closure
        # holds its host, which must be collectable once its pipeline is
        # dropped.
        del job
        with self._changed:
          self._running = False
          self._changed.notify_all()

  def wait_idle(self, timeout: float) -> bool:
    """Waits up to ``timeout`` seconds until no job is queued or running
    (for tests and diagnostics); whether that happened. Once closed, the
    jobs queued are cancelled, and the one running (a release does not
    wait for it) is still waited for: it holds its chains' cursors."""
    with self._changed:
      return self._changed.wait_for(
          lambda: not self._running and (self._closed or not self._jobs),
          timeout)

  def join(self, timeout: float) -> None:
    """Waits up to ``timeout`` seconds for the thread to end (after
    :meth:`close`)."""
    thread = self._thread
    if thread is not None and thread is not threading.current_thread():
      thread.join(timeout)

  def close(self, error: BaseException) -> None:
    """Cancels the jobs not started with ``error``; the thread ends after
    the running one. Idempotent; does not wait."""
    with self._changed:
      self._closed = True
      jobs, self._jobs = list(self._jobs), collections.deque()
      self._changed.notify_all()
    for job in jobs:
      job.cancel(error)


def _skip(error: BaseException) -> None:
  del error  # a housekeeping job cancelled: nothing waits for it


def _untrimmed(queued: threading.Event, error: BaseException) -> None:
  del error  # a job that was to trim cancelled: the next one may
  queued.clear()


class ChainStore:
  """Serves the chunks of one pipeline's chains.

  Args:
    chains: The pipeline's chains.
    cycle: Chunks per pass of ordered chains whose requests wrap around
      (full-data passes); None for random chains.
    verify_calls: Warn when a chunk is produced again because a request
      came for one no longer stored (a state used twice).
    scheduler: Runs the productions ahead and the housekeeping in the
      background; None: chunks are produced when asked for.
  """

  def __init__(self, chains: ChainTable, cycle: Optional[int] = None,
               verify_calls: bool = False,
               scheduler: Optional[Scheduler] = None):
    self._chains = chains
    self.name = chains.name
    self.cycle = cycle
    self._limits = chains.loader.store_limits
    self._lock = threading.Lock()
    self._shelf = Shelf(chains.layout, self._limits, chains.keep)
    self._held = CursorBudget()
    # The release's error, once released: then nothing is claimed ahead.
    self._released: Optional[BaseException] = None
    self._producer = Producer(chains.layout, self.name, self._limits,
                              self._held, verify_calls)
    self._scheduler = scheduler
    self._stopped: Optional[Scheduler] = None  # closed by stop_prefetching
    self._trim_queued = threading.Event()
    self.removals = 0  # chains taken out so far

  def remove(self, number: int) -> None:
    """Takes a chain out of the pipeline and closes its cursor."""
    record = self._chains.pop(number)
    self.removals += 1  # once it is out: groups found later lack it
    if record is None:
      return
    with self._lock:
      for index in list(record.chunks):
        self._shelf.drop(record, index)
    record.close(blocking=True)
    self._held.forget(record.number)

  def reads_in_place(self, lanes: int) -> bool:  # see Shelf's
    return self._shelf.reads_in_place(lanes)

  # -- serving ------------------------------------------------------------

  def chunks(self, wanted: Sequence[Tuple[int, int]], device_count: int = 1,
             defer: Optional[Served] = None,
             into: Optional[Sequence[Chunk]] = None) -> List[Chunk]:
    """Chunk ``index`` of chain ``chain`` for each ``(chain, index)``.

    The chunks not stored yet are produced now, those of chains whose
    cursors produce together in one call (vmapped counter-based chains:
    one draw of all their indices, one read of all their rows), even where
    a job queued behind other productions would produce them later.

    ``into``: compiled code's buffers for each ``(chain, index)``. In a
    request too large to keep chunks ahead for (:meth:`reads_in_place`),
    the chunks of counter-based chains are read straight into them, neither
    stored nor produced ahead, and returned as views of them.
    ``device_count`` requests are expected for each chunk (one per device
    of a replicated state); it is kept until they all came, within a cap.

    The next chunks of every chain (:meth:`Shelf.ahead`) are scheduled now,
    or, if ``defer`` is given and the chunks were ready when asked for or
    are several, appended to it for :meth:`schedule_next` after the
    caller's copy, which they would compete with.

    Raises:
      HostLoaderError: the loader failed (the first failure in lane
        order); a later request tries the failed chunks again, and so does
        this one where it found a chunk being produced ahead, before any
        request, which then failed (the loader may have recovered since
        that production began).
    """
    in_place = (into is not None and device_count == 1
                and self._shelf.reads_in_place(len(wanted)))
    # Per (chain, index): record, index, future, ready, stored.
    claims: List[Tuple[ChainRecord, int, Any, bool, bool]] = []
    joined: Set[int] = set()  # lanes that found a production ahead
    mine, direct, targets = [], {}, {}
    try:
      self._claim(wanted, device_count, into, in_place, claims, mine,
                  direct, targets, joined)
      if mine:
        self._producer.produce_many(mine, targets)
    except BaseException as e:  # Ctrl-C between a claim and its answer
      self._abandon(mine, e)
      raise
    failed = [lane for lane in sorted(joined)
              if claims[lane][2].exception() is not None]
    if failed:
      self._claim_again(claims, failed, device_count)
    failure = None
    for record, index, future, _, stored in claims:
      if future.exception() is not None:
        if stored:  # a later request tries again
          with self._lock:
            self._shelf.forget(record, index, future)
        failure = failure or future.exception()
    now = Served()
    for record, index, _, ready, stored in claims:
      if not stored or (in_place and record.regenerates):
        continue  # read in place next time too: nothing ahead
      # Several lanes: their copies are many short calls that need the GIL
      # the production would hold; the next chunks wait for them too.
      later = defer is not None and (ready or len(claims) > 1)
      (defer if later else now).add(record, index)
    self.schedule_next(now)
    if failure is not None:
      raise failure
    return [future.result() for _, _, future, _, _ in claims]

  def _claim(self, wanted: Sequence[Tuple[int, int]], device_count: int,
             into: Optional[Sequence[Chunk]], in_place: bool,
             claims: List[Tuple[ChainRecord, int, Any, bool, bool]],
             mine: List[Job], direct: Dict[Tuple[int, int], Job],
             targets: Dict[int, Chunk], joined: Set[int]) -> None:
    """Claims the chunks of :meth:`chunks`: appends each one's claim to
    ``claims``, and the jobs this request must produce itself to ``mine``
    as soon as they are claimed (see :meth:`_abandon`); adds to ``joined``
    the lanes whose chunk this request found being produced ahead of any
    request (each device's request of a replicated state, not only the
    first)."""
    for lane, (chain, index) in enumerate(wanted):
      record = self._chains.record(chain)
      if index < 0:
        raise ValueError(
            f"chunk={index} of chain {chain} requested: a state's chunk "
            "counter is an int32 that only grows, so it is negative only "
            "in a state built by hand or once it has wrapped, past "
            "2**31 - 1 chunks of cached_batches_count batches each; a "
            "chain goes on past that from a new init_fn state")
      with self._lock:
        stored = not (in_place and record.regenerates
                      and index not in record.chunks)
        if not stored:
          record.requested = index  # the shelf's claim notes it otherwise
        if stored:
          future, produce = self._guarded_claim(record, index, device_count)
          if produce:
            mine.append((record, index, future))
          elif record.chunks[index].ahead:  # every device's request
            joined.add(lane)
      if stored:
        claims.append((record, index, future, future.done(), True))
        continue
      job = direct.get((chain, index))
      if job is None:  # the same chunk twice in a request: read once
        job = direct[(chain, index)] = (record, index, Answer())
        targets[id(job[2])] = into[lane]
        mine.append(job)
      claims.append((record, index, job[2], False, False))

  def _claim_again(self, claims: List[Tuple[ChainRecord, int, Any, bool,
                                             bool]],
                   lanes: Sequence[int], device_count: int) -> None:
    """Claims and produces once more the chunks of ``lanes``: each was
    being produced ahead when this request claimed it, and that production
    failed. It may have begun before the loader recovered; a request that
    came after the recovery gets a chunk produced after it. The first of a
    replicated state's requests to come here claims the chunk anew, for
    all ``device_count`` requests; the others join that claim."""
    mine: List[Job] = []
    try:
      for lane in lanes:
        record, index, future, _, _ = claims[lane]
        with self._lock:
          if self._released is not None:  # its error is the answer
            released = Answer()
            settle(released, error=self._released)
            claims[lane] = (record, index, released, False, False)
            continue
          self._shelf.forget(record, index, future)
          again, produce = self._guarded_claim(record, index, device_count)
        if produce:
          mine.append((record, index, again))
        claims[lane] = (record, index, again, False, True)
      if mine:
        self._producer.produce_many(mine)
    except BaseException as e:  # Ctrl-C between a claim and its answer
      self._abandon(mine, e)
      raise

  def _guarded_claim(self, record: ChainRecord, index: int,
                     device_count: int) -> Tuple[Any, bool]:
    """``Shelf.claim`` of chunk ``index`` of ``record`` (with the store's
    lock held): if Ctrl-C lands inside it, the entry the claim put is
    settled with the interrupt and forgotten before it goes on, so that
    no chunk is left on the shelf that no one will answer."""
    before = record.chunks.get(index)
    try:
      return self._shelf.claim(record, index, device_count)
    except BaseException as e:
      entry = record.chunks.get(index)
      if entry is not None and entry is not before:  # put by it
        settle(entry.future, error=interrupted(e))
        self._shelf.forget(record, index, entry.future)
      raise

  def _abandon(self, mine: Sequence[Job], error: BaseException) -> None:
    """Settles the futures of the jobs this request claimed and left
    without an answer, when something interrupted it (Ctrl-C between a
    claim and its answer), and forgets the failed ones: a future left
    unsettled on the shelf made every later request for its chunk wait
    forever. A later request produces them again."""
    for record, index, future in mine:
      settle(future, error=interrupted(error))  # unless answered
      if future.exception() is not None:
        with self._lock:
          self._shelf.forget(record, index, future)

  def ready(self, chains: Sequence[int], indices: Sequence[int],
            defer: Served) -> Optional[List[Chunk]]:
    """:meth:`chunks` of chunk ``indices[i]`` of chain ``chains[i]`` for a
    one-device request whose chunks were all produced before it came (the
    common refresh), with the least bookkeeping: the chains and indices go
    to ``defer`` (see :meth:`chunks`). None, and nothing claimed, if one is
    not ready."""
    records = [self._chains.get(chain) for chain in chains]
    with self._lock:
      chunks = self._shelf.claim_done(records, indices)
    if chunks is not None:
      defer.extend(records, indices)
    return chunks

  def note_lanes(self, lanes: int) -> None:
    """A request asked for ``lanes`` chunks at once: the store keeps room
    for ``keep + ahead`` chunks per lane of the largest such request (the
    served ones kept and those produced ahead)."""
    self._shelf.lanes = max(self._shelf.lanes, lanes)
    # Each lane's chunks produced ahead and the one served.
    self._producer.reserve_buffers(
        (self._shelf.ahead() + 1) * self._shelf.lanes)

  def _following(self, index: int) -> int:
    """The chunk requested after chunk ``index``."""
    following = index + 1
    return following if self.cycle is None else following % self.cycle

  def schedule_next(self, served: Served, trim: bool = False) -> None:
    """Queues one job that claims and produces the :meth:`Shelf.ahead`
    chunks after each of the ``served`` not stored yet, then, with
    ``trim``, does the housekeeping of :meth:`trim_later`."""
    scheduler = self._scheduler
    if scheduler is None or not served:
      if trim:
        self.trim_later()
      return
    trims = trim and not self._trim_queued.is_set()
    if trims:
      self._trim_queued.set()
    if not scheduler.submit(
        functools.partial(self._produce_ahead, served, trims),
        functools.partial(_untrimmed, self._trim_queued) if trims else _skip):
      self._trim_queued.clear()

  def _produce_ahead(self, served: Served, trim: bool) -> None:
    try:
      # A chain asked for another chunk since (the job ran late): that
      # request's own job produces what follows it.
      records, indices = [], []
      for record, index in zip(served.records, served.indices):
        if record.requested == index:
          records.append(record)
          indices.append(index)
      for _ in range(self._shelf.ahead()):
        indices = [self._following(index) for index in indices]
        with self._lock:  # none once released: they would keep the loader
          jobs = ([] if self._released is not None
                  else self._shelf.claim_ahead(records, indices))
        if jobs:
          self._producer.produce_many(jobs)
    finally:
      if trim:
        self._trim_queued_job()

  # -- housekeeping -------------------------------------------------------

  def trim_later(self) -> None:
    """Has the scheduler run :meth:`trim_idle` after the productions
    queued now: it may drop a ``tf.data`` iterator of another chain, which
    can take seconds, and a request never waits for it. Without a
    scheduler it runs here, after the request's chunks were produced."""
    scheduler = self._scheduler
    if scheduler is None:
      self.trim_idle()
    elif not self._trim_queued.is_set():
      self._trim_queued.set()
      if not scheduler.submit(self._trim_queued_job, _skip):
        self._trim_queued.clear()

  def _trim_queued_job(self) -> None:
    self._trim_queued.clear()
    self.trim_idle()

  def trim_idle(self) -> None:
    """Trims the cursors of chains whose chunks were all dropped for room,
    then those beyond the budget (:meth:`CursorBudget.trim`).
    Housekeeping: producing never trims."""
    with self._lock:
      idle, self._shelf.idle = self._shelf.idle, []
      lanes = self._shelf.lanes
    self._held.trim(idle, self._chains.get, self._limits, lanes)

  def wait_idle(self, timeout: float) -> bool:
    """Whether the scheduler ran the jobs queued within ``timeout`` s;
    after :meth:`stop_prefetching`, whether the job it was running ended
    (a release does not wait for it)."""
    scheduler = self._scheduler or self._stopped
    return scheduler is None or scheduler.wait_idle(timeout)

  # -- release ------------------------------------------------------------

  def stop_prefetching(self, error: BaseException) -> Optional[Scheduler]:
    """Closes the scheduler (jobs not started get ``error``) and returns
    it, to join; chunks are then produced when asked for."""
    scheduler, self._scheduler = self._scheduler, None
    if scheduler is not None:
      scheduler.close(error)
      self._stopped = scheduler  # for wait_idle
    return scheduler

  def release(self, error: BaseException) -> None:
    """Drops the loader and every chain: requests still waiting for a chunk
    get ``error``, the scheduler's jobs not started the store's released
    error, and cursors are cancelled and closed (a cursor that is
    producing stops soon and closes when it is done). Idempotent; does not
    wait for a production."""
    records = self._chains.release()
    with self._lock:
      self._released = error
      self._producer.release(
          f"this pipeline over {self.name} was released by its release_fn; "
          "create a new pipeline to draw more data")
      waiting = [entry.future for record in records
                 for entry in record.chunks.values()]
      for record in records:
        record.chunks.clear()
      self._shelf.clear()
    self._held.clear()
    for future in waiting:
      settle(future, error=error)
    self.stop_prefetching(self._chains.closing_error())
    for record in records:
      record.cursor.cancel()  # a production stops soon, and raises
      record.close(blocking=False)  # if producing, it closes when done
