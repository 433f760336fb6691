"""Many chains and many devices: vmap, pmap, shard_map, device_count."""

import re
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

import jax_data
from jax_data import NumpyDataLoader
from jax_data.host_loader import StoreLimits
from jax_data.rendezvous import Rendezvous

# Tests that build pipelines with the `pipelines` fixture run with both ways
# chunks reach compiled code (conftest.py).

CHAINS = [dict(seed=0), dict(seed=1, shuffle=True),
          dict(seed=2, shuffle=True, in_epochs=True), dict(seed=3)]
N, CACHE, MB, STEPS = 11, 3, 4, 10

# pmap over the 4 devices conftest.py forces on CPU; a GPU machine's default
# devices are its GPUs, here one.
NEEDS_FOUR = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices (conftest.py forces 4 CPU devices)")


def _stack(states):
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)


class CountingLoader(NumpyDataLoader):
  """A loader that counts the chunks it produces."""

  def __init__(self, **arrays):
    super().__init__(**arrays)
    self.produced = []

  def open_chain(self, spec, layout):
    cursor = super().open_chain(spec, layout)
    produce = cursor.produce

    def counted(index, out):
      self.produced.append(index)
      return produce(index, out)

    cursor.produce = counted
    return cursor


def _counting_loader():
  loader = CountingLoader(x=np.arange(N))
  return loader, loader.produced


def _run(batch_fn, steps=STEPS):
  def body(state, _):
    state, (batch, info) = batch_fn(state, information=True)
    return state, (batch["x"], info.mask)
  return lambda state: lax.scan(body, state, None, length=steps)


def _lax_scan(batch_fn, step, init, length):
  """What ``jax_data.scan(step, init, state, ...)`` gives: a lax.scan
  whose body calls ``batch_fn``."""
  def body(loop, _):
    carry, state = loop
    state, batch = batch_fn(state)
    carry, y = step(carry, batch)
    return (carry, state), y
  return lambda state: lax.scan(body, (init, state), None, length=length)


def _solo(kwargs, steps=STEPS):
  init_fn, batch_fn, _ = jax_data.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  _, (x, mask) = jax.jit(_run(batch_fn, steps))(init_fn(**kwargs))
  return x.tolist(), mask.tolist()


@pytest.fixture(scope="module")
def solo():
  return [_solo(kwargs) for kwargs in CHAINS]


