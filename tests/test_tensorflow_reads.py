"""Random chains of a streamed TensorflowDataLoader that read one pipeline
iterator between them (``jax_data.loaders.tensorflow_reads``): the same
streams as chains that read their own, the data read once, and each chain
on its own when it is elsewhere, released or failing."""

import threading
import time
import warnings

import jax
import numpy as np
import pytest

import jax_data

tf = pytest.importorskip("tensorflow")
tensorflow_loader = pytest.importorskip("jax_data.tensorflow_loader")
TensorflowDataLoader = tensorflow_loader.TensorflowDataLoader


def _pipeline(n):
  return tf.data.Dataset.from_tensor_slices(
      {"x": np.arange(n), "y": np.arange(n, dtype=np.float32) / 2})


class _Counted:
  """A pipeline over ``range(n)`` that counts the elements it yields."""

  def __init__(self, n):
    self.read = 0
    self._lock = threading.Lock()

    def count(x):
      with self._lock:
        self.read += 1
      return x

    self.pipeline = tf.data.Dataset.range(n).map(
        lambda x: {"x": tf.ensure_shape(
            tf.py_function(count, [x], tf.int64), [])})


def _held(n, slots):
  """A loader of ``range(n)`` held in memory: the streams of the streamed
  chains of the same pipeline and ``shuffle_cache``, to compare with."""
  return TensorflowDataLoader(tf.data.Dataset.range(n).map(
      lambda x: {"x": x}), shuffle_cache=slots, in_memory=True)


def _chunk_x(cursor, layout):
  return cursor.produce(0, layout.new_chunk()).leaves[0].copy()


class _Stalling:
  """A pipeline over ``range(30)`` whose element 3 stalls (the first time
  only, with ``once``) until :attr:`go_on` is set; :attr:`stalled` is set
  when it does. :meth:`read` reads a cursor's chunk in a daemon thread
  into :attr:`outcomes` (the chunk's x, or the error)."""

  def __init__(self, once=False):
    self.stalled, self.go_on = threading.Event(), threading.Event()
    self.outcomes = {}
    first = [True]

    def slow(x):
      if int(x) == 3 and (first[0] or not once):
        first[0] = False
        self.stalled.set()
        self.go_on.wait(60)
      return x

    self.pipeline = tf.data.Dataset.range(30).map(
        lambda x: {"x": tf.ensure_shape(tf.py_function(slow, [x], tf.int64),
                                        [])})

  def read(self, name, cursor, layout):
    def run():
      try:
        self.outcomes[name] = _chunk_x(cursor, layout)
      except Exception as e:  # pylint: disable=broad-except
        self.outcomes[name] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_share_reads_must_be_a_bool():
  with pytest.raises(TypeError, match="share_reads"):
    TensorflowDataLoader(_pipeline(10), share_reads="yes")


@pytest.mark.parametrize("shard", [None, (1, 3)])
def test_chains_in_step_read_the_pipeline_once_and_keep_their_streams(
    shard):
  """Eight vmapped chains: the same batches as chains that read their own
  iterators (and as chains held in memory), from one read of the data;
  one reader thread, not eight."""
  counted = _Counted(300)
  keywords = {} if shard is None else dict(shard_index=shard[0],
                                           shard_count=shard[1])

  def run(loader):
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, 3, 5)
    states = init_fn(seed=range(8), **keywords)
    step = jax.jit(jax.vmap(batch_fn))
    xs = []
    for _ in range(70):  # 350 steps: more than a pass of each shard
      states, batch = step(states)
      xs.append(np.asarray(batch["x"]))
    release_fn()
    return np.stack(xs)

  shared = run(TensorflowDataLoader(counted.pipeline, shuffle_cache=7))
  read_shared, counted.read = counted.read, 0
  own = run(TensorflowDataLoader(counted.pipeline, shuffle_cache=7,
                                 share_reads=False))
  read_own = counted.read
  held = run(TensorflowDataLoader(counted.pipeline, shuffle_cache=7,
                                  in_memory=True))
  np.testing.assert_array_equal(shared, own)
  np.testing.assert_array_equal(shared, held)
  # The chains' seeds differ, so do their streams.
  assert (shared[:, 0] != shared[:, 1]).any()
  steps = 70 * 5 + 7  # steps served, the shuffle buffer
  read_once = steps if shard is None else steps * 3  # a shard's skip
  assert read_shared <= read_once + 3 * 3 * 5 * 5  # and reads ahead
  assert read_own >= 8 * steps


def test_many_chains_keep_one_reader_thread():
  loader = TensorflowDataLoader(_pipeline(500), shuffle_cache=10)
  before = {t for t in threading.enumerate() if t.name == "jax_data-tf-read"}
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 2,
                                                                 4)
  states = init_fn(seed=range(64))
  step = jax.jit(jax.vmap(batch_fn))
  for _ in range(10):
    states, _ = step(states)
  jax.block_until_ready(states)
  readers = {t for t in threading.enumerate()
             if t.name == "jax_data-tf-read"} - before
  assert len(readers) == 1
  release_fn()


def test_chains_with_iterators_of_their_own_read_in_few_threads():
  """With share_reads=False, 64 vmapped chains read their 64 iterators in
  a few of the loader's reading threads (a thread per chain kept
  memory of its own in TensorFlow), and their iterators do not autotune;
  the chains' streams are those of the shared reads."""
  before = {t for t in threading.enumerate() if t.name == "jax_data-tf-read"}
  streams = []
  for share_reads in (False, True):
    loader = TensorflowDataLoader(_pipeline(500), shuffle_cache=10,
                                  share_reads=share_reads)
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader,
                                                                   2, 4)
    states = init_fn(seed=range(64))
    step = jax.jit(jax.vmap(batch_fn))
    seen = []
    for _ in range(10):
      states, batch = step(states)
      seen.append(np.asarray(batch["x"]))
    streams.append(np.stack(seen))
    if not share_reads:
      readers = {t for t in threading.enumerate()
                 if t.name == "jax_data-tf-read"} - before
      # One or two; a third or fourth where a job came before the
      # thread that finished the last one was idle again (a loaded machine).
      assert 1 <= len(readers) <= 4
    release_fn()
  np.testing.assert_array_equal(streams[0], streams[1])
  from jax_data.loaders import tensorflow_rows
  data = _pipeline(5)
  assert tensorflow_rows.chain_dataset(
      data, one_of_many=True).options().autotune.enabled is False
  assert tensorflow_rows.chain_dataset(data).options().autotune.enabled is None
  options = tf.data.Options()
  options.autotune.enabled = True  # the pipeline's own choice is kept
  assert tensorflow_rows.chain_dataset(
      data.with_options(options),
      one_of_many=True).options().autotune.enabled is True


