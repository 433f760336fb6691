"""Long runs, many pipelines, many threads: memory stays flat, streams stay
exact."""

import ctypes
import gc
import threading
import time
import warnings
import weakref

import jax
import numpy as np
import psutil
import pytest
from jax import lax

import jax_data
import jax_data.loaders.indexed
import jax_data.pass_keys
import jax_data.serving.chunk_store
from jax_data import NumpyDataLoader
from jax_data.host_loader import StoreLimits


def _rss() -> int:
  """Resident memory after freed heap pages went back to the OS.

  glibc keeps freed pages of its heap until asked (XLA's compilations leave
  many); ``malloc_trim`` returns them, so what remains is memory still held.
  """
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: measure as it is
    pass
  return psutil.Process().memory_info().rss


def test_hundred_pipelines_over_100mb_leave_memory_where_it_was():
  loader = NumpyDataLoader(x=np.ones((100_000, 250), np.float32))  # 100 MB

  def use_once(loader, seed):
    pipeline = jax_data.random_reference_data(loader, 8, 32)
    init_fn, batch_fn, release_fn = pipeline
    state = init_fn(seed=seed)
    for _ in range(10):
      state, batch = batch_fn(state)
    mapper_fn, release_mapper = jax_data.full_data_mapper(loader, 10, 1000)
    sums, _ = mapper_fn(lambda b, m, c: ((b["x"].sum(1) * m).sum(), c), None,
                        masking=True)
    assert float(batch["x"].sum()) == 32 * 250
    assert float(sums.sum()) == 100_000 * 250
    release_fn()
    release_mapper()

  for seed in range(5):  # warm up JAX's own caches
    use_once(loader, seed)
  start = _rss()
  for seed in range(100):
    use_once(loader, seed)
  grown = _rss() - start
  assert grown < 50 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"
  ref = weakref.ref(loader)
  del loader
  gc.collect()
  assert ref() is None  # released pipelines hold no reference to the data


def test_pipelines_dropped_without_release_free_their_host_and_thread():
  # Without release_fn: dropping the pipeline must free its host (and with
  # it the loader's data) and end its prefetch thread; a thread left behind
  # could run while the interpreter finalizes, which aborts the process.
  # Only this test's threads are counted: the gc.collect() below also ends
  # those of pipelines that earlier tests dropped in reference cycles.
  before = set(threading.enumerate())

  def started() -> int:
    return sum(t.name == "jax_data-prefetch" and t.is_alive()
               for t in set(threading.enumerate()) - before)

  hosts = []
  for kind in range(6):
    loader = NumpyDataLoader(x=np.arange(300.0, dtype=np.float32))
    if kind % 2:
      init_fn, map_fn, release_fn = jax_data.full_reference_data(loader,
                                                                 3, 7)
      map_fn(lambda b, c: (b["x"], c), init_fn(), None)
      hosts.append(weakref.ref(map_fn.__self__.host))
    else:
      init_fn, batch_fn, release_fn = jax_data.random_reference_data(
          loader, 3, 7)
      state = init_fn(seed=kind)
      for _ in range(10):  # several refreshes, each prefetching the next
        state, batch = batch_fn(state)
      jax.block_until_ready(batch)
      hosts.append(weakref.ref(batch_fn.__self__.host))
  assert started() > 0
  del loader, init_fn, state, batch, batch_fn, map_fn, release_fn
  # A prefetch job still running holds its host until it ends.
  deadline = time.monotonic() + 5.0
  while time.monotonic() < deadline:
    gc.collect()
    if all(h() is None for h in hosts) and started() == 0:
      break
    time.sleep(0.02)
  assert [h() for h in hosts] == [None] * len(hosts)
  assert started() == 0


def test_pipelines_start_their_threads_on_first_use_and_release_unused():
  # A constructor starts nothing: the host makes its chains at the first
  # init_fn and its store, with the prefetch thread, at the first request.
  before = set(threading.enumerate())

  def started() -> int:  # prefetch threads this test started, alive
    return sum(t.name == "jax_data-prefetch" and t.is_alive()
               for t in set(threading.enumerate()) - before)

  loader = NumpyDataLoader(x=np.arange(300.0, dtype=np.float32))
  built = ([jax_data.random_reference_data(loader, 3, 7) for _ in range(10)]
           + [jax_data.full_reference_data(loader, 3, 7) for _ in range(10)])
  assert started() == 0
  assert all(p.host.wait_idle(0.0) for p in built)
  for pipeline in built[1:]:
    pipeline.release_fn()  # released unused: nothing to stop, nothing lost
    with pytest.raises(jax_data.PipelineReleasedError):
      pipeline.init_fn()
  init_fn, batch_fn, release_fn = built[0]
  state = init_fn(seed=0)
  assert started() == 0  # a chain, no request yet
  state, batch = batch_fn(state)
  assert float(batch["x"].sum()) >= 0
  assert built[0].host.wait_idle()
  assert started() == 1
  # Prefetching stopped before a store is made (the exit hook): the store
  # made later serves without a thread.
  late = jax_data.random_reference_data(loader, 3, 7)
  assert late.host.stop_prefetching() is None
  late_state, late_batch = late.batch_fn(late.init_fn(seed=0))
  np.testing.assert_array_equal(late_batch["x"], batch["x"])
  assert started() == 1
  for pipeline in (built[0], late):
    pipeline.release_fn()
  ref = weakref.ref(loader)
  del loader, built, init_fn, batch_fn, release_fn, late, state, late_state
  gc.collect()
  assert ref() is None


