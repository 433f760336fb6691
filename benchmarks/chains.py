"""Case (g): many vmapped chains, SGLD for Bayesian logistic regression.

C chains of the same sampler as case (a) in one jitted ``jax.vmap``, each
call a ``lax.scan`` of ``steps`` steps:

* compute only: every chain reuses one fixed batch (no data access);
* device-resident: the data on the device, each chain's indices drawn with
  ``jax.random.randint`` and gathered inside the scan;
* device-resident, indices given: the same, each step's indices taken
  from a table drawn before the call (32 sets, in turn), not drawn: the
  gather and the compute alone, what device-resident would take if its
  draw cost nothing (a host loader on a CPU gathers the same rows in the
  same memory; it can move the draw beside compiled code, not the rows);
* jax_data: ``jax.vmap`` of ``jax_data.scan`` over the stacked states of
  ``init_fn(seed=range(C))`` (independent draws): with the default stream
  of a sequence of seeds, counter-based, whose chains a refresh draws and
  reads together, and with ``stream="exact"`` (the guide's streams, drawn
  chain by chain); counter chains in shuffled epochs (``shuffle=True,
  in_epochs=True``: what SG-MCMC users often run); and counter chains with
  ``cached_batches_count="auto"`` (caches sized for the chain count:
  1,000 batches for one chain here, 123 for 16, 7 at 256, 1 at 1,024);
  the last also over memmaps of the same arrays (``copy=False``, files
  written just before, so in the page cache: many chains over data kept
  out of the process's memory);
* compute over a cache: every chain scans over one fixed refresh of
  ``cache`` random batches on the device, again and again, as
  ``jax_data.scan`` scans its chunks (no host work: XLA slicing each
  step's batch out of the cache is what it adds to compute only);
* jax_data on the device: ``DeviceNumpyDataLoader`` (the data on the
  device, as for device-resident), each chain's counter-based stream drawn
  in the step (``init_fn(seed=range(C), stream="counter")``); not a host
  loader, so not in the targets' "best";
* gather floor: NumPy gathering the rows of one refresh (C x cache x mb
  random rows of x and y, fresh ones for every gather) into reused
  buffers, split over the usable cores, per step (a refresh serves
  ``cache`` steps);
* Datarax ``MemorySource`` (when installed, see ``datarax_peer.py``): each
  chain's shuffled epochs in Datarax's scan mode, a call one epoch of
  N // mb steps. An epoch starts with a permutation of N per chain (56 ms
  at N = 1e5 here), so it runs only where C x N is at most
  ``Config.datarax_work`` and is left out of larger rows.

A repeat waits until the process is idle (``common.settle``: no
contender's background work in another's calls), then calls each
contender twice: the second call, back to back with the first as a
sampler's loop calls, is the one timed for the columns and targets; the
first, after 50 ms or more of idle, is reported for the counter chains
(``after_idle``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import sys
from typing import Any

import numpy as np
from common import Records
from common import Section
from common import Target
from common import Timing
from common import format_bytes
from common import format_count
from common import format_ratio
from common import format_timing
from common import run_child

COMPUTE = "compute only"
DEVICE = "device-resident"
GIVEN = "device-resident, indices given"
JAX_DATA = "jax_data exact"
COUNTER = "jax_data counter"
EPOCHS = "jax_data counter, epochs"
AUTO = 'jax_data counter, cache "auto"'
MEMMAP = 'jax_data counter, cache "auto", memmap'
ON_DEVICE = "jax_data on the device"
FLOOR = "gather floor"
CACHED = "compute over a cache"
DATARAX = "Datarax MemorySource"


def after_idle(name: str) -> str:
  """The name of contender ``name``'s calls that follow the idle before
  each repeat (the other columns time the call after that one)."""
  return f"{name}, after idle"


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of case (g): (N, chains) per row."""
  rows: tuple[tuple[int, int], ...]
  features: int = 32
  mb: int = 64
  cache: int = 100
  steps: int = 2_000
  datarax_work: int = 110_000_000
  # Fresh processes the repeats of a row are spread over: the
  # device-resident sampler's step at 16 chains took 37-40 us in some
  # processes and 52-66 us in others alike, so a ratio to it taken in one
  # process is the luck of that process.
  processes: int = 3