def test_readers_run_their_jobs_in_order_and_a_stuck_read_keeps_one_thread():
  """Readers of one loader run their jobs in their loader's threads: each
  reader's jobs one at a time, in the order they came; a read that does
  not return keeps its thread, and the other readers' jobs go on in
  another; its reader's release ends the wait for it at once."""
  from jax_data.loaders import tensorflow_rows
  threads = tensorflow_rows.ReadThreads()
  readers = [tensorflow_rows.Reader(threads) for _ in range(3)]
  done = {i: [] for i in range(3)}
  running = {i: threading.Lock() for i in range(3)}
  overlaps = []

  def job(i, k):
    def work():
      if not running[i].acquire(blocking=False):
        overlaps.append((i, k))
        return
      try:
        time.sleep(0.001)
        done[i].append(k)
      finally:
        running[i].release()
    return work

  for k in range(30):
    for i, reader in enumerate(readers):
      reader.submit(job(i, k))
  assert readers[0].next(iter([7])) == 7  # after reader 0's 30 jobs
  assert done[0] == list(range(30))
  deadline = time.monotonic() + 10
  while any(len(d) < 30 for d in done.values()) and (
      time.monotonic() < deadline):
    time.sleep(0.01)
  assert done == {i: list(range(30)) for i in range(3)}
  assert not overlaps
  assert threads.started <= 4  # threads as jobs ran at once, not per job

  stuck, go_on = threading.Event(), threading.Event()

  def never_returns():
    stuck.set()
    go_on.wait(30)
    yield 1

  outcome = []

  def wait_stuck():
    try:
      outcome.append(readers[0].next(never_returns()))
    except jax_data.PipelineReleasedError as e:
      outcome.append(e)

  waiter = threading.Thread(target=wait_stuck, daemon=True)
  waiter.start()
  try:
    assert stuck.wait(10)
    for k in range(5):  # the other readers go on meanwhile
      assert readers[1].next(iter([k])) == k
      assert readers[2].next(iter([k])) == k
    readers[0].cancel()
    waiter.join(5)
    assert isinstance(outcome[0], jax_data.PipelineReleasedError)
  finally:
    go_on.set()


def test_threads_beyond_what_the_reads_need_end_while_reads_go_on(
    monkeypatch):
  """Eight readers' jobs at once start eight threads; while one reader
  then goes on reading, the threads it does not need end after _IDLE_S
  (each job woke the thread idle the shortest time, so the others time
  out)."""
  from jax_data.loaders import tensorflow_rows
  monkeypatch.setattr(tensorflow_rows, "_IDLE_S", 0.2)

  def alive():
    return {t for t in threading.enumerate()
            if t.name == "jax_data-tf-read"} - before

  before = {t for t in threading.enumerate() if t.name == "jax_data-tf-read"}
  threads = tensorflow_rows.ReadThreads()
  readers = [tensorflow_rows.Reader(threads) for _ in range(8)]
  go_on, started = threading.Event(), threading.Semaphore(0)

  def hold():
    started.release()
    go_on.wait(10)

  for reader in readers:
    reader.submit(hold)
  for _ in readers:
    assert started.acquire(timeout=10)
  assert len(alive()) == 8
  go_on.set()
  deadline = time.monotonic() + 1.5
  while time.monotonic() < deadline:
    assert readers[0].next(iter([1])) == 1
    time.sleep(0.01)
  assert len(alive()) <= 2


def test_a_read_whose_thread_cannot_start_fails_and_the_next_reads_work(
    monkeypatch):
  """A thread that cannot start (the interpreter exiting, too many
  threads) fails the read that needed it, with its error; the reader and
  the other readers of the loader read on afterwards."""
  from jax_data.loaders import tensorflow_rows
  threads = tensorflow_rows.ReadThreads()
  first, second = (tensorflow_rows.Reader(threads) for _ in range(2))
  start = threading.Thread.start
  failures = [RuntimeError("can't start new thread")]

  def fails_once(thread):
    if failures and thread.name == "jax_data-tf-read":
      raise failures.pop()
    return start(thread)

  monkeypatch.setattr(threading.Thread, "start", fails_once)
  with pytest.raises(RuntimeError, match="can't start new thread"):
    first.next(iter([0, 1]))
  items, got = iter([0, 1]), []

  def reads():  # in a thread: a read that waits for ever fails the test
    got.append(first.next(items))  # the failed read took nothing
    got.append(second.next(iter([5])))
    got.append(first.next(items))

  reading = threading.Thread(target=reads, daemon=True)
  reading.start()
  reading.join(10)
  assert got == [0, 5, 1]


def test_a_failed_reads_error_is_all_that_keeps_its_iterator():
  """A read that fails raises its pipeline's error in the caller; once the
  caller drops the error, nothing keeps the iterator (no reference cycle
  waits for the garbage collector with it)."""
  import gc
  import weakref

  from jax_data.loaders import tensorflow_rows

  class Failing:
    def __iter__(self):
      return self

    def __next__(self):
      raise ValueError("the pipeline failed")

  reader = tensorflow_rows.Reader(tensorflow_rows.ReadThreads())
  iterator = Failing()
  alive = weakref.ref(iterator)
  collecting = gc.isenabled()
  gc.disable()
  try:
    with pytest.raises(ValueError, match="the pipeline failed") as caught:
      reader.next(iterator)
    del iterator
    assert alive() is not None  # the error's traceback holds it
    del caught
    assert alive() is None
  finally:
    if collecting:
      gc.enable()