def test_million_steps_keep_host_memory_flat():
  pipeline = jax_data.random_reference_data(
      NumpyDataLoader(x=np.arange(10_000.0)), 100, 64)
  init_fn, batch_fn, _ = pipeline
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=200_000)[0])
  state = run(init_fn(seed=1))
  start = _rss()
  for _ in range(4):
    state = run(state)
  grown = _rss() - start
  assert int(state.chunk) * 100 == 1_000_000
  record = pipeline.host.chain(int(state.chain))
  assert len(record.chunks) <= 2 + StoreLimits().ahead
  assert len(record.snapshots) < 400
  assert grown < 20 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"


def test_eight_threads_each_get_their_solo_stream():
  n, cache, mb, steps = 101, 3, 7, 40
  loader = NumpyDataLoader(x=np.arange(n))
  init_fn, batch_fn, _ = jax_data.random_reference_data(loader, cache, mb)
  modes = [dict(), dict(shuffle=True), dict(shuffle=True, in_epochs=True)]
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=steps)[1]["x"])
  results, errors = {}, []
  barrier = threading.Barrier(8)

  def worker(i):
    try:
      state = init_fn(seed=100 + i, **modes[i % 3])
      barrier.wait()
      first = run(state)
      second = run(state)  # the same state again, concurrently with others
      results[i] = (first.tolist(), second.tolist())
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert not errors, errors
  for i in range(8):
    solo_init, solo_batch, _ = jax_data.random_reference_data(
        NumpyDataLoader(x=np.arange(n)), cache, mb)
    _, solo = jax.lax.scan(lambda s, _, step=solo_batch: step(s),
                           solo_init(seed=100 + i, **modes[i % 3]), None,
                           length=steps)
    assert results[i][0] == results[i][1] == solo["x"].tolist(), i


def test_mapper_compiles_once_per_function_and_keeps_a_bounded_set():
  mapper = jax_data.full_data_mapper(NumpyDataLoader(x=np.arange(100.0)),
                                     2, 10)
  mapper_fn, _ = mapper
  client = jax.devices()[0].client

  def fun(observation, carry):
    return observation["x"] * 2, carry

  mapper_fn(fun, None, batched=False)
  gc.collect()
  before = len(client.live_executables())
  for _ in range(10):
    values, _ = mapper_fn(fun, None, batched=False)
  assert values.tolist() == [2.0 * i for i in range(100)]
  gc.collect()
  assert len(client.live_executables()) == before  # nothing compiled again
  # A new function on every call (the user guide's lambdas): compiled each
  # time, but only the most recent passes are kept.
  limit = jax_data.pass_keys.MAX_COMPILED
  for _ in range(3 * limit):
    mapper_fn(lambda o, c: (o["x"], c), None, batched=False)
  gc.collect()
  assert len(client.live_executables()) - before <= limit


def test_a_new_chain_per_epoch_keeps_host_memory_flat():
  """Stored chunks of all chains stay within the store's budget (4.8 MB
  chunks, 120 chains)."""
  loader = NumpyDataLoader(x=np.ones((20_000, 187), np.float32))
  pipeline = jax_data.random_reference_data(loader, 100, 64)
  init_fn, batch_fn, _ = pipeline
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=300)[0])
  chunk_bytes = pipeline.host.layout.nbytes
  budget = max(StoreLimits().store_bytes, 3 * chunk_bytes)
  chains = []
  for epoch in range(120):
    state = jax.block_until_ready(run(init_fn(seed=epoch, shuffle=True)))
    chains.append(int(state.chain))
    if epoch == 40:
      start = _rss()
    stored = sum(len(pipeline.host.chain(c).chunks) for c in chains)
    assert stored * chunk_bytes <= budget + chunk_bytes
  grown = _rss() - start
  assert grown < 40 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"


