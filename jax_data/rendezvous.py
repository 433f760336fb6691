"""Devices that make the same refresh request meet on the host.

Inside ``pmap`` or ``shard_map`` every device asks for its chunk on its own
XLA thread. If one of them fails and raises while the others go on to a
collective (a ``psum`` of the gradients), the others wait forever and XLA
aborts the process. So the requests of one refresh wait for each other
here, and if any failed, all raise its failure.

Pure Python; nothing calls JAX.
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

  If the devices named in a request do not all come within ``timeout``
  seconds (a wrong ``device_count``, states at different positions), the
  rendezvous warns once and stops waiting for good.

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
      elif not self._changed.wait_for(lambda: current.done, self._timeout):
        self._enabled = False
        self._rounds.pop(key, None)
        warnings.warn(
            f"{self._name}: {participants} devices were expected to request "
            f"chunk {index} together, but {current.arrived} did within "
            f"{self._timeout:.0f} s; check device_count. Devices no longer "
            "wait for each other, so a loader failure on one device may "
            "leave the others waiting in a collective.", stacklevel=3)
      return current.error
