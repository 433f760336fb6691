"""Bayesian softmax regression on scikit-learn's digits with SGLD and jax_data.

Four chains of stochastic-gradient Langevin dynamics (SGLD) run side by side:
``jax.vmap`` over the chains, ``lax.scan`` over the steps, one ``jax.jit``
around both. Every step draws its own mini-batch with
``jax_data.random_reference_data``, inside the compiled loop. Then
``jax_data.full_data_mapper`` maps the samples over the training set
(full-data log-likelihood) and over the held-out test set (accuracy of each
sample, and the posterior predictive of each chain and of all chains).

The loop runs in segments, so that a progress bar can move between them;
each segment is one call of the same compiled function, and the data states
carry the chains' positions from one call to the next.

Run it from the repository root::

    python examples/sgld_digits.py            # 20,000 steps, about 10-15 s
    python examples/sgld_digits.py --quick    # 2,000 steps, for CI
    python examples/sgld_digits.py --out /tmp/sgld.png

It prints a summary and writes a PNG figure: the log-likelihood and the
held-out accuracy of every sample, one line per chain.
``examples/tfds_example.py`` reuses the sampler over a TensorFlow pipeline.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.ticker
import numpy as np
import tqdm
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jax_data

matplotlib.use("Agg")  # write files only, never open a window
import matplotlib.pyplot as plt

Params = dict[str, jax.Array]
Batch = dict[str, jax.Array]


def parse_args(description: str, steps: int, quick_steps: int, out: str,
               thin: int = 20, add_arguments=None) -> argparse.Namespace:
  """The command line of both examples; ``add_arguments(parser)`` adds
  more."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true",
                      help=f"a short run ({quick_steps:,} steps) for smoke "
                           "tests")
  parser.add_argument("--steps", type=int, default=None,
                      help=f"SGLD steps per chain (default {steps:,}; "
                           f"{quick_steps:,} with --quick)")
  parser.add_argument("--chains", type=int, default=4)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--step-size", type=float, default=1e-3,
                      help="initial SGLD step size; it decays as "
                           "(1 + t / 1000) ** -0.55")
  parser.add_argument("--thin", type=int, default=thin,
                      help="keep every THIN-th state as a sample")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=out,
                      help="path of the PNG figure (default: %(default)s "
                           "in the current directory)")
  if add_arguments is not None:
    add_arguments(parser)
  args = parser.parse_args()
  if args.steps is None:
    args.steps = quick_steps if args.quick else steps
  return args


# -- data -------------------------------------------------------------------

def load_split(seed: int):
  """Digits (8x8 images, 10 classes), standardised, 75 % / 25 % split."""
  x, y = load_digits(return_X_y=True)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=0.25, random_state=seed, stratify=y)
  mean, scale = x_train.mean(axis=0), x_train.std(axis=0)
  scale[scale == 0] = 1.0  # pixels that are blank in every training image
  x_train = ((x_train - mean) / scale).astype(np.float32)
  x_test = ((x_test - mean) / scale).astype(np.float32)
  return x_train, y_train.astype(np.int32), x_test, y_test.astype(np.int32)


# -- model ------------------------------------------------------------------

class Model(NamedTuple):
  """A classifier: class scores and true labels of a batch."""
  logits: Callable[[Params, Batch], jax.Array]  # (batch, classes)
  labels: Callable[[Batch], jax.Array]  # (batch,), int


def softmax_regression(features: Callable[[Batch], jax.Array],
                       label_key: str) -> Model:
  """Softmax regression on ``features(batch)``, of shape (batch, d)."""
  def logits(params: Params, batch: Batch) -> jax.Array:
    return features(batch) @ params["w"] + params["b"]
  return Model(logits, lambda batch: batch[label_key])


def initial_params(key: jax.Array, features: int, classes: int) -> Params:
  return {"w": 0.01 * jax.random.normal(key, (features, classes)),
          "b": jnp.zeros(classes)}


def log_likelihood(model: Model, params: Params, batch: Batch) -> jax.Array:
  """log p(label | observation, params) of each observation of a batch."""
  log_probs = jax.nn.log_softmax(model.logits(params, batch))
  labels = model.labels(batch)
  return jnp.take_along_axis(log_probs, labels[:, None], axis=1)[:, 0]


def log_prior(params: Params) -> jax.Array:
  """Independent standard normal prior on every weight."""
  return sum(-0.5 * jnp.sum(p ** 2) for p in jax.tree.leaves(params))


def over_samples(fun: Callable) -> Callable:
  """``fun(params, batch)`` for a (chains, samples, ...) stack of params."""
  return jax.vmap(jax.vmap(fun, (0, None)), (0, None))


