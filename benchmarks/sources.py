"""Case (e): records per second from a random-access source whose records
need real work, feeding the data-loading tutorial's MLP.

The source holds 28x28 uint8 images compressed with bz2 (each decompressed
by ``bz2.decompress``, which releases the GIL: about 45 µs per image on
this project's machines) and their labels. Every contender decodes every
record it serves and trains the tutorial's 784-512-512-10 MLP on batches of
64:

* jax_data: ``SourceDataLoader(source, transform=decode, workers=W)``,
  the training steps in one jitted ``lax.scan``;
* Grain's own pipelines over the same source, with the same number of
  workers, feeding a jitted step from Python (the tutorial's pattern):
  ``MapDataset.source(...).shuffle().map(decode).to_iter_dataset()`` with
  ``W`` read threads, and ``grain.DataLoader`` with ``W`` worker processes;
* PyTorch's ``DataLoader`` with ``W`` workers, if torch is installed;
* cyreal 0.2.1's ``DiskSource`` (its state goes through ``jit``; one host
  callback per sample), the steps in one jitted ``lax.scan``.

A second table compares an in-memory source (records already arrays, no
decoding) with ``NumpyDataLoader`` over the same arrays.
"""

from __future__ import annotations

import bz2
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from common import JAX_DATA
from common import Contender
from common import Section
from common import Target
from common import compare
from common import format_ratio
from common import memory_row
from common import paired_ratio
from models import LAYER_SIZES
from models import init_network_params
from models import mlp_update

import jax_data
from jax_data.source_loader import default_workers

GRAIN_THREADS = "Grain MapDataset, {} read threads"
GRAIN_PROCESSES = "Grain DataLoader, {} worker processes"
TORCH = "PyTorch DataLoader, {} workers"
CYREAL = "cyreal 0.2.1 DiskSource"
IN_MEMORY = "jax_data SourceDataLoader, in-memory records"
NUMPY = "jax_data NumpyDataLoader, same arrays"


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of case (e).

  Attributes:
    records: Images in the source.
    mb: Images per batch.
    cache: Batches per host call (jax_data).
    steps: Training steps per measurement (the same for every contender;
      cyreal runs ``cyreal_steps``).
    cyreal_steps: Training steps per measurement of cyreal, which is slow.
    calls: Calls of ``steps`` steps per measurement, back to back. The
      measurements settle before they start, and a loader's work ahead
      (jax_data's two chunks) is done meanwhile, off the clock: with one
      call it was 2 of the 12 chunks timed (14 % of the records decoded);
      with four, 2 of 48.
    workers: Worker threads or processes; None: jax_data's default (the
      usable cores, at most 8).
  """
  records: int = 20_000
  mb: int = 64
  cache: int = 50
  steps: int = 600
  cyreal_steps: int = 100
  calls: int = 4
  workers: int | None = None


FULL = Config()
SMOKE = Config(records=2_000, cache=10, steps=40, cyreal_steps=10, calls=2)


def _images(config: Config) -> tuple[np.ndarray, np.ndarray]:
  """MNIST-shaped images (smooth class prototypes plus noise) and labels."""
  rng = np.random.default_rng(0)
  prototypes = np.kron(rng.normal(size=(10, 7, 7)), np.ones((4, 4)))
  labels = rng.integers(0, 10, config.records)
  images = prototypes[labels] * 45 + 128 + rng.normal(
      0, 85, (config.records, 28, 28))
  return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.int64)


def _compressed(images: np.ndarray, labels: np.ndarray) -> list[bytes]:
  """Records of the source: a label byte, then the bz2-compressed pixels."""
  return [bytes([int(label)]) + bz2.compress(image.tobytes(), 9)
          for image, label in zip(images, labels)]


def decode(record: bytes) -> dict[str, np.ndarray]:
  """A record's image and label (module level: worker processes pickle
  it)."""
  image = np.frombuffer(bz2.decompress(record[1:]), np.uint8)
  return {"image": image.reshape(28, 28), "label": np.int32(record[0])}


def _update(params, batch):
  """The tutorial's training step on a batch of uint8 images."""
  images = batch["image"].reshape(batch["image"].shape[0], -1)
  return mlp_update(params, {"image": images.astype(jnp.float32) / 255,
                             "label": batch["label"]})


def _params():
  return init_network_params(LAYER_SIZES, jax.random.PRNGKey(0))


