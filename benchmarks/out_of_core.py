"""Out-of-core: ``NumpyDataLoader(copy=False, x=numpy.memmap(...))``.

The parent process writes memmap files (4 GiB of features in the full run)
into a temporary directory and starts a fresh Python process (this file
with ``--child``) that serves SGLD random batches and a full-data pass from
them, while a thread samples the child's resident memory. The files are
deleted afterwards.

Resident memory is read from ``/proc/self/status``: ``VmHWM`` (exact peak
of the total, reset per phase through ``/proc/self/clear_refs``), and
``RssAnon`` / ``RssFile`` sampled every few milliseconds. Pages of a
memmap that the process has touched count into ``RssFile`` (and so into
the total RSS) for as long as they stay mapped, although they are page
cache that the kernel can drop at any time; memory the process allocates
itself is ``RssAnon``. Both are reported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any
from typing import Self

import numpy as np
from common import Section
from common import Target
from common import format_bytes
from common import format_count
from common import memory_row

_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of the out-of-core case.

  Attributes:
    feature_bytes: Size of the feature file ``x`` (float32, ``features``
      columns); the label file ``y`` adds 4 bytes per row.
    features: D.
    mb: Batch size of the random chain.
    cache: Batches per host call.
    steps: SGLD steps of the random-batch phase.
    full_mb: Batch size of the full-data pass.
    limit_bytes: Target: peak resident memory above the baseline.
  """
  feature_bytes: int = 4 * 2 ** 30
  features: int = 32
  mb: int = 64
  cache: int = 100
  steps: int = 20_000
  full_mb: int = 1_000
  limit_bytes: int = 2 ** 30


FULL = Config()
SMOKE = Config(feature_bytes=64 * 2 ** 20, steps=1_000)


def _rows(config: Config) -> int:
  return config.feature_bytes // (4 * config.features)


def write_files(directory: str, config: Config) -> dict[str, str]:
  """Writes ``x.f32`` and ``y.f32`` block by block (never all in memory).

  Returns:
    Paths by key.
  """
  rows = _rows(config)
  paths = {"x": os.path.join(directory, "x.f32"),
           "y": os.path.join(directory, "y.f32")}
  rng = np.random.default_rng(0)
  block = 2 ** 20
  with open(paths["x"], "wb") as fx, open(paths["y"], "wb") as fy:
    for start in range(0, rows, block):
      count = min(block, rows - start)
      x = rng.random((count, config.features), dtype=np.float32)
      x -= 0.5
      x.tofile(fx)
      (rng.random(count, dtype=np.float32) < 0.5).astype(
          np.float32).tofile(fy)
  return paths


def run(config: Config, repeats: int) -> Section:
  """Writes the files, measures in a child process, deletes the files.

  Args:
    config: Sizes.
    repeats: Unused: memory is measured once (timings are secondary here).

  Returns:
    The section of the report.
  """
  del repeats
  directory = tempfile.mkdtemp(prefix="jax_data_bench_")
  try:
    start = time.perf_counter()
    paths = write_files(directory, config)
    written = time.perf_counter() - start
    print(f"  wrote {format_bytes(config.feature_bytes)} of memmap files in "
          f"{written:.1f} s", flush=True)
    request = {"paths": paths, "config": dataclasses.asdict(config)}
    completed = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child",
         json.dumps(request)], capture_output=True, text=True, check=False)
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  if completed.returncode != 0:
    raise RuntimeError(
        f"out-of-core child process failed ({completed.returncode}):\n"
        f"{completed.stderr[-4000:]}")
  result = json.loads(completed.stdout.strip().splitlines()[-1])
  return _section(config, result)


def _section(config: Config, result: dict[str, Any]) -> Section:
  rows = _rows(config)
  base = result["baseline"]
  table = []
  for name, phase in result["phases"].items():
    table.append([
        name, phase["work"], phase["time"],
        format_bytes(phase["peak"]["VmHWM"] - base["VmRSS"]),
        format_bytes(phase["peak"]["RssAnon"] - base["RssAnon"]),
        format_bytes(phase["peak"]["RssFile"] - base["RssFile"]),
        format_bytes(phase["end"]["VmRSS"] - base["VmRSS"])])
  peak_total = max(p["peak"]["VmHWM"] for p in result["phases"].values())
  peak_anon = max(p["peak"]["RssAnon"] for p in result["phases"].values())
  total_delta = peak_total - base["VmRSS"]
  anon_delta = peak_anon - base["RssAnon"]
  limit = format_bytes(config.limit_bytes)
  full_size = config == FULL
  return Section(
      key="memmap",
      title="Out-of-core: NumpyDataLoader over numpy.memmap",
      description=(
          f"`NumpyDataLoader(copy=False, x=memmap, y=memmap)` over "
          f"{format_count(rows)} rows: "
          f"{format_bytes(config.feature_bytes)} of float32 features "
          f"(D={config.features}) and {format_bytes(rows * 4)} of labels, "
          "written to a temporary directory just before (so in the page "
          "cache, not read cold from disk) and deleted afterwards. A fresh "
          "process measures; its baseline, after importing JAX and "
          f"jax_data, is {format_bytes(base['VmRSS'])} RSS "
          f"({format_bytes(base['RssAnon'])} anonymous). Peaks include "
          "compilation."),
      headers=["phase", "work", "time", "peak RSS above baseline",
               "anonymous (RssAnon)", "mapped file pages (RssFile)",
               "RSS above baseline at the end"],
      rows=table,
      notes=[
          ("RssFile counts the memmap's pages that the process has touched "
           "and that are still mapped: page cache, shared with the kernel, "
           "dropped under memory pressure, but part of RSS. RssAnon is what "
           "the process allocates itself (caches, chunks, XLA buffers)."),
          ("The total peak is the kernel's high-water mark (VmHWM), so "
           "pages mapped only for an instant, while one chunk is read, "
           "count too; the anonymous and file peaks are sampled every "
           "3 ms. A read of a row can map more than its own page: the "
           "kernel maps pages around it (fault-around, large folios of "
           "the page cache), so a chunk of random rows can map much of "
           "the file at once."),
          ("The last column is what stays resident when the phase ends: "
           "pages the loader no longer maps are not counted there.")],
      targets=[
          Target("out-of-core: peak RSS above baseline (total, incl. "
                 "mapped memmap pages)", f"< {limit}",
                 format_bytes(total_delta),
                 total_delta < config.limit_bytes if full_size else None),
          Target("out-of-core: peak anonymous memory above baseline",
                 f"< {limit}", format_bytes(anon_delta),
                 anon_delta < config.limit_bytes if full_size else None)],
      memory=[memory_row("memmap random_reference_data", config.cache,
                         config.mb, 4 * (config.features + 1), rows),
              memory_row("memmap full_data_mapper", config.cache,
                         config.full_mb, 4 * (config.features + 1), rows)])


