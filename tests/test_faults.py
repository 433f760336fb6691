"""Loader failures reach the user with context; nothing hangs or aborts."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest
from jax import lax

import jax_data
from jax_data import NumpyDataLoader
from jax_data import SourceDataLoader
from jax_data.serving import chain_records
from tests import scripts

# Tests that build pipelines with the `pipelines` fixture run with both ways
# chunks reach compiled code (conftest.py).


class FlakyLoader(NumpyDataLoader):
  """Fails on the ``fail_at``-th chunk of chain ``fail_chain`` (counting
  every call, a chunk tried again too), and with ``persistent`` on every
  one after."""

  def __init__(self, fail_chain, fail_at, persistent=False, **arrays):
    super().__init__(**arrays)
    self.fail_chain, self.fail_at = fail_chain, fail_at
    self.persistent = persistent
    self.served = {}

  def get_batches(self, chain_id):
    count = self.served.get(chain_id, 0)
    self.served[chain_id] = count + 1
    if chain_id == self.fail_chain and (
        count == self.fail_at or self.persistent and count > self.fail_at):
      raise RuntimeError("disk read failed")
    return super().get_batches(chain_id)


def _scan(batch_fn, steps):
  return jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                    length=steps))


class DownLoader(NumpyDataLoader):
  """Fails every chunk while ``down`` is set."""

  down = True

  def get_batches(self, chain_id):
    if self.down:
      raise OSError("transient disk error")
    return super().get_batches(chain_id)


def test_chunks_that_failed_ahead_are_tried_again_when_asked_for(pipelines):
  """Chunks produced ahead while the loader was failing, before anyone
  asked for them, are produced again when asked for once it recovered:
  every later step gets its exact batch, and none raises a stale error."""
  loader = DownLoader(x=np.arange(40))
  pipeline = pipelines.random_reference_data(loader, 2, 4)
  init_fn, batch_fn, _ = pipeline
  step = jax.jit(batch_fn)
  state = init_fn(seed=0)
  with pytest.raises(Exception, match="chunk 0: OSError: transient"):
    jax.block_until_ready(step(state))
  assert pipeline.host.wait_idle()  # the chunks ahead failed too
  loader.down = False
  init_plain, batch_plain, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(40)), 2, 4)
  plain = init_plain(seed=0)
  for k in range(8):
    state, batch = step(state)
    plain, expected = batch_plain(plain)
    np.testing.assert_array_equal(batch["x"], expected["x"], err_msg=str(k))


class GatedLoader(NumpyDataLoader):
  """Its second chunk (counting every call) waits for ``gate``, then
  fails: a read that began before the disk recovered."""

  def __init__(self, **arrays):
    super().__init__(**arrays)
    self.calls = 0
    self.entered, self.gate = threading.Event(), threading.Event()

  def get_batches(self, chain_id):
    self.calls += 1
    if self.calls == 2:
      self.entered.set()
      self.gate.wait(timeout=60)
      raise OSError("read began before the disk recovered")
    return super().get_batches(chain_id)


def test_a_chunk_whose_production_ahead_fails_once_asked_for_is_produced_again(
    pipelines, monkeypatch):
  """A request that finds its chunk being produced ahead waits for that
  production; if it fails, the request produces the chunk again rather than
  raise an error from a read that began before it came (CI saw the stale
  error once a loader had recovered)."""
  claimed = threading.Event()
  claim = chain_records.Shelf.claim

  def noting_claim(self, record, index, device_count):
    answer = claim(self, record, index, device_count)
    if index == 1:
      claimed.set()
    return answer

  monkeypatch.setattr(chain_records.Shelf, "claim", noting_claim)
  loader = GatedLoader(x=np.arange(40))
  init_fn, batch_fn, _ = pipelines.random_reference_data(loader, 2, 4)
  init_plain, batch_plain, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(40)), 2, 4)
  step, plain_step = jax.jit(batch_fn), jax.jit(batch_plain)
  state, plain = init_fn(seed=0), init_plain(seed=0)
  for _ in range(2):  # chunk 0
    state, batch = step(state)
    plain, expected = plain_step(plain)
    np.testing.assert_array_equal(batch["x"], expected["x"])
  assert loader.entered.wait(60)  # chunk 1 is being produced ahead
  answers = {}

  def ask():
    try:
      answers["batch"] = step(state)[1]
    except Exception as e:  # pylint: disable=broad-except
      answers["error"] = e

  thread = threading.Thread(target=ask)
  thread.start()
  assert claimed.wait(60)  # the request waits on that production
  loader.gate.set()
  thread.join(60)
  assert "error" not in answers, answers.get("error")
  _, expected = plain_step(plain)
  np.testing.assert_array_equal(answers["batch"]["x"], expected["x"])


def test_every_device_of_a_replicated_state_produces_a_failed_ahead_chunk_again(
    pipelines, monkeypatch):
  """Each device of a replicated state asks for the chunk; both requests
  found it being produced ahead, and neither raises the error of that
  production once it fails (the second used to)."""
  both_claimed, claims = threading.Event(), []
  claim = chain_records.Shelf.claim

  def noting_claim(self, record, index, device_count):
    answer = claim(self, record, index, device_count)
    if index == 1:
      claims.append(index)
      if len(claims) == 2:
        both_claimed.set()
    return answer

  monkeypatch.setattr(chain_records.Shelf, "claim", noting_claim)
  pipeline = pipelines.random_reference_data(GatedLoader(x=np.arange(40)), 2,
                                             4)
  plain = pipelines.random_reference_data(NumpyDataLoader(x=np.arange(40)),
                                          2, 4)
  chain, plain_chain = int(pipeline[0](seed=0).chain), int(
      plain[0](seed=0).chain)
  for _ in range(2):  # both devices take chunk 0; chunk 1 is produced ahead
    pipeline.host.chunk(chain, 0, device_count=2)
  assert pipeline.host.loader.entered.wait(60)
  answers = [None, None]

  def ask(device):
    try:
      answers[device] = pipeline.host.chunk(chain, 1, device_count=2)
    except Exception as e:  # pylint: disable=broad-except
      answers[device] = e

  threads = [threading.Thread(target=ask, args=(d,)) for d in range(2)]
  for thread in threads:
    thread.start()
  assert both_claimed.wait(60)  # both wait on that production
  pipeline.host.loader.gate.set()
  for thread in threads:
    thread.join(60)
  # Produced once more for both requests: neither is still awaited.
  assert pipeline.host.chain(chain).chunks[1].pending == 0
  expected = plain.host.chunk(plain_chain, 1)
  for answer in answers:
    assert not isinstance(answer, Exception), answer
    for got, want in zip(answer.leaves + [answer.mask],
                         expected.leaves + [expected.mask]):
      np.testing.assert_array_equal(got, want)


def _noting_claims_of(index, monkeypatch, fire=None):
  """An event set once ``Shelf.claim`` has claimed chunk ``index``; with
  ``fire``, ``fire(produce)`` runs after each such claim."""
  claimed = threading.Event()
  claim = chain_records.Shelf.claim

  def noting_claim(self, record, at, device_count):
    answer = claim(self, record, at, device_count)
    if at == index:
      claimed.set()
      if fire is not None:
        fire(answer[1])
    return answer

  monkeypatch.setattr(chain_records.Shelf, "claim", noting_claim)
  return claimed


def _waiting_on_a_production_ahead(monkeypatch):
  """A pipeline over a :class:`GatedLoader` whose chunk 1 is being produced
  ahead (waiting at the gate), and a thread whose request for chunk 1 waits
  on that production: ``(pipeline, loader, thread, answers)``, the
  request's chunk or error in ``answers``."""
  claimed = _noting_claims_of(1, monkeypatch)
  loader = GatedLoader(x=np.arange(40))
  pipeline = jax_data.random_reference_data(loader, 2, 4)
  chain = int(pipeline[0](seed=0).chain)
  pipeline.host.chunk(chain, 0)  # chunk 1 is produced ahead, at the gate
  assert loader.entered.wait(60)
  answers = {}

  def ask():
    try:
      answers["chunk"] = pipeline.host.chunk(chain, 1)
    except BaseException as e:  # pylint: disable=broad-except
      answers["error"] = e

  thread = threading.Thread(target=ask)
  thread.start()
  assert claimed.wait(60)  # the request waits on the production ahead
  return pipeline, loader, thread, answers


