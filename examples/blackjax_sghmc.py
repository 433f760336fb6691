"""Bayesian logistic regression on breast-cancer data with BlackJAX's SGHMC
and jax_data.

Four chains of BlackJAX's stochastic-gradient Hamiltonian Monte Carlo
(``blackjax.sghmc``) run side by side in one compiled loop: ``jax.vmap`` over
the chains, :func:`jax_data.scan` over the steps, which hands every step the
next mini-batch of its chain from ``jax_data.random_reference_data``. Then
``jax_data.full_data_mapper`` maps the samples over every training
observation (log-likelihood of each sample) and every test observation (the
posterior predictive).

The data set is scikit-learn's bundled Wisconsin breast-cancer data (569
tumours, 30 features, malignant or benign); nothing is downloaded.

Run it from the repository root::

    python examples/blackjax_sghmc.py            # 10,000 steps, about 10 s
    python examples/blackjax_sghmc.py --quick    # 1,000 steps, for CI
    python examples/blackjax_sghmc.py --out /tmp/sghmc.png

It prints a summary and writes a PNG figure: the trace of three weights and
the training log-likelihood of every sample, one line per chain, and the
posterior predictive probability of each test tumour.
"""

from __future__ import annotations

import argparse
import os
import time

import blackjax
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import tqdm
from blackjax.sgmcmc.gradients import grad_estimator
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split

import jax_data

matplotlib.use("Agg")  # write files only, never open a window
import matplotlib.pyplot as plt

Params = dict[str, jax.Array]


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="a short run (1,000 steps) for smoke tests")
  parser.add_argument("--steps", type=int, default=None,
                      help="SGHMC steps per chain (default 10,000; 1,000 "
                           "with --quick); a multiple of 500")
  parser.add_argument("--chains", type=int, default=4)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--step-size", type=float, default=5e-3)
  parser.add_argument("--integration-steps", type=int, default=10,
                      help="leapfrog steps of one SGHMC step (one batch)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="blackjax_sghmc.png",
                      help="path of the PNG figure (default: %(default)s)")
  args = parser.parse_args()
  if args.steps is None:
    args.steps = 1_000 if args.quick else 10_000
  if args.steps % SEGMENT:
    parser.error(f"--steps must be a multiple of {SEGMENT}, got "
                 f"{args.steps}")
  return args


SEGMENT = 500  # steps per call of the compiled sampler (a progress tick)
THIN = 10  # keep every THIN-th position as a sample


# -- data and model ---------------------------------------------------------

def load_split(seed: int):
  """Standardised features, 75 % / 25 % split; label 1 = malignant."""
  x, y = load_breast_cancer(return_X_y=True)
  y = 1 - y  # scikit-learn codes malignant as 0
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=0.25, random_state=seed, stratify=y)
  mean, scale = x_train.mean(axis=0), x_train.std(axis=0)
  return ((x_train - mean) / scale).astype(np.float32), \
      y_train.astype(np.float32), \
      ((x_test - mean) / scale).astype(np.float32), y_test.astype(np.float32)


def log_prior(params: Params) -> jax.Array:
  """Standard normal prior on every weight."""
  return sum(-0.5 * jnp.sum(p**2) for p in jax.tree.leaves(params))


def logit(params: Params, x: jax.Array) -> jax.Array:
  return x @ params["w"] + params["b"]


def log_likelihood(params: Params, observation) -> jax.Array:
  """log p(y | x, params) of one observation (Bernoulli-logit)."""
  z = logit(params, observation["x"])
  return observation["y"] * z - jax.nn.softplus(z)


# -- sampler ----------------------------------------------------------------

def make_sampler(batch_fn, observation_count: int, args):
  """One jitted call: ``SEGMENT`` SGHMC steps of every chain, returning the
  chains' new positions, data states and keys, and every ``THIN``-th
  position."""
  gradient = grad_estimator(log_prior, log_likelihood, observation_count)
  sghmc = blackjax.sghmc(gradient,
                         num_integration_steps=args.integration_steps)

  def one_chain(key, params, data_state):
    def step(carry, batch):
      key, params = carry
      key, step_key = jax.random.split(key)
      params = sghmc.step(step_key, params, batch, args.step_size)
      return (key, params), params

    ((key, params), data_state), trace = jax_data.scan(
        step, (key, params), data_state, batch_fn=batch_fn, length=SEGMENT)
    samples = jax.tree.map(lambda t: t[THIN - 1::THIN], trace)
    return key, params, data_state, samples

  return jax.jit(jax.vmap(one_chain))