def _cursors(loader, seeds, layout, **keywords):
  return [loader.open_chain(loader.chain_spec(False, seed=s, **keywords),
                            layout) for s in seeds]


@pytest.mark.parametrize("seed", range(4))
def test_chains_served_in_any_order_and_moved_anywhere_keep_their_streams(
    seed):
  """Chains produced in a random order, some moved to other positions
  (their own reads, then back with the others once they meet them),
  trimmed or restarted, serve exactly the chunks of the same chains held
  in memory; at the end every chain in step reads the shared iterator."""
  rng = np.random.default_rng(seed)
  n, chains = int(rng.integers(40, 120)), 5
  data = _pipeline(n)
  shared = TensorflowDataLoader(data, shuffle_cache=int(rng.integers(1, 30)))
  held = TensorflowDataLoader(data, shuffle_cache=shared._shuffle_cache,  # pylint: disable=protected-access
                              in_memory=True)
  layout = shared.chunk_layout(int(rng.integers(1, 4)),
                               int(rng.integers(1, 9)))
  cursors = _cursors(shared, range(chains), layout)
  references = _cursors(held, range(chains), layout)
  for _ in range(200):
    c = int(rng.integers(chains))
    action = rng.random()
    if action < 0.08:  # a restore elsewhere
      position = cursors[c].position()
      position["position"] = int(rng.integers(0, 3 * n))
      cursors[c].seek(position)
      references[c].seek(position)
    elif action < 0.12:
      cursors[c].trim()
    else:
      np.testing.assert_array_equal(_chunk_x(cursors[c], layout),
                                    _chunk_x(references[c], layout))
  # All chains to one place: they read together again.
  for cursor, reference in zip(cursors, references):
    position = cursor.position()
    position["position"] = n
    cursor.seek(position)
    reference.seek(position)
  for _ in range(3):
    for cursor, reference in zip(cursors, references):
      np.testing.assert_array_equal(_chunk_x(cursor, layout),
                                    _chunk_x(reference, layout))
  assert all(cursor._source.reads_shared() for cursor in cursors)  # pylint: disable=protected-access
  for cursor in cursors:
    cursor.close()


def test_a_chain_left_far_behind_reads_by_itself_exactly():
  """One chain stays while the others move on many chunks: the window of
  shared reads leaves it behind, it reads its own iterator, and its
  stream goes on exactly."""
  n = 1000
  shared = TensorflowDataLoader(_pipeline(n), shuffle_cache=5)
  held = TensorflowDataLoader(_pipeline(n), shuffle_cache=5, in_memory=True)
  layout = shared.chunk_layout(2, 4)
  lagging, leading = _cursors(shared, [0, 1], layout)
  reference = _cursors(held, [0], layout)[0]
  for _ in range(2):
    np.testing.assert_array_equal(_chunk_x(lagging, layout),
                                  _chunk_x(reference, layout))
  for _ in range(20):
    _chunk_x(leading, layout)
  for _ in range(3):
    np.testing.assert_array_equal(_chunk_x(lagging, layout),
                                  _chunk_x(reference, layout))
  assert not lagging._source.reads_shared()  # pylint: disable=protected-access
  assert leading._source.reads_shared()  # pylint: disable=protected-access
  lagging.close()
  leading.close()


def test_release_ends_only_the_released_chains_wait():
  """Two chains wait for the same shared read of a stalled pipeline; the
  release of one (its cursor's cancel) ends its wait at once with
  PipelineReleasedError, and the other gets its rows once the read
  ends."""
  stalling = _Stalling()
  loader = TensorflowDataLoader(stalling.pipeline, shuffle_cache=2)
  layout = loader.chunk_layout(1, 4)
  first, second = _cursors(loader, [0, 1], layout)
  threads = [stalling.read(name, cursor, layout)
             for name, cursor in (("first", first), ("second", second))]
  outcomes = stalling.outcomes
  try:
    assert stalling.stalled.wait(30)
    time.sleep(0.2)  # both wait for the read now
    first.cancel()
    threads[0].join(10)
    assert isinstance(outcomes.get("first"), jax_data.PipelineReleasedError)
    assert "second" not in outcomes
  finally:
    stalling.go_on.set()
  threads[1].join(30)
  assert sorted(outcomes["second"].reshape(-1).tolist()) != []
  assert set(outcomes["second"].reshape(-1).tolist()) <= set(range(6))
  first.close()
  second.close()


def test_a_failed_read_fails_every_waiting_chain_and_is_tried_again():
  """A pipeline that fails once: every chain that needed the read gets
  its error, and the next chunks are read again from the start of the
  pass, the same as with no failure."""
  failures = [1]

  def flaky(x):
    if int(x) == 6 and failures:
      failures.pop()
      raise ValueError("a flaky element")
    return x

  data = tf.data.Dataset.range(40).map(
      lambda x: {"x": tf.ensure_shape(tf.py_function(flaky, [x], tf.int64),
                                      [])})
  loader = TensorflowDataLoader(data, shuffle_cache=3)
  held = _held(40, 3)
  layout = loader.chunk_layout(2, 4)
  cursors = _cursors(loader, range(3), layout)
  references = _cursors(held, range(3), layout)
  errors = 0
  for cursor, reference in zip(cursors, references):
    try:
      got = _chunk_x(cursor, layout)
    except Exception as e:  # pylint: disable=broad-except
      assert "flaky" in str(e)
      errors += 1
      got = _chunk_x(cursor, layout)  # the same chunk, asked again
    np.testing.assert_array_equal(got, _chunk_x(reference, layout))
  assert errors == 1  # the read failed once, for the chain that waited
  for _ in range(4):
    for cursor, reference in zip(cursors, references):
      np.testing.assert_array_equal(_chunk_x(cursor, layout),
                                    _chunk_x(reference, layout))
  for cursor in cursors:
    cursor.close()


