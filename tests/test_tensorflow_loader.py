"""TensorflowDataLoader: streams, checkpoints, dtypes, errors, and use inside
``jit``."""

import collections
import contextlib
import copy
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_data
from tests import calls
from tests import scripts

tf = pytest.importorskip("tensorflow")
tensorflow_loader = pytest.importorskip("jax_data.tensorflow_loader")
TensorflowDataLoader = tensorflow_loader.TensorflowDataLoader


def _pipeline(n, **extra):
  return tf.data.Dataset.from_tensor_slices(
      {"x": np.arange(n), "y": np.arange(n, dtype=np.float64) / 2, **extra})


def _chunks(loader, chain, count):
  """``count`` chunks of a chain: x values and masks, as lists."""
  out = [loader.get_batches(chain) for _ in range(count)]
  return [b["x"].tolist() for b, _ in out], [m.tolist() for _, m in out]


def _stream(loader, chain, count):
  """The x values of ``count`` chunks, flattened into one stream."""
  return np.concatenate([np.ravel(x) for x in _chunks(loader, chain,
                                                      count)[0]])


# -- the data-loading guide's example, with small numbers ------------------


def test_mock_cifar10_batches_inside_jit():
  tfds = pytest.importorskip("tensorflow_datasets")
  with contextlib.redirect_stdout(io.StringIO()), tfds.testing.mock_data(
      num_examples=60):
    pipeline, info = tfds.load("cifar10", split="train", with_info=True)
  assert sorted(info.features.keys()) == ["id", "image", "label"]
  loader = TensorflowDataLoader(pipeline, shuffle_cache=10,
                                exclude_keys=["id"])
  zero = loader.initializer_batch(mb_size=20)
  assert {k: (v.shape, str(v.dtype)) for k, v in zero.items()} == {
      "image": ((20, 32, 32, 3), "uint8"), "label": ((20,), "int32")}
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 2,
                                                                 20)

  @jax.jit
  def draw(state):
    return jax.lax.scan(lambda s, _: batch_fn(s), state, None, length=5)

  _, batches = draw(init_fn(seed=3))
  release_fn()
  assert batches["image"].shape == (5, 20, 32, 32, 3)
  assert batches["image"].dtype == jnp.uint8
  assert batches["label"].shape == (5, 20)
  assert batches["label"].dtype == jnp.int32
  labels = np.asarray(batches["label"])
  assert labels.min() >= 0 and labels.max() < 10
  # Three batches of 20 make one pass over the 60 mock images: each image
  # once (images are random, so distinct with overwhelming probability).
  first_pass = np.asarray(batches["image"][:3]).reshape(60, -1)
  assert len({row.tobytes() for row in first_pass}) == 60


# -- random chains ----------------------------------------------------------


@pytest.mark.parametrize("n,mb,cache,buffer", [(23, 4, 3, 5), (20, 5, 2, 50),
                                               (7, 7, 1, 3)])
