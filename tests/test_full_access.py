"""full_reference_data and full_data_mapper: every observation, in order."""

import functools
import gc
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh

import jax_data
from jax_data import DeviceNumpyDataLoader
from jax_data import NumpyDataLoader
from jax_data import pass_loop
from tests.counted import CountedRows

# Tests that build pipelines with the `pipelines` fixture run with both ways
# chunks reach compiled code (conftest.py).


@pytest.mark.parametrize("n,mb,cache", [(10, 4, 1), (10, 4, 2), (10, 4, 5),
                                        (12, 4, 2), (7, 1, 3), (9, 9, 4),
                                        (23, 5, 100)])
@pytest.mark.parametrize("loader_cls", [NumpyDataLoader, DeviceNumpyDataLoader])
def test_every_observation_once_in_order_pass_after_pass(loader_cls, n, mb,
                                                         cache, pipelines):
  x = np.arange(n) * 10
  init_fn, map_fn, _ = pipelines.full_reference_data(loader_cls(x=x), cache,
                                                    mb)

  def per_observation(batch, carry):
    return batch["x"], carry + 1

  def per_batch(batch, mask, carry):
    return jnp.stack([batch["x"], mask.astype(jnp.int32)]), carry

  @jax.jit
  def passes(state):
    def body(state, _):
      state, (values, count) = map_fn(per_observation, state, 0)
      state, (batches, _) = map_fn(per_batch, state, None, masking=True)
      return state, (values, count, batches)
    return lax.scan(body, state, None, length=3)

  _, (values, counts, batches) = passes(init_fn())
  per_pass = math.ceil(n / mb)
  for p in range(3):
    assert values[p].tolist() == x.tolist()
    assert int(counts[p]) == per_pass
    got = batches[p, :, 0][batches[p, :, 1] == 1]
    assert got.tolist() == x.tolist()
    padding = batches[p, :, 0][batches[p, :, 1] == 0]
    assert padding.tolist() == x[:per_pass * mb - n].tolist()


@pytest.mark.parametrize("loader_cls", [NumpyDataLoader, DeviceNumpyDataLoader])
def test_passes_under_x64_and_strict_promotion(loader_cls, pipelines):
  """A pass whose last batch is padded, under jax_enable_x64 with strict
  dtype promotion: the library's own index arithmetic mixed int32 and
  int64 (TypePromotionError) and the pass failed."""
  with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
    x = np.arange(10, dtype=np.float32)
    mapper, _ = pipelines.full_data_mapper(loader_cls(x=x), 2, 4)
    values, _ = jax.jit(lambda: mapper(lambda b, c: (b["x"], c), None))()
    assert values.tolist() == x.tolist()
    init_fn, map_fn, _ = pipelines.full_reference_data(loader_cls(x=x), 2, 4)
    _, (batches, _) = jax.jit(lambda s: map_fn(
        lambda b, m, c: (jnp.where(m, b["x"], -1.0), c), s, None,
        masking=True))(init_fn())
    assert batches.reshape(-1).tolist() == x.tolist() + [-1.0, -1.0]


def test_guide_sum_of_potentials(pipelines):
  loader = NumpyDataLoader(base=jnp.arange(10))
  init_fun, map_fun, _ = pipelines.full_reference_data(loader, 3, 4)

  def sum_potentials(exp, data, mask, carry):
    return jnp.sum(mask * jnp.power(data["base"], exp)), carry

  def body(state, exp):
    state, (sums, _) = map_fun(lambda d, m, c: sum_potentials(exp, d, m, c),
                               state, None, masking=True)
    return state, jnp.sum(sums)

  _, result = lax.scan(body, init_fun(), jnp.arange(3))
  assert result.tolist() == [10, 45, 285]


def test_information_and_carry(pipelines):
  loader = NumpyDataLoader(x=np.arange(7.0))
  init_fn, map_fn, _ = pipelines.full_reference_data(loader, 2, 3)

  def fun(batch_and_info, carry):
    batch, info = batch_and_info
    assert info.observation_count == 7 and info.batch_size == 3
    return batch["x"] * info.mask, carry + jnp.sum(batch["x"] * info.mask)

  _, (values, total) = jax.jit(
      lambda s: map_fn(fun, s, 0.0, information=True))(init_fn())
  assert values.tolist() == list(range(7)) and float(total) == 21.0


def test_mapper_batched_and_unbatched(pipelines):
  loader = NumpyDataLoader(x=np.arange(10.0), y=np.ones((10, 2)))
  mapper_fn, release_fn = pipelines.full_data_mapper(loader, 2, 3)
  batched, carry = jax.jit(lambda: mapper_fn(
      lambda b, c: (b["x"][:, None] * b["y"], c), 1.0))()
  assert batched.shape == (10, 2) and float(carry) == 1.0
  unbatched, _ = mapper_fn(lambda o, c: (o["x"] * o["y"], c), None,
                           batched=False)
  np.testing.assert_array_equal(batched, unbatched)
  with pytest.raises(ValueError, match="masking=True needs a batched fun"):
    mapper_fn(lambda o, m, c: (o, c), None, masking=True, batched=False)
  release_fn()
  with pytest.raises(jax_data.PipelineReleasedError):
    mapper_fn(lambda b, c: (b["x"], c), None)