def make_log_likelihood(loader, batch_size: int):
  """Mean log-likelihood per training observation of every sample of a
  (chains, samples, ...) stack, over the whole training set."""
  mapper_fn, release_fn = jax_data.full_data_mapper(
      loader, cached_batches_count=4, mb_size=batch_size)
  count = loader.static_information["observation_count"]
  per_sample = jax.vmap(jax.vmap(jax.vmap(log_likelihood, (None, 0)),
                                 (0, None)), (0, None))

  def batch_sum(batch, mask, samples):
    ll = per_sample(samples, batch)  # (chains, samples, batch)
    return jnp.sum(jnp.where(mask, ll, 0.0), axis=-1), samples

  @jax.jit
  def mean_log_likelihood(samples):
    sums, _ = mapper_fn(batch_sum, samples, masking=True)
    return sums.sum(axis=0) / count

  return mean_log_likelihood, release_fn


def posterior_predictive(loader, samples: Params, batch_size: int):
  """p(malignant | x) of every test observation, averaged over all samples
  of all chains, and each chain's; and the labels."""
  mapper_fn, release_fn = jax_data.full_data_mapper(
      loader, cached_batches_count=4, mb_size=batch_size)

  def predict(batch, samples):
    probs = jax.nn.sigmoid(jax.vmap(jax.vmap(logit, (0, None)), (0, None))(
        samples, batch["x"]))  # (chains, samples, batch)
    per_chain = probs.mean(axis=1)
    return (per_chain.mean(axis=0), per_chain.T, batch["y"]), samples

  (probs, per_chain, labels), _ = jax.jit(
      lambda s: mapper_fn(predict, s))(samples)
  release_fn()
  return np.asarray(probs), np.asarray(per_chain), np.asarray(labels)


# -- figure -----------------------------------------------------------------

def save_figure(path: str, steps: np.ndarray, samples: Params,
                log_lik: np.ndarray, probs: np.ndarray, labels: np.ndarray,
                burn_in: int) -> None:
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  ax_w, ax_ll, ax_pred = axes
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  chains = log_lik.shape[0]
  shown = [0, 1, 2]
  styles = ["-", "--", ":"]
  for ax in (ax_w, ax_ll):
    ax.axvspan(0, burn_in, color="0.92", zorder=0, label="burn-in")
  for c in range(chains):
    color = colors[c % len(colors)]
    for j, style in zip(shown, styles):
      ax_w.plot(steps, samples["w"][c, :, j], color=color, ls=style, lw=0.7,
                label=f"chain {c}" if j == 0 else None)
    ax_ll.plot(steps, log_lik[c], color=color, lw=0.8, label=f"chain {c}")
  ax_w.set(xlabel="SGHMC step", ylabel="weight",
           title="Trace of weights 0 (solid), 1 (dashed), 2 (dotted)")
  ax_ll.set(xlabel="SGHMC step",
            ylabel="log-likelihood per training observation",
            title="Full-data log-likelihood of the samples")
  order = np.argsort(probs)
  rank = np.empty_like(order)
  rank[order] = np.arange(len(order))
  for label, name, color in ((0, "benign", colors[0]),
                             (1, "malignant", colors[1])):
    chosen = labels == label
    ax_pred.scatter(rank[chosen], probs[chosen], color=color, s=10,
                    label=f"{name} ({int(chosen.sum())})")
  ax_pred.axhline(0.5, color="black", lw=0.8, ls="--")
  ax_pred.set(xlabel="test tumour (sorted by prediction)",
              ylabel="posterior predictive p(malignant)",
              title="Posterior predictive on the test set")
  ax_pred.legend(loc="upper left", fontsize="small", framealpha=0.9)
  for ax in (ax_w, ax_ll):
    ax.legend(loc="best", fontsize="small", framealpha=0.9)
    ax.grid(alpha=0.3)
  ax_pred.grid(alpha=0.3)
  fig.suptitle(f"BlackJAX SGHMC with jax_data, {chains} chains")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# -- main -------------------------------------------------------------------

