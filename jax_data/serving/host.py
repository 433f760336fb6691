"""The host side of a pipeline: what compiled code's requests reach.

A :class:`Host` owns a pipeline's chains and the store that serves their
chunks and produces the next ones ahead, both made on first use
(:class:`_Parts`). The bridge's callback calls :meth:`Host.serve` or
:meth:`Host.serve_into` with a request for several *lanes* (a chain and a
chunk index each); the requests that several devices make for one refresh
meet in a :class:`Rendezvous`; checkpoints go through
:meth:`Host.save_chain` and :meth:`Host.restore_chain`.

Only NumPy runs here; nothing calls JAX.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data.errors import HostLoaderError
from jax_data.errors import PipelineReleasedError
from jax_data.errors import foreign_state
from jax_data.lifetime import LIVE_HOSTS
from jax_data.lifetime import Thread
from jax_data.lifetime import give_back_heap
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import Chunk
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import Span
from jax_data.loaders.chains import readable
from jax_data.loaders.chains import spanned
from jax_data.loaders.gather import BufferPool
from jax_data.loaders.gather import Gatherer
from jax_data.loaders.host_loader import HostDataLoader
from jax_data.loaders.pinning import pin
from jax_data.serving.chain_records import ChainRecord
from jax_data.serving.chain_records import ChainTable
from jax_data.serving.chunk_store import ChainStore
from jax_data.serving.chunk_store import Prefetcher
from jax_data.serving.chunk_store import Served
from jax_data.serving.group_refresh import GroupRefresh
from jax_data.serving.group_refresh import same_memory
from jax_data.serving.rendezvous import Rendezvous


def _copies(outs: Sequence[np.ndarray], lanes: List[Chunk],
            need: Optional[np.ndarray], read_in_place: bool
            ) -> List[Tuple[np.ndarray, np.ndarray]]:
  """The ``(out, leaf)`` copies that put the lanes' chunks into ``outs``:
  none for lanes that ``need`` nothing (when given), nor for leaves that
  are views of ``outs`` already (read in place). Lanes that are the chunks
  of one group, in its order (:func:`spanned`), are one copy per leaf, not
  one per lane and leaf: a refresh of 256 lanes of 5 batches took 8.2 ms
  to answer with 768 copies, 4.4 ms with 3. A group whose rows are read
  when served (``Span.later``) is read straight into ``outs`` here."""
  span = spanned(lanes) if need is None or all(need) else None
  if span is not None and span.read_into(outs[:-1]):
    pairs = [(outs[-1], span.mask)]  # its rows read into outs already
  elif span is not None:
    pairs = list(zip(outs, span.read().leaves + [span.mask]))
  else:
    pairs = [(out[lane], leaf) for lane, chunk in enumerate(lanes)
             if need is None or need[lane]
             for out, leaf in zip(outs, list(chunk.leaves) + [chunk.mask])]
  return [(out, leaf) for out, leaf in pairs
          if not (read_in_place and same_memory(out, leaf))]


def _check_served(name: str, served: Sequence[Chunk], chains: Sequence[int],
                  chunks: Sequence[int]) -> None:
  """Runs each distinct :attr:`~Chunk.check` of the chunks served to
  lanes of ``chains`` and ``chunks`` once (the lanes of one loader share
  one: an fstat per memmap, not per lane). A failure (a memmap's file
  truncated since the chunk was read) is raised as
  :class:`~jax_data.HostLoaderError` naming the loader and the first
  chain and chunk it concerns, as a failure to produce them is."""
  first: Dict[Callable[[], None], Tuple[int, int]] = {}
  for chunk, chain, index in zip(served, chains, chunks):
    first.setdefault(chunk.check, (chain, index))
  for check, (chain, index) in first.items():
    try:
      check()
    except Exception as e:  # pylint: disable=broad-except
      raise HostLoaderError(f"{name}, chain {chain}, chunk {index}: "
                            f"{type(e).__name__}: {e}") from e


class Host:
  """Serves the chunks of one pipeline's chains to compiled code.

  Args:
    loader: The host loader.
    layout: The chunks' arrays.
    pipeline_id: The pipeline's identity, a positive int32 that its states
      carry; requests with states of other pipelines are refused.
    cycle: Chunks per pass of ordered chains whose requests wrap around
      (full-data passes); None for random chains.
    progress: Called on the host once per request for chunks, with the
      number of devices' requests that make the step together (progress
      of full-data passes).
    prefetch: Produce each chain's next chunk in a background thread.
    verify_calls: Warn when a chunk is produced again because it was asked
      for after the chain moved on (a state used twice).

  Attributes:
    id: The pipeline's identity.
    requests: Host calls served so far (for tests and diagnostics).
    rendezvous: Where several devices' requests of a refresh meet.
  """

  def __init__(self, loader: HostDataLoader, layout: ChunkLayout,
               pipeline_id: int, *, cycle: Optional[int] = None,
               progress: Optional[Callable[[int, int], None]] = None,
               prefetch: bool = True, verify_calls: bool = False):
    self.name = repr(loader)
    self.id = pipeline_id
    self.layout = layout
    self._progress = progress
    self._parts = _Parts(loader, layout, self.name, cycle, verify_calls,
                         prefetch)
    self._zeros: Optional[Chunk] = None
    # Copies chunks into compiled code's buffers, large ones (the chunks of
    # full-data passes, not a random chain's few batches) split over the cores.
    self._copier = Gatherer()
    self.requests = 0
    LIVE_HOSTS.add(self)
    # What pipelines released before this one freed (their chunks, once
    # compiled code and states let go of them) goes back to the system.
    give_back_heap()

  @property
  def rendezvous(self) -> Rendezvous:
    """Where devices' requests for one refresh meet (made at the first)."""
    return self._parts.rendezvous()

  @rendezvous.setter
  def rendezvous(self, rendezvous: Rendezvous) -> None:
    self._parts.made_rendezvous = rendezvous

  # -- chains -------------------------------------------------------------

  @property
  def loader(self) -> HostDataLoader:
    """The loader; :class:`PipelineReleasedError` once released."""
    return self._parts.loader

  def check_open(self) -> None:
    """Raises :class:`PipelineReleasedError` if the pipeline was released."""
    _ = self.loader

  def chains(self) -> List[int]:
    """The numbers of this pipeline's chains (for tests and diagnostics)."""
    return self._parts.chains().numbers()

  def chain(self, number: int) -> ChainRecord:
    """The bookkeeping of chain ``number`` (for tests and diagnostics)."""
    return self._parts.chains().record(number)

  def has_chain(self, number: int) -> bool:
    """Whether this pipeline has chain ``number`` (a lookup, not a listing:
    eager calls check their states' chains with it)."""
    return self._parts.chains().get(number) is not None

  def register(self, spec: ChainSpec) -> int:
    """Adds a chain and returns its number (``CacheState.chain``)."""
    return self._parts.chains().add(spec).number

  def save_chain(self, chain: int, chunk: int) -> Dict[str, Any]:
    """See :meth:`ChainTable.save`."""
    return self._parts.chains().save(chain, chunk)

  def restore_chain(self, saved: Dict[str, Any], chunk: int) -> int:
    """See :meth:`ChainTable.restore`; returns the chain's number."""
    return self._parts.chains().restore(saved, chunk).number

  def remove_chain(self, chain: int) -> None:
    """Takes a chain out of this pipeline (a restore that failed later)."""
    self._parts.store().remove(chain)

  # -- serving ------------------------------------------------------------

  def chunk(self, chain: int, index: int, device_count: int = 1) -> Chunk:
    """Chunk ``index`` of a chain (see :meth:`ChainStore.chunks`)."""
    return self._parts.store().chunks([(chain, index)], device_count)[0]

  def lanes(self, pipelines: np.ndarray, chains: np.ndarray,
            chunks: np.ndarray, need: np.ndarray, device_count: int = 1,
            participants: int = 1, defer: Optional[Served] = None,
            into: Optional[Sequence[np.ndarray]] = None) -> List[Chunk]:
    """The chunk of each of ``L`` lanes (``defer`` and ``into``: see
    :meth:`ChainStore.chunks`; ``into`` holds each leaf's and the mask's
    buffer with a leading lane axis). Lanes whose ``need`` is False get
    zeros; compiled code keeps their cache. With ``participants > 1`` the
    request is one of several that devices make for the same refresh: they
    meet in :attr:`rendezvous`, and if one failed, all raise the failure.

    Raises:
      ValueError: a lane's state belongs to another pipeline.
    """
    # Python ints: this runs on every refresh, and NumPy scalars are slow.
    pipelines, chains, chunks, need = (
        np.asarray(a).reshape(-1).tolist()
        for a in (pipelines, chains, chunks, need))
    self.requests += 1
    store = self._parts.store()
    store.note_lanes(sum(need))
    lanes, error, ticket = [], None, None
    if participants > 1 and any(need):
      # Announced before producing: the others wait however long it takes.
      ticket = self.rendezvous.come(
          min(c for c, wanted in zip(chunks, need) if wanted), participants,
          [chain for chain, wanted in zip(chains, need) if wanted])
    try:
      for pipeline, wanted in zip(pipelines, need):
        if wanted and pipeline != self.id:
          raise foreign_state(f"the pipeline over {self.name}", pipeline,
                              self.id)
      targets = None  # only where chunks can be read in place
      if into is not None and store.reads_in_place(sum(need)):
        # One span, so that a group read into all of them is seen as one.
        whole = Span(list(into[:-1]), into[-1]).chunks([readable] * len(need))
        targets = [target for target, wanted in zip(whole, need) if wanted]
      if self._progress is not None and any(need):
        # Once per request: its lanes ask for one step of their passes.
        self._progress(participants, min(
            int(c) for c, wanted in zip(chunks, need) if wanted))
      served = iter(store.chunks(
          [(chain, index) for chain, index, wanted in zip(chains, chunks,
                                                          need) if wanted],
          device_count, defer, targets))
      lanes = [next(served) if wanted else self._zero_chunk()
               for wanted in need]
      _check_served(self.name, lanes, chains, chunks)
    except Exception as e:  # pylint: disable=broad-except
      error = e
    except BaseException:
      if ticket is not None:
        self.rendezvous.withdraw(ticket)
      raise
    if defer is None:  # else the caller trims after its copy
      store.trim_later()
    if ticket is not None:
      error = self.rendezvous.meet(ticket, error)
    if error is not None:
      raise error
    return lanes

  def serve(self, pipelines: np.ndarray, chains: np.ndarray,
            chunks: np.ndarray, need: np.ndarray, device_count: int = 1,
            participants: int = 1) -> Tuple[np.ndarray, ...]:
    """The callback body of ``pure_callback``: the lanes' leaves and masks,
    stacked on a leading lane axis, in buffers used again once
    ``pure_callback`` has copied and dropped them (:class:`BufferPool`)."""
    if np.size(need) == 1:
      chunk, = self.lanes(pipelines, chains, chunks, need, device_count,
                          participants)
      return tuple(leaf[None] for leaf in chunk.leaves) + (chunk.mask[None],)
    outs = [self._parts.results.empty(shape, dtype)
            for shape, dtype in self.layout.formats(np.size(need))]
    self.serve_into(outs, pipelines, chains, chunks, need, device_count,
                    participants)
    return tuple(outs)

  def serve_into(self, outs: Sequence[np.ndarray], pipelines: np.ndarray,
                 chains: np.ndarray, chunks: np.ndarray, need: np.ndarray,
                 device_count: int = 1, participants: int = 1,
                 keep_others: bool = False, cpu: bool = False,
                 group_tried: bool = False) -> None:
    """Like :meth:`serve`, but copies the lanes into ``outs`` (compiled
    code's own output buffers, a leading lane axis each) with NumPy, which
    releases the GIL; the next chunks are produced after the copy, which
    holds up the device, not during it (see :meth:`ChainStore.chunks`).
    Lanes that ``need`` nothing get zeros, or with ``keep_others`` are left
    as they are (``outs`` are the caches themselves). A group's refresh goes
    to :meth:`GroupRefresh.serve_request` first (``cpu``: on a CPU), unless
    the caller tried that already (``group_tried``:
    :meth:`serve_group_lanes_second`)."""
    store = self._parts.store()
    if (need.size > 1 and not group_tried
        and self._parts.groups().serve_request(
            store, self.id, outs, pipelines, chains, chunks, need,
            device_count * participants == 1 and self._progress is None,
            cpu)):
      self.requests += 1
      return
    deferred = Served()
    try:
      lanes = self._ready(store, pipelines, chains, chunks, need,
                          device_count, participants, deferred)
      if lanes is None:
        lanes = self.lanes(pipelines, chains, chunks, need, device_count,
                           participants, deferred, outs)
      # Chunks read in place are views of outs already (see chunks); none
      # are where even all lanes would not be read in place.
      self._copier.copy_all(_copies(
          outs, lanes, need.reshape(-1) if keep_others else None,
          store.reads_in_place(len(lanes))))
    finally:
      store.schedule_next(deferred, trim=True)

  def serve_group_lanes_second(self, outs: Sequence[np.ndarray],
                               pipelines: np.ndarray, chains: np.ndarray,
                               chunks: np.ndarray, need: np.ndarray) -> bool:
    """Serves a CPU's refresh of one device into compiled code's buffers as
    they are (shaped lane axis first, their bytes laid out lane axis
    second) if a group's read can
    (:meth:`GroupRefresh.serve_lanes_second_into`); whether it did. The
    bridge tries this before it lays the buffers out for
    :meth:`serve_into`."""
    if need.size < 2 or self._progress is not None:
      return False
    if not self._parts.groups().serve_request(
        self._parts.store(), self.id, outs, pipelines, chains, chunks, need,
        True, True, lanes_second=True):
      return False
    self.requests += 1
    return True

  def serve_steps_into(self, steps: Sequence[Sequence[np.ndarray]],
                       pipelines: np.ndarray, chains: np.ndarray,
                       chunks: np.ndarray, need: np.ndarray,
                       device_count: int = 1, participants: int = 1
                       ) -> None:
    """:meth:`serve_into` for a CPU's buffers of each step of the chunks
    (``steps[k]``: step ``k``'s leaves then its mask, a leading lane axis
    each): a group's read writes the rows into them step by step
    (:meth:`GroupRefresh.serve_request`); other requests are served into
    buffers of a chunk's layout from this host's pool, and each step is
    copied out."""
    store = self._parts.store()
    if need.size > 1 and self._parts.groups().serve_request(
        store, self.id, steps, pipelines, chains, chunks, need,
        device_count * participants == 1 and self._progress is None, True,
        by_step=True):
      self.requests += 1
      store.schedule_next(Served(), trim=True)
      return
    chunk = [self._parts.results.empty(shape, dtype)
             for shape, dtype in self.layout.formats(np.size(need))]
    self.serve_into(chunk, pipelines, chains, chunks, need, device_count,
                    participants, cpu=True)
    for k, step in enumerate(steps):
      for out, whole in zip(step, chunk):
        np.copyto(out, whole[:, k])

  def _ready(self, store: ChainStore, pipelines: np.ndarray,
             chains: np.ndarray, chunks: np.ndarray, need: np.ndarray,
             device_count: int, participants: int, defer: Served
             ) -> Optional[List[Chunk]]:
    """:meth:`lanes` for the common refresh (one device, every lane a chunk
    of this pipeline produced ahead: :meth:`ChainStore.ready`), on lists:
    NumPy's calls on a few numbers cost microseconds each. None for other
    requests."""
    need = need.reshape(-1).tolist()
    if (participants != 1 or device_count != 1 or self._progress is not None
        or not all(need) or set(pipelines.reshape(-1).tolist()) != {self.id}):
      return None
    store.note_lanes(len(need))
    if store.reads_in_place(len(need)):
      return None
    chains, chunks = chains.reshape(-1).tolist(), chunks.reshape(-1).tolist()
    served = store.ready(chains, chunks, defer)
    if served is not None:
      self.requests += 1
      _check_served(self.name, served, chains, chunks)
    return served

  def wait_idle(self, timeout: float = 60.0) -> bool:
    """Waits until the prefetch thread has run the jobs queued, the
    housekeeping of :meth:`trim_later` among them (for tests and
    diagnostics); whether it did within ``timeout`` seconds."""
    store = self._parts.made_store
    return store is None or store.wait_idle(timeout)

  def _zero_chunk(self) -> Chunk:
    if self._zeros is None:
      self._zeros = self.layout.new_chunk(np.zeros)
    return self._zeros

  # -- release ------------------------------------------------------------

  def stop_prefetching(self) -> Optional[Thread]:
    """Ends the prefetch thread after its running job, and returns it to
    join (None if it never started); chunks are then made when asked for."""
    self._copier.close()
    return self._parts.stop_prefetching(PipelineReleasedError(
        f"the prefetch thread of the pipeline over {self.name} stopped"))

  def release(self, error: Optional[BaseException] = None) -> None:
    """Drops the loader, every chain and stored chunk, and ends the
    prefetch thread; idempotent, and it does not wait for a chunk being
    produced. Requests still waiting for a chunk get ``error`` (default: a
    :class:`PipelineReleasedError` that names ``release_fn``) at once."""
    if error is None:
      error = PipelineReleasedError(
          f"this pipeline over {self.name} was released by its release_fn "
          "while compiled code waited for a chunk")
    self._parts.release(error)
    rendezvous = self._parts.made_rendezvous
    if rendezvous is not None:  # devices waiting for each other raise it
      rendezvous.release(error)
    self._copier.close()
    self._zeros = None
    give_back_heap()


