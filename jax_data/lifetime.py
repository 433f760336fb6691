"""The process's lifetime as jax_data sees it: the live hosts, found by
pipeline identity, the exit hook that lets compiled work which calls them
finish before the interpreter finalizes, and the process-wide caches of
compiled code (:class:`Shared`: bridges, jitted steps, compiled passes).

The bridge's callback looks a host up here (:meth:`LiveHosts.host`) by the
identity compiled code passes it; a host registers itself when it is made.
Hosts are held weakly: compiled code kept in JAX's caches keeps no pipeline
alive.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import sys
import threading
import time
import weakref
from typing import Any
from typing import Callable
from typing import Hashable
from typing import Optional
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jax_data.errors import PipelineReleasedError


class Thread(Protocol):
  """A background thread of a host (``jax_data.serving.chunk_store.
  Prefetcher``) that the exit hook ends."""

  def close(self, error: BaseException) -> None:
    """Cancels its jobs not started with ``error``; ends after the running
    one."""

  def join(self, timeout: float) -> None:
    """Waits up to ``timeout`` seconds for it to end."""


class ServedHost(Protocol):
  """What the bridge and the exit hook use of a pipeline's host
  (:class:`jax_data.serving.host.Host`)."""

  id: int

  def serve(self, pipelines, chains, chunks, need, device_count: int = 1,
            participants: int = 1):
    """The lanes' chunks, returned (``pure_callback``)."""

  def serve_into(self, outs, pipelines, chains, chunks, need,
                 device_count: int = 1, participants: int = 1) -> None:
    """The lanes' chunks, written into XLA's buffers ``outs``."""

  def serve_group_lanes_second(self, outs, pipelines, chains, chunks,
                               need) -> bool:
    """A group's refresh into buffers whose bytes are laid out lane axis
    second, if it can; whether it did."""

  def stop_prefetching(self) -> Optional[Thread]:
    """Ends the host's prefetch thread; returns it to join, if any."""

  def release(self, error: Optional[BaseException] = None) -> None:
    """Drops its loader and chains; requests waiting for a chunk raise
    ``error`` (reads the loader can interrupt end)."""


class LiveHosts:
  """The hosts of this process, held weakly, and when compiled code last
  called one: what jax_data's exit hook (:func:`_settle_at_exit`) needs.

  Compiled work can outlive a script's last line. JAX waits at exit for the
  computations it keeps runtime tokens of, but not for every one that calls
  back into Python; a callback that runs while the interpreter finalizes
  aborts the process. So the exit hook waits until no host has been called
  for a moment, then stops every prefetch thread.
  """

  def __init__(self):
    self._hosts: "weakref.WeakValueDictionary[int, ServedHost]" = (
        weakref.WeakValueDictionary())
    # The prefetchers of hosts dropped without release_fn, while their
    # thread runs (a running thread keeps its prefetcher alive).
    self._orphans: "weakref.WeakSet[Thread]" = weakref.WeakSet()
    self._changed = threading.Condition(threading.Lock())
    self._busy = 0
    self._last: Optional[float] = None  # when a request last started/ended
    self._exiting = False  # requests refused: the interpreter exits
    self._callback_failed = False

  @property
  def callback_failed(self) -> bool:
    """Whether a callback raised (see :func:`_settle_at_exit`)."""
    return self._callback_failed

  def note_failed_callback(self) -> None:
    """Records that a callback raised: the exit hook then replaces the
    runtime tokens that hold its error."""
    self._callback_failed = True

  @property
  def called(self) -> bool:
    """Whether compiled code ever called a host of this process."""
    return self._last is not None

  def add(self, host: ServedHost) -> None:
    """Registers ``host`` under its pipeline's identity.

    Raises:
      ValueError: a live host has that identity already.
    """
    with self._changed:
      if self._hosts.get(host.id) is not None:
        raise ValueError(f"pipeline id {host.id} is in use")
      self._hosts[host.id] = host

  def orphan(self, prefetcher: Thread, error: BaseException) -> None:
    """Closes the prefetcher of a host that was dropped (``error`` for its
    jobs not started); :meth:`stop_prefetching` waits for its running
    job."""
    self._orphans.add(prefetcher)
    prefetcher.close(error)

  def taken(self, pipeline_id: int) -> bool:
    """Whether a live host has identity ``pipeline_id``."""
    return self._hosts.get(pipeline_id) is not None

  def host(self, pipeline_id: int) -> ServedHost:
    """The host of pipeline ``pipeline_id``, for compiled code's requests.

    Raises:
      PipelineReleasedError: no live pipeline has that identity.
    """
    if self._exiting:
      raise PipelineReleasedError("the Python interpreter is exiting")
    host = self._hosts.get(pipeline_id)
    if host is None:
      raise PipelineReleasedError(
          f"compiled code called a jax_data pipeline (id {pipeline_id}) "
          "that no longer exists")
    return host

  def begin_request(self) -> None:
    """Marks the start of answering one callback (:meth:`end_request`
    marks its end; plain calls, not a context manager: this runs on every
    refresh)."""
    with self._changed:
      self._busy += 1
      self._last = time.monotonic()

  def end_request(self) -> None:
    """Marks the end of answering one callback."""
    with self._changed:
      self._busy -= 1
      self._last = time.monotonic()
      self._changed.notify_all()

  def wait_until_quiet(self, quiet: float, timeout: float) -> bool:
    """Waits until no request has run for ``quiet`` seconds (True), or
    ``timeout`` seconds without such a pause (False)."""
    deadline = time.monotonic() + timeout
    with self._changed:
      while True:
        now = time.monotonic()
        idle = now - (self._last or 0.0)
        if not self._busy and idle >= quiet:
          return True
        if now >= deadline:
          return False
        left = deadline - now
        self._changed.wait(left if self._busy else min(left, quiet - idle))

  def refuse_requests(self) -> None:
    """From now on every request raises :class:`PipelineReleasedError`
    at once (the interpreter exits), and those waiting for a chunk raise
    it too: every host is released, which interrupts the reads its loader
    can interrupt (a ``tf.data`` pipeline's, a source's workers'), so that
    no callback still runs when the interpreter finalizes."""
    with self._changed:
      self._exiting = True
      hosts = list(self._hosts.values())
    error = PipelineReleasedError(
        "the Python interpreter is exiting while compiled code waited for "
        "a chunk")
    for host in hosts:
      try:
        host.release(error)
      except Exception:  # pylint: disable=broad-except
        pass  # at exit, nothing is left to tell

  def stop_prefetching(self, timeout: float = 2.0) -> None:
    """Ends every prefetch thread, also those of hosts dropped without
    ``release_fn``, and waits up to ``timeout`` seconds in all for their
    running jobs: a thread that still runs Python or TensorFlow code while
    the interpreter finalizes aborts the process."""
    stopped = [host.stop_prefetching() for host in list(self._hosts.values())]
    prefetchers = [p for p in stopped if p is not None] + list(self._orphans)
    error = PipelineReleasedError("the Python interpreter is exiting")
    for prefetcher in prefetchers:
      prefetcher.close(error)  # idempotent
    deadline = time.monotonic() + timeout
    for prefetcher in prefetchers:
      prefetcher.join(max(0.0, deadline - time.monotonic()))


