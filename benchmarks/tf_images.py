"""Case (d): images per second through a ``TensorflowDataLoader``.

The pipeline is ``tf.data.Dataset.from_tensor_slices`` over 32x32x3 uint8
images and int64 labels (CIFAR-10-shaped, synthetic). jax_data's and
jax-sgmc's ``TensorflowDataLoader(pipeline, shuffle_cache=100)`` serve
random batches to the same jitted ``lax.scan`` consumer; jax_data twice:
reading the pipeline every pass (the default) and with ``in_memory=True``
(the pipeline read once into NumPy arrays). Two references:
the same ``repeat / shuffle / batch / batch`` pipeline iterated without JAX
(what tf.data itself delivers), and jax_data's ``NumpyDataLoader`` over the
arrays the pipeline is built from. When ``jax_data.tensorflow_loader``
cannot be imported, its row is skipped with a note.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from common import JAX_DATA
from common import JAX_SGMC
from common import Contender
from common import Section
from common import Target
from common import compare
from common import format_ratio
from common import memory_row
from common import paired_ratio

import jax_data

TF_DATA = "tf.data alone (no JAX)"
IN_MEMORY = "jax_data, in_memory=True"
NUMPY = "jax_data NumpyDataLoader, same arrays"


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of case (d).

  Attributes:
    images: Observations in the pipeline.
    shuffle_cache: Shuffle buffer of the loaders.
    mb: Images per batch.
    cache: Batches per host call.
    steps: Batches consumed per measurement.
  """
  images: int = 50_000
  shuffle_cache: int = 100
  mb: int = 64
  cache: int = 100
  steps: int = 5_000


FULL = Config()
SMOKE = Config(images=5_000, cache=10, steps=200)


def _arrays(config: Config) -> dict[str, np.ndarray]:
  """The images and labels the pipeline is built from."""
  rng = np.random.default_rng(0)
  return {"image": rng.integers(0, 256, (config.images, 32, 32, 3),
                                dtype=np.uint8),
          "label": rng.integers(0, 10, config.images).astype(np.int64)}


def _consumer(batch_fn: Callable, steps: int) -> Callable:
  """A jitted scan that takes a batch per step and does almost nothing with
  it (one pixel per image and the labels), so that the loader, not the
  consumer, sets the pace. The host still serves, and XLA still receives,
  every byte of every chunk."""

  def body(carry, _):
    total, data_state = carry
    data_state, batch = batch_fn(data_state)
    total = (total + jnp.sum(batch["image"][:, 0, 0, 0], dtype=jnp.float32)
             + jnp.sum(batch["label"]).astype(jnp.float32))
    return (total, data_state), None

  @jax.jit
  def run(total, data_state):
    carry, _ = jax.lax.scan(body, (total, data_state), None, length=steps)
    return carry

  return run


def _loader_contender(name: str, loader, config: Config
                      ) -> tuple[Contender, Callable]:
  init_fn, batch_fn, release_fn = _random_reference_data(name, loader,
                                                         config)
  run = _consumer(batch_fn, config.steps)
  holder = [(jnp.float32(0), init_fn())]

  def once():
    holder[0] = jax.block_until_ready(run(*holder[0]))

  return Contender(name, once, config.steps * config.mb), release_fn


def _random_reference_data(name: str, loader, config: Config):
  if name == JAX_SGMC:
    from jax_sgmc import data as sgmc_data
    return sgmc_data.random_reference_data(loader, config.cache, config.mb)
  return jax_data.random_reference_data(loader, config.cache, config.mb)


def _tf_alone(pipeline, config: Config) -> Contender:
  batches = (pipeline.repeat().shuffle(config.shuffle_cache)
             .batch(config.mb).batch(config.cache))
  iterator = batches.as_numpy_iterator()
  chunks = config.steps // config.cache

  def once():
    for _ in range(chunks):
      next(iterator)

  return Contender(TF_DATA, once, chunks * config.cache * config.mb)


