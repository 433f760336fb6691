"""Watching what code calls, without replacing anything.

:func:`watch` records the Python calls the current thread makes while it
is active (``sys.setprofile``): tests observe a function's calls and the
arguments it got instead of patching module globals.
"""

import contextlib
import sys
from typing import Callable
from typing import Iterator
from typing import List


@contextlib.contextmanager
def watch(wanted: Callable) -> Iterator[List]:
  """Records ``wanted(frame)`` for every call in this thread for which it
  is not None."""
  seen: List = []
  previous = sys.getprofile()

  def profile(frame, event, arg):
    del arg
    if event == "call":
      found = wanted(frame)
      if found is not None:
        seen.append(found)

  sys.setprofile(profile)
  try:
    yield seen
  finally:
    sys.setprofile(previous)


def calls_of(function: Callable, argument: str) -> Callable:
  """For :func:`watch`: ``argument``'s value in each call of ``function``."""
  code = function.__code__
  return lambda frame: (frame.f_locals[argument] if frame.f_code is code
                        else None)


def jax_calls(frame):
  """For :func:`watch`: the name of each function of JAX called."""
  module = frame.f_globals.get("__name__", "")
  if module == "jax" or module.startswith(("jax.", "jaxlib")):
    return f"{module}.{frame.f_code.co_name}"
  return None
