"""Producing chains' chunks through their loader cursors.

A :class:`Producer` moves a chain's cursor to the chunk asked for (at once
where the cursor can, a counter-based or ordered stream over rows read by
index, else by replaying from the nearest snapshot of its position), has
it produce the chunk and settles the future that the chunk's requests
wait on, with the chunk or with the failure, named. The
vmapped chains of one request whose cursors produce together are produced
in one call. The chunk lands in the producer's reused buffers, or straight
in compiled code's own where a request passes them; what the cursors hold
afterwards is noted in a :class:`~jax_data.serving.cursor_budget.
CursorBudget`.

Only NumPy runs here; nothing calls JAX.
"""

from __future__ import annotations

import math
import traceback
import warnings
from typing import Any
from typing import Callable
from typing import Dict
from typing import Hashable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data.errors import HostLoaderError
from jax_data.errors import PipelineReleasedError
from jax_data.loaders.chains import Chunk
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import SeekRefused
from jax_data.loaders.chains import spanned
from jax_data.loaders.gather import BufferPool
from jax_data.loaders.host_loader import StoreLimits
from jax_data.loaders.pinning import pin
from jax_data.serving.chain_records import ChainRecord
from jax_data.serving.chain_records import Job
from jax_data.serving.chain_records import settle
from jax_data.serving.cursor_budget import CursorBudget


def interrupted(error: BaseException) -> RuntimeError:
  """The answer of a chunk whose production ``error`` cut short (Ctrl-C,
  or another lane's bad request before it started): a later request
  produces it again."""
  return RuntimeError(
      f"producing the chunk stopped early ({type(error).__name__}); a later "
      "request produces it again")


