"""SourceDataLoader: every kind of random-access source gives exactly the
NumpyDataLoader's streams over the stacked records."""

import collections
import collections.abc
import concurrent.futures
import gc
import io
import multiprocessing
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_data
from jax_data import NumpyDataLoader
from jax_data import SourceDataLoader
from jax_data.host_loader import StoreLimits
from jax_data.loaders import source_workers
from tests import scripts
from tests.records import Gated
from tests.records import HalfWritten
from tests.records import Numbered
from tests.records import decode

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


def _stacked(loader):
  """A NumpyDataLoader over a source loader's records, stacked."""
  reader = loader._reader  # pylint: disable=protected-access
  records = [reader.leaves(i, reader.load(i))
             for i in range(len(reader.source))]
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


def test_repeated_rows_are_copied_in_blocks(monkeypatch):
  """Rows whose index repeats an earlier one's are copied from it a block
  at a time (blocks of 3 rows here), and large reads give the heap back:
  the same streams as the stacked records'."""
  from jax_data.loaders import source_loader
  trims = []
  monkeypatch.setattr(source_loader, "COPY_BLOCK", 3)
  monkeypatch.setattr(source_loader, "TRIM_ROWS", 1)
  monkeypatch.setattr(source_loader, "give_back_heap",
                      lambda: trims.append(0))
  images, labels = _images()
  _assert_same_streams(SourceDataLoader(
      [{"image": im, "label": lb} for im, lb in zip(images, labels)],
      workers=0))
  assert trims and set(trims) == {0}


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
  with pytest.raises(TypeError, match="but the transform does not pickle: "
                     ".*; define it at module level"):
    SourceDataLoader(records, transform=lambda r: decode(r), processes=True)
  with pytest.raises(TypeError, match=r"but the source \(Locked\) does not "
                     "pickle: .*__getstate__"):
    SourceDataLoader(Locked(records), transform=decode, processes=True)


class Locked:
  """A source holding what does not pickle (as an open h5py file)."""

  def __init__(self, records):
    self.records, self.lock = records, threading.Lock()

  def __len__(self):
    return len(self.records)

  def __getitem__(self, i):
    return self.records[i]


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
    # Chunked and compressed: not a plain array in the file.
    f.create_dataset("packed", data=images, chunks=(7, 28, 28),
                     compression="gzip")
  records = SourceDataLoader(H5Records(path), workers=2)
  _assert_same_streams(records)
  in_memory = NumpyDataLoader(image=images, label=labels)
  with h5py.File(path, "r") as f:
    mapped = NumpyDataLoader(copy=False, image=f["image"], label=f["label"])
    sliced = NumpyDataLoader(copy=False, image=f["packed"], label=f["label"])
    # pylint: disable=protected-access
    assert isinstance(mapped._arrays["image"], np.memmap)  # mapped, not read
    assert not isinstance(sliced._arrays["image"], np.ndarray)  # h5py's
    for lazy in (mapped, sliced):
      for run in (_random_streams, _full_passes):
        for got, want in zip(run(lazy), run(in_memory)):
          np.testing.assert_array_equal(got, want)
      assert lazy.content_digest() == in_memory.content_digest()


def test_a_closed_hdf5_file_is_named(tmp_path):
  """A loader made inside a with block that closes the file before the run:
  h5py's reads failed with "identifier is not of specified type". A
  contiguous dataset, mapped, is read all the same."""
  h5py = pytest.importorskip("h5py")
  images, _ = _images()
  path = tmp_path / "closed.h5"
  with h5py.File(path, "w") as f:
    f["plain"] = images
    f.create_dataset("packed", data=images, chunks=(7, 28, 28))
  with h5py.File(path, "r") as f:
    loaders = {"plain": NumpyDataLoader(copy=False, x=f["plain"]),
               "packed": NumpyDataLoader(copy=False, x=f["packed"]),
               "source": SourceDataLoader(f["packed"])}
  for name, loader in loaders.items():
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, 2, 4)
    if name == "plain":
      _, batch = jax.jit(batch_fn)(init_fn(seed=0))
      assert batch["x"].shape == (4, 28, 28)
    else:
      with pytest.raises(Exception, match="its HDF5 file was closed: keep "
                         "the h5py.File open while the loader reads"):
        jax.block_until_ready(jax.jit(batch_fn)(init_fn(seed=0)))
    release_fn()


def test_a_contiguous_hdf5_dataset_with_nans_is_mapped(tmp_path):
  """Its mapping is checked against h5py's reads of three rows, byte for
  byte: a NaN (a missing value) among them compared unequal as a value, and
  the dataset was read through h5py, 76x slower a step, without a word."""
  h5py = pytest.importorskip("h5py")
  x = np.arange(40.0, dtype=np.float32).reshape(10, 4)
  x[0, 1] = x[5, 2] = x[9, 3] = np.nan  # the rows checked
  with h5py.File(tmp_path / "nan.h5", "w") as f:
    f["x"] = x
  with h5py.File(tmp_path / "nan.h5", "r") as f:
    loader = NumpyDataLoader(copy=False, x=f["x"])
    # pylint: disable=protected-access
    assert isinstance(loader._arrays["x"], np.memmap)
    mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 3)
    values, _ = mapper_fn(lambda batch, carry: (batch["x"], carry), None)
    np.testing.assert_array_equal(values, x)  # NaN where x has one
    release_fn()


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


class BatchedRaising:
  """A batched source whose record 30 cannot be read, alone or in a
  batch."""

  def __len__(self):
    return 400

  def __getitem__(self, i):
    if i == 30:
      raise KeyError("record missing")
    return {"x": np.float32(i)}

  def __getitems__(self, indices):
    return [self[i] for i in indices]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_record_of_a_batched_read_is_named(workers):
  """A failed ``__getitems__`` names the record that fails (read again one
  by one), not the first indices of its block."""
  mapper_fn, release_fn = jax_data.full_data_mapper(
      SourceDataLoader(BatchedRaising(), workers=workers), 4, 64)
  with pytest.raises(Exception, match=r"SourceDataLoader over BatchedRaising"
                     r": record 30: KeyError: 'record missing'"):
    jax.block_until_ready(mapper_fn(lambda b, c: (b["x"], c), None))
  release_fn()