def test_random_chain_visits_every_observation_once_per_pass(n, mb, cache,
                                                             buffer):
  loader = TensorflowDataLoader(_pipeline(n), shuffle_cache=buffer)
  chain = loader.register_random_pipeline(cache, mb, seed=4)
  stream = _stream(loader, chain, -(-3 * n // (mb * cache)))
  passes = stream[:len(stream) // n * n].reshape(-1, n)
  assert len(passes) >= 3
  for one_pass in passes:
    assert sorted(one_pass.tolist()) == list(range(n))
    # A shuffle buffer of `buffer` observations emits at position t only
    # observations it has read: 0 .. t + buffer - 1.
    assert np.all(one_pass <= np.arange(n) + buffer - 1)
  if n > buffer > 1:
    assert passes[0].tolist() != passes[1].tolist()  # reshuffled per pass


def test_shuffle_cache_one_keeps_pipeline_order():
  loader = TensorflowDataLoader(_pipeline(10), shuffle_cache=1)
  chain = loader.register_random_pipeline(2, 3)
  assert _stream(loader, chain, 3).tolist() == (
      list(range(10)) + list(range(8)))


def test_seeds_give_reproducible_streams_and_default_to_chain_id():
  pipeline = _pipeline(50)
  loader = TensorflowDataLoader(pipeline, shuffle_cache=20)
  assert loader.register_ordered_pipeline(1, 5) == 0
  default = loader.register_random_pipeline(2, 5)  # chain 1: seed 1
  explicit = loader.register_random_pipeline(2, 5, seed=1)
  other_seed = loader.register_random_pipeline(2, 5, seed=2)
  expected = _stream(loader, default, 4)
  assert _stream(loader, explicit, 4).tolist() == expected.tolist()
  assert _stream(loader, other_seed, 4).tolist() != expected.tolist()
  # A new loader over the same pipeline, and another cache size.
  fresh = TensorflowDataLoader(pipeline, shuffle_cache=20)
  five = fresh.register_random_pipeline(5, 5, seed=1)
  assert _stream(fresh, five, 1).tolist() == expected[:25].tolist()
  assert fresh.save_state(five)["seed"] == 1


# -- ordered chains -----------------------------------------------------------


@pytest.mark.parametrize("n,mb,cache", [(10, 4, 2), (10, 5, 3), (7, 3, 5),
                                        (9, 9, 2), (11, 2, 1)])
def test_ordered_chain_equals_numpy_ordered_stream(n, mb, cache):
  loader = TensorflowDataLoader(_pipeline(n), shuffle_cache=3)
  reference = jax_data.NumpyDataLoader(x=np.arange(n))
  chain = loader.register_ordered_pipeline(cache, mb)
  ref_chain = reference.register_ordered_pipeline(cache, mb)
  chunks = 2 * -(-n // (mb * cache)) + 1  # a few passes
  assert _chunks(loader, chain, chunks) == _chunks(reference, ref_chain,
                                                   chunks)


def test_ordered_chain_serves_batches_in_pipeline_order_with_padding():
  loader = TensorflowDataLoader(_pipeline(10))
  chain = loader.register_ordered_pipeline(cache_size=2, mb_size=4)
  values, masks = _chunks(loader, chain, 3)
  assert values == [[[0, 1, 2, 3], [4, 5, 6, 7]],
                    [[8, 9, 0, 1], [0, 1, 2, 3]],
                    [[4, 5, 6, 7], [8, 9, 0, 1]]]
  assert masks[1] == [[True, True, False, False], [True] * 4]
  assert masks[2] == [[True] * 4, [True, True, False, False]]


def test_shards_split_the_observations():
  loader = TensorflowDataLoader(_pipeline(10))
  seen = []
  for index, batches in enumerate([1, 1, 2]):  # shards of 3, 3, 4: one pass
    chain = loader.register_ordered_pipeline(batches, 3, shard_index=index,
                                             shard_count=3)
    (values,), (mask,) = _chunks(loader, chain, 1)
    seen += [v for v, m in zip(np.ravel(values), np.ravel(mask)) if m]
  assert seen == list(range(10))
  chain = loader.register_random_pipeline(1, 3, shard_index=2, shard_count=3)
  assert set(_stream(loader, chain, 4).tolist()) == {6, 7, 8, 9}


# -- checkpoints ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "ordered"])
def test_save_and_load_state_continue_exactly(kind):
  pipeline = _pipeline(23)
  loader = TensorflowDataLoader(pipeline, shuffle_cache=6)
  register = (loader.register_random_pipeline if kind == "random"
              else loader.register_ordered_pipeline)
  chain = register(3, 4, **({"seed": 11} if kind == "random" else {}))
  _chunks(loader, chain, 4)  # past the first pass
  saved = loader.save_state(chain)
  frozen = copy.deepcopy(saved)
  expected = _chunks(loader, chain, 5)
  # Into the same chain, and into a new chain of a new loader.
  loader.load_state(chain, saved)
  assert _chunks(loader, chain, 5) == expected
  other = TensorflowDataLoader(pipeline, shuffle_cache=6)
  other.register_ordered_pipeline(1, 2)  # another chain id, another seed
  other_chain = (other.register_random_pipeline(3, 4, seed=99)
                 if kind == "random" else other.register_ordered_pipeline(3, 4))
  other.load_state(other_chain, saved)
  assert _chunks(other, other_chain, 5) == expected
  assert saved == frozen  # loading never mutates the checkpoint


@pytest.mark.parametrize("in_memory", [False, True])
def test_load_state_replays_only_when_the_position_moves(in_memory):
  loader = TensorflowDataLoader(_pipeline(23), shuffle_cache=6,
                                in_memory=in_memory)
  chain = loader.register_random_pipeline(3, 4, seed=1)
  first = _chunks(loader, chain, 1)
  seeks = calls.calls_of(jax_data.sampling.BufferShuffle.seek, "position")
  with calls.watch(seeks) as seen:
    loader.load_state(chain, loader.save_state(chain))
    _chunks(loader, chain, 1)
  assert seen == []  # at the current position: no replay
  state = loader.save_state(chain)
  state["position"] = 0
  with calls.watch(seeks) as seen:
    loader.load_state(chain, state)
    assert _chunks(loader, chain, 1) == first
  assert seen == [0]


def test_load_state_names_what_differs():
  loader = TensorflowDataLoader(_pipeline(10), shuffle_cache=4)
  a = loader.register_random_pipeline(2, 3)
  b = loader.register_random_pipeline(4, 3)
  with pytest.raises(ValueError, match="cache_size is 2 in the state but 4"):
    loader.load_state(b, loader.save_state(a))
  ordered = loader.register_ordered_pipeline(2, 3)
  with pytest.raises(ValueError, match="kind is 'random' in the state but "
                     "'ordered' here"):
    loader.load_state(ordered, loader.save_state(a))
  other = TensorflowDataLoader(_pipeline(10), shuffle_cache=5)
  with pytest.raises(ValueError, match="shuffle_cache is 4 in the state"):
    other.load_state(other.register_random_pipeline(2, 3),
                     loader.save_state(a))
  with pytest.raises(TypeError, match="dict from save_state"):
    loader.load_state(a, [1, 2])


def test_state_is_small_and_plain():
  loader = TensorflowDataLoader(_pipeline(10))
  chain = loader.register_random_pipeline(2, 3, seed=5)
  loader.get_batches(chain)
  state = loader.save_state(chain)
  assert state["position"] == 2 and state["seed"] == 5
  assert all(isinstance(v, (int, str, list)) for v in state.values())


# -- formats and dtypes -----------------------------------------------------


def test_dtypes_follow_jax_defaults():
  pipeline = tf.data.Dataset.from_tensor_slices({
      "i64": np.arange(6, dtype=np.int64),
      "f64": np.zeros((6, 2), np.float64),
      "u8": np.zeros((6, 4, 4, 3), np.uint8),
      "b": np.ones(6, bool),
      "f16": np.zeros(6, np.float16),
      "i16": np.zeros(6, np.int16)})
  loader = TensorflowDataLoader(pipeline)
  expected = {"i64": "int32", "f64": "float32", "u8": "uint8", "b": "bool",
              "f16": "float16", "i16": "int16"}
  assert {k: str(v.dtype) for k, v in
          loader.initializer_batch().items()} == expected
  batches, mask = loader.get_batches(loader.register_random_pipeline(2, 3))
  assert {k: str(v.dtype) for k, v in batches.items()} == expected
  # The public method returns JAX arrays, as the predecessor's did.
  assert all(isinstance(v, jax.Array) for v in batches.values())
  assert isinstance(mask, jax.Array)
  assert batches["u8"].shape == (2, 3, 4, 4, 3)
  assert batches["f64"].shape == (2, 3, 2)
  assert mask.dtype == bool and mask.shape == (2, 3) and mask.all()
  with jax.enable_x64(True):
    wide = TensorflowDataLoader(pipeline)
    assert str(wide.initializer_batch()["i64"].dtype) == "int64"
    assert str(wide.observation_format["f64"].dtype) == "float64"


@pytest.mark.parametrize("in_memory", [False, True])
def test_integers_that_jax_holds_in_32_bits_are_checked(in_memory):
  """An int64 feature is served as int32 without jax_enable_x64: values
  that fit come through exactly, and one that does not is named (its key
  and value) where NumPy's cast wrapped it without a word: at
  construction when the pipeline is read into memory, else by the read
  that meets it."""
  if jax.config.jax_enable_x64:
    pytest.skip("64-bit integers are served as they are")
  labels = np.arange(30, dtype=np.int64) - 15
  fits = TensorflowDataLoader(tf.data.Dataset.from_tensor_slices(
      {"x": np.arange(30.0), "label": {"id": labels}}), in_memory=in_memory)
  batches, _ = fits.get_batches(fits.register_ordered_pipeline(1, 30))
  assert batches["label"]["id"].dtype == jnp.int32
  np.testing.assert_array_equal(batches["label"]["id"][0], labels)
  labels[13] = 3_000_000_013
  message = re.escape(
      "yields ['label']['id'] = 3000000013, which JAX's int32 (64-bit types "
      "are 32-bit without jax_enable_x64) cannot hold")
  pipeline = tf.data.Dataset.from_tensor_slices(
      {"x": np.arange(30.0), "label": {"id": labels}})
  if in_memory:
    with pytest.raises(ValueError, match=message):
      TensorflowDataLoader(pipeline, in_memory=True)
    return
  loader = TensorflowDataLoader(pipeline)
  with pytest.raises(Exception, match=message):
    loader.get_batches(loader.register_ordered_pipeline(1, 30))


def test_nested_features_and_repr():
  pipeline = tf.data.Dataset.from_tensor_slices(
      {"x": np.arange(4), "meta": {"w": np.ones((4, 2), np.float32)}})
  loader = TensorflowDataLoader(pipeline, shuffle_cache=7)
  assert repr(loader) == ("TensorflowDataLoader(x, meta; 4 observations, "
                          "shuffle_cache=7)")
  assert loader.static_information == {"observation_count": 4}
  batches, _ = loader.get_batches(loader.register_ordered_pipeline(1, 2))
  assert batches["meta"]["w"].shape == (1, 2, 2)
  assert batches["x"].tolist() == [[0, 1]]


@pytest.mark.parametrize("in_memory", [False, True])
def test_features_of_integer_keys(in_memory):
  """tf.data and JAX take a dict of integer keys; the loader failed making
  its name ("sequence item 0: expected str instance, int found")."""
  x = np.arange(20, dtype=np.float32)
  loader = TensorflowDataLoader(tf.data.Dataset.from_tensor_slices(
      {1: x, 2: 2 * x}), in_memory=in_memory)
  assert repr(loader).startswith("TensorflowDataLoader(1, 2; 20 observations")
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 4)
  each, _ = mapper_fn(lambda b, c: ((b[1], b[2]), c), None, batched=False)
  np.testing.assert_array_equal(each[0], x)
  np.testing.assert_array_equal(each[1], 2 * x)
  release_fn()


# -- errors -----------------------------------------------------------------


def test_string_feature_names_the_key_and_exclude_keys():
  pipeline = _pipeline(4, name=np.array([b"a", b"b", b"c", b"d"]))
  with pytest.raises(TypeError, match=r"'name' has dtype string.*"
                     r"exclude_keys=\['name'\]"):
    TensorflowDataLoader(pipeline)
  loader = TensorflowDataLoader(pipeline, exclude_keys=["name"])
  assert sorted(loader.observation_format) == ["x", "y"]
  batches, _ = loader.get_batches(loader.register_ordered_pipeline(1, 4))
  assert sorted(batches) == ["x", "y"]


def test_unknown_dimensions_and_ragged_features_are_named():
  unknown = _pipeline(4).map(
      lambda d: {**d, "v": tf.zeros(tf.cast(d["x"], tf.int32))})
  with pytest.raises(ValueError, match=r"'v' has shape \(None,\).*"
                     r"exclude_keys=\['v'\]"):
    TensorflowDataLoader(unknown)
  assert TensorflowDataLoader(unknown, exclude_keys=["v"]).static_information
  ragged = tf.data.Dataset.from_tensor_slices(
      {"x": np.arange(2), "r": tf.ragged.constant([[1], [2, 3]])})
  with pytest.raises(TypeError, match=r"'r' is a RaggedTensorSpec.*"
                     r"exclude_keys=\['r'\]"):
    TensorflowDataLoader(ragged)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(pipeline=np.arange(3)), TypeError, "must be a tf.data.Dataset"),
    (dict(shuffle_cache=0), ValueError, "shuffle_cache=0"),
    (dict(exclude_keys="x"), TypeError, "exclude_keys='x'"),
    (dict(exclude_keys=["z"]), ValueError, "'z', which the pipeline does not"),
    (dict(exclude_keys=["x", "y"]), ValueError, "drops every feature"),
    (dict(observation_count=5), ValueError,
     r"differs from the pipeline's cardinality 10; leave it out, or use "
     r"pipeline.take\(5\)"),
    (dict(observation_count=11), ValueError,
     "cardinality 10; the pipeline has only 10 elements: leave it out"),
])
def test_bad_loader_arguments_are_named(kwargs, error, match):
  kwargs = {"pipeline": _pipeline(10), **kwargs}
  with pytest.raises(error, match=match):
    TensorflowDataLoader(**kwargs)