def test_vmap_lanes_equal_solo_chains_with_one_host_call_per_refresh(
    solo, pipelines):
  pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  init_fn, batch_fn, _ = pipeline
  states = _stack([init_fn(**kwargs) for kwargs in CHAINS])
  run = jax.jit(jax.vmap(_run(batch_fn)))
  host = pipeline.host
  before = host.requests
  _, (x, mask) = run(states)
  for lane, (sx, smask) in enumerate(solo):
    assert x[lane].tolist() == sx and mask[lane].tolist() == smask
  refreshes = -(-STEPS // CACHE)
  assert host.requests - before == refreshes  # not per step, not per lane


def test_nested_vmap_is_one_host_call_per_refresh(solo, pipelines):
  pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  init_fn, batch_fn, _ = pipeline
  states = _stack([init_fn(**kwargs) for kwargs in CHAINS])
  grid = jax.tree_util.tree_map(lambda a: a.reshape((2, 2) + a.shape[1:]),
                                states)
  before = pipeline.host.requests
  _, (x, _) = jax.jit(jax.vmap(jax.vmap(_run(batch_fn))))(grid)
  assert x.reshape(4, STEPS, MB).tolist() == [s[0] for s in solo]
  assert pipeline.host.requests - before == -(-STEPS // CACHE)


def test_vmapped_lanes_may_refresh_at_different_steps(pipelines):
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  a, b = init_fn(seed=5), init_fn(seed=6)
  b, _ = batch_fn(b)  # one lane a step ahead
  _, (x, _) = jax.jit(jax.vmap(_run(batch_fn, 7)))(_stack([a, b]))
  _, (xa, _) = jax.jit(_run(batch_fn, 7))(a)
  _, (xb, _) = jax.jit(_run(batch_fn, 7))(b)
  assert x[0].tolist() == xa.tolist() and x[1].tolist() == xb.tolist()


def test_map_fn_under_vmap_over_parameters(pipelines):
  x = np.linspace(-2, 2, 13)
  init_fn, map_fn, _ = pipelines.full_reference_data(
      NumpyDataLoader(x=x), 2, 3)
  state = init_fn()

  def loglik(w):
    _, (values, _) = map_fn(lambda b, c: (-(b["x"] - w) ** 2, c), state, None)
    return jnp.sum(values)

  ws = jnp.linspace(-1, 1, 5)
  np.testing.assert_allclose(jax.jit(jax.vmap(loglik))(ws),
                             [loglik(w) for w in ws], rtol=1e-6)


def test_map_fn_under_vmap_over_states(pipelines):
  init_fn, map_fn, _ = pipelines.full_reference_data(
      NumpyDataLoader(x=np.arange(7)), 2, 3)
  states = _stack([init_fn(), init_fn()])
  _, (values, _) = jax.jit(jax.vmap(
      lambda s: map_fn(lambda b, c: (b["x"], c), s, None)))(states)
  assert values.tolist() == [list(range(7))] * 2


@NEEDS_FOUR
def test_pmap_over_stacked_states_equals_solo(solo, pipelines):
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  devices = jax.local_device_count()
  assert devices == 4, "tests run with 4 CPU devices (conftest.py)"
  states = _stack([init_fn(**kwargs) for kwargs in CHAINS])
  _, (x, mask) = jax.pmap(_run(batch_fn))(states)
  for lane, (sx, smask) in enumerate(solo):
    assert x[lane].tolist() == sx and mask[lane].tolist() == smask


@NEEDS_FOUR
def test_replicated_state_gives_every_device_the_same_batches_once(pipelines):
  loader, produced = _counting_loader()
  init_fn, batch_fn, _ = pipelines.random_reference_data(loader, CACHE, MB)
  state = init_fn(seed=7)
  produced.clear()

  def per_device(i):
    _, (x, _) = _run(lambda s, **kw: batch_fn(s, device_count=4, **kw))(state)
    return x

  x = jax.jit(jax.pmap(per_device))(jnp.arange(4))
  assert all(x[d].tolist() == x[0].tolist() for d in range(4))
  expected, _ = _solo(dict(seed=7))
  assert x[0].tolist() == expected
  chunks = -(-STEPS // CACHE)
  # Each chunk is generated once on the host (plus those produced ahead).
  assert chunks <= len(produced) <= chunks + StoreLimits().ahead


def test_wrong_device_count_keeps_memory_bounded(pipelines):
  pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  init_fn, batch_fn, _ = pipeline
  state = init_fn()
  run = jax.jit(_run(lambda s, **kw: batch_fn(s, device_count=64, **kw),
                     steps=300))
  state, _ = run(state)
  state, _ = run(state)
  record = pipeline.host.chain(int(state.chain))
  # 64 devices were announced but one asks: chunks wait for the other 63
  # only up to the documented cap.
  assert len(record.chunks) <= StoreLimits().max_stored


def test_shard_map_behaves_like_pmap(solo, pipelines):
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  states = _stack([init_fn(**kwargs) for kwargs in CHAINS])
  run = jax.jit(jax.shard_map(jax.vmap(_run(batch_fn)), mesh=mesh,
                              in_specs=PartitionSpec("d"),
                              out_specs=PartitionSpec("d")))
  _, (x, mask) = run(states)
  for lane, (sx, smask) in enumerate(solo):
    assert x[lane].tolist() == sx and mask[lane].tolist() == smask
  # A replicated state: every device gets the same batches.
  state = init_fn(seed=7)
  replicated = jax.jit(jax.shard_map(
      lambda s: _run(batch_fn)(s)[1][0][None], mesh=mesh,
      in_specs=PartitionSpec(), out_specs=PartitionSpec("d")))(state)
  assert all(replicated[d].tolist() == _solo(dict(seed=7))[0]
             for d in range(4))


@NEEDS_FOUR
def test_device_loader_chains_under_pmap_and_shard_map_equal_solo():
  """DeviceNumpyDataLoader chains of every kind (jax.random, then each
  counter-based mode), one per device under pmap and two per device under
  shard_map of vmap (devices whose lanes share a kind and devices whose
  lanes do not): each gets the batches it gets alone."""
  init_fn, batch_fn, _ = jax_data.random_reference_data(
      jax_data.DeviceNumpyDataLoader(x=np.arange(N)), CACHE, MB)
  kinds = [init_fn(key=jax.random.PRNGKey(4))] + [
      init_fn(seed=seed, stream="counter", **mode) for seed, mode in
      enumerate(({}, {"shuffle": True}, {"shuffle": True, "in_epochs": True}))]
  alone = jax.jit(_run(batch_fn))
  solo = [np.asarray(alone(state)[1][0]) for state in kinds]
  _, (x, _) = jax.pmap(_run(batch_fn))(_stack(kinds))
  np.testing.assert_array_equal(x, np.stack(solo))
  mesh = Mesh(np.array(jax.devices()), ("d",))
  run = jax.jit(jax.shard_map(jax.vmap(_run(batch_fn)), mesh=mesh,
                              in_specs=PartitionSpec("d"),
                              out_specs=PartitionSpec("d")))
  for order in ([0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 2, 3, 3, 2, 1, 0]):
    _, (x, _) = run(_stack([kinds[k] for k in order]))
    np.testing.assert_array_equal(x, np.stack([solo[k] for k in order]))


@NEEDS_FOUR
@pytest.mark.parametrize("vmapped", [True, False])
@pytest.mark.parametrize("length", [CACHE, 4 * CACHE])
def test_an_invariant_carry_under_shard_map_with_sharded_states(
    pipelines, vmapped, length):
  """A carry that does not depend on the batches (a step counter from a
  Python 0) inside ``shard_map`` over each device's own chains: the loop
  over whole chunks keeps the carry of lanes without one more (a select on
  positions that vary over the mesh), which made the carry vary after its
  first round and the loop refuse it."""
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  states = init_fn(seed=range(4))
  step = lambda count, batch: (count + 1, batch["x"])

  def scan(state):
    return jax_data.scan(step, 0, state, batch_fn=batch_fn, length=length)

  reference = _lax_scan(batch_fn, step, 0, length)

  def per_device(fn):
    if vmapped:
      return jax.vmap(fn)
    return lambda s: jax.tree_util.tree_map(
        lambda a: a[None], fn(jax.tree_util.tree_map(lambda a: a[0], s)))

  (count, _), ys = jax.jit(jax.shard_map(
      per_device(scan), mesh=mesh, in_specs=PartitionSpec("d"),
      out_specs=PartitionSpec("d")))(states)
  (_, _), want = jax.jit(jax.shard_map(
      per_device(reference), mesh=mesh, in_specs=PartitionSpec("d"),
      out_specs=PartitionSpec("d")))(states)
  assert np.asarray(count).tolist() == [length] * 4
  np.testing.assert_array_equal(ys, want)


@NEEDS_FOUR
@pytest.mark.parametrize("length", [CACHE - 1, 4 * CACHE])
def test_a_weak_carry_returned_strong_under_shard_map(pipelines, length):
  """A Python 0.0 the step adds a float32 sum to, inside ``shard_map``
  over each device's own chains: its ys of ``carry * a bfloat16`` are
  bfloat16, as lax.scan's (which traces the step once, the carry weak),
  the carry given back to the step weak where it varies over the mesh."""
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N, dtype=np.float32)), CACHE, MB)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  states = init_fn(seed=range(8))
  # (a bfloat16 of the batch's: a constant would be cast to vary over the
  # mesh, which runs the steps as one lax.scan)
  step = lambda c, b: (c + jnp.sum(b["x"]),
                       c * b["x"][0].astype(jnp.bfloat16))

  def init():
    init = lax.pcast(0.0, ("d",), to="varying")
    assert jax.typeof(init).weak_type
    return init

  def scan(state):
    return jax_data.scan(step, init(), state, batch_fn=batch_fn,
                         length=length)

  def reference(state):
    return _lax_scan(batch_fn, step, init(), length)(state)

  run = lambda fn: jax.jit(jax.shard_map(
      jax.vmap(fn), mesh=mesh, in_specs=PartitionSpec("d"),
      out_specs=PartitionSpec("d")))(states)
  (carry, _), ys = run(scan)
  (want_carry, _), want = run(reference)
  assert ys.dtype == want.dtype == jnp.bfloat16
  np.testing.assert_array_equal(ys, want)
  np.testing.assert_array_equal(carry, want_carry)


