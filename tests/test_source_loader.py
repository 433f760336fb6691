"""SourceDataLoader: every kind of random-access source gives exactly the
NumpyDataLoader's streams over the stacked records."""

import gc
import io
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_data
from jax_data import NumpyDataLoader
from jax_data import SourceDataLoader

N = 23
MODES = [dict(), dict(shuffle=True), dict(shuffle=True, in_epochs=True)]


def _images(n=N):
  rng = np.random.default_rng(0)
  return (rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
          rng.integers(0, 10, n).astype(np.int64))


def _png(image):
  from PIL import Image
  buffer = io.BytesIO()
  Image.fromarray(image).save(buffer, format="PNG")
  return buffer.getvalue()


def _encode(image, label):
  """A record as bytes: a PNG image and its label."""
  return pickle.dumps({"png": _png(image), "label": int(label)})


def decode(record):
  """The transform of encoded records (module level: it pickles)."""
  from PIL import Image
  data = pickle.loads(record)
  return {"image": np.asarray(Image.open(io.BytesIO(data["png"]))),
          "label": np.int64(data["label"])}


def _stacked(loader):
  """A NumpyDataLoader over a source loader's records, stacked."""
  records = [loader._leaves(i, loader._load(i))  # pylint: disable=protected-access
             for i in range(len(loader._source))]  # pylint: disable=protected-access
  treedef = loader._first.treedef  # pylint: disable=protected-access
  columns = [np.stack(column) for column in zip(*records)]
  stacked = treedef.unflatten(columns)
  if not isinstance(stacked, dict):
    stacked = {f"leaf{i}": c for i, c in enumerate(columns)}
  return NumpyDataLoader(**stacked), treedef


def _leaves(batch):
  return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(batch)]


def _random_streams(loader, cache=3, mb=4, steps=9):
  """Batches of three chains, one per mode, vmapped in one jitted scan."""
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader,
                                                                 cache, mb)
  states = jax.tree_util.tree_map(
      lambda *xs: jnp.stack(xs),
      *[init_fn(seed=11 + i, **mode) for i, mode in enumerate(MODES)])
  run = jax.jit(jax.vmap(lambda s: lax.scan(
      lambda s, _: batch_fn(s, information=True), s, None, length=steps)[1]))
  batches, info = run(states)
  leaves = _leaves(batches) + [np.asarray(info.mask)]
  release_fn()
  return leaves


def _full_passes(loader, cache=2, mb=5):
  init_fn, map_fn, release_fn = jax_data.full_reference_data(loader, cache,
                                                             mb)
  fun = lambda batch, mask, carry: (jax.tree_util.tree_map(
      lambda leaf: leaf.reshape(leaf.shape[0], -1).sum(1) * mask, batch),
                                    carry)
  _, (passes, _) = jax.jit(lambda s: map_fn(fun, s, None, masking=True))(
      init_fn())
  mapper_fn, release_mapper = jax_data.full_data_mapper(loader, cache, mb)
  each, _ = mapper_fn(lambda batch, carry: (batch, carry), None)
  leaves = _leaves(passes) + _leaves(each)
  release_fn()
  release_mapper()
  return leaves


def _pmapped(loader, cache=2, mb=3, steps=5):
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader,
                                                                 cache, mb)
  states = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                  *[init_fn(seed=s) for s in range(4)])
  batches = jax.pmap(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                        length=steps)[1])(states)
  leaves = _leaves(batches)
  release_fn()
  return leaves


def _assert_same_streams(loader):
  """Random chains (jit, scan, vmap), full-data passes and pmapped chains
  equal those of a NumpyDataLoader over the stacked records."""
  reference, _ = _stacked(loader)
  for run in (_random_streams, _full_passes, _pmapped):
    got, want = run(loader), run(reference)
    assert len(got) == len(want)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


# -- the kinds of sources ---------------------------------------------------


class MapStyle:
  """A PyTorch-style map dataset: (image, label) tuples."""

  def __init__(self, images, labels):
    self.images, self.labels = images, labels

  def __len__(self):
    return len(self.labels)

  def __getitem__(self, i):
    return self.images[i].astype(np.float32) / 255, self.labels[i]


class BatchedMapStyle(MapStyle):
  """With PyTorch's optional batched read."""

  def __init__(self, images, labels):
    super().__init__(images, labels)
    self.batched_calls = 0

  def __getitems__(self, indices):
    self.batched_calls += 1
    return [self[i] for i in indices]


def test_list_of_dicts():
  images, labels = _images()
  records = [{"image": im, "label": lb} for im, lb in zip(images, labels)]
  loader = SourceDataLoader(records, workers=2)
  assert loader.observation_format["label"].dtype == jnp.int32
  _assert_same_streams(loader)


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_pytorch_style_map_dataset(workers):
  loader = SourceDataLoader(MapStyle(*_images()), workers=workers)
  _assert_same_streams(loader)


def test_batched_reads_are_used():
  source = BatchedMapStyle(*_images())
  loader = SourceDataLoader(source, workers=2)
  _assert_same_streams(loader)
  assert source.batched_calls > 0


