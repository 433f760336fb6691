"""Global batches: one chain's batch split over a mesh axis
(``random_reference_data(..., mesh=, batch_axis=, chain_axis=)``).

The invariant: the global batch equals the batch of the same seed without
a mesh, batch for batch, whatever the devices; each device's host part
chain reads only its rows. Several processes: tests/test_distributed.py.
"""

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

import jax_data
from jax_data import NumpyDataLoader
from jax_data import SourceDataLoader
from jax_data.loaders.chains import BatchPart
from jax_data.loaders.chains import RandomChain
from jax_data.loaders.chains import spec_from_json
from jax_data.loaders.chains import spec_to_json
from jax_data.sampling import ObservationRange

N, CACHE, MB, STEPS = 101, 3, 8, 7
MODES = [dict(seed=5), dict(seed=5, shuffle=True),
         dict(seed=5, shuffle=True, in_epochs=True),
         dict(seed=5, shuffle=True, in_epochs=True, stream="counter")]


def _data():
  x = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
  return {"x": x, "y": (x[:, 0] > 0).astype(np.float32),
          "index": np.arange(N)}


def _mesh(shape=(4,), names=("data",)):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape),
              names)


def _solo(loader, steps=STEPS, **kwargs):
  """Batches and masks of the chain without a mesh."""
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, CACHE, MB)
  state, batches, masks = init_fn(**kwargs), [], []
  for _ in range(steps):
    state, (batch, info) = batch_fn(state, information=True)
    batches.append(np.asarray(batch["index"]))
    masks.append(np.asarray(info.mask))
  release_fn()
  return np.stack(batches), np.stack(masks)


@pytest.mark.parametrize("field,value,match", [
    ("position", 5, r"position=\[5\], which must be in 0 .. 2"),
    ("position", -3, r"position=\[-3\]"),
    ("chunk", -4, r"chunk=\[-4\]"),
    ("chain", 99, "chain 99, which this pipeline's init_fn did not create"),
])
def test_a_state_edited_by_hand_is_refused_as_without_a_mesh(field, value,
                                                             match):
  """A mesh pipeline checked only the state's pipeline: a position past
  the cache moved the chain to another chunk, and a chunk or chain out of
  range failed inside the host callback."""
  pipeline = jax_data.random_reference_data(
      NumpyDataLoader(**_data()), CACHE, MB, mesh=_mesh(), batch_axis="data")
  init_fn, batch_fn, release_fn = pipeline
  state = init_fn(seed=0)
  edited = state._replace(**{field: np.full_like(
      np.asarray(getattr(state, field)), value)})
  with pytest.raises(ValueError, match="batch_fn got a state .*" + match):
    batch_fn(edited)
  with pytest.raises(ValueError, match="state_to_pytree got a state .*"
                     + match):
    jax_data.state_to_pytree(pipeline, edited)
  assert jax.jit(batch_fn)(state)[0].chunk.tolist() == 0
  release_fn()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(m)[5:] or
                         "draws")
def test_global_batch_equals_the_batch_without_a_mesh(pipelines, mode):
  loader = NumpyDataLoader(**_data())
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(
      loader, CACHE, MB, mesh=_mesh(), batch_axis="data")
  step = jax.jit(lambda s: batch_fn(s, information=True))
  state, batches, masks = init_fn(**mode), [], []
  for _ in range(STEPS):
    state, (batch, info) = step(state)
    assert batch["x"].shape == (MB, 3)
    assert batch["x"].sharding.spec == PartitionSpec("data")
    assert info.batch_size == MB and info.observation_count == N
    batches.append(np.asarray(batch["index"]))
    masks.append(np.asarray(info.mask))
  release_fn()
  expected, expected_masks = _solo(loader, **mode)
  np.testing.assert_array_equal(np.stack(batches), expected)
  np.testing.assert_array_equal(np.stack(masks), expected_masks)