def _jax_data(name: str, loader, config: Config
              ) -> tuple[Contender, Callable]:
  """Training steps in one jitted scan, batches from ``loader``."""
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, config.cache, config.mb)

  @jax.jit
  def run(params, state):
    def step(carry, _):
      params, state = carry
      state, batch = batch_fn(state)
      return (_update(params, batch), state), None
    return jax.lax.scan(step, (params, state), None, length=config.steps)[0]

  holder = [(_params(), init_fn(seed=0, shuffle=True))]

  def once():
    for _ in range(config.calls):
      holder[0] = jax.block_until_ready(run(*holder[0]))

  return (Contender(name, once, config.calls * config.steps * config.mb),
          release_fn)


def _python_loop(name: str, batches, config: Config) -> Contender:
  """The tutorial's pattern: batches from a Python iterator, one jitted
  step per batch."""
  update = jax.jit(_update)
  holder = [_params()]

  def once():
    for _ in range(config.calls):
      params = holder[0]
      for _ in range(config.steps):
        batch = next(batches)
        params = update(params, {"image": jnp.asarray(batch["image"]),
                                 "label": jnp.asarray(batch["label"])})
      holder[0] = jax.block_until_ready(params)

  return Contender(name, once, config.calls * config.steps * config.mb)


def _grain_threads(records: list[bytes], config: Config, workers: int
                   ) -> Contender:
  import grain
  dataset = (grain.MapDataset.source(records).shuffle(seed=0).repeat()
             .map(decode).to_iter_dataset(grain.ReadOptions(
                 num_threads=workers, prefetch_buffer_size=4 * config.mb))
             .batch(config.mb, drop_remainder=True))
  return _python_loop(GRAIN_THREADS.format(workers), iter(dataset), config)


class _Decode:
  """Grain's map transform of the DataLoader (a class: it pickles)."""

  def __new__(cls):
    import grain

    class Decode(grain.transforms.Map):
      def map(self, element):
        return decode(element)

    return Decode()


