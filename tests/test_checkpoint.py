"""Checkpoints restore the data position exactly, also in a new process."""

import copy
import io
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_data
from jax_data import NumpyDataLoader
from jax_data.host_loader import StoreLimits
from tests.counted import CountedRows

MODES = [dict(), dict(shuffle=True), dict(shuffle=True, in_epochs=True)]
N, CACHE, MB = 37, 4, 5


def _pipeline():
  return jax_data.random_reference_data(NumpyDataLoader(x=np.arange(N)),
                                        CACHE, MB)


def _run(batch_fn, steps):
  def body(state, _):
    state, (batch, info) = batch_fn(state, information=True)
    return state, (batch["x"], info.mask)
  return jax.jit(lambda s: lax.scan(body, s, None, length=steps))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("steps", [0, 3, 4, 9])
def test_restore_continues_with_the_same_batches(tmp_path, mode, steps):
  pipeline = _pipeline()
  init_fn, batch_fn, _ = pipeline
  state, _ = _run(batch_fn, max(steps, 1))(init_fn(**mode)) if steps else (
      init_fn(**mode), None)
  path = tmp_path / "data.npz"
  jax_data.save_checkpoint(path, pipeline, state)
  _, expected = _run(batch_fn, 11)(state)
  # A new loader and pipeline, as after a restart.
  fresh = _pipeline()
  restored = jax_data.restore_checkpoint(path, fresh)
  _, got = _run(fresh[1], 11)(restored)
  assert got[0].tolist() == expected[0].tolist()
  assert got[1].tolist() == expected[1].tolist()


def test_stacked_states_and_init_fn_as_handle(tmp_path):
  pipeline = _pipeline()
  init_fn, batch_fn, _ = pipeline
  states = jax.tree_util.tree_map(
      lambda *xs: jnp.stack(xs), *[init_fn(seed=s, **m)
                                   for s, m in enumerate(MODES)])
  run = jax.jit(jax.vmap(lambda s: lax.scan(
      lambda s, _: batch_fn(s), s, None, length=6)))
  states, _ = run(states)
  tree = jax_data.state_to_pytree(init_fn, states)
  frozen = copy.deepcopy(tree)
  _, expected = run(states)
  fresh = _pipeline()
  restored = jax_data.state_from_pytree(fresh[0], pickle.loads(
      pickle.dumps(tree)))
  _, got = jax.jit(jax.vmap(lambda s: lax.scan(
      lambda s, _: fresh[1](s), s, None, length=6)))(restored)
  assert got["x"].tolist() == expected["x"].tolist()
  assert all(np.array_equal(tree[k], frozen[k]) for k in tree)
  # The functions packed into a tuple again are a handle too; functions of
  # two pipelines are not.
  again = jax_data.state_to_pytree((init_fn, batch_fn, pipeline[2]), states)
  assert all(np.array_equal(again[k], tree[k]) for k in tree)
  with pytest.raises(TypeError, match="pipeline="):
    jax_data.state_to_pytree((init_fn, fresh[1]), states)


def test_full_reference_state_and_device_loader(tmp_path):
  loader = NumpyDataLoader(x=np.arange(10))
  pipeline = jax_data.full_reference_data(loader, 2, 3)
  state = pipeline[0]()
  tree = jax_data.state_to_pytree(pipeline, state)
  fresh = jax_data.full_reference_data(NumpyDataLoader(x=np.arange(10)), 2, 3)
  restored = jax_data.state_from_pytree(fresh, tree)
  _, (values, _) = fresh[1](lambda b, c: (b["x"], c), restored, None)
  assert values.tolist() == list(range(10))

  device = jax_data.random_reference_data(
      jax_data.DeviceNumpyDataLoader(x=np.arange(10)), 1, 3)
  state = device[0](key=jax.random.PRNGKey(5))
  state, _ = device[1](state)
  again = jax_data.state_from_pytree(device,
                                     jax_data.state_to_pytree(device, state))
  assert device[1](again)[1]["x"].tolist() == device[1](state)[1]["x"].tolist()


def test_a_restored_state_donated_leaves_the_pipeline_whole():
  """A restored state of one chain is the user's to donate: its arrays
  are its own, where they were the pipeline's template, which the donation
  deleted, and every later init_fn and batch_fn with it."""
  pipeline = _pipeline()
  init_fn, batch_fn, _ = pipeline
  tree = jax_data.state_to_pytree(pipeline, init_fn(seed=5))
  restored = jax_data.state_from_pytree(pipeline, tree)
  _, batch = jax.jit(batch_fn, donate_argnums=0)(restored)
  _, again = batch_fn(jax_data.state_from_pytree(pipeline, tree))
  assert batch["x"].tolist() == again["x"].tolist()
  _, fresh = batch_fn(init_fn(seed=6))
  assert fresh["x"].shape == batch["x"].shape


