"""Producing chunks ahead of their requests, in one background thread.

While the device works through a chunk, the host produces the chain's next
one, so the next request finds it ready. Jobs run one at a time, in the
order they came; a request that finds its chunk still queued takes the job
(:meth:`Prefetcher.take`) and runs it itself rather than wait behind other
chains. :meth:`Prefetcher.close` ends the thread: jobs not started yet are
cancelled with an error, so that no request waits on a chunk that will
never be produced; the running job finishes on its own.

Pure Python; nothing calls JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable
from typing import Deque
from typing import FrozenSet
from typing import Hashable
from typing import Iterable
from typing import Optional


@dataclasses.dataclass
class _Job:
  keys: FrozenSet[Hashable]
  run: Callable[[], None]
  cancel: Callable[[BaseException], None]


class Prefetcher:
  """One background thread that runs production jobs in order.

  Args:
    name: The thread's name.
  """

  def __init__(self, name: str = "jax_data-prefetch"):
    self._name = name
    self._jobs: Deque[_Job] = collections.deque()
    self._changed = threading.Condition()
    self._thread: Optional[threading.Thread] = None
    self._closed = False
    self._running = False

  def submit(self, keys: Iterable[Hashable], run: Callable[[], None],
             cancel: Callable[[BaseException], None]) -> bool:
    """Queues ``run()`` under ``keys`` (what it produces: the chunks of
    several chains, produced together); if the prefetcher closes before it
    starts, ``cancel(error)`` is called instead.

    Returns:
      False, and nothing is queued, if the prefetcher is closed.
    """
    with self._changed:
      if self._closed:
        return False
      self._jobs.append(_Job(frozenset(keys), run, cancel))
      if self._thread is None:
        # A daemon: the interpreter's exit does not wait for it.
        self._thread = threading.Thread(target=self._work, name=self._name,
                                        daemon=True)
        self._thread.start()
      self._changed.notify_all()  # the thread, and wait_idle's waiters
    return True

  def take(self, key: Hashable) -> Optional[Callable[[], None]]:
    """Removes the queued job with ``key`` among its keys and returns its
    ``run``, for the caller to run now; None if it is not queued (running
    or done)."""
    with self._changed:
      for job in self._jobs:
        if key in job.keys:
          self._jobs.remove(job)
          self._changed.notify_all()  # for wait_idle
          return job.run
    return None

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
    (for tests and diagnostics); whether that happened."""
    with self._changed:
      return self._changed.wait_for(
          lambda: self._closed or not (self._jobs or self._running), timeout)

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