#: The hosts of this process (see :class:`LiveHosts`).
LIVE_HOSTS = LiveHosts()


class Shared:
  """A cache of compiled code by key, thread-safe: values are made once per
  key (:meth:`get`). The process-wide ones (:data:`BRIDGES`, ...) hold
  formats and functions, never a host or a loader; a pipeline keeps its
  own compiled passes in one.

  Args:
    size: Keep the ``size`` most recently used values.
    weak: Keep a value only while something else holds it (a pipeline
      that keeps its compiled passes); ``size`` is then ignored.
  """

  def __init__(self, size: int = 256, weak: bool = False):
    self._size = size
    self._values: Any = (weakref.WeakValueDictionary() if weak
                         else collections.OrderedDict())
    self._weak = weak
    self._lock = threading.Lock()

  def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
    """The value of ``key``, made by ``make()`` if there is none."""
    with self._lock:
      value = self._values.get(key)
      if value is None:
        value = self._values[key] = make()
      elif not self._weak:
        self._values.move_to_end(key)
      if not self._weak and len(self._values) > self._size:
        self._values.popitem(last=False)
      return value

  def clear(self) -> None:
    """Drops every value (a released pipeline's compiled passes, which may
    hold a device loader's arrays as constants)."""
    with self._lock:
      self._values.clear()

  def __len__(self) -> int:
    with self._lock:
      return len(self._values)


#: Bridges by chunk format and callback path (``bridge.shared``).
BRIDGES = Shared()
#: Jitted steps of random pipelines by bridge and cache size.
STEPS = Shared()
#: Compiled full-data passes by chunk format and function, while a pipeline
#: keeps them (each keeps its ``max_compiled`` most recent).
PASSES = Shared(weak=True)


def _malloc_trim() -> Optional[Callable[[int], int]]:
  try:
    trim = ctypes.CDLL(None).malloc_trim
  except (OSError, AttributeError, TypeError):  # not glibc
    return None
  trim.argtypes = [ctypes.c_size_t]
  trim.restype = ctypes.c_int
  return trim


_MALLOC_TRIM = _malloc_trim()


