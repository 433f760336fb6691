"""NumpyDataLoader and DeviceNumpyDataLoader: input checks, dtypes, chains,
checkpoints."""

import copy
import logging
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_data
from jax_data import DeviceNumpyDataLoader
from jax_data import NumpyDataLoader
from jax_data import gather

MODES = [dict(), dict(shuffle=True), dict(shuffle=True, in_epochs=True)]


def _stream(loader, chain, chunks):
  out = [loader.get_batches(chain) for _ in range(chunks)]
  return [b["x"].tolist() for b, _ in out], [m.tolist() for _, m in out]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=np.arange(3), y=np.arange(4)), ValueError, "x: 3, y: 4"),
    (dict(x=np.zeros((0, 2))), ValueError, "observation count 0"),
    (dict(), ValueError, "at least one array"),
    (dict(x=np.array(["a", "b"])), TypeError, "'x' has dtype <U1"),
    (dict(x=np.array([object(), 1], dtype=object)), TypeError, "'x'"),
    (dict(x=np.float32(3.0)), ValueError, "first axis"),
    (dict(copy="yes", x=np.arange(2)), TypeError, "copy='yes'"),
    # int32 without jax_enable_x64: NumPy's cast served 2**40 as 0.
    (dict(t=np.array([1, 2**40])), ValueError,
     r"'t' holds integers from 1 to 1099511627776 \(the first outside at "
     r"row 1: 1099511627776\), which JAX's int32"),
    (dict(t=np.array([-2**31 - 1, 0])), ValueError, "int32"),
    (dict(t=np.array([2**32], np.uint64)), ValueError, "uint32"),
])
def test_bad_arrays_are_named(kwargs, error, match):
  for cls in (NumpyDataLoader, DeviceNumpyDataLoader):
    with pytest.raises(error, match=match):
      cls(**kwargs)


def test_accepts_lists_numpy_and_jax_arrays_with_jax_dtypes():
  loader = NumpyDataLoader(a=[1, 2, 3], b=np.ones(3, np.float64),
                           c=jnp.arange(3), d=np.zeros(3, np.uint8),
                           e=np.array([True, False, True]))
  fmt = {k: str(v.dtype) for k, v in loader.initializer_batch(2).items()}
  assert fmt == {"a": "int32", "b": "float32", "c": "int32", "d": "uint8",
                 "e": "bool"}
  batches, _ = loader.get_batches(loader.register_ordered_pipeline(1, 3))
  assert {k: str(v.dtype) for k, v in batches.items()} == fmt
  assert batches["a"].tolist() == [[1, 2, 3]]
  # 64-bit integers that 32 bits hold are served as they are.
  edges = NumpyDataLoader(t=np.array([-2**31, 2**31 - 1]),
                          u=np.array([0, 2**32 - 1], np.uint64))
  batches, _ = edges.get_batches(edges.register_ordered_pipeline(1, 2))
  assert batches["t"].tolist() == [[-2**31, 2**31 - 1]]
  assert batches["u"].tolist() == [[0, 2**32 - 1]]


