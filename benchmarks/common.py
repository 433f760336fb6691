"""Timing, reporting and environment helpers shared by the benchmark cases.

Every case builds a few *contenders* (ways of running the same workload:
data on the device, jax_data, jax-sgmc, a Python loop), warms each of them
up (compiles), and then times them round-robin: repeat ``r`` times every
contender once before repeat ``r + 1`` starts. On a shared, noisy machine
this keeps the contenders of one ratio under the same conditions; ratios
are medians of the per-repeat (paired) ratios. Between two measurements
the process waits until its threads are idle (:func:`settle`): a tf.data
iterator refills its prefetch buffer after its contender stopped asking,
and that work must not be timed as part of the next contender.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence

import jax
import numpy as np
import psutil

# Column names, used by every case.
DEVICE = "device-resident"
JAX_DATA = "jax_data"
JAX_SGMC = "jax-sgmc 0.1.5"
PYTHON_LOOP = "Python loop"


@dataclasses.dataclass
class Contender:
  """One way of running a workload.

  Attributes:
    name: Column name, e.g. :data:`JAX_DATA`.
    run: Runs one measurement and blocks until its results are ready.
    units: Work units (steps, passes, images) one call of ``run`` does.
  """
  name: str
  run: Callable[[], None]
  units: int


def scan_contender(name: str, run: Callable, carry: tuple, units: int
                   ) -> Contender:
  """A contender that continues a jitted scan from its last carry."""
  holder = [carry]

  def once():
    holder[0] = jax.block_until_ready(run(*holder[0]))

  return Contender(name, once, units)


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds per work unit, one sample per repeat.

  Attributes:
    samples: Seconds per unit of each repeat, in the order measured.
    units: Work units per measurement.
  """
  samples: tuple
  units: int

  @property
  def median(self) -> float:
    return statistics.median(self.samples)

  @property
  def spread(self) -> float:
    """Half the range of the samples, relative to their median."""
    return (max(self.samples) - min(self.samples)) / 2 / self.median


def settle(window: float = 0.05, timeout: float = 5.0) -> None:
  """Waits until the process's threads are idle: less than a tenth of a
  core used over ``window`` seconds (background work a contender left:
  tf.data prefetching, a loader's read-ahead), at most ``timeout`` s."""
  deadline = time.perf_counter() + timeout
  while time.perf_counter() < deadline:
    cpu = time.process_time()
    time.sleep(window)
    if time.process_time() - cpu < 0.1 * window:
      return


def measure(contenders: Sequence[Contender], repeats: int,
            warm_up: bool = True, lead_in: bool = True) -> list[Timing]:
  """Times contenders round-robin after one warm-up call each.

  Args:
    contenders: The ways of running the workload.
    repeats: Measurements per contender.
    warm_up: Call every ``run`` once, untimed, before measuring (compiles
      and fills caches and prefetch queues).
    lead_in: Before each measurement, after the process is idle
      (:func:`settle`), call ``run`` once untimed, so that the timed call
      comes back to back with another, as a sampler's loop calls. After
      50 ms of idle this machine ran one chain's 2,000 SGLD steps in
      20-29 ms against 12-15 ms back to back (data on the device: 37
      against 30 ms); loops that read data lose the most.

  Returns:
    Timing of each contender, in their order.
  """
  if warm_up:
    for contender in contenders:
      contender.run()
  samples: list[list[float]] = [[] for _ in contenders]
  for _ in range(repeats):
    for contender, times in zip(contenders, samples):
      settle()
      if lead_in:
        contender.run()
      start = time.perf_counter()
      contender.run()
      times.append((time.perf_counter() - start) / contender.units)
  return [Timing(tuple(times), c.units)
          for c, times in zip(contenders, samples)]


def compare(contenders: Sequence[Contender], repeats: int,
            warm_up: bool = True) -> dict[str, Timing]:
  """:func:`measure`, keyed by contender name (names must differ)."""
  names = [c.name for c in contenders]
  if len(set(names)) != len(names):
    raise ValueError(f"contender names must differ, got {names}")
  return dict(zip(names, measure(contenders, repeats, warm_up)))


def paired_ratio(timings: dict[str, Timing], numerator: str,
                 denominator: str) -> float | None:
  """Median over repeats of ``numerator / denominator`` (None if missing)."""
  if numerator not in timings or denominator not in timings:
    return None
  ratios = [a / b for a, b in zip(timings[numerator].samples,
                                  timings[denominator].samples)]
  return statistics.median(ratios)