def test_jax_data_scan_under_shard_map_equals_lax_scan(pipelines):
  """Per-step outputs of ``jax_data.scan`` inside ``shard_map`` (one chain
  per device): the buffer they go into varies over the mesh as they do."""
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N, dtype=np.float32)), CACHE, MB)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  states = _stack([init_fn(seed=20 + d) for d in range(4)])
  step = lambda c, b: (c + jnp.sum(b["x"]), b["x"])

  def with_lax_scan(state):
    init = lax.pcast(0.0, ("d",), to="varying")

    def body(loop, _):
      carry, state = loop
      state, batch = batch_fn(state)
      carry, y = step(carry, batch)
      return (carry, state), y

    return lax.scan(body, (init, state), None, length=2 * CACHE + 1)

  def with_jax_data_scan(state):
    init = lax.pcast(0.0, ("d",), to="varying")
    return jax_data.scan(step, init, state, batch_fn=batch_fn,
                         length=2 * CACHE + 1)

  results = [jax.jit(jax.shard_map(jax.vmap(fn), mesh=mesh,
                                   in_specs=PartitionSpec("d"),
                                   out_specs=PartitionSpec("d")))(states)
             for fn in (with_lax_scan, with_jax_data_scan)]
  expected, got = results
  np.testing.assert_array_equal(got[1], expected[1])
  np.testing.assert_array_equal(got[0][0], expected[0][0])


