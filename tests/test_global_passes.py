"""Full-data passes split over a mesh axis
(``full_data_mapper(..., mesh=, batch_axis=)``).

The invariant: the results are the results of the pass without a mesh,
observation for observation (or batch for batch), and each observation is
visited once over all devices. Several processes: tests/test_distributed.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_data
from jax_data import NumpyDataLoader
from jax_data.compiled.global_passes import PassSplit
from tests.counted import CountedRows


def _mesh(devices=4):
  if jax.device_count() < devices:  # a GPU machine: its one GPU
    pytest.skip(f"needs {devices} devices (conftest.py forces 4 CPU "
                f"devices; the default devices here are "
                f"{jax.device_count()})")
  return Mesh(np.array(jax.devices()[:devices]), ("data",))


@pytest.mark.parametrize("count, mb_size, cache, devices", [
    (1001, 16, 4, 4), (23, 5, 2, 4), (10, 2, 1, 4), (64, 4, 3, 4),
    (17, 4, 2, 2), (9, 9, 1, 1),
    # The last device's block only the last batch, partial.
    (11, 3, 1, 4), (5, 3, 2, 2), (7, 2, 1, 4)])
def test_a_split_pass_gives_the_results_of_one_pass(pipelines, count,
                                                    mb_size, cache, devices):
  x = np.random.default_rng(count).normal(size=count).astype(np.float32)
  loader = NumpyDataLoader(x=x, index=np.arange(count))
  split_fn, split_release = pipelines.full_data_mapper(
      loader, cache, mb_size, mesh=_mesh(devices), batch_axis="data")
  one_fn, one_release = pipelines.full_data_mapper(loader, cache, mb_size)

  per_observation = lambda b, c: (b["index"] * 2, c)
  got, _ = jax.jit(lambda: split_fn(per_observation, None))()
  expected, _ = one_fn(per_observation, None)
  np.testing.assert_array_equal(got, expected)
  np.testing.assert_array_equal(got, 2 * np.arange(count))

  per_batch = lambda b, m, c: (jnp.sum(jnp.where(m, b["x"], 0.0)),
                               c + jnp.sum(m))
  sums, counts = split_fn(per_batch, 0, masking=True)
  expected_sums, _ = one_fn(per_batch, 0, masking=True)
  np.testing.assert_allclose(sums, expected_sums, rtol=1e-6)
  # Each device counted its own observations: all of them, once.
  assert counts.shape == (devices,) and int(counts.sum()) == count
  np.testing.assert_allclose(float(jnp.sum(sums)), float(np.sum(
      x.astype(np.float64))), rtol=1e-5)

  # Unmasked rows too: the last batch's fillers are the pass's first
  # observations (they were the last device's block's first).
  rows, _ = split_fn(lambda b, m, c: (b["index"], c), None, masking=True)
  np.testing.assert_array_equal(
      rows, one_fn(lambda b, m, c: (b["index"], c), None, masking=True)[0])

  plus_one, _ = split_fn(lambda o, c: (o["index"] + 1, c), None,
                         batched=False)
  np.testing.assert_array_equal(plus_one, np.arange(count) + 1)
  split_release()
  one_release()


def test_a_mesh_of_explicit_axes(pipelines):
  """jax.make_mesh's axes are Explicit: the blocks the devices computed
  are typed as sharded, and their gather back to pass order failed with a
  ShardingTypeError. The results are those of an Auto mesh's pass."""
  _mesh()
  explicit = jax.make_mesh((4,), ("data",), axis_types=(
      jax.sharding.AxisType.Explicit,))
  count = 103
  loader = NumpyDataLoader(x=np.arange(count, dtype=np.float32))
  results = []
  for mesh in (explicit, _mesh()):
    split_fn, release = pipelines.full_data_mapper(loader, 3, 5, mesh=mesh,
                                                   batch_axis="data")
    each, _ = jax.jit(lambda f=split_fn: f(lambda b, c: (b["x"] * 2, c),
                                           None))()
    sums, _ = jax.jit(lambda f=split_fn: f(
        lambda b, m, c: (jnp.sum(jnp.where(m, b["x"], 0.0)), c), None,
        masking=True))()
    results.append((np.asarray(each), np.asarray(sums)))
    release()
  np.testing.assert_array_equal(results[0][0], 2 * np.arange(count))
  for got, want in zip(*results):
    np.testing.assert_array_equal(got, want)
  # A carry sharded over the explicit axis enters each block whole; an
  # array on the mesh that fun closes over is refused, sharded or
  # replicated, closed over or an argument of the enclosing jit (JAX
  # cannot close over either inside a shard_map), and the error says to
  # pass it in the carry (it said to replicate it, which did not help).
  split_fn, release = pipelines.full_data_mapper(loader, 3, 5, mesh=explicit,
                                                 batch_axis="data")
  sharded = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(
      explicit, jax.sharding.PartitionSpec("data")))
  sums, carries = jax.jit(lambda c: split_fn(
      lambda b, m, c: (jnp.sum(jnp.where(m, b["x"], 0.0)) * c.sum(), c), c,
      masking=True))(sharded)
  np.testing.assert_allclose(np.sum(sums), 6 * np.sum(np.arange(count)))
  assert carries.shape == (4, 4)
  replicated = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(
      explicit, jax.sharding.PartitionSpec()))
  fun = lambda w: lambda b, m, c: (
      jnp.sum(jnp.where(m, b["x"], 0.0)) * w.sum(), c)
  for on_mesh in (sharded, replicated):
    for call in (lambda w: jax.jit(lambda: split_fn(fun(w), None,
                                                    masking=True))(),
                 jax.jit(lambda w: split_fn(fun(w), None, masking=True))):
      with pytest.raises(ValueError, match="mesh of explicit axes.*pass it "
                         "in the carry, or close over a NumPy array"):
        call(on_mesh)
  sums, _ = jax.jit(lambda: split_fn(fun(np.arange(4.0, dtype=np.float32)),
                                     None, masking=True))()
  np.testing.assert_allclose(np.sum(sums), 6 * np.sum(np.arange(count)))
  release()


