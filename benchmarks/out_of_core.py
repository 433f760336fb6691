"""Out-of-core: ``NumpyDataLoader(copy=False, x=numpy.memmap(...))``.

The parent process writes memmap files (4 GiB of features in the full run)
into a temporary directory and starts two fresh Python processes (this file
with ``--child``, then ``--speed``); the files are deleted afterwards.

* ``--child`` serves SGLD random batches (pages kept, then dropped with
  ``drop_file_pages=True``) and a full-data pass from them, while a thread
  samples the process's resident memory.
* ``--speed`` times, round-robin, the same workloads over the files and
  over the same rows in memory (1e6 rows and the whole file; HDF5 and
  random-access sources at 1e6), with the page cache warm; then reads
  random records with the files dropped from the page cache, beside the
  disk's own random 4 KiB read rate (``os.pread``) in the same run.

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
import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any
from typing import Self

import numpy as np
from common import Contender
from common import Records
from common import Section
from common import Target
from common import format_bytes
from common import format_count
from common import memory_row
from common import run_child

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
  speed_steps: int = 100_000
  short_steps: int = 2_000
  source_steps: int = 2_000
  cold_steps: int = 2_000
  cold_reads: int = 20_000


FULL = Config()
SMOKE = Config(feature_bytes=16 * 2 ** 20, steps=500, speed_steps=1_000,
               short_steps=200, source_steps=200, cold_steps=200,
               cold_reads=2_000)


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
    for f in (fx, fy):  # written back: the page cache may drop them
      f.flush()
      os.fsync(f.fileno())
  return paths


def run(config: Config, repeats: int) -> Section:
  """Writes the files, measures in a child process, deletes the files.

  Args:
    config: Sizes.
    repeats: Measurements per contender of the speed tables (memory is
      measured once).

  Returns:
    The section of the report.
  """
  directory = tempfile.mkdtemp(prefix="jax_data_bench_")
  try:
    start = time.perf_counter()
    paths = write_files(directory, config)
    written = time.perf_counter() - start
    print(f"  wrote {format_bytes(config.feature_bytes)} of memmap files in "
          f"{written:.1f} s", flush=True)
    request = {"paths": paths, "config": dataclasses.asdict(config),
               "directory": directory, "repeats": repeats}
    result = _in_child("--child", request)
    speed = _in_child("--speed", request)
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  return _section(config, result, speed)


def _in_child(mode: str, request: dict[str, Any]) -> dict[str, Any]:
  """Runs this file's ``mode`` in a fresh process; its JSON result."""
  return run_child(os.path.abspath(__file__), mode, request,
                   one_device=False)


def _speed_tables(config: Config, speed: dict[str, Any]
                  ) -> tuple[list[tuple], list[Target]]:
  """The warm and cold tables, and their targets."""
  full_size = config == FULL
  warm_rows, targets = [], []
  for row in speed["warm"]:
    unit = "s" if row["workload"] == "full-data pass" else "µs/step"
    scale = 1 if unit == "s" else 1e6
    warm_rows.append([
        format_count(row["rows"]), row["workload"], row["form"],
        f"{row['time'] * scale:.3g} {unit}",
        f"{row['memory'] * scale:.3g} {unit}", f"{row['ratio']:.2f}x",
        f"{row['again']:.2f}x" if "again" in row else "-"])
    if row["form"] != _SOURCE_MEMMAP:
      targets.append(Target(
          f"out-of-core, warm: {row['form']} / in memory, "
          f"{format_count(row['rows'])} rows, {row['workload']}",
          "<= 1.2x", f"{row['ratio']:.2f}x",
          row["ratio"] <= 1.2 if full_size else None))
  cold = speed["cold"]
  disk = cold["disk"]
  best = max(disk.values())
  cold_rows = [[format_count(cold["rows"]), f"{cold['records']:,.0f}",
                *[f"{v:,.0f}" for v in disk.values()],
                f"{cold['records'] / best:.2f}",
                f"{cold['cached']:.0%}"]]
  tables = [
      ("Speed with the page cache warm: the same workload over the files "
       "(memmaps, an HDF5 file holding the same arrays, random-access "
       "sources whose `__getitem__` indexes the memmaps) and over the same "
       "rows in memory (NumPy arrays; the source over the arrays), timed "
       "round-robin in one fresh process, median per step (per pass) and "
       "median of per-repeat ratios. `data only`: the `jax_data.scan` loop "
       "whose step only sums its batch; SGLD: the sampler of case (a); "
       "the full-data pass: the log-likelihood of case (c).",
       ["rows", "workload", "on disk", "time", "in memory",
        "on disk / in memory", "in memory again / in memory"], warm_rows,
       ["`in memory again`: a second loader over the same arrays, timed "
        "with the others: how far two identical contenders differ here.",
        "The random-access sources read a record per `__getitem__` call. "
        "Indexing a `numpy.memmap` row costs about 0.9 µs of Python (it "
        "builds a memmap object) against 0.07 µs for an `np.ndarray` row, "
        "which is the difference between the two source rows; indexing "
        "`memmap.view(np.ndarray)` reads the same file pages at the "
        "speed of memory."]),
      ("Cold reads: before each call the files are dropped from the page "
       "cache (`posix_fadvise(POSIX_FADV_DONTNEED)`, after unmapping the "
       "pages) and a `jax_data.scan` of "
       f"{config.cold_steps:,} data-only steps of mb={config.mb} reads "
       "random records from them (a record is a row of x and a row of y, "
       "in two files: at least one 4 KiB read from the disk, the x row's "
       "page). Beside it, in the same run, the "
       "disk's own rate: random page-aligned 4 KiB `os.pread`s from the x "
       "file dropped from the page cache, from 1 and 16 threads.",
       ["rows", "jax_data records/s",
        *[f"disk 4 KiB reads/s, {k}" for k in disk],
        "jax_data records / disk's best reads", "pages still cached"],
       cold_rows,
       ["`pages still cached`: the largest fraction of a sample of the "
        "files' pages that the page cache still held after dropping them "
        "(0% when the drop worked)."])]
  targets.append(Target(
      "out-of-core, cold: jax_data records/s / disk's best 4 KiB reads/s",
      ">= 0.5", f"{cold['records'] / best:.2f}",
      cold["records"] / best >= 0.5 if full_size else None))
  return tables, targets