@NEEDS_FOUR
def test_full_data_mapper_with_a_pmapped_function_inside_jit(pipelines):
  n = 22
  x = np.arange(n, dtype=np.float32)
  loader = NumpyDataLoader(x=x, index=np.arange(n))
  mapper_fn, _ = pipelines.full_data_mapper(loader, 2, 4)
  squared = jax.pmap(lambda v: v ** 2)

  def fun(batch, carry):
    values = squared(batch["x"].reshape(4, 1)).reshape(4)
    return (values, batch["index"]), carry

  (values, index), _ = jax.jit(lambda: mapper_fn(fun, None))()
  assert index.tolist() == list(range(n))  # every observation exactly once
  np.testing.assert_array_equal(values, x ** 2)


def test_full_map_under_shard_map_with_per_device_states(pipelines):
  init_fn, map_fn, _ = pipelines.full_reference_data(
      NumpyDataLoader(x=np.arange(9)), 2, 4)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  states = _stack([init_fn() for _ in range(4)])

  def per_device(states):
    def one(state):
      _, (values, _) = map_fn(lambda b, c: (b["x"] * 2, c), state, None)
      return values
    return jax.vmap(one)(states)

  values = jax.jit(jax.shard_map(per_device, mesh=mesh,
                                 in_specs=PartitionSpec("d"),
                                 out_specs=PartitionSpec("d")))(states)
  assert values.tolist() == [[2 * i for i in range(9)]] * 4


