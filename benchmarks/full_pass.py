"""Case (c): the full-data log-likelihood of logistic regression, one pass
over every observation per call, with ``full_data_mapper``.

* fused op: the dataset on the device, the log-likelihood of all of it in
  one jitted expression (the reference: one read of the data plus the
  compute);
* copy + fused op: the dataset copied from the host arrays in chunks of
  ``cache * mb`` rows (on CPU with NumPy into one reused buffer, split over
  the cores as jax_data's own copy is; elsewhere with ``jax.device_put``),
  then the fused op. On CPU about the floor of a pass fed from host memory:
  every byte is copied into XLA's buffers once, and XLA does not run a host
  callback beside computation;
* device-resident: the (padded) dataset on the device, a jitted
  ``lax.scan`` over batches cut with ``lax.dynamic_slice``;
* jax_data: ``full_data_mapper(NumpyDataLoader(x=..., y=...), cache, mb)``
  inside ``jit``;
* jax-sgmc 0.1.5: its ``full_data_mapper`` inside ``jit``;
* Python loop: one jitted call per batch of host slices.

All evaluate the same log-likelihood.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

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
from common import calibrate
from common import compare
from common import format_bytes
from common import format_count
from common import format_ratio
from common import format_timing
from common import memory_row
from common import observation_bytes
from common import paired_ratio
from common import timed
from models import logistic_data
from models import masked_log_likelihood

import jax_data
from jax_data import gather


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of case (c).

  Attributes:
    sizes: Observation counts N.
    features: D.
    mb: Observations per batch.
    cache: Batches per host call (jax_data, jax-sgmc).
    min_seconds: Each measurement makes as many passes as take about this
      long (device-resident and jax_data make the same number).
    max_passes: At most this many passes per measurement.
  """
  sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
  features: int = 32
  mb: int = 1_000
  cache: int = 100
  min_seconds: float = 1.0
  max_passes: int = 2_000


FULL = Config()
SMOKE = Config(sizes=(10_000,), cache=10, min_seconds=0.05, max_passes=20)


def _padded(data: dict[str, np.ndarray], mb: int
            ) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """Arrays padded with zeros to whole batches, and the validity mask."""
  n = len(data["y"])
  batches = -(-n // mb)
  pad = batches * mb - n
  padded = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
            for k, v in data.items()}
  mask = (np.arange(batches * mb) < n).reshape(batches, mb)
  return padded, mask


def _device_pass(data: dict[str, np.ndarray], mb: int) -> Callable:
  padded, mask = _padded(data, mb)
  arrays = {k: jnp.asarray(v) for k, v in padded.items()}
  mask = jnp.asarray(mask)

  @jax.jit
  def log_likelihood(theta):
    def body(total, i):
      batch = {k: jax.lax.dynamic_slice_in_dim(a, i * mb, mb)
               for k, a in arrays.items()}
      return total + masked_log_likelihood(theta, batch, mask[i]), None

    total, _ = jax.lax.scan(body, jnp.float32(0),
                            jnp.arange(mask.shape[0]))
    return total

  return log_likelihood


FUSED = "fused op"
FLOOR = "copy + fused op"


def _fused_pass(data: dict[str, np.ndarray]) -> Callable:
  arrays = {k: jnp.asarray(v) for k, v in data.items()}
  mask = jnp.ones(len(data["y"]), bool)
  return jax.jit(lambda theta: masked_log_likelihood(theta, arrays, mask))


def _floor_pass(data: dict[str, np.ndarray], rows: int,
                fused: Callable) -> tuple[Callable, Callable[[], None]]:
  """The copy floor: every chunk of ``rows`` rows copied once, then the
  fused op. Returns the pass and a function that ends its threads."""
  on_cpu = jax.default_backend() == "cpu"
  # The copy jax_data's host makes into XLA's buffers, split the same way.
  copier = gather.Gatherer()
  buffers = {k: np.empty((rows,) + v.shape[1:], v.dtype)
             for k, v in data.items()}
  n = len(data["y"])

  def copy_chunk(start: int) -> None:
    stop = min(start + rows, n)
    for key, array in data.items():
      if on_cpu:
        copier.copy(buffers[key][:stop - start], array[start:stop])
      else:
        jax.block_until_ready(jax.device_put(array[start:stop]))

  def log_likelihood(theta):
    for start in range(0, n, rows):
      copy_chunk(start)
    # Waited for: the next pass's copy would otherwise run beside this
    # pass's fused op (15-25 % of the floor hidden), not after it.
    return jax.block_until_ready(fused(theta))

  return log_likelihood, copier.close