def test_integers_wider_than_jax_keeps_are_checked_without_a_copy(tmp_path):
  """copy=False serves 64-bit integers as JAX keeps them (int32 without
  jax_enable_x64) from the user's arrays: values that fit come through
  exactly; one that does not is refused at construction for an array in
  memory, and named (array, row, value) by the read that meets it for a
  memmap, which is not read whole up front. Before, NumPy's cast wrapped
  it without a word (3,000,000,013 served as -1,294,967,283)."""
  if jax.config.jax_enable_x64:
    pytest.skip("64-bit integers are served as they are")
  wide = np.arange(40, dtype=np.int64) - 20
  wide[13] = 3_000_000_013
  with pytest.raises(ValueError, match=r"array 'y' holds integers from -20 "
                     r"to 3000000013 \(the first outside at row 13: "
                     r"3000000013\), which JAX's int32"):
    NumpyDataLoader(copy=False, x=np.arange(40.0), y=wide)
  np.save(tmp_path / "y.npy", wide)
  np.save(tmp_path / "fits.npy", np.arange(40, dtype=np.int64) - 20)
  for name, fits in (("y.npy", False), ("fits.npy", True)):
    loader = NumpyDataLoader(copy=False, x=np.arange(40.0),
                             y=np.load(tmp_path / name, mmap_mode="r"))
    for chain in (loader.register_ordered_pipeline(2, 10),
                  loader.register_random_pipeline(2, 10, seed=0,
                                                  shuffle=True)):
      if fits:
        batches, _ = loader.get_batches(chain)
        assert batches["y"].dtype == np.int32
        np.testing.assert_array_equal(batches["y"], batches["x"] - 20)
      else:
        with pytest.raises(ValueError, match=re.escape(
            "array 'y' holds at row 13 the integer 3000000013, which JAX's "
            "int32 (64-bit types are 32-bit without jax_enable_x64) cannot "
            "hold")):
          for _ in range(4):  # row 13 is among the first 40 rows read
            loader.get_batches(chain)


@pytest.mark.parametrize("kind", ["memmap", "hdf5 contiguous", "hdf5 chunked"])
def test_a_device_loader_checks_integers_of_arrays_it_moves_whole(tmp_path,
                                                                 kind):
  """DeviceNumpyDataLoader(copy=False) over a memmap or an HDF5 dataset
  moves the array to the device whole: an integer that int32 cannot hold
  is refused there, named with its row, as NumpyDataLoader refuses it when
  read. It came through wrapped (3,000,000,013 as -1,294,967,283), or
  saturated from a chunked HDF5 dataset."""
  if jax.config.jax_enable_x64:
    pytest.skip("64-bit integers are served as they are")
  y = np.arange(10, dtype=np.int64)
  y[6] = 3_000_000_013
  fits = np.arange(10, dtype=np.int64) - 5
  match = (r"array 'y' holds integers from 0 to 3000000013 \(the first "
           r"outside at row 6: 3000000013\), which JAX's int32")
  if kind == "memmap":
    np.save(tmp_path / "y.npy", y)
    np.save(tmp_path / "fits.npy", fits)
    wide = np.load(tmp_path / "y.npy", mmap_mode="r")
    narrow = np.load(tmp_path / "fits.npy", mmap_mode="r")
  else:
    h5py = pytest.importorskip("h5py")
    chunks = (3,) if kind == "hdf5 chunked" else None
    f = h5py.File(tmp_path / "y.h5", "w")
    f.create_dataset("y", data=y, chunks=chunks)
    f.create_dataset("fits", data=fits, chunks=chunks)
    wide, narrow = f["y"], f["fits"]
  for copied in (True, False):
    with pytest.raises(ValueError, match=match):
      DeviceNumpyDataLoader(copy=copied, y=wide)
  loader = DeviceNumpyDataLoader(copy=False, y=narrow)
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 5)
  values, _ = mapper_fn(lambda batch, carry: (batch["y"], carry), None)
  release_fn()
  assert np.asarray(values).dtype == np.int32
  assert np.asarray(values).reshape(-1).tolist() == fits.tolist()