def _grain_processes(records: list[bytes], config: Config, workers: int
                     ) -> Contender:
  import grain
  from absl import flags
  # Grain's worker processes read an absl flag; outside absl.app it must be
  # marked parsed (google/grain#1355).
  flags.FLAGS.mark_as_parsed()
  loader = grain.DataLoader(
      data_source=records,
      sampler=grain.samplers.IndexSampler(
          num_records=len(records), shard_options=grain.sharding.NoSharding(),
          shuffle=True, num_epochs=None, seed=0),
      operations=[_Decode(), grain.transforms.Batch(batch_size=config.mb,
                                                    drop_remainder=True)],
      worker_count=workers,
      read_options=grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  return _python_loop(GRAIN_PROCESSES.format(workers), iter(loader), config)


def _torch(records: list[bytes], config: Config, workers: int
           ) -> Contender | None:
  try:
    import torch
  except ImportError:
    return None

  class Records(torch.utils.data.Dataset):
    def __len__(self):
      return len(records)

    def __getitem__(self, index):
      return decode(records[index])

  sampler = torch.utils.data.RandomSampler(Records(), replacement=True,
                                           num_samples=10**9)
  loader = torch.utils.data.DataLoader(
      Records(), batch_size=config.mb, sampler=sampler, num_workers=workers,
      collate_fn=lambda b: {k: np.stack([r[k] for r in b]) for k in b[0]},
      persistent_workers=workers > 0)
  return _python_loop(TORCH.format(workers), iter(loader), config)


def _cyreal(records: list[bytes], config: Config) -> Contender | None:
  try:
    from cyreal.loader import DataLoader
    from cyreal.sources import DiskSource
    from cyreal.transforms import BatchTransform
  except ImportError:
    return None
  spec = {"image": jax.ShapeDtypeStruct((28, 28), jnp.uint8),
          "label": jax.ShapeDtypeStruct((), jnp.int32)}
  source = DiskSource(length=len(records),
                      sample_fn=lambda i: decode(records[int(i)]),
                      sample_spec=spec, ordering="shuffle",
                      prefetch_size=config.cache * config.mb)
  loader = DataLoader([source, BatchTransform(batch_size=config.mb)])
  steps = config.cyreal_steps

  @jax.jit
  def run(params, state):
    def step(carry, _):
      params, state = carry
      batch, state, _ = loader.next(state)
      return (_update(params, batch), state), None
    return jax.lax.scan(step, (params, state), None, length=steps)[0]

  holder = [(_params(), loader.init_state(jax.random.key(0)))]

  def once():
    for _ in range(config.calls):
      holder[0] = jax.block_until_ready(run(*holder[0]))

  return Contender(CYREAL, once, config.calls * steps * config.mb)


def run(config: Config, repeats: int) -> Section:
  """Times the loaders.

  Args:
    config: Sizes.
    repeats: Measurements per contender.

  Returns:
    The section of the report.
  """
  workers = config.workers or default_workers()
  images, labels = _images(config)
  records = _compressed(images, labels)
  source_name = f"{JAX_DATA} SourceDataLoader, {workers} workers"
  contenders, releases, notes = [], [], []
  contender, release = _jax_data(
      source_name, jax_data.SourceDataLoader(records, transform=decode,
                                             workers=workers), config)
  contenders.append(contender)
  releases.append(release)
  contenders.append(_grain_threads(records, config, workers))
  contenders.append(_grain_processes(records, config, workers))
  torch_contender = _torch(records, config, workers)
  if torch_contender is None:
    notes.append("PyTorch row skipped: torch is not installed.")
  else:
    contenders.append(torch_contender)
  cyreal_contender = _cyreal(records, config)
  if cyreal_contender is None:
    notes.append("cyreal row skipped: cyreal is not installed.")
  else:
    contenders.append(cyreal_contender)
  arrays = {"image": images, "label": labels.astype(np.int32)}
  in_memory = [{"image": i, "label": lb}
               for i, lb in zip(arrays["image"], arrays["label"])]
  for name, loader in ((IN_MEMORY, jax_data.SourceDataLoader(
      in_memory, workers=workers)), (NUMPY, jax_data.NumpyDataLoader(
          **arrays))):
    contender, release = _jax_data(name, loader, config)
    contenders.append(contender)
    releases.append(release)

  timings = compare(contenders, repeats)
  for release in releases:
    release()

  grain_names = [c.name for c in contenders if c.name.startswith("Grain")]
  best_grain = min(grain_names, key=lambda n: timings[n].median)
  rows = []
  for c in contenders:
    t = timings[c.name]
    rows.append([c.name, f"{1 / t.median:,.0f} ±{t.spread:.0%}",
                 f"{c.units:,}",
                 format_ratio(paired_ratio(timings, c.name, source_name))])
  over_grain = paired_ratio(timings, best_grain, source_name)
  over_cyreal = (paired_ratio(timings, CYREAL, source_name)
                 if cyreal_contender is not None else None)
  in_memory_ratio = paired_ratio(timings, IN_MEMORY, NUMPY)
  full = config == FULL
  if cyreal_contender is not None:
    notes.append(
        "cyreal's DiskSource reads the samples of a prefetch block (here "
        f"{config.cache * config.mb}, as many as jax_data's chunk) one "
        "after another in one host callback, while the scan waits; jax_data "
        "reads the next chunk with its workers while the device trains. "
        "So cyreal's records/s is bounded by 1 / (decode + step) per record "
        "and jax_data's by the cores: with decoding dominating, the ratio "
        "cannot approach 20x on this machine (at most about (decode + step) "
        "/ (decode / cores), about 3x on 2 cores).")
  return Section(
      key="sources",
      title="(e) Random-access sources: records that need decoding",
      description=(
          f"Records per second (median over {repeats} repeats, ± half the "
          f"range) from a source of {config.records:,} 28x28 uint8 images "
          "stored bz2-compressed (each decompressed by `bz2.decompress`, "
          "which releases the GIL), with their labels, each contender "
          "decoding every record it serves and training the data-loading "
          f"tutorial's 784-512-512-10 MLP on shuffled batches of {config.mb}"
          f". jax_data and cyreal run the steps in one jitted `lax.scan` "
          f"({config.steps} steps; cyreal {config.cyreal_steps}); Grain and "
          "PyTorch feed a jitted step from Python, as in the tutorial. A "
          f"measurement is {config.calls} such calls back to back, so that "
          "work a loader does ahead while the measurements settle is a small "
          "part of it. "
          f"Every contender has {workers} workers (the usable cores). The "
          "last column is jax_data's records/s over the contender's "
          "(median of per-repeat ratios). The last two rows serve the same "
          "images already decoded: a source of in-memory records, and "
          "`NumpyDataLoader` over the stacked arrays."),
      headers=["loader", "records/s", "records per measurement",
               "jax_data SourceDataLoader / this"],
      rows=rows, notes=notes,
      targets=[
          Target(f"(e) jax_data / {best_grain} records/s", ">= 1.5x",
                 format_ratio(over_grain),
                 over_grain >= 1.5 if full and over_grain else None),
          Target("(e) jax_data / cyreal DiskSource records/s", ">= 20x",
                 format_ratio(over_cyreal),
                 over_cyreal >= 20 if full and over_cyreal else None),
          Target("(e) in-memory source: SourceDataLoader / NumpyDataLoader "
                 "time", "<= 1.3x", format_ratio(in_memory_ratio),
                 in_memory_ratio <= 1.3 if full and in_memory_ratio
                 else None)],
      memory=[memory_row("(e) SourceDataLoader random_reference_data",
                         config.cache, config.mb, 28 * 28 + 4,
                         config.records)])