class Labelled:
  """Records with integer labels (Python ints: int64 leaves) of which
  record ``wide`` holds one that int32 cannot; read one by one or in
  batches."""

  def __init__(self, wide, batched):
    self.wide = wide
    if batched:
      self.__getitems__ = lambda indices: [self[i] for i in indices]

  def __len__(self):
    return 300

  def __getitem__(self, i):
    label = 3_000_000_000 + i if i == self.wide else -i
    return {"x": np.float32(i), "y": label, "z": np.array([i, -label])}


@pytest.mark.parametrize("read", ["alone", "threads", "processes",
                                  "batched"])
def test_integers_that_jax_holds_in_32_bits_are_checked(read):
  """Without jax_enable_x64 a record's int64 leaves are served as int32,
  as JAX holds them: values that fit come through exactly, and one that
  does not is named (record, leaf, value) where NumPy's cast would have
  wrapped it without a word, by every way records are read."""
  if jax.config.jax_enable_x64:
    pytest.skip("64-bit integers are served as they are")
  workers = 0 if read == "alone" else 2
  processes = read == "processes"
  source = (Labelled(None, read == "batched") if not processes
            else [Labelled(None, False)[i] for i in range(300)])
  mapper_fn, release_fn = jax_data.full_data_mapper(
      SourceDataLoader(source, workers=workers, processes=processes), 2, 50)
  (y, z), _ = mapper_fn(lambda b, c: ((b["y"], b["z"]), c), None)
  assert y.dtype == z.dtype == jnp.int32
  np.testing.assert_array_equal(y, -np.arange(300))
  np.testing.assert_array_equal(z[:, 1], np.arange(300))
  release_fn()
  source = (Labelled(123, read == "batched") if not processes
            else [Labelled(123, False)[i] for i in range(300)])
  mapper_fn, release_fn = jax_data.full_data_mapper(
      SourceDataLoader(source, workers=workers, processes=processes), 2, 50)
  with pytest.raises(Exception, match=re.escape(
      "record 123 has ['y'] = 3000000123, which JAX's int32 (64-bit types "
      "are 32-bit without jax_enable_x64) cannot hold: enable "
      "jax_enable_x64")):
    jax.block_until_ready(mapper_fn(lambda b, c: (b["y"], c), None))
  release_fn()




class ExitsAt:
  """Record 13's read calls sys.exit, as argparse or a decoder's fatal
  path may in a library the source calls."""

  def __len__(self):
    return 30

  def __getitem__(self, index):
    if index == 13:
      sys.exit(1)
    return {"x": np.float32(index)}


@pytest.mark.parametrize("read", ["alone", "threads", "processes"])
def test_a_record_whose_read_calls_sys_exit_is_named(read):
  """SystemExit from a record's read fails that record, named as any
  other failure is (it escaped the records' error and said only
  'SystemExit: 1'), by every way records are read."""
  loader = SourceDataLoader(ExitsAt(), workers=0 if read == "alone" else 2,
                            processes=read == "processes")
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 5)
  try:
    with pytest.raises(Exception, match=re.escape("record 13: SystemExit: 1")):
      jax.block_until_ready(mapper_fn(lambda b, c: (b["x"], c), None))
  finally:
    release_fn()


class FieldNamedRecords(collections.abc.Sequence):
  """A source (``len`` and ``source[i]``) that also names its records'
  fields with ``keys()``, as some dataset wrappers do."""

  def __len__(self):
    return 10

  def __getitem__(self, index):
    if not 0 <= index < 10:
      raise IndexError(index)
    return {"x": np.float32(index), "y": np.int32(index % 3)}

  def keys(self):
    return ["x", "y"]


def test_a_source_indexed_by_field_is_refused_and_one_with_keys_is_not():
  """A dict of arrays (NumpyDataLoader's data) or a DataFrame, whose [0] is
  no record, is refused naming source= (it failed on record 0 with a
  KeyError); a sequence of records that also has keys() is a source."""
  with pytest.raises(TypeError, match=re.escape(
      "source must be indexed by record number (source[0] the first "
      "record), got source={'x'")):
    SourceDataLoader({"x": np.arange(10.0)}, workers=0)
  pandas = pytest.importorskip("pandas")
  with pytest.raises(TypeError, match="DataFrame"):
    SourceDataLoader(pandas.DataFrame(np.zeros((5, 3))), workers=0)
  mapper_fn, release_fn = jax_data.full_data_mapper(
      SourceDataLoader(FieldNamedRecords(), workers=0), 2, 5)
  xs, _ = mapper_fn(lambda b, c: (b["x"], c), None)
  release_fn()
  assert np.asarray(xs).reshape(-1).tolist() == list(range(10))


def test_a_first_record_whose_integers_jax_cannot_hold_is_refused_when_made():
  """Record 0 is read and checked when the loader is made: an integer in it
  that JAX's int32 cannot hold is named then, as NumpyDataLoader names
  one, not by the first batch from inside compiled code."""
  if jax.config.jax_enable_x64:
    pytest.skip("64-bit integers are served as they are")
  with pytest.raises(jax_data.RecordError, match=re.escape(
      "record 0 has ['x'] = 1099511627776, which JAX's int32")):
    SourceDataLoader([{"x": 2**40}] * 3, workers=0)