def _mapper_pass(mapper_fn: Callable) -> Callable:
  """A jitted full-data log-likelihood through a ``full_data_mapper``."""

  @jax.jit
  def log_likelihood(theta):
    def fun(batch, mask, carry):
      return masked_log_likelihood(theta, batch, mask), carry

    sums, _ = mapper_fn(fun, None, masking=True)
    return jnp.sum(sums)

  return log_likelihood


def _python_pass(data: dict[str, np.ndarray], mb: int) -> Callable:
  padded, mask = _padded(data, mb)

  @jax.jit
  def add_batch(total, theta, batch, batch_mask):
    return total + masked_log_likelihood(theta, batch, batch_mask)

  def log_likelihood(theta):
    total = jnp.float32(0)
    for i in range(mask.shape[0]):
      batch = {k: v[i * mb:(i + 1) * mb] for k, v in padded.items()}
      total = add_batch(total, theta, batch, mask[i])
    return total

  return log_likelihood


def _contender(name: str, fn: Callable, theta, passes: int) -> Contender:
  def once():
    for _ in range(passes):
      result = fn(theta)
    jax.block_until_ready(result)

  return Contender(name, once, passes)


def _per_pass(fn: Callable, theta) -> float:
  """Seconds of one pass, after a compiling call."""
  jax.block_until_ready(fn(theta))
  return timed(lambda: jax.block_until_ready(fn(theta)))


