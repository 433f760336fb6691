"""Case (a): SGLD for Bayesian logistic regression, the whole sampler in one
jitted ``lax.scan``, with mini-batches from every source we compare.

* compute only: the same scan reusing one fixed batch, no data access at
  all (the real limit);
* device-resident: the dataset on the device, indices drawn with
  ``jax.random`` inside the scan;
* jax_data: ``random_reference_data(NumpyDataLoader(x=..., y=...), cache,
  mb)`` with the sampler written with ``jax_data.scan`` (the documented
  way), and with ``batch_fn`` called in a ``lax.scan`` body;
* jax_data data only: the ``jax_data.scan`` loop with a step that only sums
  its batch: the time of the chunk refreshes alone, reported as the bytes
  per second that reach the device (host-to-device on a GPU);
* jax-sgmc 0.1.5: the predecessor's data module in the same scan;
* cyreal 0.2.1: ``ArraySource`` (arrays on the device) and ``DiskSource``
  (a host callback per sample), loaders whose state goes through ``jit``;
* Datarax 0.1.4 (when installed, see ``datarax_peer.py``): a shuffled
  ``MemorySource`` (data on the device) and a ``StreamingDiskSource`` (one
  ``io_callback`` per batch), read with ``get_batch_at`` inside the scan;
* Grain: a ``MapDataset`` pipeline's iterator feeding a jitted step from
  Python (the data-loading tutorial's pattern);
* Python loop: indices drawn with NumPy on the host and one jitted SGLD
  step per batch.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable

import datarax_peer
import jax
import jax.numpy as jnp
import numpy as np
from common import DEVICE
from common import JAX_DATA
from common import JAX_SGMC
from common import PYTHON_LOOP
from common import Contender
from common import Section
from common import Target
from common import Timing
from common import calibrate
from common import format_bytes
from common import format_count
from common import format_ratio
from common import format_timing
from common import measure
from common import memory_row
from common import paired_ratio
from common import scan_contender
from common import timed
from models import data_only_scan_sampler
from models import device_batch_fn
from models import logistic_data
from models import sgld_sampler
from models import sgld_scan_sampler
from models import sgld_update

import jax_data

COMPUTE = "compute only"
BATCH_FN = "jax_data batch_fn"
CYREAL_ARRAY = "cyreal ArraySource"
CYREAL_DISK = "cyreal DiskSource"
GRAIN = "Grain iterator"
DATA_ONLY = "jax_data data only"
COUNTER = "jax_data counter stream"


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of case (a).

  Attributes:
    sizes: Observation counts N.
    features: D.
    mb: Mini-batch size.
    cache: Batches per host call (jax_data, jax-sgmc).
    min_steps: Least SGLD steps per measurement of device-resident and
      jax_data (both run the same number).
    max_steps: Most steps per measurement of any contender.
    min_seconds: Every contender runs as many steps as take about this
      long (device-resident sets the count for itself and jax_data),
      measured in a pilot run of ``pilot_steps``.
    pilot_steps: Steps of the pilot runs.
  """
  sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
  features: int = 32
  mb: int = 64
  cache: int = 100
  min_steps: int = 20_000
  max_steps: int = 100_000
  min_seconds: float = 1.0
  pilot_steps: int = 1_000


FULL = Config()
SMOKE = Config(sizes=(10_000,), min_steps=2_000, max_steps=2_000,
               min_seconds=0.05, pilot_steps=200)


def _main_steps(batch_fn: Callable, n: int, carry: tuple, config: Config,
                step_size: float) -> int:
  """Steps per measurement of device-resident and jax_data: as many as take
  device-resident ``min_seconds`` in a pilot run, within the configured
  bounds, in whole cache refreshes."""
  pilot = sgld_sampler(batch_fn, n, config.pilot_steps, step_size)
  carry = jax.block_until_ready(pilot(*carry))  # compile
  per_step = timed(lambda: jax.block_until_ready(pilot(*carry))
                   ) / config.pilot_steps
  steps = calibrate(per_step, config.min_seconds, config.cache,
                    config.max_steps)
  return max(steps, config.min_steps)