def test_a_shuffle_buffer_larger_than_memory_is_refused():
  """It was taken, and the first batch failed to allocate 8 TiB inside the
  host callback; a buffer of more than the pipeline's observations holds
  only those, and is taken."""
  with pytest.raises(ValueError, match=f"shuffle_cache={2**40} observations "
                     "of .* bytes take .* bytes per random chain, more than "
                     "this machine's"):
    TensorflowDataLoader(_pipeline(10).repeat(), 2**40)
  assert TensorflowDataLoader(_pipeline(10), 2**40).observation_count == 10
  # A pipeline of unknown length read into memory: counted first.
  unknown = _pipeline(10).filter(lambda element: True)
  assert TensorflowDataLoader(unknown, 2**40,
                              in_memory=True).observation_count == 10


def test_tuple_elements_are_an_error():
  pipeline = tf.data.Dataset.from_tensor_slices((np.arange(3), np.arange(3)))
  with pytest.raises(TypeError, match="must yield dicts"):
    TensorflowDataLoader(pipeline)


def test_unknown_and_infinite_cardinality_ordered_chains_need_the_count():
  filtered = _pipeline(10).filter(lambda d: d["x"] % 2 == 0)
  for unknown in (TensorflowDataLoader(filtered),
                  TensorflowDataLoader(_pipeline(10).repeat())):
    assert unknown.static_information == {"observation_count": None}
    assert "unknown number of observations" in repr(unknown)
    with pytest.raises(ValueError, match="ordered.*observation_count=N"):
      unknown.register_ordered_pipeline(1, 2)
    with pytest.raises(ValueError, match="shard.*observation_count=N"):
      unknown.register_random_pipeline(1, 2, shard_index=0, shard_count=2)
    with pytest.raises(ValueError, match="observation_count=N"):
      jax_data.full_reference_data(unknown, 1, 2)
    with pytest.raises(ValueError, match="observation_count=N"):
      jax_data.full_data_mapper(unknown, 1, 2)
  with pytest.raises(ValueError, match="infinite.*observation_count=N"):
    TensorflowDataLoader(_pipeline(10).repeat(), in_memory=True)
  loader = TensorflowDataLoader(filtered, observation_count=5)
  chain = loader.register_ordered_pipeline(1, 5)
  assert _chunks(loader, chain, 2)[0] == [[[0, 2, 4, 6, 8]]] * 2
  endless = TensorflowDataLoader(_pipeline(10).repeat(), observation_count=4)
  chain = endless.register_ordered_pipeline(1, 3)
  assert _chunks(endless, chain, 2)[0] == [[[0, 1, 2]], [[3, 0, 1]]]
  too_many = TensorflowDataLoader(filtered, observation_count=6)
  chain = too_many.register_ordered_pipeline(1, 4)
  too_many.get_batches(chain)
  with pytest.raises(ValueError, match="observation_count=6 does not fit"):
    too_many.get_batches(chain)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(cache_size=0, mb_size=2), ValueError, "cache_size=0"),
    (dict(cache_size=1, mb_size=11), ValueError, "mb_size=11"),
    (dict(cache_size=1, mb_size=None), ValueError, "mb_size=None"),
    (dict(mb_size=2, sed=1), TypeError, "sed=1"),
    (dict(mb_size=2, seed=-1), ValueError, "seed=-1"),
    (dict(mb_size=2, seed=1.5), TypeError, "seed=1.5"),
    (dict(mb_size=2, shard_index=0), ValueError, "go together"),
])
def test_bad_chain_arguments_are_named(kwargs, error, match):
  loader = TensorflowDataLoader(_pipeline(10))
  with pytest.raises(error, match=match):
    loader.register_random_pipeline(**kwargs)


