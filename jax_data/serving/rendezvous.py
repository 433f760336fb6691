"""Where the requests that several devices make for one refresh meet
(:class:`Rendezvous`), made by a host at the first such request.

Only Python's threading runs here; nothing calls JAX.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Dict
from typing import Optional
from typing import Tuple

# Seconds the devices of one refresh wait for each other.
ROUND_TIMEOUT = 10.0


@dataclasses.dataclass
class _Round:
  """The requests of one refresh made by several devices."""
  expected: int
  arrived: int = 0
  error: Optional[BaseException] = None
  done: bool = False


class Rendezvous:
  """Where the requests of one refresh meet.

  The devices of one ``pmap`` or ``shard_map`` run the same steps, each
  making one request at a time, so with states at the same chunk and
  position they ask for the same chunk together. Two requests waiting here
  for different chunks mean their states are at different positions (they
  refresh at different steps and can never meet): the rendezvous then stops
  at once, serves every device its own chunk, and warns naming the chunks.
  If the devices do not all come within ``timeout`` seconds, while no other
  chunk is asked for (the others refresh at other steps, past a collective
  that waits for this one), it stops the same way. Stopped, it lets every
  request through without waiting, for good.

  Args:
    name: Named in the warning (the loader's repr).
    timeout: Seconds to wait for the other devices.
  """

  def __init__(self, name: str, timeout: float = ROUND_TIMEOUT):
    self._name = name
    self._timeout = timeout
    self._rounds: Dict[Tuple[int, int], _Round] = {}
    self._changed = threading.Condition()
    self._enabled = True

  def meet(self, index: int, participants: int,
           error: Optional[BaseException]) -> Optional[BaseException]:
    """Waits for the other ``participants - 1`` requests for chunk
    ``index``; returns the failure of any of them (or ``error``)."""
    with self._changed:
      if not self._enabled:
        return error
      key = (index, participants)
      current = self._rounds.setdefault(key, _Round(participants))
      current.arrived += 1
      current.error = current.error or error
      if current.arrived >= current.expected:
        current.done = True
        del self._rounds[key]
        self._changed.notify_all()
        return current.error
      apart = sorted((i, r.arrived) for (i, p), r in self._rounds.items()
                     if p == participants)
      if len(apart) > 1:
        self._stop(
            f"the {participants} devices of one pmap/shard_map asked for "
            "different chunks at once: "
            + ", ".join(f"chunk {i} by {n} device{'s' * (n > 1)}"
                        for i, n in apart)
            + ". Their states are at different positions (stacked from "
            "chains that took different numbers of steps, or one device's "
            "state advanced alone), so they refresh apart and cannot wait "
            "for each other.")
        return current.error
      try:
        met = self._changed.wait_for(lambda: current.done, self._timeout)
      except BaseException:
        current.arrived -= 1  # interrupted: it no longer waits
        if not current.arrived and self._rounds.get(key) is current:
          del self._rounds[key]
        raise
      if not met:
        self._stop(
            f"{current.arrived} of the {participants} devices of one "
            f"pmap/shard_map asked for chunk {index} within "
            f"{self._timeout:g} s, and the others for no chunk: their "
            "states are at other positions (they refresh their caches at "
            "other steps, and may wait in a collective for this one), or "
            "they are held up elsewhere.")
      return current.error

  def _stop(self, what: str) -> None:
    """Stops waiting for good: releases every waiting request and warns
    once (called holding the lock)."""
    self._enabled = False
    for waiting in self._rounds.values():
      waiting.done = True
    self._rounds.clear()
    self._changed.notify_all()
    warnings.warn(
        f"{self._name}: {what} Each device gets its own chunk, but devices "
        "no longer wait for each other, so a loader failure on one device "
        "may leave the others waiting in a collective. To keep that "
        "protection, give every device a state at the same chunk and "
        "position (init_fn's states, stepped together).", stacklevel=4)
