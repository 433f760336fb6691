"""random_reference_data inside compiled code: streams, values, release."""

import gc
import re
import threading
import time
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest
from jax import lax

import jax_data
from jax_data import NumpyDataLoader
from jax_data.host_loader import StoreLimits
from jax_data.streams import counter_streams as cs
from tests import calls

# Tests that build pipelines with the `pipelines` fixture run with both ways
# chunks reach compiled code (conftest.py).

MODES = [dict(), dict(shuffle=True), dict(shuffle=True, in_epochs=True)]


def _expected_stream(n, cache, mb, steps, **chain_kwargs):
  """The chain's batches straight from a loader, without the bridge."""
  loader = NumpyDataLoader(x=np.arange(n))
  chain = loader.register_random_pipeline(cache, mb, **chain_kwargs)
  rows, masks = [], []
  while len(rows) < steps:
    batches, mask = loader.get_batches(chain)
    rows.extend(batches["x"].tolist())
    masks.extend(mask.tolist())
  return rows[:steps], masks[:steps]


def _scan(batch_fn, steps):
  @jax.jit
  def run(state):
    def body(state, _):
      state, (batch, info) = batch_fn(state, information=True)
      return state, (batch["x"], info.mask)
    return lax.scan(body, state, None, length=steps)
  return run


@pytest.mark.parametrize("mode", MODES)
def test_jit_scan_and_eager_give_the_loader_stream(mode, pipelines):
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(13)), 3, 4)
  expected = _expected_stream(13, 3, 4, 20, seed=5, **mode)
  state, (x, mask) = _scan(batch_fn, 20)(init_fn(seed=5, **mode))
  assert (x.tolist(), mask.tolist()) == expected
  eager = init_fn(seed=5, **mode)
  rows = []
  for _ in range(20):
    eager, batch = batch_fn(eager)
    rows.append(batch["x"].tolist())
  assert rows == expected[0]
  release_fn()


def test_guide_batches(pipelines):
  loader = NumpyDataLoader(x_r=np.arange(10), y_r=np.zeros((10, 2)))
  with pytest.warns(UserWarning, match="more than the 5 that hold all 10"):
    init_fn, batch_fn, _ = pipelines.random_reference_data(loader, 100, 2)
  _, (batch, info) = batch_fn(init_fn(seed=0), information=True)
  assert batch["x_r"].tolist() == [8, 9]
  assert repr(info) == ("MiniBatchInformation(observation_count=10, "
                        "mask=Array([ True,  True], dtype=bool), batch_size=2)")


def test_same_state_twice_gives_same_batches_and_stream_continues(pipelines):
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(50)), 4, 3)
  expected, _ = _expected_stream(50, 4, 3, 30, seed=2, shuffle=True)
  run = _scan(batch_fn, 10)
  start = init_fn(seed=2, shuffle=True)
  s1, (first, _) = run(start)
  s2, (again, _) = run(start)  # the same initial state: the same batches
  assert first.tolist() == again.tolist() == expected[:10]
  _, (after, _) = run(s1)  # and the stream continues where it was
  assert after.tolist() == expected[10:20]
  _, (after2, _) = run(s2)
  assert after2.tolist() == expected[10:20]
  _, b1 = batch_fn(s1)
  _, b2 = batch_fn(s1)
  assert b1["x"].tolist() == b2["x"].tolist() == expected[10]


def test_repeated_host_request_never_advances_chain(pipelines):
  pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(40)), 2, 3)
  init_fn, batch_fn, _ = pipeline
  host = pipeline.host
  chain = int(init_fn(seed=4).chain)
  first = host.chunk(chain, 0).leaves[0].copy()
  second_chunk = host.chunk(chain, 1).leaves[0].copy()
  assert (host.chunk(chain, 0).leaves[0] == first).all()
  for _ in range(3):
    host.chunk(chain, 5)  # a far chunk, then the old ones again
  np.testing.assert_array_equal(host.chunk(chain, 1).leaves[0], second_chunk)
  np.testing.assert_array_equal(host.chunk(chain, 0).leaves[0], first)
  expected, _ = _expected_stream(40, 2, 3, 4, seed=4)
  assert np.concatenate([first, second_chunk]).tolist() == expected