def test_ordered_chains_take_no_seed_and_released_chains_are_errors():
  loader = TensorflowDataLoader(_pipeline(10))
  with pytest.raises(TypeError, match="seed=1"):
    loader.register_ordered_pipeline(1, 2, seed=1)
  chain = loader.register_random_pipeline(1, 2)
  loader.release_chain(chain)
  loader.release_chain(chain)  # idempotent
  with pytest.raises(ValueError, match="was released"):
    loader.get_batches(chain)
  with pytest.raises(ValueError, match="does not exist"):
    loader.get_batches(5)


# -- TensorFlow set-up --------------------------------------------------------


def test_importing_jax_data_does_not_import_tensorflow_and_env_defaults():
  fake = textwrap.dedent("""
      import importlib.util, os, sys, types
      import jax_data
      assert "tensorflow" not in sys.modules, "jax_data imported tensorflow"
      os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
      os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"  # a user's choice wins
      seen = {}
      class Config:
        def set_visible_devices(self, devices, kind):
          seen["hidden"] = (devices, kind)
      fake = types.ModuleType("tensorflow")
      fake.config = Config()
      class Finder:  # records the environment when tensorflow is imported
        def find_spec(self, name, path=None, target=None):
          if name != "tensorflow":
            return None
          seen["level"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
          seen["onednn"] = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
          return importlib.util.spec_from_loader(name, self)
        def create_module(self, spec):
          return fake
        def exec_module(self, module):
          pass
      sys.meta_path.insert(0, Finder())
      import jax_data.tensorflow_loader
      print(seen)
      """)
  result = subprocess.run([sys.executable, "-c", fake], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == (
      "{'level': '2', 'onednn': '1', 'hidden': ([], 'GPU')}")


def test_gpus_stay_hidden_or_a_warning_says_why():
  assert tf.config.get_visible_devices("GPU") == []

  class InitialisedWithGpus:
    """What tf.config answers once TensorFlow has taken the GPUs."""

    def set_visible_devices(self, devices, kind):
      raise RuntimeError("Visible devices cannot be modified after being "
                         "initialized")

    def get_visible_devices(self, kind):
      return ["GPU:0"]

  with pytest.warns(UserWarning, match="can still see the GPUs"):
    tensorflow_loader._hide_gpus(InitialisedWithGpus())


def test_streams_do_not_depend_on_tensorflow_seeds():
  reference = TensorflowDataLoader(_pipeline(30), shuffle_cache=8)
  expected = _stream(reference, reference.register_random_pipeline(4, 5), 3)
  try:
    tf.random.set_seed(1234)
    loader = TensorflowDataLoader(_pipeline(30), shuffle_cache=8)
    assert _stream(loader, loader.register_random_pipeline(4, 5),
                   3).tolist() == expected.tolist()
  finally:
    tf.compat.v1.random.set_random_seed(None)


# -- in memory ----------------------------------------------------------------


@pytest.mark.parametrize("n,mb,cache,buffer,shard", [
    (23, 4, 3, 5, None), (20, 5, 2, 50, (1, 3)), (7, 7, 1, 3, None),
    (41, 3, 4, 100, (2, 4))])
def test_in_memory_serves_the_same_streams(n, mb, cache, buffer, shard):
  shards = {} if shard is None else dict(shard_index=shard[0],
                                         shard_count=shard[1])
  streams = []
  for in_memory in (False, True):
    loader = TensorflowDataLoader(_pipeline(n), shuffle_cache=buffer,
                                  in_memory=in_memory)
    random = loader.register_random_pipeline(cache, mb, seed=3, **shards)
    ordered = loader.register_ordered_pipeline(cache, mb, **shards)
    streams.append([_chunks(loader, random, 5), _chunks(loader, ordered, 5)])
  assert streams[0] == streams[1]
  ordered_x = np.ravel(streams[1][1][0][0])
  start = 0 if shard is None else shard[0] * n // shard[1]
  assert ordered_x[0] == start  # the shard, in pipeline order


def test_in_memory_reads_the_pipeline_once_and_converts_dtypes():
  reads = []

  def count(x):
    reads.append(1)
    return x

  pipeline = _pipeline(12).map(
      lambda e: {**e, "x": tf.numpy_function(count, [e["x"]], tf.int64)})
  pipeline = pipeline.map(lambda e: {**e, "x": tf.ensure_shape(e["x"], [])})
  loader = TensorflowDataLoader(pipeline, shuffle_cache=4, in_memory=True)
  assert len(reads) == 12
  assert repr(loader).endswith("shuffle_cache=4, in memory)")
  chain = loader.register_random_pipeline(3, 5)
  batches, _ = loader.get_batches(chain)
  for _ in range(4):
    loader.get_batches(chain)
  assert len(reads) == 12
  assert str(batches["x"].dtype) == "int32"
  assert str(batches["y"].dtype) == "float32"
  ordered, _ = loader.get_batches(loader.register_ordered_pipeline(2, 3))
  assert ordered["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
  # The chunks the host serves are views of the held arrays, which stay
  # intact.
  layout = loader.chunk_layout(2, 3)
  cursor = loader.open_chain(loader.chain_spec(True), layout)
  out = layout.new_chunk()
  chunk = cursor.produce(0, out)
  with pytest.raises(ValueError, match="read-only"):
    chunk.leaves[0][0, 0] = 7


def test_checkpoints_move_between_memory_and_streaming():
  streamed = TensorflowDataLoader(_pipeline(17), shuffle_cache=5)
  chain = streamed.register_random_pipeline(2, 3, seed=8)
  _chunks(streamed, chain, 4)
  state = streamed.save_state(chain)
  expected = _chunks(streamed, chain, 6)
  memory = TensorflowDataLoader(_pipeline(17), shuffle_cache=5,
                                in_memory=True)
  other = memory.register_random_pipeline(2, 3)
  memory.load_state(other, state)
  assert _chunks(memory, other, 6) == expected


def test_in_memory_errors_name_the_argument():
  with pytest.raises(TypeError, match="in_memory must be True or False, got "
                     "in_memory='yes'"):
    TensorflowDataLoader(_pipeline(5), in_memory="yes")
  short = _pipeline(5).filter(lambda e: e["x"] < 100)
  with pytest.raises(ValueError, match="observation_count=8 does not fit"):
    TensorflowDataLoader(short, observation_count=8, in_memory=True)


# -- inside jit -------------------------------------------------------------


def test_random_reference_data_inside_jit_serves_the_chain_stream():
  pipeline = _pipeline(30)
  loader = TensorflowDataLoader(pipeline, shuffle_cache=8)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 3,
                                                                 4)

  @jax.jit
  def draw(state):
    return jax.lax.scan(lambda s, _: batch_fn(s), state, None, length=10)

  state = init_fn(seed=6)
  end, batches = draw(state)
  reference = TensorflowDataLoader(pipeline, shuffle_cache=8)
  expected = _stream(reference, reference.register_random_pipeline(
      3, 4, seed=6), 4)[:40]
  assert np.asarray(batches["x"]).ravel().tolist() == expected.tolist()
  np.testing.assert_allclose(batches["y"], np.asarray(batches["x"]) / 2)
  # The same state again (a replay across chunks) gives the same batches,
  # and the chain goes on where it was.
  _, again = draw(state)
  assert np.array_equal(again["x"], batches["x"])
  _, later = draw(end)
  assert np.asarray(later["x"]).ravel().tolist() == _stream(
      reference, reference.register_random_pipeline(3, 4, seed=6),
      7)[40:80].tolist()
  release_fn()


def test_full_data_maps_inside_jit_equal_numpy_results():
  n = 23
  loader = TensorflowDataLoader(_pipeline(n))
  mapper_fn, release_mapper = jax_data.full_data_mapper(loader, 2, 4)

  @jax.jit
  def total(carry):
    return mapper_fn(lambda b, m, c: (jnp.sum(b["y"] * m), c + jnp.sum(m)),
                     carry, masking=True)

  for _ in range(2):  # pass after pass
    sums, count = total(jnp.int32(0))
    assert float(sums.sum()) == pytest.approx(np.arange(n).sum() / 2)
    assert int(count) == n
  release_mapper()

  init_fn, map_fn, release_fn = jax_data.full_reference_data(loader, 3, 5)
  state = init_fn()

  @jax.jit
  def squares(state):
    return map_fn(lambda b, c: (b["x"] ** 2, c), state, None)

  for _ in range(3):
    state, (results, _) = squares(state)
    assert results.tolist() == [i * i for i in range(n)]
  release_fn()


def test_a_streamed_pass_reads_the_data_once():
  """A streamed pipeline cannot seek: the host reaches a chunk by reading
  the ones before it. XLA asked for a pass's last chunk before the loop's,
  so the first pass read the data up to it, then again from the start
  (220 elements for 103); the last chunk's request now depends on the
  loop's."""
  n, reads = 103, [0]

  def records():
    for i in range(n):
      reads[0] += 1
      yield {"x": np.float32(i)}

  pipeline = tf.data.Dataset.from_generator(
      records, output_signature={"x": tf.TensorSpec((), tf.float32)}
  ).apply(tf.data.experimental.assert_cardinality(n))
  init_fn, map_fn, release_fn = jax_data.full_reference_data(
      TensorflowDataLoader(pipeline), 2, 10)
  state, (values, _) = jax.jit(lambda s: map_fn(
      lambda b, c: (b["x"], c), s, None))(init_fn())
  assert values.tolist() == list(range(n))
  # Once, the last chunk's filling, and maybe the next pass's first
  # chunks, read ahead meanwhile (at most 163 in all).
  assert reads[0] < 2 * n
  release_fn()


@pytest.mark.parametrize("kind", ["random", "full"])
def test_checkpoint_restores_into_a_new_loader(kind):
  pipeline = _pipeline(19)

  def build():
    loader = TensorflowDataLoader(pipeline, shuffle_cache=5)
    if kind == "random":
      pipe = jax_data.random_reference_data(loader, 3, 4)
      init_fn, batch_fn, _ = pipe
      step = jax.jit(lambda s: jax.lax.scan(lambda s, _: batch_fn(s), s,
                                            None, length=7))
      return pipe, lambda: init_fn(seed=2), step
    pipe = jax_data.full_reference_data(loader, 2, 4)
    init_fn, map_fn, _ = pipe
    step = jax.jit(lambda s: map_fn(lambda b, c: (b["x"], c), s, None))
    return pipe, init_fn, step

  pipe, init, step = build()
  state, _ = step(step(init())[0])  # a few chunks in
  tree = jax_data.state_to_pytree(pipe, state)
  expected = [step(state)[1]]
  expected.append(step(step(state)[0])[1])
  pipe[-1]()
  new_pipe, new_init, new_step = build()
  new_init()  # another chain first: the restored one gets another id
  restored = jax_data.state_from_pytree(new_pipe, tree)
  got = [new_step(restored)[1]]
  got.append(new_step(new_step(restored)[0])[1])
  for want, have in zip(expected, got):
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: np.array_equal(a, b), want, have))
  new_pipe[-1]()


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_pipeline_with_its_own_randomness_restores_into_a_new_loader(
    in_memory):
  """A random augmentation gives a new loader other first observations:
  the data's digest then covers the count and formats, so a checkpoint
  restores into a new loader over the pipeline, and the chains' elements
  go on as they would have; other formats are still refused."""
  def augmented(n):
    return tf.data.Dataset.range(n).map(
        lambda x: {"x": x, "noise": tf.random.uniform(())})

  def pipeline(n=100):
    return jax_data.random_reference_data(TensorflowDataLoader(
        augmented(n), shuffle_cache=10, in_memory=in_memory), 2, 4)

  init_fn, batch_fn, release_fn = saved = pipeline()
  step = jax.jit(jax.vmap(batch_fn))
  states, _ = step(init_fn(seed=range(3)))
  tree = jax_data.state_to_pytree(saved, states)
  expected = np.asarray(step(states)[1]["x"])
  release_fn()
  restored = pipeline()
  got = np.asarray(jax.jit(jax.vmap(restored[1]))(
      jax_data.state_from_pytree(restored, tree))[1]["x"])
  np.testing.assert_array_equal(got, expected)
  restored[2]()
  other = jax_data.random_reference_data(TensorflowDataLoader(
      tf.data.Dataset.range(100).map(lambda x: {"x": x}), shuffle_cache=10,
      in_memory=in_memory), 2, 4)
  with pytest.raises(jax_data.CheckpointError, match="does not fit: data"):
    jax_data.state_from_pytree(other, tree)
  other[2]()