def _python_loop(data: dict[str, np.ndarray], theta, key, config: Config,
                 step_size: float, max_steps: int) -> Contender:
  """Host-drawn indices and one jitted SGLD step per batch."""
  n = len(data["y"])
  step = jax.jit(functools.partial(sgld_update, observation_count=n,
                                   step_size=step_size))
  rng = np.random.default_rng(0)
  holder = [(theta, key)]

  def steps(count: int):
    theta, key = holder[0]
    for _ in range(count):
      indices = rng.integers(0, n, config.mb)
      batch = {k: v[indices] for k, v in data.items()}
      theta, key = step(theta, key, batch)
    holder[0] = jax.block_until_ready((theta, key))

  steps(10)  # compile
  per_step = timed(lambda: steps(config.pilot_steps)) / config.pilot_steps
  units = calibrate(per_step, config.min_seconds, 100, max_steps)
  return Contender(PYTHON_LOOP, lambda: steps(units), units)


def _calibrated_scan(name: str, make_run: Callable, carry: tuple,
                     config: Config, max_steps: int) -> Contender:
  """A jitted scan contender whose steps a pilot run decides (slow peers
  run fewer steps)."""
  pilot = make_run(config.pilot_steps)
  holder = [jax.block_until_ready(pilot(*carry))]  # compile

  def pilot_run():
    holder[0] = jax.block_until_ready(pilot(*holder[0]))

  per_step = timed(pilot_run) / config.pilot_steps
  units = calibrate(per_step, config.min_seconds, 10, max_steps)
  return scan_contender(name, make_run(units), holder[0], units)


def _cyreal(data: dict[str, np.ndarray], theta, key, config: Config,
            step_size: float, max_steps: int) -> list[Contender]:
  """cyreal's ArraySource and DiskSource feeding the same jitted scan."""
  try:
    from cyreal.loader import DataLoader
    from cyreal.sources import ArraySource
    from cyreal.sources import DiskSource
    from cyreal.transforms import BatchTransform
  except ImportError:
    return []
  n = len(data["y"])
  spec = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
          for k, v in data.items()}
  sources = {
      CYREAL_ARRAY: ArraySource({k: jnp.asarray(v) for k, v in data.items()},
                                ordering="shuffle"),
      CYREAL_DISK: DiskSource(
          length=n, sample_fn=lambda i: {k: v[int(i)] for k, v in
                                         data.items()},
          sample_spec=spec, ordering="shuffle",
          prefetch_size=config.cache * config.mb),
  }
  contenders = []
  for name, source in sources.items():
    loader = DataLoader([source, BatchTransform(batch_size=config.mb)])

    def make_run(steps, loader=loader):
      def step(carry, _):
        theta, state, key = carry
        batch, state, _ = loader.next(state)
        theta, key = sgld_update(theta, key, batch, n, step_size)
        return (theta, state, key), None

      @jax.jit
      def run(theta, state, key):
        return jax.lax.scan(step, (theta, state, key), None, length=steps)[0]
      return run

    contenders.append(_calibrated_scan(
        name, make_run, (theta, loader.init_state(jax.random.key(0)), key),
        config, max_steps))
  return contenders