def test_an_index_into_an_array_placed_on_an_auto_mesh(pipelines):
  """fun indexing an array placed on an ordinary mesh, closed over: JAX
  cannot index it inside the pass's shard_map, and the error says what to
  do; passed into jit, in the carry, or as a NumPy array, it gives the
  pass without a mesh."""
  mesh = _mesh()
  count = 103
  loader = NumpyDataLoader(x=np.arange(count, dtype=np.float32))
  split_fn, release = pipelines.full_data_mapper(loader, 2, 8, mesh=mesh,
                                                 batch_axis="data")
  w = np.arange(4.0, dtype=np.float32)
  fun = lambda w: lambda b, m, c: (
      jnp.sum(jnp.where(m, b["x"], 0.0)) * w[1], c)
  for spec in (jax.sharding.PartitionSpec("data"),
               jax.sharding.PartitionSpec()):
    on_mesh = jax.device_put(w, jax.sharding.NamedSharding(mesh, spec))
    with pytest.raises(ValueError, match="fun indexes an array placed on "
                       "the mesh.*pass it in the carry"):
      split_fn(fun(on_mesh), None, masking=True)
    assert float(jnp.sum(jax.jit(lambda w: split_fn(
        fun(w), None, masking=True)[0])(on_mesh))) == np.sum(np.arange(count))
    sums, _ = split_fn(lambda b, m, c: (
        jnp.sum(jnp.where(m, b["x"], 0.0)) * c[1], c), on_mesh,
                       masking=True)
    assert float(jnp.sum(sums)) == np.sum(np.arange(count))
  assert float(jnp.sum(split_fn(fun(w), None, masking=True)[0])) == (
      np.sum(np.arange(count)))
  release()


def test_a_gradient_over_all_data_inside_jit():
  x = np.random.default_rng(0).normal(1.5, 1.0, 333).astype(np.float32)
  loader = NumpyDataLoader(x=x)
  split_fn, release_fn = jax_data.full_data_mapper(
      loader, 3, 10, mesh=_mesh(), batch_axis="data")

  def log_likelihood(mu):
    sums, _ = split_fn(lambda b, m, c: (jnp.sum(
        jnp.where(m, -0.5 * (b["x"] - mu) ** 2, 0.0)), c), None,
                       masking=True)
    return jnp.sum(sums)

  grad = jax.jit(jax.grad(log_likelihood))(0.5)
  np.testing.assert_allclose(grad, np.sum(x.astype(np.float64) - 0.5),
                             rtol=1e-5)
  release_fn()


