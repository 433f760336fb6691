"""Huge pages over XLA's large callback buffers: asked for only where the
kernel gives them on request, only over the whole huge pages inside a
large buffer, changing no byte; a fresh large buffer asks for them, and
many chains' caches, reused, need none."""

import re

import jax
import numpy as np
import pytest

import jax_data
from jax_data import counter_streams as cs
from jax_data.compiled import huge_pages

MIB = 1 << 20
HUGE = 2 * MIB


@pytest.mark.parametrize("modes, given", [
    ("always [madvise] never\n", True),
    ("[always] madvise never\n", False),
    ("always madvise [never]\n", False),
])
def test_huge_pages_are_asked_for_only_where_given_on_request(
    tmp_path, modes, given):
  enabled = tmp_path / "enabled"
  enabled.write_text(modes)
  assert huge_pages.on_request(str(enabled)) is given
  assert not huge_pages.on_request(str(tmp_path / "absent"))


def test_the_span_is_the_whole_huge_pages_inside_a_large_buffer():
  buffer = np.zeros(40 * MIB + 12_345, np.uint8)
  low, high = buffer.ctypes.data, buffer.ctypes.data + buffer.nbytes
  span = huge_pages.huge_span(buffer)
  assert span.start % HUGE == 0 and len(span) % HUGE == 0
  assert low <= span.start < low + HUGE
  assert high - HUGE < span.stop <= high
  # A view with its lane axis moved covers the same bytes.
  lanes = buffer[:40 * MIB].reshape(4, 10, MIB)
  assert huge_pages.huge_span(np.moveaxis(lanes, 1, 0)) == (
      huge_pages.huge_span(buffer[:40 * MIB]))
  assert huge_pages.huge_span(buffer[:huge_pages.ADVISE_BYTES - 1]) is None


def test_only_large_buffers_are_advised_and_a_refusal_is_no_error():
  calls = []

  def call(address, length, advice):
    calls.append((address, length, advice))
    return 0

  large = np.zeros(huge_pages.ADVISE_BYTES + HUGE, np.uint8)
  small = np.zeros(MIB, np.uint8)
  assert huge_pages.advise([small, large, small], call) == 1
  span = huge_pages.huge_span(large)
  assert calls == [(span.start, len(span), 14)]  # MADV_HUGEPAGE
  assert huge_pages.advise([large], lambda *args: -1) == 0


def _vm_flags(address):
  """The ``VmFlags`` of the mapping that holds ``address``."""
  mapping = None
  with open("/proc/self/smaps", encoding="ascii") as smaps:
    for line in smaps:
      bounds = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
      if bounds:
        low, high = (int(b, 16) for b in bounds.groups())
        mapping = low <= address < high
      elif mapping and line.startswith("VmFlags:"):
        return line.split()[1:]
  raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not huge_pages.on_request(),
                    reason="huge pages are not given on request here")
def test_the_kernel_marks_the_advised_bytes_and_keeps_them():
  values = np.arange(40 * MIB // 8, dtype=np.int64)
  assert huge_pages.advise([values]) == 1
  assert "hg" in _vm_flags(huge_pages.huge_span(values).start)
  np.testing.assert_array_equal(values, np.arange(values.size))


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="buffers are written in place on CPU")
def test_fresh_large_buffers_ask_for_huge_pages_and_caches_are_reused(
    monkeypatch):
  """Five vmapped chains with caches of 8 MiB each: a scan over whole
  chunks has the host write them into the caches' own buffers, which
  persist (nothing fresh to advise), and every chain gets its own stream
  in both calls; a full-data pass over a 32 MiB chunk gets a fresh buffer,
  advised before it is written."""
  advised = []
  advise = huge_pages.advise

  def spied(arrays, call=None):
    advised.append([a.nbytes for a in arrays])
    return advise(arrays, call)

  monkeypatch.setattr(huge_pages, "advise", spied)
  n, cache, mb, chains, width = 32_768, 64, 512, 5, 64
  rows = np.repeat(np.arange(n, dtype=np.float32)[:, None], width, axis=1)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(x=rows), cache, mb)
  stacked = init_fn(seed=range(chains))

  def run(state):
    (_, state), xs = jax_data.scan(lambda carry, b: (carry, b["x"]), 0,
                                   state, batch_fn=batch_fn, length=cache)
    return state, xs

  vmapped = jax.jit(jax.vmap(run))
  stacked, got = vmapped(stacked)
  _, more = vmapped(stacked)
  got = np.concatenate([np.asarray(got), np.asarray(more)], axis=1)
  release_fn()
  whole_rows = np.broadcast_to(got[..., :1], got.shape)
  np.testing.assert_array_equal(got, whole_rows)
  for c in range(chains):
    expected, _ = cs.stream_batches(c, 0, 2 * cache, mb, n, False, False)
    np.testing.assert_array_equal(got[c, ..., 0], expected)
  assert not [sizes for sizes in advised
              if max(sizes) >= huge_pages.ADVISE_BYTES]

  wide = np.repeat(np.arange(n, dtype=np.float32)[:, None], 4 * width,
                   axis=1)
  mapper_fn, release_mapper = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=wide), cache, mb)
  firsts, _ = jax.jit(lambda: mapper_fn(lambda b, c: (b["x"][:, 0], c),
                                        None))()
  release_mapper()
  assert np.asarray(firsts).tolist() == list(range(n))
  large = [max(sizes) for sizes in advised
           if max(sizes) >= huge_pages.ADVISE_BYTES]
  assert large == [wide.nbytes]
