"""A refresh of many counter-based chains with no Python per lane.

The vmapped chains of ``init_fn(seed=range(C), stream="counter")`` refresh
together, in one request of ``C`` lanes. The general path
(:meth:`~jax_data.serving.chunk_store.ChainStore.chunks`) claims, produces
and settles every lane's chunk on its own: about 20 ms of bookkeeping in a
refresh of 1,024 lanes, and most of the time of a refresh of a few batches
(1.3-1.9 ms for 256 lanes of one batch, whose rows take 0.2 ms to read).

A counter-based chain's chunk ``i`` is a pure function of its seed and
``i`` (its batches ``i * cache_size`` on). So a request whose lanes are all
chains of one group (the same rows, layout and stream mode:
:meth:`~jax_data.loaders.chains.ChainCursor.group_key`) needs none of it:
the chains' seeds, gathered once per set of chains, and the request's chunk
indices give every lane's indices in one draw, and the rows are read
straight into compiled code's buffers (:meth:`~jax_data.loaders.indexed.
IndexedCursor.read_group`). Nothing is stored, and the chains' cursors and
records are left as they are: a later request through the general path
moves a cursor to its chunk as it always does.

Only NumPy runs here; nothing calls JAX.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any
from typing import Callable
from typing import List
from typing import NamedTuple
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import Span
from jax_data.loaders.indexed import StepRows
from jax_data.serving.chain_records import ChainRecord
from jax_data.serving.chain_records import ChainTable
from jax_data.serving.chunk_store import ChainStore

# Sets of chains remembered (a pipeline's requests name one or a few).
_REMEMBERED = 8


class _Group(NamedTuple):
  lead: ChainRecord  # its cursor draws and reads for all
  seeds: np.ndarray  # uint64, one per lane


class GroupRefresh:
  """Serves the requests whose lanes are all chains of one group of
  counter-based chains, read in place (see the module's docstring).

  Args:
    chains: The pipeline's chains.
    layout: Their chunks.
  """

  def __init__(self, chains: ChainTable, layout: ChunkLayout):
    self._chains = chains
    self._layout = layout
    # Lanes' chains (bytes of the int32 array) -> their group, or None.
    self._groups: "collections.OrderedDict[bytes, Optional[_Group]]" = (
        collections.OrderedDict())
    self._removals = 0
    self._lock = threading.Lock()

  def serve_request(self, store: ChainStore, pipeline: int,
                    outs: Sequence[np.ndarray], pipelines: np.ndarray,
                    chains: np.ndarray, chunks: np.ndarray, need: np.ndarray,
                    plain: bool, cpu: bool, by_step: bool = False,
                    lanes_second: bool = False) -> bool:
    """Serves a request of pipeline ``pipeline`` (``Host.serve_into``'s
    arguments) if it is a refresh of every lane, all chains of one group
    read in place, and ``plain`` (one device's, no progress to report);
    whether it did.

    Read in place are the refreshes the store would read so (too large to
    keep ahead), and, on a CPU device (``cpu``), whose compiled code runs
    on the host's cores, those of groups whose rows are read as fast as
    from memory (``IndexedCursor.reads_memory``: arrays in memory, memmaps
    whose pages are in the page cache) whatever their size: produced
    ahead, they would take those cores from compiled code and be copied
    once more. Rows read from disk and decoded records are still produced
    ahead, beside compiled code. On 2 cores, 64 chains of 100 batches took
    145-182 us per step produced ahead and 122-159 us read in place; 256
    chains of 10 batches 671-719 and 415-420 us. Over a memmap in the page
    cache ("auto"'s caches, N = 1e5, medians alternated in one process)
    256 chains took 1,015 us per step produced ahead and 526 read in
    place, 16 chains 36 and 29; 1,024 chains of one batch 11,909 and 2,035.

    ``by_step``: ``outs`` are a buffer per step (:meth:`serve_steps_into`);
    ``lanes_second``: compiled code's buffers as they are, shaped lane axis
    first with their bytes laid out lane axis second
    (:meth:`serve_lanes_second_into`)."""
    lanes = need.size
    serve = (self.serve_steps_into if by_step else
             self.serve_lanes_second_into if lanes_second else self.serve_into)
    if (lanes < 2 or not plain or not need.all()
        or not (pipelines == pipeline).all()):
      return False
    in_place = store.reads_in_place(lanes)
    if not (cpu or in_place):
      return False
    if not serve(outs, chains, chunks, store.removals,
                 memory_only=not in_place):
      return False
    store.note_lanes(lanes)
    return True

  def serve_into(self, outs: Sequence[np.ndarray], chains: np.ndarray,
                 chunks: np.ndarray, removals: int, memory_only: bool
                 ) -> bool:
    """Writes chunk ``chunks[g]`` of chain ``chains[g]`` into lane ``g`` of
    ``outs`` (each leaf's and the mask's buffer, a leading lane axis) if
    the lanes are chains of one group and the buffers hold every lane's
    rows in one piece (with ``memory_only``, only if the group's rows are
    now read as fast as from memory: ``IndexedCursor.reads_memory``);
    whether it did.
    ``removals``: the store's count of chains taken out, which makes
    remembered groups stale.

    A failure leaves ``outs`` to the general path, which produces the
    chunks again and reports the failure as it does for any chunk."""
    buffers = _in_place(outs[:-1])
    if buffers is None:
      return False

    def finish(leaves: List[np.ndarray], mask: np.ndarray) -> None:
      self._layout.check_span(Span(leaves, mask), np.size(chunks))
      for out, leaf in zip(outs, leaves):
        if not same_memory(out, leaf):  # a view of the data
          np.copyto(out, leaf)
      _write_mask(outs[-1], mask)

    return self._serve(chains, chunks, removals, memory_only,
                       _Into(*buffers), finish)

  def serve_lanes_second_into(self, outs: Sequence[np.ndarray],
                              chains: np.ndarray, chunks: np.ndarray,
                              removals: int, memory_only: bool) -> bool:
    """:meth:`serve_into` into buffers shaped lane axis first whose bytes
    are laid out lane axis second (a CPU's refresh through the bridge's
    ``into_lanes_second_as_first``), taken as they are: each leaf's buffer
    holds every lane's rows batch by batch, in one piece, which is how the
    group reads them. No views are made to lay them out lane axis first
    and none are checked: at 1,024 vmapped chains of one batch a refresh
    (N = 1e5, 2 cores) the callback took 967 us against 1,014 through the
    views (medians, alternated), at 16 chains 289 against 332."""
    if not all(o.flags.c_contiguous and o.flags.writeable for o in outs):
      return False

    def finish(leaves: List[np.ndarray], mask: np.ndarray) -> None:
      del leaves  # read into the buffers themselves (_read_interleaved)
      _write_mask_lanes_second(outs[-1], mask)

    return self._serve(chains, chunks, removals, memory_only,
                       _Into(list(outs[:-1]), True), finish)

  def serve_steps_into(self, steps: Sequence[Sequence[np.ndarray]],
                       chains: np.ndarray, chunks: np.ndarray, removals: int,
                       memory_only: bool) -> bool:
    """:meth:`serve_into` into a buffer per step of the chunks
    (``steps[k]``: step ``k``'s leaves then its mask, a leading lane axis
    each), written step by step; whether it did."""
    if not all(o.flags.c_contiguous and o.flags.writeable
               for step in steps for o in step):
      return False

    def finish(leaves: List[Sequence[np.ndarray]], mask: np.ndarray) -> None:
      del leaves  # read into the steps' buffers themselves
      for k, step in enumerate(steps):
        _write_mask(step[-1], mask[:, k])

    return self._serve(chains, chunks, removals, memory_only,
                       _StepsInto(steps), finish)

  def _serve(self, chains: np.ndarray, chunks: np.ndarray, removals: int,
             memory_only: bool, allocate: Callable[..., Any],
             finish: Callable[[Any, np.ndarray], None]) -> bool:
    """A group's read of chunk ``chunks[g]`` of chain ``chains[g]`` into
    ``allocate``'s buffers, then ``finish(leaves, mask)``; whether it
    served them (see :meth:`serve_into`)."""
    chains = np.asarray(chains).reshape(-1)
    chunks = np.asarray(chunks, np.int64).reshape(-1)
    if chunks.min() < 0:
      return False  # the general path says what is wrong
    group = self._group(chains, removals)
    if group is None or (memory_only
                         and not group.lead.cursor.reads_memory()):  # type: ignore[attr-defined]
      return False
    lead, cursor = group.lead, group.lead.cursor
    served = False
    later: List[Callable[[], None]] = []  # the next draw, started last
    with lead.produce_lock:
      if lead.closed:
        return False
      try:
        leaves, mask = cursor.read_group(  # type: ignore[attr-defined]
            group.seeds, chunks * self._layout.cache_size, allocate, later)
        finish(leaves, mask)
        cursor.check()  # type: ignore[attr-defined]
        served = True
      except Exception:  # pylint: disable=broad-except
        pass  # the general path produces them again
      finally:
        released = self._chains.get(lead.number) is not lead
      if served and not released:
        for start in later:
          start()
    # The release left its cursor to close, as it was reading; a read it
    # cancelled fails, and the cursor must be closed all the same (its
    # loader's workers end when its last cursor closes).
    if released or lead.closing:
      lead.close(blocking=True)
    return served

  def _group(self, chains: np.ndarray, removals: int) -> Optional[_Group]:
    key = chains.tobytes()
    with self._lock:
      if removals != self._removals:
        self._groups.clear()
        self._removals = removals
      if key in self._groups:
        self._groups.move_to_end(key)
        return self._groups[key]
    group = self._find(chains.tolist())
    with self._lock:
      self._groups[key] = group
      if len(self._groups) > _REMEMBERED:
        self._groups.popitem(last=False)
    return group

  def _find(self, numbers: List[int]) -> Optional[_Group]:
    """The group of these chains, if they are all counter-based chains of
    one group (the same key, one that reads all of them at once)."""
    records = [self._chains.get(number) for number in numbers]
    if len(records) < 2 or any(
        record is None or record.closed or not record.regenerates
        for record in records):
      return None
    lead = records[0]
    key = lead.cursor.group_key()
    if key is None or not hasattr(lead.cursor, "read_group") or any(
        record.cursor.group_key() != key for record in records):
      return None
    seeds = [record.cursor.seed  # type: ignore[attr-defined]
             for record in records]
    return _Group(lead, np.asarray(seeds, np.uint64))


class _Into:
  """The ``allocate`` of :meth:`~jax_data.loaders.indexed.IndexedCursor.
  read_group` into compiled code's buffers: each leaf's, whole, in order."""

  def __init__(self, buffers: List[np.ndarray], interleaved: bool):
    self._buffers = iter(buffers)
    self.interleaved = interleaved

  def __call__(self, shape: Tuple[int, ...], dtype) -> np.ndarray:
    buffer = next(self._buffers)
    if buffer.size != math.prod(shape) or buffer.dtype != np.dtype(dtype):
      raise ValueError(f"a buffer of {buffer.shape} {buffer.dtype} for "
                       f"rows of {shape} {np.dtype(dtype)}")
    return buffer.reshape(shape)


class _StepsInto:
  """The ``allocate`` of :meth:`~jax_data.loaders.indexed.IndexedCursor.
  read_group` into a buffer per step: each leaf's steps' buffers, in
  order, as rows (:class:`~jax_data.loaders.indexed.StepRows`)."""

  interleaved = True

  def __init__(self, steps: Sequence[Sequence[np.ndarray]]):
    self._leaves = iter(list(zip(*steps))[:-1])  # the masks are written after

  def __call__(self, shape: Tuple[int, ...], dtype) -> StepRows:
    buffers = next(self._leaves)
    if (sum(b.size for b in buffers) != math.prod(shape)
        or any(b.dtype != np.dtype(dtype) for b in buffers)):
      raise ValueError(f"buffers of {buffers[0].shape} {buffers[0].dtype} "
                       f"for rows of {shape} {np.dtype(dtype)}")
    return StepRows(b.reshape((-1,) + tuple(shape[1:])) for b in buffers)


def _in_place(leaves: Sequence[np.ndarray]
              ) -> Optional[Tuple[List[np.ndarray], bool]]:
  """Each leaf's buffer (a leading lane axis) as one writable C-contiguous
  array for all lanes' rows, and whether the lane axis is second in memory
  (batch by batch, every lane's batch ``j`` before any ``j + 1``); None if
  the buffers are laid out neither way."""
  for interleaved in (False, True):
    arrays = [leaf.swapaxes(0, 1) if interleaved else leaf
              for leaf in leaves]
    if all(a.ndim >= 2 and a.flags.c_contiguous and a.flags.writeable
           for a in arrays):
      return arrays, interleaved
  return None


def _write_mask(out: np.ndarray, mask: np.ndarray) -> None:
  """``out[...] = mask``; one value broadcast (all valid) is a fill of the
  whole buffer, not a copy through its lanes' strides."""
  whole = _in_place([out])
  if whole is not None and mask.size and not any(mask.strides):
    whole[0][0].fill(mask.flat[0])
  else:
    np.copyto(out, mask)


def _write_mask_lanes_second(out: np.ndarray, mask: np.ndarray) -> None:
  """``mask`` (a leading lane axis) written into ``out``, a buffer of its
  shape whose bytes are laid out lane axis second."""
  if mask.size and not any(mask.strides):  # one value: all valid
    out.reshape(-1).fill(mask.flat[0])
  else:
    np.copyto(out.reshape(mask.shape[1:2] + mask.shape[:1] + mask.shape[2:]),
              mask.swapaxes(0, 1))


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
  """Whether two arrays are the same memory, laid out alike (a chunk read
  in place)."""
  return (a.__array_interface__["data"][0] == b.__array_interface__[
      "data"][0] and a.shape == b.shape and (
          a.strides == b.strides
          # Strides of axes of length 1 differ between views alike.
          or a.flags.c_contiguous and b.flags.c_contiguous))