def calibrate(seconds_per_unit: float, min_seconds: float, quantum: int,
              maximum: int) -> int:
  """Work units that take at least ``min_seconds``, rounded up to a multiple
  of ``quantum`` (e.g. whole cache refreshes), between ``quantum`` and
  ``maximum``."""
  wanted = min_seconds / max(seconds_per_unit, 1e-12)
  units = quantum * int(np.ceil(wanted / quantum))
  return int(min(max(units, quantum), maximum))


def timed(fn: Callable[[], None]) -> float:
  """Seconds one call of ``fn`` takes."""
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def run_child(script: str, flag: str, request: dict,
              one_device: bool = True) -> dict:
  """Runs ``script flag <request as JSON>`` in a fresh Python process (a
  measurement of memory, or of a first call, that nothing before may
  disturb) and returns the JSON object on the last line it printed.

  Args:
    script: The benchmark file, which handles ``flag``.
    flag: Its command-line switch, e.g. ``"--child"``.
    request: What to measure, passed as JSON.
    one_device: Drop ``XLA_FLAGS`` (the tests' several virtual devices):
      the benchmarks measure one device.

  Raises:
    RuntimeError: the process failed; the message ends with its stderr.
  """
  env = dict(os.environ)
  if one_device:
    env.pop("XLA_FLAGS", None)
  done = subprocess.run([sys.executable, script, flag, json.dumps(request)],
                        capture_output=True, text=True, check=False, env=env)
  if done.returncode != 0:
    raise RuntimeError(
        f"{os.path.basename(script)} {flag} failed ({done.returncode}):\n"
        f"{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


# -- reporting -----------------------------------------------------------


@dataclasses.dataclass
class Target:
  """An acceptance target and whether one run met it.

  Attributes:
    name: What is compared, e.g. "(a) jax_data / device-resident, every N".
    limit: The bound, e.g. "<= 1.5x".
    measured: The measured value(s), formatted.
    holds: True or False; None when the run used other sizes than the ones
      the target is stated for (a smoke run).
  """
  name: str
  limit: str
  measured: str
  holds: bool | None

  @property
  def verdict(self) -> str:
    return {True: "yes", False: "**no**", None: "not evaluated"}[self.holds]


@dataclasses.dataclass
class Section:
  """One case's results, printed and written to the Markdown report.

  Attributes:
    key: Short name used by ``--only``.
    title: Heading.
    description: What was measured and how, one paragraph.
    headers: Column headers of the results table.
    rows: Cells of the results table.
    notes: Remarks printed below the table.
    targets: Acceptance targets this case checks.
    memory: Rows of the device-memory table (pipeline, formula, bytes).
    tables: Further tables, printed after the notes: (paragraph before
      it, headers, rows, notes below it) each.
  """
  key: str
  title: str
  description: str
  headers: list[str]
  rows: list[list[str]]
  notes: list[str] = dataclasses.field(default_factory=list)
  targets: list[Target] = dataclasses.field(default_factory=list)
  memory: list[list[str]] = dataclasses.field(default_factory=list)
  tables: list[tuple[str, list[str], list[list[str]], list[str]]] = (
      dataclasses.field(default_factory=list))

  def markdown(self) -> str:
    parts = [f"### {self.title}", "", self.description, "",
             markdown_table(self.headers, self.rows)]
    if self.notes:
      parts += [""] + [f"- {note}" for note in self.notes]
    for before, headers, rows, notes in self.tables:
      parts += ["", before, "", markdown_table(headers, rows)]
      if notes:
        parts += [""] + [f"- {note}" for note in notes]
    return "\n".join(parts)


MEMORY_HEADERS = ["pipeline", "cache x batch x observation",
                  "device cache", "dataset"]


class Records:
  """A random-access source (``__len__``, ``__getitem__``) of records
  ``{"x": x[i], "y": y[i]}``, over a memmap or an array alike."""

  def __init__(self, x: np.ndarray, y: np.ndarray):
    self._x, self._y = x, y

  def __len__(self) -> int:
    return len(self._x)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return {"x": np.asarray(self._x[i]), "y": np.asarray(self._y[i])}


def memory_row(name: str, cache: int, mb: int, observation_bytes: int,
               observation_count: int) -> list[str]:
  """A row of the device-memory table: what a pipeline keeps on the device
  (``cache * mb * observation_bytes``, plus a one-byte mask per
  observation) next to the dataset that a device-resident loader holds."""
  cache_bytes = cache * mb * (observation_bytes + 1)
  return [name, f"{cache} x {mb} x ({observation_bytes} + 1 mask) B",
          format_bytes(cache_bytes),
          format_bytes(observation_count * observation_bytes)]


def observation_bytes(arrays: dict[str, np.ndarray]) -> int:
  """Bytes of one observation of a dict of arrays (first axis: N)."""
  return int(sum(a.dtype.itemsize * int(np.prod(a.shape[1:]))
                 for a in arrays.values()))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]
                   ) -> str:
  """A GitHub Markdown table; columns padded for the terminal."""
  cells = [list(headers)] + [list(map(str, row)) for row in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
           for row in cells]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  return "\n".join(lines)