def give_back_heap() -> None:
  """Returns the freed heap memory of this process to the system, where
  the C library is glibc (elsewhere nothing): after a read of many rows,
  and when a pipeline is released.

  A read's index arrays (5 MiB each for 1,024 chains) are freed into the
  producing thread's arena, which kept them resident: 1,024 chains with
  caches of 10 peaked at +502 MiB above the start against a bound of 422,
  and at +332 with the copy in blocks and this
  (``benchmarks/chains.py --source-memory``). A released pipeline's
  chunks are freed into the arenas of the threads that made them: 50
  pipelines of 16 memmap chains made and released one after another left
  +451 MiB resident and still growing, +303 MiB with this at each
  release and each new pipeline (a single arena, ``MALLOC_ARENA_MAX=1``:
  +174 MiB)."""
  if _MALLOC_TRIM is not None:
    _MALLOC_TRIM(0)


# How long no host must have been called before the interpreter may finalize.
_QUIET_AT_EXIT = 0.5
# Seconds the exit hook waits for such a pause; then requests are refused,
# and it waits up to _LAST_AT_EXIT seconds more.
_WAIT_AT_EXIT = 5.0
_LAST_AT_EXIT = 2.0


@atexit.register
def _settle_at_exit() -> None:
  """Lets compiled work that calls jax_data finish before the interpreter
  finalizes.

  Registered when jax_data is imported, after JAX's own exit hooks, so it
  runs before them. A callback that runs while the interpreter finalizes
  aborts the process ("terminate called without an active exception"), and
  JAX's exit hooks wait only for the computations whose runtime tokens they
  keep: not for repeated calls of a jitted function, which take a fast path
  that keeps none. So this hook waits for every live array, then until no
  jax_data host has been called for ``_QUIET_AT_EXIT`` seconds (work whose
  outputs were dropped), and stops the prefetch threads.

  A daemon thread whose loop keeps calling a pipeline never gives that
  pause, and Python does not wait for daemon threads: after
  ``_WAIT_AT_EXIT`` seconds every request raises
  :class:`PipelineReleasedError` (so that such a loop ends; requests
  waiting in a read are interrupted, :meth:`LiveHosts.refuse_requests`),
  and after
  ``_LAST_AT_EXIT`` more the interpreter exits whatever still runs.

  Then, if a callback raised: in a ``jax.distributed`` job of several
  processes, a warning on stderr says that JAX's shutdown will now wait
  for the others, which wait in a collective for this one
  (:func:`_warn_distributed_shutdown`); and JAX keeps the error of such
  a computation in its per-device runtime tokens, also after later
  ``pmap`` computations succeed, and its exit hooks re-raise it
  ("Exception ignored in atexit callback"); a successful jitted callback
  on each device replaces those tokens.
  """
  if not LIVE_HOSTS.called:
    return
  try:
    try:
      for array in jax.live_arrays():
        try:
          array.block_until_ready()
        except Exception:  # pylint: disable=broad-except
          pass  # a failed computation has ended too
      if not LIVE_HOSTS.wait_until_quiet(_QUIET_AT_EXIT, _WAIT_AT_EXIT):
        LIVE_HOSTS.refuse_requests()
        LIVE_HOSTS.wait_until_quiet(_QUIET_AT_EXIT, _LAST_AT_EXIT)
    except KeyboardInterrupt:
      # Ctrl-C again while this waits: stop waiting, but refuse requests
      # first and keep the last short wait, so that a loop still calling
      # back ends before the interpreter finalizes (skipping both aborted
      # the process). A third Ctrl-C ends that wait too.
      LIVE_HOSTS.refuse_requests()
      try:
        LIVE_HOSTS.wait_until_quiet(_QUIET_AT_EXIT, _LAST_AT_EXIT)
      except KeyboardInterrupt:
        pass
    LIVE_HOSTS.stop_prefetching()
    if LIVE_HOSTS.callback_failed:
      _warn_distributed_shutdown()
      noop = jax.jit(lambda x: jax.pure_callback(
          lambda x: x, jax.ShapeDtypeStruct((), jnp.int32), x))
      for device in jax.local_devices():
        jax.block_until_ready(noop(jax.device_put(np.int32(0), device)))
  except (Exception, KeyboardInterrupt):  # pylint: disable=broad-except
    pass  # at exit, nothing is left to tell


def _warn_distributed_shutdown() -> None:
  """At exit after a callback raised, in a job of several processes: tells
  on stderr why the exit stalls. The other processes wait in their next
  collective for this one, and JAX's exit hook waits at
  ``jax.distributed``'s shutdown barrier for them, until its
  ``shutdown_timeout_seconds`` (300 s by default) pass and every process
  is aborted (measured: jax 0.10.2, 2 processes on CPU)."""
  if jax.process_count() < 2:
    return
  sys.stderr.write(
      f"jax_data: a host callback failed in process {jax.process_index()} "
      f"of this jax.distributed job of {jax.process_count()} (the error "
      "was raised above). The other processes wait for it in their next "
      "collective, and JAX's exit now waits for them at jax.distributed's "
      "shutdown until its shutdown_timeout_seconds (300 s by default) "
      "pass, then aborts every process. To end the job at once, end a "
      "failed process with os._exit(1) (see 'A loader failure in one "
      "process' in jax_data's distributed docs).\n")
  sys.stderr.flush()