def test_chains_and_batch_rows_on_a_2d_mesh_with_jax_data_scan(pipelines):
  loader = NumpyDataLoader(**_data())
  mesh = _mesh((2, 2), ("chains", "data"))
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(
      loader, CACHE, MB, mesh=mesh, batch_axis="data", chain_axis="chains")
  seeds = [3, 4, 5, 6]

  @jax.jit
  def run(state):
    return jax_data.scan(lambda c, b: (c + jnp.sum(b["x"]), b["index"]),
                         0.0, state, batch_fn=batch_fn, length=STEPS)

  # Chains made together draw counter-based streams by default.
  (_, state), drawn = run(init_fn(seed=seeds, shuffle=True))
  assert drawn.shape == (STEPS, 4, MB)
  for c, seed in enumerate(seeds):
    np.testing.assert_array_equal(
        drawn[:, c], _solo(loader, seed=seed, shuffle=True,
                           stream="counter")[0])
  # The scan's final state goes on as batch_fn's would.
  state, batch = batch_fn(state)
  assert batch["index"].sharding.spec == PartitionSpec("chains", "data")
  for c, seed in enumerate(seeds):
    np.testing.assert_array_equal(
        batch["index"][c], _solo(loader, STEPS + 1, seed=seed,
                                 shuffle=True, stream="counter")[0][-1])
  release_fn()


@pytest.mark.parametrize("before, length", [(0, 7), (1, 8), (2, 1),
                                             (0, 0), (3, 6)])
def test_jax_data_scan_of_global_batches_equals_batch_fn(pipelines, before,
                                                         length):
  """The chunked scan (each chunk's global batches scanned over) gives
  batch_fn's batches, masks and final state, from inside a chunk too."""
  loader = NumpyDataLoader(**_data())
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(
      loader, CACHE, MB, mesh=_mesh(), batch_axis="data")
  state = init_fn(seed=4, shuffle=True, in_epochs=True)
  for _ in range(before):
    state, _ = batch_fn(state)

  @jax.jit
  def run(state):
    return jax_data.scan(
        lambda c, b: (c + jnp.sum(jnp.where(b[1].mask, b[0]["x"][:, 0], 0)),
                      (b[0]["index"], b[1].mask)),
        0.0, state, batch_fn=batch_fn, length=length, information=True)

  (total, end), (drawn, masks) = run(state)
  expected, expected_masks, expected_total = [], [], 0.0
  for _ in range(length):
    state, (batch, info) = batch_fn(state, information=True)
    expected.append(np.asarray(batch["index"]))
    expected_masks.append(np.asarray(info.mask))
    expected_total += float(np.sum(np.where(info.mask, batch["x"][:, 0], 0)))
  if length:
    np.testing.assert_array_equal(drawn, np.stack(expected))
    np.testing.assert_array_equal(masks, np.stack(expected_masks))
    assert drawn.sharding.spec == PartitionSpec(None, "data")
  np.testing.assert_allclose(total, expected_total, rtol=1e-5)
  assert (int(end.chunk), int(end.position)) == (int(state.chunk),
                                                 int(state.position))
  np.testing.assert_array_equal(batch_fn(end)[1]["index"],
                                batch_fn(state)[1]["index"])
  release_fn()


def test_a_data_parallel_gradient_equals_the_single_device_one():
  loader = NumpyDataLoader(**_data())
  loss = lambda w, b: jnp.sum(jnp.logaddexp(0.0, b["x"] @ w)
                              - b["y"] * (b["x"] @ w))
  results = []
  for mesh in (None, _mesh()):
    extra = {} if mesh is None else dict(mesh=mesh, batch_axis="data")
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, CACHE, MB, **extra)

    @jax.jit
    def sgd(w, state, batch_fn=batch_fn):
      state, batch = batch_fn(state)
      return w - 0.1 * jax.grad(loss)(w, batch), state

    w, state = jnp.zeros(3), init_fn(seed=1, shuffle=True)
    for _ in range(STEPS):
      w, state = sgd(w, state)
    results.append(np.asarray(w))
    release_fn()
  np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


class _Records:
  """A random-access source that records which records are read."""

  def __init__(self, data):
    self._data = data
    self.read = []
    self._lock = threading.Lock()

  def __len__(self):
    return len(self._data["index"])

  def __getitem__(self, i):
    with self._lock:
      self.read.append(int(i))
    return {k: v[i] for k, v in self._data.items()}