def test_a_chain_that_joins_idle_mid_pass_brings_its_own_reads(
    monkeypatch):
  """A chain that read by itself to the middle of a pass finds no chain
  reading together (they were closed): its own iterator becomes the shared
  one, so it reads on shared from where it stood, exactly, without
  reading the pass again from its start."""
  from jax_data.loaders import tensorflow_reads
  n = 2000
  counted = _Counted(n)
  loader = TensorflowDataLoader(counted.pipeline, shuffle_cache=5)
  held = _held(n, 5)
  layout = loader.chunk_layout(2, 4)
  lagging, leading = _cursors(loader, [0, 1], layout)
  reference = _cursors(held, [0], layout)[0]
  np.testing.assert_array_equal(_chunk_x(lagging, layout),
                                _chunk_x(reference, layout))
  for _ in range(60):  # far ahead: the lagging chain is let go
    _chunk_x(leading, layout)
  for _ in range(40):  # it reads by itself to the middle of the pass
    np.testing.assert_array_equal(_chunk_x(lagging, layout),
                                  _chunk_x(reference, layout))
  assert not lagging._source.reads_shared()  # pylint: disable=protected-access
  leading.close()  # no chain reads shared now
  counted.read = 0
  joins = []
  join = tensorflow_reads.SharedReads.join
  monkeypatch.setattr(tensorflow_reads.SharedReads, "join", (
      lambda self, *args: joins.append(args[1]) or join(self, *args)))
  for _ in range(5):
    np.testing.assert_array_equal(_chunk_x(lagging, layout),
                                  _chunk_x(reference, layout))
  assert lagging._source.reads_shared()  # pylint: disable=protected-access
  assert len(joins) == 1
  assert counted.read <= 5 * 8 + 8  # its chunks and a block read ahead
  lagging.close()


def test_a_chain_restored_mid_pass_replays_once_then_reads_shared():
  """A chain restored alone into a pass needs the elements from the oldest
  its shuffle buffer holds on: it reads the pass up to there once (here
  through the idle shared reads, its buffer's oldest element being within
  their reach), then reads on shared, not the pass again."""
  n = 3000
  counted = _Counted(n)
  loader = TensorflowDataLoader(counted.pipeline, shuffle_cache=5)
  held = _held(n, 5)
  layout = loader.chunk_layout(2, 4)
  cursor, = _cursors(loader, [0], layout)
  reference, = _cursors(held, [0], layout)
  for c in (cursor, reference):
    position = c.position()
    position["position"] = 250  # batch 250: step 1,000 of the first pass
    c.seek(position)
  for _ in range(4):
    np.testing.assert_array_equal(_chunk_x(cursor, layout),
                                  _chunk_x(reference, layout))
  assert cursor._source.reads_shared()  # pylint: disable=protected-access
  assert counted.read <= 1000 + 5 + 4 * 8 + 2 * 8  # one replay
  cursor.close()


def test_new_chains_never_wait_behind_a_read_of_released_ones():
  """Every chain of a shared read that stalls is released and closed; new
  chains of the same loader (a new pipeline after release_fn) read at
  once, not behind the stalled read, which may never end."""
  stalling = _Stalling(once=True)
  loader = TensorflowDataLoader(stalling.pipeline, shuffle_cache=2)
  layout = loader.chunk_layout(1, 4)
  old = _cursors(loader, [0, 1], layout)
  threads = [stalling.read(i, cursor, layout) for i, cursor in enumerate(old)]
  outcomes = stalling.outcomes
  try:
    assert stalling.stalled.wait(30)
    time.sleep(0.2)
    for cursor in old:  # release_fn: cancel, then close
      cursor.cancel()
    for thread in threads:
      thread.join(10)
    for cursor in old:
      cursor.close()
    assert all(isinstance(outcomes.get(i), jax_data.PipelineReleasedError)
               for i in range(2))
    new = _cursors(loader, [0], layout)[0]
    thread = stalling.read("new", new, layout)
    thread.join(20)
    assert not thread.is_alive()
    assert sorted(outcomes["new"].reshape(-1).tolist()) != []
    new.close()
  finally:
    stalling.go_on.set()


def test_a_chain_dropped_unclosed_leaves_without_taking_a_lock():
  """A chain's rows dropped without close leave the shared reads from a
  finalizer, which the garbage collector runs wherever it runs, even
  inside the iterator closer's lock: it takes no lock, so that it cannot
  deadlock there; the reads notice at their next use."""
  import gc
  loader = TensorflowDataLoader(_pipeline(100), shuffle_cache=3)
  layout = loader.chunk_layout(1, 4)
  cursor, other = _cursors(loader, [0, 1], layout)
  _chunk_x(cursor, layout)
  _chunk_x(other, layout)
  shared = cursor._source._shared  # pylint: disable=protected-access
  closer = loader._closer  # pylint: disable=protected-access
  done = threading.Event()

  def drop():
    nonlocal cursor, other
    with closer._lock:  # pylint: disable=protected-access
      cursor = other = None
      gc.collect()
    done.set()

  thread = threading.Thread(target=drop, daemon=True)
  thread.start()
  assert done.wait(20), "deadlocked in the finalizer"
  assert shared.chains() == 0


class _Allocate:
  """An ``allocate`` of ``ChainCursor.produce_group``: fresh buffers,
  marked ``interleaved`` (rows batch by batch) or not."""

  def __init__(self, interleaved):
    self.interleaved = interleaved

  def __call__(self, shape, dtype):
    return np.full(shape, -1, dtype)


def _produce_together(cursors, layout, interleaved):
  chunks = type(cursors[0]).produce_group(cursors, [0] * len(cursors),
                                          layout, _Allocate(interleaved))
  return [[leaf.copy() for leaf in chunk.leaves] + [chunk.mask.copy()]
          for chunk in chunks]


def _produce_alone(cursor, layout):
  chunk = cursor.produce(0, layout.new_chunk())
  return [leaf.copy() for leaf in chunk.leaves] + [chunk.mask.copy()]