def test_release_reaches_a_request_waiting_on_a_production_ahead(monkeypatch):
  """A request waits on a chunk being produced ahead, and the pipeline is
  released: the request raises the release's error (the exit hook's, when
  the interpreter exits), not one of its own from producing the chunk
  again on a released chain."""
  pipeline, loader, thread, answers = _waiting_on_a_production_ahead(
      monkeypatch)
  error = jax_data.PipelineReleasedError("the release's own error")
  pipeline.host.release(error)
  thread.join(60)
  loader.gate.set()
  assert not thread.is_alive()
  assert answers.get("error") is error, answers


def test_release_after_a_production_ahead_failed_is_the_answer(monkeypatch):
  """The production ahead a request waits on fails, and the pipeline is
  released before the request produces the chunk again: the request
  raises the release's error, not the stale one of that production."""
  from jax_data.serving import chunk_store
  pipeline, loader, thread, answers = _waiting_on_a_production_ahead(
      monkeypatch)
  error = jax_data.PipelineReleasedError("the release's own error")
  again = chunk_store.ChainStore._claim_again

  def released_first(self, *args):
    pipeline.host.release(error)
    return again(self, *args)

  monkeypatch.setattr(chunk_store.ChainStore, "_claim_again", released_first)
  loader.gate.set()  # the production ahead fails
  thread.join(60)
  assert not thread.is_alive()
  assert answers.get("error") is error, answers


