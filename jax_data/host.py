"""The host side of a pipeline: what compiled code's requests reach.

A :class:`Host` owns a pipeline's chains (:class:`~jax_data.chunk_store.
ChainStore`), produces each chain's next chunk ahead of time
(:class:`~jax_data.prefetch.Prefetcher`), and lets the devices of one
refresh meet (:class:`~jax_data.rendezvous.Rendezvous`). The bridge's
callback calls :meth:`Host.serve` or :meth:`Host.serve_into` with a request
for several *lanes* (a chain and a chunk index each); checkpoints go
through :meth:`Host.save_chain` and :meth:`Host.restore_chain`.

Only NumPy runs here; nothing calls JAX.
"""

from __future__ import annotations

import concurrent.futures
import functools
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

from jax_data.chains import ChainSpec
from jax_data.chains import Chunk
from jax_data.chains import ChunkLayout
from jax_data.chains import RandomChain
from jax_data.chains import spec_from_json
from jax_data.chains import spec_to_json
from jax_data.chunk_store import ChainRecord
from jax_data.chunk_store import ChainStore
from jax_data.chunk_store import settle
from jax_data.errors import CheckpointError
from jax_data.errors import PipelineReleasedError
from jax_data.gather import Gatherer
from jax_data.host_loader import HostDataLoader
from jax_data.lifetime import LIVE_HOSTS
from jax_data.prefetch import Prefetcher
from jax_data.rendezvous import Rendezvous
from jax_data.validation import check_int

# Chunks whose production follows the copy of a served one: (chain, index).
Deferred = List[Tuple[ChainRecord, int]]


def _cancel(futures: Sequence[concurrent.futures.Future],
            error: BaseException) -> None:
  for future in futures:
    settle(future, error=error)


def _trim(store: ChainStore, queued: threading.Event) -> None:
  """The prefetch thread's housekeeping job (see :meth:`Host.trim_later`)."""
  queued.clear()
  store.trim_idle()


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
  """Whether two arrays are the same memory, laid out alike (a chunk read
  in place)."""
  return (a.__array_interface__["data"][0] == b.__array_interface__[
      "data"][0] and a.shape == b.shape and a.strides == b.strides)


def _skip(error: BaseException) -> None:
  del error  # a housekeeping job cancelled: nothing waits for it