class ReadOnConversion:
  """A leaf read when converted to an array, as an h5py dataset or a zarr
  array is: the read of leaf ``failing`` fails."""

  def __init__(self, index, failing):
    self.index, self.failing = index, failing

  def __array__(self, dtype=None, copy=None):
    if self.index == self.failing:
      raise OSError("Can't read data (file truncated)")
    return np.full(2, self.index, np.float32)


class LazyLeaves:

  def __init__(self, failing):
    self.failing = failing

  def __len__(self):
    return 20

  def __getitem__(self, i):
    return {"x": ReadOnConversion(i, self.failing)}


class LazyLeavesBatched(LazyLeaves):

  def __getitems__(self, indices):
    return [self[i] for i in indices]


@pytest.mark.parametrize("source", [LazyLeaves, LazyLeavesBatched])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_leaf_that_fails_to_convert_names_its_record(source, workers):
  mapper_fn, release_fn = jax_data.full_data_mapper(
      SourceDataLoader(source(5), workers=workers), 2, 4)
  with pytest.raises(Exception, match=re.escape(
      f"SourceDataLoader over {source.__name__}: record 5 ['x']: OSError: "
      "Can't read data")):
    jax.block_until_ready(mapper_fn(lambda b, c: (b["x"], c), None))
  release_fn()
  # Public by name, where it was reached only by its module's path.
  assert jax_data.RecordError is jax_data.source_records.RecordError
  assert "RecordError" in jax_data.__all__
  with pytest.raises(jax_data.RecordError,
                     match=re.escape("record 0 ['x']: OSError")):
    SourceDataLoader(source(0))


@pytest.mark.parametrize("workers", [8, 64])
def test_more_workers_than_a_chunks_records(workers):
  """A chunk of 4 records and a pool of 8 or 64: the pool's timed trial
  read them with 4 workers and failed to note it (KeyError: 4) at the
  second chunk; the batches are those of workers=0, and no more threads
  start than a chunk's records."""
  def batches(workers):
    before = set(threading.enumerate())
    loader = SourceDataLoader([np.float32(i) for i in range(100)],
                              workers=workers)
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, 1, 4)
    state, drawn = init_fn(seed=0), []
    for _ in range(6):
      state, batch = batch_fn(state)
      drawn.append(np.asarray(batch).tolist())
    started = [t for t in set(threading.enumerate()) - before
               if t.name.startswith("jax_data-source")]
    release_fn()
    return drawn, started

  drawn, started = batches(workers)
  assert drawn == batches(0)[0]
  assert len(started) <= 4


class FailingOnce:
  """Records of their index, where record 5 fails once (a transient I/O
  error)."""

  def __init__(self):
    self.failed = False

  def __len__(self):
    return 20

  def __getitem__(self, i):
    if i == 5 and not self.failed:
      self.failed = True
      raise OSError("transient")
    return {"x": np.int32(i)}


@pytest.mark.parametrize("ordered", [True, False])
def test_the_predecessors_get_batches_retries_a_failed_chunk(ordered):
  """A chunk whose read failed is read again by the next call (before, the
  chain had moved on: an ordered pass skipped observations 4-7)."""
  def chunks(loader, count):
    register = (loader.register_ordered_pipeline if ordered else
                loader.register_random_pipeline)
    chain, got = register(1, 4), []
    while len(got) < count:
      try:
        got.append(np.asarray(loader.get_batches(chain)[0]["x"]).tolist())
      except jax_data.source_records.RecordError:
        pass
    return got

  source = FailingOnce()
  got = chunks(SourceDataLoader(source, workers=0), 8)
  assert source.failed
  source = FailingOnce()
  source.failed = True  # never fails
  assert got == chunks(SourceDataLoader(source, workers=0), 8)


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
  # Tens of thousands of threads failed to start inside compiled code.
  with pytest.raises(ValueError, match="workers must be between 0 and "
                     "1024, got workers=100000"):
    SourceDataLoader([1, 2], workers=100_000)
  with pytest.raises(jax_data.source_records.RecordError, match="record 0: "
                     "ZeroDivisionError"):
    SourceDataLoader([1, 2], transform=lambda r: r / 0)


def test_more_worker_processes_than_cores_warn_before_any_starts():
  cores = jax_data.loaders.gather.usable_cores()
  before = set(multiprocessing.active_children())
  with pytest.warns(UserWarning, match=rf"workers={10 * cores}, "
                    rf"processes=True\).*the {cores} cores"):
    loader = SourceDataLoader(list(range(4)), workers=10 * cores,
                              processes=True)
  assert set(multiprocessing.active_children()) <= before
  del loader
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    SourceDataLoader(list(range(4)), workers=cores, processes=True)
    SourceDataLoader(list(range(4)), workers=10 * cores)  # threads


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


def test_worker_threads_end_with_a_loader_dropped_unreleased():
  """The threads hold their jobs' queue, not the pool: a loader and
  pipeline dropped without release_fn end them."""
  before = set(threading.enumerate())
  loader = SourceDataLoader(Virtual(), workers=3)
  init_fn, batch_fn, _ = jax_data.random_reference_data(loader, 8, 32)
  state = init_fn()
  for _ in range(4):
    state, _ = batch_fn(state)
  started = [t for t in set(threading.enumerate()) - before
             if t.name.startswith("jax_data-source")]
  assert started
  del loader, init_fn, batch_fn, state
  gc.collect()
  for thread in started:
    thread.join(30)
  assert not any(thread.is_alive() for thread in started)


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


# -- worker processes that die, Ctrl-C, __main__; release mid-read ----------


def _mapped(loader):
  """Every record, in order, through a full-data pass."""
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 4)
  try:
    return np.asarray(mapper_fn(lambda b, c: (b["x"], c), None)[0]).tolist()
  finally:
    release_fn()