@pytest.mark.parametrize("in_memory", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_nan_among_the_first_rows_is_data_like_any_value(in_memory, dtype):
  """Two reads of the first rows are compared byte for byte: a bfloat16 NaN
  (dtype kind "V") compared unequal, the pipeline was taken for one with
  randomness of its own, and its checkpoints restored onto other data of
  the same count and formats."""
  ml_dtypes = pytest.importorskip("ml_dtypes")
  np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)

  def pipeline(first):
    x = np.array([np.nan] + list(range(first, first + 19))).astype(np_dtype)
    return jax_data.random_reference_data(TensorflowDataLoader(
        tf.data.Dataset.from_tensor_slices({"x": x}), in_memory=in_memory),
                                          2, 4)

  saved, other = pipeline(1), pipeline(101)
  tree = jax_data.state_to_pytree(saved, saved[0](seed=0))
  with pytest.raises(jax_data.CheckpointError, match="does not fit: data"):
    jax_data.state_from_pytree(other, tree)
  for made in (saved, other):
    made[2]()


def _generated(n):
  """A pipeline of unknown length: from a generator."""
  def gen():
    for i in range(n):
      yield {"x": np.int64(i), "y": np.float32(i) / 2}
  return tf.data.Dataset.from_generator(gen, output_signature={
      "x": tf.TensorSpec((), tf.int64), "y": tf.TensorSpec((), tf.float32)})


