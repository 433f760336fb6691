"""Page-locked host buffers for the answers that a GPU copies in.

On a GPU, compiled code receives its chunks through ``jax.pure_callback``,
and the runtime copies the host's answer to the device. From pageable
memory the CUDA driver copies through staging buffers of its own; from
page-locked ("pinned") memory it copies directly. On an H200 machine, an
answer of 210 MB (a refresh of 256 vmapped chains) took 27-30 ms to reach
the device from pageable memory, 4.1 ms once the same buffer was
registered, which took 8.7 ms. A :class:`~jax_data.loaders.gather.
BufferPool` uses its buffers again and again, so it registers each once
(:func:`pin`). From page-locked memory the copy is asynchronous; JAX's
GPU callback waits for its stream before it drops the answer, so a buffer
is used again only once its copy is done, as before.

Only where this process drives an NVIDIA GPU (the CUDA driver's library is
loaded, as XLA's CUDA backend loads it), through the CUDA runtime's
library: one the process has loaded already, else one of the ``nvidia``
wheels that JAX's CUDA plugin installs, else one on the library path.
Elsewhere, and where registering fails, buffers stay pageable: copies are
slower, not wrong. The runtime registers through the calling thread's CUDA
context, or else through the primary context of device 0, which XLA's
backend has started wherever device 0 is one of JAX's devices. A process
whose JAX was told to leave device 0 alone (``jax_cuda_visible_devices``)
would start a context there; ``CUDA_VISIBLE_DEVICES`` does not have this
problem.

ctypes only, no JAX call: it may run inside a host callback.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import weakref
from typing import Any
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

# cudaHostRegisterPortable: page-locked for every CUDA context of the
# process (several GPUs), not only the current one.
_PORTABLE = 1
# Smaller buffers are not registered: their copies cost about the same
# either way, and small allocations share pages that another registration
# may already hold.
PIN_BYTES = 1 << 20


def mapped_libraries() -> List[str]:
  """The paths of the shared libraries mapped into this process (empty
  where ``/proc/self/maps`` cannot be read: not Linux)."""
  try:
    with open("/proc/self/maps", encoding="utf-8") as maps:
      lines = maps.read().splitlines()
  except OSError:
    return []
  paths = (line.split(maxsplit=5) for line in lines)
  return list(dict.fromkeys(
      fields[5] for fields in paths if len(fields) == 6 and ".so" in fields[5]))


def _named(paths: Sequence[str], prefix: str) -> List[str]:
  return [path for path in paths if os.path.basename(path).startswith(prefix)]


def runtime_path(mapped: Sequence[str]) -> Optional[str]:
  """The CUDA runtime library to register buffers with, given the
  libraries ``mapped`` into the process: None where the CUDA driver is not
  among them (no GPU is driven), else the runtime mapped already, else the
  newest in the ``nvidia`` wheels, else one on the library path."""
  if not _named(mapped, "libcuda.so"):
    return None
  loaded = _named(mapped, "libcudart.so")
  if loaded:
    return loaded[0]
  spec = importlib.util.find_spec("nvidia")
  found = [path for root in ((spec.submodule_search_locations or [])
                             if spec else [])
           for path in glob.glob(os.path.join(root, "**", "libcudart.so*"),
                                 recursive=True)]
  if found:
    return max(found, key=_version)
  return ctypes.util.find_library("cudart")


def _version(path: str) -> Tuple[int, ...]:
  """The version in a library's name (``libcudart.so.12.4``: (12, 4))."""
  suffix = os.path.basename(path).partition(".so")[2]
  return tuple(int(part) for part in suffix.split(".") if part.isdigit())


def _loaded(name: str) -> bool:
  """Whether the library ``name`` is loaded in this process (40 us to
  tell that it is not; reading the process's maps takes 1 ms)."""
  try:
    ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
  except (OSError, AttributeError):  # AttributeError: no RTLD_NOLOAD
    return False
  return True


def cuda_runtime() -> Optional[Any]:
  """The CUDA runtime library (ctypes) where this process drives a GPU,
  else None. Looked for anew at each call (a process drives a GPU only
  once JAX has started its backend); callers call it once per buffer."""
  if not _loaded("libcuda.so.1"):
    return None
  path = runtime_path(mapped_libraries())
  if path is None:
    return None
  try:
    library = ctypes.CDLL(path)
    library.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_uint]
    library.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    library.cudaGetLastError.argtypes = []
  except (OSError, AttributeError):  # not a CUDA runtime after all
    return None
  return library


def pin(array: np.ndarray, runtime: Optional[Any] = None) -> bool:
  """Registers the memory of ``array`` (its own, C-contiguous) as
  page-locked with the CUDA runtime ``runtime`` (default:
  :func:`cuda_runtime`), for as long as ``array`` lives; whether it did.
  Arrays smaller than :data:`PIN_BYTES` are left as they are."""
  if (array.nbytes < PIN_BYTES or not array.flags.c_contiguous
      or not array.flags.owndata):
    return False
  runtime = cuda_runtime() if runtime is None else runtime
  if runtime is None:
    return False
  address = array.ctypes.data
  if runtime.cudaHostRegister(address, array.nbytes, _PORTABLE) != 0:
    runtime.cudaGetLastError()  # not sticky: only clear it
    return False
  # Unregistered before NumPy frees the memory. Not at exit: the process's
  # memory goes then anyway, and the runtime may be gone first.
  finalizer = weakref.finalize(array, runtime.cudaHostUnregister, address)
  finalizer.atexit = False
  return True