# -- sampler ----------------------------------------------------------------

class Chain(NamedTuple):
  """Everything one chain carries from step to step."""
  params: Params
  data: jax_data.CacheState  # position in the chain's mini-batch stream
  key: jax.Array  # PRNG key of the Langevin noise


def make_segment(batch_fn, model: Model):
  """A segment of one chain: a scan over samples, each a scan over the SGLD
  steps between two samples."""

  def sgld_step(chain: Chain, step_size: jax.Array) -> tuple[Chain, None]:
    data, (batch, info) = batch_fn(chain.data, information=True)

    def log_posterior(params):
      # Unbiased estimate: scale the batch up to the whole training set,
      # counting real observations only (fillers appear with in_epochs).
      ll = jnp.where(info.mask, log_likelihood(model, params, batch), 0.0)
      scale = info.observation_count / jnp.sum(info.mask)
      return scale * jnp.sum(ll) + log_prior(params)

    grads = jax.grad(log_posterior)(chain.params)
    key, noise_key = jax.random.split(chain.key)
    leaves, treedef = jax.tree.flatten(chain.params)
    noise = treedef.unflatten([
        jax.random.normal(k, leaf.shape)
        for k, leaf in zip(jax.random.split(noise_key, len(leaves)), leaves)])
    params = jax.tree.map(
        lambda p, g, n: p + 0.5 * step_size * g + jnp.sqrt(step_size) * n,
        chain.params, grads, noise)
    return Chain(params, data, key), None

  def one_sample(chain: Chain, step_sizes: jax.Array) -> tuple[Chain, Params]:
    chain, _ = jax.lax.scan(sgld_step, chain, step_sizes)
    return chain, chain.params

  def segment(chain: Chain, step_sizes: jax.Array) -> tuple[Chain, Params]:
    # step_sizes has shape (samples, thin); the samples come out stacked.
    return jax.lax.scan(one_sample, chain, step_sizes)

  return segment


