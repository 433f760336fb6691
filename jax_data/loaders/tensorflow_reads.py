"""The rows of random chains of
:class:`~jax_data.loaders.tensorflow_loader.TensorflowDataLoader` read from
the pipeline (``in_memory=False``): :class:`PipelineRows`.

A chain's shuffle buffer asks for stream elements in order, pass after pass.
Chains of one shard that are at the same place in their streams (every chain
of ``init_fn(seed=range(C))``, stepped together under ``vmap``) need the same
elements at the same time, and only their shuffles differ; so they read one
iterator between them, a :class:`SharedReads`, and gather from the elements
it holds (the chains of one request all at once,
:meth:`PipelineRows.rows_together`). A chain that is too far from the
others for the elements held (restored elsewhere, left behind) reads an
iterator of its own until it meets them again. Measured with 256 chains
(N = 1e5, caches of 10 batches of 64 rows of 133 bytes, 2 cores), an
iterator each against one shared: 1,055 against 35 threads, 22.8 against
2.3 ms a step, 438 against 262 MiB of peak resident set above the start.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
import threading
import traceback
import weakref
from typing import Callable
from typing import Deque
from typing import Dict
from typing import Iterator
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple
from typing import Union

import numpy as np
import tensorflow as tf

from jax_data.loaders.chains import LaterRows
from jax_data.loaders.tensorflow_rows import IteratorCloser
from jax_data.loaders.tensorflow_rows import Reading
from jax_data.loaders.tensorflow_rows import Rows
from jax_data.loaders.tensorflow_rows import Wanted
from jax_data.loaders.tensorflow_rows import in_order
from jax_data.loaders.tensorflow_rows import read_later
from jax_data.loaders.tensorflow_rows import released_error
from jax_data.streams.sampling import Held
from jax_data.streams.sampling import HeldRows

Block = Tuple[np.ndarray, Rows]  # element numbers (sorted), their rows

# How often a chain that waits for a shared read looks at its stop event.
_STOP_POLL_S = 0.05


def _not_held(count: int) -> RuntimeError:
  return RuntimeError(
      f"internal error: {count} of the elements wanted are not held; please "
      "report it")


def _gather(held: Optional[Block], runs: List[Block], wanted: np.ndarray,
            out: Rows) -> None:
  """Fills ``out`` with the rows of the elements ``wanted``. ``runs`` are
  blocks of consecutive numbers that follow one another; elements before
  the first are in ``held`` (sorted numbers). The first run is gathered
  for every element at once (found by subtraction); the elements of the
  others, and the held ones, overwrite theirs."""
  old = None
  runs = [run for run in runs if run[0].size]
  if runs:
    base = int(runs[0][0][0])
    offset = wanted - base
    end = 0
    for i, (numbers, rows) in enumerate(runs):
      start, end = int(numbers[0]) - base, int(numbers[-1]) - base + 1
      if i == 0:
        at = np.clip(offset, 0, end - 1)
        for leaf, row in zip(out, rows):
          np.take(row, at, axis=0, out=leaf)
      else:
        positions = np.flatnonzero((offset >= start) & (offset < end))
        for leaf, row in zip(out, rows):
          leaf[positions] = row[offset[positions] - start]
    beyond = np.count_nonzero(offset >= end)
    if beyond:
      raise _not_held(beyond)
    old = np.flatnonzero(offset < 0)
  if old is not None and not old.size:
    return
  numbers, rows = held if held else (np.empty(0, np.int64), [])
  asked = wanted if old is None else wanted[old]
  at = np.minimum(np.searchsorted(numbers, asked), max(numbers.size - 1, 0))
  missing = asked.size if not numbers.size else np.count_nonzero(
      numbers[at] != asked)
  if missing:
    raise _not_held(missing)
  for leaf, row in zip(out, rows):
    if old is None:
      np.take(row, at, axis=0, out=leaf)
    else:
      leaf[old] = row[at]


def _from(block: Block, first: int) -> Optional[Block]:
  """The part of ``block`` with numbers from ``first`` on (views), or None
  if empty."""
  numbers, rows = block
  start = int(np.searchsorted(numbers, first))
  if start >= numbers.size:
    return None
  if start == 0:
    return block
  return numbers[start:], [row[start:] for row in rows]


def _base(array: np.ndarray) -> np.ndarray:
  """The array whose memory ``array`` views (itself if it owns it)."""
  while isinstance(array.base, np.ndarray):
    array = array.base
  return array


def _bytes(blocks: List[Block]) -> int:
  """The bytes of the rows of ``blocks`` (the whole arrays that views keep
  alive)."""
  arrays = {id(a): a for numbers, rows in blocks
            for a in [numbers] + [_base(row) for row in rows]}
  return sum(a.nbytes for a in arrays.values())


class _CatchUp:
  """The rows of elements ``numbers`` (sorted) a chain needs, copied from
  the blocks read as they pass them (in the reader's thread)."""

  def __init__(self, numbers: np.ndarray, formats):
    self.numbers = numbers
    self.rows = [np.empty((numbers.size,) + fmt.shape, fmt.dtype)
                 for fmt in formats]
    self.filled = 0  # numbers[:filled] are copied

  def copy(self, first: int, rows: Rows) -> None:
    """From the block of elements ``first ..`` read: ``rows``."""
    start = self.filled
    stop = int(np.searchsorted(self.numbers, first + len(rows[0])))
    if stop > start:
      at = self.numbers[start:stop] - first
      for out, row in zip(self.rows, rows):
        np.take(row, at, axis=0, out=out[start:stop])
      self.filled = stop


class SharedReads:
  """One iterator over a shard's pipeline, read pass after pass in blocks
  of ``rows_per_read`` elements, for the chains that read the shard at
  about the same place (:class:`PipelineRows` with ``shared``).

  Elements are numbered along the passes as a chain numbers them. The
  elements read last, up to :attr:`reach` behind the newest, are held as
  one window of consecutive elements (copied into it at each read, once
  for all chains, where chains then gather from one array by
  subtraction, not from several blocks by search). The window is cut
  only at a read, never where the chains served so far are: the chains
  served after them need the same elements.

  Each chain that reads here has a mark: it needs no element before it
  from here (it took them, or holds the rows of those its shuffle buffer
  still holds). A chain whose mark the window leaves behind is let go
  (:meth:`take` answers None) and reads on by itself. A chain joins
  (:meth:`join`) where the window, or the next read, reaches its mark;
  once no chain reads here the iterator is dropped, and the next chain to
  join starts it again at the start of its pass.

  The window reaches four reads and ``buffer * max(1, ln(chains))`` elements
  behind the newest (``buffer``: the chains' shuffle buffer slots;
  ``chains``: the most that read here together so far), and back to the mark
  of the chain furthest behind within twice that. An element stays in a
  shuffle buffer of ``buffer`` slots for ``buffer`` steps on average,
  geometrically distributed, so a chain holds the rows of the few elements
  of its buffer older than that (:meth:`PipelineRows.rows`), about ``buffer
  / chains`` each, and the window the others once for all chains: with 256
  chains of 10,000 slots, about 65,000 rows in all where each chain holding
  its buffer's rows held 2,560,000.

  Reads run in a :class:`Reader` of their own (in the loader's reading
  threads; a new one each time every chain is let go, so that new chains
  never wait behind a read of chains gone): a chain waiting for one gives
  up when its own stop event is set (a release), and the read goes on for
  the others. A read that fails lets every chain go (the iterator's
  position is unknown); the chains waiting for it raise its error, and
  the chains read again from the start of their pass, once for all those
  that meet there.
  """

  def __init__(self, data: tf.data.Dataset, count: int, rows_per_read: int,
               reading: Reading, closer: IteratorCloser, buffer: int):
    self._data = data
    self._count = count
    self._rows_per_read = rows_per_read
    self._reading = reading
    self._closer = closer
    self._buffer = buffer
    self._cond = threading.Condition()
    self._iterator: Optional[Iterator] = None
    # The elements held: numbers first .. next - 1 and their rows.
    self._window: Optional[Block] = None
    self._next = 0  # the number of the element read next
    self._marks: Dict[int, int] = {}  # id of a chain's rows -> its mark
    self._most = 1  # the most chains that read here at once so far
    # Chains that joined needing elements before the window's reach (chains
    # restored together): the rows of those elements, copied as reads
    # pass them (see join_together).
    self._catching: Dict[int, _CatchUp] = {}
    # Chains dropped unclosed (appended by their finalizers, which may run
    # anywhere, even where a lock of the closer's is held: no lock here).
    self._gone: Deque[int] = collections.deque()
    self._busy = False  # a read of this generation is queued or under way
    # Bumped whenever every chain is let go (the last one left, or a read
    # failed); a read of an older generation is dropped.
    self._generation = 0
    self._failure: Optional[Tuple[int, BaseException]] = None
    self._reader = reading.reader()

  @property
  def reach(self) -> int:
    """How far behind the newest element the window reaches, for the most
    chains that read here at once so far (see the class's notes): it
    never shrinks, so that the chains' marks, set within it, stay within
    it when chains leave or are let go (a failed read), and they join
    again together."""
    return self._reach(0)

  def _reach(self, more: int) -> int:
    """:attr:`reach` were ``more`` chains to join those reading here.
    (With the lock held, unless ``more`` is 0.)"""
    chains = max(self._most, len(self._marks) + more)
    return 4 * self._rows_per_read + int(
        self._buffer * max(1.0, math.log(chains)))

  def _add(self, marks: Dict[int, int]) -> None:
    """The chains ``marks`` (keys, marks) read here now. (With the lock
    held.)"""
    self._marks.update(marks)
    self._most = max(self._most, len(self._marks))

  @property
  def rows_per_read(self) -> int:
    return self._rows_per_read

  def chains(self) -> int:
    """Chains reading here now."""
    with self._cond:
      self._forget_gone()
      return len(self._marks)

  def held_bytes(self) -> int:
    """The bytes of the elements held."""
    with self._cond:
      return _bytes([self._window] if self._window else [])

  def gone(self, key: int) -> None:
    """The chain ``key`` was dropped unclosed (from its finalizer)."""
    self._gone.append(key)

  def _forget_gone(self) -> None:
    """(With the lock held.)"""
    while self._gone:
      self._leave(self._gone.popleft())

  def _first(self) -> int:
    """The number of the first element held. (With the lock held.)"""
    return int(self._window[0][0]) if self._window else self._next

  def join(self, key: int, mark: int,
           own: Optional[Tuple[Iterator, int, List[Block]]] = None
           ) -> Optional[bool]:
    """Whether the chain ``key``, whose mark is ``mark``, now reads here:
    None if not, True if its ``own`` reads were taken, False if not.

    With no chain reading here, the chain's ``own`` reads (its iterator,
    the number it reads next, and the blocks it read from its mark on)
    become the shared ones, if it has them; else the shared iterator
    starts again at the start of its mark's pass (the chain replays less
    than a pass once, and the others join it as they meet it)."""
    with self._cond:
      self._forget_gone()
      if not self._marks:
        self._let_all_go()
        self._failure = None
        self._add({key: mark})
        if own is None:
          self._next = mark - mark % self._count
          return False
        self._iterator, self._next, blocks = own
        if blocks:
          self._window = (np.concatenate([b[0] for b in blocks]), [
              np.concatenate(leaves) for leaves in zip(*[
                  b[1] for b in blocks])])
        return True
      if self._first() <= mark <= self._next + self._rows_per_read:
        self._add({key: mark})
        return False
      return None

  def join_together(self, marks: Dict[int, int], stop: int,
                    needs: Optional[Dict[int, Tuple[int, np.ndarray]]] = None
                    ) -> List[int]:
    """The chains of ``marks`` (keys, their marks) that now read here,
    needing elements up to ``stop``: with no chain reading here, all of
    them, the shared iterator started again at the start of the pass of
    the first element any of them needs (chains restored together to one
    place, each needing the elements of its shuffle buffer, read the pass
    up to there once); else those that :meth:`join` would let join.

    ``needs[key]`` is ``(horizon, numbers)``: the chain needs the elements
    ``numbers`` (sorted), before the window's reach, and the others from
    ``horizon`` on (its mark here). With no chain reading here, the reads
    copy the rows of ``numbers`` as they pass them (:meth:`caught` gives
    them); else it is not let join. Without ``needs``, a chain whose mark
    is beyond the reach of ``stop`` is not let join."""
    needs = needs or {}
    with self._cond:
      self._forget_gone()
      idle = not self._marks
      # The reach of all of them, which the window keeps from now on:
      # those not let join now read by themselves and join later.
      self._most = max(self._most, len(self._marks) + len(marks))
      reach = self.reach
      if idle:
        near = {key: needs[key][0] if key in needs else mark
                for key, mark in marks.items()
                if key in needs or stop - mark <= reach}
      else:
        near = {key: mark for key, mark in marks.items()
                if key not in needs and stop - mark <= reach and
                self._first() <= mark <= self._next + self._rows_per_read}
      if not near:
        return []
      if idle:
        self._let_all_go()
        self._failure = None
        first = min([*near.values()] + [int(needs[key][1][0])
                                        for key in near if key in needs])
        self._next = first - first % self._count
        for key in near:
          if key in needs:
            self._catching[key] = _CatchUp(needs[key][1],
                                           self._reading.formats)
      self._add(near)
      return list(near)

  def reach_with(self, more: int) -> int:
    """:attr:`reach` were ``more`` chains to join those reading here."""
    with self._cond:
      return self._reach(more)

  def caught(self, key: int) -> Optional[Block]:
    """The rows a chain that joined with ``needs`` needed, once the reads
    passed them all (then it no longer waits for them), else None."""
    with self._cond:
      catch = self._catching.get(key)
      if catch is None or catch.filled < catch.numbers.size:
        return None
      del self._catching[key]
      return catch.numbers, catch.rows

  def leave(self, key: int) -> None:
    """The chain ``key`` no longer reads here; the last one to leave drops
    the iterator (in the background) and the elements held."""
    with self._cond:
      self._forget_gone()
      self._leave(key)

  def _leave(self, key: int) -> None:
    """(With the lock held.)"""
    self._catching.pop(key, None)
    if self._marks.pop(key, None) is not None and not self._marks:
      self._let_all_go()

  def take(self, key: int, stop: int, cancelled: threading.Event
           ) -> Optional[Block]:
    """Views of the elements held from the chain's mark on, read up to
    ``stop`` first if need be; None if the chain was let go (it reads by
    itself).

    Raises:
      PipelineReleasedError: ``cancelled`` was set while the chain waited.
      Exception: the read the chain waited for failed (a copy of its
        error).
    """
    with self._cond:
      if not self._wait([key], stop, [cancelled]):
        return None
      if self._window is None:  # it needs nothing new (a buffer emptied)
        return np.empty(0, np.int64), []
      numbers, rows = self._window
      skip = self._marks[key] - int(numbers[0])  # >= 0: not let go
      return numbers[skip:], [row[skip:] for row in rows]

  def take_together(self, keys: Sequence[int], stop: int,
                    cancelled: Sequence[threading.Event]
                    ) -> Optional[Block]:
    """:meth:`take` for the chains ``keys`` at once: the whole window, read
    up to ``stop`` first if need be, which holds every element from each
    chain's mark on; None if any of them was let go, or nothing was read
    (a buffer emptied needs nothing new). Raises as :meth:`take` does, if
    any of ``cancelled`` is set."""
    with self._cond:
      if not self._wait(keys, stop, cancelled):
        return None
      return self._window

  def _wait(self, keys: Sequence[int], stop: int,
            cancelled: Sequence[threading.Event]) -> bool:
    """Waits until elements up to ``stop`` are read; whether the chains
    ``keys`` all still read here then. (With the lock held.)"""
    self._forget_gone()
    generation = self._generation
    while True:
      if self._generation != generation or not all(
          key in self._marks for key in keys):
        failure = self._failure
        if failure is not None and failure[0] == generation:
          raise _copy(failure[1])
        return False
      if self._next >= stop:
        return True
      if not self._busy:
        self._busy = True
        self._reader.submit(functools.partial(self._read, generation))
      self._cond.wait(_STOP_POLL_S)
      if any(event.is_set() for event in cancelled):
        raise released_error()

  def advance(self, marks: Dict[int, int]) -> None:
    """Each chain ``key`` of ``marks`` took every element before
    ``marks[key]``."""
    with self._cond:
      for key, mark in marks.items():
        if key in self._marks:
          self._marks[key] = mark

  def _let_all_go(self) -> None:
    """(With the lock held.)"""
    self._generation += 1
    self._marks.clear()
    self._catching.clear()
    self._window = None
    held, self._iterator = [self._iterator], None
    self._closer.close_later(held)
    if self._busy:  # that read may never end: later ones go elsewhere
      self._busy = False
      self._reader = self._reading.reader()

  def _read(self, generation: int) -> None:
    """Reads the next block and makes the next window (in the reader's
    thread), for the chains of ``generation``."""
    with self._cond:
      if generation != self._generation:
        return
      iterator = self._iterator
      window, first = self._window, self._next
      reach = self.reach
      oldest = min(self._marks.values(), default=first)
      catching = list(self._catching.values())
    fresh = iterator is None
    try:
      if fresh:
        iterator = in_order(self._data.repeat().batch(self._rows_per_read))
      rows = self._reading.next_rows(iterator, fresh)
      stop = first + len(rows[0])
      for catch in catching:
        catch.copy(first, rows)
      if window:  # the elements within reach stay, with the new ones
        # (and those of the chain furthest behind, within twice the reach)
        first = max(int(window[0][0]), min(stop - reach, oldest),
                    stop - 2 * reach)
        kept = first - int(window[0][0])
        rows = [np.concatenate([old[kept:], new])
                for old, new in zip(window[1], rows)]
      window = (np.arange(first, stop), rows)
    except BaseException as e:  # pylint: disable=broad-except
      # The error's traceback holds the frames it passed: not the
      # iterator, nor the rows (the iterator goes to the closer, as every
      # dropped one).
      held, iterator, window, rows = [iterator if fresh else None], None, (
          None), None
      traceback.clear_frames(e.__traceback__)
      with self._cond:
        if self._generation == generation:
          self._let_all_go()
          self._failure = (generation, e)
        self._cond.notify_all()
      self._closer.close_later(held)
      return
    with self._cond:
      if self._generation == generation:
        self._busy = False
        if fresh:
          self._iterator = iterator
        self._window, self._next = window, stop
        behind = [key for key, mark in self._marks.items() if mark < first]
        for key in behind:
          del self._marks[key]
        if behind and not self._marks:
          self._let_all_go()
      elif fresh:  # every chain left meanwhile
        held = [iterator]
        del iterator
        self._closer.close_later(held)
      self._cond.notify_all()


def _copy(error: BaseException) -> BaseException:
  """A copy of ``error`` with its traceback, to raise in one of several
  threads: raising the same one in each would add every thread's frames
  to it."""
  try:
    copied = copy.copy(error)
  except Exception:  # pylint: disable=broad-except
    return error
  if type(copied) is not type(error) or copied.args != error.args:
    return error
  copied.__cause__, copied.__context__ = error.__cause__, error.__context__
  return copied.with_traceback(error.__traceback__)


def _stacked(keeps: Sequence[Held]) -> bool:
  """Whether ``keeps`` are the non-empty buffers of chains stepped
  together, one array (:class:`HeldRows`)."""
  return isinstance(keeps, HeldRows) and keeps.local.shape[1] > 0


def _split_all(keeps: Sequence[Held], horizons: np.ndarray
               ) -> Tuple[np.ndarray, np.ndarray, List[Optional[int]]]:
  """:meth:`Held.split` of each chain's ``keeps[i]`` at ``horizons[i]``:
  the elements before, sorted and concatenated in chain order, how many
  each chain has there, and the least of each one's others. Buffers of
  chains stepped together (:class:`HeldRows`) are split in a few array
  calls, not a few per chain (3 ms a refresh of 1,024 chains)."""
  if _stacked(keeps):
    return keeps.split_each(horizons)
  splits = [keep.split(horizon)
            for keep, horizon in zip(keeps, horizons.tolist())]
  counts = np.asarray([part.size for part, _ in splits], np.int64)
  kept = (np.concatenate([part for part, _ in splits]) if counts.any()
          else np.empty(0, np.int64))
  return kept, counts, [rest for _, rest in splits]


def _merged(held: Optional[Block], more: Block) -> Block:
  """The rows held and ``more`` (other elements) as one block, by number."""
  if held is None:
    return more
  numbers = np.concatenate([held[0], more[0]])
  order = np.argsort(numbers, kind="stable")
  return numbers[order], [np.concatenate([a, b])[order]
                          for a, b in zip(held[1], more[1])]


def _mark_after(rest: Optional[int], mark: int, stop: int) -> int:
  """A chain's mark once it took the elements before ``stop``: ``rest``,
  its least element kept without rows, if any, else ``stop`` (not less
  than before: a buffer emptied at a pass's end reads nothing new)."""
  return rest if rest is not None else max(mark, stop)


def _gather_window(window: Block, offset: np.ndarray, out: Rows,
                   sources: Sequence[PipelineRows],
                   lane_of: Callable[[np.ndarray], np.ndarray]) -> None:
  """Fills ``out`` with the rows of the elements of several chains at
  ``offset`` from the start of the ``window`` of consecutive elements:
  from the window where they are in it, else (before it) from the shuffle
  buffer of their chain, ``sources[lane_of(positions)]``."""
  numbers, rows = window
  base = int(numbers[0])
  beyond = np.count_nonzero(offset >= numbers.size)
  if beyond:
    raise _not_held(beyond)
  before = np.flatnonzero(offset < 0)
  for leaf, row in zip(out, rows):  # (those before the window: row 0)
    np.take(row, offset, axis=0, out=leaf, mode="clip")
  if not before.size:
    return
  lanes = lane_of(before)
  for lane in np.unique(lanes).tolist():
    positions = before[lanes == lane]
    parts = [np.empty((positions.size,) + leaf.shape[1:], leaf.dtype)
             for leaf in out]
    _gather(sources[lane]._held, [], offset[positions] + base, parts)  # pylint: disable=protected-access
    for leaf, part in zip(out, parts):
      leaf[positions] = part


class PipelineRows:
  """A chain's observations read from the pipeline in order, pass after
  pass (the default, ``in_memory=False``).

  Elements are numbered along the passes (element ``i`` of pass ``p`` is
  ``p * count + i``). The chain holds what it read and still needs: the
  rows of elements its shuffle buffer holds (copied into one small block:
  all of them when it reads by itself, only those the shared window may
  drop when it reads through it) and, when it reads by itself, those read
  ahead (views of the last block read). With ``shared``, it reads through
  the :class:`SharedReads` of its shard whenever it can join it.
  """

  def __init__(self, data: tf.data.Dataset, count: int, rows_per_read: int,
               reading: Reading, closer: IteratorCloser,
               shared: Optional[SharedReads] = None):
    self._data = data
    self._rows_per_read = rows_per_read
    self._reading = reading
    self._closer = closer
    self._shared = shared
    self._in_shared = False
    self.count = count
    self._iterator: Optional[Iterator] = None
    self._reader = reading.reader()
    self._cancelled = threading.Event()
    self.restart(0)
    if shared is not None:  # a chain dropped unclosed leaves too
      # Not at the interpreter's exit: no TensorFlow iterator is dropped
      # while it finalizes.
      weakref.finalize(self, shared.gone, id(self)).atexit = False

  def restart(self, first: int, mark: Optional[int] = None) -> None:
    """Reads again from element ``first``, the start of a pass, and needs
    the elements from ``mark`` on (default ``first``: after a seek, the
    oldest element of the shuffle buffer, so that chains restored
    together to one place read the pass once between them); the iterator
    read so far is dropped in the background."""
    self._leave_shared()
    self._own_from(first)
    self._held: Optional[Block] = None  # the shuffle buffer's elements
    # It needs no element before its mark but those it holds the rows of.
    self._mark = first if mark is None else mark

  def _own_from(self, first: int) -> None:
    """Reads by itself from the start of ``first``'s pass on."""
    held, self._iterator = [self._iterator], None
    self._closer.close_later(held)
    self._ahead: List[Block] = []  # read, not taken yet
    self._next = first - first % self.count  # the number read next

  def _leave_shared(self) -> None:
    if self._in_shared:
      self._in_shared = False
      self._shared.leave(id(self))

  def close(self) -> None:
    """Drops what it holds."""
    self.restart(0)

  def cancel(self) -> None:
    """A release: a read it waits for, and every later one, raises
    :class:`~jax_data.PipelineReleasedError`."""
    self._cancelled.set()
    self._reader.cancel()

  def held_bytes(self) -> int:
    """The bytes of the rows it holds (the whole blocks that views keep
    alive; not the shared blocks)."""
    return _bytes(([self._held] if self._held else []) + self._ahead)

  def group_key(self) -> Optional[SharedReads]:
    """Its shard's shared reads, if it has them: chains whose rows have
    one key can gather their rows together (:meth:`rows_together`)."""
    return self._shared

  @staticmethod
  def rows_together(sources: Sequence[PipelineRows], wanted: Wanted,
                    keeps: Sequence[Held], out: Rows,
                    later: Optional[Sequence[Tuple[int, ...]]] = None
                    ) -> Union[bool, LaterRows]:
    """:meth:`rows` of chains of one :meth:`group_key` at once: chain
    ``i`` wants the elements ``wanted.numbers[i]``, in the order of the
    rows of ``out`` that ``wanted`` gives, and keeps ``keeps[i]``. Where
    every chain reads through the shared
    reads now (or they join them together), their rows are gathered from
    its window in one piece and True is returned; else False, with
    nothing written and no chain moved (read them chain by chain).

    With ``later`` (the leaves' shapes), rows that are all in the window
    are read from it when served instead (the window's arrays do not
    change: each read makes new ones), and their reading is returned
    (:func:`~jax_data.loaders.tensorflow_rows.read_later`); the chains
    move as they would have. A shuffle buffer of 100 slots almost never
    holds an element older than the window of 1,024 chains."""
    shared = sources[0]._shared  # pylint: disable=protected-access
    if shared is None or any(s._shared is not shared for s in sources):  # pylint: disable=protected-access
      return False
    if any(s._cancelled.is_set() for s in sources):  # pylint: disable=protected-access
      raise released_error()
    stops = np.maximum(wanted.max_each(), keeps.max_each() if _stacked(
        keeps) else [keep.max() if keep.size else -1 for keep in keeps]) + 1
    # Chains that do not read there yet (the first chunk, or chains
    # restored together) join together, unless reading by themselves;
    # those that need elements beyond the window's reach (restored into a
    # pass, the oldest elements of their shuffle buffers) have their rows
    # copied as the shared reads pass them.
    outside = {id(s): (lane, s) for lane, s in enumerate(sources)
               if not s._in_shared and s._iterator is None}  # pylint: disable=protected-access
    needs: Dict[int, Tuple[int, np.ndarray]] = {}
    if outside:
      reach = shared.reach_with(len(outside))
      for key, (lane, s) in outside.items():
        horizon = int(stops[lane]) - reach + 2 * shared.rows_per_read
        if horizon > s._mark:  # pylint: disable=protected-access
          wants = np.union1d(wanted.numbers[lane], keeps[lane].numbers())
          wants = wants[(wants >= s._mark) & (wants < horizon)]  # pylint: disable=protected-access
          if wants.size:
            needs[key] = (horizon, wants)
      for key in shared.join_together(
          {key: s._mark for key, (_, s) in outside.items()},  # pylint: disable=protected-access
          int(stops.max()), needs):
        source = outside[key][1]
        source._in_shared = True  # pylint: disable=protected-access
        source._own_from(source._mark)  # pylint: disable=protected-access
    if not all(s._in_shared for s in sources):  # pylint: disable=protected-access
      for key in needs:  # they would wait for rows nobody reads for them
        outside[key][1]._leave_shared()  # pylint: disable=protected-access
      return False
    try:
      window = shared.take_together(
          [id(s) for s in sources], int(stops.max()),
          [s._cancelled for s in sources])  # pylint: disable=protected-access
    finally:
      # The chains that joined needing rows copied: once copied, they
      # hold them and their marks move to where the window keeps the
      # rest; else they leave (their marks there would be past elements
      # they lack).
      for key, (horizon, _) in needs.items():
        source = outside[key][1]
        if source._in_shared:  # pylint: disable=protected-access
          rows = shared.caught(key)
          if rows is None:
            source._leave_shared()  # pylint: disable=protected-access
          else:
            source._held = _merged(source._held, rows)  # pylint: disable=protected-access
            source._mark = horizon  # pylint: disable=protected-access
    if window is None or not window[0].size or not all(
        s._in_shared for s in sources):  # pylint: disable=protected-access
      return False
    # Every element from a chain's mark on is in the window; the elements
    # before the window, in the chain's rows held.
    base = int(window[0][0])

    def gather(wanted: Wanted, out: Rows) -> None:
      _gather_window(window, wanted.flat(base), out, sources,
                     wanted.lane_of)

    read: Union[bool, LaterRows] = True
    if later is not None and wanted.least() >= base and int(
        stops.max()) <= base + window[0].size:
      read = read_later(wanted, later, gather)  # none held by a chain
    else:
      gather(wanted, out)
    # As rows() does chain by chain: the elements of each buffer before
    # its horizon are held as rows (one array for all chains, few rows).
    marks = np.asarray([s._mark for s in sources])  # pylint: disable=protected-access
    horizons = np.maximum(
        marks, stops - shared.reach + 2 * shared.rows_per_read)
    kept, counts, rests = _split_all(keeps, horizons)
    held_rows = [np.empty((kept.size,) + row.shape[1:], row.dtype)
                 for row in window[1]]
    if kept.size:
      lanes = np.repeat(np.arange(len(sources)), counts)
      _gather_window(window, kept - int(window[0][0]), held_rows, sources,
                     lambda at: lanes[at])
    ends = np.cumsum(counts).tolist()
    new_marks = {}
    for lane, source in enumerate(sources):
      count, end = int(counts[lane]), ends[lane]
      # Copies (few rows): a view would keep the group's rows alive.
      source._held = None if not count else (  # pylint: disable=protected-access
          kept[end - count:end].copy(),
          [row[end - count:end].copy() for row in held_rows])
      source._mark = _mark_after(rests[lane], int(marks[lane]),  # pylint: disable=protected-access
                                 int(stops[lane]))
      new_marks[id(source)] = source._mark  # pylint: disable=protected-access
    shared.advance(new_marks)
    return read

  def reads_shared(self) -> bool:
    """Whether it reads through its shard's :class:`SharedReads` now."""
    return self._in_shared

  def rows(self, wanted: np.ndarray, keep: Held, out: Rows) -> Rows:
    """The rows of elements ``wanted`` written into ``out``. Afterwards the
    chain can still give the elements ``keep`` (its shuffle buffer's) and
    those after all ``wanted`` and ``keep``: it holds the rows of those of
    ``keep`` before its horizon (all of them when it reads by itself),
    and its mark stays before the others, which the shared window keeps
    (or the chain reads again). Where it raises, it gave nothing: it can
    give the same elements again."""
    if self._cancelled.is_set():
      raise released_error()
    stop = int(max(wanted.max(), keep.max() if keep.size else -1)) + 1
    taken = self._take_shared(stop)
    if taken is None:
      try:
        while self._next < stop:
          self._read()
      except BaseException:
        self._own_from(self._mark)  # its iterator's place is unknown
        raise
      taken = self._ahead
    _gather(self._held, taken, wanted, out)
    kept, rest = keep.split(self._horizon(stop))
    held = None
    if kept.size:
      held = (kept, [np.empty((kept.size,) + fmt.shape, fmt.dtype)
                     for fmt in self._reading.formats])
      _gather(self._held, taken, kept, held[1])
    self._held, self._mark = held, _mark_after(rest, self._mark, stop)
    if self._in_shared:
      self._shared.advance({id(self): self._mark})
    else:
      self._ahead = [part for part in (_from(block, self._mark)
                                       for block in self._ahead) if part]
    return out

  def _horizon(self, stop: int) -> int:
    """The elements of its shuffle buffer before this one are kept as rows
    once it took elements up to ``stop``: all of them when it reads by
    itself (its reads drop what it took); reading through the shared
    reads, those the window may drop before the chain's next chunk
    (another read and a margin of one)."""
    horizon = stop
    if self._in_shared:
      horizon = stop - self._shared.reach + 2 * self._rows_per_read
    return max(self._mark, horizon)

  def _take_shared(self, stop: int) -> Optional[List[Block]]:
    """The elements from the mark up to ``stop`` read through the shared
    reads, or None: read them by itself."""
    shared = self._shared
    if shared is None:
      return None
    for _ in range(2):  # once more after being let go: it may join again
      if not self._in_shared:
        if stop - self._mark > shared.reach:
          # More than the shared window holds (after a seek into a
          # pass, its shuffle buffer's oldest element is further back):
          # read by itself, and join with its own iterator once it has
          # read them.
          return None
        own = None
        if self._iterator is not None:
          own = (self._iterator, self._next, self._ahead)
        joined = shared.join(id(self), self._mark, own)
        del own
        if joined is None:
          return None
        self._in_shared = True
        if joined:  # its reads are the shared ones now
          self._iterator = None
        self._own_from(self._mark)  # drops its own iterator, if it has one
      taken = shared.take(id(self), stop, self._cancelled)
      if taken is not None:
        return [taken]
      # Let go: reads by itself from the start of its pass, unless it
      # joins again (every chain was let go: the shared reads restart).
      self._in_shared = False
      self._own_from(self._mark)
    return None

  def _read(self) -> None:
    fresh = self._iterator is None
    if fresh:
      self._iterator = in_order(
          self._data.repeat().batch(self._rows_per_read), one_of_many=True)
    rows = self._reading.next_rows(self._iterator, fresh, self._reader)
    size = len(rows[0])
    block = _from((np.arange(self._next, self._next + size), rows),
                  self._mark)
    self._next += size
    if block is not None:  # elements before the mark were taken already
      self._ahead.append(block)