@pytest.mark.parametrize("seed", range(4))
def test_chains_produced_together_serve_the_chunks_each_would_alone(seed):
  """Groups of chains produced at once (one gather for all, laid out chain
  by chain or batch by batch as compiled code's buffers take them), with
  chains moved elsewhere or trimmed between, serve exactly the chunks of
  the same chains produced one by one, streamed or held in memory."""
  rng = np.random.default_rng(seed)
  n, chains = int(rng.integers(40, 400)), 6
  data = _pipeline(n)
  shuffle = int(rng.integers(1, 60))
  streamed = TensorflowDataLoader(data, shuffle_cache=shuffle)
  held = TensorflowDataLoader(data, shuffle_cache=shuffle, in_memory=True)
  layout = streamed.chunk_layout(int(rng.integers(1, 4)),
                                 int(rng.integers(1, 9)))
  together = {"streamed": _cursors(streamed, range(chains), layout),
              "held": _cursors(held, range(chains), layout)}
  references = _cursors(held, range(chains), layout)
  assert all(len({c.group_key() for c in cursors}) == 1
             for cursors in together.values())
  for _ in range(80):
    action = rng.random()
    if action < 0.1:  # a restore elsewhere
      c = int(rng.integers(chains))
      position = references[c].position()
      position["position"] = int(rng.integers(0, 3 * n))
      for cursors in list(together.values()) + [references]:
        cursors[c].seek(position)
    elif action < 0.15:
      together["streamed"][int(rng.integers(chains))].trim()
    else:
      group = np.flatnonzero(rng.random(chains) < 0.7).tolist() or [0, 1]
      expected = [_produce_alone(references[c], layout) for c in group]
      for cursors in together.values():
        got = _produce_together([cursors[c] for c in group], layout,
                                bool(rng.random() < 0.5))
        for chunk, reference in zip(got, expected):
          for leaf, want in zip(chunk, reference):
            np.testing.assert_array_equal(leaf, want)
  for cursors in together.values():
    for cursor in cursors:
      cursor.close()



@pytest.mark.parametrize("seed", range(3))
def test_buffers_split_together_split_as_each_alone(seed):
  """Chains stepped together split their buffers at their horizons (the
  elements whose rows they hold, and the least of the rest) in one array
  as each one's buffer alone is split, in element numbers past 2**32
  (buffers hold int32 numbers within a pass): also rows all or none of
  whose elements are before, and none of which are."""
  from jax_data.loaders import tensorflow_reads
  from jax_data.streams.sampling import Held
  from jax_data.streams.sampling import HeldRows
  rng = np.random.default_rng(seed)
  base = 3 * 2**32 + 5000  # the pass's first element
  local = rng.permutation(5000)[:300 * 7].reshape(300, 7).astype(np.int32)
  horizons = base + rng.integers(-10, 5100, 300)
  horizons[:3] = [base - 1, base + 5000, 0]  # none, all, none
  horizons[3] = base + int(local[3].min())  # none: the least is not before
  horizons[4] = base + 2**40  # all, far past the pass
  together = tensorflow_reads._split_all(HeldRows(local, base), horizons)
  alone = tensorflow_reads._split_all([Held(row, base) for row in local],
                                      horizons)
  for a, b in zip(together[:2], alone[:2]):
    assert a.dtype == b.dtype == np.int64
    np.testing.assert_array_equal(a, b)
  assert together[2] == alone[2]
  assert alone[2][0] == base + int(local[0].min()) and alone[2][1] is None
  kept, counts, _ = alone
  ends = np.cumsum(counts)
  for lane in (1, 4, 7):  # sorted, and what the definition keeps
    numbers = np.sort(local[lane].astype(np.int64) + base)
    np.testing.assert_array_equal(
        kept[ends[lane] - counts[lane]:ends[lane]],
        numbers[numbers < horizons[lane]])
  assert HeldRows(local, base).max_each().tolist() == [
      Held(row, base).max() for row in local]



def test_many_chains_hold_the_rows_of_few_of_their_buffers_elements():
  """64 chains of 400-slot shuffle buffers, in step: the window of shared
  reads holds the rows of their buffers' elements once for all, and each
  chain the rows of only the few elements older than the window may keep
  (64 x 400 rows before); their streams are those of chains held in
  memory."""
  chains, slots = 64, 400
  data = _pipeline(4000)
  streamed = TensorflowDataLoader(data, shuffle_cache=slots)
  held = TensorflowDataLoader(data, shuffle_cache=slots, in_memory=True)
  layout = streamed.chunk_layout(4, 8)
  cursors = _cursors(streamed, range(chains), layout)
  references = _cursors(held, range(chains), layout)
  most = 0
  for _ in range(100):  # 3,200 steps: many elements stayed long
    got = _produce_together(cursors, layout, interleaved=True)
    for chunk, reference in zip(got, references):
      np.testing.assert_array_equal(chunk[0],
                                    _produce_alone(reference, layout)[0])
    rows = sum(0 if c._source._held is None else c._source._held[0].size  # pylint: disable=protected-access
               for c in cursors)
    most = max(most, rows)
  assert all(c._source.reads_shared() for c in cursors)  # pylint: disable=protected-access
  assert 0 < most <= chains * slots // 10
  for cursor in cursors:
    cursor.close()


@pytest.mark.parametrize("together", [True, False])
@pytest.mark.parametrize("chains, slots, step", [(32, 10, 1000),
                                                 (16, 100, 1600)])
def test_chains_restored_together_mid_pass_read_it_once_between_them(
    together, chains, slots, step):
  """Chains restored to one place in a pass (a checkpoint of vmapped
  chains), produced together (as the host produces a vmapped request's
  chains): the pass up to there is read once for all of them, not once
  per chain. Each needs its shuffle buffer's elements from the oldest on;
  those beyond the shared window's reach (100 slots for 16 chains) are
  copied for it as the shared reads pass them. Produced one by one, the
  first reads the pass, and the chains whose oldest element its window no
  longer holds read it again by themselves; all serve their streams
  exactly."""
  counted = _Counted(3000)
  loader = TensorflowDataLoader(counted.pipeline, shuffle_cache=slots)
  held = _held(3000, slots)
  layout = loader.chunk_layout(2, 4)
  cursors = _cursors(loader, range(chains), layout)
  references = _cursors(held, range(chains), layout)
  for c in cursors + references:
    position = c.position()
    position["position"] = step // 4  # batches of 4
    c.seek(position)
  for _ in range(4):
    if together:
      got = [chunk[0] for chunk in _produce_together(cursors, layout, True)]
    else:
      got = [_chunk_x(cursor, layout) for cursor in cursors]
    for x, reference in zip(got, references):
      np.testing.assert_array_equal(x, _chunk_x(reference, layout))
  assert all(c._source.reads_shared() for c in cursors)  # pylint: disable=protected-access
  if together:  # once, and reads ahead
    assert counted.read <= step + slots + 4 * 8 + 6 * 8
  for cursor in cursors:
    cursor.close()