def test_mapper_with_default_sizes_and_vmap_over_parameters(pipelines):
  x = np.linspace(-1, 1, 9)
  mapper_fn, _ = pipelines.full_data_mapper(NumpyDataLoader(x=x))

  def loglik(w):
    values, _ = mapper_fn(lambda b, c: (-(b["x"] - w) ** 2, c), None)
    return jnp.sum(values)

  ws = jnp.array([0.0, 0.5, 1.0])
  got = jax.jit(jax.vmap(loglik))(ws)
  expected = [-np.sum((x - w) ** 2) for w in ws.tolist()]
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_stacked_pass_states_read_the_data_once_for_all_lanes(pipelines):
  """One full-pass state per chain, stacked for vmap: the results are each
  lane's pass, and a pass reads each record as often as one state's does
  (each init_fn gave its own host chain: 256 states read the data 256
  times a pass)."""
  x = np.linspace(-1, 1, 40).astype(np.float32)
  thetas = jnp.asarray([0.0, 0.5, 1.0, 2.0])
  reads = []
  for chains in (1, 4):
    source = CountedRows(x)
    init_fn, map_fn, release_fn = pipelines.full_reference_data(
        jax_data.SourceDataLoader(source, workers=0), 2, 5)
    states = jax.tree_util.tree_map(lambda *s: jnp.stack(s),
                                    *[init_fn() for _ in range(chains)])
    assert len(set(np.asarray(states.chain).tolist())) == 1
    run = jax.jit(jax.vmap(lambda state, theta, map_fn=map_fn: map_fn(
        lambda b, m, c: (jnp.sum(jnp.where(m, (b["x"] - theta) ** 2, 0.0)),
                         c), state, None, masking=True)[1][0].sum()))
    got = run(states, thetas[:chains])
    np.testing.assert_allclose(
        got, [np.sum((x - t) ** 2) for t in thetas[:chains].tolist()],
        rtol=1e-5)
    reads.append(source.reads)
    release_fn()
  assert reads[1] == reads[0]


@pytest.mark.parametrize("n,mb,cache", [(23, 5, 2), (103, 10, 2)])
def test_a_pass_reads_its_own_batches_alone(pipelines, n, mb, cache):
  """A pass reads each record once, and the padding of its last batch (the
  pass's first records) again, not the next pass's batches that filled its
  last chunk. XLA asked for that chunk before the others, which replayed
  the pass from its start: the first pass over 23 records read 48 of
  them."""
  source = CountedRows(np.arange(n, dtype=np.float32))
  loader = jax_data.SourceDataLoader(source, workers=0)
  init_fn, map_fn, release_fn = pipelines.full_reference_data(loader, cache,
                                                             mb)
  source.reads = 0
  run = jax.jit(lambda state: map_fn(
      lambda b, m, c: (jnp.sum(jnp.where(m, b["x"], 0.0)), c), state, None,
      masking=True))
  state = init_fn()
  once = n + (-n) % mb
  for passes in range(1, 4):
    state, (sums, _) = run(state)
    assert float(sums.sum()) == n * (n - 1) / 2
    if n == 23:  # the pass's 3 chunks stay stored
      assert source.reads == once
    else:  # its 6 do not: the next pass's first chunks are read ahead
      assert passes * once <= source.reads <= passes * once + 3 * cache * mb
  release_fn()


class _Wrapped(jax_data.chains.ChainCursor):
  """A cursor that hands every call on to another one."""

  def __init__(self, inner):
    self.inner = inner

  def produce(self, index, out):
    return self.inner.produce(index, out)

  def position(self):
    return self.inner.position()

  def seek(self, position):
    self.inner.seek(position)


def test_a_loader_that_extends_get_batches_passes_over_the_data(pipelines):
  """A NumpyDataLoader subclass with a get_batches of its own serves its
  chains through that, and one whose open_chain wraps the cursors through
  those, which do not read rows by index: their passes are not padded to
  whole chunks (they were refused as split passes)."""
  class Logged(NumpyDataLoader):
    def get_batches(self, chain_id):
      return super().get_batches(chain_id)

  class Wrapping(NumpyDataLoader):  # its open_chain wraps the cursors
    def open_chain(self, spec, layout):
      return _Wrapped(super().open_chain(spec, layout))

  for n, loader_cls in ((10, Logged), (8, Logged), (23, Wrapping)):
    loader = loader_cls(x=np.arange(float(n)))
    mapper_fn, release_mapper = pipelines.full_data_mapper(loader, 2, 4)
    sums, _ = mapper_fn(lambda b, m, c: (jnp.sum(b["x"] * m), c), None,
                        masking=True)
    assert float(jnp.sum(sums)) == n * (n - 1) / 2
    init_fn, map_fn, release_fn = pipelines.full_reference_data(loader, 2, 4)
    _, (values, _) = map_fn(lambda b, c: (b["x"], c), init_fn(), None)
    assert values.tolist() == list(range(n))
    release_fn()
    release_mapper()


def test_shards_cover_the_data_once(pipelines):
  x = np.arange(11.0)
  total = 0.0
  for index in range(3):
    mapper_fn, _ = pipelines.full_data_mapper(
        NumpyDataLoader(x=x), 2, 2, shard_index=index, shard_count=3)
    sums, _ = mapper_fn(lambda b, m, c: (jnp.sum(b["x"] * m), c), None,
                        masking=True)
    total += float(jnp.sum(sums))
  assert total == float(x.sum())