def test_inside_cond_while_loop_and_grad(pipelines):
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(10.0)), 2, 2)
  expected, _ = _expected_stream(10, 2, 2, 6, seed=1)

  @jax.jit
  def loop(state):
    def cond(carry):
      return carry[0] < 6

    def body(carry):
      i, state, out = carry
      state, batch = lax.cond(i % 2 == 0, batch_fn, batch_fn, state)
      return i + 1, state, out.at[i].set(batch["x"])

    return lax.while_loop(cond, body, (0, state, jnp.zeros((6, 2))))[2]

  assert loop(init_fn(seed=1)).tolist() == expected

  def loss(w, state):
    state, batch = batch_fn(state)
    return jnp.sum(w * batch["x"]), state

  grad, _ = jax.jit(jax.grad(loss, has_aux=True))(2.0, init_fn(seed=1))
  assert float(grad) == float(sum(expected[0]))


def test_compiles_once_for_new_states(pipelines):
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(30)), 3, 2)
  traces = []

  @jax.jit
  def run(state):
    traces.append(1)
    return lax.scan(lambda s, _: batch_fn(s), state, None, length=5)

  outs = [run(init_fn(seed=s))[1]["x"].tolist() for s in range(3)]
  assert len(traces) == 1
  assert outs[0] != outs[1]
  assert outs[2] == _expected_stream(30, 3, 2, 5, seed=2)[0]


def test_remat_replay_keeps_stream(pipelines):
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(20.0)), 2, 2)
  expected, _ = _expected_stream(20, 2, 2, 8, seed=0)

  def loss(w, state):
    def body(state, _):
      state, batch = batch_fn(state)
      return state, jnp.sum(w * batch["x"])
    body = jax.checkpoint(body)
    state, terms = lax.scan(body, state, None, length=8)
    return jnp.sum(terms), state

  grad, state = jax.jit(jax.grad(loss, has_aux=True))(1.0, init_fn(seed=0))
  assert float(grad) == float(np.sum(expected))
  _, batch = batch_fn(state)
  assert batch["x"].tolist() == _expected_stream(20, 2, 2, 9, seed=0)[0][8]


def test_cpu_chunks_are_written_in_place(pipelines):
  """On CPU the host writes chunks into XLA's buffers (buffer_callback);
  the pure_callback path, which other platforms use, gives the same
  stream."""
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(13)), 3, 4)
  text = _scan(batch_fn, 20).lower(init_fn(seed=1)).as_text()
  if jax.default_backend() == "cpu":
    target = {"auto": "xla_buffer_python_cpu_callback",
              "pure": "xla_ffi_python_cpu_callback"}[pipelines.callback]
  else:  # pure_callback everywhere (seen on a GPU: xla_ffi_python_gpu_...)
    target = f"xla_ffi_python_{jax.default_backend()}_callback"
  assert set(re.findall(r"xla_\w*callback", text)) == {target}
  _, (x, mask) = _scan(batch_fn, 20)(init_fn(seed=1))
  assert (x.tolist(), mask.tolist()) == _expected_stream(13, 3, 4, 20, seed=1)


def _span(array):
  start = array.__array_interface__["data"][0]
  return start, start + array.nbytes