def main() -> None:
  args = parse_args()
  x_train, y_train, x_test, y_test = load_split(args.seed)
  train = jax_data.NumpyDataLoader(x=x_train, y=y_train)
  test = jax_data.NumpyDataLoader(x=x_test, y=y_test)
  count, features = x_train.shape
  print(f"breast cancer: {count} training and {len(x_test)} test tumours, "
        f"{features} features")

  # A cache of batches per chain on the device, refreshed by one host call
  # for all chains together; "auto" sizes it for the chains init_fn makes
  # (up to 1,000 batches each, fewer for many chains).
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      train, cached_batches_count="auto", mb_size=args.batch_size)
  # One data state per chain, each with its own seed, stacked for vmap.
  data_states = init_fn(
      seed=range(args.seed, args.seed + args.chains), shuffle=True)
  keys = jax.random.split(jax.random.key(args.seed), args.chains)
  params = {"w": jnp.zeros((args.chains, features)),
            "b": jnp.zeros(args.chains)}

  sampler = make_sampler(batch_fn, count, args)
  mean_log_likelihood, release_ll = make_log_likelihood(train,
                                                        args.batch_size)
  start = time.perf_counter()
  sampler = sampler.lower(keys, params, data_states).compile()
  compile_seconds = time.perf_counter() - start

  samples, log_lik = [], []
  sampling_seconds = 0.0
  with tqdm.tqdm(total=args.steps, unit="step", desc="SGHMC",
                 dynamic_ncols=True) as bar:
    for _ in range(args.steps // SEGMENT):
      start = time.perf_counter()
      keys, params, data_states, new = sampler(keys, params, data_states)
      jax.block_until_ready(new)
      sampling_seconds += time.perf_counter() - start
      ll = mean_log_likelihood(new)  # every training observation
      samples.append(jax.device_get(new))
      log_lik.append(np.asarray(ll))
      bar.set_postfix(loglik=f"{float(ll[:, -1].mean()):.3f}")
      bar.update(SEGMENT)
  release_fn()
  release_ll()

  samples = jax.tree.map(lambda *s: np.concatenate(s, axis=1), *samples)
  log_lik = np.concatenate(log_lik, axis=1)
  per_chain_samples = samples["b"].shape[1]
  kept = jax.tree.map(lambda s: s[:, per_chain_samples // 2:], samples)
  probs, per_chain, labels = posterior_predictive(test, kept,
                                                  args.batch_size)
  accuracy = float(((probs > 0.5) == labels).mean())
  chain_accuracy = ((per_chain > 0.5) == labels[:, None]).mean(axis=0)
  brier = float(np.mean((probs - labels) ** 2))

  print(f"SGHMC: {args.chains} chains x {args.steps:,} steps of "
        f"{args.integration_steps} leapfrog steps, mini-batches of "
        f"{args.batch_size}; compiled in {compile_seconds:.1f} s, sampled "
        f"in {sampling_seconds:.1f} s "
        f"({args.chains * args.steps / sampling_seconds:,.0f} chain-steps/s)")
  print(f"posterior predictive on {len(labels)} test tumours (second half "
        f"of each chain, {per_chain_samples - per_chain_samples // 2} "
        "samples per chain):")
  for c, acc in enumerate(chain_accuracy):
    print(f"  chain {c}: accuracy {100 * acc:.1f} %")
  print(f"  all chains: accuracy {100 * accuracy:.1f} %, Brier score "
        f"{brier:.3f}")
  steps = np.arange(THIN, args.steps + 1, THIN)
  path = os.path.abspath(args.out)
  save_figure(path, steps, samples, log_lik, probs, labels,
              burn_in=(per_chain_samples // 2) * THIN)
  print(f"figure: {path}")


if __name__ == "__main__":
  main()