_WORKERS_WITHOUT_JAX = textwrap.dedent("""
    import numpy as np
    import jax_data
    from tests.records import JaxImported

    for nested in (False, True):
      loader = jax_data.SourceDataLoader(JaxImported(40, nested), workers=2,
                                         processes=True)
      mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 4)
      x = (lambda b: b["x"]["v"]) if nested else (lambda b: b["x"])
      (flags, xs), _ = mapper_fn(lambda b, c: ((b["jax"], x(b)), c), None)
      release_fn()
      print(f"nested={nested} jax={sorted(set(np.asarray(flags).tolist()))} "
            f"records={np.asarray(xs).tolist() == list(range(40))}")
    print("main thread done", flush=True)
    """)


def test_worker_processes_read_plain_records_without_jax():
  """A worker process imports JAX (over a second and ~160 MiB each) only for
  records it cannot take apart without it: records that are a dict of
  arrays and numbers are read and checked with NumPy alone, nested ones
  with JAX, the same records either way. (Run from `python -c`, whose
  workers run no main module again: a script's would, with its imports.)
  """
  done = scripts.run(_WORKERS_WITHOUT_JAX)
  scripts.assert_ended_cleanly(done)
  assert "nested=False jax=[0] records=True" in done.stdout, done.stdout
  assert "nested=True jax=[1] records=True" in done.stdout, done.stdout


_EXIT_AFTER_A_RELEASE = textwrap.dedent("""
    import concurrent.futures.process
    import jax_data
    from jax_data.loaders import source_workers
    from tests.records import Numbered

    loader = jax_data.SourceDataLoader(Numbered(40), workers=2,
                                       processes=True)
    mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 4)
    mapper_fn(lambda b, c: (b["x"], c), None)
    # The pools' manager threads, whose wake-up pipes Python's exit writes to.
    threads = list(concurrent.futures.process._threads_wakeups)
    release_fn()  # shuts the pool down, and exits at once:
    source_workers._end_pools_at_exit()  # the exit's first hook
    running = sum(thread.is_alive() for thread in threads)
    print(f"pools={len(threads)} running={running}")
    print("main thread done", flush=True)
    """)


def test_exit_after_a_release_waits_for_the_pools_shutdown():
  """A script that releases its pipeline and ends at once: Python's exit
  wakes each pool's manager thread through a pipe which that thread, shut
  down just before, may be closing ("OSError: Bad file descriptor" at
  exit, 4 runs in 59). jax_data's exit hook, which runs first, waits for
  the threads of the pools it shut down, so none is running then."""
  done = scripts.run(_EXIT_AFTER_A_RELEASE)
  scripts.assert_ended_cleanly(done)
  assert re.search(r"pools=[1-9]\d* running=0", done.stdout), done.stdout
  assert "Exception ignored" not in done.stderr, done.stderr[-3000:]


def test_an_ended_pool_fails_its_blocks_as_broken_never_cancelled(
    monkeypatch):
  """Ending a pool of worker processes fails the blocks it was reading
  and those waiting with BrokenProcessPool, which a read reads again; it
  cancels none (Python 3.14's terminate_workers would: emulated, a read at
  the interpreter's exit then waited for ever)."""
  monkeypatch.setattr(concurrent.futures.ProcessPoolExecutor,
                      "terminate_workers", lambda pool: pytest.fail(
                          "terminate_workers cancels futures"),
                      raising=False)
  pool = concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context("spawn"))
  futures = [pool.submit(time.sleep, 60) for _ in range(3)]
  source_workers.terminate(pool)
  done, _ = concurrent.futures.wait(futures, timeout=60)
  assert len(done) == 3
  assert all(source_workers.broke(future) and not future.cancelled()
             for future in futures)


def test_threads_that_end_one_pool_at_once_end_it_once():
  """Reads of several threads that meet one broken pool each end it: its
  results' pipe is closed once. Closed twice at once, the second close
  freed a descriptor number that something else held by then (a CI run:
  BrokenPipeError in shutdown, then the test process crashed)."""
  pool = concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context("spawn"))
  pool.submit(time.sleep, 0).result(timeout=60)  # a worker started
  writer = pool._result_queue._writer  # pylint: disable=protected-access
  closes = []
  close = writer.close
  def counted():
    closes.append(threading.get_ident())
    time.sleep(0.01)  # the window in which a second close found the handle
    close()
  writer.close = counted
  ready = threading.Barrier(8)
  def end():
    ready.wait(timeout=60)
    source_workers.terminate(pool)
  threads = [threading.Thread(target=end) for _ in range(8)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(60)
  assert not any(thread.is_alive() for thread in threads)
  assert len(closes) == 1
  source_workers.terminate(pool)  # and never again
  assert len(closes) == 1


def test_a_block_the_pool_could_not_send_is_read_again():
  """Workers ended while the pool's feeder thread sends a block to them
  fail it with BrokenPipeError, not BrokenProcessPool (once in a CI run of
  test_a_record_that_ends_its_worker_is_blamed_on_its_own_read, whose
  innocent read then failed): it is read again, as a block of a worker
  that died is; an error of the source's is not."""
  def failed(error):
    future = concurrent.futures.Future()
    future.set_exception(error)
    return future

  assert source_workers.broke(failed(BrokenPipeError(32, "Broken pipe")))
  assert source_workers.broke(failed(
      concurrent.futures.process.BrokenProcessPool("ended")))
  assert not source_workers.broke(failed(
      jax_data.loaders.source_records.RecordError("record 3: OSError")))


def _write_half_a_result(marker):
  """In a pool's worker: begins a result in the results' pipe, as a worker
  ended while it wrote one leaves it (its header promises 1 MiB), tells
  ``marker`` so, and waits."""
  frame = sys._getframe()  # pylint: disable=protected-access
  while "result_queue" not in frame.f_locals:  # the pool's worker loop
    frame = frame.f_back
  writer = frame.f_locals["result_queue"]._writer  # pylint: disable=protected-access
  writer._send(struct.pack("!i", 1 << 20) + b"half")  # pylint: disable=protected-access
  open(marker, "w").close()
  time.sleep(60)


def test_a_pool_ended_while_a_worker_wrote_a_result_lets_go(tmp_path):
  """Half a result in the results' pipe kept the pool's manager thread
  reading for ever once its workers were ended (the pool's own end for
  writing kept the pipe open), and the interpreter's exit waited on it:
  10 of 22 runs of a released processes=True pipeline hung at exit. Ended,
  the pool's thread reads the pipe's end and fails the pool as broken."""
  pool = concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context("spawn"))
  results = pool._result_queue  # pylint: disable=protected-access
  marker = tmp_path / "written"
  future = pool.submit(_write_half_a_result, str(marker))
  try:
    deadline = time.monotonic() + 60
    while not marker.exists():
      assert time.monotonic() < deadline, "the worker never wrote"
      time.sleep(0.05)
    manager = pool._executor_manager_thread  # pylint: disable=protected-access
    source_workers.terminate(pool)
    manager.join(30)
    assert not manager.is_alive()
    assert source_workers.broke(future)
  finally:  # else (the bug) this process's exit would wait for ever
    results._writer.close()  # pylint: disable=protected-access


