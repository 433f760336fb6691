"""The data-loading tutorial's MLP, trained inside one ``lax.scan`` per epoch
from each kind of random-access source in turn.

The JAX tutorial on data loaders trains a 784-512-512-10 MLP on MNIST from a
PyTorch dataset, Grain, TFDS and Hugging Face, one Python-loop step per
batch. Here every epoch is one compiled ``lax.scan`` that draws its batches
from :class:`jax_data.SourceDataLoader` (shuffled, in epochs, the last batch
masked), over:

* a PyTorch-style map dataset (``__len__`` / ``__getitem__``);
* a Grain ``MapDataset``;
* an ArrayRecord file of PNG-encoded images, decoded by a transform;
* a Hugging Face ``datasets.Dataset``;
* an HDF5 file, read with ``NumpyDataLoader(copy=False)``.

No download: the data are synthetic MNIST-shaped digits (ten noisy
prototype images), written to a temporary directory. Every source gives the
same batches for the same seed, so every run ends with the same accuracy.

Usage::

  python examples/sources_mnist.py            # 12,000 images, 3 epochs
  python examples/sources_mnist.py --quick    # small, for the test suite
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import tempfile
import time
from typing import Callable
from typing import Dict
from typing import List
from typing import Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing downloads
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.scipy.special import logsumexp  # noqa: E402

import jax_data  # noqa: E402

LAYER_SIZES = [784, 512, 512, 10]  # the tutorial's network
STEP_SIZE = 0.5  # the tutorial: 0.01 over 8 epochs of the real MNIST
BATCH_SIZE = 128


# -- data ---------------------------------------------------------------------


def synthetic_mnist(count: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
  """MNIST-shaped digits: one smooth random prototype per class, plus
  noise, as uint8 images of 28 x 28."""
  prototypes = np.random.default_rng(1234).normal(size=(10, 7, 7))
  prototypes = np.kron(prototypes, np.ones((4, 4)))  # 28 x 28 blobs
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 10, count)
  images = prototypes[labels] * 45 + 128 + rng.normal(0, 85, (count, 28, 28))
  return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.int64)


class MapStyleDataset:
  """A PyTorch-style map dataset, as in the tutorial."""

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    self.images, self.labels = images, labels

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
    return {"image": self.images[index], "label": self.labels[index]}


def encode(image: np.ndarray, label: int) -> bytes:
  """A record of the ArrayRecord file: a PNG image and its label."""
  from PIL import Image
  png = io.BytesIO()
  Image.fromarray(image).save(png, format="PNG")
  return pickle.dumps({"png": png.getvalue(), "label": int(label)})


def decode(record: bytes) -> Dict[str, np.ndarray]:
  """The transform of the ArrayRecord source: decodes the PNG."""
  from PIL import Image
  data = pickle.loads(record)
  return {"image": np.asarray(Image.open(io.BytesIO(data["png"]))),
          "label": np.int64(data["label"])}


def sources(images: np.ndarray, labels: np.ndarray, folder: str
            ) -> List[Tuple[str, Callable[[], jax_data.HostDataLoader]]]:
  """(name, loader factory) of every kind of source over the same data."""
  import datasets
  import grain
  import h5py
  from array_record.python.array_record_module import ArrayRecordWriter

  records_path = os.path.join(folder, "train.array_record")
  writer = ArrayRecordWriter(records_path, "group_size:1")
  for image, label in zip(images, labels):
    writer.write(encode(image, label))
  writer.close()
  hdf5_path = os.path.join(folder, "train.h5")
  with h5py.File(hdf5_path, "w") as f:
    f["image"], f["label"] = images, labels
  hdf5 = h5py.File(hdf5_path, "r")
  records = [{"image": im, "label": lb} for im, lb in zip(images, labels)]
  return [
      ("PyTorch-style dataset",
       lambda: jax_data.SourceDataLoader(MapStyleDataset(images, labels))),
      ("Grain MapDataset",
       lambda: jax_data.SourceDataLoader(grain.MapDataset.source(records))),
      ("ArrayRecord + PNG decode",
       lambda: jax_data.SourceDataLoader(
           grain.sources.ArrayRecordDataSource([records_path]),
           transform=decode)),
      ("Hugging Face dataset",
       lambda: jax_data.SourceDataLoader(datasets.Dataset.from_dict(
           {"image": images, "label": labels}).with_format(
               "numpy", dtype=np.uint8))),
      ("HDF5 (NumpyDataLoader)",
       lambda: jax_data.NumpyDataLoader(copy=False, image=hdf5["image"],
                                        label=hdf5["label"])),
  ]


# -- the tutorial's model ---------------------------------------------------


def init_network_params(sizes: List[int], key: jax.Array):
  keys = jax.random.split(key, len(sizes))
  return [(1e-2 * jax.random.normal(k1, (n, m)), 1e-2 * jax.random.normal(
      k2, (n,))) for m, n, k in zip(sizes[:-1], sizes[1:], keys)
          for k1, k2 in [jax.random.split(k)]]


def predict(params, images: jax.Array) -> jax.Array:
  activations = images
  for w, b in params[:-1]:
    activations = jnp.maximum(0, activations @ w.T + b)
  final_w, final_b = params[-1]
  logits = activations @ final_w.T + final_b
  return logits - logsumexp(logits, axis=-1, keepdims=True)


def loss(params, images, targets, mask):
  """The tutorial's loss, with padded observations masked out."""
  per_image = -jnp.mean(predict(params, images) * targets, axis=-1)
  return jnp.sum(per_image * mask) / jnp.maximum(jnp.sum(mask), 1)