def test_initializer_batch_and_batch_format():
  loader = NumpyDataLoader(x_r=np.arange(10), y_r=np.zeros((10, 2)))
  zero = loader.initializer_batch()
  assert zero["x_r"].shape == () and zero["y_r"].shape == (2,)
  fmt, info = loader.batch_format(5, 3)
  assert fmt["y_r"].shape == (5, 3, 2) and fmt["y_r"].dtype == jnp.float32
  assert info.observation_count == 10 and info.batch_size == 3
  assert info.mask.tolist() == [True] * 3


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(cache_size=0, mb_size=2), ValueError, "cache_size=0"),
    (dict(cache_size=1, mb_size=0), ValueError, "mb_size=0"),
    (dict(cache_size=1, mb_size=11), ValueError, "mb_size=11"),
    (dict(cache_size=1, mb_size=None), ValueError, "mb_size=None"),
    (dict(cache_size=1.5, mb_size=2), TypeError, "cache_size=1.5"),
    (dict(mb_size=2, in_epochs=True), ValueError, "in_epochs=True needs"),
    (dict(mb_size=2, sed=1), TypeError, "sed=1"),
    (dict(mb_size=2, seed=-1), ValueError, "seed=-1"),
    (dict(mb_size=2, shuffle="no"), TypeError, "shuffle='no'"),
    (dict(mb_size=2, shard_index=2, shard_count=2), ValueError,
     "shard_index=2"),
    (dict(mb_size=2, shard_index=0), ValueError, "go together"),
    (dict(cache_size=2**63, mb_size=2), ValueError,
     "cache_size must be between 1 and 2147483647"),
])
def test_bad_chain_arguments_are_named(kwargs, error, match):
  loader = NumpyDataLoader(x=np.arange(10))
  with pytest.raises(error, match=match):
    loader.register_random_pipeline(**kwargs)


def test_chain_ids_count_registrations_and_default_seed():
  loader = NumpyDataLoader(x=np.arange(50))
  assert loader.register_ordered_pipeline(2, 3) == 0
  chain = loader.register_random_pipeline(2, 3)
  assert chain == 1
  explicit = loader.register_random_pipeline(2, 3, seed=1)
  assert _stream(loader, chain, 3) == _stream(loader, explicit, 3)


@pytest.mark.parametrize("mode", MODES)
def test_save_and_load_state_continue_exactly(mode):
  loader = NumpyDataLoader(x=np.arange(23))
  chain = loader.register_random_pipeline(3, 4, seed=11, **mode)
  _stream(loader, chain, 2)
  saved = loader.save_state(chain)
  frozen = copy.deepcopy(saved)
  expected = _stream(loader, chain, 6)
  # Into the same chain, and into a new chain of a new loader.
  loader.load_state(chain, saved)
  assert _stream(loader, chain, 6) == expected
  other = NumpyDataLoader(x=np.arange(23))
  chain2 = other.register_random_pipeline(3, 4, seed=99, **mode)
  other.load_state(chain2, saved)
  assert _stream(other, chain2, 6) == expected
  assert saved == frozen  # loading never mutates the checkpoint


def test_save_and_load_state_of_ordered_chain():
  loader = NumpyDataLoader(x=np.arange(10))
  chain = loader.register_ordered_pipeline(2, 4)
  loader.get_batches(chain)
  saved = loader.save_state(chain)
  expected = _stream(loader, chain, 4)
  loader.load_state(chain, saved)
  assert _stream(loader, chain, 4) == expected


def test_load_state_names_what_differs():
  loader = NumpyDataLoader(x=np.arange(10))
  a = loader.register_random_pipeline(2, 3)
  b = loader.register_random_pipeline(4, 3)
  with pytest.raises(ValueError, match="cache_size is 2 in the state but 4"):
    loader.load_state(b, loader.save_state(a))
  c = loader.register_random_pipeline(2, 3, shuffle=True)
  with pytest.raises(ValueError, match="mode 'independent'"):
    loader.load_state(c, loader.save_state(a))