def test_a_worker_process_that_dies_once_is_replaced(tmp_path):
  once = str(tmp_path / "died")
  loader = SourceDataLoader(Numbered(die_at=13, once=once), workers=2,
                            processes=True)
  reference = NumpyDataLoader(x=np.arange(30, dtype=np.float32))
  # The request that lost a worker gets every record, and so do later ones.
  got, want = _random_streams(loader), _random_streams(reference)
  assert os.path.exists(once)  # a worker did die
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  assert _mapped(loader) == list(range(30))


@pytest.mark.parametrize("once", [True, False])
def test_a_worker_that_died_writing_a_result_does_not_stall_reads(
    tmp_path, once):
  """The pool's manager thread read the half result for ever, and the read
  waited for ever; the pool is now ended and its blocks read again."""
  source = HalfWritten(die_at=13, once=str(tmp_path / "died") if once
                       else None)
  loader = SourceDataLoader(source, workers=2, processes=True)
  outcome = []

  def read():
    try:
      outcome.append(_mapped(loader))
    except Exception as e:  # pylint: disable=broad-except
      outcome.append(e)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  reader.join(150)
  assert not reader.is_alive(), "the read stalled"
  if once:
    assert os.path.exists(source.once)
    assert outcome == [list(range(30))]
  else:
    assert isinstance(outcome[0], Exception)
    assert re.search(r"record 13 ended the worker process that read it",
                     str(outcome[0]))


def test_a_record_that_always_ends_its_worker_is_named():
  loader = SourceDataLoader(Numbered(die_at=13), workers=2, processes=True)
  for _ in range(2):  # also a later request: named again, not a broken pool
    with pytest.raises(Exception, match=r"record 13 ended the worker "
                       r"process that read it, also a new worker that read "
                       r"it alone"):
      _mapped(loader)
  assert _mapped(SourceDataLoader(Numbered(), workers=2, processes=True)
                 ) == list(range(30))


_EXIT_WHILE_READING = textwrap.dedent("""
    import sys, time
    import jax
    import jax_data
    from tests.records import Sleepy

    if __name__ == "__main__":
      flag = sys.argv[1]
      loader = jax_data.SourceDataLoader(Sleepy(flag, 600.0), workers=2,
                                         processes=sys.argv[2] == "processes")
      init_fn, batch_fn, _ = jax_data.random_reference_data(loader, 1, 4)
      step = jax.jit(batch_fn)
      state, batch = step(init_fn(seed=0))
      jax.block_until_ready(batch)
      time.sleep(1)  # the next chunk produced ahead, quickly
      open(flag, "w").close()  # from now on a record takes 10 minutes
      state, batch = step(state)  # the chunk after is read ahead, slowly
      jax.block_until_ready(batch)
      time.sleep(1)
      print("exiting", flush=True)  # no release_fn
    """)


@pytest.mark.parametrize("kind", ["processes", "threads"])
def test_exit_does_not_wait_for_workers_reading(tmp_path, kind):
  """The interpreter exits while worker processes or threads read records
  that take 10 minutes: processes are ended, threads are daemons
  (concurrent.futures joined them before any atexit hook, for as long as
  the records took)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = tmp_path / "exit_while_reading.py"
  script.write_text(_EXIT_WHILE_READING)
  done = subprocess.run(
      [sys.executable, str(script), str(tmp_path / "slow"), kind], cwd=root,
      env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
      timeout=180)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "exiting" in done.stdout


_EXIT_WITH_A_RUN_IN_A_THREAD = textwrap.dedent("""
    import sys, threading
    import jax, numpy as np
    from jax import lax
    import jax_data
    from tests.records import Numbered

    if __name__ == "__main__":
      processes = sys.argv[1] == "processes"
      loader = jax_data.SourceDataLoader(Numbered(4000), workers=2,
                                         processes=processes)
      init_fn, batch_fn, _ = jax_data.random_reference_data(loader, 2, 64)
      run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                       length=40))
      state = init_fn(seed=0)
      jax.block_until_ready(run(state))  # compiled, workers started

      def work(state):
        total = 0.0
        for _ in range(30):
          state, batches = run(state)
          total += float(batches["x"].sum())
        print("thread done", total, flush=True)

      threading.Thread(target=work, args=(state,)).start()  # not a daemon
      print("main thread done", flush=True)
    """)


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_a_run_in_a_thread_python_waits_for_ends_at_exit(kind, tmp_path):
  """The main thread ends while a (non-daemon) thread runs a sampler over
  a SourceDataLoader; Python waits for that thread. Its run failed: the
  exit hook ended the worker processes ("reading records stopped: the
  interpreter is exiting"), or the thread pool refused work ("cannot
  schedule new futures after interpreter shutdown"). Now it reads its
  records itself and finishes, with the batches of a run in full."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = tmp_path / "exit_with_a_run.py"
  script.write_text(_EXIT_WITH_A_RUN_IN_A_THREAD)
  done = subprocess.run(
      [sys.executable, str(script), kind], cwd=root,
      env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
      timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Traceback" not in done.stderr, done.stderr[-3000:]
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      jax_data.SourceDataLoader(Numbered(4000)), 2, 64)
  state, want = init_fn(seed=0), 0.0
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=40))
  for _ in range(30):
    state, batches = run(state)
    want += float(batches["x"].sum())
  release_fn()
  assert f"thread done {want}" in done.stdout, done.stdout