def _endless_reference(n, shuffle_cache, seed, steps):
  """What a random chain of a pipeline of unknown length serves: the
  pipeline repeated, through one shuffle buffer never emptied."""
  from jax_data.sampling import ENDLESS
  from jax_data.sampling import BufferShuffle
  shuffle = BufferShuffle(ENDLESS, shuffle_cache, seed)
  shuffle.seek(0)
  return shuffle.take(steps) % n


@pytest.mark.parametrize("make", [
    _generated, lambda n: _pipeline(n).filter(lambda d: d["x"] >= 0),
    lambda n: _pipeline(n).repeat()])
def test_random_access_without_the_count(make):
  n, cache, mb = 23, 3, 4
  loader = TensorflowDataLoader(make(n), shuffle_cache=8)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, cache, mb)

  @jax.jit
  def run(state):
    def body(state, _):
      state, (batch, info) = batch_fn(state, information=True)
      return state, (batch["x"], batch["y"], info.mask)
    return jax.lax.scan(body, state, None, length=40)

  state, (x, y, mask) = run(init_fn(seed=3))
  x = np.asarray(x).reshape(-1)
  np.testing.assert_array_equal(
      x, _endless_reference(n, 8, 3, x.size))
  np.testing.assert_array_equal(np.asarray(y).reshape(-1), x / 2)
  assert np.asarray(mask).all()
  # The stream runs through the passes: 160 draws cover all 23 elements.
  assert set(x.tolist()) == set(range(n))
  _, (batch, info) = batch_fn(state, information=True)
  assert info.observation_count is None and info.batch_size == mb
  release_fn()


def test_random_chain_of_unknown_length_restores_exactly(tmp_path):
  def pipeline():
    return jax_data.random_reference_data(
        TensorflowDataLoader(_generated(17), shuffle_cache=5), 2, 3)

  def draws(pipe, state, count):
    out = []
    for _ in range(count):
      state, batch = pipe.batch_fn(state)
      out.append(np.asarray(batch["x"]))
    return np.concatenate(out), state

  first = pipeline()
  whole, _ = draws(first, first.init_fn(seed=9), 30)
  _, state = draws(first, first.init_fn(seed=9), 11)
  jax_data.save_checkpoint(tmp_path / "chain", first, state)
  second = pipeline()
  rest, _ = draws(second, jax_data.restore_checkpoint(tmp_path / "chain",
                                                      second), 19)
  np.testing.assert_array_equal(rest, whole[11 * 3:])
  first.release_fn()
  second.release_fn()


def test_in_memory_learns_the_count_of_a_pipeline_of_unknown_length():
  loader = TensorflowDataLoader(
      _pipeline(10).filter(lambda d: d["x"] % 3 == 0), in_memory=True)
  assert loader.static_information == {"observation_count": 4}
  batches, mask = loader.get_batches(loader.register_ordered_pipeline(1, 4))
  assert np.asarray(batches["x"]).tolist() == [[0, 3, 6, 9]]


def test_a_random_chain_reports_the_rows_it_holds_and_trims_them():
  """The host budgets what cursors hold (``held_bytes``); a trimmed chain
  drops its rows and continues exactly, like an untrimmed twin."""
  loader = TensorflowDataLoader(_pipeline(200), shuffle_cache=50)
  pipeline = jax_data.random_reference_data(loader, 2, 8)
  init_fn, batch_fn, _ = pipeline
  step = jax.jit(batch_fn)
  trimmed, twin = init_fn(seed=4), init_fn(seed=4)
  for _ in range(3):
    trimmed, _ = step(trimmed)
    twin, _ = step(twin)
  record = pipeline.host.chain(int(trimmed.chain))
  with record.produce_lock:
    assert record.cursor.held_bytes() > 0
    record.cursor.trim()
    assert record.cursor.held_bytes() == 0
  for _ in range(30):
    trimmed, batch = step(trimmed)
    twin, expected = step(twin)
    np.testing.assert_array_equal(batch["x"], expected["x"])


# -- housekeeping of many chains (issue 24) ---------------------------------


def _array_bytes(cursor):
  """The bytes of the NumPy arrays a cursor reaches through jax_data
  objects and containers (whole buffers, each counted once), but for the
  blocks of the reads its shard's chains share (a few chunks' rows for
  them all, not trimmed chain by chain)."""
  from jax_data.loaders.tensorflow_reads import SharedReads
  arrays, seen, todo = {}, set(), [cursor]
  while todo:
    obj = todo.pop()
    if id(obj) in seen or isinstance(obj, SharedReads):
      continue
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
      while isinstance(obj.base, np.ndarray):
        obj = obj.base
      arrays[id(obj)] = obj.nbytes
    elif isinstance(obj, dict):
      todo.extend(obj.values())
    elif isinstance(obj, (list, tuple, collections.deque)):
      todo.extend(obj)
    elif type(obj).__module__.startswith("jax_data."):
      todo.extend(getattr(obj, "__dict__", {}).values())
  return sum(arrays.values())


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_trimmed_chain_keeps_no_more_than_a_fresh_one(in_memory):
  """``held_bytes`` counts every array a random chain keeps beyond a new
  cursor's (the shuffle buffer's slots and rows), and ``trim`` frees all
  of it: chains used one after another past the budget do not grow
  memory."""
  loader = TensorflowDataLoader(_pipeline(300), shuffle_cache=64,
                                in_memory=in_memory)
  pipeline = jax_data.random_reference_data(loader, 2, 8)
  init_fn, batch_fn, release_fn = pipeline
  step = jax.jit(batch_fn)
  state = init_fn(seed=3)
  for _ in range(5):
    state, _ = step(state)
  record = pipeline.host.chain(int(state.chain))
  fresh = _array_bytes(loader.open_chain(record.spec, pipeline.host.layout))
  with record.produce_lock:
    cursor = record.cursor
    assert _array_bytes(cursor) - fresh <= cursor.held_bytes()
    assert cursor.held_bytes() >= 64 * 4  # the buffer's 64 int32 slots
    cursor.trim()
    assert cursor.held_bytes() == 0
    assert _array_bytes(cursor) <= fresh
  release_fn()


@pytest.mark.parametrize("share_reads", [True, False])
def test_a_trimmed_chain_drops_its_iterator_in_a_background_thread(
    share_reads):
  """Dropping a tf.data iterator can take seconds: a trim (the host's, or
  a chain's own seek to another pass) never drops it in the calling
  thread, whether the chain reads its own iterator or, the last chain of
  its shard, the shared one."""
  dropped = []
  loader = TensorflowDataLoader(_pipeline(100), shuffle_cache=8,
                                share_reads=share_reads)
  pipeline = jax_data.random_reference_data(loader, 2, 4)
  init_fn, batch_fn, release_fn = pipeline
  state, _ = jax.jit(batch_fn)(init_fn(seed=1))
  record = pipeline.host.chain(int(state.chain))
  with record.produce_lock:  # no production meanwhile
    # The iterator the chain reads its pipeline through.
    rows = record.cursor._source  # pylint: disable=protected-access
    assert rows.reads_shared() == share_reads
    if share_reads:
      rows = rows._shared  # pylint: disable=protected-access
    iterator = rows._iterator  # pylint: disable=protected-access
    assert iterator is not None
    weakref.finalize(iterator, lambda: dropped.append(
        threading.current_thread().name))
    del iterator
    record.cursor.trim()
  for _ in range(3000):  # the background thread drops it soon
    if dropped:
      break
    time.sleep(0.01)
  assert dropped == ["jax_data-tf-iterator-closer"]
  release_fn()