def test_mismatches_are_named_with_both_sides(tmp_path):
  pipeline = _pipeline()
  state = pipeline[0](seed=1)
  tree = jax_data.state_to_pytree(pipeline, state)
  other = jax_data.random_reference_data(NumpyDataLoader(x=np.arange(N)),
                                         CACHE, MB + 1)
  with pytest.raises(ValueError, match=r"its pipeline is .*'mb_size': 5.* "
                     r"but here it is .*'mb_size': 6"):
    jax_data.state_from_pytree(other, tree)
  smaller = jax_data.random_reference_data(
      NumpyDataLoader(x=np.arange(N - 1)), CACHE, MB)
  with pytest.raises(ValueError, match="'observation_count': 37"):
    jax_data.state_from_pytree(smaller, tree)
  host = json.loads(tree["host"].tobytes())
  host["version"] = 99
  bad = dict(tree, host=np.frombuffer(json.dumps(host).encode(), np.uint8))
  version = jax_data.checkpoint.FORMAT_VERSION
  with pytest.raises(ValueError, match=f"format version is 99, but here it "
                     f"is {version}"):
    jax_data.state_from_pytree(pipeline, bad)
  with pytest.raises(TypeError, match="pipeline must be"):
    jax_data.state_to_pytree(object(), state)


_RESTORE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jax import lax
    import jax_data
    path, steps = sys.argv[1], int(sys.argv[2])
    pipeline = jax_data.random_reference_data(
        jax_data.NumpyDataLoader(x=np.arange(%d)), %d, %d)
    state = jax_data.restore_checkpoint(path, pipeline)
    _, x = jax.jit(lambda s: lax.scan(
        lambda s, _: pipeline[1](s), s, None, length=steps))(state)
    print(json.dumps(x["x"].tolist()))
    """ % (N, CACHE, MB))


def _restored_in_new_process(script, path, steps):
  """The batches a fresh Python process draws after restoring ``path``."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run(
      [sys.executable, "-c", script, str(path), str(steps)], cwd=root,
      env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
      timeout=180)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", MODES)
def test_restore_in_a_fresh_process(tmp_path, mode):
  pipeline = _pipeline()
  init_fn, batch_fn, _ = pipeline
  state, _ = _run(batch_fn, 7)(init_fn(seed=12, **mode))
  path = tmp_path / "data.npz"
  jax_data.save_checkpoint(path, pipeline, state)
  _, (expected, _) = _run(batch_fn, 13)(state)
  assert _restored_in_new_process(_RESTORE, path, 13) == expected.tolist()