def run(config: Config, repeats: int) -> Section:
  """Times the six contenders at every N.

  Args:
    config: Sizes.
    repeats: Measurements per contender.

  Returns:
    The section of the report.
  """
  from jax_sgmc import data as sgmc_data
  from jax_sgmc.data.numpy_loader import NumpyDataLoader as SgmcLoader

  rows: list[list[str]] = []
  notes: list[str] = []
  ratios: dict[int, float] = {}
  fused: dict[int, float] = {}
  floors: dict[int, float] = {}
  obs_bytes = 0
  for n in config.sizes:
    data = logistic_data(n, config.features)
    obs_bytes = observation_bytes(data)
    theta = jnp.asarray(np.linspace(-1, 1, config.features,
                                    dtype=np.float32))
    mapper_fn, release_fn = jax_data.full_data_mapper(
        jax_data.NumpyDataLoader(**data), config.cache, config.mb)
    sgmc_mapper, sgmc_release = sgmc_data.full_data_mapper(
        SgmcLoader(**data), config.cache, config.mb)
    fused_pass = _fused_pass(data)
    floor_pass, floor_close = _floor_pass(data, config.cache * config.mb,
                                          fused_pass)
    fns = {FUSED: fused_pass,
           FLOOR: floor_pass,
           DEVICE: _device_pass(data, config.mb),
           JAX_DATA: _mapper_pass(mapper_fn),
           JAX_SGMC: _mapper_pass(sgmc_mapper),
           PYTHON_LOOP: _python_pass(data, config.mb)}
    pilot = {name: _per_pass(fn, theta) for name, fn in fns.items()}
    results = {name: float(fn(theta)) for name, fn in fns.items()}
    _check_agree(results, n)
    calibrated = functools.partial(calibrate, min_seconds=config.min_seconds,
                                   quantum=1, maximum=config.max_passes)
    same = calibrated(min(pilot[DEVICE], pilot[JAX_DATA]))
    passes = {FUSED: same, FLOOR: same, DEVICE: same, JAX_DATA: same,
              JAX_SGMC: calibrated(pilot[JAX_SGMC]),
              PYTHON_LOOP: calibrated(pilot[PYTHON_LOOP])}
    contenders = [_contender(name, fn, theta, passes[name])
                  for name, fn in fns.items()]
    timings = compare(contenders, repeats)
    release_fn()
    sgmc_release()
    floor_close()
    del fns, data

    ratios[n] = paired_ratio(timings, JAX_DATA, DEVICE)
    fused[n] = paired_ratio(timings, JAX_DATA, FUSED)
    floors[n] = paired_ratio(timings, JAX_DATA, FLOOR)
    rows.append([format_count(n)]
                + [format_timing(timings[c.name], "ms") for c in contenders]
                + [format_ratio(fused[n]), format_ratio(floors[n]),
                   format_ratio(paired_ratio(timings, FLOOR, FUSED)),
                   format_ratio(ratios[n]),
                   format_ratio(paired_ratio(timings, JAX_SGMC, JAX_DATA)),
                   format_ratio(paired_ratio(timings, PYTHON_LOOP,
                                             JAX_DATA)),
                   format_bytes(n * obs_bytes / timings[JAX_DATA].median)
                   + "/s"])
    notes.append(f"N={format_count(n)}: " + ", ".join(
        f"{c.name} {c.units} passes" for c in contenders))
    print(f"  (c) N={format_count(n)} done", flush=True)

  large = max(ratios)
  return Section(
      key="full",
      title="(c) Full-data log-likelihood pass",
      description=(
          "Time of one pass over all observations computing the "
          "logistic-regression log-likelihood (median over "
          f"{repeats} repeats, ± half the range), D={config.features}, "
          f"mb={config.mb}, cache={config.cache} batches per host call; "
          "every pass is one call of a jitted function (the Python loop: "
          "one jitted call per batch). All contenders agree on the value. "
          "`copy + fused op`: the data set copied once from the host "
          "arrays in chunks of cache x mb rows (on CPU into one reused "
          "buffer with NumPy, split over the cores as jax_data's own "
          f"copy is: up to {min(8, gather.usable_cores())} threads, parts "
          "of at least 2 MiB; elsewhere with "
          "`jax.device_put`), then the fused op. On CPU it is about the "
          "floor of a pass fed from host memory: every byte must be copied "
          "into XLA's buffers once, and XLA runs a host callback and the "
          "computation one after the other (a pass can come in under it "
          "only where computing on a chunk it has just copied, still in "
          "the cache, is faster than the fused op reading the data set "
          "from memory). "
          "`jax_data bytes/s`: the data set's bytes over jax_data's pass "
          "time (on a GPU, the host-to-device rate of the pass's chunk "
          "refreshes)."),
      headers=["N", FUSED, FLOOR, DEVICE, JAX_DATA, JAX_SGMC, PYTHON_LOOP,
               "jax_data / fused op", "jax_data / (copy + fused op)",
               "(copy + fused op) / fused op", "jax_data / device",
               "jax-sgmc / jax_data", "Python loop / jax_data",
               "jax_data bytes/s"],
      rows=rows, notes=notes,
      targets=[Target(f"(c) full pass: jax_data / fused op at "
                      f"N={format_count(large)}", "<= 1.5x",
                      format_ratio(fused[large]),
                      fused[large] <= 1.5 if config == FULL else None),
               Target("(c) full pass: jax_data / fused op, smaller N",
                      "<= 2x", ", ".join(
                          f"{format_count(n)}: {format_ratio(fused[n])}"
                          for n in sorted(fused) if n != large) or "-",
                      all(fused[n] <= 2 for n in fused if n != large)
                      if config == FULL else None)],
      memory=[memory_row("(c) full_data_mapper", config.cache, config.mb,
                         obs_bytes, max(config.sizes))])


def _check_agree(results: dict[str, float], n: int) -> None:
  """All contenders compute the same log-likelihood (float32 sums)."""
  reference = results[DEVICE]
  for name, value in results.items():
    if not np.isclose(value, reference, rtol=1e-3, atol=1e-3 * n):
      raise RuntimeError(
          f"{name} computed log-likelihood {value}, device-resident "
          f"{reference} (N={n})")
