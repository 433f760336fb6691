"""What the cursors of a pipeline's chains hold for reuse (permutations,
read blocks), and trimming them to a budget: :class:`CursorBudget`.

Only NumPy runs here; nothing calls JAX.
"""

from __future__ import annotations

import collections
import threading
import warnings
from typing import Callable
from typing import Optional
from typing import Sequence

from jax_data.loaders.host_loader import StoreLimits
from jax_data.serving.chain_records import ChainRecord


class CursorBudget:
  """What the cursors of a pipeline's chains hold for reuse, the chains
  produced for least recently first, and trimming them to a budget.
  Thread-safe."""

  def __init__(self):
    self._lock = threading.Lock()
    self._held: "collections.OrderedDict[int, int]" = (
        collections.OrderedDict())
    self._total = 0
    self._most = 0

  def note(self, record: ChainRecord) -> None:
    """Notes what a chain's cursor holds after producing for it or
    trimming it (with its ``produce_lock`` held); a closed chain holds
    nothing."""
    held = 0 if record.closed else record.cursor.held_bytes()
    with self._lock:
      self._total -= self._held.pop(record.number, 0)
      if held:
        self._held[record.number] = held
        self._total += held
        self._most = max(self._most, held)

  def forget(self, number: int) -> None:
    """A chain left the pipeline."""
    with self._lock:
      self._total -= self._held.pop(number, 0)

  def clear(self) -> None:
    with self._lock:
      self._held.clear()
      self._total = 0

  def trim(self, idle: Sequence[ChainRecord],
           lookup: Callable[[int], Optional[ChainRecord]],
           limits: StoreLimits, lanes: int) -> None:
    """Trims the cursors of the ``idle`` chains (no chunk stored), then
    those of the chains produced for least recently while all cursors hold
    more than ``limits.store_bytes``, or ``limits.held_requests`` times
    what the chains of the largest request (``lanes`` chains) hold if that
    is more; a cursor that is producing is passed over, and the ``lanes``
    chains produced for last never are trimmed for the budget."""
    for record in idle:
      self._trim(record, only_if_idle=True)
    protected = max(lanes, 1)
    with self._lock:
      limit = max(limits.store_bytes,
                  limits.held_requests * protected * self._most)
      excess = self._total - limit
      chosen = []
      for number, held in list(self._held.items())[:-protected]:
        if excess <= 0:
          break
        chosen.append(number)
        excess -= held
    for number in chosen:
      record = lookup(number)
      if record is not None:
        self._trim(record, only_if_idle=False)

  def _trim(self, record: ChainRecord, only_if_idle: bool) -> None:
    if not record.produce_lock.acquire(blocking=False):
      return
    try:
      if not record.closed and not (only_if_idle and record.chunks):
        try:
          record.cursor.trim()
        except Exception as e:  # pylint: disable=broad-except
          # Housekeeping in the background: the chain keeps what it held,
          # and the other chains are trimmed still.
          warnings.warn(
              f"jax_data: trimming chain {record.number}'s cursor failed "
              f"({type(e).__name__}: {e}); it keeps what it holds",
              RuntimeWarning, stacklevel=1)
        self.note(record)
    finally:
      record.let_go()