def step_sizes(first: int, count: int, thin: int, initial: float) -> jax.Array:
  """Polynomially decaying step sizes of steps first .. first + count - 1."""
  t = np.arange(first, first + count, dtype=np.float64)
  eps = initial * (1.0 + t / 1000.0) ** -0.55
  return jnp.asarray(eps.reshape(count // thin, thin), jnp.float32)


# -- evaluation with full-data maps -----------------------------------------

def make_evaluate(model: Model, train_loader, test_loader, batch_size: int):
  """Full-data log-likelihood per training observation, and accuracy on the
  test set, of every sample of a (chains, samples, ...) stack."""
  train_map, train_release = jax_data.full_data_mapper(
      train_loader, cached_batches_count=4, mb_size=batch_size)
  test_map, test_release = jax_data.full_data_mapper(
      test_loader, cached_batches_count=4, mb_size=batch_size)

  # masking=True: one result per batch; the mapped functions drop the
  # fillers of the last batch themselves, and the batch results are summed.
  def batch_log_likelihood(batch, mask, samples):
    ll = over_samples(lambda p, b: log_likelihood(model, p, b))(samples, batch)
    return jnp.sum(jnp.where(mask, ll, 0.0), axis=-1), samples

  def batch_correct(batch, mask, samples):
    predicted = jnp.argmax(over_samples(model.logits)(samples, batch), -1)
    hits = (predicted == model.labels(batch)) & mask
    return jnp.sum(hits, axis=-1), samples

  n_train = train_loader.static_information["observation_count"]
  n_test = test_loader.static_information["observation_count"]

  @jax.jit
  def evaluate(samples: Params) -> tuple[jax.Array, jax.Array]:
    ll, _ = train_map(batch_log_likelihood, samples, masking=True)
    hits, _ = test_map(batch_correct, samples, masking=True)
    return ll.sum(axis=0) / n_train, hits.sum(axis=0) / n_test

  def release():
    train_release()
    test_release()

  return evaluate, release


def posterior_predictive(model: Model, test_loader, samples: Params,
                         batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """p(class | observation) averaged over each chain's samples, for every
  test observation, shape (observations, chains, classes); and the labels."""
  mapper_fn, release_fn = jax_data.full_data_mapper(
      test_loader, cached_batches_count=4, mb_size=batch_size)

  def predictive(batch, samples):
    probs = jax.nn.softmax(over_samples(model.logits)(samples, batch))
    per_chain = probs.mean(axis=1)  # (chains, batch, classes)
    return (jnp.swapaxes(per_chain, 0, 1), model.labels(batch)), samples

  # masking=False: one result per observation, the fillers dropped.
  (probs, labels), _ = jax.jit(lambda s: mapper_fn(predictive, s))(samples)
  release_fn()
  return np.asarray(probs), np.asarray(labels)


# -- the whole run ----------------------------------------------------------

class Run(NamedTuple):
  samples: Params  # (chains, samples, ...), NumPy
  evaluated: np.ndarray  # (points,): the SGLD step of each evaluated sample
  log_lik: np.ndarray  # (chains, points): per training observation
  accuracy: np.ndarray  # (chains, points): on the test set
  compile_seconds: float
  sampling_seconds: float


def sample_chains(model: Model, train_loader, test_loader, args, features: int,
                  classes: int, segment_steps: int,
                  chain_options: dict | None = None,
                  evaluate_every: int = 1) -> Run:
  """Runs ``args.chains`` SGLD chains for ``args.steps`` steps, in segments
  of ``segment_steps``, with a progress bar.

  ``chain_options`` are the loader's keywords for the chains (default
  ``shuffle=True``; the seeds are ``args.seed``, ``args.seed + 1``, ...).
  Every ``evaluate_every``-th sample is evaluated on all training and test
  data.
  """
  if chain_options is None:
    chain_options = {"shuffle": True}
  per_segment = segment_steps // args.thin
  if (args.steps % segment_steps or segment_steps % args.thin
      or per_segment % evaluate_every):
    raise SystemExit(
        f"--steps must be a multiple of {segment_steps}, and {segment_steps} "
        f"a multiple of --thin * {evaluate_every}; got --steps={args.steps} "
        f"--thin={args.thin}")

  # The device keeps a cache of batches per chain, refreshed by one host
  # call for all chains together; "auto" sizes it for the chains init_fn
  # makes (up to 1,000 batches each, fewer for many chains).
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      train_loader, cached_batches_count="auto", mb_size=args.batch_size)

  # One data state per chain, each with its own seed, stacked for vmap.
  data_states = init_fn(seed=range(args.seed, args.seed + args.chains),
                        **chain_options)
  keys = jax.random.split(jax.random.key(args.seed), 2 * args.chains)
  chains = Chain(
      params=jax.vmap(initial_params, (0, None, None))(
          keys[:args.chains], features, classes),
      data=data_states,
      key=keys[args.chains:])

  # Compile ahead of time, so that the timing below is of sampling alone.
  print("compiling the sampler ...", flush=True)
  start = time.perf_counter()
  run_segment = jax.jit(jax.vmap(make_segment(batch_fn, model),
                                 in_axes=(0, None)))
  run_segment = run_segment.lower(
      chains, step_sizes(0, segment_steps, args.thin, args.step_size)
  ).compile()
  compile_seconds = time.perf_counter() - start
  evaluate, release_evaluate = make_evaluate(model, train_loader,
                                             test_loader, args.batch_size)

  samples, log_lik, accuracy = [], [], []
  sampling_seconds = 0.0
  with tqdm.tqdm(total=args.steps, unit="step", desc="SGLD",
                 dynamic_ncols=True) as bar:
    for first in range(0, args.steps, segment_steps):
      sizes = step_sizes(first, segment_steps, args.thin, args.step_size)
      start = time.perf_counter()
      chains, new_samples = run_segment(chains, sizes)
      jax.block_until_ready(new_samples)
      sampling_seconds += time.perf_counter() - start
      # Outside the timed, compiled loop: full-data log-likelihood and
      # test accuracy of the new samples.
      ll, acc = evaluate(jax.tree.map(
          lambda s: s[:, evaluate_every - 1::evaluate_every], new_samples))
      samples.append(jax.device_get(new_samples))
      log_lik.append(np.asarray(ll))
      accuracy.append(np.asarray(acc))
      bar.set_postfix(loglik=f"{float(ll[:, -1].mean()):.3f}",
                      test_acc=f"{100 * float(acc[:, -1].mean()):.1f}%")
      bar.update(segment_steps)
  release_fn()
  release_evaluate()
  every = args.thin * evaluate_every
  return Run(jax.tree.map(lambda *s: np.concatenate(s, axis=1), *samples),
             np.arange(every, args.steps + 1, every),
             np.concatenate(log_lik, axis=1), np.concatenate(accuracy, axis=1),
             compile_seconds, sampling_seconds)


def summarize(model: Model, test_loader, run: Run, args, path: str,
              title: str) -> None:
  """The posterior predictive of the second half of every chain, a printed
  summary and the figure."""
  kept = jax.tree.map(lambda s: s[:, s.shape[1] // 2:], run.samples)
  probs, labels = posterior_predictive(model, test_loader, kept,
                                       args.batch_size)
  chain_acc = (probs.argmax(axis=-1) == labels[:, None]).mean(axis=0)
  ensemble_acc = float((probs.mean(axis=1).argmax(axis=-1) == labels).mean())
  samples_per_chain = run.samples["w"].shape[1]

  print(f"SGLD: {args.chains} chains x {args.steps:,} steps, mini-batches "
        f"of {args.batch_size}, {samples_per_chain} samples per chain (one "
        f"every {args.thin} steps)")
  print(f"compiled in {run.compile_seconds:.1f} s; sampled in "
        f"{run.sampling_seconds:.1f} s = "
        f"{args.steps / run.sampling_seconds:,.0f} steps/s for all "
        f"{args.chains} chains together "
        f"({args.chains * args.steps / run.sampling_seconds:,.0f} "
        "chain-steps/s)")
  print("held-out accuracy of the posterior predictive "
        f"({samples_per_chain - samples_per_chain // 2} samples per chain "
        "after burn-in):")
  for c, acc in enumerate(chain_acc):
    print(f"  chain {c}: {100 * acc:.1f} %")
  print(f"  all chains: {100 * ensemble_acc:.1f} %")
  burn_in = (samples_per_chain // 2) * args.thin  # last step left out
  save_figure(path, title, run, burn_in, chain_acc, ensemble_acc)
  print(f"figure: {path}")


# -- figure -----------------------------------------------------------------

def save_figure(path: str, title: str, run: Run, burn_in: int,
                chain_acc: np.ndarray, ensemble_acc: float) -> None:
  """Log-likelihood and held-out accuracy against the SGLD step, per chain."""
  steps, chains = run.evaluated, run.log_lik.shape[0]
  fig, (ax_ll, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax in (ax_ll, ax_acc):
    ax.axvspan(0, burn_in, color="0.92", zorder=0,
               label="burn-in (left out of the predictive)")
  for c in range(chains):
    color = colors[c % len(colors)]
    ax_ll.plot(steps, -run.log_lik[c], color=color, lw=0.8,
               label=f"chain {c}")
    ax_acc.plot(steps, 100 * run.accuracy[c], color=color, lw=0.8,
                label=f"chain {c}: predictive {100 * chain_acc[c]:.1f} %")
  ax_acc.axhline(100 * ensemble_acc, color="black", ls="--", lw=1,
                 label=f"all chains: predictive {100 * ensemble_acc:.1f} %")
  ax_ll.set_yscale("log")
  plain = matplotlib.ticker.FormatStrFormatter("%.2g")
  ax_ll.yaxis.set_major_formatter(plain)
  ax_ll.yaxis.set_minor_formatter(plain)
  # Room below the curves for the legend.
  ax_acc.set_ylim(max(0.0, np.percentile(100 * run.accuracy, 0.5) - 6), 100)
  ax_ll.set(xlabel="SGLD step", xlim=(0, steps[-1]),
            ylabel="- log-likelihood per training observation",
            title="Full-data log-likelihood of the samples")
  ax_acc.set(xlabel="SGLD step", xlim=(0, steps[-1]),
             ylabel="accuracy on the test set (%)",
             title="Held-out accuracy of the samples")
  ax_ll.legend(loc="upper right", fontsize="small", framealpha=0.9)
  ax_acc.legend(loc="lower center", fontsize="small", ncol=2,
                framealpha=0.9)
  for ax in (ax_ll, ax_acc):
    ax.grid(alpha=0.3)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# -- main -------------------------------------------------------------------

def main() -> None:
  args = parse_args(__doc__.split("\n")[0], steps=20_000, quick_steps=2_000,
                    out="sgld_digits.png")
  x_train, y_train, x_test, y_test = load_split(args.seed)
  train_loader = jax_data.NumpyDataLoader(x=x_train, y=y_train)
  test_loader = jax_data.NumpyDataLoader(x=x_test, y=y_test)
  features, classes = x_train.shape[1], int(y_train.max()) + 1
  print(f"digits: {len(x_train)} training and {len(x_test)} test images, "
        f"{features} features, {classes} classes")

  model = softmax_regression(lambda batch: batch["x"], label_key="y")
  run = sample_chains(model, train_loader, test_loader, args, features,
                      classes, segment_steps=200 if args.quick else 1_000)
  summarize(model, test_loader, run, args, os.path.abspath(args.out),
            title=f"SGLD for softmax regression on digits, {args.chains} "
                  "chains")


if __name__ == "__main__":
  main()