@pytest.mark.parametrize("kwargs,edit,match", [
    (dict(shuffle=True, in_epochs=True), dict(offset=-5),
     "offset must be between 0 and 3, got offset=-5"),
    (dict(shuffle=True), dict(offset=10), "offset must be between 0 and 9"),
    (dict(shuffle=True), dict(offset=None), "has no 'offset'"),
    (dict(), dict(rng=None), "rng must be the state of a PCG64 generator"),
    (dict(stream="counter"), dict(batch=-3), "batch must be between 0"),
    (dict(stream="counter"), dict(batch=2**70), "got batch=1180591620717"),
    (dict(stream="counter"), dict(seed=-1), "seed must be between 0"),
    # A bare OverflowError, and "unhashable type: 'list'".
    (dict(), dict(rng={"bit_generator": "PCG64", "state": {"state": -1,
                                                           "inc": 1},
                       "has_uint32": 0, "uinteger": 0}),
     "rng must be the state of a PCG64 generator.*OverflowError"),
    (dict(stream="counter"), dict(draws=[2]), r"draws must be an integer, "
     r"got draws=\[2\]"),
    (dict(stream="counter", shuffle=True), dict(permutation=[1]),
     r"permutation must be an integer"),
])
def test_load_state_checks_every_field(kwargs, edit, match):
  """An edited position is refused, naming the field, and the chain goes
  on where it stood (before: batches all masked, or a bare KeyError or
  OverflowError at the next batch)."""
  loader = NumpyDataLoader(x=np.arange(10))
  chain = loader.register_random_pipeline(2, 3, seed=0, **kwargs)
  loader.get_batches(chain)
  saved = loader.save_state(chain)
  expected = _stream(loader, chain, 3)
  loader.load_state(chain, saved)
  stream = saved["stream"]
  for name, value in edit.items():
    if value is None and name != "rng":
      del stream[name]
    else:
      stream[name] = value
  with pytest.raises((TypeError, ValueError), match=match):
    loader.load_state(chain, saved)
  assert _stream(loader, chain, 3) == expected


def test_load_state_refuses_fields_the_position_does_not_have():
  """A field put beside stream instead of in it (batch) was ignored: the
  chain stayed where it stood."""
  loader = NumpyDataLoader(x=np.arange(1000))
  chain = loader.register_random_pipeline(2, 8, seed=3, stream="counter",
                                          shuffle=True)
  saved = loader.save_state(chain)
  expected = _stream(loader, chain, 2)
  loader.load_state(chain, saved)
  with pytest.raises(ValueError, match=r"has fields \['batch'\] besides "
                     "version and stream"):
    loader.load_state(chain, dict(saved, batch=5))
  assert _stream(loader, chain, 2) == expected


def test_released_chain_is_an_error():
  loader = NumpyDataLoader(x=np.arange(10))
  chain = loader.register_random_pipeline(2, 3)
  loader.release_chain(chain)
  with pytest.raises(ValueError, match="was released"):
    loader.get_batches(chain)
  with pytest.raises(ValueError, match="does not exist"):
    loader.get_batches(5)
  other = loader.register_random_pipeline(2, 3)
  for bad in (1.7, "x", None, -5):  # before: 1.7 released chain 1
    with pytest.raises((TypeError, ValueError), match="chain_id"):
      loader.release_chain(bad)
  loader.get_batches(other)


def test_memmap_without_copy_stays_on_disk(tmp_path):
  path = tmp_path / "x.npy"
  data = np.lib.format.open_memmap(path, mode="w+", dtype=np.float64,
                                   shape=(100, 3))
  data[:] = np.arange(300).reshape(100, 3)
  data.flush()
  mm = np.load(path, mmap_mode="r")
  loader = NumpyDataLoader(copy=False, x=mm)
  assert isinstance(loader._arrays["x"], np.memmap)
  chain = loader.register_random_pipeline(2, 5, seed=3)
  batches, _ = loader.get_batches(chain)
  reference = NumpyDataLoader(x=np.asarray(mm))
  ref_chain = reference.register_random_pipeline(2, 5, seed=3)
  expected, _ = reference.get_batches(ref_chain)
  assert batches["x"].dtype == np.float32
  np.testing.assert_array_equal(batches["x"], expected["x"])


def test_copy_on_write_memmap_keeps_the_users_edits(tmp_path):
  path = tmp_path / "x.npy"
  np.save(path, np.arange(20.0).reshape(10, 2))
  mm = np.load(path, mmap_mode="c")
  mm[0] = -1.0  # an edit in memory only
  loader = NumpyDataLoader(copy=False, x=mm)
  chain = loader.register_random_pipeline(1, 4, seed=0)
  loader.get_batches(chain)
  assert mm[0].tolist() == [-1.0, -1.0]


