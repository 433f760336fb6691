"""The workloads: SGLD for Bayesian logistic regression, the data-loaders
tutorial's MLP, and synthetic data for both.

Every contender of a case runs the same functions defined here; only where
the batches come from differs. Nothing here downloads anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

Batch = dict[str, jax.Array]
BatchFn = Callable[[Any], tuple[Any, Batch]]

# -- Bayesian logistic regression ----------------------------------------


def logistic_data(n: int, d: int, seed: int = 0
                  ) -> dict[str, np.ndarray]:
  """Synthetic logistic-regression data.

  Args:
    n: Observations.
    d: Features.
    seed: NumPy seed.

  Returns:
    ``{"x": float32 (n, d), "y": float32 (n,)}`` with labels drawn from the
    model with a random weight vector.
  """
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d), dtype=np.float32)
  w = rng.standard_normal(d, dtype=np.float32) / np.sqrt(d)
  p = 1 / (1 + np.exp(-(x @ w)))
  y = (rng.random(n, dtype=np.float32) < p).astype(np.float32)
  return {"x": x, "y": y}


def log_likelihood(theta: jax.Array, batch: Batch) -> jax.Array:
  """Per-observation Bernoulli log-likelihood, shape ``(mb,)``."""
  logits = batch["x"] @ theta
  return batch["y"] * logits - jax.nn.softplus(logits)


def masked_log_likelihood(theta: jax.Array, batch: Batch, mask: jax.Array
                          ) -> jax.Array:
  """Sum of the log-likelihood over the valid observations of a batch."""
  return jnp.sum(jnp.where(mask, log_likelihood(theta, batch), 0.0))


def sgld_update(theta: jax.Array, key: jax.Array, batch: Batch,
                observation_count: int, step_size: float
                ) -> tuple[jax.Array, jax.Array]:
  """One SGLD step with a standard normal prior.

  Args:
    theta: Parameters, shape ``(d,)``.
    key: PRNG key for the injected noise.
    batch: A mini-batch ``{"x": (mb, d), "y": (mb,)}``.
    observation_count: N, to scale the mini-batch likelihood.
    step_size: SGLD step size.

  Returns:
    The new parameters and key.
  """
  mb = batch["y"].shape[0]
  grad = jax.grad(lambda t: jnp.sum(log_likelihood(t, batch)))(theta)
  grad = grad * (observation_count / mb) - theta
  key, noise_key = jax.random.split(key)
  noise = jax.random.normal(noise_key, theta.shape, theta.dtype)
  theta = theta + 0.5 * step_size * grad + jnp.sqrt(step_size) * noise
  return theta, key


def sgld_sampler(batch_fn: BatchFn, observation_count: int, steps: int,
                 step_size: float) -> Callable:
  """The whole SGLD sampler in one jitted ``lax.scan``.

  Args:
    batch_fn: ``batch_fn(data_state) -> (data_state, batch)``, called once
      per step inside the scan.
    observation_count: N.
    steps: Scan length.
    step_size: SGLD step size.

  Returns:
    Jitted ``run(theta, data_state, key) -> (theta, data_state, key)``.
  """

  def step(carry, _):
    theta, data_state, key = carry
    data_state, batch = batch_fn(data_state)
    theta, key = sgld_update(theta, key, batch, observation_count, step_size)
    return (theta, data_state, key), None

  @jax.jit
  def run(theta, data_state, key):
    carry, _ = jax.lax.scan(step, (theta, data_state, key), None,
                            length=steps)
    return carry

  return run


def sgld_scan_sampler(batch_fn: BatchFn, observation_count: int, steps: int,
                      step_size: float) -> Callable:
  """:func:`sgld_sampler` written with ``jax_data.scan`` (the documented
  way): the same steps and batches, the same ``run`` signature."""
  def step(carry, batch):
    theta, key = carry
    return sgld_update(theta, key, batch, observation_count, step_size), None

  return _scan_run(step, batch_fn, steps)


def data_only_scan_sampler(batch_fn: BatchFn, steps: int) -> Callable:
  """:func:`sgld_scan_sampler`'s loop with (almost) no compute: each step
  only sums its batch, so its time is that of bringing the batches in (the
  chunk refreshes); the same ``run`` signature."""
  def step(carry, batch):
    theta, key = carry
    total = sum(jnp.sum(leaf.astype(jnp.float32))
                for leaf in jax.tree_util.tree_leaves(batch))
    return (theta + 1e-30 * total, key), None

  return _scan_run(step, batch_fn, steps)


def _scan_run(step: Callable, batch_fn: BatchFn, steps: int) -> Callable:
  """``run(theta, data_state, key)``: ``steps`` of ``step(carry, batch)``
  over ``(theta, key)`` in one jitted ``jax_data.scan``."""
  import jax_data

  @jax.jit
  def run(theta, data_state, key):
    ((theta, key), data_state), _ = jax_data.scan(
        step, (theta, key), data_state, batch_fn=batch_fn, length=steps)
    return theta, data_state, key

  return run


def device_batch_fn(arrays: dict[str, jax.Array], mb: int) -> BatchFn:
  """Random batches of device arrays: the device-resident limit.

  The data state is a PRNG key; indices are independent draws with
  ``jax.random.randint``, gathered with ``jnp.take`` inside the scan.
  """
  count = next(iter(arrays.values())).shape[0]

  def batch_fn(key):
    key, index_key = jax.random.split(key)
    indices = jax.random.randint(index_key, (mb,), 0, count)
    return key, {k: jnp.take(a, indices, axis=0) for k, a in arrays.items()}

  return batch_fn


# -- the data-loaders tutorial's MLP -------------------------------------

LAYER_SIZES = [784, 512, 512, 10]
STEP_SIZE = 0.01
N_TARGETS = 10


def mnist_like(n: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Synthetic MNIST-shaped data (nothing may download).

  Returns:
    ``{"image": float32 (n, 784) in [0, 1], "label": int32 (n,)}``: images
    flattened and cast as the tutorial's ``FlattenAndCast`` does.
  """
  rng = np.random.default_rng(seed)
  image = rng.integers(0, 256, (n, 28 * 28), dtype=np.uint8)
  image = image.astype(np.float32) / 255
  label = rng.integers(0, N_TARGETS, n, dtype=np.int32)
  return {"image": image, "label": label}