def _section(config: Config, result: dict[str, Any],
             speed: dict[str, Any]) -> Section:
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
  peak_anon = max(p["peak"]["RssAnon"] for p in result["phases"].values())
  dropped = result["phases"]["SGLD, drop_file_pages=True"]
  dropped_delta = dropped["peak"]["VmHWM"] - base["VmRSS"]
  anon_delta = peak_anon - base["RssAnon"]
  tables, speed_targets = _speed_tables(config, speed)
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
           "the process allocates itself (caches, chunks, XLA buffers). "
           "jax_data leaves file pages mapped (reading them again costs "
           "nothing); with `drop_file_pages=True` it unmaps them after each "
           "chunk, and the total stays low too."),
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
          Target("out-of-core: peak anonymous memory above baseline",
                 f"< {limit}", format_bytes(anon_delta),
                 anon_delta < config.limit_bytes if full_size else None),
          Target("out-of-core, drop_file_pages=True: peak RSS above "
                 "baseline (total, incl. mapped memmap pages)", f"< {limit}",
                 format_bytes(dropped_delta),
                 dropped_delta < config.limit_bytes if full_size else None),
          *speed_targets],
      tables=tables,
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


def log_likelihood_pass(loader: Any, config: Config) -> tuple:
  """Case (c)'s full-data log-likelihood over ``loader``: a jitted
  ``theta -> sum`` and the pipeline's ``release_fn``."""
  import jax
  import jax.numpy as jnp
  from models import masked_log_likelihood

  import jax_data

  mapper_fn, release_fn = jax_data.full_data_mapper(loader, config.cache,
                                                    config.full_mb)

  @jax.jit
  def log_likelihood(theta):
    sums, _ = mapper_fn(
        lambda batch, mask, carry: (
            masked_log_likelihood(theta, batch, mask), carry),
        None, masking=True)
    return jnp.sum(sums)

  return log_likelihood, release_fn


def child(request: dict[str, Any]) -> dict[str, Any]:
  """Measures both phases in this (fresh) process."""
  import jax
  import jax.numpy as jnp
  from common import settle
  from models import sgld_sampler

  import jax_data
  from jax_data.file_rows import drop_pages

  config = Config(**request["config"])
  rows = _rows(config)
  jax.block_until_ready(jnp.zeros(1) + 1)
  x = np.memmap(request["paths"]["x"], np.float32, "r",
                shape=(rows, config.features))
  y = np.memmap(request["paths"]["y"], np.float32, "r", shape=(rows,))
  loader = jax_data.NumpyDataLoader(copy=False, x=x, y=y)
  theta = jnp.zeros(config.features, jnp.float32)
  phases = {}
  with MemorySampler() as sampler:
    baseline = read_status()
    for name, drop in (("SGLD random batches", False),
                       ("SGLD, drop_file_pages=True", True)):
      sampler.reset()
      init_fn, batch_fn, release_fn = jax_data.random_reference_data(
          jax_data.NumpyDataLoader(copy=False, drop_file_pages=drop, x=x,
                                   y=y), config.cache, config.mb)
      sampler_fn = sgld_sampler(batch_fn, rows, config.steps, 0.01 / rows)
      args = (theta, init_fn(seed=0), jax.random.PRNGKey(0))
      compiled = sampler_fn.lower(*args).compile()
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      seconds = time.perf_counter() - start
      release_fn()
      phases[name] = {
          "work": f"{config.steps:,} steps of mb={config.mb}, "
                  f"cache={config.cache}",
          "time": f"{seconds / config.steps * 1e6:.3g} µs/step",
          "peak": sampler.peak(), "end": read_status()}
      settle()  # the loader's read-ahead is done: nothing maps pages now
      drop_pages(x)  # the next phase starts with no pages mapped
      drop_pages(y)

    sampler.reset()
    log_likelihood, release_fn = log_likelihood_pass(loader, config)
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