def test_bad_arguments(pipelines):
  loader = NumpyDataLoader(x=np.arange(10))
  with pytest.raises(ValueError, match="mb_size=None"):
    pipelines.full_reference_data(loader, 2)
  with pytest.raises(ValueError, match="cached_batches_count=0"):
    pipelines.full_data_mapper(loader, 0, 2)
  with pytest.raises(ValueError, match="shard_index=3"):
    pipelines.full_data_mapper(loader, 1, 2, shard_index=3, shard_count=3)
  # The shard's observations, not the loader's, are fewer than a batch.
  for make in (pipelines.full_data_mapper, pipelines.full_reference_data):
    with pytest.raises(ValueError, match=r"shard_count=4 leaves shard_index=0 "
                       r"2 observation\(s\), fewer than mb_size=3"):
      make(loader, 2, 3, shard_index=0, shard_count=4)
  init_fn, map_fn, _ = pipelines.full_reference_data(loader, 2, 2)
  with pytest.raises(TypeError, match="unknown keyword.*seed=1"):
    init_fn(seed=1)
  with pytest.raises(TypeError, match="fun must be callable"):
    map_fn(None, init_fn(), None)
  with pytest.raises(TypeError, match="masking must be True or False"):
    map_fn(lambda b, c: (b, c), init_fn(), None, masking="yes")


def test_progress_is_reported_per_chunk_on_request(pipelines):
  seen = []
  mapper_fn, _ = pipelines.full_data_mapper(
      NumpyDataLoader(x=np.arange(25.0)), 2, 3,
      progress=lambda done, total: seen.append((done, total)))
  run = jax.jit(lambda: mapper_fn(lambda b, c: (b["x"], c), None)[0])
  assert run().tolist() == list(range(25))
  # Read off the chunk each request asks for: map_pass asks in order.
  assert seen == [(2, 9), (4, 9), (6, 9), (8, 9), (9, 9)]

  seen.clear()
  run()
  assert seen[-1] == (9, 9) and len(seen) == 5
  with pytest.raises(TypeError, match="progress='yes'"):
    pipelines.full_data_mapper(NumpyDataLoader(x=np.arange(5)), 1, 1,
                              progress="yes")


class _FailingRow:
  """Rows ``{"x": i}`` whose row ``bad`` fails to read until ``mended``
  (every time: a read ahead that failed is read again when asked)."""

  def __init__(self, n, bad):
    self.n, self.bad, self.mended = n, bad, False

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    if i == self.bad and not self.mended:
      raise OSError("a read that fails")
    return {"x": np.float32(i)}


def test_progress_after_a_pass_cut_short_reports_whole_passes():
  """A pass that stops partway (here a failed read; an error in fun or
  Ctrl-C alike) leaves every later pass's reports from 2 to the total:
  counted requests stayed partway through, and later passes reported
  10/14 first and 8/14 last."""
  seen = []
  rows = _FailingRow(40, bad=20)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      jax_data.SourceDataLoader(rows, workers=0), 2, 3,
      progress=lambda done, total: seen.append(done))
  fun = lambda b, c: (b["x"], c)
  with pytest.raises(Exception, match="OSError: a read that fails"):
    jax.block_until_ready(mapper_fn(fun, None))
  assert seen and seen[-1] < 14
  rows.mended = True
  for _ in range(2):
    seen.clear()
    values, _ = mapper_fn(fun, None)
    np.testing.assert_array_equal(values, np.arange(40.0))
    assert seen == [2, 4, 6, 8, 10, 12, 14]
  release_fn()


