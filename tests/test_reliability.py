"""Long runs, many pipelines, many threads: memory stays flat, streams stay
exact."""

import ctypes
import gc
import threading
import weakref

import jax
import numpy as np
import psutil
from jax import lax

import jax_data
from jax_data import NumpyDataLoader


def _rss() -> int:
  """Resident memory after freed heap pages went back to the OS.

  glibc keeps freed pages of its heap until asked (XLA's compilations leave
  many); ``malloc_trim`` returns them, so what remains is memory still held.
  """
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: measure as it is
    pass
  return psutil.Process().memory_info().rss


def test_hundred_pipelines_over_100mb_leave_memory_where_it_was():
  loader = NumpyDataLoader(x=np.ones((100_000, 250), np.float32))  # 100 MB

  def use_once(loader, seed):
    pipeline = jax_data.random_reference_data(loader, 8, 32)
    init_fn, batch_fn, release_fn = pipeline
    state = init_fn(seed=seed)
    for _ in range(10):
      state, batch = batch_fn(state)
    mapper_fn, release_mapper = jax_data.full_data_mapper(loader, 10, 1000)
    sums, _ = mapper_fn(lambda b, m, c: ((b["x"].sum(1) * m).sum(), c), None,
                        masking=True)
    assert float(batch["x"].sum()) == 32 * 250
    assert float(sums.sum()) == 100_000 * 250
    release_fn()
    release_mapper()

  for seed in range(5):  # warm up JAX's own caches
    use_once(loader, seed)
  start = _rss()
  for seed in range(100):
    use_once(loader, seed)
  grown = _rss() - start
  assert grown < 50 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"
  ref = weakref.ref(loader)
  del loader
  gc.collect()
  assert ref() is None  # released pipelines hold no reference to the data


def test_million_steps_keep_host_memory_flat():
  pipeline = jax_data.random_reference_data(
      NumpyDataLoader(x=np.arange(10_000.0)), 100, 64)
  init_fn, batch_fn, _ = pipeline
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=200_000)[0])
  state = run(init_fn(seed=1))
  start = _rss()
  for _ in range(4):
    state = run(state)
  grown = _rss() - start
  assert int(state.chunk) * 100 == 1_000_000
  record = pipeline.host.chain(int(state.chain))
  assert len(record.chunks) <= 3 and len(record.snapshots) < 400
  assert grown < 20 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"


def test_eight_threads_each_get_their_solo_stream():
  n, cache, mb, steps = 101, 3, 7, 40
  loader = NumpyDataLoader(x=np.arange(n))
  init_fn, batch_fn, _ = jax_data.random_reference_data(loader, cache, mb)
  modes = [dict(), dict(shuffle=True), dict(shuffle=True, in_epochs=True)]
  run = jax.jit(lambda s: lax.scan(lambda s, _: batch_fn(s), s, None,
                                   length=steps)[1]["x"])
  results, errors = {}, []
  barrier = threading.Barrier(8)

  def worker(i):
    try:
      state = init_fn(seed=100 + i, **modes[i % 3])
      barrier.wait()
      first = run(state)
      second = run(state)  # the same state again, concurrently with others
      results[i] = (first.tolist(), second.tolist())
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert not errors, errors
  for i in range(8):
    solo_init, solo_batch, _ = jax_data.random_reference_data(
        NumpyDataLoader(x=np.arange(n)), cache, mb)
    _, solo = jax.lax.scan(lambda s, _, step=solo_batch: step(s),
                           solo_init(seed=100 + i, **modes[i % 3]), None,
                           length=steps)
    assert results[i][0] == results[i][1] == solo["x"].tolist(), i