def _datarax(data: dict[str, np.ndarray], theta, key, config: Config,
             step_size: float, max_steps: int
             ) -> tuple[list[Contender], Callable]:
  """Datarax's MemorySource (whole epochs, see ``datarax_peer``) and
  StreamingDiskSource feeding the same sampler; the second value removes
  the disk source's file."""
  if not datarax_peer.available():
    return [], lambda: None
  n = len(data["y"])
  update = functools.partial(sgld_update, observation_count=n,
                             step_size=step_size)
  batch_at, source_state = datarax_peer.memory_batches(data, config.mb)
  per_epoch = n // config.mb
  pilot = jax.jit(datarax_peer.memory_sampler(batch_at, n, config.mb, 1,
                                              update))
  carry = (theta, source_state, jax.random.PRNGKey(2), key)
  carry = jax.block_until_ready(pilot(*carry))  # compile
  per_step = timed(lambda: jax.block_until_ready(pilot(*carry))) / per_epoch
  epochs = calibrate(per_step * per_epoch, config.min_seconds, 1,
                     max(1, max_steps // per_epoch))
  memory = scan_contender(datarax_peer.MEMORY, jax.jit(
      datarax_peer.memory_sampler(batch_at, n, config.mb, epochs, update)),
      carry, epochs * per_epoch)
  directory = datarax_peer.temporary_directory()
  read_at = datarax_peer.disk_batches(data, config.mb, directory.name)
  disk = _calibrated_scan(
      datarax_peer.DISK, lambda steps: datarax_peer.disk_sampler(
          read_at, config.mb, steps, update), (theta, jnp.int32(0), key),
      config, max_steps)
  return [memory, disk], directory.cleanup


def _grain(data: dict[str, np.ndarray], theta, key, config: Config,
           step_size: float, max_steps: int) -> list[Contender]:
  """Grain's iterator over a shuffled, batched MapDataset feeding one
  jitted SGLD step per batch."""
  try:
    import grain
  except ImportError:
    return []
  n = len(data["y"])
  dataset = (grain.MapDataset.range(n).shuffle(seed=0).repeat()
             .map(lambda i: {k: v[i] for k, v in data.items()})
             .batch(config.mb))
  iterator = iter(dataset.to_iter_dataset())
  step = jax.jit(functools.partial(sgld_update, observation_count=n,
                                   step_size=step_size))
  holder = [(theta, key)]

  def steps(count: int):
    theta, key = holder[0]
    for _ in range(count):
      theta, key = step(theta, key, next(iterator))
    holder[0] = jax.block_until_ready((theta, key))

  steps(10)  # compile
  per_step = timed(lambda: steps(config.pilot_steps)) / config.pilot_steps
  units = calibrate(per_step, config.min_seconds, 10, max_steps)
  return [Contender(GRAIN, lambda: steps(units), units)]


def _jax_sgmc(data: dict[str, np.ndarray], theta, key, config: Config,
              step_size: float, max_steps: int
              ) -> tuple[Contender, Callable]:
  """jax-sgmc's random_reference_data in the same jitted scan; fewer steps
  when it is slow (calibrated in a pilot run)."""
  from jax_sgmc import data as sgmc_data
  from jax_sgmc.data.numpy_loader import NumpyDataLoader

  n = len(data["y"])
  loader = NumpyDataLoader(**data)
  init_fn, batch_fn, release_fn = sgmc_data.random_reference_data(
      loader, config.cache, config.mb)
  state = init_fn(seed=0)
  pilot = sgld_sampler(batch_fn, n, config.pilot_steps, step_size)
  # A jax-sgmc state must not be used twice (its host side checks a token
  # that every request renews), so the carry is always the latest one.
  holder = [jax.block_until_ready(pilot(theta, state, key))]  # compile

  def pilot_run():
    holder[0] = jax.block_until_ready(pilot(*holder[0]))

  per_step = timed(pilot_run) / config.pilot_steps
  units = calibrate(per_step, config.min_seconds, config.cache, max_steps)
  run = sgld_sampler(batch_fn, n, units, step_size)
  return scan_contender(JAX_SGMC, run, holder[0], units), release_fn


def _contenders(n: int, config: Config) -> tuple[list[Contender], Callable]:
  """The contenders at N=n (those of the module's docstring that run in
  this process; ``common.measure`` warms them up), and a function releasing
  the pipelines."""
  data = logistic_data(n, config.features)
  step_size = 0.01 / n
  theta = jnp.zeros(config.features, jnp.float32)
  key = jax.random.PRNGKey(0)

  device = {k: jnp.asarray(v) for k, v in data.items()}
  device_batch = device_batch_fn(device, config.mb)
  device_carry = (theta, jax.random.PRNGKey(1), key)
  steps = _main_steps(device_batch, n, device_carry, config, step_size)
  device_run = sgld_sampler(device_batch, n, steps, step_size)
  fixed = {k: v[:config.mb] for k, v in device.items()}
  compute_run = sgld_sampler(lambda s: (s, fixed), n, steps, step_size)
  loader = jax_data.NumpyDataLoader(**data)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, config.cache, config.mb)
  jax_data_run = sgld_scan_sampler(batch_fn, n, steps, step_size)
  batch_fn_run = sgld_sampler(batch_fn, n, steps, step_size)
  data_only_run = data_only_scan_sampler(batch_fn, steps)
  sgmc, sgmc_release = _jax_sgmc(data, theta, key, config, step_size, steps)
  datarax, datarax_cleanup = _datarax(data, theta, key, config, step_size,
                                      steps)
  contenders = [
      scan_contender(COMPUTE, compute_run, (theta, jnp.int32(0), key), steps),
      scan_contender(DEVICE, device_run, device_carry, steps),
      scan_contender(JAX_DATA, jax_data_run, (theta, init_fn(seed=0), key),
                     steps),
      scan_contender(BATCH_FN, batch_fn_run, (theta, init_fn(seed=1), key),
                     steps),
      scan_contender(DATA_ONLY, data_only_run, (theta, init_fn(seed=2), key),
                     steps),
      scan_contender(COUNTER, jax_data_run,
                     (theta, init_fn(seed=3, stream="counter"), key), steps),
      sgmc,
      *_cyreal(data, theta, key, config, step_size, steps),
      *datarax,
      *_grain(data, theta, key, config, step_size, steps),
      _python_loop(data, theta, key, config, step_size, steps),
  ]

  def release():
    release_fn()
    sgmc_release()
    datarax_cleanup()

  return contenders, release


def run(config: Config, repeats: int) -> Section:
  """Times the contenders at every N.

  The contenders of all N are timed round-robin together, so that the
  ratios across N (the growth of jax_data's time with N) are paired too.

  Args:
    config: Sizes.
    repeats: Measurements per contender.

  Returns:
    The section of the report.
  """
  by_size: dict[int, list[Contender]] = {}
  releases = []
  for n in config.sizes:
    by_size[n], release = _contenders(n, config)
    releases.append(release)
    print(f"  (a) N={format_count(n)} compiled", flush=True)
  everyone = [c for contenders in by_size.values() for c in contenders]
  measured = measure(everyone, repeats)
  for release in releases:
    release()
  timings: dict[int, dict[str, Timing]] = {}
  position = 0
  for n, contenders in by_size.items():
    timings[n] = {c.name: t for c, t in zip(
        contenders, measured[position:position + len(contenders)])}
    position += len(contenders)

  names = [c.name for c in next(iter(by_size.values()))]
  ratios = [(JAX_DATA, COMPUTE), (BATCH_FN, COMPUTE), (JAX_DATA, DEVICE),
            (COUNTER, JAX_DATA)] + [
      (peer, JAX_DATA) for peer in names
      if peer not in (COMPUTE, DEVICE, JAX_DATA, BATCH_FN, DATA_ONLY,
                      COUNTER)]
  observation = 4 * (config.features + 1)  # float32 x and y
  batch_bytes = config.mb * observation
  rows = []
  for n, contenders in by_size.items():
    rows.append([format_count(n)]
                + [format_timing(timings[n][c.name], "us")
                   for c in contenders]
                + [format_ratio(paired_ratio(timings[n], a, b))
                   for a, b in ratios]
                + [format_bytes(batch_bytes / timings[n][DATA_ONLY].median)
                   + "/s"])
  notes = [f"N={format_count(n)}: " + ", ".join(
      f"{c.name} {c.units:,} steps" for c in contenders)
           for n, contenders in by_size.items()]
  return Section(
      key="sgld",
      title="(a) SGLD, logistic regression",
      description=(
          f"Time per SGLD step (median over {repeats} repeats, ± half the "
          f"range), D={config.features}, mb={config.mb}, "
          f"cache={config.cache} batches per host call, the whole sampler "
          "in one jitted `lax.scan` (the Python loop: one jitted step per "
          "batch; Grain: one jitted step per batch of its iterator). "
          "jax_data is the sampler written with `jax_data.scan`; `jax_data "
          "batch_fn` the same sampler calling `batch_fn` in a `lax.scan` "
          "body; `jax_data counter stream` the jax_data sampler over a "
          "counter-based stream (`stream=\"counter\"`; N <= 2**20 draws "
          "the exact stream by default); `jax_data data only` the "
          "`jax_data.scan` loop whose step "
          "only sums its batch, and `refresh bytes/s` the batch bytes it "
          "brings in per second (the chunk refresh's host-to-device rate "
          "on a GPU, next to the device time of the other columns). "
          "Compute only (the same scan reusing one fixed batch: the "
          "limit), device-resident and jax_data run the same sampler code "
          "for the same number of steps, as many as take device-resident "
          f"about {config.min_seconds} s (at least {config.min_steps:,}); "
          "jax-sgmc, cyreal, Datarax, Grain and the Python loop run as many "
          "as take them about as long (at most as many; Datarax's "
          "MemorySource whole shuffled epochs in its scan mode, its "
          "StreamingDiskSource reads consecutive windows, unshuffled in "
          "0.1.4). Pilot runs decide the "
          "counts, listed below the table; the time per step is compared. "
          "The contenders of all N are timed round-robin together; ratios "
          "are medians of per-repeat ratios."),
      headers=["N"] + names + [
          f"{a} / {'device' if b == DEVICE else b}" for a, b in ratios]
      + ["refresh bytes/s"],
      rows=rows, notes=notes,
      targets=_targets(config, timings),
      memory=[memory_row("(a) SGLD random_reference_data", config.cache,
                         config.mb, observation,
                         max(config.sizes))])


def _targets(config: Config, timings: dict[int, dict[str, Timing]]
             ) -> list[Target]:
  sizes = sorted(timings)
  ratios = {n: paired_ratio(timings[n], JAX_DATA, DEVICE) for n in sizes}
  limit = {n: paired_ratio(timings[n], JAX_DATA, COMPUTE) for n in sizes}
  small, large = sizes[0], sizes[-1]
  growth = statistics.median(
      a / b for a, b in zip(timings[large][JAX_DATA].samples,
                            timings[small][JAX_DATA].samples))
  speedup = paired_ratio(timings[large], JAX_SGMC, JAX_DATA)
  counter = {n: paired_ratio(timings[n], COUNTER, JAX_DATA) for n in sizes}
  full = config == FULL  # targets are stated for the full sizes
  return [
      Target("(a) jax_data / compute only, every N", "<= 1.3x",
             ", ".join(f"{format_count(n)}: {format_ratio(r)}"
                       for n, r in limit.items()),
             max(limit.values()) <= 1.3 if full else None),
      Target("(a) jax_data / device-resident, every N", "<= 1.0x",
             ", ".join(f"{format_count(n)}: {format_ratio(r)}"
                       for n, r in ratios.items()),
             max(ratios.values()) <= 1.0 if full else None),
      Target(f"(a) jax_data time at N={format_count(large)} / at "
             f"N={format_count(small)}", "within 1.3x",
             format_ratio(growth),
             1 / 1.3 <= growth <= 1.3 if full else None),
      Target("(a) counter stream / exact stream, every N", "<= 1.1x",
             ", ".join(f"{format_count(n)}: {format_ratio(r)}"
                       for n, r in counter.items()),
             max(counter.values()) <= 1.1 if full else None),
      Target(f"(a) jax-sgmc / jax_data at N={format_count(large)}",
             ">= 5x", format_ratio(speedup),
             speedup >= 5 if full else None),
  ]