def test_answers_of_many_lanes_reuse_memory_only_once_dropped(pipelines):
  """pure_callback's answers of many lanes (hundreds of MB per refresh of
  hundreds of chains) lie in buffers used again: a buffer is handed out
  again only when every array over it, views included, is dropped (the
  runtime has copied it), never while one is alive; the stream is the
  chains' own across refreshes."""
  init_fn, batch_fn, _ = pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(50, dtype=np.int32)), 2, 3)
  host = pipeline.host
  states = init_fn(seed=range(3), stream="counter")
  request = lambda chunk: host.serve(  # chunk `chunk` of chains 0 .. 2
      np.asarray(states.pipeline), np.asarray(states.chain),
      np.full(3, chunk), np.ones(3, bool))
  first = request(0)
  assert [(a.shape, a.dtype) for a in first] == [
      ((3, 2, 3), np.dtype(np.int32)), ((3, 2, 3), np.dtype(bool))]
  block = _span(first[0])[0]
  view = first[0][1:].reshape(-1)  # a view keeps the buffer in use
  del first
  second = request(1)
  assert _span(second[0])[0] != block
  del view
  assert _span(request(2)[0])[0] == block  # free again once dropped
  third = request(3)
  assert _span(third[0])[0] == block and _span(second[0])[0] != block
  expected = np.stack([cs.stream_batches(seed, 0, 8, 3, 50, False, False)[0]
                       for seed in range(3)]).reshape(3, 4, 2, 3)
  np.testing.assert_array_equal(second[0], expected[:, 1])
  np.testing.assert_array_equal(third[0], expected[:, 3])
  _, xs = jax.jit(jax.vmap(lambda s: jax_data.scan(
      lambda c, b: (c, b["x"]), 0, s, batch_fn=batch_fn, length=8)))(
          init_fn(seed=range(3), stream="counter"))
  np.testing.assert_array_equal(xs, expected.reshape(3, 8, 3))


def test_host_answers_with_numpy_only(monkeypatch, pipelines):
  """What the callback runs on the host calls no function of JAX, and
  answers with NumPy arrays."""
  pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(20.0)), 2, 2)
  init_fn, batch_fn, _ = pipeline
  host = pipeline.host
  jax_called, results = [], []

  def watched(serve):
    def watched_serve(*args):
      with calls.watch(calls.jax_calls) as seen:
        out = serve(*args)
      jax_called.extend(seen)
      for chunk in out or ():
        results.extend(list(chunk.leaves) + [chunk.mask])
      return out
    return watched_serve

  # This host only: the general request, and the short path of chunks
  # produced ahead.
  monkeypatch.setattr(host, "lanes", watched(host.lanes))
  monkeypatch.setattr(host, "_ready", watched(host._ready))  # pylint: disable=protected-access
  _scan(batch_fn, 6)(init_fn())
  assert results and all(type(r) is np.ndarray for r in results)
  assert jax_called == []


def test_host_memory_bounded_over_100k_steps(pipelines):
  pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(1000.0)), 5, 2)
  init_fn, batch_fn, _ = pipeline
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=20_000)[0])
  state = run(init_fn(seed=0))  # warm up: compile, first allocations
  gc.collect()
  rss = psutil.Process().memory_info().rss
  for _ in range(4):
    state = run(state)
  gc.collect()
  grown = psutil.Process().memory_info().rss - rss
  record = pipeline.host.chain(int(state.chain))
  assert int(state.chunk) * 5 == 100_000
  # Two served chunks kept, and those produced ahead.
  assert len(record.chunks) <= 2 + StoreLimits().ahead
  assert len(record.snapshots) < 400  # ~16 per doubling, not 100k
  assert grown < 30 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"