FULL = Config(rows=tuple((n, c) for n in (100_000, 1_000_000)
                         for c in (1, 16, 256, 1024)))
SMOKE = Config(rows=((10_000, 4),), cache=10, steps=100, processes=1)


def run(config: Config, repeats: int) -> Section:
  """Measures every row in its own child processes: its times in up to
  ``config.processes`` fresh ones, the repeats spread over them."""
  results = []
  processes = min(config.processes, repeats)
  for n, chains in config.rows:
    request = {"n": n, "chains": chains,
               "repeats": -(-repeats // processes),
               **dataclasses.asdict(config)}
    del request["rows"]
    timing = _pooled([_child_run({**request, "what": "time"})
                      for _ in range(processes)])
    memory = _child_run({**request, "what": "memory"})
    print(f"  N={format_count(n)}, {chains} chains: " + ", ".join(
        f"{k} {v['median'] * 1e6:.1f} us" if "median" in v else
        f"{k} failed: {v['failed']}" for k, v in timing.items())
          + f"; peak RSS +{format_bytes(memory['peak'])}", flush=True)
    results.append((n, chains, timing, memory))
  return _section(config, results, processes)


def _child_run(request: dict[str, Any]) -> dict[str, Any]:
  return run_child(os.path.abspath(__file__), "--child", request)


def _pooled(timings: list[dict[str, Any]]) -> dict[str, Any]:
  """The timings of several processes as one: each contender's samples
  pooled, and kept per process (``"processes"``) for the ratios."""
  pooled = {}
  for name, first in timings[0].items():
    if "samples" not in first or any(
        "samples" not in t.get(name, {}) for t in timings):
      pooled[name] = next((t[name] for t in timings
                           if "failed" in t.get(name, {})), first)
      continue
    each = [t[name]["samples"] for t in timings]
    samples = [s for process in each for s in process]
    pooled[name] = {"samples": samples, "median": float(np.median(samples)),
                    "processes": each}
  return pooled


def _ratios(timing: dict[str, Any], a: str, b: str) -> list[float]:
  """Per process, the median of its per-repeat ratios a / b (the
  contenders of a repeat run one after another in the same process)."""
  return [float(np.median(np.asarray(x) / np.asarray(y)))
          for x, y in zip(timing[a]["processes"], timing[b]["processes"])]


def _ratio(timing: dict[str, Any], a: str, b: str) -> float:
  """The median over processes of :func:`_ratios`."""
  return float(np.median(_ratios(timing, a, b)))


def _spread(timing: dict[str, Any], a: str, b: str) -> str:
  """The median ratio a / b and, over several processes, its range."""
  ratios = _ratios(timing, a, b)
  if len(ratios) < 2:
    return format_ratio(ratios[0])
  return (f"{format_ratio(float(np.median(ratios)))} "
          f"({min(ratios):.2f}-{max(ratios):.2f})")


def _section(config: Config, results: list, processes: int) -> Section:
  rows, device_ok, compute_ok, memory_ok, bests = [], [], [], [], []
  auto_ok = []
  for n, chains, timing, memory in results:
    timings = {k: Timing(tuple(v["samples"]), 1) for k, v in timing.items()
               if "samples" in v}
    floor = timing[COMPUTE]["median"] + timing[FLOOR]["median"]
    cached_floor = timing[CACHED]["median"] + timing[FLOOR]["median"]
    best = min(_ratio(timing, JAX_DATA, COMPUTE),
               _ratio(timing, COUNTER, COMPUTE))
    fastest = min(timing[JAX_DATA]["median"], timing[COUNTER]["median"])
    datarax, datarax_ratio = timing.get(DATARAX, {}).get("failed",
                                                         "not run"), ""
    if "samples" in timing.get(DATARAX, {}):
      datarax = format_timing(Timing(tuple(timing[DATARAX]["samples"]), 1),
                              "us")
      datarax_ratio = format_ratio(timing[DATARAX]["median"] / fastest)
    nearest = min((JAX_DATA, COUNTER),
                  key=lambda name: _ratio(timing, name, DEVICE))
    to_device = _ratio(timing, nearest, DEVICE)
    rows.append([
        format_count(n), str(chains),
        *(format_timing(timings[k], "us")
          for k in (COMPUTE, CACHED, DEVICE, JAX_DATA, COUNTER, FLOOR)),
        format_ratio(_ratio(timing, JAX_DATA, COMPUTE)),
        format_ratio(_ratio(timing, COUNTER, COMPUTE)),
        _spread(timing, nearest, DEVICE), format_ratio(fastest / floor),
        format_ratio(fastest / cached_floor),
        format_bytes(memory["peak"]), format_bytes(memory["caches"]),
        datarax, datarax_ratio, format_timing(timings[EPOCHS], "us"),
        _spread(timing, EPOCHS, DEVICE),
        format_timing(timings[AUTO], "us"),
        _spread(timing, AUTO, DEVICE),
        format_timing(timings[ON_DEVICE], "us"),
        _spread(timing, ON_DEVICE, DEVICE),
        format_timing(timings[after_idle(COUNTER)], "us"),
        _spread(timing, after_idle(COUNTER), after_idle(COMPUTE)),
        _spread(timing, after_idle(COUNTER), after_idle(DEVICE)),
        format_timing(timings[MEMMAP], "us"), _spread(timing, MEMMAP, AUTO),
        _spread(timing, MEMMAP, DEVICE),
        format_timing(timings[GIVEN], "us"), _spread(timing, GIVEN, DEVICE)])
    floor_bound = timing[FLOOR]["median"] > timing[COMPUTE]["median"]
    bests.append(f"{chains}: {format_ratio(best)}" + (
        f" ({format_ratio(fastest / floor)} of compute + floor)"
        if floor_bound else ""))
    device_ok.append(to_device <= 0.8)
    auto_ok.append(_ratio(timing, AUTO, DEVICE) <= 0.8)
    limit = 2.0 if chains <= 16 else 4.0
    compute_ok.append(best <= limit or (floor_bound
                                        and fastest / floor <= 1.3))
    memory_ok.append(memory["peak"] <= 2 * memory["caches"] + (256 << 20))
  full = config is FULL
  return Section(
      key="chains",
      title="(g) Many vmapped chains: SGLD, logistic regression",
      description=(
          f"C chains of case (a)'s SGLD sampler (D={config.features}, "
          f"mb={config.mb}, cache={config.cache}) in one jitted jax.vmap, "
          f"{config.steps:,} steps per call; times per step of all C "
          "chains, medians over the repeats, which run in "
          f"{processes} fresh process(es), as many in each. A ratio is "
          "the median over the processes of each one's median per-repeat "
          "ratio (a repeat runs the contenders one after another), with "
          "its range over the processes in parentheses. "
          "'jax_data counter' is "
          "init_fn(seed=range(C)) (independent draws; a sequence of seeds "
          "draws counter-based streams by default), 'jax_data exact' the "
          "same with stream='exact' (the guide's streams, chain by chain); "
          "'gather floor' is NumPy gathering one refresh's rows (fresh "
          "random ones each time) into reused buffers over the usable "
          "cores, per step; 'compute over "
          "a cache' scans each chain over one fixed refresh of random "
          "batches on the device, as jax_data.scan scans its chunks, with "
          f"no host work; '{GIVEN}' is device-resident with each step's "
          "indices taken from a table drawn before the call (no draw in "
          "the loop). Peak RSS: "
          "jax_data with counter streams in a fresh process, VmHWM above "
          "the resident set before the chains were made (the loader, with "
          "its copy of the data, made before); caches: the "
          "device caches' bytes (C x cache x mb observations and masks). "
          f"{DATARAX}: Datarax 0.1.4, each chain's shuffled epochs in its "
          "scan mode, a call one epoch of N // mb steps (a permutation of N "
          "per chain and epoch); not run where C x N is over "
          f"{config.datarax_work:,}; its ratio is to the faster jax_data "
          f"column. {EPOCHS}: counter chains in shuffled epochs "
          f"(shuffle=True, in_epochs=True); {AUTO}: counter chains with "
          "cached_batches_count='auto' (caches sized for C; its ratio to "
          "device-resident has a target of its own); "
          f"{ON_DEVICE}: DeviceNumpyDataLoader (the data on the device), "
          "each chain's counter-based stream drawn in the step "
          "(init_fn(seed=range(C), stream='counter')); "
          f"{MEMMAP}: {AUTO} over memmaps of the same arrays "
          "(copy=False, the files written just before: in the page "
          "cache). None of the four "
          "is in the targets' 'best'. Each repeat waits until the process "
          "is idle (50 ms or more), then times two calls of each "
          "contender: the columns above and the targets are the second, "
          "back to back with the first, as a sampler's loop calls; "
          f"'{after_idle(COUNTER)}' and its ratios are the first (a "
          "call after 50 ms of idle, which costs data-reading loops "
          "more on shared machines)."),
      headers=["N", "C", COMPUTE, CACHED, DEVICE, JAX_DATA, COUNTER, FLOOR,
               "exact / compute", "counter / compute",
               "best / device", "best / (compute + floor)",
               "best / (cached + floor)", "peak RSS",
               "device caches", DATARAX, "Datarax / best jax_data",
               EPOCHS, "epochs / device", AUTO, "auto / device",
               ON_DEVICE, "on the device / device", after_idle(COUNTER),
               "after idle: counter / compute",
               "after idle: counter / device", MEMMAP,
               "memmap / in memory", "memmap / device", GIVEN,
               "given / device"],
      rows=rows,
      targets=[
          Target("(g) jax_data / device-resident, every C", "<= 0.8x",
                 ", ".join(r[10] for r in rows),
                 all(device_ok) if full else None),
          Target("(g) jax_data / compute only (C <= 16 / C >= 256), or, "
                 "where the gather floor is larger than compute only, "
                 "within 1.3x of compute + floor",
                 "<= 2x / <= 4x, or <= 1.3x",
                 ", ".join(bests),
                 all(compute_ok) if full else None),
          Target("(g) jax_data counter, cache 'auto' / device-resident, "
                 "every C", "<= 0.8x", ", ".join(r[20] for r in rows),
                 all(auto_ok) if full else None),
          Target("(g) peak RSS above baseline", "<= 2 x caches + 256 MiB",
                 ", ".join(r[13] for r in rows),
                 all(memory_ok) if full else None),
          Target("(g) best jax_data / (compute over a cache + gather "
                 "floor): what any scan over a host-filled cache pays",
                 "reported, no target", ", ".join(
                     f"{r[0]}, {r[1]}: {r[12]}" for r in rows), None),
          Target("(g) jax_data counter, cache 'auto', over memmaps in the "
                 "page cache / over the arrays in memory", "reported, no "
                 "target", ", ".join(f"{r[0]}, {r[1]}: {r[-4]}"
                                     for r in rows), None),
          Target("(g) device-resident, indices given / device-resident: "
                 "its gather and compute without the draw, the rows a host "
                 "loader on a CPU moves in the same memory",
                 "reported, no target", ", ".join(
                     f"{r[0]}, {r[1]}: {r[-1]}" for r in rows), None),
      ])


# -- child process -------------------------------------------------------


def _rss(field: str = "VmRSS") -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  return 0


def _samplers(request: dict[str, Any], data: dict[str, np.ndarray]):
  import jax
  import jax.numpy as jnp
  from models import device_batch_fn
  from models import sgld_update

  n, chains, steps = request["n"], request["chains"], request["steps"]
  step_size = 1e-5

  def vmapped(run_one):
    return jax.jit(jax.vmap(run_one))

  def scan_fixed(theta, batch, key):
    def step(carry, _):
      theta, key = carry
      return sgld_update(theta, key, batch, n, step_size), None
    (theta, key), _ = jax.lax.scan(step, (theta, key), None, length=steps)
    return theta, batch, key

  arrays = {k: jnp.asarray(v) for k, v in data.items()}
  device_fn = device_batch_fn(arrays, request["mb"])

  def scan_device(theta, data_key, key):
    def step(carry, _):
      theta, data_key, key = carry
      data_key, batch = device_fn(data_key)
      theta, key = sgld_update(theta, key, batch, n, step_size)
      return (theta, data_key, key), None
    carry, _ = jax.lax.scan(step, (theta, data_key, key), None, length=steps)
    return carry

  def scan_given(theta, table, key):
    def step(carry, i):
      theta, key = carry
      rows = table[i % table.shape[0]]
      batch = {k: jnp.take(a, rows, axis=0) for k, a in arrays.items()}
      return sgld_update(theta, key, batch, n, step_size), None
    (theta, key), _ = jax.lax.scan(step, (theta, key), jnp.arange(steps))
    return theta, table, key

  cache = request["cache"]

  def scan_cached(theta, chunk, key):
    # The chains' steps vmapped inside the loops, so that the cache stays
    # lane axis second: a vmap of the loops would carry it lane axis
    # first and transpose it for the scan on every pass.
    step = jax.vmap(lambda theta, key, batch: sgld_update(
        theta, key, batch, n, step_size))

    def over(_, carry):
      carry, _ = jax.lax.scan(lambda c, b: (step(*c, b), None), carry,
                              chunk)
      return carry

    theta, key = jax.lax.fori_loop(0, steps // cache, over, (theta, key))
    return theta, chunk, key

  theta = jnp.zeros((chains, request["features"]), jnp.float32)
  keys = jax.random.split(jax.random.key(0), chains)
  fixed = {k: jnp.broadcast_to(v[:request["mb"]], (chains,) + v[
      :request["mb"]].shape) for k, v in arrays.items()}
  # One refresh's random rows per chain, on the device, lane axis second
  # as jax_data.scan's chunks are.
  rows = jax.random.randint(jax.random.key(3), (cache, chains,
                                                request["mb"]), 0, n)
  chunk = {k: v[rows] for k, v in arrays.items()}
  return {
      COMPUTE: (vmapped(scan_fixed), (theta, fixed, keys)),
      CACHED: (jax.jit(scan_cached), (theta, chunk, keys)),
      DEVICE: (vmapped(scan_device),
               (theta, jax.random.split(jax.random.key(1), chains), keys)),
      GIVEN: (vmapped(scan_given), (theta, jax.random.randint(
          jax.random.key(4), (chains, 32, request["mb"]), 0, n), keys)),
  }, theta, keys, step_size


def _jax_data(request, data, theta, keys, step_size, stream, loader=None,
              **init):
  import jax
  from models import sgld_update

  import jax_data

  n = request["n"]
  if loader is None:
    loader = jax_data.NumpyDataLoader(**data)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, request["cache"], request["mb"])

  def step(carry, batch):
    theta, key = carry
    return sgld_update(theta, key, batch, n, step_size), None

  def one(theta, state, key):
    ((theta, key), state), _ = jax_data.scan(
        step, (theta, key), state, batch_fn=batch_fn,
        length=request["steps"])
    return theta, state, key

  # The many-chain form the docs give: the chains' states made stacked,
  # and donated, so a call's returned states take the given ones' buffers.
  if stream is not None:
    init = {**init, "stream": stream}
  states = init_fn(seed=range(request["chains"]), **init)
  return (jax.jit(jax.vmap(one), donate_argnums=1), (theta, states, keys),
          release_fn)


def _datarax_runs(request) -> bool:
  import datarax_peer
  return (datarax_peer.available()
          and request["chains"] * request["n"] <= request["datarax_work"])


def _datarax(request, data, theta, keys, step_size):
  """Datarax's MemorySource chains, vmapped (the source's state, the data,
  shared): ``((run, carry), steps)``, a call one epoch."""
  import functools

  import datarax_peer
  import jax
  from models import sgld_update

  n, mb = request["n"], request["mb"]
  update = functools.partial(sgld_update, observation_count=n,
                             step_size=step_size)
  batch_at, source_state = datarax_peer.memory_batches(data, mb)
  data_keys = jax.random.split(jax.random.key(2), request["chains"])
  run_fn = jax.jit(jax.vmap(
      datarax_peer.memory_sampler(batch_at, n, mb, 1, update),
      in_axes=(0, None, 0, 0), out_axes=(0, None, 0, 0)))
  return (run_fn, (theta, source_state, data_keys, keys)), n // mb


def _floor(request, data):
  """Seconds per step of gathering a refresh's rows into reused buffers."""
  import time

  rows = request["chains"] * request["cache"] * request["mb"]
  rng = np.random.default_rng(0)
  outs = {k: np.empty((rows,) + v.shape[1:], v.dtype)
          for k, v in data.items()}
  cores = max(1, len(os.sched_getaffinity(0)))
  parts = np.array_split(np.arange(rows), min(cores, max(1, rows // 8192)))
  pool = concurrent.futures.ThreadPoolExecutor(cores)

  def gather(part, indices):
    # mode="clip": no bounds checks (the indices are in range), as the
    # loaders gather; NumPy's default checks took 2.4x as long here.
    for k, v in data.items():
      np.take(v, indices[part[0]:part[-1] + 1], axis=0,
              out=outs[k][part[0]:part[-1] + 1], mode="clip")

  def once(indices):
    list(pool.map(gather, parts, [indices] * len(parts)))

  # Fresh rows for every gather, drawn before it, as every refresh reads
  # rows it has not just read. The same rows again were found in the
  # processor's caches, most where a refresh is small: one chain, 1.6
  # against 3.3 us a step at N = 1e6; 1,024 chains of one batch, 722
  # against 1,136 us (2 cores, 2026-11-30).
  once(rng.integers(0, request["n"], rows))
  best = []
  for _ in range(5):
    indices = rng.integers(0, request["n"], rows)
    start = time.perf_counter()
    once(indices)
    best.append(time.perf_counter() - start)
  pool.shutdown()
  return float(np.median(best)) / request["cache"]


def child(request: dict[str, Any]) -> dict[str, Any]:
  import jax
  from common import settle
  from models import logistic_data

  data = logistic_data(request["n"], request["features"])
  if request["what"] == "memory":
    import jax.numpy as jnp

    import jax_data

    theta = jnp.zeros((request["chains"], request["features"]))
    keys = jax.random.split(jax.random.key(0), request["chains"])
    jax.block_until_ready(theta)
    # The loader's copy of the data (NumpyDataLoader's default copy=True)
    # is in the baseline: it does not grow with the chains.
    stream = "counter"
    if request.get("loader") == "source":
      loader = jax_data.SourceDataLoader(Records(data["x"], data["y"]))
    elif request.get("loader") == "tensorflow":
      import tensorflow as tf
      # Streamed: the pipeline read pass after pass, through its own
      # shuffle buffer (its only random stream).
      loader = jax_data.TensorflowDataLoader(
          tf.data.Dataset.from_tensor_slices(data),
          shuffle_cache=request.get("shuffle_cache", 100),
          share_reads=request.get("share_reads", True),
          in_memory=request.get("in_memory", False))
      stream = request.get("stream")
    else:
      loader = jax_data.NumpyDataLoader(**data)
    before = _rss()
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # resets VmHWM to the current resident set
    run_fn, carry, release_fn = _jax_data(request, data, theta, keys, 1e-5,
                                          stream, loader)
    import time
    calls = []
    for _ in range(request.get("calls", 3)):
      start = time.perf_counter()
      carry = jax.block_until_ready(run_fn(*carry))
      calls.append((time.perf_counter() - start) / request["steps"])
    peak = _rss("VmHWM") - before
    threads = len(os.listdir("/proc/self/task"))
    release_fn()
    caches = request["chains"] * request["cache"] * request["mb"] * (
        4 * (request["features"] + 1) + 1)
    # The first call compiles.
    measured = {"peak": peak, "caches": caches, "threads": threads,
                "step": float(np.median(calls[1:] or calls))}
    if request.get("references"):  # after the peak: their own memory
      contenders = _samplers(request, data)[0]
      for name in (COMPUTE, DEVICE):
        run_fn, carry = contenders[name]
        times = []
        for _ in range(request.get("calls", 3)):
          start = time.perf_counter()
          carry = jax.block_until_ready(run_fn(*carry))
          times.append((time.perf_counter() - start) / request["steps"])
        measured[name] = float(np.median(times[1:] or times))
    return measured
  import time

  contenders, theta, keys, step_size = _samplers(request, data)
  steps = dict.fromkeys(contenders, request["steps"])
  failed, carries = {}, {}
  if _datarax_runs(request):
    try:
      (run_fn, carry), steps[DATARAX] = _datarax(request, data, theta, keys,
                                                 step_size)
      contenders[DATARAX] = run_fn, carry
      # Compiled, and seen to run (an epoch of many chains takes long).
      carries[DATARAX] = jax.block_until_ready(run_fn(*carry))
    except jax.errors.JaxRuntimeError as e:  # XLA's out of memory
      contenders.pop(DATARAX, None)
      failed[DATARAX] = str(e).splitlines()[0][:120]
  releases = []
  auto = {**request, "cache": "auto"}
  import tempfile

  import jax_data
  files = tempfile.TemporaryDirectory()
  mapped = {}
  for key, array in data.items():
    np.save(os.path.join(files.name, f"{key}.npy"), array)
    mapped[key] = np.load(os.path.join(files.name, f"{key}.npy"),
                          mmap_mode="r")
  for name, stream, init, asked, loader in (
      (JAX_DATA, "exact", {}, request, None),
      (COUNTER, "auto", {}, request, None),
      (EPOCHS, "counter", {"shuffle": True, "in_epochs": True}, request,
       None),
      (AUTO, "counter", {}, auto, None),
      (ON_DEVICE, "counter", {}, request,
       jax_data.DeviceNumpyDataLoader(**data)),
      (MEMMAP, "counter", {}, auto,
       jax_data.NumpyDataLoader(copy=False, **mapped))):
    run_fn, carry, release_fn = _jax_data(asked, data, theta, keys,
                                          step_size, stream, loader, **init)
    contenders[name] = (run_fn, carry)
    steps[name] = request["steps"]
    releases.append(release_fn)
  for name, (run_fn, carry) in contenders.items():
    if name not in carries:
      carries[name] = jax.block_until_ready(run_fn(*carry))  # compile
  samples = {name: [] for name in contenders}
  idle = {after_idle(name): [] for name in contenders}
  for _ in range(request["repeats"]):
    for name, (run_fn, _) in contenders.items():
      # Idle first, so that no contender's background work falls in
      # another's calls; then two calls: the first after the idle, the
      # second back to back, as a sampler's loop calls (the one the
      # columns and targets use). After 50 ms of idle this machine ran one
      # chain's 2,000-step calls in 20-29 ms against 12-15 ms back to back
      # (device-resident 37 against 30 ms, compute only 10.7 against 9.8).
      settle()
      for kept in (idle[after_idle(name)], samples[name]):
        start = time.perf_counter()
        carries[name] = jax.block_until_ready(run_fn(*carries[name]))
        kept.append((time.perf_counter() - start) / steps[name])
  samples.update(idle)
  floor = _floor(request, data)
  samples[FLOOR] = [floor] * request["repeats"]
  for release_fn in releases:
    release_fn()
  files.cleanup()
  return {**{name: {"samples": s, "median": float(np.median(s))}
             for name, s in samples.items()},
          **{name: {"failed": why} for name, why in failed.items()}}


def source_memory(n: int = 100_000, chains: int = 1024,
                  caches: tuple[int, ...] = (10, 100), calls: int = 2
                  ) -> list[dict[str, Any]]:
  """Point 2 of the many-chains targets for a ``SourceDataLoader`` (a
  Python ``__getitem__`` per record): peak RSS above the start of
  ``chains`` counter chains over ``n`` records, ``calls`` calls of at
  least 10 refreshes and 500 steps each, against twice the caches plus
  256 MiB, per cache size.
  Printed as a table (``python chains.py --source-memory``)."""
  rows = []
  for cache in caches:
    request = {**dataclasses.asdict(FULL), "n": n, "chains": chains,
               "cache": cache, "steps": max(500, 10 * cache), "calls": calls,
               "what": "memory", "loader": "source"}
    del request["rows"]
    memory = _child_run(request)
    bound = 2 * memory["caches"] + (256 << 20)
    rows.append({"cache": cache, **memory, "bound": bound})
    print(f"| {chains} | {cache} | +{format_bytes(memory['peak'])} | "
          f"{format_bytes(bound)} | "
          f"{'yes' if memory['peak'] <= bound else 'no'} |", flush=True)
  return rows


def streamed_chains(n: int = 100_000, chains: tuple[int, ...] = (16, 256,
                                                                  1024),
                    calls: int = 5) -> list[dict[str, Any]]:
  """Many random chains of a ``TensorflowDataLoader`` (``from_tensor_slices``
  of the case's data; caches of 10 batches of 64): streamed (the pipeline
  read pass after pass) through one shared iterator and, with
  ``share_reads=False``, one each, and held in memory (through the
  shuffle buffer, and with ``stream="counter"``), with
  ``shuffle_cache=100``; and streamed, shared, with
  ``shuffle_cache=10_000`` from 256 chains. Threads, time a step (median
  of the calls after the first, of 100 steps; of two, one that a full
  garbage collection of the process's objects fell in, 60-200 ms with
  TensorFlow imported, was half the median) against compute only and
  device-resident data in the same process, and peak RSS above the start
  against twice the caches plus 256 MiB, each in a fresh process.
  Printed as a table (``python chains.py --streamed``)."""
  rows = []
  reads = {"shared": {"share_reads": True}, "own": {"share_reads": False},
           "in memory": {"in_memory": True},
           "in memory, counter": {"in_memory": True, "stream": "counter"}}
  cases = [(count, how, 100) for count in chains for how in reads]
  cases += [(count, "shared", 10_000) for count in chains if count >= 256]
  for count, how, slots in cases:
    request = {**dataclasses.asdict(FULL), "n": n, "chains": count,
               "cache": 10, "steps": 100, "calls": calls,
               "what": "memory", "loader": "tensorflow", **reads[how],
               "shuffle_cache": slots, "references": True}
    del request["rows"]
    memory = _child_run(request)
    bound = 2 * memory["caches"] + (256 << 20)
    rows.append({"chains": count, "reads": how, "shuffle_cache": slots,
                 **memory, "bound": bound})
    print(f"| {count} | {how} | {slots:,} | {memory['threads']} | "
          f"{memory['step'] * 1e3:.2f} ms | "
          f"{memory[COMPUTE] * 1e3:.2f} ms | {memory[DEVICE] * 1e3:.2f} ms "
          f"| {memory['step'] / memory[COMPUTE]:.2f}x | "
          f"{memory['step'] / memory[DEVICE]:.2f}x | "
          f"+{format_bytes(memory['peak'])} | {format_bytes(bound)} | "
          f"{'yes' if memory['peak'] <= bound else 'no'} |", flush=True)
  return rows


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--child":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(child(json.loads(sys.argv[2]))))
  elif sys.argv[1:] == ["--source-memory"]:
    print("| chains | cache | peak RSS above the start | bound | holds |\n"
          "|---|---|---|---|---|")
    source_memory()
  elif sys.argv[1:] == ["--streamed"]:
    print("| chains | reads | shuffle_cache | threads | a step | compute "
          "only | device-resident | / compute only | / device-resident | "
          "peak RSS above the start | bound | holds |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    streamed_chains()