def test_many_chains_that_cannot_regenerate_keep_only_their_chunks_ahead():
  """Vmapped chains of the exact streams (a chunk made again replays from
  a snapshot) where the budget cannot keep served chunks for every lane:
  the store keeps only the chunks produced ahead, not a few lanes' served
  ones on top (1,024 chains kept 1.5 chunks each, 40 MiB beyond them),
  and the producer's buffers are used again rather than made anew; the
  streams are those of the same chains one by one."""
  loader = NumpyDataLoader(x=np.arange(4_000.0 * 8).reshape(4_000, 8))
  lanes, cache, mb = 16, 4, 8
  chunk = cache * mb * 8 * 8  # bytes of x
  # Room for 2 chunks a lane, not the 4 of keep + ahead.
  loader.store_limits = StoreLimits(store_bytes=2 * lanes * (chunk + 4096))
  pipeline = jax_data.random_reference_data(loader, cache, mb)
  init_fn, batch_fn, release_fn = pipeline

  def one(state):
    return lax.scan(lambda s, _: batch_fn(s), state, None, length=3 * cache)

  run = jax.jit(jax.vmap(one))
  states = init_fn(seed=range(lanes), stream="exact")
  got = []
  for _ in range(4):
    states, batches = run(states)
    got.append(np.asarray(batches["x"]))
    assert pipeline.host.wait_idle()
    records = [pipeline.host.chain(int(c)) for c in states.chain]
    stored = [len(record.chunks) for record in records]
    assert sum(stored) <= 2 * lanes, stored  # ahead: 2, none kept besides
    # The chunks produced ahead stay, the next one asked for among them: a
    # store that dropped them instead made every request a replay.
    for record, chunk in zip(records, states.chunk):
      assert int(chunk) in record.chunks, (int(chunk), list(record.chunks))
  solo = jax.jit(one)
  for lane in range(lanes):
    state = init_fn(seed=lane, stream="exact")
    for call in range(4):
      state, batches = solo(state)
      np.testing.assert_array_equal(got[call][lane], batches["x"])
  release_fn()


def test_a_chain_whose_chunks_were_dropped_continues_exactly():
  rows = np.arange(20_000, dtype=np.float32)[:, None]
  loader = NumpyDataLoader(x=rows + np.zeros((1, 187), np.float32))
  pipeline = jax_data.random_reference_data(loader, 100, 64)  # 4.8 MB
  init_fn, batch_fn, _ = pipeline
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=250))
  first = init_fn(seed=3, shuffle=True)
  middle, _ = run(first)
  _, expected = run(middle)
  # Many other chains push the first one's chunks out of the store, and its
  # cursor drops its permutations; the same state continues exactly.
  host = pipeline.host
  for seed in range(200):
    run(init_fn(seed=100 + seed, shuffle=True))
    if not host.chain(int(first.chain)).chunks:
      break
  assert not host.chain(int(first.chain)).chunks
  _, again = run(middle)
  np.testing.assert_array_equal(again["x"], expected["x"])


def _small_budget(count):
  """Shuffled chains of 4 batches of 32 over ``count`` observations, whose
  cursors share a budget of 1 MiB."""
  loader = NumpyDataLoader(x=np.arange(count, dtype=np.float32))
  loader.store_limits = StoreLimits(store_bytes=1 << 20)
  return jax_data.random_reference_data(loader, 4, 32)


def _steps(pipeline, length):
  """``length`` steps of ``pipeline``'s batch_fn in one jitted scan."""
  batch_fn = pipeline[1]
  return jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                    length=length))


def test_a_cursor_trim_that_fails_once_does_not_stop_the_prefetch_thread(
    monkeypatch):
  """Trimming runs in the prefetch thread; a cursor whose trim raised
  ended that thread before, and every later job queued for ever (no more
  read-ahead, no more trimming, wait_idle never true). Now the failure is
  warned and the housekeeping goes on."""
  count = 20_000
  failed = []
  trim = jax_data.loaders.indexed.IndexedCursor.trim

  def trim_failing_once(cursor):
    if not failed:
      failed.append(cursor)
      raise OSError("trim failed once")
    return trim(cursor)

  monkeypatch.setattr(jax_data.loaders.indexed.IndexedCursor, "trim",
                      trim_failing_once)
  init_fn, _, release_fn = pipeline = _small_budget(count)
  run = _steps(pipeline, 8)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    states = []
    for epoch in range(40):
      states.append(run(init_fn(seed=epoch, shuffle=True))[0])
      assert pipeline.host.wait_idle(), epoch
  assert failed
  assert any("trimming chain" in str(w.message) and "trim failed once" in
             str(w.message) for w in caught)
  cursors = [pipeline.host.chain(int(s.chain)).cursor for s in states]
  limit = max(1 << 20, StoreLimits().held_requests * 8 * count)
  assert sum(c.held_bytes() for c in cursors) <= limit + max(
      c.held_bytes() for c in cursors)
  release_fn()


