"""Every dtype JAX accepts, ml_dtypes' too (bfloat16, float8, int4), goes
through every loader and stream; objects and strings are refused by name."""

import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jax_data
from jax_data import DeviceNumpyDataLoader
from jax_data import NumpyDataLoader
from jax_data import SourceDataLoader

# Tests that build pipelines with the `pipelines` fixture run with both ways
# chunks reach compiled code (conftest.py).

N, CACHE, MB = 23, 2, 5  # 23 is no multiple of 5: epochs end with masks
BF16 = np.dtype(ml_dtypes.bfloat16)
X32 = (np.arange(N * 3, dtype=np.float32).reshape(N, 3) / 7 - 2).astype(
    np.float32)  # values that bfloat16 rounds
MODES = [dict(), dict(shuffle=True), dict(shuffle=True, in_epochs=True)]
MODE_IDS = ["with_replacement", "shuffled", "epochs"]


def _stackable(x):
  """``x``, or, for values of fewer than 8 bits outside the CPU, the same
  values in a byte-sized type: XLA on a GPU cannot stack 4-bit values of an
  odd count per step in a scan's outputs ("Non-byte-aligned dimension in
  slice", seen with JAX 0.11.2 on an H200, in a plain ``lax.scan`` without
  jax_data too). :func:`_served` casts them back on the host."""
  if (jax.default_backend() == "cpu"
      or jax.dtypes.itemsize_bits(x.dtype) >= 8):
    return x
  return x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating)
                  else jnp.int8)


def _served(outputs, dtypes):
  """Outputs of a jitted function, as NumPy arrays of the ``dtypes`` the
  pipeline served (see :func:`_stackable`)."""
  return jax.tree_util.tree_map(lambda x, d: np.asarray(x).astype(d),
                                outputs, dtypes)


def _random_stream(pipelines, loader, mode, steps=11):
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(
      loader, CACHE, MB)
  dtypes = jax.tree_util.tree_map(lambda s: s.dtype, jax.eval_shape(
      batch_fn, init_fn(seed=5, **mode))[1])

  def body(state, _):
    state, (batch, info) = batch_fn(state, information=True)
    return state, (jax.tree_util.tree_map(_stackable, batch), info.mask)

  _, (batches, masks) = jax.jit(lambda s: lax.scan(body, s, None,
                                                   length=steps))(
      init_fn(seed=5, **mode))
  release_fn()
  return _served(batches, dtypes), np.asarray(masks)