def test_progress_counts_a_step_once_for_all_lanes_and_devices(pipelines):
  """The lanes of a vmapped pass, and the devices of a pass under pmap,
  ask for each chunk step together: one step reported, not one per lane
  or device. A pass split over a mesh reports the whole pass's batches."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  x = np.arange(23, dtype=np.float32)
  seen = []
  report = lambda done, total: seen.append((done, total))
  init_fn, map_fn, release_fn = pipelines.full_reference_data(
      NumpyDataLoader(x=x), 2, 4, progress=report)
  fun = lambda b, c: (b["x"], c)
  states = jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                  *[init_fn() for _ in range(3)])
  jax.block_until_ready(jax.vmap(lambda s: map_fn(fun, s, None))(states))
  assert seen == [(2, 6), (4, 6), (6, 6)]
  seen.clear()
  states = jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                  *[init_fn() for _ in range(4)])
  jax.block_until_ready(jax.pmap(
      lambda s: map_fn(fun, s, None, device_count=4))(states))
  assert seen == [(2, 6), (4, 6), (6, 6)]
  release_fn()
  seen.clear()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  mapper_fn, release_mapper = pipelines.full_data_mapper(
      NumpyDataLoader(x=x), 2, 1, mesh=mesh, batch_axis="data",
      progress=report)
  jax.block_until_ready(mapper_fn(fun, None))
  assert seen == [(8, 23), (16, 23), (23, 23)]
  release_mapper()


def test_progress_true_prints_to_stderr(capsys, pipelines):
  mapper_fn, _ = pipelines.full_data_mapper(
      NumpyDataLoader(x=np.arange(10.0)), 5, 2, progress=True)
  mapper_fn(lambda b, c: (b["x"], c), None)
  assert "full-data pass: 5/5 batches" in capsys.readouterr().err


def test_untouched_carry_maps_chunks_at_once_with_the_same_results():
  """A fun that returns its carry unchanged is mapped over each chunk's
  batches in one vectorised call; the per-batch results are those of the
  batch-by-batch scan (exactly for integers, to rounding for floats)."""
  x = np.random.default_rng(0).normal(size=(103, 3)).astype(np.float32)
  ints = np.arange(103 * 2).reshape(103, 2)
  loader = jax_data.NumpyDataLoader(x=x, i=ints)
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 4, 10)
  w = jnp.asarray([0.5, -1.0, 2.0])

  def untouched(batch, mask, carry):
    return (jnp.sum(jnp.where(mask, batch["x"] @ carry, 0.0)),
            jnp.sum(jnp.where(mask[:, None], batch["i"], 0))), carry

  def threaded(batch, mask, carry):
    result, _ = untouched(batch, mask, carry)
    return result, carry * 1.0 + 0.0 * jnp.sum(result[0])

  assert not pass_loop.threads_carry(
      lambda c, bm: untouched(*bm, c)[::-1], w, lambda k: (
          {"x": jnp.zeros((4, 10, 3)), "i": jnp.zeros((4, 10, 2), int)},
          jnp.zeros((4, 10), bool)))
  fast, _ = jax.jit(lambda w: mapper_fn(untouched, w, masking=True))(w)
  slow, _ = jax.jit(lambda w: mapper_fn(threaded, w, masking=True))(w)
  np.testing.assert_array_equal(np.asarray(fast[1]), np.asarray(slow[1]))
  np.testing.assert_allclose(np.asarray(fast[0]), np.asarray(slow[0]),
                             rtol=1e-6, atol=1e-5)
  assert int(np.asarray(fast[1]).sum()) == int(ints.sum())
  np.testing.assert_allclose(float(np.asarray(fast[0]).sum()),
                             float(np.sum(x @ np.asarray(w))), rtol=1e-5)
  release_fn()


_SCALE = jnp.float32(1.0)


def _scaled_sum(batch, mask, carry):
  return jnp.sum(jnp.where(mask, _SCALE * batch["x"], 0.0)), carry


class _Model:

  def __init__(self, w):
    self.w = jnp.float32(w)

  def loglik(self, batch, carry):
    return -0.5 * (batch["x"] - self.w) ** 2, carry


@pytest.mark.parametrize("split", [False, True],
                         ids=["one_pass", "split_over_a_mesh"])
def test_values_a_function_reads_are_those_of_each_call(split):
  """A function mapped again sees the values it reads now (globals,
  attributes, closures), not those of its first call, and a change of value
  compiles nothing new; also in a pass split over a mesh
  (test_global_passes.py)."""
  global _SCALE
  x = np.arange(10.0, dtype=np.float32)
  loader = jax_data.NumpyDataLoader(x=x)
  if split:
    if jax.device_count() < 4:  # a GPU machine: its one GPU
      pytest.skip("needs 4 devices (conftest.py forces 4 CPU devices)")
    mapper_fn, release_mapper = jax_data.full_data_mapper(
        loader, 1, 2, mesh=Mesh(np.array(jax.devices()[:4]), ("data",)),
        batch_axis="data")
  else:
    mapper_fn, release_mapper = jax_data.full_data_mapper(loader, 2, 4)
  init_fn, map_fn, release_full = jax_data.full_reference_data(loader, 2, 4)
  model = _Model(1.0)
  client = jax.devices()[0].client
  executables = None
  try:
    for value in (1.0, 2.0, 3.5):
      _SCALE = jnp.float32(value)
      model.w = jnp.float32(value)
      sums, _ = mapper_fn(_scaled_sum, None, masking=True)
      assert float(sums.sum()) == 45.0 * value
      _, (sums, _) = map_fn(_scaled_sum, init_fn(), None, masking=True)
      assert float(sums.sum()) == 45.0 * value
      loglik, _ = mapper_fn(model.loglik, None)
      np.testing.assert_allclose(loglik, -0.5 * (x - value) ** 2)
      # A closure over a value of a jitted caller.
      within = jax.jit(lambda w: mapper_fn(
          lambda b, c: (b["x"] * w, c), None)[0])(jnp.float32(value))
      np.testing.assert_allclose(within, x * value)
      gc.collect()
      if executables is None:
        executables = len(client.live_executables())
    assert len(client.live_executables()) == executables
  finally:
    _SCALE = jnp.float32(1.0)
    release_mapper()
    release_full()


def _scaled_gradient(scale):
  """The identity, whose gradient is scaled by ``scale``."""

  @jax.custom_vjp
  def identity(v):
    return v

  identity.defvjp(lambda v: (v, None), lambda _, g: (g * scale,))
  return identity


def test_custom_rules_are_those_of_each_call():
  """A custom gradient rule made in the mapped function gives the gradient
  of this call's rule, not of the first call's; JAX's own rules
  (``softplus``'s) compile nothing new from call to call."""
  x = np.arange(1.0, 9.0, dtype=np.float32)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=x), 2, 4)
  model = _Model(1.0)

  def loglik(batch, mask, theta):
    scaled = _scaled_gradient(model.w)(theta)
    return jnp.sum(jnp.where(mask, scaled * batch["x"], 0.0)), theta

  total = lambda theta, fun: mapper_fn(fun, theta, masking=True)[0].sum()
  for value in (1.0, 10.0):
    model.w = value
    np.testing.assert_allclose(jax.grad(total)(2.0, loglik),
                               value * x.sum())

  def softplus(batch, mask, theta):
    return jnp.sum(jnp.where(mask, jax.nn.softplus(theta * batch["x"]),
                             0.0)), theta

  client = jax.devices()[0].client
  executables = None
  for theta in (0.5, -1.0, 2.0):
    np.testing.assert_allclose(
        jax.grad(total)(theta, softplus),
        np.sum(x / (1 + np.exp(-theta * x))), rtol=1e-5)
    gc.collect()
    if executables is None:
      executables = len(client.live_executables())
  assert len(client.live_executables()) == executables
  release_fn()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _clip_gradient(low, high, v):
  return v