def test_ctrl_c_inside_the_claim_of_a_chunk_produced_again_leaves_it_usable(
    monkeypatch):
  """Ctrl-C lands inside the claim by which a request produces again a
  chunk whose production ahead failed: the chunk is not left on the shelf
  unanswered (the next request waited for it forever), and the next
  request gets the chunk a plain loader gives."""
  armed = [False]

  def fire(produce):
    if produce and armed[0]:  # the claim anew, which produces
      armed[0] = False
      raise KeyboardInterrupt

  claimed = _noting_claims_of(1, monkeypatch, fire)
  loader = GatedLoader(x=np.arange(40))
  pipeline = jax_data.random_reference_data(loader, 2, 4)
  chain = int(pipeline[0](seed=0).chain)
  pipeline.host.chunk(chain, 0)
  assert loader.entered.wait(60)  # chunk 1 is being produced ahead
  answers = {}

  def ask(key):
    try:
      answers[key] = pipeline.host.chunk(chain, 1)
    except BaseException as e:  # pylint: disable=broad-except
      answers[key] = e

  armed[0] = True
  first = threading.Thread(target=ask, args=("first",), daemon=True)
  first.start()
  assert claimed.wait(60)  # it joined the production ahead
  loader.gate.set()  # which fails; the request claims chunk 1 anew
  first.join(60)
  assert isinstance(answers.get("first"), KeyboardInterrupt), answers
  second = threading.Thread(target=ask, args=("second",), daemon=True)
  second.start()
  second.join(60)
  assert "second" in answers, "the request after the interrupt never ended"
  plain = jax_data.random_reference_data(NumpyDataLoader(x=np.arange(40)), 2,
                                         4)
  want = plain.host.chunk(int(plain[0](seed=0).chain), 1)
  for got, expected in zip(answers["second"].leaves + [answers["second"].mask],
                           want.leaves + [want.mask]):
    np.testing.assert_array_equal(got, expected)
  pipeline[2]()
  plain[2]()


def test_release_while_a_cursor_is_trimmed_closes_it(monkeypatch):
  """``release_fn`` runs while the prefetch thread trims a chain's cursor
  (which holds the chain while it drops what it keeps): the cursor is
  closed once the trim is done, as one that was producing is (a cursor
  left open kept its loader's workers)."""
  from jax_data.host_loader import StoreLimits
  from jax_data.loaders import indexed
  entered, gate = threading.Event(), threading.Event()
  closed = []
  trim, close = indexed.IndexedCursor.trim, indexed.IndexedCursor.close

  def gated_trim(cursor):
    if not entered.is_set():
      entered.set()
      gate.wait(60)
    return trim(cursor)

  def noting_close(cursor):
    closed.append(cursor)
    return close(cursor)

  monkeypatch.setattr(indexed.IndexedCursor, "trim", gated_trim)
  monkeypatch.setattr(indexed.IndexedCursor, "close", noting_close)
  loader = NumpyDataLoader(x=np.arange(20_000, dtype=np.float32))
  loader.store_limits = StoreLimits(store_bytes=1 << 20)
  init_fn, batch_fn, release_fn = pipeline = jax_data.random_reference_data(
      loader, 4, 32)
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=8))
  records = []
  for epoch in range(40):  # until the store trims a chain's cursor
    state = run(init_fn(seed=epoch, shuffle=True))[0]
    records.append(pipeline.host.chain(int(state.chain)))
    pipeline.host.wait_idle(1.0)
    if entered.is_set():
      break
  assert entered.is_set()  # a trim is running, holding its chain
  release_fn()
  gate.set()
  assert pipeline.host.wait_idle(30)
  assert [r.number for r in records if not r.closed] == []
  assert len(closed) == len(records)