_AGAIN = "in memory, a second loader"
_SOURCE_MEMMAP = "random-access source, np.memmap rows"
_SOURCE_VIEW = "random-access source, rows of memmap.view(np.ndarray)"


def evict(*arrays: np.memmap) -> float:
  """Drops the memmaps' files from this process and from the page cache;
  the fraction of a sample of their pages still cached afterwards."""
  from jax_data.file_rows import drop_pages
  from jax_data.file_rows import pages_resident
  cached = []
  for array in arrays:
    drop_pages(array)
    fd = os.open(array.filename, os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)
    rows = np.linspace(0, len(array) - 1, 64).astype(np.int64)
    base = array.ctypes.data
    cached += [pages_resident([base + r * array.strides[0]])
               for r in rows.tolist()]
  return float(np.mean(cached))


def disk_reads_per_second(path: str, reads: int, threads: int) -> float:
  """Random 4 KiB reads (``os.pread`` at page-aligned offsets) per second
  from a file just dropped from the page cache: the disk's own rate, where
  no memmap of this process maps its pages (:func:`evict` first)."""
  import concurrent.futures
  size = os.path.getsize(path)
  offsets = np.random.default_rng(threads).integers(
      0, size // 4096, reads) * 4096
  fd = os.open(path, os.O_RDONLY)
  try:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def part(chunk: np.ndarray) -> None:
      for offset in chunk.tolist():
        os.pread(fd, 4096, offset)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      list(pool.map(part, np.array_split(offsets, threads)))
    return reads / (time.perf_counter() - start)
  finally:
    os.close(fd)


def speed_child(request: dict[str, Any]) -> dict[str, Any]:
  """Times memmap against in-memory reads (warm) and cold reads."""
  import jax
  import jax.numpy as jnp
  from common import compare
  from common import paired_ratio
  from common import scan_contender
  from common import settle
  from models import data_only_scan_sampler
  from models import sgld_scan_sampler

  import jax_data

  config = Config(**request["config"])
  repeats = request["repeats"]
  rows = _rows(config)
  x = np.memmap(request["paths"]["x"], np.float32, "r",
                shape=(rows, config.features))
  y = np.memmap(request["paths"]["y"], np.float32, "r", shape=(rows,))
  theta = jnp.zeros(config.features, jnp.float32)

  warm = []

  def random_contender(name, loader, make, steps, n):
    init_fn, batch_fn, _ = jax_data.random_reference_data(
        loader, config.cache, config.mb)
    run = make(batch_fn, n, steps)
    return scan_contender(name, run, (theta, init_fn(seed=0),
                                      jax.random.PRNGKey(0)), steps)

  def sgld(batch_fn, n, steps):
    return sgld_scan_sampler(batch_fn, n, steps, 0.01 / n)

  def data_only(batch_fn, n, steps):
    del n
    return data_only_scan_sampler(batch_fn, steps)

  def pass_contender(name, loader):
    log_likelihood, _ = log_likelihood_pass(loader, config)
    return Contender(name, lambda: jax.block_until_ready(
        log_likelihood(theta)), 1)

  # Cold first, while no other mapping of the files (no worker process of
  # the source below) keeps their pages: dropped before each call.
  loader = jax_data.NumpyDataLoader(copy=False, x=x, y=y)
  init_fn, batch_fn, _ = jax_data.random_reference_data(
      loader, config.cache, config.mb)
  cold_run = data_only(batch_fn, rows, config.cold_steps)
  jax.block_until_ready(cold_run(theta, init_fn(seed=0),
                                 jax.random.PRNGKey(0)))  # compiled
  cold, cached = [], []
  for repeat in range(repeats):
    settle()  # the loader's read-ahead done: no page is being mapped
    cached.append(evict(x, y))
    start = time.perf_counter()
    # A new chain each time: a chain's chunks read ahead while the last
    # call settled came from pages still in memory (with a call of two
    # chunks, every chunk timed), a new one's from the evicted files.
    state = init_fn(seed=repeat + 1)
    jax.block_until_ready(cold_run(theta, state, jax.random.PRNGKey(0)))
    cold.append(config.cold_steps * config.mb / (time.perf_counter() - start))
  disk = {}
  for t in (1, 16):
    # The pages the last cold call mapped stay cached until this process
    # drops them (posix_fadvise alone leaves them): 32 % of a 256 MiB
    # file's, which made the disk's rate partly memory's.
    evict(x, y)
    disk[f"{t} thread{'s' if t > 1 else ''}"] = disk_reads_per_second(
        request["paths"]["x"], config.cold_reads, t)
  sizes = sorted({min(10 ** 6, rows), rows})
  for n in sizes:
    on_disk = {"x": x[:n], "y": y[:n]}
    in_memory = {k: np.array(v) for k, v in on_disk.items()}
    forms = {"memmap": jax_data.NumpyDataLoader(copy=False, **on_disk),
             "in memory": jax_data.NumpyDataLoader(copy=False, **in_memory),
             # The same again: how far two identical contenders differ.
             _AGAIN: jax_data.NumpyDataLoader(copy=False, **in_memory)}
    steps = config.speed_steps
    workloads = {
        f"data only, {steps:,} steps": functools.partial(
            random_contender, make=data_only, steps=steps, n=n),
        f"SGLD, {steps:,} steps": functools.partial(
            random_contender, make=sgld, steps=steps, n=n),
        "full-data pass": pass_contender}
    if n == sizes[0]:
      short = config.short_steps
      workloads[f"SGLD, {short:,} steps per call"] = functools.partial(
          random_contender, make=sgld, steps=short, n=n)
    for workload, make in workloads.items():
      timings = compare([make(k, v) for k, v in forms.items()], repeats)
      warm.append({"rows": n, "workload": workload, "form": "memmap",
                   "time": timings["memmap"].median,
                   "memory": timings["in memory"].median,
                   "ratio": paired_ratio(timings, "memmap", "in memory"),
                   "again": paired_ratio(timings, _AGAIN, "in memory")})
    if n == sizes[0]:
      warm += _other_files(config, request["directory"], on_disk, in_memory,
                           repeats, random_contender, sgld, n)
    del forms, in_memory

  return {"warm": warm, "cold": {
      "records": float(np.median(cold)), "cached": float(np.max(cached)),
      "disk": disk, "rows": rows}}


def _other_files(config, directory, on_disk, in_memory, repeats,
                 random_contender, sgld, n):
  """HDF5 and a random-access source, on disk against in memory."""
  from common import compare
  from common import paired_ratio

  import jax_data
  results = []
  forms = {}
  try:
    import h5py
  except ImportError:
    h5py = None
  if h5py is not None:
    path = os.path.join(directory, "xy.h5")
    with h5py.File(path, "w") as f:
      for key, value in in_memory.items():
        f[key] = value
    handle = h5py.File(path, "r")
    forms["HDF5 (h5py dataset)"] = (
        jax_data.NumpyDataLoader(copy=False, **{k: handle[k]
                                                for k in in_memory}),
        config.speed_steps)
  forms[_SOURCE_MEMMAP] = (
      jax_data.SourceDataLoader(Records(on_disk["x"], on_disk["y"])),
      config.source_steps)
  forms[_SOURCE_VIEW] = (
      jax_data.SourceDataLoader(Records(on_disk["x"].view(np.ndarray),
                                         on_disk["y"].view(np.ndarray))),
      config.source_steps)
  for name, (loader, steps) in forms.items():
    reference = (jax_data.NumpyDataLoader(copy=False, **in_memory)
                 if name.startswith("HDF5") else
                 jax_data.SourceDataLoader(Records(in_memory["x"],
                                                    in_memory["y"])))
    timings = compare([random_contender(name, loader, sgld, steps, n),
                       random_contender("in memory", reference, sgld, steps,
                                        n)], repeats)
    results.append({"rows": n, "workload": f"SGLD, {steps:,} steps",
                    "form": name, "time": timings[name].median,
                    "memory": timings["in memory"].median,
                    "ratio": paired_ratio(timings, name, "in memory")})
  return results


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] in ("--child", "--speed"):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main = child if sys.argv[1] == "--child" else speed_child
    print(json.dumps(main(json.loads(sys.argv[2]))))
  else:
    sys.exit("run benchmarks/run.py --only memmap; this file's main is the "
             "child process of that case")