_clip_gradient.defvjp(lambda low, high, v: (v, None),
                      lambda low, high, _, g: (jnp.clip(g, low, high),))


def test_a_custom_rules_static_arguments_are_those_of_each_call():
  """A custom_vjp's nondiff_argnums (Python floats, as in JAX's clip_gradient
  example) are the rule's own values at each call: the second bound gave
  the first call's gradient (found by a review)."""
  x = np.arange(7, dtype=np.float32)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=x), 2, 3)

  def gradients(high):
    mapped = jax.grad(lambda w: jnp.sum(mapper_fn(
        lambda b, m, c: (jnp.sum(_clip_gradient(-high, high, b["x"] * w) * m),
                         c), 0.0, masking=True)[0]))(1.0)
    plain = jax.grad(lambda w: jnp.sum(
        _clip_gradient(-high, high, jnp.asarray(x) * w)))(1.0)
    return float(mapped), float(plain)

  for high in (0.5, 0.25):
    # Each row's gradient 1 clipped to high, times its x (they sum to 21).
    assert gradients(high) == (high * 21, high * 21)
  release_fn()


class _Settings:
  scale = 1.0


_RULE_SCALE = 1.0


@jax.custom_vjp
def _scaled_by_global(v):
  return v


_scaled_by_global.defvjp(lambda v: (v, None), lambda _, g: (g * _RULE_SCALE,))


@pytest.mark.parametrize("reads", ["attribute, vjp", "attribute, jvp",
                                   "global"])
def test_a_custom_rule_that_reads_changed_values_is_traced_again(reads):
  """A custom rule is traced when the pass is differentiated, reading an
  object's attribute or a module's global then: a value changed between
  calls is this call's, as in JAX without jax_data (the first call's
  gradient came back; found by a review)."""
  global _RULE_SCALE
  x = np.arange(7, dtype=np.float32)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=x), 2, 3)
  settings = _Settings()

  def rule():
    if reads == "global":
      return _scaled_by_global
    if reads == "attribute, jvp":
      f = jax.custom_jvp(lambda v: v)
      f.defjvp(lambda p, t: (p[0], t[0] * settings.scale))
      return f
    f = jax.custom_vjp(lambda v: v)
    f.defvjp(lambda v: (v, None), lambda _, g: (g * settings.scale,))
    return f

  def gradient(f):
    return float(jax.grad(lambda w: jnp.sum(mapper_fn(
        lambda b, m, c: (jnp.sum(f(b["x"] * w) * m), c), 0.0,
        masking=True)[0]))(1.0))

  try:
    for scale in (1.0, 3.0):
      settings.scale = _RULE_SCALE = scale
      assert gradient(rule()) == 21 * scale
  finally:
    _RULE_SCALE = 1.0
    release_fn()


@pytest.mark.parametrize("kind", ["full_reference_data", "full_data_mapper"])
def test_release_frees_a_device_loaders_arrays(kind):
  """A pass over a device loader holds its arrays in the compiled code;
  release_fn drops the pipeline's compiled passes, so dropping the loader
  frees its arrays."""
  loader = jax_data.DeviceNumpyDataLoader(x=np.arange(1000.0))
  data = weakref.ref(loader.get_full_data()["x"])
  fun = lambda b, c: (b["x"], c)
  if kind == "full_reference_data":
    init_fn, map_fn, release_fn = jax_data.full_reference_data(loader, 2, 10)
    jax.block_until_ready(map_fn(fun, init_fn(), 0.0))
  else:
    mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 10)
    jax.block_until_ready(mapper_fn(fun, 0.0))
  release_fn()
  del loader
  gc.collect()
  assert data() is None


def test_a_function_that_calls_back_compiles_once():
  loader = jax_data.NumpyDataLoader(x=np.arange(10.0, dtype=np.float32))
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 4)
  seen = []

  def fun(batch, carry):
    jax.debug.callback(lambda x: seen.append(float(x)), jnp.sum(batch["x"]))
    return batch["x"], carry

  client = jax.devices()[0].client
  mapper_fn(fun, None)
  jax.effects_barrier()
  gc.collect()
  before = len(client.live_executables())
  for _ in range(3):
    mapper_fn(fun, None)
  jax.effects_barrier()
  gc.collect()
  assert len(client.live_executables()) == before
  assert sorted(seen) == sorted([6.0, 22.0, 18.0] * 4)  # 8 + 9 + 0 + 1
  release_fn()


_FACTOR = 1


def _host_scaled(x):
  return np.asarray(x * _FACTOR, np.float32)


def _scaled_by_callback(batch, carry):
  """A host callback over a closure that captures the global factor when
  traced (as callbacks built per call do)."""
  factor = _FACTOR
  host = lambda x: np.asarray(x * factor, np.float32)
  shape = jax.ShapeDtypeStruct(batch["x"].shape, jnp.float32)
  return jax.pure_callback(host, shape, batch["x"],
                           vmap_method="sequential"), carry


def _scaled_by_partial(batch, carry):
  shape = jax.ShapeDtypeStruct(batch["x"].shape, jnp.float32)
  host = functools.partial(lambda f, x: np.asarray(x * f, np.float32),
                           _FACTOR)
  return jax.pure_callback(host, shape, batch["x"],
                           vmap_method="sequential"), carry


def _scaled_at_run_time(batch, carry):
  shape = jax.ShapeDtypeStruct(batch["x"].shape, jnp.float32)
  return jax.pure_callback(_host_scaled, shape, batch["x"],
                           vmap_method="sequential"), carry