def test_device_loader_draws_with_key():
  loader = DeviceNumpyDataLoader(x=np.arange(10), y=np.zeros((10, 2)))
  key = loader.init_random_data(key=jax.random.PRNGKey(3))
  key2, (batch, info) = jax.jit(loader.get_random_data,
                                static_argnums=1)(key, 4)
  assert batch["x"].shape == (4,) and batch["y"].shape == (4, 2)
  assert not np.array_equal(key, key2)
  assert info.mask.tolist() == [True] * 4
  typed = loader.init_random_data(key=jax.random.key(3))
  np.testing.assert_array_equal(typed, key)
  with pytest.raises(TypeError, match="seed=1"):
    loader.init_random_data(seed=1)
  assert loader.get_full_data()["x"].tolist() == list(range(10))


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_device_loader_chains_under_another_default_prng(impl):
  """Under jax_default_prng_impl="rbg" a device pipeline refused its own
  default state (key data of 4 words, expected 2) and every counter chain
  failed in the jax.random branch. jax.random chains draw with
  threefry2x32 whatever the default: the same batches as under it; a key
  of another impl is refused by name."""
  def batches(**kwargs):
    loader = DeviceNumpyDataLoader(x=np.arange(20))
    init_fn, batch_fn, _ = jax_data.random_reference_data(loader, 1, 4)
    state, out = init_fn(**kwargs), []
    for _ in range(3):
      state, batch = jax.jit(batch_fn)(state)
      out.append(batch["x"].tolist())
    return out

  cases = [{}, {"key": jax.random.key(5, impl="threefry2x32")},
           {"key": np.array([0, 5], np.uint32)},
           {"seed": 3, "shuffle": True, "stream": "counter"}]
  want = [batches(**kwargs) for kwargs in cases]
  with jax.default_prng_impl(impl):
    assert [batches(**kwargs) for kwargs in cases] == want
    with pytest.raises(TypeError, match=f"impl {impl}"):
      batches(key=jax.random.key(1))
    with pytest.raises(TypeError, match=f"jax_default_prng_impl is '{impl}'"):
      batches(key=jax.random.PRNGKey(1))
    # The predecessor's draw takes the caller's keys as they are.
    loader = DeviceNumpyDataLoader(x=np.arange(20))
    key, (batch, _) = loader.get_random_data(jax.random.PRNGKey(1), 4)
    assert key.shape == jax.random.PRNGKey(1).shape
    _, (again, _) = loader.get_random_data(loader.init_random_data(), 4)
    assert again["x"].shape == (4,)