_RESTORE_TF = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import tensorflow as tf
    from jax import lax
    import jax_data
    path, steps = sys.argv[1], int(sys.argv[2])
    data = tf.data.Dataset.from_tensor_slices({"x": np.arange(%d)})
    pipeline = jax_data.random_reference_data(
        jax_data.TensorflowDataLoader(data, shuffle_cache=8), %d, %d)
    state = jax_data.restore_checkpoint(path, pipeline)
    _, x = jax.jit(lambda s: lax.scan(
        lambda s, _: pipeline[1](s), s, None, length=steps))(state)
    print(json.dumps(x["x"].tolist()))
    """ % (N, CACHE, MB))


def test_tensorflow_restore_in_a_fresh_process(tmp_path):
  tf = pytest.importorskip("tensorflow")
  data = tf.data.Dataset.from_tensor_slices({"x": np.arange(N)})
  pipeline = jax_data.random_reference_data(
      jax_data.TensorflowDataLoader(data, shuffle_cache=8), CACHE, MB)
  init_fn, batch_fn, _ = pipeline
  state, _ = _run(batch_fn, 9)(init_fn(seed=4))
  path = tmp_path / "tf.npz"
  jax_data.save_checkpoint(path, pipeline, state)
  _, (expected, _) = _run(batch_fn, 13)(state)
  assert _restored_in_new_process(_RESTORE_TF, path, 13) == expected.tolist()


def test_restore_into_other_data_of_the_same_size_is_refused():
  pipeline = _pipeline()
  state, _ = _run(pipeline[1], 3)(pipeline[0](seed=1))
  tree = jax_data.state_to_pytree(pipeline, state)
  same_shape = jax_data.random_reference_data(
      NumpyDataLoader(x=np.arange(N) + 1), CACHE, MB)
  with pytest.raises(ValueError, match="data is '[0-9a-f]+' in the "
                     "checkpoint but '[0-9a-f]+' here"):
    jax_data.state_from_pytree(same_shape, tree)
  # The same data, held another way (float64 memmap-like array without a
  # copy), restores.
  again = jax_data.random_reference_data(
      NumpyDataLoader(copy=False, x=np.arange(N, dtype=np.int64)), CACHE, MB)
  restored = jax_data.state_from_pytree(again, tree)
  _, expected = _run(pipeline[1], 5)(state)
  _, got = _run(again[1], 5)(restored)
  assert got[0].tolist() == expected[0].tolist()


@pytest.mark.parametrize("chain", [5, 0, -10, 2**31 - 1])
def test_a_device_loaders_state_names_a_kind_of_stream(chain):
  """A device loader's state of another chain value than its kinds (-1 to
  -4) drew one kind's batches, and was saved into a checkpoint that no
  restore took."""
  init_fn, batch_fn, _ = pipeline = jax_data.random_reference_data(
      jax_data.DeviceNumpyDataLoader(x=np.arange(10.0)), 1, 3)
  state = init_fn()
  edited = state._replace(chain=jnp.int32(chain))
  with pytest.raises(ValueError, match=f"batch_fn got a state with "
                     f"chain={chain}, where a device loader's state names "
                     "its kind of stream, -1 to -4"):
    batch_fn(edited)
  with pytest.raises(ValueError, match=f"state_to_pytree got a state with "
                     f"chain={chain}"):
    jax_data.state_to_pytree(pipeline, edited)
  states = init_fn(seed=range(3))
  jax_data.state_from_pytree(pipeline, jax_data.state_to_pytree(
      pipeline, jax.jit(jax.vmap(batch_fn))(states)[0]))


@pytest.mark.parametrize("kind", ["random", "full"])
def test_a_device_loaders_checkpoint_is_refused_by_other_data(kind):
  """As for host loaders: the checkpoint of a device loader's pipeline is
  refused by a pipeline over other data of the same size, and restores
  into the same data; one saved before device loaders had a digest
  (``data`` None) still restores."""
  def pipeline(x):
    loader = jax_data.DeviceNumpyDataLoader(x=x)
    if kind == "random":
      made = jax_data.random_reference_data(loader, 1, 3)
      return made, made[0](seed=4, stream="counter")
    made = jax_data.full_reference_data(loader, 2, 3)
    return made, made[0]()

  x = np.arange(20.0)
  saved_by, state = pipeline(x)
  tree = jax_data.state_to_pytree(saved_by, state)
  other, _ = pipeline(x * 100 + 7)
  with pytest.raises(ValueError, match="data is '[0-9a-f]+' in the "
                     "checkpoint but '[0-9a-f]+' here"):
    jax_data.state_from_pytree(other, tree)
  same, _ = pipeline(x.copy())
  jax_data.state_from_pytree(same, tree)
  host = json.loads(np.asarray(tree["host"], np.uint8).tobytes().decode())
  host["fingerprint"]["data"] = None
  older = {**tree, "host": np.frombuffer(json.dumps(host).encode(),
                                         np.uint8)}
  jax_data.state_from_pytree(other, older)


def test_data_digest_reads_a_fixed_sample_of_rows(tmp_path):
  class Counting:
    def __init__(self, array):
      self.array, self.rows = array, set()

    def __getitem__(self, row):
      self.rows.add(row)
      return self.array[row]

  for n in (1, 10, 32, 33, 37, 10_000, 1_000_000):
    leaf = Counting(np.arange(n))
    digest = jax_data.gather.digest_rows(
        n, lambda row, leaf=leaf: [leaf[row]], [np.dtype(np.int32)])
    # Every row up to 32, else 32 distinct ones (the sample of version 1
    # repeated rows: 23 of 37, 24 of 32).
    assert len(leaf.rows) == min(n, 32) and len(digest) == 32
  # A memmap is not read whole, and its digest is that of the same data
  # in memory.
  path = tmp_path / "x.npy"
  np.save(path, np.arange(200_000, dtype=np.float64).reshape(100_000, 2))
  memmapped = NumpyDataLoader(copy=False, x=np.load(path, mmap_mode="r"))
  in_memory = NumpyDataLoader(x=np.load(path))
  assert memmapped.content_digest() == in_memory.content_digest()
  changed = np.load(path)
  changed[0, 0] = -1.0  # row 0 is always in the sample
  assert NumpyDataLoader(x=changed).content_digest() != (
      in_memory.content_digest())


@pytest.mark.parametrize("kind", ["numpy", "device", "source", "tf",
                                  "tf in memory"])
def test_every_row_of_small_data_counts_and_older_checkpoints_restore(kind):
  """A checkpoint was restored onto data whose row 1 (of 32, or of the
  first 32 observations of a tf.data pipeline) had changed: the digest's
  sample left it out. A checkpoint saved with that digest (version 1)
  still restores onto the same data, and is refused by other data."""
  import tensorflow as tf

  def pipeline(x):
    loader = {
        "numpy": lambda: NumpyDataLoader(x=x),
        "device": lambda: jax_data.DeviceNumpyDataLoader(x=x),
        "source": lambda: jax_data.SourceDataLoader([{"x": v} for v in x]),
        "tf": lambda: jax_data.TensorflowDataLoader(
            tf.data.Dataset.from_tensor_slices({"x": x})),
        "tf in memory": lambda: jax_data.TensorflowDataLoader(
            tf.data.Dataset.from_tensor_slices({"x": x}), in_memory=True),
    }[kind]()
    return loader, jax_data.random_reference_data(loader, 2, 3)

  n = 37 if kind.startswith("tf") else 32
  x = np.arange(n, dtype=np.float32)
  loader, saved_by = pipeline(x)
  state = saved_by[0](seed=4, **({"stream": "counter"} if kind == "device"
                                 else {}))
  tree = jax_data.state_to_pytree(saved_by, state)
  for row in range(32):
    changed = x.copy()
    changed[row] = 999.0
    with pytest.raises(jax_data.CheckpointError, match="data is"):
      jax_data.state_from_pytree(pipeline(changed)[1], tree)
  host = json.loads(np.asarray(tree["host"], np.uint8).tobytes().decode())
  (earlier,) = loader.earlier_digests()
  assert earlier != host["fingerprint"]["data"]
  host["fingerprint"]["data"] = earlier
  older = {**tree, "host": np.frombuffer(json.dumps(host).encode(),
                                         np.uint8)}
  jax_data.state_from_pytree(pipeline(x.copy())[1], older)
  with pytest.raises(jax_data.CheckpointError, match="data is"):
    jax_data.state_from_pytree(pipeline(x + 1)[1], older)


def test_records_of_other_integer_widths_are_the_same_data(tmp_path):
  """Records of int64 (Hugging Face's NumPy format), Python ints and int32
  are served alike as int32, and their checkpoints restore onto each
  other, as NumpyDataLoader's do: the digest took the first record's own
  dtype and refused them. A checkpoint saved with that digest restores."""
  y = np.arange(30, dtype=np.int32)
  kinds = {"int32": [{"y": v} for v in y],
           "int64": [{"y": np.int64(v)} for v in y],
           "int": [{"y": int(v)} for v in y]}
  trees, expected = {}, {}
  for name, records in kinds.items():
    pipeline = jax_data.random_reference_data(
        jax_data.SourceDataLoader(records), 2, 4)
    state = pipeline[0](seed=5, shuffle=True)
    for _ in range(5):
      state, _ = pipeline[1](state)
    trees[name] = jax_data.state_to_pytree(pipeline, state)
    expected[name] = np.asarray(pipeline[1](state)[1]["y"])
  np.testing.assert_array_equal(expected["int64"], expected["int32"])
  for saved in kinds:
    for records in kinds.values():
      pipeline = jax_data.random_reference_data(
          jax_data.SourceDataLoader(records), 2, 4)
      restored = jax_data.state_from_pytree(pipeline, trees[saved])
      got = np.asarray(pipeline[1](restored)[1]["y"])
      assert got.dtype == np.int32
      np.testing.assert_array_equal(got, expected[saved])
  # Saved before: the sample's leaves digested as int64.
  loader = jax_data.SourceDataLoader(kinds["int64"])
  host = json.loads(trees["int64"]["host"].tobytes())
  host["fingerprint"]["data"] = jax_data.gather.digest_rows(
      len(y), lambda row: [np.int64(row)], [np.dtype(np.int64)])
  assert host["fingerprint"]["data"] != loader.content_digest()
  older = dict(trees["int64"],
               host=np.frombuffer(json.dumps(host).encode(), np.uint8))
  pipeline = jax_data.random_reference_data(loader, 2, 4)
  np.testing.assert_array_equal(
      pipeline[1](jax_data.state_from_pytree(pipeline, older))[1]["y"],
      expected["int64"])
  with pytest.raises(jax_data.CheckpointError, match="data is"):
    jax_data.state_from_pytree(jax_data.random_reference_data(
        jax_data.SourceDataLoader([{"y": v + 1} for v in y]), 2, 4), older)


def test_a_failed_restore_leaves_no_chain_registered():
  pipeline = _pipeline()
  init_fn, batch_fn, _ = pipeline
  states = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                  *[init_fn(seed=s) for s in range(3)])
  tree = jax_data.state_to_pytree(pipeline, states)
  host = json.loads(tree["host"].tobytes())
  host["chains"][2]["snapshot"] = {"version": 1, "stream": {"mode": "x"}}
  bad = dict(tree, host=np.frombuffer(json.dumps(host).encode(), np.uint8))
  fresh = _pipeline()
  with pytest.raises(jax_data.CheckpointError, match="mode 'x'"):
    jax_data.state_from_pytree(fresh, bad)
  assert fresh.host.chains() == []
  # A fingerprint that does not fit fails before any chain is added.
  other = jax_data.random_reference_data(NumpyDataLoader(x=np.arange(N)),
                                         CACHE + 1, MB)
  with pytest.raises(jax_data.CheckpointError, match="cache_size is 4"):
    jax_data.state_from_pytree(other, tree)
  assert other.host.chains() == []


def _edit(chain):
  """Edits the saved chain of ``chain(saved)`` in a checkpoint's host part."""
  def edited(tree):
    host = json.loads(tree["host"].tobytes())
    chain(host["chains"][0])
    return dict(tree, host=np.frombuffer(json.dumps(host).encode(), np.uint8))
  return edited


def _stream(name, value):
  return _edit(lambda c: c["snapshot"]["stream"].__setitem__(name, value))


@pytest.mark.parametrize("mode,edit,match", [
    # Observations past the data were read as its last row, with no error.
    ({}, _edit(lambda c: c["spec"].__setitem__("observations", [0, N + 9, 0,
                                                                1])),
     r"observations .*count=46.* are not the loader's .*count=37"),
    ({}, _edit(lambda c: c["spec"].__setitem__("observations", [3, N - 3, 0,
                                                                1])),
     "are not the loader's"),
    # An epoch's offset outside it served all-masked batches.
    (MODES[2], _stream("offset", -5), "offset must be between 0 and 7, got "
     "offset=-5"),
    (MODES[2], _stream("offset", 8), "offset=8"),
    (MODES[1], _stream("offset", N), f"offset must be between 0 and {N - 1}"),
    (MODES[0], _stream("offset", 3), "offset must be between 0 and 0"),
    # Missing or malformed fields gave a bare KeyError or AttributeError,
    # or (rng) failed only at the first batch, inside the callback.
    (MODES[2], _edit(lambda c: c["snapshot"]["stream"].pop("offset")),
     "has no 'offset'"),
    (MODES[1], _stream("rng", None), "rng must be the state of a PCG64 "
     "generator, got rng=None"),
    # Out of range, a field of the generator's state gave NumPy's bare
    # OverflowError, no CheckpointError.
    (MODES[1], _edit(lambda c: c["snapshot"]["stream"]["rng"].__setitem__(
        "uinteger", -1)), "rng must be the state of a PCG64 generator.*"
     "OverflowError"),
    ({}, _edit(lambda c: c["snapshot"]["stream"]["rng"].__setitem__(
        "has_uint32", 2**40)), "rng must be"),
    ({}, _stream("rng", {"bit_generator": "PCG64"}), "rng must be"),
    ({}, _edit(lambda c: c["snapshot"].__setitem__("stream", None)),
     "a stream's position is a dict, got None"),
    ({}, _stream("seed", -1), "seed must be at least 0, got seed=-1"),
    (dict(stream="counter"), _stream("batch", -3), "batch must be between 0"),
    (dict(stream="counter"), _stream("batch", 2**70), "batch must be"),
    (dict(stream="counter"), _stream("seed", 2**64), "seed must be between"),
    # A spec and snapshot that disagree: the snapshot's seed was drawn, and
    # its batch replaced by the chunk's, in silence.
    (dict(stream="counter"), _edit(lambda c: c["spec"].__setitem__("seed",
                                                                  5)),
     "the chain's spec and its snapshot disagree"),
    (dict(stream="counter", shuffle=True), _stream("batch", 9),
     r"'batch': 9.*is not the chain's position before chunk"),
    (dict(stream="counter"), _stream("seed", 7), "disagree"),
    # An exact stream's seed, which its generator's state does not show,
    # was taken from the snapshot in silence.
    (dict(stream="exact"), _stream("seed", 7), "its seed=7 is not the "
     "chain's seed=1: the chain's spec and its snapshot disagree"),
    (dict(stream="exact", shuffle=True), _stream("seed", 7), "disagree"),
    (dict(stream="exact", shuffle=True, in_epochs=True), _stream("seed", 0),
     "disagree"),
])
def test_edited_positions_and_observations_are_refused(mode, edit, match):
  """Every field of a saved chain is checked at restore: an edited or
  foreign one raises CheckpointError naming it, and no chain is added."""
  pipeline = _pipeline()
  state, _ = _run(pipeline[1], 6)(pipeline[0](seed=1, **mode))
  tree = jax_data.state_to_pytree(pipeline, state)
  fresh = _pipeline()
  with pytest.raises(jax_data.CheckpointError, match=match):
    jax_data.state_from_pytree(fresh, edit(tree))
  assert fresh.host.chains() == []
  # The unedited tree restores into the same pipeline.
  jax_data.state_from_pytree(fresh, tree)


@pytest.mark.parametrize("stream, match", [
    ("counter", "chunk=1 must be at least the chain's snapshot_index=3$"),
    ("exact", "chunk=1 must be between the chain's snapshot_index=3 and"),
])
def test_a_chunk_before_its_snapshot_is_named(stream, match):
  """A counter-based chain has no replay bound: its message said
  "unsupported operand type(s) for +: 'int' and 'NoneType'"."""
  pipeline = _pipeline()
  state = pipeline[0](seed=0, stream=stream)
  saved = dict(pipeline.host.save_chain(int(state.chain), 0),
               snapshot_index=3)
  with pytest.raises(jax_data.CheckpointError, match=match):
    pipeline.host.restore_chain(saved, 1)
  pipeline[2]()


def test_a_checkpoint_of_the_other_x64_setting_says_so():
  """Loaders serve 64-bit data in other dtypes with jax_enable_x64, so the
  data's digest differs: the refusal names the setting, not other data."""
  pipeline = _pipeline()
  tree = jax_data.state_to_pytree(pipeline, pipeline[0](seed=0))
  host = json.loads(tree["host"].tobytes())
  assert host["x64"] is bool(jax.config.jax_enable_x64)
  # As saved with the other setting: its digest of the data differs.
  host["x64"] = not host["x64"]
  host["fingerprint"]["data"] = "0" * 32
  other = dict(tree, host=np.frombuffer(json.dumps(host).encode(), np.uint8))
  here = bool(jax.config.jax_enable_x64)
  with pytest.raises(jax_data.CheckpointError, match=f"saved with "
                     f"jax_enable_x64={not here}, and here "
                     f"jax_enable_x64={here}"):
    jax_data.state_from_pytree(pipeline, other)
  # Without the field (older checkpoints), the fingerprint's own message.
  del host["x64"]
  older = dict(tree, host=np.frombuffer(json.dumps(host).encode(), np.uint8))
  with pytest.raises(jax_data.CheckpointError, match="data is '0000"):
    jax_data.state_from_pytree(pipeline, older)


@pytest.mark.parametrize("setting", ["jax_enable_x64",
                                     "jax_threefry_partitionable"])
def test_device_key_chains_restore_only_under_their_random_settings(setting):
  """A device loader's jax.random chain draws other batches from the same
  key with the other x64 setting (randint's dtype) or threefry setting,
  and float32 data has the same digest under both: such a restore served
  other batches silently. It is refused, naming the setting; counter
  chains, which follow neither, restore."""
  loader = jax_data.DeviceNumpyDataLoader(x=np.arange(40, dtype=np.float32))
  pipeline = jax_data.random_reference_data(loader, 1, 4)
  keyed = pipeline.init_fn(key=jax.random.PRNGKey(3))
  counter = pipeline.init_fn(seed=3, stream="counter")
  trees = [jax_data.state_to_pytree(pipeline, state)
           for state in (keyed, counter)]
  here = bool(getattr(jax.config, setting))
  flip = {"jax_enable_x64": jax.enable_x64,
          "jax_threefry_partitionable": jax.threefry_partitionable}[setting]
  with flip(not here):
    other = jax_data.random_reference_data(jax_data.DeviceNumpyDataLoader(
        x=np.arange(40, dtype=np.float32)), 1, 4)
    with pytest.raises(jax_data.CheckpointError,
                       match=f"{setting}={here} when saved and {not here}"):
      jax_data.state_from_pytree(other, trees[0])
    restored = jax_data.state_from_pytree(other, trees[1])
    _, batch = other.batch_fn(restored)
  _, want = pipeline.batch_fn(counter)
  assert batch["x"].tolist() == want["x"].tolist()


def test_save_checkpoint_checks_its_path_and_leaves_nothing_half_written(
    tmp_path):
  pipeline = _pipeline()
  state = pipeline[0](seed=0)
  with pytest.raises(TypeError, match="path must be a file name .*path=None"):
    jax_data.save_checkpoint(None, pipeline, state)
  for bad in (None, 3):  # Python's own message named no argument
    with pytest.raises(TypeError, match=f"path must be a file name .*"
                       f"path={bad}"):
      jax_data.restore_checkpoint(bad, pipeline)
  (tmp_path / "taken").mkdir()
  with pytest.raises(IsADirectoryError, match=r"path must be a file name, "
                     r"got path='.*taken', a directory"):
    jax_data.save_checkpoint(tmp_path / "taken", pipeline, state)
  with pytest.raises(FileNotFoundError, match=r"path='.*c.npz' is in "
                     r"'.*no.such', which does not exist"):
    jax_data.save_checkpoint(tmp_path / "no" / "such" / "c.npz", pipeline,
                             state)
  assert sorted(os.listdir(tmp_path)) == ["taken"]
  with pytest.raises(ValueError, match="save_checkpoint got a state of "
                     "another pipeline"):
    jax_data.save_checkpoint(tmp_path / "c.npz", pipeline,
                             _pipeline()[0](seed=0))
  # A bytes name is a file name too.
  jax_data.save_checkpoint(os.fsencode(tmp_path / "b.npz"), pipeline, state)
  assert jax_data.restore_checkpoint(tmp_path / "b.npz", pipeline).chunk == 0


def test_writers_that_save_to_one_path_at_once_each_save_whole(tmp_path):
  """Every process of a jax.distributed job may save the same state to
  one path (or several threads): with one temporary name for all, a
  writer's rename took another's file away (FileNotFoundError), or
  renamed a file another was writing."""
  pipeline = _pipeline()
  state = pipeline[0](seed=0)
  path = tmp_path / "c.npz"
  failures = []

  def save():
    for _ in range(40):
      try:
        jax_data.save_checkpoint(path, pipeline, state)
      except Exception as e:  # pylint: disable=broad-except
        failures.append(e)

  threads = [threading.Thread(target=save) for _ in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert not failures
  assert os.listdir(tmp_path) == ["c.npz"]
  assert jax_data.restore_checkpoint(path, pipeline).chunk == state.chunk


def test_temporary_files_of_saves_fit_any_name_and_killed_ones_go(tmp_path):
  """A name of its own for every writer took 33 more characters: a file
  name of 238 was too long for it. A writer killed while it wrote left its
  file, which no later save replaced: those older than ten minutes go."""
  pipeline = _pipeline()
  state = pipeline[0](seed=0)
  long = tmp_path / ("run-" + "a" * 240 + ".npz")
  jax_data.save_checkpoint(long, pipeline, state)
  assert os.listdir(tmp_path) == [long.name]
  os.remove(long)
  path = tmp_path / "c.npz"
  stale = ["c.npz.0123456789ab.partial", "c.npz.partial",
           ".jax_data.0123456789ab.partial"]
  kept = ["c.npz.ba9876543210.partial", "c.npz.mine.partial"]
  for name in stale + kept:
    (tmp_path / name).write_bytes(b"half")
    if name != kept[0]:  # a save under way elsewhere: fresh
      os.utime(tmp_path / name, (time.time() - 700, time.time() - 700))
  jax_data.save_checkpoint(path, pipeline, state)
  assert sorted(os.listdir(tmp_path)) == sorted(["c.npz"] + kept)


@pytest.mark.parametrize("seed", [2, jnp.int32(2), np.array(2)])
def test_an_array_flag_is_saved_as_a_bool(seed):
  """Flags and a seed given as 0-d arrays are Python values in the
  chain's spec and its checkpoint."""
  pipeline = _pipeline()
  init_fn, batch_fn, _ = pipeline
  state = init_fn(seed=seed, shuffle=jnp.array(True),
                  in_epochs=np.bool_(True))
  state, _ = _run(batch_fn, 6)(state)
  tree = jax_data.state_to_pytree(pipeline, state)
  spec = json.loads(tree["host"].tobytes())["chains"][0]["spec"]
  assert spec["shuffle"] is True and spec["in_epochs"] is True
  assert spec["seed"] == 2 and type(spec["seed"]) is int
  fresh = _pipeline()
  _, expected = _run(batch_fn, 8)(state)
  _, got = _run(fresh[1], 8)(jax_data.state_from_pytree(fresh, tree))
  assert got[0].tolist() == expected[0].tolist()
  assert got[1].tolist() == expected[1].tolist()


@pytest.mark.parametrize("field,value,match", [
    ("chunk", -1, "chunks -1 must not be negative"),
    ("position", -3, "positions -3 are outside 0 .. 3"),
    ("position", CACHE, "positions 4 are outside"),
    ("chunk", 2**31 - 1, "chunk=2147483647 must be between the chain's "
     "snapshot_index=1 and 1048577"),
])
def test_counters_out_of_range_are_refused(field, value, match):
  pipeline = _pipeline()
  state, _ = _run(pipeline[1], 5)(pipeline[0](seed=1))
  tree = jax_data.state_to_pytree(pipeline, state)
  with pytest.raises(jax_data.CheckpointError, match=match):
    jax_data.state_from_pytree(pipeline, dict(tree, **{field: np.int32(
        value)}))
  # Eagerly, a state built by hand is refused too, and is not saved (a
  # negative chunk failed with "max() arg is an empty sequence", and a
  # position out of range was saved, to be refused at its restore).
  if value < 0 or field == "position":
    edited = state._replace(**{field: jnp.int32(value)})
    with pytest.raises(ValueError, match=f"{field}={value}"):
      pipeline[1](edited)
    with pytest.raises(ValueError, match=f"state_to_pytree got a state with "
                       f"{field}={value}"):
      jax_data.state_to_pytree(pipeline, edited)


@pytest.mark.parametrize("field,value,error,match", [
    ("chunk", np.float32(1.7), TypeError, "chunk has shape .. and dtype "
     "float32, expected .. and int32"),
    ("position", np.float32(0.9), TypeError, "position .* dtype float32"),
    ("key", np.array([-1, 2**40]), TypeError, "key .* dtype int32, "
     r"expected \(2,\) and uint32"),
    ("chunk", np.int64(2**40), ValueError, "chunk is 1099511627776, "
     "outside int32's"),
    ("key", np.array([1, 2**40], np.uint64), ValueError,
     "key is .*outside uint32's"),
    ("chain", "0", TypeError, "chain has shape .. and dtype <U1"),
    ("chain", np.float32(np.nan), TypeError, "chain .* dtype float32"),
])
def test_counters_of_another_type_are_not_saved(field, value, error, match):
  """A counter of a state set by hand to a float or a 64-bit value is
  refused by name, as batch_fn refuses the state; it was truncated or
  wrapped into the checkpoint (chunk 1.7 restored as 1)."""
  pipeline = _pipeline()
  state = pipeline[0](seed=1)
  edited = state._replace(**{field: value})
  with pytest.raises(error, match="state_to_pytree got a state whose "
                     + match):
    jax_data.state_to_pytree(pipeline, edited)
  with pytest.raises((TypeError, ValueError), match=f"{field}|a field"):
    pipeline[1](edited)
  assert jax_data.state_to_pytree(pipeline, state)["chunk"] == 0


@pytest.mark.parametrize("path, message", [
    ("", "path must be a file name, got path=''$"),
    ("a\0b", re.escape("path must be a file name, got path='a\\x00b', "
                        "with a null byte")),
])
def test_a_path_that_names_no_file_is_refused_before_saving(path, message):
  """"" failed after the state was serialised, naming a temporary file;
  a null byte gave os's bare ValueError."""
  pipeline = _pipeline()
  with pytest.raises(ValueError, match=message):
    jax_data.save_checkpoint(path, pipeline, pipeline[0](seed=1))


def test_a_traced_state_is_not_saved():
  """Inside jit a state's counters are unknown: said so, not NumPy's
  TracerArrayConversionError."""
  pipeline = _pipeline()
  state = pipeline[0](seed=1)
  with pytest.raises(TypeError, match="state_to_pytree needs a concrete "
                     "state, got a traced one"):
    jax.jit(lambda s: jax_data.state_to_pytree(pipeline, s)["chunk"])(state)


def test_a_loaders_store_limits_bound_replays():
  """Limits are a value the loader carries: a pipeline over a loader with
  max_replay=3 refuses a state 4 chunks past its snapshot, in a checkpoint
  and inside jit, and serves one 3 chunks past."""
  loader = NumpyDataLoader(x=np.arange(N))
  loader.store_limits = StoreLimits(max_replay=3)
  pipeline = jax_data.random_reference_data(loader, CACHE, MB)
  init_fn, batch_fn, _ = pipeline
  state = init_fn(seed=1)
  tree = jax_data.state_to_pytree(pipeline, state)
  with pytest.raises(jax_data.CheckpointError, match=r"chunk=4 must be "
                     r"between the chain's snapshot_index=0 and 3 \(the "
                     r"snapshot plus max_replay=3 chunks\)"):
    jax_data.state_from_pytree(pipeline, dict(tree, chunk=np.int32(4)))
  with pytest.raises(Exception, match="more than the 3 a request may "
                     "replay"):
    jax.block_until_ready(jax.jit(batch_fn)(state._replace(
        chunk=jnp.int32(4))))
  reference = _pipeline()
  far, _ = _run(reference[1], 3 * CACHE)(reference[0](seed=1))
  _, want = _run(reference[1], 2)(far)
  _, got = _run(batch_fn, 2)(state._replace(chunk=jnp.int32(3)))
  assert got[0].tolist() == want[0].tolist()


def test_counters_out_of_range_inside_jit_are_refused_by_the_host():
  init_fn, batch_fn, _ = _pipeline()
  state = init_fn(seed=1)
  with pytest.raises(Exception, match="chunk=-1 of chain .* requested"):
    jax.block_until_ready(jax.jit(batch_fn)(state._replace(
        chunk=jnp.int32(-1))))
  with pytest.raises(Exception, match="more than the 1048576 a request may "
                     "replay"):
    jax.block_until_ready(jax.jit(batch_fn)(state._replace(
        chunk=jnp.int32(2**30))))
  # The chain is still usable.
  _, batch = jax.jit(batch_fn)(state)
  assert batch["x"].shape == (MB,)


def _foreign_files(checkpoint):
  """Files restore_checkpoint must refuse as no jax_data checkpoint, by
  what writes them."""
  whole = checkpoint.read_bytes()
  zipped = io.BytesIO()
  with zipfile.ZipFile(zipped, "w") as archive:
    archive.writestr("notes.txt", "not arrays")
  objects = io.BytesIO()
  np.savez(objects, host=np.array([{"version": 2}], dtype=object),
           chunk=np.int32(0), position=np.int32(0), key=np.zeros(2))
  arrays = io.BytesIO()
  np.savez(arrays, weights=np.ones(3))
  return {
      "pickle": pickle.dumps({"chunk": 0, "position": 0}),
      "garbage": bytes(np.random.default_rng(0).integers(0, 256, 300,
                                                         np.uint8)),
      "text": b"chunk,position\n0,0\n",
      "empty": b"",
      "truncated": whole[:len(whole) // 2],
      "bit_flipped": whole[:60] + bytes([whole[60] ^ 0x10]) + whole[61:],
      "object_arrays": objects.getvalue(),
      "other_npz": arrays.getvalue(),
      "zip_of_text": zipped.getvalue()}


@pytest.mark.parametrize("kind", ["pickle", "garbage", "text", "empty",
                                  "truncated", "bit_flipped",
                                  "object_arrays", "other_npz",
                                  "zip_of_text"])
def test_a_foreign_or_corrupt_file_is_named_no_jax_data_checkpoint(
    tmp_path, kind):
  pipeline = _pipeline()
  checkpoint = tmp_path / "data.npz"
  jax_data.save_checkpoint(checkpoint, pipeline, pipeline[0](seed=1))
  path = tmp_path / f"{kind}.npz"
  path.write_bytes(_foreign_files(checkpoint)[kind])
  chains = pipeline.host.chains()
  with pytest.raises(jax_data.CheckpointError) as info:
    jax_data.restore_checkpoint(path, pipeline)
  message = str(info.value)
  assert str(path) in message
  assert re.search("is not a (readable )?jax_data checkpoint", message)
  # Not NumPy's advice to load the file "unsafely using allow_pickle".
  assert "pickle=" not in message and "unsafe" not in message
  assert pipeline.host.chains() == chains
  # The checkpoint itself still restores.
  jax_data.restore_checkpoint(checkpoint, pipeline)


def test_restored_stacked_pass_states_share_a_chain():
  """Stacked full-pass states share one host chain, restored too: a pass
  of 4 restored lanes reads what one lane's does (each lane got its own
  chain, and read the data once per lane), and gives the same results."""
  x = np.arange(23, dtype=np.float32)
  thetas = jnp.asarray([0.0, 1.0, 2.0, 3.0])

  def run(pipeline, states):
    return jax.jit(jax.vmap(lambda state, theta: pipeline[1](
        lambda b, m, c: (jnp.sum(jnp.where(m, (b["x"] - theta) ** 2, 0.0)),
                         c), state, None, masking=True)))(states, thetas)

  source = CountedRows(x)
  made = jax_data.full_reference_data(
      jax_data.SourceDataLoader(source, workers=0), 2, 5)
  states = jax.tree_util.tree_map(lambda *s: jnp.stack(s),
                                  *[made[0]() for _ in thetas])
  states, (expected, _) = run(made, states)
  tree = jax_data.state_to_pytree(made, states)
  made[2]()
  again = CountedRows(x)
  fresh = jax_data.full_reference_data(
      jax_data.SourceDataLoader(again, workers=0), 2, 5)
  restored = jax_data.state_from_pytree(fresh, tree)
  assert len(set(np.asarray(restored.chain).tolist())) == 1
  again.reads = 0
  _, (got, _) = run(fresh, restored)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert again.reads == 23 + 2  # once, and the last batch's padding
  fresh[2]()


@pytest.mark.parametrize("edit,match", [
    ({"observations": [0, 13, 0, 1]}, "observations.*13"),
    ({"observations": [10, 13, 0, 1]}, "observations.*10, 13"),
    ({"batches": 1}, "'batches': 1"),
    ({"kind": "RandomChain", "seed": 0}, "RandomChain"),
])
def test_edited_full_pass_chains_are_refused(edit, match):
  """A full pass's chain is padded to whole chunks (its spec's batches),
  which the loader checks only as a split pass's share: observations
  within the data. The pipeline refuses any other spec; an edited one
  passed 13 rows off as the pass of 23."""
  def fresh():
    return jax_data.full_reference_data(
        NumpyDataLoader(x=np.arange(23.0)), 2, 5)
  pipeline = fresh()
  tree = jax_data.state_to_pytree(pipeline, pipeline[0]())
  other = fresh()
  with pytest.raises(jax_data.CheckpointError, match=match):
    jax_data.state_from_pytree(other, _edit(
        lambda c: c["spec"].update(edit))(tree))
  assert other.host.chains() == []


def test_a_full_pass_saved_unpadded_restores():
  """A checkpoint written before full passes were padded to whole chunks
  (no batches in its spec) restores, and its passes are the same."""
  def fresh():
    return jax_data.full_reference_data(
        NumpyDataLoader(x=np.arange(23.0)), 2, 5)
  pipeline = fresh()
  tree = jax_data.state_to_pytree(pipeline, pipeline[0]())
  old = _edit(lambda c: c["spec"].pop("batches"))(tree)
  other = fresh()
  state = jax_data.state_from_pytree(other, old)
  for _ in range(2):
    state, (values, _) = other[1](lambda b, c: (b["x"], c), state, None)
    assert values.tolist() == list(range(23))