def test_callbacks_compute_with_the_values_of_each_call(pipelines):
  """A callback whose host function captured a value when ``fun`` was
  traced computes with this call's value, not the first call's (the
  compiled pass is keyed by what the callback calls); one that reads the
  value when it runs compiles once. 0.0 and -0.0 are equal, but a host
  function tells them apart: neither takes the other's pass."""
  global _FACTOR
  x = np.arange(10.0, dtype=np.float32)
  loader = jax_data.NumpyDataLoader(x=x)
  mapper_fn, release_mapper = pipelines.full_data_mapper(loader, 2, 4)
  init_fn, map_fn, release_full = pipelines.full_reference_data(loader, 2, 4)
  client = jax.devices()[0].client
  try:
    for fun in (_scaled_by_callback, _scaled_by_partial):
      for factor in (1, 5, 7, 0.0, -0.0):
        _FACTOR = factor
        expected = (x * factor).astype(np.float32)
        results, _ = mapper_fn(fun, None)
        np.testing.assert_array_equal(results, expected)
        np.testing.assert_array_equal(np.signbit(results),
                                      np.signbit(expected))
        _, (results, _) = map_fn(fun, init_fn(), None)
        np.testing.assert_array_equal(np.signbit(results),
                                      np.signbit(expected))
    executables = None
    for factor in (1, 5, 7, 5):
      _FACTOR = factor
      results, _ = mapper_fn(_scaled_at_run_time, None)
      np.testing.assert_array_equal(results, x * factor)
      gc.collect()
      if executables is None:
        executables = len(client.live_executables())
    assert len(client.live_executables()) == executables
  finally:
    _FACTOR = 1
    release_mapper()
    release_full()


class _Replaced:
  """A model whose parameters a sampler replaces at each step."""

  def __init__(self):
    self.w = None

  def loglik(self, batch, carry):
    return batch["x"] * jnp.sum(self.w), carry

  def batched(self, batch, mask, carry):
    return batch["x"] * jnp.sum(self.w) * mask, carry


def test_a_compiled_pass_does_not_keep_the_arrays_of_its_first_call(
    pipelines):
  """A method mapped over the data reads the model's parameters, new
  arrays at every step: each call computes with its own, and the pass
  compiled at the first call does not keep that call's arrays."""
  x = np.arange(10, dtype=np.float32)
  loader = jax_data.NumpyDataLoader(x=x)
  init_fn, map_fn, release_full = pipelines.full_reference_data(loader, 2, 4)
  mapper_fn, release_mapper = pipelines.full_data_mapper(loader, 2, 4)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  split_fn, release_split = pipelines.full_data_mapper(
      loader, 1, 1, mesh=mesh, batch_axis="data")
  model = _Replaced()
  firsts = []
  for step in range(3):
    model.w = jnp.full((8, 8), float(step))
    firsts.append(weakref.ref(model.w))
    _, (results, _) = map_fn(model.loglik, init_fn(), None)
    np.testing.assert_array_equal(results, x * step * 64)
    results, _ = mapper_fn(model.batched, None, masking=True)
    np.testing.assert_array_equal(np.ravel(results)[:x.size],
                                  x * step * 64)
    results, _ = split_fn(model.batched, None, masking=True)
    assert float(np.sum(results)) == float(np.sum(x)) * step * 64
  gc.collect()
  assert [first() is None for first in firsts] == [True, True, False]
  release_full()
  release_mapper()
  release_split()


def test_new_lambdas_share_a_pass_that_keeps_nothing_they_closed_over():
  """A new lambda on every call, over new parameters, compiles once; the
  pipeline keeps neither the functions nor what they closed over, and a
  pass inside jit leaks no tracer."""
  x = np.arange(10, dtype=np.float32)
  loader = jax_data.NumpyDataLoader(x=x)
  init_fn, map_fn, release_full = jax_data.full_reference_data(loader, 2, 4)
  mapper_fn, release_mapper = jax_data.full_data_mapper(loader, 2, 4)
  client = jax.devices()[0].client
  kept, executables = [], None

  def passes(w):
    """Each pass with a new lambda over ``w``."""
    _, (full, _) = map_fn(lambda b, c: (b["x"] * w.sum(), c), init_fn(),
                          None)
    mapped, _ = mapper_fn(lambda b, c: (b["x"] * w.sum(), c), None)
    one_by_one, _ = mapper_fn(lambda o, c: (o["x"] * w.sum(), c), None,
                              batched=False)
    return full, mapped, one_by_one

  for step in range(4):
    w = jnp.full((64, 64), float(step))
    kept.append(weakref.ref(w))
    for results in passes(w):
      np.testing.assert_array_equal(results, x * step * 4096)
    del w
    gc.collect()
    if executables is None:
      executables = len(client.live_executables())
  assert len(client.live_executables()) == executables
  assert [ref() is None for ref in kept] == [True] * 4
  with jax.check_tracer_leaks():
    within = jax.jit(lambda w: mapper_fn(lambda b, c: (b["x"] * w, c),
                                         None)[0])(jnp.float32(3.0))
  np.testing.assert_array_equal(within, x * 3)
  release_full()
  release_mapper()