def _jax_data_loader() -> tuple[type | None, str]:
  """jax_data's TensorflowDataLoader, or None and why not."""
  try:
    from jax_data.tensorflow_loader import TensorflowDataLoader
  except ImportError as e:
    return None, f"{type(e).__name__}: {e}"
  return TensorflowDataLoader, ""


def run(config: Config, repeats: int) -> Section:
  """Times the loaders.

  Args:
    config: Sizes.
    repeats: Measurements per contender.

  Returns:
    The section of the report.
  """
  import tensorflow as tf
  from jax_sgmc.data.tensorflow_loader import TensorflowDataLoader as SgmcLoader

  arrays = _arrays(config)
  pipeline = tf.data.Dataset.from_tensor_slices(arrays)
  contenders = [_tf_alone(pipeline, config)]
  releases: list[Callable] = []
  notes = []
  loader_class, why = _jax_data_loader()
  if loader_class is None:
    notes.append(f"jax_data row skipped: `jax_data.tensorflow_loader` "
                 f"cannot be imported ({why}).")
  else:
    for name, in_memory in ((JAX_DATA, False), (IN_MEMORY, True)):
      contender, release = _loader_contender(
          name, loader_class(pipeline, shuffle_cache=config.shuffle_cache,
                             exclude_keys=None, in_memory=in_memory), config)
      contenders.append(contender)
      releases.append(release)
  contender, release = _loader_contender(
      JAX_SGMC, SgmcLoader(pipeline, shuffle_cache=config.shuffle_cache),
      config)
  contenders.append(contender)
  releases.append(release)
  contender, release = _loader_contender(
      NUMPY, jax_data.NumpyDataLoader(**arrays), config)
  contenders.append(contender)
  releases.append(release)

  timings = compare(contenders, repeats)
  for release in releases:
    release()

  rows = []
  for c in contenders:
    t = timings[c.name]
    rows.append([c.name, f"{1 / t.median:,.0f} ±{t.spread:.0%}",
                 f"{c.units:,}",
                 format_ratio(paired_ratio(timings, JAX_SGMC, c.name))])
  streamed = paired_ratio(timings, JAX_SGMC, JAX_DATA)
  speedup = paired_ratio(timings, JAX_SGMC, IN_MEMORY)
  image_bytes = 32 * 32 * 3 + 4  # uint8 pixels, label as int32
  return Section(
      key="tf",
      title="(d) TensorflowDataLoader throughput",
      description=(
          f"Images per second (median over {repeats} repeats, ± half the "
          f"range) from a `tf.data.Dataset.from_tensor_slices` pipeline of "
          f"{config.images:,} 32x32x3 uint8 images with int64 labels, "
          f"shuffle_cache={config.shuffle_cache}, mb={config.mb}, "
          f"cache={config.cache}, consumed in one jitted `lax.scan` that "
          "does almost nothing with the batches, so the loader sets the "
          "pace. jax_data runs twice: reading the pipeline on every pass "
          "(the default, which works for data larger than memory and keeps "
          "random augmentations random) and with `in_memory=True` (the "
          "pipeline read once into NumPy arrays; same streams). The "
          "speed-up column is the contender's images/s over jax-sgmc's "
          "(median of per-repeat ratios). Two references: the "
          "same `repeat / shuffle / batch / batch` pipeline iterated "
          "without JAX (what tf.data itself delivers), and jax_data's "
          "`NumpyDataLoader` over the arrays the pipeline was built from "
          "(independent draws)."),
      headers=["loader", "images/s", "images per measurement",
               "speed-up over jax-sgmc"],
      rows=rows, notes=notes,
      targets=[Target("(d) TensorflowDataLoader(in_memory=True): jax_data "
                      "/ jax-sgmc images/s", ">= 2x", format_ratio(speedup),
                      (speedup >= 2 if config == FULL and speedup is not None
                       else None)),
               Target("(d) TensorflowDataLoader, default (reads the "
                      "pipeline every pass): jax_data / jax-sgmc images/s",
                      "reported, no target", format_ratio(streamed),
                      None)],
      memory=[memory_row("(d) TensorflowDataLoader random_reference_data",
                         config.cache, config.mb, image_bytes,
                         config.images)])
