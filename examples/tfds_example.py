"""SGLD over a TensorFlow Datasets pipeline with TensorflowDataLoader.

The pipeline that ``tfds.load`` returns goes straight into
``TensorflowDataLoader``; features that cannot become JAX arrays (text, such
as CIFAR-10's ``id``) are left out with ``exclude_keys``. Images stay
``uint8`` on their way to the device (a quarter of the bytes of float32) and
are scaled in the compiled model. Random chains feed the sampler; ordered
chains of the same kind of loader give the full-data passes over the
training and test splits.

The sampler, its evaluation and the figure come from
``examples/sgld_digits.py``: four SGLD chains of softmax regression, vmapped
and scanned in one jitted function.

When the data set is not in the TFDS data directory, the example runs on
``tfds.testing.mock_data``: random images and labels with the data set's
shapes, so nothing is downloaded. The mock test split repeats the training
split, so its "held-out" accuracy only shows the chains fitting random
labels. With the real data (run ``tfds.load(name, download=True)`` once
beforehand) the accuracies are the real thing.

Run it from the repository root::

    python examples/tfds_example.py                   # MNIST, 5,000 steps
    python examples/tfds_example.py --quick           # 500 steps, for CI
    python examples/tfds_example.py --dataset cifar10
"""

from __future__ import annotations

import argparse
import math
import os
import time

import jax.numpy as jnp

# The loader module keeps TensorFlow off the GPUs, where nothing imported
# TensorFlow before it; import it first.
from jax_data.tensorflow_loader import TensorflowDataLoader  # isort: skip
# The main example, beside this script: Python puts the script's folder on
# the module path.
import sgld_digits
import tensorflow_datasets as tfds


def load(name: str, data_dir: str | None, mock_examples: int):
  """The train and test splits, real if prepared, else TFDS mock data."""
  try:
    (train, test), info = tfds.load(name, split=["train", "test"],
                                    data_dir=data_dir, download=False,
                                    with_info=True)
    return train, test, info, False
  except AssertionError:  # TFDS's answer when the data are not prepared
    with tfds.testing.mock_data(num_examples=mock_examples):
      (train, test), info = tfds.load(name, split=["train", "test"],
                                      data_dir=data_dir, with_info=True)
    return train, test, info, True


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--dataset", default="mnist",
                      help="a TFDS image classification data set with "
                           "'image' and 'label' features (mnist, "
                           "fashion_mnist, cifar10, ...)")
  parser.add_argument("--data-dir", default=None,
                      help="TFDS data directory (default: TFDS's own)")
  parser.add_argument("--mock-examples", type=int, default=None,
                      help="examples per split of the mock data (default "
                           "2,000; 1,000 with --quick)")


def main() -> None:
  args = sgld_digits.parse_args(__doc__.split("\n")[0], steps=5_000,
                                quick_steps=500, out="tfds_example.png",
                                thin=100, add_arguments=add_arguments)
  if args.mock_examples is None:
    args.mock_examples = 1_000 if args.quick else 2_000

  start = time.perf_counter()
  train, test, info, mock = load(args.dataset, args.data_dir,
                                 args.mock_examples)
  text = [key for key, feature in info.features.items()
          if isinstance(feature, tfds.features.Text)]
  # in_memory: MNIST-sized data fit in host memory and the pipeline has no
  # random augmentation, so the loaders read and decode it once and serve
  # chunks from NumPy arrays (the same streams, several times faster).
  train_loader = TensorflowDataLoader(train, shuffle_cache=1_000,
                                      exclude_keys=text, in_memory=True)
  test_loader = TensorflowDataLoader(test, exclude_keys=text,
                                     in_memory=True)
  image_shape = info.features["image"].shape
  features = math.prod(image_shape)
  classes = info.features["label"].num_classes
  if mock:
    print(f"{args.dataset} is not in the TFDS data directory: using TFDS mock "
          "data (random images and labels; its test split repeats the "
          "training split)")
  print(f"{args.dataset}{' (mock)' if mock else ''}"
        f": {train_loader.static_information['observation_count']:,} "
        f"training and {test_loader.static_information['observation_count']:,}"
        f" test images of shape {image_shape}, {classes} classes"
        f"{', leaving out ' + ', '.join(text) if text else ''}; "
        f"loaded in {time.perf_counter() - start:.1f} s")

  def pixels(batch):
    flat = batch["image"].reshape(batch["image"].shape[0], -1)
    return flat.astype(jnp.float32) / 255.0

  model = sgld_digits.softmax_regression(pixels, label_key="label")
  # Full-data evaluation of every sample is costly on 60,000 images, so
  # only the last sample of each segment is evaluated along the way.
  segment_steps = 100 if args.quick else 500
  # Random chains of a TensorflowDataLoader always shuffle (with a buffer
  # of shuffle_cache observations); only the seed is chosen per chain.
  run = sgld_digits.sample_chains(
      model, train_loader, test_loader, args, features, classes,
      segment_steps=segment_steps, chain_options={},
      evaluate_every=max(1, segment_steps // args.thin))
  sgld_digits.summarize(
      model, test_loader, run, args, os.path.abspath(args.out),
      title=f"SGLD for softmax regression on {args.dataset}"
            f"{' (mock data)' if mock else ''}, {args.chains} chains")


if __name__ == "__main__":
  main()