@NEEDS_FOUR
@pytest.mark.parametrize("loader_type", [NumpyDataLoader,
                                         jax_data.DeviceNumpyDataLoader])
def test_full_map_under_shard_map_mixes_batches_with_per_device_values(
    loader_type):
  """Each device's pass over its own state computes with its own shard of
  an argument (the batches vary over the mesh axis as the state does)."""
  init_fn, map_fn, _ = jax_data.full_reference_data(
      loader_type(x=np.arange(11, dtype=np.float32)), 2, 3)
  mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  states = _stack([init_fn() for _ in range(4)])

  def per_device(scale, state):
    state = jax.tree_util.tree_map(lambda a: a[0], state)
    _, (values, _) = map_fn(lambda b, c: (b["x"] * scale[0], c), state,
                            None)
    return values[None]

  values = jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=(PartitionSpec("d"),) * 2,
      out_specs=PartitionSpec("d")))(jnp.arange(4.0), states)
  np.testing.assert_array_equal(values,
                                np.arange(4.0)[:, None] * np.arange(11))


def test_chunk_kept_until_every_device_took_it(pipelines):
  pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(100)), 2, 3)
  init_fn, _, _ = pipeline
  host = pipeline.host
  chain = int(init_fn().chain)
  host.chunk(chain, 0, device_count=2)  # one of two devices took chunk 0
  for index in range(1, 6):
    for _ in range(2):
      host.chunk(chain, index, device_count=2)
  record = host.chain(chain)
  assert 0 in record.chunks  # still awaited by the second device
  assert 1 not in record.chunks  # taken by both: retired


def test_devices_that_do_not_meet_stop_waiting_with_a_warning(pipelines):
  pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  init_fn, _, _ = pipeline
  host = pipeline.host
  host.rendezvous = Rendezvous(host.name, host.loader.chains_numbered,
                               timeout=0.2)
  chain = init_fn().chain
  args = (np.array([pipeline.id]), np.array([chain]), np.array([0]),
          np.array([True]))
  with pytest.warns(UserWarning, match=(
      r"1 of the 2 devices of one pmap/shard_map asked for chunk 0 within "
      r"0.2 s, and the others for no chunk: their states are at other "
      "positions")) as caught:
    host.serve(*args, participants=2)
  assert "device_count" not in str(caught[0].message)
  out = host.serve(*args, participants=2)  # no more waiting
  assert out[0].shape == (1, CACHE, MB)


def _rendezvous_warnings(caught):
  """The messages of the warnings that devices stopped waiting."""
  return [str(w.message) for w in caught if "devices" in str(w.message)]


@NEEDS_FOUR
@pytest.mark.parametrize("steps_taken", [[0, CACHE, 2 * CACHE, 3 * CACHE],
                                         [0, 0, CACHE, 0]],
                         ids=["stacked_apart", "one_advanced"])
def test_devices_at_different_chunks_are_served_without_waiting(
    pipelines, steps_taken):
  """States at the same position of different chunks refresh at the same
  steps but never ask for the same chunk: the rendezvous must not wait for
  them (it waited 10 s per chunk and blamed device_count)."""
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  run = jax.jit(_run(batch_fn))
  states = []
  for kwargs, steps in zip(CHAINS, steps_taken):
    state = init_fn(**kwargs)
    if steps:
      state, _ = jax.jit(_run(batch_fn, steps))(state)
    states.append(state)
  alone = [run(state)[1] for state in states]

  def step(state, _):  # a data-parallel step: a collective after the batch
    state, (batch, info) = batch_fn(state, information=True)
    return state, (batch["x"], info.mask, lax.psum(batch["x"].sum(), "d"))

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, (x, mask, total) = jax.pmap(
        lambda s: lax.scan(step, s, None, length=STEPS), axis_name="d")(
            _stack(states))
    jax.block_until_ready(total)
  for device, (want_x, want_mask) in enumerate(alone):
    np.testing.assert_array_equal(x[device], want_x)
    np.testing.assert_array_equal(mask[device], want_mask)
  np.testing.assert_array_equal(total[0], sum(a[0].sum(axis=1) for a in alone))
  told = _rendezvous_warnings(caught)
  assert len(told) == 1, told
  assert re.search(r"asked for different chunks at once: chunk \d+ by \d "
                   r"devices?, chunk \d+ by", told[0]), told[0]
  assert "device_count" not in told[0]


