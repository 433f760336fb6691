"""Rows of memmaps and mapped files: the same values however they are read,
in the page cache or not."""

import os
import re

import numpy as np
import pytest

from jax_data import NumpyDataLoader
from jax_data.chains import OrderedChain
from jax_data.file_rows import MappedRows
from jax_data.file_rows import drop_pages
from jax_data.file_rows import pages_resident
from jax_data.gather import Gatherer
from jax_data.sampling import ObservationRange


def _memmap(tmp_path, rows=5000, dtype=np.float64, mode="r"):
  path = tmp_path / "x.bin"
  values = np.arange(rows * 6, dtype=dtype).reshape(rows, 6)
  with open(path, "wb") as f:
    values.tofile(f)
    f.flush()
    os.fsync(f.fileno())  # clean pages: the page cache can drop them
  return np.memmap(path, dtype=dtype, mode=mode, shape=(rows, 6)), values


def _evict(array):
  """Drops the file's pages from this process and from the page cache
  (where the file system honours the advice)."""
  drop_pages(array)
  fd = os.open(array.filename, os.O_RDONLY)
  try:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def _views(array):
  return {"whole": array, "offset": array[17:], "strided": array[::3],
          "reversed": array[::-1], "columns": array[:, 2:5]}


@pytest.mark.parametrize("view", ["whole", "offset", "strided", "reversed",
                                  "columns"])
@pytest.mark.parametrize("out_dtype", [np.float64, np.float32])
def test_every_way_of_reading_equals_numpy(tmp_path, view, out_dtype):
  mapped, values = _memmap(tmp_path)
  array, expected = _views(mapped)[view], _views(values)[view]
  rows = MappedRows(array, Gatherer(threads=2, part_bytes=64), io_threads=3)
  rng = np.random.default_rng(0)
  draws = {"random": rng.integers(0, len(array), 700),
           "repeats": np.array([5, 5, 0, len(array) - 1, 5]),
           "run": np.arange(40, 440), "one": np.array([3])}
  for name, flat in draws.items():
    want = expected[flat].astype(out_dtype)
    for read in (rows.read, rows.read_in_file_order):
      _evict(mapped)
      got = read(flat, np.empty((flat.size,) + array.shape[1:], out_dtype))
      np.testing.assert_array_equal(got, want, err_msg=f"{name} {read}")
  rows.close()


def test_residency_is_told_from_the_page_cache(tmp_path):
  array, _ = _memmap(tmp_path, rows=20000)
  rows = np.arange(0, 20000, 997)
  addresses = (array.ctypes.data + rows * array.strides[0]).tolist()
  np.asarray(array[rows]).sum()
  assert pages_resident(addresses)
  _evict(array)
  if pages_resident(addresses):
    pytest.skip("this file system keeps the file's pages cached")
  # Read cold, in file order from several threads: the same rows.
  loader = NumpyDataLoader(copy=False, x=array)
  reference = NumpyDataLoader(x=np.asarray(array))
  chain = loader.register_random_pipeline(4, 50, seed=1)
  ref_chain = reference.register_random_pipeline(4, 50, seed=1)
  np.testing.assert_array_equal(loader.get_batches(chain)[0]["x"],
                                reference.get_batches(ref_chain)[0]["x"])


def _mapped_rss(path) -> int:
  """Resident bytes of this process's mappings of ``path``."""
  total, inside = 0, False
  with open("/proc/self/smaps") as f:
    for line in f:
      fields = line.split()
      if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line
        inside = len(fields) >= 6 and fields[5] == str(path)
      elif inside and fields[0] == "Rss:":
        total += int(fields[1]) * 1024
  return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"),
                    reason="needs /proc/self/smaps")
@pytest.mark.parametrize("drop", [False, True])
def test_file_pages_stay_mapped_unless_dropped(tmp_path, drop):
  array, values = _memmap(tmp_path, rows=50000)
  loader = NumpyDataLoader(copy=False, drop_file_pages=drop, x=array)
  chain = loader.register_random_pipeline(10, 100, seed=0)
  got = loader.get_batches(chain)[0]["x"]
  reference = NumpyDataLoader(x=values)
  ref_chain = reference.register_random_pipeline(10, 100, seed=0)
  np.testing.assert_array_equal(got, reference.get_batches(ref_chain)[0]["x"])
  if drop:
    assert _mapped_rss(array.filename) == 0
  else:
    assert _mapped_rss(array.filename) > 0