def test_worker_processes_give_the_same_streams():
  """For transforms whose Python work holds the GIL (PNG decoding)."""
  pytest.importorskip("PIL")
  images, labels = _images()
  records = [_encode(image, label) for image, label in zip(images, labels)]
  loader = SourceDataLoader(records, transform=decode, workers=2,
                            processes=True)
  _assert_same_streams(loader)
  with pytest.raises(TypeError, match="do not pickle"):
    SourceDataLoader(records, transform=lambda r: decode(r), processes=True)


def test_grain_map_dataset():
  grain = pytest.importorskip("grain")
  images, labels = _images()
  records = [{"image": im, "label": lb} for im, lb in zip(images, labels)]
  dataset = grain.MapDataset.source(records).map(
      lambda r: {**r, "image": r["image"].astype(np.float32) / 255})
  _assert_same_streams(SourceDataLoader(dataset))


def test_array_record_source_with_a_decoding_transform(tmp_path):
  pytest.importorskip("grain")
  pytest.importorskip("PIL")
  array_record = pytest.importorskip("array_record.python.array_record_module")
  import grain
  images, labels = _images()
  path = str(tmp_path / "mnist.array_record")
  writer = array_record.ArrayRecordWriter(path, "group_size:1")
  for image, label in zip(images, labels):
    writer.write(_encode(image, label))
  writer.close()
  source = grain.sources.ArrayRecordDataSource([path])
  loader = SourceDataLoader(source, transform=decode, workers=2)
  _assert_same_streams(loader)
  reference, _ = _stacked(loader)
  np.testing.assert_array_equal(
      reference._arrays["image"], images)  # pylint: disable=protected-access


def test_hugging_face_dataset(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HOME", str(tmp_path))
  datasets = pytest.importorskip("datasets")
  images, labels = _images()
  dataset = datasets.Dataset.from_dict(
      {"image": images, "label": labels}).with_format("numpy")
  loader = SourceDataLoader(dataset, workers=2)
  # Hugging Face's numpy format widens integer arrays to int64.
  assert loader.observation_format["image"].shape == (28, 28)
  _assert_same_streams(loader)


def test_tfds_data_source_with_mock_data(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=N,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    source = tfds.data_source("mnist", split="train", data_dir=str(tmp_path))
  assert len(source) == N
  loader = SourceDataLoader(source, workers=2)
  assert loader.observation_format["image"].shape == (28, 28, 1)
  _assert_same_streams(loader)


def test_real_torch_dataset():
  torch = pytest.importorskip("torch")
  images, labels = _images()
  dataset = torch.utils.data.TensorDataset(torch.from_numpy(images),
                                           torch.from_numpy(labels))
  loader = SourceDataLoader(dataset, transform=lambda r: tuple(
      t.numpy() for t in r))
  _assert_same_streams(loader)


class H5Records:
  """Records of an HDF5 file, one row of each dataset per record."""

  def __init__(self, path):
    import h5py
    self.file = h5py.File(path, "r")

  def __len__(self):
    return len(self.file["label"])

  def __getitem__(self, i):
    return {"image": self.file["image"][i], "label": self.file["label"][i]}


def test_hdf5_datasets_and_records(tmp_path):
  h5py = pytest.importorskip("h5py")
  images, labels = _images()
  path = tmp_path / "mnist.h5"
  with h5py.File(path, "w") as f:
    f["image"] = images
    f["label"] = labels
  records = SourceDataLoader(H5Records(path), workers=2)
  _assert_same_streams(records)
  with h5py.File(path, "r") as f:
    lazy = NumpyDataLoader(copy=False, image=f["image"], label=f["label"])
    assert not isinstance(lazy._arrays["image"], np.ndarray)  # pylint: disable=protected-access
    in_memory = NumpyDataLoader(image=images, label=labels)
    for run in (_random_streams, _full_passes):
      for got, want in zip(run(lazy), run(in_memory)):
        np.testing.assert_array_equal(got, want)
    assert lazy.content_digest() == in_memory.content_digest()


# -- failures -----------------------------------------------------------------


class Raising(MapStyle):

  def __getitem__(self, i):
    if i == 7:
      raise KeyError("record missing")
    return super().__getitem__(i)


def test_a_failing_record_is_named():
  loader = SourceDataLoader(Raising(*_images()), workers=2)
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 4)
  with pytest.raises(Exception, match=r"SourceDataLoader over Raising: record "
                     r"7: KeyError: 'record missing'"):
    jax.block_until_ready(mapper_fn(lambda b, c: (b[1], c), None))
  release_fn()


@pytest.mark.parametrize("record,match", [
    ({"x": np.zeros(3)}, r"record 5 has the keys \['x'\], but record 0 has "
     r"\['x'\]"),
    ({"x": np.zeros(3), "y": np.zeros(4)}, r"record 5 has \['y'\] of dtype "
     r"float64 and shape \[4\], but record 0 has float64\[2\]"),
    ({"x": np.zeros(3), "y": np.zeros(2, np.float32)}, r"record 5 has "
     r"\['y'\] of dtype float32 and shape \[2\], but record 0 has "
     r"float64\[2\]"),
])
def test_a_record_of_another_format_is_named(record, match):
  records = [{"x": np.zeros(3), "y": np.zeros(2)} for _ in range(10)]
  records[5] = record
  if "y" not in record:
    match = (r"record 5 has the keys \['x'\], but record 0 has \['x'\], "
             r"\['y'\]")
  mapper_fn, release_fn = jax_data.full_data_mapper(
      SourceDataLoader(records), 10, 1)
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(mapper_fn(lambda b, c: (b["x"], c), None))
  release_fn()


def test_a_string_leaf_is_named():
  with pytest.raises(TypeError, match=r"record 0 has \['name'\] of dtype <U3 "
                     r"\(str\), which cannot become a JAX array; drop it or "
                     r"turn it into numbers with transform="):
    SourceDataLoader([{"x": 1.0, "name": "abc"}] * 3)
  loader = SourceDataLoader([{"x": 1.0, "name": "abc"}] * 3,
                            transform=lambda r: {"x": r["x"]})
  assert list(loader.observation_format) == ["x"]


def test_bad_arguments_are_named():
  with pytest.raises(TypeError, match="source must have len"):
    SourceDataLoader(iter([1, 2]))
  with pytest.raises(ValueError, match="is empty"):
    SourceDataLoader([])
  with pytest.raises(TypeError, match="transform must be callable"):
    SourceDataLoader([1, 2], transform=3)
  with pytest.raises(ValueError, match="workers=-1"):
    SourceDataLoader([1, 2], workers=-1)
  with pytest.raises(jax_data.source_loader.RecordError, match="record 0: "
                     "ZeroDivisionError"):
    SourceDataLoader([1, 2], transform=lambda r: r / 0)


def test_worker_threads_end_with_the_pipeline():
  def workers():
    return [t for t in threading.enumerate()
            if t.name.startswith("jax_data-source")]

  loader = SourceDataLoader(Virtual(), workers=3)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 8,
                                                                 32)
  # The first chunks try one worker and three.
  jax.block_until_ready(jax.jit(lambda s: lax.scan(
      lambda s, _: batch_fn(s), s, None, length=40)[1])(init_fn()))
  assert workers() and loader.workers_used in (1, 3)
  release_fn()
  for thread in workers():
    thread.join(30)
  assert not workers()