def test_arrays_an_inner_jit_holds_are_those_of_each_call():
  """An inner jax.jit keeps the arrays it closes over as its own
  constants, which the jaxpr's text does not show: passes that differ only
  there compute with their own (small ones compared by value, large ones
  as the same array), not the first's."""
  x = np.ones((6, 3), np.float32)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=x), 2, 3)
  for size in (3, 2048):  # 12 bytes, 8 KiB
    for scale in (1.0, 10.0, 2.0):
      w = np.full((3, size), scale, np.float32)
      inner = jax.jit(lambda v, w=w: v @ w)
      partial = jax.jit(functools.partial(lambda w, v: v @ w, w))
      for f in (inner, partial):
        results, _ = mapper_fn(lambda b, c, f=f: (f(b["x"]), c), None)
        np.testing.assert_array_equal(results, np.full((6, size),
                                                       3 * scale))
  release_fn()


def test_a_callback_reads_the_dict_it_closes_over_now():
  """Two callbacks over equal dicts are the same pass only if they are
  the same dict: a callback reads its dict when it runs."""
  x = np.ones(4, np.float32)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=x), 2, 2)

  def scaled(v, config):
    return np.asarray(v * config["scale"], np.float32)

  hosts = [  # the dict in a closure, a partial's argument, a default
      lambda config: lambda v: scaled(v, config),
      lambda config: functools.partial(scaled, config=config),
      lambda config: lambda v, config=config: scaled(v, config)]
  for host_of in hosts:

    def fun_of(config, host_of=host_of):
      return lambda b, c: (jax.pure_callback(
          host_of(config), jax.ShapeDtypeStruct(b["x"].shape, jnp.float32),
          b["x"], vmap_method="sequential"), c)

    first, second = {"scale": 1.0}, {"scale": 1.0}
    np.testing.assert_array_equal(mapper_fn(fun_of(first), None)[0], x)
    first["scale"] = 5.0
    np.testing.assert_array_equal(mapper_fn(fun_of(second), None)[0], x)
    np.testing.assert_array_equal(mapper_fn(fun_of(first), None)[0], 5 * x)
  release_fn()


def test_arrays_jax_prints_as_literals_are_those_of_each_call():
  """With jax_use_simplified_jaxpr_constants, arrays a function closes
  over are literals that print as [...], of one element too."""
  x = np.ones((4, 1), np.float32)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=x), 2, 2)
  before = jax.config.jax_use_simplified_jaxpr_constants
  jax.config.update("jax_use_simplified_jaxpr_constants", True)
  try:
    for shape in ((1,), (1, 1), (3,)):
      for scale in (1.0, 7.0):
        w = jnp.full(shape, scale, np.float32)
        results, _ = mapper_fn(lambda b, c, w=w: (b["x"] * w, c), None)
        np.testing.assert_array_equal(
            results, np.broadcast_to(x * scale, results.shape))
  finally:
    jax.config.update("jax_use_simplified_jaxpr_constants", before)
  release_fn()


class _Host:
  """A model whose host function is a bound method: a new object on every
  attribute access."""

  def __init__(self, factor):
    self.factor = factor

  def scaled(self, x):
    return np.asarray(x * self.factor, np.float32)

  def fun(self, batch, carry):
    shape = jax.ShapeDtypeStruct(batch["x"].shape, jnp.float32)
    return jax.pure_callback(self.scaled, shape, batch["x"],
                             vmap_method="sequential"), carry


def test_a_bound_method_callback_compiles_once_and_reads_its_object():
  x = np.arange(10, dtype=np.float32)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=x), 2, 4)
  client = jax.devices()[0].client
  model, other = _Host(2.0), _Host(-1.0)
  executables = None
  for factor in (2.0, 3.0, 5.0):
    model.factor = factor
    np.testing.assert_array_equal(mapper_fn(model.fun, None)[0], x * factor)
    gc.collect()
    if executables is None:
      executables = len(client.live_executables())
  assert len(client.live_executables()) == executables
  # Another object's method: its own pass, its own values.
  np.testing.assert_array_equal(mapper_fn(other.fun, None)[0], -x)
  np.testing.assert_array_equal(mapper_fn(model.fun, None)[0], x * 5.0)
  release_fn()


def _doubled_unless_vmapped(scale):
  """Doubles a value; under vmap, scales it by ``scale`` instead (a
  custom_vmap rule over a closure)."""

  @jax.custom_batching.custom_vmap
  def f(v):
    return v * 2.0

  @f.def_vmap
  def rule(axis_size, in_batched, v):
    del axis_size
    return v * scale, in_batched[0]

  return f


def test_custom_vmap_rules_are_those_of_each_function():
  """Functions that trace alike but whose custom_vmap rules differ get
  their own rule when the pass is vmapped."""
  x = np.arange(1.0, 9.0, dtype=np.float32)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=x), 2, 4)
  for scale in (3.0, 7.0):
    fun = lambda b, c, scale=scale: (
        _doubled_unless_vmapped(scale)(b["x"] * c), c)
    results = jax.vmap(lambda c, fun=fun: mapper_fn(fun, c)[0])(
        jnp.ones(2))
    np.testing.assert_array_equal(results, np.stack([x * scale] * 2))
  release_fn()


