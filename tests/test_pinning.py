"""Page-locked answer buffers: which CUDA runtime registers them, that each
kept buffer is registered once and unregistered before its memory goes,
and that nothing is registered where no GPU is driven."""

import gc
import types

import jax
import numpy as np
import pytest

from jax_data.loaders import pinning
from jax_data.loaders.gather import BufferPool

MIB = 1 << 20


class _Runtime:
  """Records the registrations a CUDA runtime would make."""

  def __init__(self, fails=False):
    self.fails = fails
    self.registered = {}  # address -> bytes
    self.calls = []

  def cudaHostRegister(self, address, size, flags):  # pylint: disable=invalid-name
    self.calls.append(("register", address, size, flags))
    if self.fails:
      return 1
    assert address not in self.registered
    self.registered[address] = size
    return 0

  def cudaHostUnregister(self, address):  # pylint: disable=invalid-name
    self.calls.append(("unregister", address))
    del self.registered[address]
    return 0

  def cudaGetLastError(self):  # pylint: disable=invalid-name
    self.calls.append(("last error",))
    return 0


def test_a_buffer_is_registered_portable_and_unregistered_when_it_goes():
  runtime = _Runtime()
  buffer = np.empty(2 * MIB, np.uint8)
  address = buffer.ctypes.data
  assert pinning.pin(buffer, runtime)
  assert runtime.calls == [("register", address, 2 * MIB, 1)]
  assert runtime.registered == {address: 2 * MIB}
  view = buffer[:10]
  del buffer
  gc.collect()
  assert runtime.registered  # a view keeps the memory, and it pinned
  del view
  gc.collect()
  assert runtime.registered == {}
  assert runtime.calls[-1] == ("unregister", address)


@pytest.mark.parametrize("array", [
    np.empty(MIB - 1, np.uint8),  # too small to gain
    np.empty((2, 2 * MIB), np.uint8)[:, ::2],  # not contiguous
    np.empty(4 * MIB, np.uint8)[MIB:],  # another array's memory
], ids=["small", "strided", "view"])
def test_only_whole_contiguous_buffers_of_a_mebibyte_are_registered(array):
  runtime = _Runtime()
  assert not pinning.pin(array, runtime)
  assert runtime.calls == []


def test_a_failed_registration_leaves_the_buffer_pageable():
  runtime = _Runtime(fails=True)
  buffer = np.empty(2 * MIB, np.uint8)
  assert not pinning.pin(buffer, runtime)
  del buffer
  gc.collect()
  # The runtime's last error is cleared; nothing is unregistered.
  assert [call[0] for call in runtime.calls] == ["register", "last error"]


def test_a_pool_registers_each_buffer_it_keeps_once():
  runtime = _Runtime()
  pool = BufferPool(pin=lambda array: pinning.pin(array, runtime))
  first = pool.empty((MIB,), np.float32)
  address = first.ctypes.data
  del first
  again = pool.empty((MIB,), np.float32)  # the same buffer, used again
  assert again.ctypes.data == address
  assert list(runtime.registered) == [address]
  # Buffers held at once, up to what the pool keeps, are each registered;
  # one beyond that is neither kept nor registered.
  held = [again] + [pool.empty((MIB,), np.float32)
                    for _ in range(BufferPool._PER_FORMAT)]  # pylint: disable=protected-access
  assert len(runtime.registered) == BufferPool._PER_FORMAT  # pylint: disable=protected-access
  assert held[-1].ctypes.data not in runtime.registered
  del held, again, pool
  gc.collect()
  assert runtime.registered == {}


def test_the_runtime_is_the_one_loaded_else_the_newest_of_the_wheels(
    tmp_path, monkeypatch):
  driver = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
  assert pinning.runtime_path(["/lib/libc.so.6"]) is None  # no GPU driven
  assert pinning.runtime_path(
      [driver, "/site/nvidia/cu13/lib/libcudart.so.13"]) == (
          "/site/nvidia/cu13/lib/libcudart.so.13")
  for folder in ("cuda_runtime", "cu13"):
    (tmp_path / folder / "lib").mkdir(parents=True)
  (tmp_path / "cuda_runtime" / "lib" / "libcudart.so.12").touch()
  (tmp_path / "cu13" / "lib" / "libcudart.so.13").touch()
  spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
  monkeypatch.setattr(pinning.importlib.util, "find_spec",
                      lambda name: spec if name == "nvidia" else None)
  assert pinning.runtime_path([driver]) == str(
      tmp_path / "cu13" / "lib" / "libcudart.so.13")


def test_nothing_is_registered_where_no_gpu_is_driven():
  if jax.default_backend() == "gpu" or pinning._loaded("libcuda.so.1"):  # pylint: disable=protected-access
    pytest.skip("this process drives a GPU")
  assert pinning.cuda_runtime() is None
  assert not pinning.pin(np.empty(4 * MIB, np.uint8))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_on_a_gpu_a_pinned_buffer_reaches_the_device_intact():
  buffer = np.empty((MIB,), np.float32)
  assert pinning.pin(buffer)
  buffer[:] = np.arange(MIB, dtype=np.float32)
  np.testing.assert_array_equal(np.asarray(jax.device_put(buffer)), buffer)
  assert not pinning.pin(buffer)  # registered already: left as it is


@pytest.mark.parametrize("page_locked", [True, False])
def test_a_loader_s_store_limits_choose_whether_answers_are_registered(
    monkeypatch, page_locked):
  import dataclasses

  import jax.numpy as jnp

  import jax_data
  from jax_data.serving import host
  from jax_data.serving import production

  seen = []
  monkeypatch.setattr(host, "pin", seen.append)
  monkeypatch.setattr(production, "pin", seen.append)
  loader = jax_data.NumpyDataLoader(
      x=np.arange(65536 * 4, dtype=np.float32).reshape(65536, 4))
  loader.store_limits = dataclasses.replace(loader.store_limits,
                                            page_locked=page_locked)
  # Answers of 4 lanes x 64 batches x 512 rows x 4 float32: 2 MiB, through
  # pure_callback (the path a GPU takes) and its pool of answers.
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 64, 512, callback="pure")
  step = jax.jit(jax.vmap(batch_fn))
  states = init_fn(seed=range(4))
  _, batch = step(states)
  assert batch["x"].shape == (4, 512, 4)
  assert bool(jnp.all(batch["x"][..., 1] == batch["x"][..., 0] + 1))
  release_fn()
  if page_locked:
    assert 2 * MIB in [buffer.nbytes for buffer in seen], [
        buffer.nbytes for buffer in seen]
  else:
    assert seen == []