def test_bad_arguments_raise_before_tracing(pipelines):
  loader = NumpyDataLoader(x=np.arange(10))
  with pytest.raises(TypeError, match="data_loader=.*list"):
    pipelines.random_reference_data([1, 2], 1, 1)
  with pytest.raises(ValueError, match="cached_batches_count=0"):
    pipelines.random_reference_data(loader, 0, 2)
  with pytest.raises(ValueError, match="mb_size=11"):
    pipelines.random_reference_data(loader, 1, 11)
  with pytest.raises(ValueError, match="mb_size=0"):
    pipelines.random_reference_data(loader, 1, 0)
  init_fn, batch_fn, _ = pipelines.random_reference_data(loader, 2, 2)
  with pytest.raises(TypeError, match="unknown keyword.*epochs=True"):
    init_fn(epochs=True)
  with pytest.raises(ValueError, match="in_epochs=True needs shuffle=True"):
    init_fn(in_epochs=True)
  with pytest.raises(TypeError, match="CacheState"):
    batch_fn({"x": 1})
  with pytest.raises(ValueError, match="device_count=0"):
    batch_fn(init_fn(), device_count=0)
  other_init, _, _ = pipelines.random_reference_data(loader, 3, 2)
  # Of another cache size: named a state of another pipeline.
  with pytest.raises(ValueError, match="batch_fn got a state of another "
                     "pipeline"):
    batch_fn(other_init())
  # Traced flags and seeds: JAX's generic conversion errors named nothing.
  state = init_fn(seed=1, stream="counter")
  with pytest.raises(TypeError, match="information must be a concrete True "
                     "or False, got information="):
    jax.jit(lambda s, i: batch_fn(s, information=i))(state, True)
  with pytest.raises(TypeError, match="shuffle must be a concrete True or "
                     "False, got shuffle="):
    jax.jit(lambda s: init_fn(seed=1, stream="counter", shuffle=s).key)(True)
  with pytest.raises(TypeError, match="seed must be concrete integers"):
    jax.jit(lambda s: init_fn(seed=s).key)(jnp.arange(3))


def test_no_warning_for_a_cache_smaller_than_the_data(pipelines):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    pipelines.random_reference_data(NumpyDataLoader(x=np.arange(10)), 3, 3)


def test_release_is_idempotent_and_frees_the_loader(pipelines):
  loader = NumpyDataLoader(x=np.arange(100.0))
  ref = weakref.ref(loader)
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(loader, 2, 2)
  run = _scan(batch_fn, 5)
  state, _ = run(init_fn())
  release_fn()
  release_fn()
  del loader
  gc.collect()
  assert ref() is None, gc.get_referrers(ref())
  with pytest.raises(jax_data.PipelineReleasedError, match="released"):
    init_fn()
  with pytest.raises(jax_data.PipelineReleasedError, match="released"):
    batch_fn(state)


def test_a_released_device_pipeline_names_its_loader():
  """As a host loader's pipeline does (it said only 'this pipeline')."""
  loader = jax_data.DeviceNumpyDataLoader(x=np.arange(10.0))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 2,
                                                                 2)
  state = init_fn()
  release_fn()
  for call in (init_fn, lambda: batch_fn(state)):
    with pytest.raises(jax_data.PipelineReleasedError, match=re.escape(
        "this pipeline over DeviceNumpyDataLoader(x; 10 observations) was "
        "released by its release_fn")):
      call()


def test_device_loader_pipeline(pipelines):
  loader = jax_data.DeviceNumpyDataLoader(x=np.arange(10))
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(loader, 1, 3)
  state = init_fn(key=jax.random.PRNGKey(1))
  s1, (batch, info) = jax.jit(batch_fn, static_argnums=1)(state, True)
  _, again = batch_fn(state)
  assert batch["x"].tolist() == again["x"].tolist()
  assert info.mask.tolist() == [True] * 3 and info.observation_count == 10
  _, nxt = batch_fn(s1)
  assert nxt["x"].shape == (3,)
  release_fn()
  with pytest.raises(jax_data.PipelineReleasedError):
    init_fn()


def test_a_state_of_another_pipeline_is_refused(pipelines):
  """Same loader kind and shapes, another pipeline: refused eagerly, and by
  the host inside jit."""
  a = pipelines.random_reference_data(NumpyDataLoader(x=np.arange(20)), 2, 3)
  b = pipelines.random_reference_data(NumpyDataLoader(x=np.arange(20)), 2, 3)
  foreign = b[0](seed=0)
  with pytest.raises(ValueError, match="got a state of another pipeline"):
    a[1](foreign)
  mixed = jax.tree_util.tree_map(lambda *x: jnp.stack(x), a[0](), foreign)
  with pytest.raises(Exception, match="a state of another pipeline"):
    jax.block_until_ready(jax.vmap(a[1])(mixed))
  with pytest.raises(Exception, match="a state of another pipeline"):
    jax.block_until_ready(_scan(a[1], 4)(foreign))
  # The pipeline's own states still work.
  _, (x, _) = _scan(a[1], 4)(a[0](seed=0))
  _, (y, _) = _scan(b[1], 4)(foreign)
  assert x.tolist() == y.tolist()