# -- child process -------------------------------------------------------


def read_status() -> dict[str, int]:
  """Resident-memory fields of ``/proc/self/status``, in bytes."""
  values = {}
  with open("/proc/self/status") as f:
    for line in f:
      name, _, rest = line.partition(":")
      if name in _STATUS_FIELDS:
        values[name] = int(rest.split()[0]) * 1024
  return values


class MemorySampler:
  """Samples ``/proc/self/status`` in a thread and keeps per-phase peaks."""

  def __init__(self, interval: float = 0.003):
    self._interval = interval
    self._lock = threading.Lock()
    self._peak: dict[str, int] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def __enter__(self) -> Self:
    self.reset()
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()

  def _loop(self) -> None:
    while not self._stop.wait(self._interval):
      self._sample()

  def _sample(self) -> None:
    status = read_status()
    with self._lock:
      for k, v in status.items():
        self._peak[k] = max(self._peak.get(k, 0), v)

  def reset(self) -> None:
    """Starts a new phase: resets the kernel's VmHWM and the peaks."""
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    with self._lock:
      self._peak = {}
    self._sample()

  def peak(self) -> dict[str, int]:
    self._sample()
    with self._lock:
      return dict(self._peak)


def child(request: dict[str, Any]) -> dict[str, Any]:
  """Measures both phases in this (fresh) process."""
  import jax
  import jax.numpy as jnp
  from models import masked_log_likelihood
  from models import sgld_sampler

  import jax_data

  config = Config(**request["config"])
  rows = _rows(config)
  jax.block_until_ready(jnp.zeros(1) + 1)
  x = np.memmap(request["paths"]["x"], np.float32, "r",
                shape=(rows, config.features))
  y = np.memmap(request["paths"]["y"], np.float32, "r", shape=(rows,))
  loader = jax_data.NumpyDataLoader(copy=False, x=x, y=y)
  phases = {}
  with MemorySampler() as sampler:
    baseline = read_status()

    sampler.reset()
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, config.cache, config.mb)
    theta = jnp.zeros(config.features, jnp.float32)
    sampler_fn = sgld_sampler(batch_fn, rows, config.steps, 0.01 / rows)
    args = (theta, init_fn(seed=0), jax.random.PRNGKey(0))
    compiled = sampler_fn.lower(*args).compile()
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    seconds = time.perf_counter() - start
    release_fn()
    phases["SGLD random batches"] = {
        "work": f"{config.steps:,} steps of mb={config.mb}, "
                f"cache={config.cache}",
        "time": f"{seconds / config.steps * 1e6:.3g} µs/step",
        "peak": sampler.peak(), "end": read_status()}

    sampler.reset()
    mapper_fn, release_fn = jax_data.full_data_mapper(
        loader, config.cache, config.full_mb)

    @jax.jit
    def log_likelihood(theta):
      sums, _ = mapper_fn(
          lambda batch, mask, carry: (
              masked_log_likelihood(theta, batch, mask), carry),
          None, masking=True)
      return jnp.sum(sums)

    compiled = log_likelihood.lower(theta).compile()
    start = time.perf_counter()
    jax.block_until_ready(compiled(theta))
    seconds = time.perf_counter() - start
    release_fn()
    total_bytes = rows * 4 * (config.features + 1)
    phases["full-data pass"] = {
        "work": f"1 pass, mb={config.full_mb}, cache={config.cache}",
        "time": f"{seconds:.3g} s ({total_bytes / seconds / 2 ** 30:.2g} "
                "GiB/s)",
        "peak": sampler.peak(), "end": read_status()}
  return {"baseline": baseline, "phases": phases}


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--child":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print(json.dumps(child(json.loads(sys.argv[2]))))
  else:
    sys.exit("run benchmarks/run.py --only memmap; this file's main is the "
             "child process of that case")