def init_network_params(sizes: list[int], key: jax.Array, scale=1e-2):
  """The tutorial's parameter initialisation."""
  keys = jax.random.split(key, len(sizes))
  params = []
  for m, n, k in zip(sizes[:-1], sizes[1:], keys):
    w_key, b_key = jax.random.split(k)
    params.append((scale * jax.random.normal(w_key, (n, m)),
                   scale * jax.random.normal(b_key, (n,))))
  return params


def predict(params, image):
  """The tutorial's per-example prediction."""
  activations = image
  for w, b in params[:-1]:
    activations = jnp.maximum(0, jnp.dot(w, activations) + b)
  final_w, final_b = params[-1]
  logits = jnp.dot(final_w, activations) + final_b
  return logits - logsumexp(logits)


batched_predict = jax.vmap(predict, in_axes=(None, 0))


def loss(params, images, targets):
  """The tutorial's loss."""
  return -jnp.mean(batched_predict(params, images) * targets)


def mlp_update(params, batch: Batch):
  """The tutorial's gradient-descent step on a batch; the one-hot encoding
  of ``reshape_and_one_hot`` happens inside the step."""
  targets = jax.nn.one_hot(batch["label"], N_TARGETS, dtype=jnp.float32)
  grads = jax.grad(loss)(params, batch["image"], targets)
  return [(w - STEP_SIZE * dw, b - STEP_SIZE * db)
          for (w, b), (dw, db) in zip(params, grads)]


def mlp_trainer(batch_fn: BatchFn, steps: int) -> Callable:
  """``steps`` tutorial training steps in one jitted ``lax.scan``.

  Returns:
    Jitted ``run(params, data_state) -> (params, data_state)``.
  """

  def step(carry, _):
    params, data_state = carry
    data_state, batch = batch_fn(data_state)
    return (mlp_update(params, batch), data_state), None

  @jax.jit
  def run(params, data_state):
    carry, _ = jax.lax.scan(step, (params, data_state), None, length=steps)
    return carry

  return run