def test_stacked_states_given_to_one_chains_functions_are_named(pipelines):
  """A PRNGKey given as seed makes two chains (a sequence of two seeds);
  their stacked states given to batch_fn or scan were refused as 'a field
  has shape (2,)', which named neither the stacking nor vmap."""
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(20)), 2, 3)
  stacked = init_fn(seed=jax.random.PRNGKey(3))
  for call in (batch_fn, jax.jit(batch_fn), lambda s: jax_data.scan(
      lambda c, b: (c, None), 0, s, batch_fn=batch_fn, length=3)):
    with pytest.raises(TypeError, match="states of 2 chains stacked.*vmap"):
      call(stacked)
  _, batches = jax.vmap(batch_fn)(stacked)
  assert batches["x"].shape == (2, 3)


def test_a_state_put_back_leaf_by_leaf_names_the_way_to_restore(pipelines):
  """A state saved by a plain pytree checkpointer and put back into the
  pipeline of a new process carries the old pipeline's identity: refused,
  eagerly and inside jit, with the message naming state_from_pytree; the
  state restored that way continues the chain."""
  old = pipelines.random_reference_data(NumpyDataLoader(x=np.arange(20)), 2, 3)
  state, _ = _scan(old[1], 4)(old[0](seed=5))
  _, (expected, _) = _scan(old[1], 4)(state)
  leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(state)]
  tree = jax_data.state_to_pytree(old, state)
  new = pipelines.random_reference_data(NumpyDataLoader(x=np.arange(20)), 2, 3)
  put_back = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(new[0](seed=5)), leaves)
  with pytest.raises(ValueError, match="state_from_pytree"):
    new[1](put_back)
  with pytest.raises(Exception, match="state_from_pytree"):
    jax.block_until_ready(_scan(new[1], 4)(put_back))
  _, (got, _) = _scan(new[1], 4)(jax_data.state_from_pytree(new, tree))
  assert got.tolist() == expected.tolist()



@pytest.mark.parametrize("chains", [1, 3])
def test_a_released_pipelines_loader_is_freed_without_a_collection(
    chains, pipelines):
  """Nothing of jax_data forms a reference cycle with a loader: once the
  pipeline is released and the prefetch thread idle, dropping the loader
  frees it (and its arrays) at once, not at the next garbage collection;
  also after vmapped counter chains were served as one group."""
  loader = NumpyDataLoader(x=np.arange(100.0))
  ref = weakref.ref(loader)
  pipeline = pipelines.random_reference_data(loader, 2, 2)
  init_fn, batch_fn, release_fn = pipeline
  if chains == 1:
    _scan(batch_fn, 5)(init_fn())
  else:
    states = init_fn(seed=range(chains), stream="counter")
    jax.block_until_ready(jax.jit(jax.vmap(batch_fn))(states))
    del states
  host = pipeline.host
  release_fn()
  assert host.wait_idle()
  gc.collect()  # what earlier tests left behind
  gc.disable()
  try:
    del loader  # the last reference outside jax_data's objects
    assert ref() is None, gc.get_referrers(ref())
  finally:
    gc.enable()