def test_a_prefetch_job_that_raises_is_warned_and_the_next_runs():
  prefetcher = jax_data.serving.chunk_store.Prefetcher("the loader")
  ran = []

  def failing():
    raise OSError("housekeeping failed")

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert prefetcher.submit(failing, lambda e: None)
    assert prefetcher.submit(lambda: ran.append(1), lambda e: None)
    assert prefetcher.wait_idle(30)
  assert ran == [1]
  assert any("background work for the loader failed and was skipped: "
             "OSError: housekeeping failed" in str(w.message) for w in caught)
  prefetcher.close(RuntimeError("closed"))
  prefetcher.join(30)


def test_permutations_of_many_small_chains_stay_within_the_budget():
  """A new shuffled chain per epoch with chunks too small for the chunk
  budget to act: the chains' permutations (8 bytes per observation each)
  are trimmed, least recently used first, and every chain continues
  exactly."""
  count = 20_000
  init_fn, _, _ = pipeline = _small_budget(count)
  loader = pipeline.host.loader
  run = _steps(pipeline, 8)
  host = pipeline.host
  states, batches = [], []
  for epoch in range(40):
    state, batch = run(init_fn(seed=epoch, shuffle=True))
    states.append(state)
    batches.append(np.asarray(batch["x"]))
    assert host.wait_idle()  # trimming is the prefetch thread's work
    cursors = [host.chain(int(s.chain)).cursor for s in states]
    held = sum(cursor.held_bytes() for cursor in cursors)
    most = max(cursor.held_bytes() for cursor in cursors)
    limit = max(1 << 20, StoreLimits().held_requests * 8 * count)
    assert held <= limit + most, (epoch, held)
  assert held > 0
  assert host.chain(int(states[0].chain)).cursor.held_bytes() == 0
  # Trimmed chains draw their permutations again: the same batches as the
  # same seeds on a new pipeline.
  fresh_init, fresh_batch, _ = jax_data.random_reference_data(loader, 4, 32)
  fresh_run = jax.jit(lambda s: lax.scan(lambda s, _: fresh_batch(s), s,
                                         None, length=8))
  for epoch in (0, 1, 39):
    _, again = run(states[epoch])
    _, expected = fresh_run(fresh_run(fresh_init(seed=epoch,
                                                 shuffle=True))[0])
    np.testing.assert_array_equal(again["x"], expected["x"])
    np.testing.assert_array_equal(
        batches[epoch],
        fresh_run(fresh_init(seed=epoch, shuffle=True))[1]["x"])


def test_a_chain_made_while_release_fn_runs_is_closed():
  """init_fn in one thread while release_fn runs in another, during the
  loader's opening of the chain's cursor: the chain used to stay in the
  released table with its cursor open. Now init_fn raises
  PipelineReleasedError and the cursor is closed."""
  from jax_data.indexed import IndexedCursor

  opened, closed, opening = [], [], threading.Event()

  class Cursor(IndexedCursor):
    def close(self):
      closed.append(self)
      super().close()

  class SlowToOpen(jax_data.HostDataLoader):
    static_information = {"observation_count": 100}
    observation_format = {"x": jax.ShapeDtypeStruct((), np.int32)}

    def open_chain(self, spec, layout):
      opening.set()
      time.sleep(0.3)  # a file or a tf.data iterator being opened

      def read(rows, out):
        out[0][...] = rows
        return out

      opened.append(Cursor(spec, layout, read))
      return opened[-1]

  init_fn, _, release_fn = jax_data.random_reference_data(SlowToOpen(), 2, 4)
  results = []

  def make():
    try:
      results.append(init_fn(seed=1))
    except jax_data.PipelineReleasedError as e:
      results.append(e)

  maker = threading.Thread(target=make)
  maker.start()
  assert opening.wait(10)
  release_fn()
  maker.join(30)
  assert isinstance(results[0], jax_data.PipelineReleasedError)
  assert opened and closed == opened
  assert init_fn.__self__.host.chains() == []


def test_a_release_while_a_state_is_checked_says_released():
  """release_fn in another thread between the check that the pipeline is
  open and the check of the state's chain (once in 78 races of a
  reviewer's probe) said the chain was not this pipeline's (its chains:
  none); it says the pipeline was released."""
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      NumpyDataLoader(x=np.arange(10.0)), 2, 3)
  state = init_fn()
  host = batch_fn.__self__.host
  has_chain = host.has_chain

  def released_meanwhile(chain):
    release_fn()
    return has_chain(chain)

  host.has_chain = released_meanwhile
  with pytest.raises(jax_data.PipelineReleasedError, match="release_fn"):
    batch_fn(state)