def test_callbacks_that_vmap_refuses_are_mapped_batch_by_batch(pipelines):
  """A fun that leaves its carry unchanged is vmapped over a chunk's
  batches; a pure_callback without vmap_method or an ordered io_callback
  cannot be, so such a fun is scanned, with the same results."""
  from jax.experimental import io_callback
  x = np.arange(10.0, dtype=np.float32)
  loader = jax_data.NumpyDataLoader(x=x)
  mapper_fn, release_fn = pipelines.full_data_mapper(loader, 2, 4)
  seen = []

  def pure(batch, carry):
    shape = jax.ShapeDtypeStruct(batch["x"].shape, jnp.float32)
    return jax.pure_callback(lambda v: np.asarray(v * 2, np.float32), shape,
                             batch["x"]), carry

  def ordered(batch, mask, carry):
    total = jnp.sum(jnp.where(mask, batch["x"], 0.0))
    io_callback(lambda t: seen.append(float(t)), None, total, ordered=True)
    return total, carry

  results, _ = mapper_fn(pure, None)
  np.testing.assert_array_equal(results, 2 * x)
  results, _ = jax.jit(lambda: mapper_fn(pure, None))()
  np.testing.assert_array_equal(results, 2 * x)
  sums, _ = mapper_fn(ordered, jnp.float32(0.0), masking=True)
  jax.effects_barrier()
  np.testing.assert_array_equal(sums, [6.0, 22.0, 17.0])
  assert seen == [6.0, 22.0, 17.0]  # in order: ordered
  release_fn()


def test_one_result_per_batch_without_masking_names_fun(pipelines):
  """With masking=False a fun returns one result per observation; one that
  returns one per batch is told so before anything is compiled."""
  loader = jax_data.NumpyDataLoader(x=np.arange(10.0, dtype=np.float32))
  mapper_fn, release_mapper = pipelines.full_data_mapper(loader, 2, 4)
  init_fn, map_fn, release_full = pipelines.full_reference_data(loader, 2, 4)

  def per_batch(batch, carry):
    return {"sum": jnp.sum(batch["x"]), "x": batch["x"]}, carry

  for call in (lambda: mapper_fn(per_batch, None),
               lambda: map_fn(per_batch, init_fn(), None)):
    with pytest.raises(ValueError, match=r"masking=False.*mb_size=4.*per_batch"
                       r".*\['sum'\] has shape \(\).*masking=True"):
      call()
  release_mapper()
  release_full()


@pytest.mark.parametrize("carry, returned, message", [
    (np.int32(0), lambda c, b: c + 0.5,
     r"carry is int32\[\], fun returned float32\[\] for it"),
    (np.float32(0), lambda c, b: c + b["x"], r"float32\[\].*float32\[4\]"),
    # a carry the pass need not thread (its value unchanged) is checked too
    ({"a": np.float32(0)}, lambda c, b: (c["a"],),
     r"carry has a leaf at \['a'\], fun returned one at \[0\]"),
    ({"a": np.float32(0)}, lambda c, b: {**c, "b": c["a"]},
     r"fun's carry has 1 more leaves, the first at \['b'\]")])
def test_a_carry_of_another_type_is_named(pipelines, carry, returned,
                                          message):
  """A fun whose carry changes type is told so in the passes' own terms
  (fun, carry), as jax_data.scan names f and init, and never loses it."""
  loader = jax_data.NumpyDataLoader(x=np.arange(10.0, dtype=np.float32))
  mapper_fn, release_mapper = pipelines.full_data_mapper(loader, 2, 4)
  init_fn, map_fn, release_full = pipelines.full_reference_data(loader, 2, 4)

  def fun(batch, carry):
    return batch["x"], returned(carry, batch)

  for call in (lambda: mapper_fn(fun, carry),
               lambda: map_fn(fun, init_fn(), carry),
               lambda: jax.jit(lambda c: mapper_fn(fun, c))(carry)):
    with pytest.raises(TypeError, match=r"fun must return a carry of "
                       r"carry's .*" + message):
      call()
  # a Python number is promoted to what fun returns, as lax.scan does
  _, total = mapper_fn(lambda b, m, c: (b["x"], c + (b["x"] * m).sum()), 0,
                       masking=True)
  assert total.dtype == jnp.float32 and total == 45.0
  release_mapper()
  release_full()


@pytest.mark.parametrize("call, message", [
    (lambda p: p.mapper_fn(lambda b, c: (b["x"], c), "abc"),
     "carry must be an array or a number, got 'abc' of type str"),
    (lambda p: p.map_fn(lambda b, c: (b["x"], c), p.init_fn(),
                        {"a": (1.0, object())}),
     r"carry\['a'\]\[1\] must be an array or a number, got <object"),
    (lambda p: p.map_fn(lambda b, c: ("a", c), p.init_fn(), 0.0),
     r"the result must be an array or a number \(returned by fun=.*\), got "
     "'a' of type str"),
    (lambda p: p.mapper_fn(lambda o, c: ("a", c), 0.0, batched=False),
     r"the result must be an array or a number \(returned by fun="),
    # The shape fun returned for one observation, not the vmapped (3,).
    (lambda p: p.mapper_fn(lambda o, c: o["x"], 0.0, batched=False),
     r"fun must return a pair \(result, carry\), got an array of shape \(\) "
     "from fun="),
])
def test_what_jax_cannot_take_is_named_in_the_passes_terms(call, message):
  """A carry or a result JAX cannot hold was JAX's error about the
  library's own inner functions ("Error interpreting argument to
  <function Traced.__init__.<locals>.<lambda>>")."""
  loader = jax_data.NumpyDataLoader(x=np.arange(10.0, dtype=np.float32))

  class Pipes:
    init_fn, map_fn, _ = full = jax_data.full_reference_data(loader, 2, 3)
    mapper_fn, _ = mapper = jax_data.full_data_mapper(loader, 2, 3)

  with pytest.raises(TypeError, match=message):
    call(Pipes)
  Pipes.full.release_fn()
  Pipes.mapper.release_fn()
