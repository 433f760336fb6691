"""Case (b): training steps of the JAX data-loaders tutorial's MLP
(784-512-512-10, mb=128) on synthetic MNIST-shaped data.

Device-resident, jax_data and jax-sgmc run the same training steps in one
jitted ``lax.scan``; the Python loop is the tutorial's: host batches,
``device_put`` and one jitted ``update`` per batch.
"""

from __future__ import annotations

import dataclasses

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
from common import compare
from common import format_count
from common import format_ratio
from common import format_timing
from common import memory_row
from common import observation_bytes
from common import paired_ratio
from common import scan_contender
from models import LAYER_SIZES
from models import device_batch_fn
from models import init_network_params
from models import mlp_trainer
from models import mlp_update
from models import mnist_like

import jax_data


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of case (b).

  Attributes:
    observations: N (MNIST's training set has 60,000).
    mb: Mini-batch size (the tutorial's 128).
    cache: Batches per host call (jax_data, jax-sgmc).
    steps: Training steps per measurement, the same for every contender.
  """
  observations: int = 60_000
  mb: int = 128
  cache: int = 100
  steps: int = 400


FULL = Config()
SMOKE = Config(observations=6_000, cache=10, steps=40)


def _python_loop(data, params, config: Config) -> Contender:
  """The tutorial's loop: host batches, device_put, one jitted update."""
  update = jax.jit(mlp_update)
  rng = np.random.default_rng(0)
  n = len(data["label"])
  holder = [params]

  def once():
    params = holder[0]
    for _ in range(config.steps):
      indices = rng.integers(0, n, config.mb)
      batch = jax.device_put({k: v[indices] for k, v in data.items()})
      params = update(params, batch)
    holder[0] = jax.block_until_ready(params)

  return Contender(PYTHON_LOOP, once, config.steps)


def run(config: Config, repeats: int) -> Section:
  """Times the four contenders.

  Args:
    config: Sizes.
    repeats: Measurements per contender.

  Returns:
    The section of the report.
  """
  from jax_sgmc import data as sgmc_data
  from jax_sgmc.data.numpy_loader import NumpyDataLoader as SgmcLoader

  data = mnist_like(config.observations)
  params = init_network_params(LAYER_SIZES, jax.random.PRNGKey(0))

  device = {k: jnp.asarray(v) for k, v in data.items()}
  device_run = mlp_trainer(device_batch_fn(device, config.mb), config.steps)
  loader = jax_data.NumpyDataLoader(**data)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, config.cache, config.mb)
  sgmc_init, sgmc_batch, sgmc_release = sgmc_data.random_reference_data(
      SgmcLoader(**data), config.cache, config.mb)
  contenders = [
      scan_contender(DEVICE, device_run, (params, jax.random.PRNGKey(1)),
                      config.steps),
      scan_contender(JAX_DATA, mlp_trainer(batch_fn, config.steps),
                      (params, init_fn(seed=0)), config.steps),
      scan_contender(JAX_SGMC, mlp_trainer(sgmc_batch, config.steps),
                      (params, sgmc_init(seed=0)), config.steps),
      _python_loop(data, params, config),
  ]
  timings = compare(contenders, repeats)
  release_fn()
  sgmc_release()

  ratio = paired_ratio(timings, JAX_DATA, DEVICE)
  row = ([format_count(config.observations)]
         + [format_timing(timings[c.name], "ms") for c in contenders]
         + [format_ratio(ratio),
            format_ratio(paired_ratio(timings, JAX_SGMC, JAX_DATA)),
            format_ratio(paired_ratio(timings, PYTHON_LOOP, JAX_DATA))])
  return Section(
      key="mlp",
      title="(b) The data-loaders tutorial's MLP",
      description=(
          "Time per training step (median over "
          f"{repeats} repeats, ± half the range) of the tutorial's "
          "784-512-512-10 MLP with its loss and SGD update, "
          f"mb={config.mb}, on {config.observations:,} synthetic "
          "MNIST-shaped observations (float32 images, int32 labels, one-hot "
          f"inside the step), cache={config.cache}, {config.steps} steps "
          "per measurement for every contender; random batches with "
          "replacement."),
      headers=["N", DEVICE, JAX_DATA, JAX_SGMC, PYTHON_LOOP,
               "jax_data / device", "jax-sgmc / jax_data",
               "Python loop / jax_data"],
      rows=[row],
      targets=[Target("(b) MLP: jax_data / device-resident", "<= 1.05x",
                      format_ratio(ratio),
                      ratio <= 1.05 if config == FULL else None)],
      memory=[memory_row("(b) MLP random_reference_data", config.cache,
                         config.mb, observation_bytes(data),
                         config.observations)])