class Host:
  """Serves the chunks of one pipeline's chains to compiled code.

  Args:
    loader: The host loader.
    layout: The chunks' arrays.
    pipeline_id: The pipeline's identity, a positive int32 that its states
      carry; requests with states of other pipelines are refused.
    cycle: Chunks per pass of ordered chains whose requests wrap around
      (full-data passes); None for random chains.
    progress: Called on the host with the chunk index whenever compiled
      code asks for a chunk (progress of full-data passes).
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
               progress: Optional[Callable[[int], None]] = None,
               prefetch: bool = True, verify_calls: bool = False):
    self.name = repr(loader)
    self.id = pipeline_id
    self.layout = layout
    self._limits = loader.store_limits
    self._store = ChainStore(loader, layout, self.name, cycle, verify_calls)
    self._progress = progress
    self._prefetcher = Prefetcher() if prefetch else None
    if self._prefetcher is not None:
      LIVE_HOSTS.track(self._prefetcher)
      # Dropped without release_fn: the thread ends with the host.
      weakref.finalize(self, self._prefetcher.close, PipelineReleasedError(
          f"the pipeline over {self.name} was garbage-collected"))
    self.rendezvous = Rendezvous(self.name)
    self._zeros: Optional[Chunk] = None
    # Copies chunks into compiled code's buffers, large ones (the chunks of
    # full-data passes, not a random chain's few batches) split over the cores.
    self._copier = Gatherer()
    self.requests = 0
    self._trim_queued = threading.Event()
    LIVE_HOSTS.add(self)

  # -- chains -------------------------------------------------------------

  @property
  def loader(self) -> HostDataLoader:
    """The loader; :class:`PipelineReleasedError` once released."""
    return self._store.loader

  def check_open(self) -> None:
    """Raises :class:`PipelineReleasedError` if the pipeline was released."""
    _ = self._store.loader

  def chains(self) -> List[int]:
    """The numbers of this pipeline's chains (for tests and diagnostics)."""
    return self._store.numbers()

  def chain(self, number: int) -> ChainRecord:
    """The bookkeeping of chain ``number`` (for tests and diagnostics)."""
    return self._store.record(number)

  def register(self, spec: ChainSpec) -> int:
    """Adds a chain and returns its number (``CacheState.chain``)."""
    return self._store.add(spec).number

  def save_chain(self, chain: int, chunk: int) -> Dict[str, Any]:
    """What restores chain ``chain`` at chunk ``chunk``: its spec and the
    snapshot of its position at or before that chunk (JSON-compatible)."""
    record = self._store.record(chain)
    index, position = self._store.snapshot_before(record, chunk)
    return {"spec": spec_to_json(record.spec), "snapshot_index": index,
            "snapshot": position}

  def restore_chain(self, saved: Dict[str, Any], chunk: int) -> int:
    """Adds a chain from :meth:`save_chain`'s dict, for a state at chunk
    ``chunk``; returns the chain's number.

    Raises:
      CheckpointError: the dict is not one of :meth:`save_chain`, ``chunk``
        is not at or after its snapshot (within the loader's
        ``store_limits.max_replay`` chunks), or
        the loader refuses the spec or position; no chain is added then.
    """
    if not isinstance(saved, dict) or not {"spec", "snapshot_index",
                                            "snapshot"} <= set(saved):
      raise CheckpointError(
          "a saved chain is a dict with spec, snapshot_index and snapshot, "
          f"got {saved!r}")
    try:
      spec = spec_from_json(saved["spec"])
      index = check_int("snapshot_index", saved["snapshot_index"],
                        minimum=0)
      # A counter-based stream reaches any chunk at once: no replay bound.
      counter = isinstance(spec, RandomChain) and spec.stream == "counter"
      replay = None if counter else self._limits.max_replay
      if chunk < index or (replay is not None and chunk > index + replay):
        raise ValueError(
            f"the state's chunk={chunk} must be between the chain's "
            f"snapshot_index={index} and {index + replay} (the snapshot "
            f"plus max_replay={replay} chunks)")
      return self._store.add(spec, (index, saved["snapshot"])).number
    except (TypeError, ValueError) as e:
      raise CheckpointError(f"saved chain does not fit {self.name}: {e}"
                            ) from e

  def remove_chain(self, chain: int) -> None:
    """Takes a chain out of this pipeline (a restore that failed later)."""
    self._store.remove(chain)

  # -- serving ------------------------------------------------------------

  def chunk(self, chain: int, index: int, device_count: int = 1) -> Chunk:
    """Chunk ``index`` of a chain (see :meth:`chunks`)."""
    return self.chunks([(chain, index)], device_count)[0]

  def chunks(self, wanted: Sequence[Tuple[int, int]], device_count: int = 1,
             defer: Optional[Deferred] = None,
             into: Optional[Sequence[Chunk]] = None) -> List[Chunk]:
    """Chunk ``index`` of chain ``chain`` for each ``(chain, index)``.

    The chunks not stored yet are produced now, those of chains whose
    cursors produce together in one call (vmapped counter-based chains:
    one draw of all their indices, one read of all their rows). A chunk
    still queued behind other productions is produced here.

    ``into``: for each ``(chain, index)``, compiled code's buffers that
    will receive it. A request too large to keep chunks ahead for
    (:meth:`ChainStore.reads_in_place`) has the chunks of chains that
    regenerate any chunk (counter-based streams) read straight into them,
    neither stored nor produced ahead; the chunks returned are then views
    of those buffers.

    ``device_count`` requests are expected for each chunk (one per device
    of a replicated state); it is kept until they all came, within a cap.

    The production of the next chunks of every chain
    (:meth:`ChainStore.ahead`) starts now, together, or, if ``defer`` is a
    list and the chunks were ready when asked for (the device, not the
    host, sets the pace) or are several, is appended to ``defer`` for the
    caller to start once it has copied the chunks, so that the copy does
    not compete with it.

    Raises:
      HostLoaderError: the loader failed (the first failure in lane
        order); a later request tries the failed chunks again.
    """
    store = self._store
    in_place = (into is not None and device_count == 1
                and store.reads_in_place(len(wanted)))
    # Per (chain, index): record, index, future, ready, stored.
    claims: List[Tuple[ChainRecord, int, concurrent.futures.Future, bool,
                       bool]] = []
    mine, direct, targets = [], {}, {}
    for lane, (chain, index) in enumerate(wanted):
      record = store.record(chain)
      if index < 0:
        raise ValueError(
            f"chunk={index} of chain {chain} requested: a state's chunk "
            "counter is never negative; was the state built by hand?")
      if self._progress is not None:
        self._progress(index)
      if in_place and store.regenerates(record) and not store.holds(
          record, index):
        job = direct.get((chain, index))
        if job is None:  # the same chunk twice in a request: read once
          job = direct[(chain, index)] = (record, index,
                                          concurrent.futures.Future())
          targets[id(job[2])] = into[lane]
          mine.append(job)
        claims.append((record, index, job[2], False, False))
        continue
      future, produce = store.claim(record, index, device_count)
      claims.append((record, index, future, future.done(), True))
      if produce:
        mine.append((record, index, future))
    if mine:
      store.produce_many(mine, targets)
    prefetcher = self._prefetcher
    for record, index, future, _, _ in claims:
      # Still queued behind other chains' chunks: produce it here.
      run = (None if future.done() or prefetcher is None
             else prefetcher.take((record.number, index)))
      if run is not None:
        run()
    failure = None
    for record, index, future, _, stored in claims:
      if future.exception() is not None:
        if stored:
          store.forget(record, index, future)
        failure = failure or future.exception()
    now = []
    for record, index, _, ready, stored in claims:
      if not stored or (in_place and store.regenerates(record)):
        continue  # read in place next time too: nothing ahead
      # Several lanes: their copies are many short calls that need the GIL
      # the production would hold; the next chunks wait for them too.
      later = defer is not None and (ready or len(claims) > 1)
      (defer if later else now).append((record, index))
    self.schedule_next(now)
    if failure is not None:
      raise failure
    return [future.result() for _, _, future, _, _ in claims]

  def schedule_next(self, served: Sequence[Tuple[ChainRecord, int]]
                    ) -> None:
    """Starts producing the :meth:`ChainStore.ahead` chunks after each served
    ``(chain, index)`` in the background (those not stored yet): one job
    per step ahead, which produces that chunk of every chain together."""
    prefetcher = self._prefetcher
    if prefetcher is None or not served:
      return
    store = self._store
    following = list(served)
    for _ in range(store.ahead()):
      following = [(record, store.following(index))
                   for record, index in following]
      jobs = []
      for record, index in {(record.number, index): (record, index)
                            for record, index in following}.values():
        future = store.claim_ahead(record, index)
        if future is not None:
          jobs.append((record, index, future))
      if not jobs:
        continue
      futures = [future for _, _, future in jobs]
      if not prefetcher.submit(
          [(record.number, index) for record, index, _ in jobs],
          functools.partial(store.produce_many, jobs),
          functools.partial(_cancel, futures)):
        _cancel(futures, self._released())
        return

  def _released(self) -> PipelineReleasedError:
    try:
      self.check_open()
    except PipelineReleasedError as e:
      return e
    return PipelineReleasedError(f"the pipeline over {self.name} is closing")

  def lanes(self, pipelines: np.ndarray, chains: np.ndarray,
            chunks: np.ndarray, need: np.ndarray, device_count: int = 1,
            participants: int = 1, defer: Optional[Deferred] = None,
            into: Optional[Sequence[np.ndarray]] = None) -> List[Chunk]:
    """The chunk of each of ``L`` lanes (``defer`` and ``into``: see
    :meth:`chunks`; ``into`` holds each leaf's and the mask's buffer with a
    leading lane axis).

    Lanes whose ``need`` is False get zeros; compiled code keeps their cache.

    With ``participants > 1`` the request is one of several that devices
    make for the same refresh: they meet in :attr:`rendezvous`, and if one
    failed, all raise the failure.

    Raises:
      ValueError: a lane's state belongs to another pipeline.
    """
    LIVE_HOSTS.begin_request()
    try:
      return self._lanes(pipelines, chains, chunks, need, device_count,
                         participants, defer, into)
    finally:
      if defer is None:  # else the caller trims after its copy
        self.trim_later()
      LIVE_HOSTS.end_request()

  def _lanes(self, pipelines, chains, chunks, need, device_count,
             participants, defer, into) -> List[Chunk]:
    # Python ints: this runs on every refresh, and NumPy scalars are slow.
    pipelines, chains, chunks, need = (
        np.asarray(a).reshape(-1).tolist()
        for a in (pipelines, chains, chunks, need))
    self.requests += 1
    self._store.note_lanes(sum(need))
    lanes, error = [], None
    try:
      for pipeline, wanted in zip(pipelines, need):
        if wanted and pipeline != self.id:
          raise ValueError(
              f"a state of another pipeline (id {pipeline}) was given "
              f"to a pipeline over {self.name} (id {self.id}); use the "
              "states of this pipeline's init_fn")
      targets = None  # only where chunks can be read in place
      if into is not None and self._store.reads_in_place(sum(need)):
        targets = [Chunk([out[lane] for out in into[:-1]], into[-1][lane])
                   for lane, wanted in enumerate(need) if wanted]
      served = iter(self.chunks(
          [(chain, index) for chain, index, wanted in zip(chains, chunks,
                                                          need) if wanted],
          device_count, defer, targets))
      lanes = [next(served) if wanted else self._zero_chunk()
               for wanted in need]
      # Each distinct check once per request (the lanes of one loader
      # share one: an fstat per memmap, not per lane).
      for check in dict.fromkeys(lane.check for lane in lanes):
        check()
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if participants > 1 and any(need):
      error = self.rendezvous.meet(
          min(c for c, wanted in zip(chunks, need) if wanted), participants,
          error)
    if error is not None:
      raise error
    return lanes

  def serve(self, pipelines: np.ndarray, chains: np.ndarray,
            chunks: np.ndarray, need: np.ndarray, device_count: int = 1,
            participants: int = 1) -> Tuple[np.ndarray, ...]:
    """The callback body of ``pure_callback``: the lanes' leaves and masks,
    stacked on a leading lane axis."""
    if np.size(need) == 1:
      chunk, = self.lanes(pipelines, chains, chunks, need, device_count,
                          participants)
      return tuple(leaf[None] for leaf in chunk.leaves) + (chunk.mask[None],)
    lead = (np.size(need),)
    outs = [np.empty(lead + shape, leaf.dtype) for shape, leaf in
            zip(self.layout.leaf_shapes(), self.layout.leaves)]
    outs.append(np.empty(lead + self.layout.lead, np.bool_))
    self.serve_into(outs, pipelines, chains, chunks, need, device_count,
                    participants)
    return tuple(outs)

  def serve_into(self, outs: Sequence[np.ndarray], pipelines: np.ndarray,
                 chains: np.ndarray, chunks: np.ndarray, need: np.ndarray,
                 device_count: int = 1, participants: int = 1,
                 keep_others: bool = False) -> None:
    """Like :meth:`serve`, but copies the lanes into ``outs`` (compiled
    code's own output buffers, a leading lane axis each): one copy per lane,
    made by NumPy without holding the GIL, so the prefetch thread runs
    meanwhile. When the chunks were ready before they were asked for, the
    next ones are produced after the copy, not during it (see
    :meth:`chunk`): the copy holds up the device, the production does not.
    Lanes that ``need`` nothing get zeros, or with ``keep_others`` are left
    as they are (``outs`` are the caches themselves).
    """
    deferred: Deferred = []
    try:
      lanes = self.lanes(pipelines, chains, chunks, need, device_count,
                         participants, deferred, outs)
      # Chunks read in place are views of outs already (see chunks); none
      # are where even all lanes would not be read in place.
      read_in_place = self._store.reads_in_place(len(lanes))
      for lane, chunk in enumerate(lanes):
        if keep_others and not need.reshape(-1)[lane]:
          continue
        for out, leaf in zip(outs, list(chunk.leaves) + [chunk.mask]):
          if not (read_in_place and _same_memory(out[lane], leaf)):
            self._copier.copy(out[lane], leaf)
    finally:
      self.schedule_next(deferred)
      self.trim_later()

  def trim_later(self) -> None:
    """Has the prefetch thread trim the cursors of idle chains and of those
    beyond the budget (:meth:`ChainStore.trim_idle`) once it has started
    the productions queued now. That housekeeping may drop a ``tf.data``
    iterator of another chain, which can take seconds: a request never
    waits for it. Without a prefetch thread it runs here, after the
    request's chunks were produced."""
    prefetcher = self._prefetcher
    if prefetcher is None:
      self._store.trim_idle()
      return
    if self._trim_queued.is_set():
      return
    self._trim_queued.set()
    job = functools.partial(_trim, self._store, self._trim_queued)
    if not prefetcher.submit(("trim",), job, _skip):
      self._trim_queued.clear()

  def wait_idle(self, timeout: float = 60.0) -> bool:
    """Waits until the prefetch thread has run the jobs queued, the
    housekeeping of :meth:`trim_later` among them (for tests and
    diagnostics); whether it did within ``timeout`` seconds."""
    prefetcher = self._prefetcher
    return prefetcher is None or prefetcher.wait_idle(timeout)

  def _zero_chunk(self) -> Chunk:
    if self._zeros is None:
      self._zeros = self.layout.new_chunk(np.zeros)
    return self._zeros

  # -- release ------------------------------------------------------------

  def stop_prefetching(self) -> None:
    """Ends the prefetch thread after its running job; chunks are then
    produced when asked for."""
    prefetcher, self._prefetcher = self._prefetcher, None
    if prefetcher is not None:
      prefetcher.close(PipelineReleasedError(
          f"the prefetch thread of the pipeline over {self.name} stopped"))
    self._copier.close()

  def release(self) -> None:
    """Drops the loader, every chain and stored chunk, and ends the
    prefetch thread; idempotent, and it does not wait for a chunk being
    produced. Requests still waiting for a chunk get
    :class:`PipelineReleasedError` at once."""
    self._store.release(PipelineReleasedError(
        f"this pipeline over {self.name} was released by its release_fn "
        "while compiled code waited for a chunk"))
    prefetcher, self._prefetcher = self._prefetcher, None
    if prefetcher is not None:
      prefetcher.close(self._released())
    self._copier.close()
    self._zeros = None