def test_failure_names_loader_chain_and_error_and_other_chains_work(pipelines):
  loader = FlakyLoader(fail_chain=1, fail_at=2, persistent=True,
                       x=np.arange(20))
  init_fn, batch_fn, _ = pipelines.random_reference_data(loader, 2, 3)
  healthy, failing = init_fn(seed=0), init_fn(seed=1)
  run = _scan(batch_fn, 10)
  with pytest.raises(Exception) as info:
    jax.block_until_ready(run(failing))
  message = str(info.value)
  assert "FlakyLoader(x; 20 observations), chain 1, chunk 2" in message
  assert "RuntimeError: disk read failed" in message
  # Other chains keep working, and so does the failed chain once its loader
  # recovers (a later request tries again).
  _, batches = run(healthy)
  assert batches["x"].shape == (10, 3)
  loader.fail_chain = None
  _, again = run(failing)
  assert again["x"].shape == (10, 3)


class BrokenHostLoader(jax_data.HostDataLoader):
  """A user-defined host loader whose get_batches always raises."""

  def __init__(self):
    self._chains = 0

  def __repr__(self):
    return "BrokenHostLoader()"

  @property
  def static_information(self):
    return {"observation_count": 8}

  @property
  def observation_format(self):
    return {"x": jax.ShapeDtypeStruct((), np.float32)}

  def register_random_pipeline(self, cache_size=1, mb_size=None, **kwargs):
    self._chains += 1
    return self._chains - 1

  register_ordered_pipeline = register_random_pipeline

  def get_batches(self, chain_id):
    raise ValueError("cannot decode record 3")

  def save_state(self, chain_id):
    return {}

  def load_state(self, chain_id, data):
    pass


def test_user_defined_loader_failure(pipelines):
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      BrokenHostLoader(), 2, 2)
  with pytest.raises(Exception, match=r"BrokenHostLoader\(\), chain 0, "
                     r"chunk 0: ValueError: cannot decode record 3"):
    jax.block_until_ready(_scan(batch_fn, 3)(init_fn()))
  mapper_fn, _ = pipelines.full_data_mapper(BrokenHostLoader(), 2, 2)
  with pytest.raises(Exception, match="ValueError: cannot decode record 3"):
    jax.block_until_ready(mapper_fn(lambda b, c: (b["x"], c), None))


def test_truncated_memmap_raises_instead_of_crashing(tmp_path, pipelines):
  path = tmp_path / "x.npy"
  data = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                   shape=(1000, 4))
  data[:] = 1.0
  data.flush()
  del data
  loader = NumpyDataLoader(copy=False, x=np.load(path, mmap_mode="r"))
  mapper_fn, _ = pipelines.full_data_mapper(loader, 2, 100)
  total, _ = mapper_fn(lambda b, m, c: ((b["x"].sum(1) * m).sum(), c), None,
                       masking=True)
  assert float(total.sum()) == 4000.0
  with open(path, "r+b") as f:
    f.truncate(1000)
  with pytest.raises(Exception, match="OSError: the file of array 'x'.*was "
                     "truncated to 1000 bytes"):
    jax.block_until_ready(mapper_fn(lambda b, c: (b["x"], c), None))


@pytest.mark.parametrize("loader_type", [NumpyDataLoader,
                                         jax_data.DeviceNumpyDataLoader])
@pytest.mark.parametrize("copy", [True, False])
def test_a_memmap_truncated_before_the_loader_is_made_raises(
    tmp_path, loader_type, copy):
  """Copied into memory or read later, a memmap whose file no longer holds
  its rows is an OSError naming the array, not SIGBUS."""
  path = tmp_path / "x.npy"
  np.save(path, np.ones((1000, 4), np.float32))
  data = np.load(path, mmap_mode="r")
  with open(path, "r+b") as f:
    f.truncate(1000)
  with pytest.raises(OSError, match=r"the file of array 'x' \(.*x.npy\) was "
                     "truncated to 1000 bytes; the memmap needs 16128"):
    loader_type(copy=copy, x=data)


def test_a_device_loader_does_not_keep_a_memmaps_file(tmp_path):
  """The device's copy of a memmap (a CPU device's memory is the host's)
  is its own: the file may shrink, or go, once the loader is made."""
  path = tmp_path / "x.bin"
  data = np.memmap(path, np.float32, "w+", shape=(4096, 4))  # page-aligned
  data[:] = np.arange(4096, dtype=np.float32)[:, None]
  data.flush()
  loader = jax_data.DeviceNumpyDataLoader(copy=False, x=data)
  with open(path, "r+b") as f:
    f.truncate(0)
  del data
  loader.content_digest()  # reads the device's rows
  mapper_fn, _ = jax_data.full_data_mapper(loader, 1, 1024)
  rows, _ = mapper_fn(lambda batch, carry: (batch["x"][:, 0], carry), None)
  np.testing.assert_array_equal(rows, np.arange(4096))