class Producer:
  """Produces the chunks of one pipeline's chains.

  Args:
    layout: The chunks' arrays.
    name: The loader's repr, for messages.
    limits: How far a chain may replay (``max_replay``) and how many
      snapshots it keeps (``recent_snapshots``).
    held: Where what each cursor holds after producing is noted.
    verify_calls: Warn when a chunk is produced again because a request
      came for one no longer stored (a state used twice).
  """

  def __init__(self, layout: ChunkLayout, name: str, limits: StoreLimits,
               held: CursorBudget, verify_calls: bool = False):
    self.layout = layout
    self.name = name
    self._limits = limits
    self._held = held
    self._verify_calls = verify_calls
    # A chunk served to one lane is copied to a GPU from its own buffer.
    self._buffers = BufferPool(pin=pin if limits.page_locked else None)
    self._released: Optional[str] = None

  def reserve_buffers(self, chunks: int) -> None:
    """Keeps the buffers of up to ``chunks`` chunks for reuse
    (:meth:`~jax_data.loaders.gather.BufferPool.reserve`); not those of
    other formats (a group's buffers of every lane)."""
    layout = self.layout
    self._buffers.reserve(chunks, list(zip(
        layout.leaf_shapes(), [leaf.dtype for leaf in layout.leaves])) + [
            (layout.lead, np.dtype(bool))])

  def release(self, message: str) -> None:
    """Productions not started yet fail with :class:`PipelineReleasedError`
    (``message``); running ones close their chain's cursor when done."""
    self._released = message

  def produce_into(self, record: ChainRecord, index: int,
                   future: Any,
                   out: Optional[Chunk] = None) -> None:
    """Produces chunk ``index`` (into ``out`` if given, see
    :meth:`produce_many`) and sets ``future`` to it, or to the failure
    (named :class:`HostLoaderError`); a future that release failed
    meanwhile keeps its answer."""
    try:
      chunk = self._produce(record, index, out)
    except BaseException as e:  # every failure reaches the waiting request
      settle(future, error=self._wrap(record, index, e))
    else:
      settle(future, chunk)

  def produce_many(self, jobs: Sequence[Job],
                   into: Optional[Dict[int, Chunk]] = None) -> None:
    """Produces the chunks ``(chain, index, future)`` of ``jobs`` and
    settles their futures as :meth:`produce_into` does. The chains whose
    cursors share a :meth:`~jax_data.loaders.chains.ChainCursor.group_key` are
    produced together, in one :meth:`~jax_data.loaders.chains.ChainCursor.
    produce_group` call (the vmapped chains of one request); the others
    one by one.

    ``into`` maps a job's future (by ``id``) to the buffers its chunk is
    written into (compiled code's own) instead of the producer's: a group
    whose buffers follow each other in memory, in chain order, is read into
    them in one piece."""
    groups: Dict[Hashable, List[Job]] = {}
    alone: List[Job] = []
    grouped = set()
    for job in jobs:
      key = job[0].cursor.group_key()
      if key is None or job[0].number in grouped:
        alone.append(job)  # a chain twice: its second chunk after
      else:
        grouped.add(job[0].number)
        groups.setdefault(key, []).append(job)
    into = into or {}
    for group in groups.values():
      if len(group) > 1:
        alone.extend(self._produce_group(group, into))
      else:
        alone.extend(group)
    for record, index, future in alone:
      self.produce_into(record, index, future, into.get(id(future)))

  def _produce_group(self, group: List[Job], into: Dict[int, Chunk]
                     ) -> List[Job]:
    """Produces a group's chunks in one call (with every chain's
    ``produce_lock`` held, taken in chain order); returns the jobs left to
    produce one by one (chains closed meanwhile, cursors that cannot
    seek directly)."""
    if self._released is not None:
      for _, _, future in group:
        settle(future, error=PipelineReleasedError(self._released))
      return []
    group = sorted(group, key=lambda job: job[0].number)
    locked, ready, left = [], [], []
    try:
      for record, index, future in group:
        record.produce_lock.acquire()
        locked.append(record)
        try:
          stands = not record.closed and self._stand_at(record, index)
        except BaseException as e:  # a seek refused: this chain's failure
          settle(future, error=self._wrap(record, index, e))
          continue
        (ready if stands else left).append((record, index, future))
      if len(left) > 1:
        brought = self._replay_together(left)
        ready += brought
        left = [job for job in left if job not in brought]
      if ready:
        self._produce_ready(ready, into)
    finally:
      for record in locked:
        record.produce_lock.release()
      for record in locked:  # closed while producing (after all let go)
        if self._released is not None or record.closing:
          record.close(blocking=True)
    return left

  def _warn_replay(self, record: ChainRecord, index: int, base: int
                   ) -> None:
    """With ``verify_calls``: a chain that moved on is asked for chunk
    ``index`` again, and replays it from its snapshot at ``base`` (the
    chunk itself: its cursor seeks there). Not for a chunk produced ahead
    of a chain that a request has moved elsewhere since (a job that ran
    late): no request asked for it. 4 chains whose old state was used
    again warned 8 times, not 4, when their job ahead ran after that
    request."""
    if (self._verify_calls and record.next_index is not None
        and record.requested == index):
      how = (f"replaying from chunk {base}" if base < index
             else "producing it again")
      warnings.warn(
          f"{self.name}, chain {record.number}: chunk {index} was "
          f"requested again after chunk {record.next_index - 1}; {how}",
          stacklevel=3)

  def _stand_at(self, record: ChainRecord, index: int) -> bool:
    """``record.stand_at(index)``; a cursor that computes positions, and
    so seeks where another would replay, is held to the same bound as a
    replay (a chunk far beyond the furthest it reached, a crafted state,
    is refused: a shuffle buffer seeks by replaying its pass, all of an
    endless pipeline), and warns as a replay does.

    Raises:
      ValueError: the chunk is past that bound.
    """
    if record.computes and record.next_index != index:
      if index - record.reached > self._limits.max_replay:
        raise ValueError(
            f"chunk {index} of chain {record.number} is "
            f"{index - record.reached} chunks past the furthest it reached "
            f"(before chunk {record.reached}), more than the "
            f"{self._limits.max_replay} a request may replay; the state's "
            "chunk counter does not come from this chain")
      self._warn_replay(record, index, index)
    return record.stand_at(index)

  def _replay_together(self, jobs: List[Job]) -> List[Job]:
    """Chains of a group that stand elsewhere (restored together from one
    checkpoint, whose snapshot is some chunks before the one asked for),
    each moved to its newest snapshot at or before its chunk and brought
    to the chunk producing the chunks between together, as a group:
    the jobs now standing at their chunks (all of them, or none, which
    are then produced one by one). A streamed tf.data chain replaying
    alone reads its pass alone.

    With every chain's ``produce_lock`` held."""
    if self._released is not None:
      return []
    bases = []
    for record, index, _ in jobs:
      if record.closed:
        return []
      bases.append(max(i for i in record.snapshots if i <= index))
    steps = {index - base for (_, index, _), base in zip(jobs, bases)}
    keys = {record.cursor.group_key() for record, _, _ in jobs}
    if len(steps) != 1 or len(keys) != 1 or None in keys:
      return []
    steps = steps.pop()
    if not 0 < steps <= self._limits.max_replay:
      return []
    records = [record for record, _, _ in jobs]
    for (record, index, _), base in zip(jobs, bases):
      self._warn_replay(record, index, base)
    try:
      for record, base in zip(records, bases):
        record.next_index = None  # unknown until it stands there
        record.cursor.seek(record.snapshots[base])
        record.next_index = base
      cursors = [record.cursor for record in records]
      for _ in range(steps):
        indices = []
        for record in records:
          current = record.next_index
          record.note_position(current)
          indices.append(current)
          record.next_index = None  # unknown until the cursors return
        type(cursors[0]).produce_group(cursors, indices, self.layout,
                                       self._buffers.empty)
        for record, current in zip(records, indices):
          record.next_index = current + 1
          record.thin(self._limits.recent_snapshots)
    except Exception:  # pylint: disable=broad-except
      return []  # one by one, from their snapshots (next_index is None)
    return list(jobs)

  def _produce_ready(self, ready: List[Job], into: Dict[int, Chunk]
                     ) -> None:
    """:meth:`_produce_group` once each cursor stands at its chunk."""
    cursors = [record.cursor for record, _, _ in ready]
    allocate = self._buffers.empty
    targets = [into.get(id(future)) for _, _, future in ready]
    if all(target is not None for target in targets):
      allocate = _Regions(targets, allocate)
    try:
      for record, index, _ in ready:
        record.note_position(index)
        record.next_index = None  # unknown until the cursors return
      chunks = type(cursors[0]).produce_group(
          cursors, [index for _, index, _ in ready], self.layout, allocate)
      span = spanned(chunks)
      if span is not None:  # one check, not one per chunk
        self.layout.check_span(span, len(chunks))
      else:
        chunks = [self.layout.check(chunk) for chunk in chunks]
    except Exception as e:  # pylint: disable=broad-except
      self._produce_each(ready, into, e)
      return
    except BaseException as e:  # every failure reaches the waiting requests
      for record, index, future in ready:
        settle(future, error=self._wrap(record, index, e))
      return
    for (record, index, future), chunk in zip(ready, chunks):
      record.next_index = index + 1
      record.thin(self._limits.recent_snapshots)
      self._held.note(record)
      settle(future, chunk)

  def _produce_each(self, ready: List[Job], into: Dict[int, Chunk],
                    error: Exception) -> None:
    """After a group's read failed with ``error``: each chain's chunk
    produced alone (produce locks still held), so that the failure reaches
    the chains whose rows fail, named by their own chain, and the others
    get their chunks. One read for all chains does not say whose row
    failed."""
    for record, index, future in ready:
      if self._released is not None or isinstance(
          error, PipelineReleasedError):
        settle(future, error=self._wrap(record, index, error))
        continue
      try:
        chunk = self._produce_locked(record, index, into.get(id(future)))
        self._held.note(record)
      except BaseException as e:  # every failure reaches its request
        settle(future, error=self._wrap(record, index, e))
      else:
        settle(future, chunk)

  def _wrap(self, record: ChainRecord, index: int, e: BaseException):
    _drop_frames(e)
    if isinstance(e, (HostLoaderError, PipelineReleasedError)):
      return e
    if isinstance(e, KeyboardInterrupt):  # Ctrl-C, not the loader's fault
      error = interrupted(e)
      error.__cause__ = e
      return error
    error = HostLoaderError(
        f"{self.name}, chain {record.number}, chunk {index}: "
        f"{type(e).__name__}: {e}")
    error.__cause__ = e
    return error

  def _produce(self, record: ChainRecord, index: int,
               out: Optional[Chunk] = None) -> Chunk:
    if self._released is not None:
      raise PipelineReleasedError(self._released)
    record.produce_lock.acquire()
    try:
      chunk = self._produce_locked(record, index, out)
      self._held.note(record)
    finally:
      record.let_go()
      if self._released is not None:  # released while producing
        record.close(blocking=True)
    return chunk  # no trimming here: see ChainStore.trim_idle

  def _produce_locked(self, record: ChainRecord, index: int,
                      out: Optional[Chunk] = None) -> Chunk:
    """Produces chunk ``index`` (with the chain's ``produce_lock`` held),
    moving the cursor back to a snapshot first if it stands elsewhere;
    into ``out`` if given."""
    cursor = record.cursor
    if record.next_index != index and not self._stand_at(record, index):
      base = max(i for i in record.snapshots if i <= index)
      if index - base > self._limits.max_replay:
        raise ValueError(
            f"chunk {index} of chain {record.number} is {index - base} "
            f"chunks past its nearest snapshot (chunk {base}), more than "
            f"the {self._limits.max_replay} a request may replay; the "
            "state's chunk counter does not come from this chain")
      self._warn_replay(record, index, base)
      standing, record.next_index = record.next_index, None
      try:
        cursor.seek(record.snapshots[base])
      except SeekRefused:  # it stands where it stood
        record.next_index = standing
        raise
      record.next_index = base
    while True:
      current = record.next_index
      record.note_position(current)
      record.next_index = None  # unknown until the cursor returns
      chunk = cursor.produce(current, out if out is not None and (
          current == index) else self.layout.new_chunk(self._buffers.empty))
      record.next_index = current + 1
      record.thin(self._limits.recent_snapshots)
      if current == index:
        return self.layout.check(chunk)