class _FailingOnce:
  """A pipeline over ``range(n)`` that counts the elements it yields and,
  once :attr:`armed`, fails at element ``at`` once."""

  def __init__(self, n, at):
    self.read, self.armed = 0, False
    lock = threading.Lock()

    def element(x):
      with lock:
        self.read += 1
        if self.armed and int(x) == at:
          self.armed = False
          raise ValueError("a transient failure")
      return x

    self.pipeline = tf.data.Dataset.range(n).map(
        lambda x: {"x": tf.ensure_shape(tf.py_function(element, [x], tf.int64),
                                        [])})


def test_chains_recover_from_a_failed_shared_read_reading_the_pass_once():
  """A read of the chains' shared iterator fails once, deep in a pass:
  the group's chunks fail, and then, produced chain by chain as the host
  does to name the chains whose rows fail, they serve their streams
  exactly, the pass up to there read once between them (not once a
  chain: their marks are within the window, which never shrinks)."""
  n, chains = 3000, 16
  failing = _FailingOnce(n, at=2020)  # read for the chunk after step 2,000
  loader = TensorflowDataLoader(failing.pipeline, shuffle_cache=10)
  held = _held(n, 10)
  layout = loader.chunk_layout(2, 4)
  cursors = _cursors(loader, range(chains), layout)
  references = _cursors(held, range(chains), layout)
  for _ in range(250):  # step 2,000
    _produce_together(cursors, layout, False)
    for reference in references:
      _produce_alone(reference, layout)
  failing.armed, before = True, failing.read
  with pytest.raises(Exception, match="a transient failure"):
    _produce_together(cursors, layout, False)
  for cursor, reference in zip(cursors, references):
    np.testing.assert_array_equal(_chunk_x(cursor, layout),
                                  _chunk_x(reference, layout))
  for _ in range(3):
    got = _produce_together(cursors, layout, False)
    for chunk, reference in zip(got, references):
      np.testing.assert_array_equal(chunk[0],
                                    _produce_alone(reference, layout)[0])
  assert all(c._source.reads_shared() for c in cursors)  # pylint: disable=protected-access
  assert failing.read - before <= 2020 + 4 * 8 + 10 * 8  # one replay
  for cursor in cursors:
    cursor.close()


def test_chains_left_when_most_close_go_on_reading_shared():
  """62 of 64 chains in step close: the window does not shrink under the
  two left, whose marks it set, so they go on reading the shared
  iterator, not the pass again by themselves."""
  counted = _Counted(3000)
  loader = TensorflowDataLoader(counted.pipeline, shuffle_cache=100)
  layout = loader.chunk_layout(2, 4)
  cursors = _cursors(loader, range(64), layout)
  for _ in range(100):
    _produce_together(cursors, layout, False)
  for cursor in cursors[2:]:
    cursor.close()
  before = counted.read
  for _ in range(10):
    _produce_together(cursors[:2], layout, False)
  assert all(c._source.reads_shared() for c in cursors[:2])  # pylint: disable=protected-access
  assert counted.read - before <= 10 * 8 + 4 * 8
  for cursor in cursors[:2]:
    cursor.close()


def test_a_checkpoint_of_vmapped_chains_restores_reading_the_pass_once():
  """16 vmapped chains of 200-slot buffers saved mid-pass
  (``state_to_pytree``) and restored into a new pipeline: their next
  batches are those the saved chains gave, and the pass up to there is
  read about once for all of them (each chain seeks to its chunk, whose
  position it computes, the buffers' oldest elements copied as the shared
  reads pass them), not once a chain."""
  n, chains = 3000, 16

  def pipeline(counted):
    return jax_data.random_reference_data(
        TensorflowDataLoader(counted.pipeline, shuffle_cache=200), 2, 4)

  first, second = _Counted(n), _Counted(n)
  saved_pipeline = pipeline(first)
  init_fn, batch_fn, release_fn = saved_pipeline
  step = jax.jit(jax.vmap(batch_fn))
  states = init_fn(seed=range(chains))
  for _ in range(250):  # step 1,000
    states, _ = step(states)
  saved = jax_data.state_to_pytree(saved_pipeline, states)
  expected = []
  for _ in range(5):
    states, batch = step(states)
    expected.append(np.asarray(batch["x"]))
  release_fn()
  restored_pipeline = pipeline(second)
  _, batch_fn, release_fn = restored_pipeline
  step = jax.jit(jax.vmap(batch_fn))
  states = jax_data.state_from_pytree(restored_pipeline, saved)
  for want in expected:
    states, batch = step(states)
    np.testing.assert_array_equal(np.asarray(batch["x"]), want)
  release_fn()
  assert second.read <= 1000 + 200 + 6 * 8 + 10 * 8


@pytest.mark.parametrize("in_memory", [False, True])
def test_vmapped_chains_replayed_together_warn_each_with_verify_calls(
    in_memory):
  """An old state of 4 vmapped chains used again: their chunks are
  produced again together (each cursor seeks back to its chunk), serve
  the batches they served then, and ``verify_calls`` warns once for each
  chain, as for a chain alone."""
  loader = TensorflowDataLoader(_pipeline(200), shuffle_cache=20,
                                in_memory=in_memory)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 1, 2, verify_calls=True)
  step = jax.jit(jax.vmap(batch_fn))
  states = init_fn(seed=range(4))
  for i in range(300):
    if i == 3:
      old = states
    states, batch = step(states)
    if i == 3:
      served = np.asarray(batch["x"])
  with pytest.warns(UserWarning, match="requested again") as caught:
    _, batch = step(old)
  np.testing.assert_array_equal(np.asarray(batch["x"]), served)
  assert len([w for w in caught if "requested again" in str(w.message)]) == 4
  release_fn()