def test_recycled_buffers_never_overwrite_a_chunk_in_use():
  loader = NumpyDataLoader(x=np.arange(1000))
  chain = loader.register_random_pipeline(4, 8, seed=2)
  reference = NumpyDataLoader(x=np.arange(1000))
  ref_chain = reference.register_random_pipeline(4, 8, seed=2)
  held = [loader.get_batches(chain)[0]["x"] for _ in range(3)]
  expected = [reference.get_batches(ref_chain)[0]["x"].copy()
              for _ in range(3)]
  for _ in range(20):  # dropped chunks: their buffers are used again
    got = loader.get_batches(chain)[0]["x"]
    np.testing.assert_array_equal(got,
                                  reference.get_batches(ref_chain)[0]["x"])
  for chunk, want in zip(held, expected):
    np.testing.assert_array_equal(chunk, want)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_split_gathers_and_copies_equal_numpy(threads):
  # Parts of at least 64 bytes: rows of 5 float64 split into up to
  # ``threads`` parts, the last ones shorter, for both take and copy.
  gatherer = gather.Gatherer(threads=threads, part_bytes=64)
  array = np.arange(1000 * 5, dtype=np.float64).reshape(1000, 5)
  flat = np.random.default_rng(threads).integers(0, 1000, 97)
  out = np.full((97, 5), np.nan)
  assert gatherer.take(array, flat, out) is out
  np.testing.assert_array_equal(out, np.take(array, flat, axis=0))
  copied = np.full((97, 5), np.nan)
  gatherer.copy(copied, array[100:197])
  np.testing.assert_array_equal(copied, array[100:197])
  small = np.zeros((1, 5))  # fewer rows than threads: one part
  gatherer.copy(small, array[:1])
  np.testing.assert_array_equal(small, array[:1])
  gatherer.close()
  gatherer.close()  # idempotent


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("count", [0, 1, 97])
def test_take_all_gathers_every_leaf_as_numpy_does(threads, count):
  """take_all writes rows ``flat`` of every leaf, split by rows over the
  threads with all leaves in each part (a leaf of one value per row, rows
  of 5 float64, and one converted to another dtype), as np.take would."""
  gatherer = gather.Gatherer(threads=threads, part_bytes=64)
  rows = np.arange(1000 * 5, dtype=np.float64).reshape(1000, 5)
  labels = np.arange(1000, dtype=np.int32) * 3
  wide = np.arange(1000 * 2, dtype=np.int16).reshape(1000, 2)
  flat = np.random.default_rng(count).integers(0, 1000, count)
  outs = [np.full((count, 5), np.nan), np.full(count, -1, np.int32),
          np.zeros((count, 2), np.float32)]
  gatherer.take_all(list(zip((rows, labels, wide), outs)), flat)
  for array, out in zip((rows, labels, wide), outs):
    np.testing.assert_array_equal(
        out, np.take(array, flat, axis=0).astype(out.dtype))
  gatherer.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("sizes", [[], [7], [40, 1, 1, 40, 3], [1] * 30])
def test_copies_of_many_lanes_land_whole_split_or_not(threads, sizes):
  """copy_all writes every pair, however its pairs split into parts (by
  bytes, of at least 64 here) and whichever thread takes them."""
  array = np.arange(100 * 4, dtype=np.float64).reshape(100, 4)
  gatherer = gather.Gatherer(threads=threads, part_bytes=64)
  starts = np.cumsum([0] + sizes)
  outs = [np.full((n, 4), np.nan) for n in sizes]
  pairs = [(out, array[a:a + len(out)]) for out, a in zip(outs, starts)]
  gatherer.copy_all(pairs)
  for out, source in pairs:
    np.testing.assert_array_equal(out, source)
  gatherer.close()


def test_a_split_does_not_wait_for_a_helper_that_never_starts():
  """The caller takes every part a helper has not taken: with the only
  helper thread held up, a split gather still finishes, whole."""
  import threading
  gatherer = gather.Gatherer(threads=2, part_bytes=64)
  array = np.arange(1000 * 5, dtype=np.float64).reshape(1000, 5)
  release = threading.Event()
  held = gatherer._helper_pool().submit(release.wait)
  flat = np.arange(999, -1, -1)
  out = gatherer.take(array, flat, np.empty((1000, 5)))
  np.testing.assert_array_equal(out, array[::-1])
  release.set()
  held.result()
  gatherer.close()


@pytest.mark.parametrize("copy", [True, False])
def test_big_endian_arrays_are_served_in_the_machines_byte_order(
    tmp_path, copy):
  """Arrays stored big-endian (a file written elsewhere: an ndarray, a
  memmap, an HDF5 dataset) are served as the same numbers in the machine's
  order, copied or read in place."""
  x = np.arange(20.0, dtype=np.float32).reshape(10, 2)
  big = x.astype(">f4")
  np.save(tmp_path / "x.npy", big)
  arrays = [big, np.load(tmp_path / "x.npy", mmap_mode="r")]
  h5py = pytest.importorskip("h5py")
  with h5py.File(tmp_path / "x.h5", "w") as f:
    f.create_dataset("x", data=big)
  with h5py.File(tmp_path / "x.h5", "r") as f:
    for array in arrays + [f["x"]]:
      for loader_class in (NumpyDataLoader, DeviceNumpyDataLoader):
        loader = loader_class(copy=copy, x=array)
        assert loader.observation_format["x"].dtype == np.float32
        mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 3)
        values, _ = mapper_fn(lambda batch, carry: (batch["x"], carry), None)
        np.testing.assert_array_equal(values, x)
        release_fn()


