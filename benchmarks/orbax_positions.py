"""Orbax checkpoints of data positions: save and restore time by chain count.

C vmapped chains (``random_reference_data`` over a NumPy loader of 1e5 rows
of 32 floats, cache 100, mb 64, counter streams, shuffled in epochs) are
advanced one step, then saved with ``jax_data.DataSave`` in a
``CheckpointManager`` step beside parameters of 1 MiB, and restored with
``jax_data.DataRestore`` into a fresh pipeline (registering C chains). The
table shows the median of ``--repeats`` runs: the synchronous save, the
time until an asynchronous save returns (the sampler goes on from there)
and until it is written, the restore, and the file's bytes.

Run: ``python benchmarks/orbax_positions.py [--chains 1 64 1024]``.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from common import format_bytes
from common import markdown_table

import jax_data

ROWS, FEATURES, CACHE, MB = 100_000, 32, 100, 64


def _pipeline(x):
  return jax_data.random_reference_data(jax_data.NumpyDataLoader(x=x), CACHE,
                                        MB)


def _states(init_fn, chains):
  states = [init_fn(seed=c, shuffle=True, in_epochs=True, stream="counter")
            for c in range(chains)]
  return jax.tree_util.tree_map(lambda *s: np.stack(s), *states)


def _save(directory, step, pipeline, state, params, asynchronous):
  manager = ocp.CheckpointManager(directory, options=(
      ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous)))
  start = time.perf_counter()
  manager.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params),
      data=jax_data.DataSave(pipeline, state)))
  returned = time.perf_counter() - start
  manager.wait_until_finished()
  written = time.perf_counter() - start
  manager.close()
  return returned, written


def measure(chains: int, repeats: int) -> list[str]:
  x = np.random.default_rng(0).normal(size=(ROWS, FEATURES)).astype(
      np.float32)
  params = {"w": np.zeros((512, 512), np.float32)}  # 1 MiB
  pipeline = _pipeline(x)
  init_fn, batch_fn, _ = pipeline
  step = jax.jit(jax.vmap(batch_fn))
  state, _ = step(_states(init_fn, chains))
  sync, returned, written, restored, size = [], [], [], [], 0
  for repeat in range(repeats):
    directory = tempfile.mkdtemp()
    sync.append(_save(directory, 2 * repeat, pipeline, state, params,
                      False)[1])
    r, w = _save(directory, 2 * repeat + 1, pipeline, state, params, True)
    returned.append(r)
    written.append(w)
    fresh = _pipeline(x)
    start = time.perf_counter()
    with ocp.CheckpointManager(directory) as manager:
      manager.restore(2 * repeat + 1, args=ocp.args.Composite(
          data=jax_data.DataRestore(fresh)))
    restored.append(time.perf_counter() - start)
    fresh[2]()
    size = _data_bytes(directory, 2 * repeat + 1)
    shutil.rmtree(directory, ignore_errors=True)
  med = statistics.median
  return [f"{chains:,}", f"{med(sync) * 1e3:.0f} ms",
          f"{med(returned) * 1e3:.0f} ms", f"{med(written) * 1e3:.0f} ms",
          f"{med(restored) * 1e3:.0f} ms", format_bytes(size)]


def _data_bytes(directory, step) -> int:
  return sum(p.stat().st_size for p in
             (pathlib.Path(directory) / str(step) / "data").glob("*.npz"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chains", type=int, nargs="+", default=[1, 64, 1024])
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  rows = [measure(c, args.repeats) for c in args.chains]
  print(markdown_table(
      ["chains", "save (sync)", "async save returns", "async save written",
       "restore (fresh pipeline)", "data file"], rows))


if __name__ == "__main__":
  main()