class _ObservedCursor(jax_data.chains.ChainCursor):
  """A loader's cursor that reports holding 64 MiB, so that the host trims
  it once a few chains were used, and whose trims are recorded in
  ``events`` and wait for ``go`` (at most 30 seconds, so that a request
  that waits for one ends)."""

  def __init__(self, cursor, events, go):
    self.cursor, self._events, self._go = cursor, events, go

  def produce(self, index, out):
    return self.cursor.produce(index, out)

  def position(self):
    return self.cursor.position()

  def seek(self, position):
    self.cursor.seek(position)

  def held_bytes(self):
    return 64 << 20

  def trim(self):
    self._events.append("trim started")
    self._go.wait(30)
    self._go.set()  # later trims do not wait
    self.cursor.trim()
    self._events.append("trim ended")


def test_a_request_never_waits_for_trimming_other_chains():
  """Chains used one after another past the budget: the host trims the
  least recently used chains' cursors (dropping their tf.data iterators
  can take seconds) in its prefetch thread, never while a request waits;
  a trimmed chain's stream continues exactly."""
  events, go = [], threading.Event()

  class Observed(TensorflowDataLoader):

    def open_chain(self, spec, layout):
      return _ObservedCursor(super().open_chain(spec, layout), events, go)

  loader = Observed(_pipeline(200), shuffle_cache=10)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader,
                                                                 1, 4)
  step = jax.jit(batch_fn)
  states = []

  def serve(seed):
    state, _ = jax.block_until_ready(step(init_fn(seed=seed)))
    states.append(state)
    events.append("served")

  for seed in range(12):
    serve(seed)
  # Under load the prefetch thread may begin its first trim late: more
  # chains until it has, then one more request while the trim waits.
  seed = 12
  while "trim started" not in events and seed < 60:
    serve(seed)
    seed += 1
  serve(seed)
  go.set()
  assert "trim started" in events
  first = events.index("trim started")
  # While the first trim waited, requests were served.
  assert events[first + 1] == "served", events
  # The first chain was trimmed; it continues as on an untrimmed twin.
  reference = TensorflowDataLoader(_pipeline(200), shuffle_cache=10)
  twin_init, twin_batch, twin_release = jax_data.random_reference_data(
      reference, 1, 4)
  twin_step = jax.jit(twin_batch)
  twin, _ = twin_step(twin_init(seed=0))
  state = states[0]
  for _ in range(60):
    state, batch = step(state)
    twin, expected = twin_step(twin)
    np.testing.assert_array_equal(batch["x"], expected["x"])
  release_fn()
  twin_release()


@pytest.mark.parametrize("make", [
    lambda: _pipeline(10).filter(lambda d: d["x"] > 100),
    lambda: _pipeline(10).filter(lambda d: d["x"] > 100).repeat(),
    lambda: _pipeline(10).take(0),
])
def test_an_empty_pipeline_is_named_when_the_loader_is_created(make):
  for kwargs in ({}, {"observation_count": 4}, {"in_memory": True}):
    with pytest.raises(ValueError, match="pipeline is empty: it yielded no "
                       "elements"):
      TensorflowDataLoader(make(), **kwargs)


def test_a_pipeline_empty_on_a_later_pass_says_so():
  """A generator used up after its first pass (a common mistake with
  ``from_generator``): a chain that starts reading then is told the
  pipeline yielded no elements, not that it ended early."""
  rows = iter([{"x": np.int64(i)} for i in range(6)])
  once = tf.data.Dataset.from_generator(
      lambda: rows, output_signature={"x": tf.TensorSpec((), tf.int64)})
  loader = TensorflowDataLoader(once, shuffle_cache=2)
  first = loader.register_random_pipeline(1, 4)
  with pytest.raises(RuntimeError):  # somewhere in the first pass
    for _ in range(3):
      loader.get_batches(first)
  with pytest.raises(RuntimeError, match="is empty on this pass: it yielded "
                     "no elements"):
    loader.get_batches(loader.register_random_pipeline(1, 4))


def _reader_threads():
  return {t for t in threading.enumerate() if t.name == "jax_data-tf-read"}


def test_chains_made_and_left_keep_no_reader_thread(monkeypatch):
  """Each chain reads its pipeline in a thread of its own; a chain left
  (a new one per epoch), or a pipeline dropped without release_fn, keeps
  none once idle: 40 chains made one after another kept 40 threads until
  release_fn, or forever."""
  from jax_data.loaders import tensorflow_rows
  monkeypatch.setattr(tensorflow_rows, "_IDLE_S", 0.2)
  before = _reader_threads()
  data = tf.data.Dataset.from_tensor_slices({"x": np.arange(50)})
  init_fn, batch_fn, _ = jax_data.random_reference_data(
      TensorflowDataLoader(data, shuffle_cache=10), 2, 4)
  step = jax.jit(batch_fn)
  for seed in range(40):
    jax.block_until_ready(step(init_fn(seed=seed)))
  deadline = time.monotonic() + 30
  while _reader_threads() - before and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not _reader_threads() - before  # (earlier tests' may end too)
  # A chain goes on after its thread ended: it starts another.
  state, _ = step(init_fn(seed=3))
  time.sleep(0.5)
  for _ in range(6):  # its next chunks
    state, batch = step(state)
  assert batch["x"].shape == (4,)


@pytest.mark.parametrize("kind", ["random", "full"])
def test_release_ends_a_request_that_reads_its_own_chunk(kind):
  """A request reads the chunk that nothing produced ahead (the first)
  itself; when the pipeline stalls on an element, release_fn from another
  thread ends the request at once with PipelineReleasedError, as it ends
  requests that wait for a chunk being produced."""
  stalled, go_on = threading.Event(), threading.Event()

  def slow(x):
    if int(x) == 3:
      stalled.set()
      go_on.wait(30)
    return x

  data = tf.data.Dataset.from_tensor_slices({"x": np.arange(30)}).map(
      lambda e: {"x": tf.ensure_shape(
          tf.py_function(slow, [e["x"]], tf.int64), [])})
  loader = TensorflowDataLoader(data, shuffle_cache=4)
  if kind == "random":
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, 1, 10)
    request = lambda: jax.jit(batch_fn)(init_fn(seed=0))
  else:
    init_fn, map_fn, release_fn = jax_data.full_reference_data(loader, 1, 10)
    request = lambda: map_fn(lambda b, c: (b["x"], c), init_fn(), None)
  errors = []

  def run():
    try:
      jax.block_until_ready(request())
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  try:
    assert stalled.wait(30)
    release_fn()
    thread.join(10)
    assert not thread.is_alive()
    assert errors and "released" in str(errors[0]), errors
  finally:
    go_on.set()  # the pipeline's read ends, in the reader's thread