def test_hdf5_scalars_groups_and_framework_tensors(tmp_path):
  """A 0-d HDF5 dataset is refused for its missing observation axis with
  copy=False too (it was an IndexError); a group is named as one, not as
  an array of its key names; a tensor of another framework (its dtype not
  NumPy's) is converted, not taken for an array on disk."""
  h5py = pytest.importorskip("h5py")
  with h5py.File(tmp_path / "s.h5", "w") as f:
    f.create_dataset("scalar", data=1.5)
    f.create_dataset("group/x", data=np.arange(3.0))
  with h5py.File(tmp_path / "s.h5", "r") as f:
    for copy in (True, False):
      with pytest.raises(ValueError, match="first axis of observations"):
        NumpyDataLoader(copy=copy, s=f["scalar"])
      with pytest.raises(TypeError, match=r"array 'g' is a Group of arrays, "
                         "not an array"):
        NumpyDataLoader(copy=copy, g=f["group"])

  class Tensor:
    """Shape, a framework's dtype, indexing and __array__."""
    dtype = "framework.float32"

    def __init__(self, value):
      self._value = value
      self.shape = value.shape

    def __getitem__(self, index):
      return Tensor(self._value[index])

    def __array__(self, dtype=None, copy=None):
      return self._value

  x = np.arange(6.0, dtype=np.float32).reshape(3, 2)
  for copy in (True, False):
    loader = NumpyDataLoader(copy=copy, x=Tensor(x))
    mapper_fn, release_fn = jax_data.full_data_mapper(loader, 1, 3)
    values, _ = mapper_fn(lambda batch, carry: (batch["x"], carry), None)
    np.testing.assert_array_equal(values, x)
    release_fn()


def test_eager_device_counter_batches_compile_once():
  """Each eager batch_fn of a device counter chain built its draw anew and
  compiled it again (a second, and memory mappings that add up until
  LLVM fails): the draw is made once per size."""
  from jax_data.compiled import device_loader
  assert device_loader.kind_draw(10, 2) is device_loader.kind_draw(10, 2)
  loader = DeviceNumpyDataLoader(x=np.arange(10))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 1, 2)
  state, _ = batch_fn(init_fn(seed=415, stream="counter"))
  compiled = []
  logger = logging.getLogger("jax")

  class Count(logging.Handler):
    def emit(self, record):
      if "Finished XLA compilation" in record.getMessage():
        compiled.append(record.getMessage())

  handler, level = Count(), logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  try:
    with jax.log_compiles(True):
      for _ in range(3):
        state, _ = batch_fn(state)
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  assert compiled == []
  release_fn()


def test_a_buffer_pool_gives_buffers_again_once_free():
  """Buffers come back once nothing but the pool holds them, looked for
  round robin a few at a time: a pool of many buffers, freed in about
  the order they were given, does not grow past its capacity, one still
  held is never given again, buffers held long do not make every call a
  new one, and only the reserved formats keep more than six."""
  from jax_data.loaders.gather import BufferPool
  pool = BufferPool()
  fmt = ((4,), np.float32)
  pool.reserve(100, [fmt])
  held = [pool.empty(*fmt) for _ in range(100)]
  assert len({id(b) for b in held}) == 100
  kept = pool._free[((4,), np.dtype(np.float32))]  # pylint: disable=protected-access
  for _ in range(5):  # the oldest 30 go, 30 come, round after round
    freed = {id(b) for b in held[:30]}
    del held[:30]
    new = [pool.empty(*fmt) for _ in range(30)]
    assert len(kept) == 100
    assert not {id(b) for b in new} & {id(b) for b in held}
    assert len({id(b) for b in new} & freed) >= 20  # most used again
    held.extend(new)
  # Eight held for good at the front, the rest taken and dropped: the
  # pool keeps about what is in use, not its capacity.
  other = BufferPool()
  other.reserve(1000, [fmt])
  long_held = [other.empty(*fmt) for _ in range(8)]
  for _ in range(2000):
    other.empty(*fmt)
  assert len(other._free[((4,), np.dtype(np.float32))]) <= 20  # pylint: disable=protected-access
  # Other formats keep six.
  many = [pool.empty((3,), np.int8) for _ in range(50)]
  assert len(pool._free[((3,), np.dtype(np.int8))]) == 6  # pylint: disable=protected-access
  del many, long_held