_KILLED_PARENT = textwrap.dedent("""
    import os, time
    import jax
    import jax_data
    from tests.records import Numbered

    if __name__ == "__main__":
      loader = jax_data.SourceDataLoader(Numbered(40), workers=2,
                                         processes=True)
      init_fn, batch_fn, _ = jax_data.random_reference_data(loader, 2, 4)
      jax.block_until_ready(jax.jit(batch_fn)(init_fn(seed=0))[1])
      print(os.getpid(), flush=True)
      time.sleep(600)
    """)


def test_worker_processes_end_with_a_parent_killed_by_a_signal(tmp_path):
  """A parent killed (SIGKILL, as a scheduler may) leaves no worker
  process behind: each ends once its parent is gone (an idle one waited
  for work forever, holding its copy of the source)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = tmp_path / "killed_parent.py"
  script.write_text(_KILLED_PARENT)
  parent = subprocess.Popen(
      [sys.executable, str(script)], cwd=root, stdout=subprocess.PIPE,
      env=dict(os.environ, PYTHONPATH=root), text=True)
  try:
    pid = int(parent.stdout.readline())
    children = [int(line.split()[0]) for line in subprocess.run(
        ["ps", "-eo", "pid,ppid"], capture_output=True, text=True
    ).stdout.splitlines()[1:] if int(line.split()[1]) == pid]
    assert children
  finally:
    parent.kill()
    parent.wait(30)
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    alive = [child for child in children if _alive(child)]
    if not alive:
      break
    time.sleep(0.2)
  for child in alive:
    os.kill(child, signal.SIGKILL)
  assert not alive, f"worker processes {alive} outlived their parent"


def _alive(pid):
  """Whether process ``pid`` runs (a zombie does not), on any system."""
  import psutil
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def test_a_record_that_ends_its_worker_is_blamed_on_its_own_read():
  """Two pipelines read through one loader's workers at once, and only
  one of them meets the record that ends its worker: the other's reads,
  retried alone in a pool of their own, succeed (a shared retry pool that
  the first broke named the other's innocent records)."""
  loader = SourceDataLoader(Numbered(n=400, die_at=13), workers=2,
                            processes=True)
  whole, release_whole = jax_data.full_data_mapper(loader, 1, 50)
  half, release_half = jax_data.full_data_mapper(
      loader, 1, 50, shard_index=1, shard_count=2)  # records 200 .. 399
  errors = []

  def second_half():
    for _ in range(3):
      try:
        values, _ = half(lambda b, c: (b["x"], c), None)
        assert np.asarray(values).tolist() == list(range(200, 400))
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)

  thread = threading.Thread(target=second_half)
  thread.start()
  try:
    for _ in range(3):
      with pytest.raises(Exception, match=r"record 13 ended the worker "):
        whole(lambda b, c: (b["x"], c), None)
  finally:  # nothing left reading into the tests that follow
    thread.join(120)
    release_whole()
    release_half()
  assert not errors, errors


def test_worker_processes_ignore_ctrl_c():
  """SIGINT to the process group reaches the workers too: the parent
  decides what it interrupts, the workers keep serving."""
  before = set(multiprocessing.active_children())
  loader = SourceDataLoader(Numbered(), workers=2, processes=True)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 3,
                                                                  4)
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=10)[1])
  expected = np.asarray(run(init_fn(seed=3))["x"])
  workers = [p for p in multiprocessing.active_children() if p not in before]
  assert workers
  for worker in workers:
    os.kill(worker.pid, signal.SIGINT)
  np.testing.assert_array_equal(run(init_fn(seed=3))["x"], expected)
  assert all(worker.is_alive() for worker in workers)
  release_fn()


_MAIN_SOURCE = textwrap.dedent("""
    import numpy as np
    import jax_data

    class Records:
      def __len__(self):
        return 10

      def __getitem__(self, i):
        return {"x": np.float32(i)}

    def main():
      try:
        loader = jax_data.SourceDataLoader(Records(), workers=1,
                                           processes=True)
        mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 5)
        print(mapper_fn(lambda b, c: (b["x"], c), None)[0])
      except Exception as e:
        print("ERROR", type(e).__name__, e)
    """)


# The workers run this file again as __mp_main__, without the guarded part.
_GUARDED_SOURCE = textwrap.dedent("""
    import numpy as np
    import jax_data

    if __name__ == "__main__":
      class Records:
        def __len__(self):
          return 10

        def __getitem__(self, i):
          return {"x": np.float32(i)}

      try:
        loader = jax_data.SourceDataLoader(Records(), workers=1,
                                           processes=True)
        mapper_fn, release_fn = jax_data.full_data_mapper(loader, 2, 5)
        print(mapper_fn(lambda b, c: (b["x"], c), None)[0])
      except Exception as e:
        print("ERROR", type(e).__name__, e)
    """)