def test_a_memmap_truncated_after_its_chunk_was_read_names_the_chain(
    tmp_path, pipelines):
  """A chunk read ahead whose memmap was truncated before it is served
  fails its check then, named as a failure to produce it is."""
  path = tmp_path / "x.npy"
  np.save(path, np.ones((1000, 4), np.float32))
  loader = NumpyDataLoader(copy=False, x=np.load(path, mmap_mode="r"))
  init_fn, batch_fn, _ = pipelines.random_reference_data(loader, 2, 100)
  step = jax.jit(batch_fn)
  state, _ = step(init_fn(seed=0))
  assert init_fn.__self__.host.wait_idle()  # the next chunks read ahead
  with open(path, "r+b") as f:
    f.truncate(1000)
  with pytest.raises(Exception, match=re.escape(
      f"{loader!r}, chain 0, chunk 1: OSError: the file of array 'x'")):
    for _ in range(2):  # the second batch of chunk 0, then chunk 1
      state, batch = step(state)
      jax.block_until_ready(batch)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_source_over_a_truncated_memmap_raises_instead_of_crashing(
    tmp_path, pipelines, workers):
  """A SourceDataLoader whose source is a memmap checks its file before
  each read, as NumpyDataLoader does."""
  path = tmp_path / "x.npy"
  np.save(path, np.ones((1000, 4), np.float32))
  loader = SourceDataLoader(np.load(path, mmap_mode="r"), workers=workers)
  init_fn, batch_fn, _ = pipelines.random_reference_data(loader, 2, 100)
  step = jax.jit(batch_fn)
  state, batch = step(init_fn(seed=0))
  assert float(batch.sum()) == 400.0
  assert init_fn.__self__.host.wait_idle()  # no read in flight
  with open(path, "r+b") as f:
    f.truncate(1000)
  with pytest.raises(Exception, match=r"OSError: the file of the source \(.*"
                     r"x.npy\) was truncated to 1000 bytes; the memmap "
                     "needs 16128"):
    for _ in range(50):  # past the chunks read ahead before
      state, batch = step(state)
      jax.block_until_ready(batch)


_FOUR_DEVICES = textwrap.dedent("""
    import os, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    import jax_data
    from tests.test_faults import FlakyLoader

    loader = FlakyLoader(fail_chain=2, fail_at=1, persistent=True,
                         x=np.arange(50.0))
    init_fn, batch_fn, _ = jax_data.random_reference_data(
        loader, 2, 3, callback=CALLBACK)
    states = jax.tree_util.tree_map(lambda *x: jnp.stack(x),
                                    *[init_fn(seed=i) for i in range(4)])

    def per_device(state):
      def body(state, _):
        state, batch = batch_fn(state)
        return state, lax.psum(batch["x"].sum(), "d")
      return lax.scan(body, state, None, length=6)

    start = time.time()
    try:
      jax.block_until_ready(jax.pmap(per_device, axis_name="d")(states))
      print("NO ERROR")
    except Exception as e:
      print("RAISED in %.1f s" % (time.time() - start))
      print(str(e).splitlines()[-1][:300])
    # The process still works, and so do the other chains.
    healthy = jax.tree_util.tree_map(lambda *x: jnp.stack(x),
                                     *[init_fn(seed=i) for i in range(4)])
    loader.fail_chain = None
    out = jax.block_until_ready(jax.pmap(per_device, axis_name="d")(healthy))
    print("AFTER", out[1].shape)
    """)