def test_chains_read_without_tensorflows_injected_prefetch():
  """A chain's iterator reads its pipeline in order and without the
  prefetch TensorFlow injects (jax_data reads ahead itself): with it, each
  chain kept another thread and batch, and dropping 256 chains' iterators
  took 80 s. A pipeline's own choice is kept."""
  from jax_data.loaders.tensorflow_rows import chain_dataset
  dataset = tf.data.Dataset.range(10).shuffle(
      4, seed=1, reshuffle_each_iteration=False).batch(2)
  options = chain_dataset(dataset).options()
  assert options.deterministic is True
  assert options.experimental_optimization.inject_prefetch is False
  own = tf.data.Options()
  own.experimental_optimization.inject_prefetch = True
  assert chain_dataset(dataset.with_options(own)).options(
  ).experimental_optimization.inject_prefetch is True
  # The elements are the pipeline's.
  assert ([b.tolist() for b in chain_dataset(dataset).as_numpy_iterator()]
          == [b.tolist() for b in dataset.as_numpy_iterator()])


_EXIT_DURING_A_SLOW_READ = textwrap.dedent("""
    import threading, time
    import jax, numpy as np, tensorflow as tf
    import jax_data
    from jax_data.tensorflow_loader import TensorflowDataLoader

    def slow(v):
      if int(v) >= 4:
        time.sleep(3.0)  # a slow disk or network read
      return np.int32(v)

    pipeline = tf.data.Dataset.range(30).map(lambda v: {"x": tf.ensure_shape(
        tf.py_function(slow, [v], tf.int32), [])})
    init_fn, batch_fn, _ = jax_data.random_reference_data(
        TensorflowDataLoader(pipeline, shuffle_cache=2), 2, 4)
    step = jax.jit(jax.vmap(batch_fn))
    states = init_fn(seed=range(2))

    def run():
      try:
        jax.block_until_ready(step(states))
        print("served", flush=True)
      except Exception as e:
        print("raised:", "the Python interpreter is exiting" in str(e),
              flush=True)

    threading.Thread(target=run, daemon=True).start()
    time.sleep(1.0)
    print("main thread done", flush=True)
    """)


def test_exit_while_a_daemon_thread_waits_for_a_slow_read_is_clean():
  """The exit hook refuses requests after a few seconds without a pause;
  a request that already waited in a tf.data read went on waiting, and the
  interpreter finalized under it (SIGSEGV or 'Fatal Python error'). The
  refusal now interrupts such reads, as release_fn does."""
  done = scripts.run(_EXIT_DURING_A_SLOW_READ)
  scripts.assert_ended_cleanly(done)
  assert "raised: True" in done.stdout, done.stdout


@pytest.mark.parametrize("seed", [2**31, 2**64, 2**100])
def test_a_seed_of_any_size_draws_its_own_stream_and_restores(tmp_path, seed):
  """A streamed chain takes seeds of any size, as the NumPy loaders' exact
  streams do (it took none above 2**31 - 1): its stream is its seed's, and
  a checkpoint of it restores the same batches."""
  pipeline = jax_data.random_reference_data(
      TensorflowDataLoader(_pipeline(50)), 2, 4)
  init_fn, batch_fn, release_fn = pipeline

  def batches(state, count):
    out = []
    for _ in range(count):
      state, batch = batch_fn(state)
      out.append(np.asarray(batch["x"]).tolist())
    return state, out

  state, first = batches(init_fn(seed=seed), 3)
  assert batches(init_fn(seed=seed), 3)[1] == first
  assert batches(init_fn(seed=seed + 1), 3)[1] != first
  jax_data.save_checkpoint(tmp_path / "chain.npz", pipeline, state)
  restored = jax_data.restore_checkpoint(tmp_path / "chain.npz", pipeline)
  assert batches(restored, 3)[1] == batches(state, 3)[1]
  release_fn()


@pytest.mark.parametrize("field, value, match", [
    # Restored in silence: the first batch then failed inside the callback
    # with an OverflowError, or the chain served another seed's batches.
    ("position", 2**70, r"position must be between 0 and \d+, got "
     "position=1180591620717411303424"),
    ("seed", 4, "its seed=4 is not the chain's seed=3: the chain's spec and "
     "its snapshot disagree"),
])
def test_an_edited_snapshot_of_a_shuffle_buffer_is_refused(field, value,
                                                           match):
  def pipeline():
    return jax_data.random_reference_data(TensorflowDataLoader(
        _pipeline(53), shuffle_cache=7), 3, 4)

  saved = pipeline()
  state = saved[0](seed=3)
  for _ in range(5):
    state, _ = saved[1](state)
  tree = jax_data.state_to_pytree(saved, state)
  host = json.loads(tree["host"].tobytes())
  host["chains"][0]["snapshot"][field] = value
  edited = dict(tree, host=np.frombuffer(json.dumps(host).encode(),
                                         np.uint8))
  fresh = pipeline()
  with pytest.raises(jax_data.CheckpointError, match=match):
    jax_data.state_from_pytree(fresh, edited)
  assert fresh.host.chains() == []
  # The unedited tree restores, and goes on as the chain does.
  np.testing.assert_array_equal(
      fresh[1](jax_data.state_from_pytree(fresh, tree))[1]["x"],
      saved[1](state)[1]["x"])


def test_a_counter_chain_restored_out_of_memory_says_in_memory():
  """A checkpoint of an in-memory loader's counter-based chain, restored
  into a loader not in memory, said "version is 1 in the state but 2 here,
  shuffle_cache is None ...": the shuffle buffer's fields."""
  saved = jax_data.random_reference_data(
      TensorflowDataLoader(_pipeline(53), shuffle_cache=7, in_memory=True),
      3, 4)
  state, _ = saved[1](saved[0](seed=3, stream="counter"))
  tree = jax_data.state_to_pytree(saved, state)
  elsewhere = jax_data.random_reference_data(
      TensorflowDataLoader(_pipeline(53), shuffle_cache=7), 3, 4)
  with pytest.raises(jax_data.CheckpointError, match=r"counter-based stream "
                     r"\(stream='counter'\), which TensorflowDataLoader "
                     r"draws only in memory: restore it into a "
                     r"TensorflowDataLoader\(\.\.\., in_memory=True\)"):
    jax_data.state_from_pytree(elsewhere, tree)
  assert elsewhere.host.chains() == []
  restored = jax_data.random_reference_data(
      TensorflowDataLoader(_pipeline(53), shuffle_cache=7, in_memory=True),
      3, 4)
  np.testing.assert_array_equal(
      restored[1](jax_data.state_from_pytree(restored, tree))[1]["x"],
      saved[1](state)[1]["x"])