def test_a_released_pipelines_loader_is_freed_after_a_pass_on_devices(
    pipelines):
  """A full-data pass on several devices makes the devices' requests meet
  (a rendezvous); the released pipeline, still held, holds the loader no
  more through it."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  loader = NumpyDataLoader(x=np.arange(100.0))
  ref = weakref.ref(loader)
  init_fn, map_fn, release_fn = pipelines.full_reference_data(loader, 2, 5)
  states = jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                  *[init_fn() for _ in range(4)])
  fun = lambda b, m, c: (jnp.sum(b["x"] * m), c)
  out = jax.pmap(lambda s: map_fn(fun, s, None, masking=True,
                                  device_count=4))(states)
  jax.block_until_ready(out)
  host = init_fn.__self__.host
  release_fn()
  assert host.wait_idle()
  del loader, out, states
  gc.collect()
  assert ref() is None, gc.get_referrers(ref())


def _used_and_released(kind):
  """A weak reference to a pipeline of ``kind``, used once and released
  (its host idle); nothing else of it is left in this frame."""
  make = {"random": jax_data.random_reference_data,
          "full": jax_data.full_reference_data,
          "mapper": jax_data.full_data_mapper}.get(kind)
  loader = (jax_data.DeviceNumpyDataLoader(x=np.arange(100.0))
            if kind == "device" else NumpyDataLoader(x=np.arange(100.0)))
  pipeline = (make or jax_data.random_reference_data)(loader, 2, 2)
  functions = tuple(pipeline)
  if kind in ("random", "device"):
    init_fn, batch_fn, _ = functions
    jax.block_until_ready(jax.jit(batch_fn)(
        init_fn(key=jax.random.PRNGKey(0)) if kind == "device"
        else init_fn()))
  elif kind == "full":
    init_fn, map_fn, _ = functions
    map_fn(lambda batch, carry: (batch["x"], carry), init_fn(), None)
  else:
    functions[0](lambda batch, carry: (batch["x"], carry), None)
  functions[-1]()  # release_fn
  if pipeline.host is not None:
    assert pipeline.host.wait_idle()
  return weakref.ref(pipeline)


@pytest.mark.parametrize("kind", ["random", "full", "mapper", "device"])
def test_a_released_dropped_pipeline_is_freed_without_a_collection(kind):
  """A pipeline forms no reference cycle with its own functions: released
  and dropped, it is freed at once, with the device cache of its template
  (kept for the next collection, 16 MiB a pipeline, before)."""
  gc.collect()  # what earlier tests left behind
  gc.disable()
  try:
    ref = _used_and_released(kind)
    assert ref() is None, gc.get_referrers(ref())
  finally:
    gc.enable()


@pytest.mark.parametrize("case", ["released while reading",
                                  "released after a failure"])
def test_a_loader_released_while_producing_ahead_is_freed_at_once(
    case, monkeypatch):
  """Released while the prefetch thread produces a chunk ahead (in the
  middle of a read), or after such a production failed: nothing is claimed
  after, and a failure keeps no frames (they hold the chain and its
  future), so dropping the loader frees it at once, with no reference
  cycle left for a garbage collection. The failure's traceback is kept as
  text."""
  started, go, armed = threading.Event(), threading.Event(), []

  class Slow:  # a source whose read waits, once armed
    def __len__(self):
      return 100

    def __getitem__(self, i):
      if armed and not started.is_set():
        started.set()
        go.wait(30)
      return {"x": np.float32(i)}

  read = NumpyDataLoader._read  # pylint: disable=protected-access

  def failing(self, flat, out):
    if armed:
      started.set()
      raise OSError("the disk went away")
    return read(self, flat, out)

  if case == "released while reading":
    loader = jax_data.SourceDataLoader(Slow(), workers=1)
  else:  # its cursors keep the loader until they are dropped
    monkeypatch.setattr(NumpyDataLoader, "_read", failing)
    loader = NumpyDataLoader(x=np.arange(100, dtype=np.float32))
  loader.store_limits = StoreLimits(ahead=2)
  ref = weakref.ref(loader)
  pipeline = jax_data.random_reference_data(loader, 2, 2)
  init_fn, batch_fn, release_fn = pipeline
  host = pipeline.host
  state, _ = _scan(batch_fn, 6)(init_fn())  # chunks 0-2; 3 and 4 ahead
  assert host.wait_idle()
  armed.append(True)
  _scan(batch_fn, 2)(state)  # chunk 3, stored: chunk 5 is produced ahead
  assert started.wait(30)
  if case == "released after a failure":
    assert host.wait_idle()
    record = host.chain(0)
    error = record.chunks[5].future.exception()
    assert "the disk went away" in str(error)
    assert error.__cause__.__traceback__ is None
    assert "in failing" in "".join(error.__cause__.__notes__)
    del record, error
  release_fn()
  go.set()
  assert host.wait_idle()
  gc.collect()  # what earlier tests left behind
  gc.disable()
  try:
    del loader
    # The record being read when the release came finishes in the
    # background (SourceDataLoader._read). On a loaded machine, 1 run in
    # 12-40 still held the loader here, while the source's worker thread
    # was alive, and let go of it about 1 ms later. A reference cycle
    # would keep it however long this waits: the collector is off.
    deadline = time.monotonic() + 30
    while ref() is not None and time.monotonic() < deadline:
      time.sleep(0.001)
    held = ref()
    assert held is None, gc.get_referrers(held)
  finally:
    gc.enable()


@pytest.mark.parametrize("mode", MODES)
def test_a_sequence_of_seeds_gives_the_stacked_chains(mode, pipelines):
  """``init_fn(seed=[...])`` is the stack of each seed's state: the same
  tree, and under vmap each lane gets its own seed's stream, on host
  loaders (exact and counter streams) and device-resident ones."""
  n, cache, mb, steps = 53, 3, 4, 8
  seeds = [4, 0, 9]
  loaders = [(NumpyDataLoader(x=np.arange(n)), {"stream": "exact"}),
             (NumpyDataLoader(x=np.arange(n)), {"stream": "counter"}),
             (jax_data.DeviceNumpyDataLoader(x=np.arange(n)),
              {"stream": "counter"})]
  for loader, stream in loaders:
    init_fn, batch_fn, release_fn = pipelines.random_reference_data(
        loader, cache, mb)
    apart = [init_fn(seed=s, **mode, **stream) for s in seeds]
    stacked = jax.tree_util.tree_map(lambda *s: jnp.stack(s), *apart)
    for given in (seeds, tuple(seeds), np.asarray(seeds)):
      together = init_fn(seed=given, **mode, **stream)
      assert (jax.tree_util.tree_structure(together)
              == jax.tree_util.tree_structure(stacked))
      for a, b in zip(jax.tree_util.tree_leaves(together),
                      jax.tree_util.tree_leaves(stacked)):
        assert a.shape == b.shape and a.dtype == b.dtype

    def run(state, batch_fn=batch_fn):
      return lax.scan(lambda st, _: batch_fn(st), state, None, length=steps)

    run = jax.jit(jax.vmap(run))
    _, got = run(together)
    _, want = run(stacked)
    np.testing.assert_array_equal(got["x"], want["x"])
    assert len({tuple(np.asarray(x).ravel()) for x in got["x"]}) == 3
    release_fn()


class _NeverCounter(NumpyDataLoader):
  """A loader whose "auto" never draws counter-based streams."""
  auto_counter_above = None


@pytest.mark.parametrize("mode", MODES)
def test_a_sequence_of_seeds_draws_counter_based_streams_by_default(
    mode, pipelines):
  """The chains of one ``init_fn(seed=[...])`` call are vmapped together:
  with ``stream`` left to "auto" they draw counter-based streams, whatever
  the observation count, where the loader's "auto" can (the same batches
  as ``stream="counter"``); a single seed keeps the exact streams of the
  guide's library, and so does a loader whose "auto" is never
  counter-based."""
  n, cache, mb, steps, seeds = 53, 3, 4, 8, [4, 0, 9]

  def lanes(loader, **keywords):
    init_fn, batch_fn, release_fn = pipelines.random_reference_data(
        loader, cache, mb)
    states = init_fn(**keywords)
    if np.ndim(keywords["seed"]) == 0:
      states = jax.tree_util.tree_map(lambda s: s[None], states)
    run = jax.vmap(lambda state: lax.scan(
        lambda st, _: batch_fn(st), state, None, length=steps)[1]["x"])
    got = np.asarray(jax.jit(run)(states))
    release_fn()
    return got

  counter = np.concatenate([
      lanes(NumpyDataLoader(x=np.arange(n)), seed=s, stream="counter", **mode)
      for s in seeds])
  exact = np.concatenate([
      lanes(NumpyDataLoader(x=np.arange(n)), seed=s, **mode) for s in seeds])
  assert not np.array_equal(counter, exact)
  for stream in ({}, {"stream": "auto"}):
    np.testing.assert_array_equal(
        lanes(NumpyDataLoader(x=np.arange(n)), seed=seeds, **stream, **mode),
        counter)
  np.testing.assert_array_equal(
      lanes(NumpyDataLoader(x=np.arange(n)), seed=seeds, stream="exact",
            **mode), exact)
  np.testing.assert_array_equal(
      lanes(_NeverCounter(x=np.arange(n)), seed=seeds, **mode), exact)


def test_a_bad_sequence_of_seeds_is_refused_before_any_chain(pipelines):
  loader = NumpyDataLoader(x=np.arange(20))
  pipeline = pipelines.random_reference_data(loader, 2, 3)
  init_fn, _, release_fn = pipeline
  for bad, error, words in (([], ValueError, "seed=[]"),
                            (np.zeros((2, 2), int), ValueError, "(2, 2)"),
                            ([1, -1], ValueError, "seed=-1"),
                            ([1, "a"], TypeError, "seed='a'")):
    with pytest.raises(error, match=re.escape(words)):
      init_fn(seed=bad)
  assert pipeline.host.chains() == []
  release_fn()


@pytest.mark.parametrize("seed", [7, range(5)])
@pytest.mark.parametrize("where", ["register", "state"])
def test_an_init_fn_call_ended_early_leaves_no_chain(pipelines, monkeypatch,
                                                     seed, where):
  # A Ctrl-C among many seeds, or a cache too large to allocate, ends the
  # call before its state exists: no chain is left that no state names.
  loader = NumpyDataLoader(x=np.arange(40))
  pipeline = pipelines.random_reference_data(loader, 2, 3)
  init_fn, batch_fn, release_fn = pipeline
  host = pipeline.host
  register, calls_made = host.register, []

  def interrupted(spec):
    calls_made.append(spec)
    if len(calls_made) == 3 or (where == "register" and isinstance(seed, int)):
      raise KeyboardInterrupt
    return register(spec)

  def no_memory(*args, **kwargs):
    raise MemoryError("cache")

  if where == "register":
    monkeypatch.setattr(host, "register", interrupted)
    expected = KeyboardInterrupt
  else:
    monkeypatch.setattr(jax_data.compiled.random_access.CacheState,
                        "start" if isinstance(seed, int) else "start_chains",
                        no_memory)
    expected = MemoryError
  with pytest.raises(expected):
    init_fn(seed=seed)
  assert host.chains() == []
  monkeypatch.undo()
  state = init_fn(seed=seed)
  assert len(host.chains()) == (1 if isinstance(seed, int) else 5)
  fresh_init, fresh_batch, fresh_release = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(40)), 2, 3)
  fresh = fresh_init(seed=seed)
  step = batch_fn if isinstance(seed, int) else jax.vmap(batch_fn)
  fresh_step = fresh_batch if isinstance(seed, int) else jax.vmap(fresh_batch)
  for _ in range(3):
    state, batch = step(state)
    fresh, expected_batch = fresh_step(fresh)
    np.testing.assert_array_equal(batch["x"], expected_batch["x"])
  release_fn()
  fresh_release()