class _Parts:
  """A host's chains and store, made on first use: the chains
  (:class:`ChainTable`) at the first :meth:`chains`, a chain's registration
  or restore; the store (:class:`ChainStore`) at the first :meth:`store`,
  a request, with the prefetch thread it schedules on (which starts at its
  first job); the :class:`Rendezvous` at the first request of several
  devices together. So building a pipeline starts nothing. Thread-safe."""

  def __init__(self, loader: HostDataLoader, layout: ChunkLayout, name: str,
               cycle: Optional[int], verify_calls: bool, prefetch: bool):
    self._loader: Optional[HostDataLoader] = loader  # None once released
    self._layout = layout
    self._name = name
    self._store_options = (cycle, verify_calls)
    self._prefetch = prefetch
    self._table: Optional[ChainTable] = None
    self._groups: Optional[GroupRefresh] = None
    self.made_store: Optional[ChainStore] = None
    self.made_rendezvous: Optional[Rendezvous] = None
    # For serve's arrays, which the runtime copies to the device: on a GPU
    # page-locked, so that it copies them directly.
    self.results = BufferPool(
        pin=pin if loader.store_limits.page_locked else None)
    self._lock = threading.Lock()

  @property
  def loader(self) -> HostDataLoader:
    """The loader; :class:`PipelineReleasedError` once released."""
    loader = self._loader
    return self.chains().loader if loader is None else loader

  def chains(self) -> ChainTable:
    table = self._table
    if table is None:
      with self._lock:
        if self._table is None:
          self._table = ChainTable(self._loader, self._layout, self._name)
        table = self._table
    return table

  def groups(self) -> GroupRefresh:
    if self._groups is None:  # a spare one made in a race does no harm
      self._groups = GroupRefresh(self.chains(), self._layout)
    return self._groups

  def store(self) -> ChainStore:
    store = self.made_store
    if store is None:
      table = self.chains()
      with self._lock:
        if self.made_store is None:
          prefetcher = (Prefetcher(self._name) if self._prefetch
                        else None)
          if prefetcher is not None:
            # Dropped without release_fn: the thread ends with the host,
            # and the exit hook waits for its running job.
            weakref.finalize(self, LIVE_HOSTS.orphan, prefetcher,
                             PipelineReleasedError(
                                 f"the pipeline over {self._name} was "
                                 "garbage-collected"))
          self.made_store = ChainStore(table, *self._store_options,
                                       scheduler=prefetcher)
        store = self.made_store
    return store

  def rendezvous(self) -> Rendezvous:
    rendezvous = self.made_rendezvous
    if rendezvous is None:
      with self._lock:
        if self.made_rendezvous is None:
          self.made_rendezvous = Rendezvous(
              self._name, self.loader.chains_numbered)
        rendezvous = self.made_rendezvous
    return rendezvous

  def stop_prefetching(self, error: BaseException) -> Optional[Thread]:
    """See :meth:`ChainStore.stop_prefetching`; a store made later
    prefetches nothing."""
    with self._lock:
      self._prefetch = False
      store = self.made_store
    return None if store is None else store.stop_prefetching(error)

  def release(self, error: BaseException) -> None:
    """See :meth:`ChainStore.release` (the store is made if it was not:
    it closes the chains' cursors)."""
    self.store().release(error)
    self.results = BufferPool()  # their memory goes now
    self._groups = None  # and the chains it remembered, with the loader
    self._loader = None