def test_each_part_reads_only_its_rows():
  source = _Records(_data())
  loader = SourceDataLoader(source, workers=1)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, CACHE, MB, mesh=_mesh(), batch_axis="data")
  del source.read[:]  # what the loader read to learn the records' format
  state = init_fn(seed=2, shuffle=True, stream="counter")
  for _ in range(CACHE + 1):  # into the second chunk
    state, batch = batch_fn(state)
  # Every device's request made (dispatch is asynchronous: one made after
  # the wait below had its read cut short by the release).
  jax.block_until_ready((state, batch))
  pipeline = jax_data.pipeline.of(batch_fn)
  assert pipeline.host.wait_idle()  # chunks produced ahead, all parts
  parts = sorted(pipeline.host.chain(n).spec.part.index
                 for n in pipeline.host.chains())
  assert parts == [0, 1, 2, 3]
  release_fn()
  chunks, rest = divmod(len(source.read), CACHE * MB)
  assert chunks >= 2 and rest == 0, len(source.read)
  solo, _ = _solo(NumpyDataLoader(**_data()), chunks * CACHE, seed=2,
                  shuffle=True, stream="counter")
  # The rows of whole chunks, each once over all devices, not once per
  # device.
  assert sorted(source.read) == sorted(solo.reshape(-1).tolist())


@pytest.mark.parametrize("stream", ["exact", "counter"])
def test_checkpoints_hold_whole_chains_and_restore_on_any_mesh(
    tmp_path, stream):
  loader = NumpyDataLoader(**_data())
  on = lambda mesh: jax_data.random_reference_data(
      loader, CACHE, MB, mesh=mesh, batch_axis="data")
  four, two, plain = on(_mesh()), on(_mesh((2,))), (
      jax_data.random_reference_data(loader, CACHE, MB))
  mode = dict(seed=9, shuffle=True, stream=stream)
  state = four[0](**mode)
  for _ in range(4):
    state, _ = four[1](state)
  jax_data.save_checkpoint(tmp_path / "global.npz", four, state)
  expected = _solo(loader, 9, **mode)[0][4:]
  for pipeline in (four, two, plain):
    restored = jax_data.restore_checkpoint(tmp_path / "global.npz", pipeline)
    for k in range(len(expected)):
      restored, batch = pipeline[1](restored)
      np.testing.assert_array_equal(batch["index"], expected[k])
  # A chain saved without a mesh continues on one.
  state = plain[0](**mode)
  for _ in range(4):
    state, _ = plain[1](state)
  tree = jax_data.state_to_pytree(plain, state)
  restored = jax_data.state_from_pytree(four, tree)
  for k in range(len(expected)):
    restored, batch = four[1](restored)
    np.testing.assert_array_equal(batch["index"], expected[k])
  for pipeline in (four, two, plain):
    pipeline[2]()


@pytest.mark.parametrize("length", [6, 2])
def test_scan_returns_ys_on_a_mesh_of_explicit_axes(length):
  """On jax.make_mesh's mesh (explicit axes: arrays typed by their
  sharding), jax_data.scan's ys are the lax.scan's over batch_fn."""
  mesh = jax.make_mesh((4,), ("data",), axis_types=(
      jax.sharding.AxisType.Explicit,))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      NumpyDataLoader(**_data()), CACHE, MB, mesh=mesh, batch_axis="data")
  body = lambda c, b: (c + jnp.sum(b["index"]), b["index"])

  def stepped(state):
    def step(loop, _):
      c, state = loop
      state, batch = batch_fn(state)
      c, y = body(c, batch)
      return (c, state), y
    return jax.lax.scan(step, (0, state), None, length=length)

  (expected, _), expected_ys = jax.jit(stepped)(init_fn(seed=1))
  (c, _), ys = jax.jit(lambda s: jax_data.scan(
      body, 0, s, batch_fn=batch_fn, length=length))(init_fn(seed=1))
  assert int(c) == int(expected)
  np.testing.assert_array_equal(ys, expected_ys)
  release_fn()