def test_copy_on_write_pages_are_never_dropped(tmp_path):
  array, _ = _memmap(tmp_path, mode="c")
  array[0] = -1.0  # an edit in this process's memory only
  loader = NumpyDataLoader(copy=False, drop_file_pages=True, x=array)
  chain = loader.register_random_pipeline(2, 100, seed=0)
  loader.get_batches(chain)
  assert array[0].tolist() == [-1.0] * 6


def test_drop_file_pages_must_be_a_bool(tmp_path):
  array, _ = _memmap(tmp_path)
  with pytest.raises(TypeError, match="drop_file_pages"):
    NumpyDataLoader(copy=False, drop_file_pages="yes", x=array)


def test_a_run_is_a_read_only_view_unless_cast_or_dropped(tmp_path):
  array, values = _memmap(tmp_path)
  run = np.arange(100, 300)
  view = MappedRows(array, Gatherer()).read(
      run, np.empty((200, 6), np.float64))
  assert np.shares_memory(view, array) and not view.flags.writeable
  np.testing.assert_array_equal(view, values[100:300])
  for rows, dtype in ((MappedRows(array, Gatherer()), np.float32),
                      (MappedRows(array, Gatherer(), drop_pages=True),
                       np.float64)):
    out = np.empty((200, 6), dtype)
    assert rows.read(run, out) is out
    np.testing.assert_array_equal(out, values[100:300].astype(dtype))


def test_chunks_read_ahead_are_checked_when_served(tmp_path):
  """A chunk of views read before the file shrank raises when it is asked
  for, instead of being read past the file's end (SIGBUS)."""
  path = tmp_path / "x.npy"
  np.save(path, np.ones((1000, 4), np.float32))
  loader = NumpyDataLoader(copy=False, x=np.load(path, mmap_mode="r"))
  layout = loader.chunk_layout(2, 100)
  cursor = loader.open_chain(OrderedChain(ObservationRange(0, 1000)), layout)
  out = layout.new_chunk()
  chunk = cursor.produce(0, out)
  chunk.check()  # readable
  assert np.shares_memory(chunk.leaves[0], loader._arrays["x"])  # pylint: disable=protected-access
  with open(path, "r+b") as f:
    f.truncate(1000)
  with pytest.raises(OSError, match="was truncated to 1000 bytes"):
    chunk.check()


def test_rows_read_as_fast_as_memory_only_once_a_gather_showed_it(
    tmp_path, monkeypatch):
  """A memmap's rows count as read from the page cache (a group of chains
  may then read them while compiled code waits) only once a gather of
  random rows took no longer than one in memory would; not before, not
  after a slow one, and never where pages are dropped after each read."""
  from jax_data.loaders import file_rows

  array, values = _memmap(tmp_path)
  np.asarray(array).sum()  # every page in the page cache, and mapped
  flat = np.random.default_rng(0).integers(0, len(array), 300)
  out = np.empty((flat.size, 6))
  rows = MappedRows(array, Gatherer(threads=2, part_bytes=64))
  assert not rows.reads_page_cache()
  # Gathers timed as fast, then as slow, whatever the machine's load.
  monkeypatch.setattr(file_rows, "_SLOW_ROW_SECONDS", 1.0)
  np.testing.assert_array_equal(rows.read(flat, out), values[flat])
  assert rows.reads_page_cache()
  monkeypatch.setattr(file_rows, "_SLOW_ROW_SECONDS", -1.0)
  rows.read(flat, out)
  assert not rows.reads_page_cache()
  monkeypatch.setattr(file_rows, "_SLOW_ROW_SECONDS", 1.0)
  np.testing.assert_array_equal(rows.read(flat, out), values[flat])
  assert rows.reads_page_cache()
  rows.close()
  dropping = MappedRows(array, Gatherer(), drop_pages=True)
  np.testing.assert_array_equal(dropping.read(flat, out), values[flat])
  assert not dropping.reads_page_cache()
  dropping.close()
