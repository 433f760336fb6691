"""Producing chunks ahead of their requests, in one background thread.

While the device works through a chunk, the host produces the chain's next
one, so the next request finds it ready. Jobs run one at a time, in the
order they came. :meth:`Prefetcher.close` ends the thread: jobs not started
yet are cancelled with an error, so that no request waits on a chunk that
will never be produced; the running job finishes first.

Pure Python; nothing calls JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable
from typing import Deque
from typing import Optional


@dataclasses.dataclass
class _Job:
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
      self._changed.notify()
    return True

  def _work(self) -> None:
    while True:
      with self._changed:
        while not self._jobs and not self._closed:
          self._changed.wait()
        if not self._jobs:
          return
        job = self._jobs.popleft()
      job.run()

  def close(self, error: BaseException) -> None:
    """Cancels the jobs not started with ``error``, and waits until the
    running one has finished. Idempotent."""
    with self._changed:
      self._closed = True
      jobs, self._jobs = list(self._jobs), collections.deque()
      thread = self._thread
      self._changed.notify_all()
    for job in jobs:
      job.cancel(error)
    if thread is not None and thread is not threading.current_thread():
      thread.join()