def test_a_chunk_produced_ahead_after_a_request_moved_its_chain_does_not_warn():
  """``verify_calls`` warns for a chunk a request asks for again, not for
  one produced ahead by a job that ran after a request moved the chain
  back (no request asked for it): 4 chains warned 8 times, not 4, when
  their old state was used again while such a job was still queued. The
  chunk produced late is still the chain's own."""
  pipeline = jax_data.random_reference_data(
      TensorflowDataLoader(_pipeline(200), shuffle_cache=20), 1, 2,
      verify_calls=True)
  init_fn, batch_fn, release_fn = pipeline
  state = init_fn(seed=0)
  states = [state]
  for _ in range(6):
    state, _ = batch_fn(state)
    states.append(state)
  again = init_fn(seed=0)  # a second chain of the same stream
  for _ in range(10):
    again, expected = batch_fn(again)
  host = pipeline.host
  assert host.wait_idle()
  chain = int(state.chain)
  with pytest.warns(UserWarning, match="chunk 2 was requested again"):
    batch_fn(states[2])
  assert host.wait_idle()
  store = host._parts.store()  # pylint: disable=protected-access
  record = host.chain(chain)
  record.chunks.pop(9, None)  # produced again below, as by a late job
  with store._lock:  # pylint: disable=protected-access
    jobs = store._shelf.claim_ahead([record], [9])  # pylint: disable=protected-access
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    store._producer.produce_many(jobs)  # pylint: disable=protected-access
  np.testing.assert_array_equal(jobs[0][2].result().leaves[0].ravel(),
                                np.asarray(expected["x"]))
  with pytest.warns(UserWarning, match="chunk 2 was requested again"):
    batch_fn(states[2])  # a request still warns
  release_fn()


@pytest.mark.parametrize("in_memory", [False, True])
def test_chains_keep_one_snapshot_however_long_they_run(in_memory):
  """A chain through a shuffle buffer computes the position of any later
  chunk from its first (``ChainCursor.position_after``): 4 vmapped chains
  keep that one snapshot over 300 chunks, not some per doubling of age
  (70 each, 28 MiB for 1,024 chains, after 120 chunks), and a checkpoint
  taken at a chunk names that chunk, not an earlier one to replay from."""
  pipeline = jax_data.random_reference_data(
      TensorflowDataLoader(_pipeline(200), shuffle_cache=20,
                           in_memory=in_memory), 1, 2)
  init_fn, batch_fn, release_fn = pipeline
  step = jax.jit(jax.vmap(batch_fn))
  states = init_fn(seed=range(4))
  for _ in range(300):
    states, _ = step(states)
  for chain, chunk in zip(np.asarray(states.chain), np.asarray(states.chunk)):
    record = pipeline.host.chain(int(chain))
    assert list(record.snapshots) == [0]
    index, position = record.snapshot_before(int(chunk))
    assert index == int(chunk)
    assert position == {**record.snapshots[0], "position": int(chunk)}
  release_fn()


@pytest.mark.parametrize("in_memory", [False, True])
@pytest.mark.parametrize("scanned", [False, True])
def test_256_vmapped_chains_shuffled_together_serve_their_own_streams(
    in_memory, scanned, monkeypatch):
  """256 vmapped chains step their shuffle buffers together
  (``BufferShuffle.take_together``) over passes and a pass's drain: the
  batches are those of the same chains shuffled one by one, also where a
  vmapped ``jax_data.scan`` takes whole chunks with the lane axis second
  (rows laid out batch by batch)."""
  from jax_data.streams import sampling

  def served(together):
    if not together:
      monkeypatch.setattr(sampling.BufferShuffle, "_TOGETHER_FROM", 10**9)
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        TensorflowDataLoader(_pipeline(150), shuffle_cache=10,
                             in_memory=in_memory), 4, 2)
    states = init_fn(seed=range(256))
    if scanned:
      def run(state):
        (_, state), xs = jax_data.scan(lambda c, b: (c, b["x"]), 0, state,
                                       batch_fn=batch_fn, length=50)
        return state, xs

      step = jax.jit(jax.vmap(run))
      calls = 4
    else:
      step = jax.jit(jax.vmap(batch_fn))
      calls = 200  # 2.7 passes
    batches = []
    for _ in range(calls):
      states, batch = step(states)
      batches.append(np.asarray(batch if scanned else batch["x"]))
    release_fn()
    monkeypatch.undo()
    return np.concatenate(batches, axis=1) if scanned else np.stack(batches)

  np.testing.assert_array_equal(served(True), served(False))


_READS = {"in memory": {"in_memory": True}, "shared": {},
          "own": {"share_reads": False}}