def test_a_split_pass_reads_each_share_once(pipelines):
  """Each device's share of 3 batches is served in 2 chunks of 2: the last
  one ends in an invalid batch of the share's first record, read again,
  not the share's first batch (23 records read 31 times a pass before)."""
  source = CountedRows(np.arange(23, dtype=np.float32))
  mapper_fn, release_fn = pipelines.full_data_mapper(
      jax_data.SourceDataLoader(source, workers=0), 2, 2, mesh=_mesh(4),
      batch_axis="data")
  source.reads = 0
  sums, _ = mapper_fn(lambda b, m, c: (jnp.sum(jnp.where(m, b["x"], 0.0)),
                                       c), None, masking=True)
  assert float(jnp.sum(sums)) == 253.0
  # Each record once, each share's first again, and the pass's first,
  # which fills its last batch.
  assert source.reads == 23 + 4 + 1
  release_fn()


def test_the_split_covers_every_batch_once():
  for count, mb, devices in [(1001, 16, 4), (10, 2, 4), (17, 4, 2),
                             (100, 1, 7)]:
    split = PassSplit(count, mb, devices)
    blocks = [split.block(d) for d in range(devices)]
    assert [b for block in blocks for b in block] == list(
        range(split.batches))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    assert max(map(len, blocks)) == split.per_device
    seen = np.concatenate([
        np.arange(r.start, r.start + r.count)
        for r in (split.observations(d) for d in range(devices))])
    np.testing.assert_array_equal(seen, np.arange(count))
    order = split.order(per_observation=True)
    assert len(order) == count and len(set(order.tolist())) == count


def test_bad_split_passes_are_named():
  loader = NumpyDataLoader(x=np.arange(10.0))
  with pytest.raises(ValueError, match="does not split over the 4 devices"):
    jax_data.full_data_mapper(loader, 1, 4, mesh=_mesh(), batch_axis="data")
  with pytest.raises(ValueError, match="shard_index and shard_count do not"):
    jax_data.full_data_mapper(loader, 1, 2, mesh=_mesh(), batch_axis="data",
                              shard_index=0, shard_count=2)
  with pytest.raises(ValueError, match="batch_axis must be one of"):
    jax_data.full_data_mapper(loader, 1, 2, mesh=_mesh())
  with pytest.raises(TypeError, match="needs a host loader"):
    jax_data.full_data_mapper(jax_data.DeviceNumpyDataLoader(
        x=np.arange(10.0)), 1, 2, mesh=_mesh(), batch_axis="data")
  mapper_fn, release_fn = jax_data.full_data_mapper(
      loader, 1, 2, mesh=_mesh(), batch_axis="data")
  with pytest.raises(ValueError, match="neither information=True"):
    mapper_fn(lambda b, c: (b["x"], c), None, information=True)
  with pytest.raises(ValueError, match="masking=True needs a batched fun"):
    mapper_fn(lambda b, m, c: (b["x"], c), None, masking=True,
              batched=False)
  with pytest.raises(TypeError, match="fun must be callable"):
    mapper_fn(3, None)
  release_fn()
  with pytest.raises(jax_data.PipelineReleasedError):
    mapper_fn(lambda b, c: (b["x"], c), None)
  # Last, so that the checks above run without TensorFlow too.
  tf = pytest.importorskip("tensorflow")
  with pytest.raises(ValueError, match=r"passes split the data over devices"
                     r", which needs a loader that reads rows by index "
                     r"\(NumpyDataLoader, SourceDataLoader\); "
                     r"TensorflowDataLoader"):
    jax_data.full_data_mapper(jax_data.TensorflowDataLoader(
        tf.data.Dataset.from_tensor_slices({"x": np.arange(10.0)}),
        in_memory=True), 1, 2, mesh=_mesh(), batch_axis="data")


def test_a_carry_jax_takes_for_no_array_is_named():
  """As the pass without a mesh names it; it failed inside JAX."""
  mapper_fn, release_fn = jax_data.full_data_mapper(
      NumpyDataLoader(x=np.arange(10.0)), 2, 2, mesh=_mesh(2),
      batch_axis="data")
  with pytest.raises(TypeError, match="carry must be an array or a number, "
                     "got 's' of type str"):
    mapper_fn(lambda batch, carry: (batch["x"], carry), "s")
  release_fn()
