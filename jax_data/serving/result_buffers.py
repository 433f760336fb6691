"""Memory for the arrays a ``pure_callback`` returns, used again once the
runtime is done with them.

``pure_callback`` copies the arrays its callback returns into its own
buffers (on a GPU, to the device) and then drops them. A request of many
lanes returns hundreds of megabytes (216 MB per refresh of 256 chains in
case (g)); allocated afresh, such an array is new pages that the kernel
faults in and zeroes on every refresh. :class:`ResultBuffers` keeps a few
blocks and hands out arrays over them; a block comes back when the last
array over it is dropped, so it is never written while the runtime still
reads it, whatever the runtime copies when.

Only NumPy runs here.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any
from typing import List
from typing import Sequence
from typing import Tuple

import numpy as np

Format = Tuple[Tuple[int, ...], Any]  # (shape, dtype)

# Arrays within a block start at multiples of this many bytes.
_ALIGN = 64


class _Owner:
  """The base of one request's arrays: they keep it alive, and it keeps
  its block."""

  def __init__(self, block: np.ndarray):
    self.__array_interface__ = block.__array_interface__
    self.block = block


class ResultBuffers:
  """Blocks of memory for requests of the same formats, reused.

  Args:
    keep: The most free blocks kept (one per request in flight at once:
      several devices' requests of one refresh run together).

  Thread-safe.
  """

  def __init__(self, keep: int = 4):
    self._keep = keep
    self._free: List[np.ndarray] = []
    self._last = 0  # the bytes of the latest request's block
    self._lock = threading.Lock()

  def arrays(self, formats: Sequence[Format]) -> List[np.ndarray]:
    """Uninitialised arrays of these ``(shape, dtype)`` formats, over one
    block that returns to the free blocks when they are all dropped."""
    offsets, end = [], 0
    for shape, dtype in formats:
      offsets.append(end)
      end += -(-(int(np.prod(shape)) * np.dtype(dtype).itemsize)
               // _ALIGN) * _ALIGN
    with self._lock:
      if end != self._last:  # other formats: the kept blocks would not do
        self._free, self._last = [], end
      block = self._free.pop() if self._free else None
    if block is None:
      block = np.empty(max(end, 1), np.uint8)
    owner = _Owner(block)
    weakref.finalize(owner, self._put, block)
    flat = np.asarray(owner)
    return [flat[offset:offset + int(np.prod(shape)) * np.dtype(
        dtype).itemsize].view(dtype).reshape(shape)
            for offset, (shape, dtype) in zip(offsets, formats)]

  def _put(self, block: np.ndarray) -> None:
    with self._lock:
      if block.size == max(self._last, 1) and len(self._free) < self._keep:
        self._free.append(block)

  def clear(self) -> None:
    """Drops the free blocks (those in use go when dropped)."""
    with self._lock:
      self._free, self._last = [], 0