def test_requests_for_different_chunks_stop_the_rendezvous_at_once(
    pipelines):
  """Two devices' requests for chunks 0 and 1: both are served their own
  chunk, the first does not wait for its round's timeout."""
  pipeline = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  init_fn, batch_fn, _ = pipeline
  host = pipeline.host
  host.rendezvous = Rendezvous(host.name, host.loader.chains_numbered,
                               timeout=20)
  chains = [int(init_fn(seed=s).chain) for s in range(2)]
  served = {}

  def serve(device):
    served[device] = host.serve(
        np.array([pipeline.id]), np.array([chains[device]]),
        np.array([device]), np.array([True]), participants=2)

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    other = threading.Thread(target=serve, args=(0,))
    other.start()  # whichever comes second finds the first waiting
    serve(1)
    other.join()
  told = _rendezvous_warnings(caught)
  assert len(told) == 1, told
  assert told[0].startswith(
      f"{host.name}: the 2 devices of one pmap/shard_map asked for different "
      "chunks at once: chunk 0 by 1 device, chunk 1 by 1 device. "), told[0]
  for device in range(2):
    np.testing.assert_array_equal(
        served[device][0][0],
        np.asarray(host.chunk(chains[device], device).leaves[0]))


def _meet_in_threads(rendezvous, requests, participants=None):
  """Each ``(chains, delay, error)``: a request, one of ``participants``
  (default: all these), that comes for chunk 0 of ``chains``, produces for
  ``delay`` seconds, fails with ``error`` (or not) and meets; what each
  meet returned, and its seconds."""
  results = [None] * len(requests)

  def request(i, chains, delay, error):
    ticket = rendezvous.come(0, participants or len(requests), chains)
    start = time.monotonic()
    time.sleep(delay)
    results[i] = (rendezvous.meet(ticket, error), time.monotonic() - start)

  threads = [threading.Thread(target=request, args=(i, *r))
             for i, r in enumerate(requests)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(30)
  return results


def test_a_stopped_rendezvous_protects_chains_made_later():
  """After devices stopped waiting for each other (a timeout), requests of
  the chains made until then go through at once, and chains made later
  meet again: one device's failure reaches the other (which would
  otherwise wait in a collective, and XLA abort the process)."""
  numbered = [2]
  rendezvous = Rendezvous("L", lambda: numbered[0], timeout=0.2)
  with pytest.warns(UserWarning, match="1 of the 2 devices .* chunk 0 "
                    "within 0.2 s.* chains made from now on: they wait"):
    alone = rendezvous.meet(rendezvous.come(0, 2, [0]), None)
  assert alone is None
  assert rendezvous.come(0, 2, [1]) is None  # made before the stop
  numbered[0] = 4
  failure = OSError("chain 2's disk")
  results = _meet_in_threads(rendezvous, [([2], 0.0, failure),
                                          ([3], 0.0, None)])
  assert [error for error, _ in results] == [failure, failure]


def test_devices_wait_for_a_slow_chunk_once_all_came():
  """A chunk that takes longer than the timeout to produce on one device
  is waited for once every device came: no stop, no warning, and its
  failure reaches the others."""
  rendezvous = Rendezvous("L", lambda: 2, timeout=0.2)
  failure = OSError("slow and failing")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    results = _meet_in_threads(rendezvous, [([0], 0.8, failure),
                                            ([1], 0.0, None)])
  assert [error for error, _ in results] == [failure, failure]
  assert results[1][1] >= 0.7  # it waited for the slow one


def test_a_request_that_leaves_is_not_waited_for():
  """A request that came and then ends without meeting (interrupted while
  producing or waiting) lowers its round's count: the others meet as soon
  as they are all there, with no timeout, no warning, no stop."""
  rendezvous = Rendezvous("L", lambda: 3, timeout=20)
  leaving = rendezvous.come(0, 3, [2])
  threading.Timer(0.3, rendezvous.withdraw, args=(leaving,)).start()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    results = _meet_in_threads(rendezvous, [([0], 0.0, None),
                                            ([1], 0.0, None)],
                               participants=3)
  assert all(error is None and seconds < 10 for error, seconds in results)
  assert rendezvous.come(1, 3, [0]) is not None  # still protected


def test_release_makes_devices_waiting_for_each_other_raise_together():
  """A round waiting when the pipeline is released gets the release's
  error, and its requests still meet: they raise together, once the last
  has come, and not one before (a device that raised alone would leave
  the others in a collective, and XLA abort the process)."""
  rendezvous = Rendezvous("L", lambda: 2, timeout=20)
  released = RuntimeError("released")
  threading.Timer(0.2, rendezvous.release, args=(released,)).start()
  results = _meet_in_threads(rendezvous, [([0], 0.0, None),
                                          ([1], 0.6, None)])
  assert [error for error, _ in results] == [released, released]
  assert results[0][1] >= 0.5  # it waited for the other


@NEEDS_FOUR
def test_aligned_devices_with_several_states_meet_without_warning(
    pipelines):
  """Several states of one pipeline per device, each at its own chunk,
  aligned across devices: every refresh meets, nothing is stopped."""
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      NumpyDataLoader(x=np.arange(N)), CACHE, MB)
  families = []
  for offset in (0, 2 * CACHE, 5 * CACHE):
    states = [init_fn(seed=10 * offset + d) for d in range(4)]
    if offset:
      states = [jax.jit(_run(batch_fn, offset))(s)[0] for s in states]
    families.append(_stack(states))

  def step(states, _):
    out = []
    for state in states:
      state, batch = batch_fn(state)
      out.append((state, batch["x"]))
    return [s for s, _ in out], jnp.stack([x for _, x in out])

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, x = jax.pmap(lambda s: lax.scan(step, s, None, length=STEPS),
                    axis_name="d")(families)
    jax.block_until_ready(x)
  assert _rendezvous_warnings(caught) == []
  assert x.shape == (4, STEPS, 3, MB)