@pytest.mark.parametrize("callback", ["auto", "pure"])
@pytest.mark.parametrize("reads", ["in memory", "shared"])
def test_chains_together_read_their_rows_when_served(callback, reads,
                                                     monkeypatch):
  """The chunks of chains produced together, in memory or through the
  shared reads, keep their rows' numbers until served (``Span.later``):
  a refresh of them all reads the rows straight into compiled code's
  buffers, not into the store's first; a chunk read on its own (asked for
  alone) reads the group's rows once. Both serve the chains' own streams:
  those of the same chains reading iterators of their own, which read
  their rows when they produce them. (Shared reads read rows now where a
  shuffle buffer holds an element older than their window: a small
  buffer here, so that none does.)"""
  from jax_data.loaders import chains
  read_rows = []
  read = chains.LaterRows.read
  monkeypatch.setattr(chains.LaterRows, "read",
                      lambda self, leaves: (read_rows.append(self._pending),  # pylint: disable=protected-access
                                            read(self, leaves))[1])

  def served(reads):
    pipeline = jax_data.random_reference_data(
        TensorflowDataLoader(_pipeline(150), shuffle_cache=4,
                             **_READS[reads]), 3, 2, callback=callback)
    init_fn, batch_fn, release_fn = pipeline
    states = init_fn(seed=range(6))
    step = jax.jit(jax.vmap(batch_fn))
    batches = []
    for _ in range(39):  # 13 whole chunks, past a pass
      states, batch = step(states)
      batches.append(np.asarray(batch["x"]))
    assert pipeline.host.wait_idle()
    # The chunks the next refresh asks for, produced ahead.
    alone = [np.asarray(pipeline.host.chunk(chain, chunk).leaves[0]).copy()
             for chain, chunk in zip(np.asarray(states.chain),
                                     np.asarray(states.chunk))]
    for _ in range(3):  # the chunks asked for alone
      states, batch = step(states)
      batches.append(np.asarray(batch["x"]))
    release_fn()
    return np.stack(batches), np.stack(alone)

  together, alone = served(reads)
  # The group's rows read once, for the first chunk asked for alone; the
  # refresh that serves them copies those rows (its seventh read).
  assert read_rows == [True] + [False] * 6
  read_rows.clear()
  own, _ = served("own")
  assert not read_rows
  np.testing.assert_array_equal(together, own)
  # The chunks asked for alone are those the next refresh served.
  np.testing.assert_array_equal(
      alone.reshape(6, -1),
      together[39:42].transpose(1, 0, 2).reshape(6, -1))


@pytest.mark.parametrize("reads", ["in memory", "shared"])
def test_chains_together_read_into_a_vmapped_scans_caches(reads):
  """A vmapped ``jax_data.scan`` takes whole chunks into buffers laid out
  with the lane axis second (batch by batch): the rows read there when
  served are the chains' own streams, those of the same chains reading
  iterators of their own."""
  def served(reads):
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        TensorflowDataLoader(_pipeline(150), shuffle_cache=10,
                             **_READS[reads]), 4, 2)

    def run(state):
      (_, state), xs = jax_data.scan(lambda c, b: (c, b["x"]), 0, state,
                                     batch_fn=batch_fn, length=40)
      return state, xs

    step = jax.jit(jax.vmap(run))
    states, out = init_fn(seed=range(8)), []
    for _ in range(3):
      states, xs = step(states)
      out.append(np.asarray(xs))
    release_fn()
    return np.concatenate(out, axis=1)

  np.testing.assert_array_equal(served(reads), served("own"))


@pytest.mark.parametrize("vmapped", [False, True])
def test_a_chunk_far_past_where_a_chain_reached_is_refused(vmapped):
  """A chain that seeks straight to its chunks (a shuffle buffer's) is held
  to ``max_replay`` as a replay is: a state 4 chunks past the furthest
  its chain reached is refused with max_replay=3 (a crafted counter would
  read an endless pipeline from its start), one 3 past is served."""
  from jax_data.loaders.host_loader import StoreLimits

  loader = TensorflowDataLoader(_pipeline(40), shuffle_cache=5)
  loader.store_limits = StoreLimits(max_replay=3)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 2, 3)
  step = jax.jit(jax.vmap(batch_fn) if vmapped else batch_fn)
  state = init_fn(seed=range(2) if vmapped else 1)
  with pytest.raises(Exception, match="4 chunks past the furthest it "
                     "reached .* more than the 3 a request may replay"):
    jax.block_until_ready(step(state._replace(chunk=state.chunk + 4)))
  _, batch = step(state._replace(chunk=state.chunk + 3))
  assert np.asarray(batch["x"]).size
  release_fn()


def test_the_next_chunk_is_never_past_max_replay():
  """With max_replay=0 (no replay allowed), an old state used again and
  then the newest one: the newest asks for the chunk after the furthest
  its chain produced, which it would produce next, and is served."""
  from jax_data.loaders.host_loader import StoreLimits

  loader = TensorflowDataLoader(_pipeline(40), shuffle_cache=5)
  loader.store_limits = StoreLimits(max_replay=0)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 2, 2)
  step = jax.jit(jax.vmap(batch_fn))
  states = init_fn(seed=range(4))
  for i in range(40):
    if i == 20:
      old = states
    states, _ = step(states)
  step(old)
  for _ in range(10):
    states, batch = step(states)
  assert np.asarray(batch["x"]).size
  release_fn()


@pytest.mark.parametrize("interleaved", [False, True])
def test_wanted_numbers_take_the_order_of_the_buffers_rows(interleaved):
  """``Wanted`` gives the chains' element numbers, offsets and row numbers
  in the order of a group's buffers (chain after chain, or batch by batch)
  and each position's chain; numbers within one pass (chains stepped
  together) give the same as int64 numbers."""
  from jax_data.loaders.tensorflow_rows import Wanted
  from jax_data.streams.sampling import HeldRows

  lanes, cache, mb, count = 3, 2, 4, 50
  base = 2 * count
  local = np.random.default_rng(0).integers(0, count, (lanes, cache * mb))
  numbers = local + base
  if interleaved:  # (batch, lane, row): every chain's batch j first
    order = numbers.reshape(lanes, cache, mb).swapaxes(0, 1).reshape(-1)
    lanes_at = np.broadcast_to(np.arange(lanes)[None, :, None],
                               (cache, lanes, mb)).reshape(-1)
  else:
    order = numbers.reshape(-1)
    lanes_at = np.repeat(np.arange(lanes), cache * mb)
  for given in (numbers, HeldRows(local.astype(np.int32), base)):
    wanted = Wanted(given, mb, interleaved)
    assert len(wanted) == lanes
    np.testing.assert_array_equal(wanted.numbers, numbers)
    np.testing.assert_array_equal(wanted.max_each(), numbers.max(axis=1))
    flat = wanted.flat(7)
    assert flat.dtype == np.int64
    np.testing.assert_array_equal(flat, order - 7)
    np.testing.assert_array_equal(wanted.rows(count), order % count)
    at = np.arange(order.size)
    np.testing.assert_array_equal(wanted.lane_of(at), lanes_at)
    flat[:] = -1  # a new array: the numbers stay
    np.testing.assert_array_equal(wanted.numbers, numbers)
