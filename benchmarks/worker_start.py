"""What a worker process of ``SourceDataLoader(processes=True)`` costs.

For each kind of main program and record, in a fresh process each:

* start: seconds from a new pool of one worker (``spawn``) to its first
  block of records read, the median of ``--repeats`` pools;
* peak RSS and USS of each of two workers after they read every record;
* whether the workers imported JAX.

Rows: plain records (a dict of arrays and numbers) read from a main that
imports no JAX at the top (a notebook, ``python -c``, a script that
imports JAX under ``if __name__ == "__main__":``), the same from a script
that imports JAX at the top (every spawned worker runs the main module's
imports again), and nested records (``{"x": {"v": ...}}``), which a
worker takes apart with JAX.

Run: ``python benchmarks/worker_start.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# A script that imports JAX at the top: so do its spawned workers, which
# run this module's top level again (the variable is inherited).
if os.environ.get("WORKER_START_JAX_AT_TOP"):
  import jax  # noqa: F401  pylint: disable=unused-import

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = (("plain records, no JAX in the main module", "plain", False),
        ("plain records, a script importing JAX at the top", "plain", True),
        ("nested records", "nested", False))


class Records:
  """Record i: {"x": 4 float32, "y": int32, "jax": whether the reading
  process imported JAX}; nested puts x one level down."""

  def __init__(self, n: int, nested: bool):
    self.n, self.nested = n, nested

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, i: int) -> dict:
    x = np.full(4, i, np.float32)
    return {"x": {"v": x} if self.nested else x, "y": np.int32(i),
            "jax": np.int8("jax" in sys.modules)}


def child(kind: str, repeats: int) -> dict:
  """The measurements of one row, in this (fresh) process."""
  # pylint: disable=import-outside-toplevel
  import concurrent.futures
  import multiprocessing

  import psutil

  from jax_data.loaders import source_records
  from jax_data.loaders import source_workers
  source = Records(2_000, kind == "nested")
  reader = source_records.RecordReader(source, None, "SourceDataLoader")
  pickled = source_workers.pickle_for_workers(source, None, True)
  context = multiprocessing.get_context("spawn")

  def pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    return concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=source_workers.start_worker,
        initargs=(pickled, reader.first))

  starts = []
  for _ in range(repeats):
    start = time.perf_counter()
    one = pool(1)
    one.submit(source_workers.read_block, np.arange(10)).result()
    starts.append(time.perf_counter() - start)
    one.shutdown()
  two = pool(2)
  blocks = [two.submit(source_workers.read_block, part)
            for part in np.array_split(np.arange(len(source)), 8)]
  flags = set()
  for block in blocks:
    leaves = block.result()
    flags.update(leaves[0].tolist())  # "jax" sorts first
  peaks, uss = [], []
  for process in multiprocessing.active_children():
    with open(f"/proc/{process.pid}/status", encoding="ascii") as status:
      peaks += [int(line.split()[1]) * 1024 for line in status
                if line.startswith("VmHWM")]
    uss.append(psutil.Process(process.pid).memory_full_info().uss)
  two.shutdown()
  return {"start": statistics.median(starts), "starts": starts,
          "peak": peaks, "uss": uss, "jax": sorted(flags)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--child", choices=("plain", "nested"))
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.child, args.repeats)))
    return
  print("| main module and records | worker start to first block, s "
        "(median, range) | peak RSS a worker | USS a worker | workers "
        "imported JAX |")
  print("|---|---|---|---|---|")
  for name, kind, jax_at_top in ROWS:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("WORKER_START_JAX_AT_TOP", None)
    if jax_at_top:
      env["WORKER_START_JAX_AT_TOP"] = "1"
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", kind,
         "--repeats", str(args.repeats)], env=env, capture_output=True,
        text=True, timeout=600, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    mib = lambda values: "/".join(f"{v / 2**20:.0f}" for v in values)
    print(f"| {name} | {row['start']:.2f} ({min(row['starts']):.2f}-"
          f"{max(row['starts']):.2f}) | {mib(row['peak'])} MiB | "
          f"{mib(row['uss'])} MiB | {'yes' if row['jax'] == [1] else 'no'} |")


if __name__ == "__main__":
  main()