def test_a_buffer_pool_keeps_the_buffers_of_a_few_formats_not_all():
  """Chunks of chains served as they come ready have a row count for each
  group size; a pool that kept six buffers of every such format grew call
  after call (1,024 memmap chains). The last eight formats used keep
  theirs, and a reserved format keeps its buffers whatever else comes."""
  from jax_data.loaders.gather import BufferPool
  pool = BufferPool()
  reserved = ((4,), np.float32)
  pool.reserve(10, [reserved])
  kept = [pool.empty(*reserved) for _ in range(10)]
  for rows in range(1, 200):
    pool.empty((rows, 33), np.float32)
  formats = pool._free  # pylint: disable=protected-access
  assert len(formats) == 1 + 8
  assert {shape[0] for shape, _ in formats if shape != (4,)} == set(
      range(192, 200))
  assert len(formats[((4,), np.dtype(np.float32))]) == 10
  # a format used again is recent again; the buffers it keeps come back
  again = pool.empty((192, 33), np.float32)
  del again
  for rows in range(300, 307):
    pool.empty((rows, 33), np.float32)
  assert ((192, 33), np.dtype(np.float32)) in formats
  assert ((193, 33), np.dtype(np.float32)) not in formats
  del kept


def _gather_threads():
  return sum(t.name.startswith("jax_data-gather")
             for t in threading.enumerate())


@pytest.mark.skipif(gather.usable_cores() < 2,
                    reason="one core: the gather has no helper threads")
def test_a_loader_kept_after_release_keeps_no_threads():
  """A loader kept for later pipelines ends its gather threads when its
  last chain is released, and starts them again when read again."""
  loader = NumpyDataLoader(x=np.random.default_rng(0).random(
      (100_000, 32), np.float32))
  before = _gather_threads()
  for _ in range(2):
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, 10, 64)
    states = init_fn(seed=range(16))
    step = jax.jit(jax.vmap(batch_fn))
    for _ in range(25):
      states, batches = step(states)
    jax.block_until_ready(batches)
    assert _gather_threads() > before
    release_fn()
    deadline = time.monotonic() + 10
    while _gather_threads() > before and time.monotonic() < deadline:
      time.sleep(0.01)
    assert _gather_threads() <= before


def test_a_traced_array_is_named():
  """NumPy's TracerArrayConversionError did not name the array."""
  with pytest.raises(TypeError, match="array 'x' must be concrete, got a "
                     "traced array"):
    jax.jit(lambda a: jax_data.NumpyDataLoader(x=a) and a)(jnp.arange(3.0))


@pytest.mark.parametrize("key", [None, "abc", np.zeros(2, np.float32),
                                 np.zeros(3, np.uint32)])
def test_get_random_data_names_a_key_that_is_none(key):
  """JAX's errors (unexpected PRNG key type, data type 'abc') did not say
  what the argument should be."""
  loader = jax_data.DeviceNumpyDataLoader(x=np.arange(10.0))
  with pytest.raises(TypeError, match="state must be a PRNG key"):
    loader.get_random_data(key, 3)
  raw = jax.random.key_data(jax.random.key(0))
  _, (batch, _) = jax.jit(lambda k: loader.get_random_data(k, 3))(raw)
  assert batch["x"].shape == (3,)