def format_time(seconds: float, unit: str) -> str:
  """Seconds in ``unit`` ("us", "ms" or "s"), three significant digits
  below 1000, whole numbers above."""
  scale = {"us": 1e6, "ms": 1e3, "s": 1.0}[unit]
  label = {"us": "µs", "ms": "ms", "s": "s"}[unit]
  return f"{_significant(seconds * scale)} {label}"


def format_timing(timing: Timing | None, unit: str) -> str:
  """Median time per unit and the half-range of the repeats."""
  if timing is None:
    return "–"
  return f"{format_time(timing.median, unit)} ±{timing.spread:.0%}"


def format_ratio(ratio: float | None) -> str:
  return "–" if ratio is None else f"{ratio:.2f}x"


def format_bytes(count: float) -> str:
  for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if abs(count) >= size:
      return f"{_significant(count / size)} {unit}"
  return f"{int(count)} B"


def _significant(value: float) -> str:
  """Three significant digits, whole numbers from 1,000 on (".3g" alone
  wrote 999.7 and 1,020 as "1e+03" and "1.02e+03")."""
  return f"{value:,.0f}" if abs(value) >= 999.5 else f"{value:.3g}"


def format_count(n: int) -> str:
  """1e4-style for powers of ten, else with thousands separators."""
  exponent = round(float(np.log10(n))) if n > 0 else 0
  if 10 ** exponent == n and exponent >= 4:
    return f"1e{exponent}"
  return f"{n:,}"


# -- environment ---------------------------------------------------------


def _version(distribution: str) -> str:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def cpu_model() -> str:
  """The CPU's model name, family and model from /proc/cpuinfo (and whether
  it is a virtual machine), else what ``platform`` knows."""
  fields: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
  except OSError:
    return platform.processor() or platform.machine()
  name = fields.get("model name", platform.machine())
  details = [f"family {fields[k]}" if k == "cpu family" else
             f"model {fields[k]}" for k in ("cpu family", "model")
             if k in fields]
  if "hypervisor" in fields.get("flags", "").split():
    details.append("virtual machine")
  return f"{name} ({', '.join(details)})" if details else name


def jax_data_commit() -> str:
  """The git commit of the jax_data that runs, if it is a checkout."""
  import jax_data

  root = os.path.dirname(os.path.dirname(os.path.abspath(jax_data.__file__)))

  def git(*args: str) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True,
                          text=True, timeout=10, check=True).stdout.strip()

  try:
    commit = git("rev-parse", "--short", "HEAD")
    changed = git("status", "--porcelain", "--", "jax_data")
  except (OSError, subprocess.SubprocessError):
    return "unknown (not a git checkout)"
  return commit + (" with uncommitted changes in jax_data/" if changed
                   else "")


def load_average() -> str:
  """The 1, 5 and 15 minute load averages: other work on the machine."""
  try:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())
  except OSError:
    return "unknown"


def environment() -> dict[str, str]:
  """Machine, versions and date of this run."""
  memory = psutil.virtual_memory().total
  return {
      "date": datetime.datetime.now(datetime.UTC).strftime(
          "%Y-%m-%d %H:%M UTC"),
      "cpu": cpu_model(),
      "cores": (f"{psutil.cpu_count(logical=False)} physical, "
                f"{os.cpu_count()} logical"),
      "memory": format_bytes(memory),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "jax backend": f"{jax.default_backend()} ({len(jax.devices())} "
                     "device(s))",
      "jax": _version("jax"),
      "jaxlib": _version("jaxlib"),
      "numpy": _version("numpy"),
      "tensorflow": _version("tensorflow-cpu") if _version(
          "tensorflow") == "not installed" else _version("tensorflow"),
      "tensorflow-datasets": _version("tensorflow-datasets"),
      "jax-sgmc": _version("jax-sgmc"),
      "jax_data": _version("jax_data"),
      "jax_data commit": jax_data_commit(),
  }