def test_failure_on_one_of_four_devices_before_a_collective(pipelines):
  """Every device raises together, so none waits forever in the psum."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2")
  script = _FOUR_DEVICES.replace("CALLBACK", repr(pipelines.callback))
  done = subprocess.run([sys.executable, "-c", script], cwd=root,
                        env=env, capture_output=True, text=True, timeout=180)
  output = done.stdout + done.stderr[-3000:]
  assert done.returncode == 0, output
  assert "RAISED in" in done.stdout, output
  assert "chain 2, chunk 1: RuntimeError: disk read failed" in done.stdout, (
      output)
  assert "AFTER (4, 6)" in done.stdout, output


def test_tf_data_map_that_raises(pipelines):
  tf = pytest.importorskip("tensorflow")
  from jax_data.tensorflow_loader import TensorflowDataLoader

  def check(element):
    tf.debugging.assert_none_equal(element["x"], tf.constant(13, tf.int64),
                                   message="corrupt record")
    return element

  pipeline = tf.data.Dataset.from_tensor_slices(
      {"x": np.arange(20, dtype=np.int64)}).map(check)
  mapper_fn, _ = pipelines.full_data_mapper(TensorflowDataLoader(pipeline),
                                           2, 4)
  with pytest.raises(Exception) as info:
    jax.block_until_ready(mapper_fn(lambda b, c: (b["x"], c), None))
  message = str(info.value)
  assert "TensorflowDataLoader" in message and "chain 0" in message
  assert "InvalidArgumentError" in message and "corrupt record" in message
  # The process and other loaders keep working.
  healthy, _ = pipelines.full_data_mapper(
      TensorflowDataLoader(tf.data.Dataset.from_tensor_slices(
          {"x": np.arange(20, dtype=np.int64)})), 2, 4)
  values, _ = healthy(lambda b, c: (b["x"], c), None)
  assert values.tolist() == list(range(20))


class SlowLoader(NumpyDataLoader):
  """The chain with seed 99 waits for ``gate`` before each chunk after the
  first."""

  def __init__(self, **arrays):
    super().__init__(**arrays)
    self.gate = threading.Event()
    self.started = threading.Event()  # a slow production began

  def open_chain(self, spec, layout):
    cursor = super().open_chain(spec, layout)
    if getattr(spec, "seed", None) == 99:
      produce = cursor.produce

      def slow(index, out):
        if index > 0:
          self.started.set()
          self.gate.wait(60)
        return produce(index, out)

      cursor.produce = slow
    return cursor


def test_release_answers_every_waiting_request():
  loader = SlowLoader(x=np.arange(100))
  pipeline = jax_data.random_reference_data(loader, 2, 3)
  init_fn, _, release_fn = pipeline
  host = pipeline.host
  slow, fast = int(init_fn(seed=99).chain), int(init_fn(seed=1).chain)
  host.chunk(slow, 0)  # the prefetch thread now waits in slow's chunk 1
  # (wait until it does: a request finding the chunk still queued would
  # produce it itself, and wait in it)
  assert loader.started.wait(30)
  host.chunk(fast, 0)  # fast's chunk 1 is queued behind it
  # A request for the queued chunk does not wait behind the slow one.
  served = threading.Thread(target=host.chunk, args=(fast, 1))
  served.start()
  served.join(30)
  assert not served.is_alive()
  results = {}

  def wait_for_slow():
    try:
      host.chunk(slow, 1)
      results["slow"] = "served"
    except Exception as e:  # pylint: disable=broad-except
      results["slow"] = e

  waiter = threading.Thread(target=wait_for_slow)
  waiter.start()
  time.sleep(0.2)  # it waits on the running production (or, if later,
  # it finds the pipeline released: the same answer)
  release_fn()  # answers the waiter at once, the slow chunk still running
  waiter.join(30)
  assert not waiter.is_alive()
  assert isinstance(results["slow"], jax_data.PipelineReleasedError)
  loader.gate.set()  # the production ends; the prefetch thread with it


_EXIT_IN_FLIGHT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    import jax_data
    from tests.test_faults import FlakyLoader

    loader = FlakyLoader(fail_chain=0, fail_at=1, persistent=True,
                         x=np.arange(1000.0))
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, 2, 8, callback=CALLBACK)
    stack = lambda states: jax.tree_util.tree_map(
        lambda *x: jnp.stack(x), *states)

    def per_device(state):
      def body(state, _):
        state, batch = batch_fn(state)
        return state, lax.psum(batch["x"].sum(), "d")
      return lax.scan(body, state, None, length=1000)

    run = jax.pmap(per_device, axis_name="d")
    try:  # chain 0 fails at its chunk 1
      jax.block_until_ready(run(stack([init_fn(seed=i) for i in range(4)])))
    except Exception:
      print("failed as planned")
    KEEP run(stack([init_fn(seed=i) for i in range(4, 8)]))  # not waited
    if RELEASE:
      release_fn()
    print("exiting", flush=True)
    """)


_EXIT_WITH_A_DAEMON_LOOP = textwrap.dedent("""
    import threading, time
    import jax, numpy as np
    from jax import lax
    import jax_data

    init_fn, batch_fn, _ = jax_data.random_reference_data(
        jax_data.NumpyDataLoader(x=np.arange(100.0)), 2, 4)
    run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                     length=4))

    serving = threading.Event()

    def loop():
      state = init_fn(seed=0)
      while True:
        state, _ = jax.block_until_ready(run(state))
        serving.set()

    threading.Thread(target=loop, daemon=True).start()
    # The loop calls the pipeline when the main thread ends (compiling it
    # took more than a second on a loaded machine: the exit then came
    # before any request, which is another case).
    serving.wait()
    time.sleep(1)
    print("main thread done", flush=True)
    """)


def test_exit_with_a_daemon_thread_still_calling_ends():
  """A daemon thread whose loop keeps calling a pipeline never lets the
  exit hook see a pause; the process waited for one forever. Now requests
  are refused after a few seconds and the process exits."""
  done = scripts.run(_EXIT_WITH_A_DAEMON_LOOP)
  scripts.assert_ended_cleanly(done)
  # The loop ends with the refusal, which names the exit.
  assert "the Python interpreter is exiting" in done.stderr