@NEEDS_FOUR
@pytest.mark.parametrize("limits", [None, 1], ids=["ahead", "read_in_place"])
def test_nested_and_pmapped_vmaps_of_scan_equal_solo_chains(limits,
                                                             pipelines):
  """``jax_data.scan`` under two vmaps, and under pmap of vmap, whose
  whole chunks come with the lane axis second: each chain gets its own
  stream, stored ahead or read in place."""
  from jax_data.host_loader import StoreLimits

  loader = jax_data.NumpyDataLoader(x=np.arange(500.0 * 2).reshape(500, 2))
  if limits:
    loader.store_limits = StoreLimits(store_bytes=limits)
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(loader, 4,
                                                                  5)

  def one(state):
    (_, state), xs = jax_data.scan(lambda c, b: (c, b["x"]), 0, state,
                                   batch_fn=batch_fn, length=13)
    return xs

  grid = jax.tree_util.tree_map(
      lambda a: a.reshape((2, 3) + a.shape[1:]),
      init_fn(seed=range(6), stream="counter", shuffle=True))
  nested = jax.jit(jax.vmap(jax.vmap(one)))(grid)
  mapped = jax.pmap(jax.vmap(one))(grid)
  solo = jax.jit(one)
  expected = np.stack([
      solo(init_fn(seed=s, stream="counter", shuffle=True))
      for s in range(6)]).reshape(2, 3, 13, 5, 2)
  np.testing.assert_array_equal(nested, expected)
  np.testing.assert_array_equal(mapped, expected)
  release_fn()
