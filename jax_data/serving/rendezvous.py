"""Where the requests that several devices make for one refresh meet
(:class:`Rendezvous`), made by a host at the first such request.

Only Python's threading runs here; nothing calls JAX.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from typing import Callable
from typing import Dict
from typing import Optional
from typing import Sequence
from typing import Tuple

# Seconds the devices of one refresh wait for each other.
ROUND_TIMEOUT = 10.0


@dataclasses.dataclass
class _Round:
  """The requests of one refresh made by several devices."""
  index: int  # the chunk they ask for
  expected: int
  came: int = 0  # requests that announced themselves (producing, or here)
  arrived: int = 0  # of them, those done producing and waiting here
  chains: set = dataclasses.field(default_factory=set)
  error: Optional[BaseException] = None
  done: bool = False


class Rendezvous:
  """Where the requests of one refresh meet.

  The devices of one ``pmap`` or ``shard_map`` run the same steps, each
  making one request at a time, so with states at the same chunk and
  position they ask for the same chunk together. A request announces
  itself (:meth:`come`) before it produces its chunks and waits for the
  others (:meth:`meet`) after; once every device has come, they wait for
  each other however long the slowest one's chunk takes.

  Two requests here for different chunks mean their states are at
  different positions (they refresh at different steps and can never
  meet): the rendezvous then stops waiting for those chains at once,
  serves every device its own chunk, and warns naming the chunks. If the
  devices do not all come within ``timeout`` seconds, while no other chunk
  is asked for (the others refresh at other steps, past a collective that
  waits for this one), it stops the same way for the chains that came.
  Requests of the chains numbered by then go through without waiting;
  chains made later (``init_fn``, a restore) wait again. Released
  (:meth:`release`), every round waiting gets the release's error, and
  its requests still meet, so that the devices raise it together (one
  that raised alone would leave the others in a collective, and XLA
  abort the process): a request whose read the release interrupts comes
  at once.

  Args:
    name: Named in the warning (the loader's repr).
    numbered: How many chains the loader has numbered (the next chain's
      number).
    timeout: Seconds to wait for the other devices to come.
  """

  def __init__(self, name: str, numbered: Callable[[], int],
               timeout: float = ROUND_TIMEOUT):
    self._name = name
    self._numbered = numbered
    self._timeout = timeout
    self._rounds: Dict[Tuple[int, int], _Round] = {}
    self._changed = threading.Condition()
    self._waits_from = 0  # chains numbered below do not wait

  def come(self, index: int, participants: int, chains: Sequence[int]
           ) -> Optional[_Round]:
    """Announces a request for chunk ``index`` of ``chains``, one of
    ``participants``, before it produces the chunks; its round, to
    :meth:`meet` after (also if producing failed), or None if it is not
    to wait (its chains were stopped)."""
    with self._changed:
      if min(chains) < self._waits_from:
        return None
      key = (index, participants)
      current = self._rounds.setdefault(key, _Round(index, participants))
      current.came += 1
      current.chains.update(chains)
      self._changed.notify_all()  # a waiter may stop timing now
      apart = sorted((i, r.came) for (i, p), r in self._rounds.items()
                     if p == participants)
      if len(apart) > 1:
        self._stop(
            [r for (_, p), r in self._rounds.items() if p == participants],
            f"the {participants} devices of one pmap/shard_map asked for "
            "different chunks at once: "
            + ", ".join(f"chunk {i} by {n} device{'s' * (n > 1)}"
                        for i, n in apart)
            + ". Their states are at different positions (stacked from "
            "chains that took different numbers of steps, or one device's "
            "state advanced alone), so they refresh apart and cannot wait "
            "for each other.")
        return None
      return current

  def meet(self, current: Optional[_Round], error: Optional[BaseException]
           ) -> Optional[BaseException]:
    """Waits, after producing, for the other requests of the round of
    :meth:`come` (None: no waiting); returns the failure of any of them
    (or ``error``), or the release's error if released meanwhile."""
    if current is None:
      return error
    with self._changed:
      if current.done:  # stopped meanwhile
        return current.error or error
      current.arrived += 1
      current.error = current.error or error
      if current.arrived >= current.expected:
        self._finish(current)
        return current.error
      deadline = time.monotonic() + self._timeout
      try:
        while not current.done:
          if current.came >= current.expected:
            self._changed.wait()  # all came: the others are producing
            continue
          left = deadline - time.monotonic()
          if left <= 0:
            self._stop(
                [current],
                f"{current.came} of the {current.expected} devices of one "
                f"pmap/shard_map asked for chunk {current.index} within "
                f"{self._timeout:g} s, and the others for no chunk: their "
                "states are at other positions (they refresh their caches "
                "at other steps, and may wait in a collective for this "
                "one), or they are held up elsewhere.")
            break
          self._changed.wait(left)
      except BaseException:
        # Interrupted: it no longer waits, and the others not for it.
        current.arrived -= 1
        self._leave(current)
        raise
      return current.error

  def withdraw(self, current: Optional[_Round]) -> None:
    """Takes back a :meth:`come` whose request ends without :meth:`meet`
    (interrupted while producing): the others do not wait for it."""
    if current is None:
      return
    with self._changed:
      self._leave(current)

  def _leave(self, current: _Round) -> None:
    """A request of ``current`` ends without meeting: the round expects
    one fewer (holding the lock)."""
    if current.done:
      return
    current.came -= 1
    current.expected -= 1
    if current.arrived >= current.expected:
      self._finish(current)
    else:
      self._changed.notify_all()

  def release(self, error: BaseException) -> None:
    """Gives every round waiting ``error``: its requests raise it together
    once all came (those the release's interruption of reads brings at
    once). The count of chains numbered is kept as it is now, not read
    from the loader: a released pipeline holds no reference to it."""
    with self._changed:
      numbered = self._numbered()
      self._numbered = lambda: numbered
      for waiting in self._rounds.values():
        waiting.error = waiting.error or error
      self._changed.notify_all()

  def _finish(self, current: _Round) -> None:
    """Ends a round: its requests stop waiting (holding the lock)."""
    current.done = True
    for key, other in list(self._rounds.items()):
      if other is current:
        del self._rounds[key]
    self._changed.notify_all()

  def _stop(self, rounds: Sequence[_Round], what: str) -> None:
    """Stops waiting for the chains numbered so far: releases the waiting
    requests of ``rounds`` and warns (holding the lock)."""
    self._waits_from = max(self._waits_from, self._numbered(),
                           1 + max(max(r.chains) for r in rounds))
    for waiting in rounds:
      self._finish(waiting)
    warnings.warn(
        f"{self._name}: {what} Each device gets its own chunk, but the "
        "devices of the chains made so far no longer wait for each other, "
        "so a loader failure on one device may leave the others waiting in "
        "a collective. To keep that protection, give every device a state "
        "at the same chunk and position (init_fn's states, stepped "
        "together) of chains made from now on: they wait again.",
        stacklevel=4)