class InterruptedOnce(NumpyDataLoader):
  """Raises KeyboardInterrupt (Ctrl-C landing in a read) once."""

  interrupted = False

  def get_batches(self, chain_id):
    if not self.interrupted:
      self.interrupted = True
      raise KeyboardInterrupt
    return super().get_batches(chain_id)


@pytest.mark.parametrize("where", ["claim", "settle", "read"])
def test_ctrl_c_inside_a_request_leaves_the_chain_usable(where, monkeypatch):
  """Ctrl-C landing between a request's claim of a chunk and its answer
  (inside the claim, or as the answer was set) left an unanswered chunk
  on the shelf: the next request with the same state waited for it
  forever. Landing in a read, it was reported as a loader failure. Now
  the same state gives the batch an uninterrupted chain gives."""
  from jax_data.serving import chain_records
  from jax_data.serving import production
  armed = [where != "read"]

  def fire():
    if armed[0]:
      armed[0] = False
      raise KeyboardInterrupt

  if where == "claim":
    claim = chain_records.Shelf.claim

    def claim_then_fire(self, *args):
      out = claim(self, *args)
      if out[1]:
        fire()
      return out

    monkeypatch.setattr(chain_records.Shelf, "claim", claim_then_fire)
  elif where == "settle":
    settle = production.settle

    def fire_then_settle(future, result=None, error=None):
      if error is None:
        fire()
      return settle(future, result, error)

    monkeypatch.setattr(production, "settle", fire_then_settle)
  make = InterruptedOnce if where == "read" else NumpyDataLoader
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      make(x=np.arange(1000.0)), 2, 4)
  state = init_fn(seed=0)
  with pytest.raises(BaseException) as info:
    batch_fn(state)
  assert "KeyboardInterrupt" in f"{info.type.__name__}: {info.value}"
  assert "HostLoaderError" not in str(info.value)
  got = []
  retry = threading.Thread(target=lambda: got.append(batch_fn(state)[1]),
                           daemon=True)
  retry.start()
  retry.join(60)
  assert got, "the request after the interrupt did not end"
  want_init, want_batch, want_release = jax_data.random_reference_data(
      NumpyDataLoader(x=np.arange(1000.0)), 2, 4)
  assert got[0]["x"].tolist() == want_batch(want_init(seed=0))[1]["x"].tolist()
  release_fn()
  want_release()