# -- memory and checkpoints -------------------------------------------------


class Virtual:
  """Ten million records made on demand: never held."""

  def __len__(self):
    return 10_000_000

  def __getitem__(self, i):
    return {"x": np.full(16, i % 1000, np.float32), "i": np.int64(i)}


def test_ten_million_virtual_records_over_a_thousand_refreshes():
  import psutil
  loader = SourceDataLoader(Virtual(), workers=2)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 4, 16)
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=400)[0])
  state = run(init_fn(seed=0))  # 100 refreshes, warm
  gc.collect()
  start = psutil.Process().memory_info().rss
  for _ in range(9):
    state = run(state)
  gc.collect()
  grown = psutil.Process().memory_info().rss - start
  assert int(state.chunk) == 1000
  assert grown < 20 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB"
  release_fn()


_RESTORE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jax import lax
    import jax_data
    from tests.test_source_loader import MapStyle, _images
    path = sys.argv[1]
    pipeline = jax_data.random_reference_data(
        jax_data.SourceDataLoader(MapStyle(*_images())), 3, 4)
    state = jax_data.restore_checkpoint(path, pipeline)
    _, (x, y) = jax.jit(lambda s: lax.scan(
        lambda s, _: pipeline[1](s), s, None, length=11))(state)
    print(json.dumps(np.asarray(y).tolist()))
    """)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoints_continue_exactly_also_in_a_fresh_process(tmp_path,
                                                              mode):
  pipeline = jax_data.random_reference_data(
      SourceDataLoader(MapStyle(*_images())), 3, 4)
  init_fn, batch_fn, _ = pipeline
  run = jax.jit(lambda s, n=11: lax.scan(lambda s, _: batch_fn(s), s, None,
                                         length=n))
  state, _ = run(init_fn(seed=4, **mode))
  path = tmp_path / "state.npz"
  jax_data.save_checkpoint(path, pipeline, state)
  _, (_, expected) = run(state)
  fresh = jax_data.random_reference_data(
      SourceDataLoader(MapStyle(*_images())), 3, 4)
  _, (_, again) = jax.jit(lambda s: lax.scan(
      lambda s, _: fresh[1](s), s, None, length=11))(
          jax_data.restore_checkpoint(path, fresh))
  np.testing.assert_array_equal(again, expected)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "-c", _RESTORE, str(path)],
                        cwd=root, env=dict(os.environ, PYTHONPATH=root),
                        capture_output=True, text=True, timeout=180)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip().splitlines()[-1] == str(
      np.asarray(expected).tolist()).replace(" ", "").replace(",", ", ")