@pytest.mark.parametrize("how,message", [
    ("stdin", r"__main__.__file__='<stdin>' is no file \(a script read from "
     r"stdin, as by `python -`\): run the script from a file, or use "
     r"processes=False"),
    ("-c", r"which find __main__.Records by name in __main__; but this "
     r"__main__ has no file .* define it in a module they can import .* or "
     r"use processes=False"),
    ("guarded", r"a worker process \(processes=True\) cannot unpickle "
     r"source and transform: AttributeError: .*Records.*define them in a "
     r"module the worker processes can import .* or use processes=False"),
])
def test_a_source_workers_cannot_unpickle_is_explained(tmp_path, how,
                                                       message):
  """A source defined in a ``__main__`` the spawned workers cannot see:
  read from stdin, ``python -c``, or under ``if __name__ == "__main__"``."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if how == "stdin":
    args, stdin = ["-"], _MAIN_SOURCE + "main()\n"
  elif how == "-c":
    args, stdin = ["-c", _MAIN_SOURCE + "main()\n"], None
  else:
    script = tmp_path / "script.py"
    script.write_text(_GUARDED_SOURCE)
    args, stdin = [str(script)], None
  done = subprocess.run([sys.executable, *args], input=stdin, cwd=root,
                        env=dict(os.environ, PYTHONPATH=root),
                        capture_output=True, text=True, timeout=180)
  assert "ERROR" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
  error = done.stdout[done.stdout.index("ERROR"):]
  assert re.search(message, error, re.S), error


def _release_while_reading(loader, entered):
  """Releases the pipeline while its first request waits for a record:
  release_fn returns and the request raises, neither waiting for it."""
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 4,
                                                                  4)
  state = init_fn(seed=0)
  step = jax.jit(batch_fn)
  results = {}

  def request():
    try:
      jax.block_until_ready(step(state))
      results["request"] = "served"
    except Exception as e:  # pylint: disable=broad-except
      results["request"] = e

  requester = threading.Thread(target=request)
  requester.start()
  entered()  # a record of the request is being read
  releaser = threading.Thread(target=release_fn)
  releaser.start()
  releaser.join(30)
  requester.join(30)
  assert not releaser.is_alive(), "release_fn waits for the record"
  assert not requester.is_alive(), "the request waits for the record"
  assert "PipelineReleasedError" in str(results["request"])


def test_release_does_not_wait_for_a_stuck_record_threads():
  gate, entered = threading.Event(), []
  before = set(threading.enumerate())
  loader = SourceDataLoader(Gated(gate, entered), workers=2)

  def wait_entered():
    while not entered:
      threading.Event().wait(0.01)

  try:
    _release_while_reading(loader, wait_entered)
  finally:
    gate.set()
  # This loader's reading threads (those of loaders of other tests may
  # still wait for work).
  for thread in set(threading.enumerate()) - before:
    if thread.name.startswith("jax_data-source"):
      thread.join(30)
  # Reading stopped: each worker finished the record it was reading.
  assert len(entered) <= 2, entered


def test_a_release_during_a_read_of_many_chains_ends_the_workers():
  """Vmapped counter chains whose refresh is read straight into compiled
  code's buffers (a store too small to keep chunks ahead), released while
  that read waits for a record: the request raises, and once the record
  is read the cancelled read closes its chain, so the loader's reading
  threads end."""
  gate, entered = threading.Event(), []
  before = set(threading.enumerate())
  loader = SourceDataLoader(Gated(gate, entered), workers=2)
  loader.store_limits = StoreLimits(store_bytes=1)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 4,
                                                                  4)
  state = init_fn(seed=range(4), stream="counter")
  results = {}

  def request():
    try:
      jax.block_until_ready(jax.jit(jax.vmap(batch_fn))(state))
      results["request"] = "served"
    except Exception as e:  # pylint: disable=broad-except
      results["request"] = e

  requester = threading.Thread(target=request)
  requester.start()
  try:
    deadline = time.monotonic() + 60
    while not entered and time.monotonic() < deadline:
      time.sleep(0.01)
    assert entered, "no record was read"
    release_fn()
    requester.join(30)
    assert not requester.is_alive(), "the request waits for the record"
    assert "PipelineReleasedError" in str(results["request"])
  finally:
    gate.set()
  readers = [t for t in set(threading.enumerate()) - before
             if t.name.startswith("jax_data-source")]
  for thread in readers:
    thread.join(30)
  assert not [t for t in readers if t.is_alive()]


def _running(process):
  """Whether a psutil process runs (a zombie has ended)."""
  import psutil
  try:
    return process.status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def test_release_does_not_wait_for_a_stuck_record_processes(tmp_path):
  psutil = pytest.importorskip("psutil")
  gate, entered = str(tmp_path / "gate"), tmp_path / "entered"
  entered.mkdir()
  loader = SourceDataLoader(Gated(gate, str(entered)), workers=2,
                            processes=True)

  def wait_entered():
    while not any(p.name.isdigit() for p in entered.iterdir()):
      threading.Event().wait(0.01)

  try:
    _release_while_reading(loader, wait_entered)
    # The workers reading for nobody are ended, not left stuck (they would
    # hold up the interpreter's exit).
    stuck = []
    for path in [p for p in entered.iterdir() if p.name.isdigit()]:
      try:
        stuck.append(psutil.Process(int(path.read_text())))
      except psutil.NoSuchProcess:
        pass  # ended already
    # Waited for without reaping them: psutil's wait would reap the pool's
    # children, and the pool's manager thread, which then can never see
    # them end, would spin at the interpreter's exit.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_running(p) for p in stuck):
      time.sleep(0.05)
    assert not [p for p in stuck if _running(p)]
  finally:
    open(gate, "w").close()


class Batched(MapStyle):
  """``__getitems__`` of records shaped by ``shape(i, record)``."""

  def __init__(self, images, labels, shape):
    super().__init__(images, labels)
    self.shape = shape

  def __getitem__(self, i):
    return self.shape(i, super().__getitem__(i))

  def __getitems__(self, indices):
    return [self[i] for i in indices]


@pytest.mark.parametrize("shape", [
    lambda i, r: r,
    lambda i, r: {"image": r[0], "label": r[1]},
    lambda i, r: list(r),
    lambda i, r: r[0]])
def test_batched_records_are_stacked_as_read_one_by_one(shape):
  images, labels = _images()
  batched = SourceDataLoader(Batched(images, labels, shape), workers=2)
  one_by_one = SourceDataLoader([shape(i, (im.astype(np.float32) / 255, lb))
                                 for i, (im, lb) in
                                 enumerate(zip(images, labels))], workers=2)
  for run in (_random_streams, _full_passes):
    for got, want in zip(run(batched), run(one_by_one)):
      np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("odd, message", [
    (lambda r: {"image": r[0]}, r"record 7 has the keys \['image'\]"),
    (lambda r: {"image": r[0], "label": r[1], "x": 1.0},
     r"record 7 has the keys \['image'\], \['label'\], \['x'\]"),
    (lambda r: {"image": r[0][:3], "label": r[1]},
     r"record 7 has \['image'\] of dtype float32 and shape \[3, 28\]"),
    (lambda r: {"image": r[0], "label": float(r[1])},
     r"record 7 has \['label'\] of dtype float64")])
def test_a_batch_with_an_odd_record_names_it(odd, message):
  def shape(i, r):
    return odd(r) if i == 7 else {"image": r[0], "label": r[1]}
  loader = SourceDataLoader(Batched(*_images(), shape), workers=0)
  mapper_fn, _ = jax_data.full_data_mapper(loader, 2, 10)
  with pytest.raises(Exception, match=message):
    jax.block_until_ready(mapper_fn(lambda b, c: (b["label"], c), None))


# -- formats the review found refused or unchecked ---------------------------


class _Mixed:
  """Records of int64, record 5 of int32; ``batched`` reads through
  ``__getitems__``."""

  def __init__(self, batched):
    if batched:
      self.__getitems__ = lambda indices: [self[i] for i in indices]

  def __len__(self):
    return 8

  def __getitem__(self, i):
    return {"x": np.int32(i) if i == 5 else np.int64(i)}


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "batched"])
def test_a_record_of_another_dtype_is_named_on_either_read(batched):
  """A record whose leaf has a smaller dtype than record 0's is named,
  also where the records are read in one batch (np.array would promote it
  silently)."""
  loader = SourceDataLoader(_Mixed(batched), workers=0)
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 1, 8)
  with pytest.raises(Exception, match=r"record 5 has \['x'\] of dtype "
                     r"int32 and shape \[\], but record 0 has int64"):
    mapper_fn(lambda batch, carry: (batch["x"], carry), None)
  release_fn()


class _PythonScalars:
  """Records of Python floats, record 5 of ``odd``; ``batched`` reads
  through ``__getitems__``."""

  def __init__(self, batched, odd, first=0.0):
    self.odd, self.first = odd, first
    if batched:
      self.__getitems__ = lambda indices: [self[i] for i in indices]

  def __len__(self):
    return 8

  def __getitem__(self, i):
    return {"x": self.odd if i == 5 else type(self.first)(i)}


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "batched"])
@pytest.mark.parametrize("first, odd, message", [
    (0.0, 5, r"record 5 has \['x'\] of dtype int64 and shape \[\], but "
     "record 0 has float64"),
    (0, True, r"record 5 has \['x'\] of dtype bool and shape \[\], but "
     "record 0 has int64"),
])
def test_a_python_scalar_of_another_type_is_named_on_either_read(
    batched, first, odd, message):
  """A Python int among floats (a bool among ints) was promoted silently
  where records are read in one batch, and refused where read one by
  one."""
  loader = SourceDataLoader(_PythonScalars(batched, odd, first), workers=0)
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 1, 8)
  with pytest.raises(Exception, match=message):
    mapper_fn(lambda batch, carry: (batch["x"], carry), None)
  release_fn()


@pytest.mark.parametrize("odd, message", [
    (lambda: collections.OrderedDict(x=np.float32(1)),
     r"record 5 has the structure PyTreeDef\(CustomNode\(OrderedDict"),
    (lambda: {"x": None},
     r"record 5 has the structure PyTreeDef\(\{'x': None\}\), but record "
     r"0 has PyTreeDef\(\{'x': \*\}\)"),
])
def test_records_of_the_same_keys_in_other_containers_say_so(odd, message):
  """The keys were listed, the same on both sides (or none for a None
  leaf): the structures tell the records apart."""
  records = [{"x": np.float32(i)} for i in range(8)]
  records[5] = odd()
  loader = SourceDataLoader(records, workers=0)
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 1, 8)
  with pytest.raises(Exception, match=message):
    mapper_fn(lambda batch, carry: (batch["x"], carry), None)
  release_fn()


def test_records_in_the_other_byte_order_are_named():
  records = [{"x": row} for row in np.arange(8.0).reshape(4, 2).astype(">f4")]
  with pytest.raises(TypeError, match=r"record 0 has \['x'\] of dtype >f4, "
                     "in the other byte order.*transform="):
    SourceDataLoader(records, workers=0)


class _NegativeLength:
  def __len__(self):
    return -1

  def __getitem__(self, index):
    return np.zeros(2)


@pytest.mark.parametrize("source, message", [
    (np.array(3.0), "len\\(source\\) failed for source=array\\(3.\\) of type "
     "ndarray: TypeError"),
    (_NegativeLength(), "len\\(source\\) failed .* ValueError: __len__"),
])
def test_a_source_without_a_length_is_named(source, message):
  """Python's own error did not name the argument."""
  with pytest.raises(TypeError, match="source must have a length, "
                     + message):
    jax_data.SourceDataLoader(source)