def accuracy(params, images: np.ndarray, labels: np.ndarray) -> float:
  x = jnp.asarray(images.reshape(len(images), -1), jnp.float32) / 255
  return float(jnp.mean(jnp.argmax(predict(params, x), -1) == labels))


def train(loader, epochs: int, count: int, test) -> Tuple[float, float]:
  """Trains the MLP, one compiled scan per epoch; returns the test accuracy
  and the time per epoch after the first (which compiles)."""
  steps = -(-count // BATCH_SIZE)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, cached_batches_count=min(20, steps), mb_size=BATCH_SIZE)

  @jax.jit
  def epoch(params, state):
    def step(carry, _):
      params, state = carry
      state, (batch, info) = batch_fn(state, information=True)
      images = batch["image"].reshape(BATCH_SIZE, -1).astype(jnp.float32)
      targets = jax.nn.one_hot(batch["label"], 10)
      grads = jax.grad(loss)(params, images / 255, targets, info.mask)
      params = [(w - STEP_SIZE * dw, b - STEP_SIZE * db)
                for (w, b), (dw, db) in zip(params, grads)]
      return (params, state), None
    return lax.scan(step, (params, state), None, length=steps)[0]

  params = init_network_params(LAYER_SIZES, jax.random.PRNGKey(0))
  state = init_fn(seed=0, shuffle=True, in_epochs=True)
  times = []
  for _ in range(epochs):
    start = time.perf_counter()
    params, state = jax.block_until_ready(epoch(params, state))
    times.append(time.perf_counter() - start)
  release_fn()
  later = times[1:] or times
  return accuracy(params, *test), sum(later) / len(later)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="a small run, for the test suite")
  args = parser.parse_args()
  count, epochs = (4_000, 4) if args.quick else (12_000, 3)
  images, labels = synthetic_mnist(count, seed=0)
  test = synthetic_mnist(count // 5, seed=1)
  print(f"{count} synthetic MNIST-shaped images, {epochs} epochs of "
        f"{-(-count // BATCH_SIZE)} steps of {BATCH_SIZE}; each epoch one "
        "jitted lax.scan")
  results = []
  with tempfile.TemporaryDirectory() as folder:
    for name, make_loader in sources(images, labels, folder):
      test_accuracy, seconds = train(make_loader(), epochs, count, test)
      results.append(test_accuracy)
      print(f"  {name:<26} test accuracy {test_accuracy:.3f}   "
            f"{seconds:.2f} s per epoch")
  same = all(abs(r - results[0]) < 1e-6 for r in results)
  print("every source gave the same batches and the same accuracy:",
        "yes" if same else "NO")


if __name__ == "__main__":
  main()
