"""Huge pages for XLA's large callback buffers (Linux).

On CPU the host writes each refresh straight into XLA's output buffer
(``buffer_callback``). XLA allocates a compiled call's buffers anew at
every call, and glibc maps an allocation above 32 MiB fresh from the
kernel every time, so the first refresh of each call faults that buffer in
4 KiB at a time while compiled code waits: 1,024 vmapped chains with
caches of 100 batches (865 MB) took 214,000-219,000 page faults and 0.4-1.3
s of system time per 1,000-step call. Where the kernel's transparent huge
pages are given on request (``/sys/kernel/mm/transparent_hugepage/enabled``
reads ``madvise``), :func:`advise` asks for them over such a buffer before
it is written, one fault per 2 MiB, as NumPy asks for them over its own
large arrays (``numpy._core.multiarray._get_madvise_hugepage()``), among
them the loaders' copies of the data.

Advice only: it changes no byte. Where it is not given (not Linux, huge
pages off, a refused call) buffers fault as before; where huge pages are
always on, buffers get them without asking.
Buffers below :data:`ADVISE_BYTES` are left alone: once one of their size
has been freed, glibc serves them from its heap, which it keeps between
calls, faulted in already.

ctypes only, no JAX call: it runs inside a host callback.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable
from typing import Optional
from typing import Sequence

import numpy as np

# glibc's largest threshold for mapping an allocation by itself.
ADVISE_BYTES = 32 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def on_request(path: str = _ENABLED) -> bool:
  """Whether the kernel gives huge pages to the memory that asks for them
  (and only to it): the mode in brackets in ``path`` is ``madvise``."""
  try:
    with open(path, encoding="ascii") as modes:
      return "[madvise]" in modes.read()
  except OSError:
    return False


@functools.lru_cache(maxsize=None)
def _madvise() -> Optional[Callable[..., int]]:
  """libc's ``madvise``, where huge pages are given on request."""
  if not on_request():
    return None
  try:
    call = ctypes.CDLL(None, use_errno=True).madvise
  except (OSError, AttributeError, TypeError):  # TypeError: Windows
    return None
  call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  call.restype = ctypes.c_int
  return call


def huge_span(array: np.ndarray) -> Optional[range]:
  """The whole huge pages inside ``array``'s bytes, as a range of
  addresses; None for an array below :data:`ADVISE_BYTES` or one that holds
  no whole huge page."""
  if array.nbytes < ADVISE_BYTES:
    return None
  low, high = np.lib.array_utils.byte_bounds(array)
  low = -(-low // _HUGE_PAGE) * _HUGE_PAGE
  high = high // _HUGE_PAGE * _HUGE_PAGE
  return range(low, high) if high > low else None


def advise(arrays: Sequence[np.ndarray],
           call: Optional[Callable[..., int]] = None) -> int:
  """Asks for huge pages over each large array of ``arrays`` (XLA's
  buffers, before they are written).

  Args:
    arrays: the buffers.
    call: ``madvise(address, length, advice)``, returning 0 where given;
      by default libc's, where huge pages are given on request, else none.

  Returns:
    How many arrays were advised.
  """
  call = _madvise() if call is None else call
  if call is None:
    return 0
  advised = 0
  for array in arrays:
    span = huge_span(array)
    if span is not None and call(span.start, len(span), _MADV_HUGEPAGE) == 0:
      advised += 1
  return advised