def _full_passes(pipelines, loader):
  """One pass of full_reference_data (batches, masks) and one of
  full_data_mapper (observation by observation)."""
  init_fn, map_fn, release_fn = pipelines.full_reference_data(loader, CACHE,
                                                              MB)
  stackable = lambda tree: jax.tree_util.tree_map(_stackable, tree)
  dtypes = {}

  def keep(batch, mask, carry):
    dtypes.update(jax.tree_util.tree_map(lambda x: x.dtype, batch))
    return (stackable(batch), mask), carry

  _, ((batches, masks), _) = jax.jit(lambda s: map_fn(
      keep, s, None, masking=True))(init_fn())
  release_fn()
  mapper_fn, release_mapper = pipelines.full_data_mapper(loader, CACHE, MB)
  each, _ = mapper_fn(lambda observation, carry: (stackable(observation),
                                                  carry), None,
                      batched=False)
  release_mapper()
  return (_served(batches, dtypes), np.asarray(masks), _served(each, dtypes))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_random_streams_in_bfloat16_are_the_float32_streams_cast(pipelines,
                                                                 mode):
  y = np.arange(N, dtype=np.int32)
  want, want_masks = _random_stream(pipelines, NumpyDataLoader(x=X32, y=y),
                                    mode)
  got, got_masks = _random_stream(
      pipelines, NumpyDataLoader(x=X32.astype(BF16), y=y), mode)
  assert got["x"].dtype == BF16
  np.testing.assert_array_equal(got_masks, want_masks)
  np.testing.assert_array_equal(got["y"], want["y"])
  np.testing.assert_array_equal(got["x"], want["x"].astype(BF16))
  if mode.get("in_epochs"):
    # Each epoch serves every observation once; its last batch is masked.
    epoch = got["y"].reshape(-1)[:-(-N // MB) * MB]
    served = epoch[got_masks.reshape(-1)[:epoch.size]]
    assert sorted(served.tolist()) == list(range(N))


def test_full_passes_in_bfloat16_are_the_float32_passes_cast(pipelines):
  want = _full_passes(pipelines, NumpyDataLoader(x=X32))
  got = _full_passes(pipelines, NumpyDataLoader(x=X32.astype(BF16)))
  (batches, masks, each), (want_batches, want_masks, want_each) = got, want
  assert batches["x"].dtype == each["x"].dtype == BF16
  np.testing.assert_array_equal(masks, want_masks)
  np.testing.assert_array_equal(batches["x"], want_batches["x"].astype(BF16))
  np.testing.assert_array_equal(each["x"], X32.astype(BF16))
  np.testing.assert_array_equal(want_each["x"], X32)
  assert masks.sum() == N


@pytest.mark.parametrize("processes", [False, True],
                         ids=["threads", "processes"])
def test_source_records_in_bfloat16(pipelines, processes):
  records = [{"x": row, "label": np.int32(i)}
             for i, row in enumerate(X32.astype(BF16))]
  loader = SourceDataLoader(records, workers=2, processes=processes)
  reference = NumpyDataLoader(x=X32.astype(BF16), label=np.arange(N))
  for got, want in [(_random_stream(pipelines, loader, MODES[2]),
                     _random_stream(pipelines, reference, MODES[2])),
                    (_full_passes(pipelines, loader),
                     _full_passes(pipelines, reference))]:
    got_leaves, want_leaves = (jax.tree_util.tree_leaves(got),
                               jax.tree_util.tree_leaves(want))
    assert [g.dtype for g in got_leaves] == [w.dtype for w in want_leaves]
    for g, w in zip(got_leaves, want_leaves):
      np.testing.assert_array_equal(g, w)


def test_device_loader_in_bfloat16(pipelines):
  got = _full_passes(pipelines, DeviceNumpyDataLoader(x=X32.astype(BF16)))
  assert got[0]["x"].dtype == got[2]["x"].dtype == BF16
  np.testing.assert_array_equal(got[2]["x"], X32.astype(BF16))
  init_fn, batch_fn, _ = pipelines.random_reference_data(
      DeviceNumpyDataLoader(x=X32.astype(BF16), y=np.arange(N)), CACHE, MB)
  _, batch = jax.jit(batch_fn)(init_fn())
  assert batch["x"].dtype == BF16
  np.testing.assert_array_equal(batch["x"], X32.astype(BF16)[batch["y"]])


def test_memmap_in_bfloat16_stays_on_disk(pipelines, tmp_path):
  path = os.fspath(tmp_path / "x.bf16")
  written = np.memmap(path, dtype=BF16, mode="w+", shape=X32.shape)
  written[:] = X32.astype(BF16)
  written.flush()
  mapped = np.memmap(path, dtype=BF16, mode="r", shape=X32.shape)
  got = _full_passes(pipelines, NumpyDataLoader(x=mapped, copy=False))
  np.testing.assert_array_equal(got[2]["x"], X32.astype(BF16))
  batches, _ = _random_stream(
      pipelines, NumpyDataLoader(x=mapped, y=np.arange(N), copy=False),
      MODES[1])
  np.testing.assert_array_equal(batches["x"], X32.astype(BF16)[batches["y"]])


# Of 8 bits and fewer: XLA packs int4, uint4 and float4 two to a byte in its
# buffers, NumPy holds one to a byte.
SMALL = ["float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "int4", "uint4",
         "int2", "float4_e2m1fn"]


@pytest.mark.parametrize("name", SMALL)
def test_small_dtypes_serve_the_rows_they_name(pipelines, name):
  dtype = np.dtype(getattr(ml_dtypes, name))
  x = (np.arange(N * 3) % 4).reshape(N, 3).astype(dtype)
  batches, _ = _random_stream(pipelines,
                              NumpyDataLoader(x=x, y=np.arange(N)), MODES[2])
  assert batches["x"].dtype == dtype
  # Compared bit for bit: float8_e8m0fnu has no zero, 0 becomes NaN.
  bits = lambda a: a.view(np.uint8)
  np.testing.assert_array_equal(bits(batches["x"]), bits(x[batches["y"]]))
  _, _, each = _full_passes(pipelines, NumpyDataLoader(x=x))
  np.testing.assert_array_equal(bits(each["x"]), bits(x))


def test_one_byte_dtypes_of_one_shape_keep_their_own_dtype(pipelines):
  """int4 and float8_e4m3fn share NumPy's ``.str`` ("<V1"): pipelines of
  each, used one after the other, still return their own dtype."""
  for name in ["float8_e4m3fn", "int4", "float8_e4m3fn"]:
    dtype = np.dtype(getattr(ml_dtypes, name))
    x = (np.arange(N * 3) % 4).reshape(N, 3).astype(dtype)
    batches, _ = _random_stream(
        pipelines, NumpyDataLoader(x=x, y=np.arange(N)), MODES[0], steps=2)
    assert batches["x"].dtype == dtype, name
    np.testing.assert_array_equal(batches["x"], x[batches["y"]])


def test_checkpoints_of_bfloat16_data_restore_and_tell_dtypes_apart(
    tmp_path):
  x = X32.astype(BF16)
  pipeline = jax_data.random_reference_data(NumpyDataLoader(x=x), CACHE, MB)
  init_fn, batch_fn, _ = pipeline
  state, _ = batch_fn(init_fn(seed=2, shuffle=True))
  path = tmp_path / "data.npz"
  jax_data.save_checkpoint(path, pipeline, state)
  restored = jax_data.restore_checkpoint(path, pipeline)
  np.testing.assert_array_equal(batch_fn(restored)[1]["x"],
                                batch_fn(state)[1]["x"])
  # The same bytes as other one-byte types are other data.
  small = (np.arange(N * 3) % 4).reshape(N, 3).astype(np.uint8)
  saved = jax_data.random_reference_data(
      NumpyDataLoader(x=small.view(ml_dtypes.int4)), CACHE, MB)
  jax_data.save_checkpoint(path, saved, saved[0](seed=2))
  other = jax_data.random_reference_data(
      NumpyDataLoader(x=small.view(ml_dtypes.float8_e4m3fn)), CACHE, MB)
  with pytest.raises(jax_data.CheckpointError,
                     match="data is '[0-9a-f]+' in the checkpoint"):
    jax_data.restore_checkpoint(path, other)


@pytest.mark.parametrize("value", [
    np.array(["a", "b"]), np.array([b"a", b"b"]),
    np.array([object(), object()]), np.array([1, 2], "datetime64[s]"),
    np.array([1, 2], "timedelta64[s]"), np.zeros(2, "V4"),
    np.zeros(2, [("a", np.float32)])],
                         ids=lambda v: str(v.dtype))
def test_arrays_jax_cannot_hold_are_refused_by_name(value):
  for loader in (NumpyDataLoader, DeviceNumpyDataLoader):
    with pytest.raises(TypeError, match=(
        rf"array 'x' has dtype {re.escape(str(value.dtype))}.*cannot become "
        "a JAX array")):
      loader(x=value, y=np.arange(2))
  with pytest.raises(TypeError, match=(
      rf"record 0 has \['x'\] of dtype {re.escape(str(value.dtype))}.*"
      "cannot become a JAX array")):
    SourceDataLoader([{"x": v} for v in value])