def test_ctrl_c_twice_while_the_exit_hook_waits_does_not_abort():
  """Ctrl-C ends the main thread while a daemon thread's loop calls a
  pipeline, and Ctrl-C again while the exit hook waits: the second one
  skipped the refusal of requests, and the loop's next callback during
  finalization aborted the process (SIGABRT), 8 of 8 times."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2")
  # Ctrl-C raises KeyboardInterrupt in the child also where this process
  # ignores SIGINT, which children inherit (a job started in the
  # background by a non-interactive shell, as CI may be).
  script = ("import signal\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            + _EXIT_WITH_A_DAEMON_LOOP.replace(
                'print("main thread done", flush=True)',
                'print("main thread done", flush=True)\n'
                'while True:\n  time.sleep(0.1)'))
  child = subprocess.Popen([sys.executable, "-c", script], cwd=root, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
  try:
    assert child.stdout.readline().strip() == "main thread done"
    child.send_signal(signal.SIGINT)  # the main thread ends
    time.sleep(1.5)
    child.send_signal(signal.SIGINT)  # while the exit hook waits
    _, stderr = child.communicate(timeout=120)
  finally:
    child.kill()
  # Ended by the first SIGINT (-2), as Python ends after KeyboardInterrupt.
  assert child.returncode == -signal.SIGINT, stderr[-3000:]
  for sign in ("terminate called", "Fatal Python error", "Aborted"):
    assert sign not in stderr, stderr[-3000:]


@pytest.mark.parametrize("run", range(10))
def test_exit_with_work_in_flight_is_clean(run):
  """Ten exits of a process whose pmapped scan still draws from jax_data
  (after a loader failure, on both callback paths, its outputs kept or
  dropped, with and without a release): no abort, no traceback at exit."""
  callback, keep, release = [
      ("auto", True, False), ("pure", True, False), ("auto", False, False),
      ("pure", False, False), ("auto", True, True), ("pure", False, True),
  ][run % 6]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2")
  script = _EXIT_IN_FLIGHT.replace("CALLBACK", repr(callback)).replace(
      "RELEASE", str(release)).replace("KEEP ", "out = " if keep else "")
  done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "failed as planned" in done.stdout and "exiting" in done.stdout
  for sign in ("Exception ignored", "terminate called", "PyGILState",
               "Fatal Python error", "Aborted"):
    assert sign not in done.stderr, done.stderr[-3000:]


_SHRUNK_VIEW = textwrap.dedent("""
    import sys
    import jax, numpy as np
    import jax_data
    path, view = sys.argv[1], sys.argv[2]
    np.save(path, np.ones((100_000, 4), np.float32))
    mm = np.load(path, mmap_mode="r")
    array = {"slice": mm[50_000:], "strided": mm[::2],
             "reversed": mm[::-1]}[view]
    loader = jax_data.NumpyDataLoader(copy=False, x=array)
    mapper_fn, _ = jax_data.full_data_mapper(loader, 2, 1000)
    total = lambda: float(mapper_fn(
        lambda b, m, c: ((b["x"].sum(1) * m).sum(), c), None,
        masking=True)[0].sum())
    assert total() == 4 * len(array)
    with open(path, "r+b") as f:
      f.truncate(128 + 75_000 * 16)  # three quarters of the rows remain
    try:
      total()
      print("read past the end")
    except Exception as e:
      print(str(e).splitlines()[-1])
    """)


@pytest.mark.parametrize("view", ["slice", "strided", "reversed"])
def test_memmap_view_whose_file_shrank_raises(tmp_path, view):
  """In a subprocess: reading past the file's end would be SIGBUS."""
  done = subprocess.run(
      [sys.executable, "-c", _SHRUNK_VIEW, str(tmp_path / "x.npy"), view],
      capture_output=True, text=True, timeout=180,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "OSError: the file of array 'x'" in done.stdout, done.stdout
  assert "was truncated to 1200128 bytes" in done.stdout, done.stdout


@pytest.mark.parametrize("change", ["unlink", "replace"])
def test_memmap_keeps_working_when_its_path_changes(tmp_path, change):
  path = tmp_path / "x.npy"
  np.save(path, np.arange(4000.0).reshape(1000, 4))
  loader = NumpyDataLoader(copy=False, x=np.load(path, mmap_mode="r"))
  mapper_fn, _ = jax_data.full_data_mapper(loader, 2, 100)
  total = lambda: float(mapper_fn(
      lambda b, m, c: ((b["x"].sum(1) * m).sum(), c), None,
      masking=True)[0].sum())
  before = total()
  os.unlink(path)
  if change == "replace":
    np.save(path, np.zeros((10, 4)))  # a shorter file at the same path
  assert total() == before == sum(range(4000))


class WrongDtypeLoader(BrokenHostLoader):
  """Says float32, serves float64."""

  def get_batches(self, chain_id):
    return {"x": np.zeros((2, 2), np.float64)}, None


def test_a_custom_loader_of_the_wrong_dtype_is_an_error_not_a_cast():
  init_fn, batch_fn, _ = jax_data.random_reference_data(
      WrongDtypeLoader(), 2, 2)
  with pytest.raises(Exception, match=r"get_batches returned an array of "
                     r"shape \(2, 2\) and dtype float64, expected shape "
                     r"\(2, 2\) .* and dtype float32"):
    jax.block_until_ready(_scan(batch_fn, 3)(init_fn()))


class WrongStructureLoader(BrokenHostLoader):
  """Says {"x", "y"}, serves arrays of the right shapes and dtypes under
  other keys, or as a tuple."""

  def __init__(self, batches):
    super().__init__()
    self._batches = batches

  @property
  def observation_format(self):
    return {"x": jax.ShapeDtypeStruct((), np.float32),
            "y": jax.ShapeDtypeStruct((), np.float32)}

  def get_batches(self, chain_id):
    return self._batches, None


@pytest.mark.parametrize("batches", [
    {"x_obs": np.zeros((2, 2), np.float32), "w": np.ones((2, 2), np.float32)},
    (np.zeros((2, 2), np.float32), np.ones((2, 2), np.float32))])
def test_a_custom_loader_of_the_wrong_structure_is_an_error(batches):
  """Leaves of the right count, shapes and dtypes under other keys were
  served by leaf order, as other features; the message names both
  structures."""
  init_fn, batch_fn, _ = jax_data.random_reference_data(
      WrongStructureLoader(batches), 2, 2)
  got = jax.tree_util.tree_structure(batches)
  with pytest.raises(Exception, match=re.escape(
      f"get_batches returned batches of structure {got}, expected "
      "PyTreeDef({'x': *, 'y': *}) as in the loader's observation_format")):
    jax.block_until_ready(_scan(batch_fn, 3)(init_fn()))