@pytest.mark.parametrize("mesh", [(4,), None])
def test_a_chain_made_after_a_restore_does_not_draw_a_restored_seed(mesh):
  """In a resumed job (a new loader and pipeline), chains restored and
  then one made without a seed: the new chain draws its own batches, as
  it does without a mesh (the default seeds follow the restored chains)."""
  on = lambda: jax_data.random_reference_data(
      NumpyDataLoader(**_data()), CACHE, MB, **(
          {} if mesh is None else dict(mesh=_mesh(mesh), batch_axis="data")))
  saved = on()
  tree = jax_data.state_to_pytree(saved, saved[0](shuffle=True))
  saved[2]()
  resumed = on()
  restored = jax_data.state_from_pytree(resumed, tree)
  fresh = resumed[0](shuffle=True)
  _, restored_batch = resumed[1](restored)
  _, fresh_batch = resumed[1](fresh)
  assert not np.array_equal(restored_batch["index"], fresh_batch["index"])
  resumed[2]()


def test_a_2d_checkpoint_restores_as_vmapped_chains():
  loader = NumpyDataLoader(**_data())
  grid = jax_data.random_reference_data(
      loader, CACHE, MB, mesh=_mesh((2, 2), ("chains", "data")),
      batch_axis="data", chain_axis="chains")
  plain = jax_data.random_reference_data(loader, CACHE, MB)
  state = grid[0](seed=[1, 2], shuffle=True, in_epochs=True)
  for _ in range(4):
    state, _ = grid[1](state)
  tree = jax_data.state_to_pytree(grid, state)
  stacked = jax_data.state_from_pytree(plain, tree)
  again = jax_data.state_from_pytree(grid, tree)
  step = jax.jit(jax.vmap(plain[1]))
  for _ in range(4):
    state, batch = grid[1](state)
    again, batch_again = grid[1](again)
    stacked, batch_stacked = step(stacked)
    np.testing.assert_array_equal(batch["index"], batch_stacked["index"])
    np.testing.assert_array_equal(batch["index"], batch_again["index"])
  one = jax_data.state_to_pytree(plain, plain[0](seed=1))
  # One chain picked does not fill a chain axis of 2 devices; the
  # checkpoint's two would (the error said it held fewer chains).
  with pytest.raises(ValueError, match=re.escape(
      "lanes=[0] picks 1 of the 2 chains of the checkpoint (its lanes "
      "(2,)), but a global pipeline with chain_axis restores chains whose "
      "number the 2 devices of the chain axis divide")):
    jax_data.state_from_pytree(grid, tree, lanes=[0])
  # Every lane picked and still too few: what would fit, as without a pick.
  with pytest.raises(ValueError, match="it holds fewer chains"):
    jax_data.state_from_pytree(grid, one, lanes=[0])
  # A checkpoint of one chain: no pick would, so the error says what would.
  with pytest.raises(ValueError, match=re.escape(
      "the checkpoint's state has lanes (), which do not fit: a global "
      "pipeline with chain_axis restores chains whose number the 2 devices "
      "of the chain axis divide; it holds fewer chains: restore it onto a "
      "mesh with fewer devices along the chain axis")):
    jax_data.state_from_pytree(grid, one)
  for pipeline in (grid, plain):
    pipeline[2]()