class _Regions:
  """The ``allocate`` of a group produced into given chunks (see
  :meth:`Producer.produce_many`): a group's cursors ask for one buffer
  per leaf for all their rows, in leaf order; where the given chunks'
  leaves follow each other in memory, in the group's order, that buffer is
  the span of them, so the rows land in place. Where they are interleaved
  batch by batch instead (compiled code's buffers with the lane axis
  second, see ``Bridge``), ``interleaved`` is True and the buffer is the
  span of them in that order. Chunks that are one span in its order (the
  host's buffers whole, see ``Host.lanes``) are checked as one. Other
  requests get ``fallback``'s buffers."""

  def __init__(self, chunks: Sequence[Chunk],
               fallback: Callable[..., np.ndarray]):
    whole = spanned(chunks)
    if whole is not None:  # the host's buffers whole: no check per chunk
      self._spans = [a if _writable(a) else None for a in whole.leaves]

      def interleaved() -> List[Optional[np.ndarray]]:
        return [a.swapaxes(0, 1) if _writable(a.swapaxes(0, 1)) else None
                for a in whole.leaves]
    else:
      leaves = [[chunk.leaves[k] for chunk in chunks]
                for k in range(len(chunks[0].leaves))]
      self._spans = [_span(arrays) for arrays in leaves]

      def interleaved() -> List[Optional[np.ndarray]]:
        return [_interleaved_span(arrays) for arrays in leaves]
    self.interleaved = False
    if len(chunks) > 1 and any(span is None for span in self._spans):
      spans = interleaved()
      if all(span is not None for span in spans):
        self._spans, self.interleaved = spans, True
    self._next = 0
    self._fallback = fallback

  def __call__(self, shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
    k, self._next = self._next, self._next + 1
    span = self._spans[k] if k < len(self._spans) else None
    if span is not None and span.size == math.prod(shape) and (
        span.dtype == np.dtype(dtype)):
      return span.reshape(shape)  # a view: the span is contiguous
    return self._fallback(shape, dtype)


def _writable(array: np.ndarray) -> bool:
  return array.flags.c_contiguous and array.flags.writeable


def _interleaved_span(arrays: Sequence[np.ndarray]
                      ) -> Optional[np.ndarray]:
  """One writable C-contiguous array of shape ``(batches, len(arrays),
  ...)`` whose ``[:, g]`` is ``arrays[g]`` (alike, each a leading axis of
  batches over contiguous batches, interleaved in memory batch by batch);
  None if they are not laid out so."""
  first, lanes = arrays[0], len(arrays)
  if first.ndim < 2 or first.shape[0] == 0:
    return None
  batch = first[0].nbytes
  if not all(a.shape == first.shape and a.dtype == first.dtype
             and a.flags.writeable and a[0].flags.c_contiguous
             and a.strides[0] == lanes * batch for a in arrays):
    return None
  start = first.__array_interface__["data"][0]
  if any(a.__array_interface__["data"][0] != start + g * batch
         for g, a in enumerate(arrays)):
    return None
  return np.lib.stride_tricks.as_strided(
      first, (first.shape[0], lanes) + first.shape[1:],
      (lanes * batch, batch) + first.strides[1:], writeable=True)


def _span(arrays: Sequence[np.ndarray]) -> Optional[np.ndarray]:
  """One writable array over ``arrays`` (C-contiguous, alike, each
  starting where the one before ends), stacked on a new leading axis; None
  if they are not laid out so."""
  first = arrays[0]
  if not all(_writable(a) and a.shape == first.shape
             and a.dtype == first.dtype for a in arrays):
    return None
  start = first.__array_interface__["data"][0]
  if any(a.__array_interface__["data"][0] != start + g * first.nbytes
         for g, a in enumerate(arrays)):
    return None
  return np.lib.stride_tricks.as_strided(
      first, (len(arrays),) + first.shape, (first.nbytes,) + first.strides,
      writeable=True)


def _drop_frames(error: BaseException) -> None:
  """Replaces the tracebacks of ``error`` and of the errors it chains (its
  cause and context) by a note with their text. ``error`` is kept in a
  chunk's future, and a traceback's frames, with the frames that called
  them, hold the chain and that future: a reference cycle that would keep
  the loader alive until a garbage collection."""
  pending, seen = [error], set()
  while pending:
    e = pending.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    if e.__traceback__ is not None:
      if not isinstance(e, PipelineReleasedError):  # raised by release
        e.add_note("Traceback on the host (most recent call last):\n"
                   + "".join(traceback.format_tb(e.__traceback__)).rstrip())
      e.__traceback__ = None
    pending += [e.__cause__, e.__context__]