def test_bad_meshes_and_arguments_are_named():
  loader = NumpyDataLoader(**_data())
  build = lambda **kw: jax_data.random_reference_data(loader, CACHE, MB, **kw)
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    build(mesh="data", batch_axis="data")
  with pytest.raises(ValueError, match="batch_axis must be one of"):
    build(mesh=_mesh(), batch_axis="rows")
  with pytest.raises(ValueError, match="batch_axis must be one of"):
    build(mesh=_mesh())
  with pytest.raises(ValueError, match="chain_axis and batch_axis must"):
    build(mesh=_mesh(), batch_axis="data", chain_axis="data")
  with pytest.raises(ValueError, match="every axis of the mesh"):
    build(mesh=_mesh((2, 2), ("a", "data")), batch_axis="data")
  with pytest.raises(ValueError, match="mb_size=6 must split evenly"):
    jax_data.random_reference_data(loader, CACHE, 6, mesh=_mesh(),
                                   batch_axis="data")
  with pytest.raises(TypeError, match="need a host loader"):
    jax_data.random_reference_data(
        jax_data.DeviceNumpyDataLoader(x=np.arange(N)), CACHE, MB,
        mesh=_mesh(), batch_axis="data")
  grid = build(mesh=_mesh((2, 2), ("chains", "data")), batch_axis="data",
               chain_axis="chains")
  with pytest.raises(ValueError, match="a sequence of seeds"):
    grid[0](seed=3)
  with pytest.raises(ValueError, match="a sequence of seeds"):
    grid[0](seed=[1, 2, 3])
  with pytest.raises(TypeError, match="unknown keyword"):
    grid[0](seed=[1, 2], shufle=True)
  # Seeds as a 1-D array, as without a mesh (refused as not a sequence).
  for seeds in (np.array([1, 2]), jnp.array([1, 2]), range(1, 3)):
    state = grid[0](seed=seeds)
    assert np.asarray(state.chunk).shape == (2,)
  init_fn, batch_fn, release_fn = build(mesh=_mesh(), batch_axis="data")
  for seeds in ([0, 1], (0, 1), range(2), np.array([0, 1])):
    with pytest.raises(TypeError, match=re.escape(
        f"seed must be an integer, got seed={seeds!r}; a sequence of seeds "
        "makes several chains, which on a mesh need chain_axis")):
      init_fn(seed=seeds)
  state = init_fn(seed=1)
  with pytest.raises(ValueError, match="device_count does not apply"):
    batch_fn(state, device_count=4)
  with pytest.raises(TypeError, match="does not belong to this pipeline"):
    batch_fn(grid[0](seed=[1, 2]))
  with pytest.raises(TypeError, match="expects a CacheState"):
    batch_fn({"chain": 0})
  release_fn()
  grid[2]()


def test_loaders_that_do_not_read_by_index_refuse_parts():
  tf = pytest.importorskip("tensorflow")
  from jax_data.tensorflow_loader import TensorflowDataLoader
  dataset = tf.data.Dataset.from_tensor_slices({"x": np.arange(N)})
  loader = TensorflowDataLoader(dataset, shuffle_cache=10)
  init_fn, _, release_fn = jax_data.random_reference_data(
      loader, CACHE, MB, mesh=_mesh(), batch_axis="data")
  with pytest.raises(ValueError, match="reads rows by index"):
    init_fn(seed=1)
  release_fn()


def test_a_part_is_kept_in_the_chain_spec():
  spec = RandomChain(3, ObservationRange(0, N), True, False, "counter",
                     BatchPart(1, 4))
  assert spec_from_json(spec_to_json(spec)) == spec
  whole = RandomChain(3, ObservationRange(0, N))
  assert "part" not in spec_to_json(whole)
  assert spec_from_json(spec_to_json(whole)) == whole
  with pytest.raises(ValueError, match="part index"):
    spec_from_json(dict(spec_to_json(spec), part={"index": 4, "count": 4}))


def test_an_init_fn_call_ended_early_leaves_no_part(monkeypatch):
  # A Ctrl-C while the parts of a global state are registered: none of
  # them stays, and the next call serves the chains of a fresh pipeline.
  loader = NumpyDataLoader(**_data())
  mesh = _mesh((2, 2), ("chains", "data"))
  pipeline = jax_data.random_reference_data(
      loader, CACHE, MB, mesh=mesh, batch_axis="data", chain_axis="chains")
  init_fn, batch_fn, release_fn = pipeline
  register, made = pipeline.host.register, []

  def interrupted(spec):
    made.append(spec)
    if len(made) == 3:
      raise KeyboardInterrupt
    return register(spec)

  monkeypatch.setattr(pipeline.host, "register", interrupted)
  with pytest.raises(KeyboardInterrupt):
    init_fn(seed=[3, 4], shuffle=True)
  assert pipeline.host.chains() == []
  monkeypatch.undo()
  state, batch = batch_fn(init_fn(seed=[3, 4], shuffle=True))
  assert len(pipeline.host.chains()) == 4  # two chains of two parts
  for c, seed in enumerate([3, 4]):
    np.testing.assert_array_equal(
        batch["index"][c], _solo(loader, 1, seed=seed, shuffle=True,
                                 stream="counter")[0][0])
  release_fn()
