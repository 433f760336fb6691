"""BlackJAX's SGLD and SGHMC, with and without control variates, and a
NumPyro model's log-density, sampling with jax_data's mini-batches inside
one jitted, vmapped loop: they recover known posteriors."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_data

blackjax = pytest.importorskip("blackjax")
numpyro = pytest.importorskip("numpyro")

from blackjax.sgmcmc.gradients import control_variates  # noqa: E402
from blackjax.sgmcmc.gradients import grad_estimator  # noqa: E402

N, D, SIGMA, PRIOR_SD = 2000, 3, 0.5, 10.0
CHAINS = 4
# Posterior means must come within this of the exact ones: about one
# posterior standard deviation (0.011 here), far below the prior's 10.
TOLERANCE = 0.01


@pytest.fixture(scope="module")
def regression():
  """A linear regression with known noise and a Gaussian prior, so its
  posterior is known exactly; the data, and that posterior's mean and
  standard deviations."""
  rng = np.random.default_rng(42)
  x = rng.normal(size=(N, D)).astype(np.float32)
  w = np.array([1.5, -0.5, 2.0])
  y = (x @ w + SIGMA * rng.normal(size=N)).astype(np.float32)
  x64 = x.astype(np.float64)
  precision = x64.T @ x64 / SIGMA**2 + np.eye(D) / PRIOR_SD**2
  mean = np.linalg.solve(precision, x64.T @ y / SIGMA**2)
  sd = np.sqrt(np.diag(np.linalg.inv(precision)))
  return {"x": x, "y": y}, mean, sd


def log_prior(w):
  return -0.5 * jnp.sum(w**2) / PRIOR_SD**2


def log_likelihood(w, observation):
  return -0.5 * ((observation["y"] - observation["x"] @ w) / SIGMA) ** 2


def stacked_states(init_fn, first_seed=0):
  return jax.tree.map(lambda *s: jnp.stack(s), *[
      init_fn(seed=first_seed + c) for c in range(CHAINS)])


def run_chains(kernel, batch_fn, data_states, step_size, steps):
  """``CHAINS`` chains of a BlackJAX kernel from zero, in one jitted vmap
  of ``jax_data.scan``: the positions of every step."""

  def one_chain(key, position, data_state):
    def step(carry, batch):
      key, position = carry
      key, step_key = jax.random.split(key)
      position = kernel.step(step_key, position, batch, step_size)
      return (key, position), position

    (_, data_state), positions = jax_data.scan(
        step, (key, position), data_state, batch_fn=batch_fn, length=steps)
    return positions, data_state

  keys = jax.random.split(jax.random.key(3), CHAINS)
  positions, data_states = jax.jit(jax.vmap(one_chain))(
      keys, jnp.zeros((CHAINS, D)), data_states)
  return np.asarray(positions), data_states


@pytest.mark.parametrize("name, step_size, options", [
    ("sgld", 1e-5, {}),
    ("sghmc", 1e-3, {"num_integration_steps": 5}),
])
def test_blackjax_chains_recover_the_posterior_mean(regression, name,
                                                    step_size, options):
  data, mean, _ = regression
  gradient = grad_estimator(log_prior, log_likelihood, N)
  kernel = getattr(blackjax, name)(gradient, **options)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(**data), 50, 32)
  positions, data_states = run_chains(kernel, batch_fn,
                                      stacked_states(init_fn), step_size,
                                      3000)
  release_fn()
  assert positions.shape == (CHAINS, 3000, D)
  kept = positions[:, 1000:]
  np.testing.assert_array_less(np.abs(kept.mean(axis=(0, 1)) - mean),
                               TOLERANCE)
  # Every chain on its own, too; the chains drew different batches.
  np.testing.assert_array_less(np.abs(kept.mean(axis=1) - mean),
                               3 * TOLERANCE)
  assert len(set(np.asarray(data_states.chain).tolist())) == CHAINS
  assert not np.array_equal(positions[0], positions[1])


def full_gradient_fn(loader):
  """The gradient of the log-posterior over every observation, from
  ``full_data_mapper`` inside compiled code; and its release."""
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, 4, 128)

  def full_gradient(w):
    def batch_gradient(batch, mask, carry):
      def batch_log_likelihood(w):
        values = jax.vmap(log_likelihood, (None, 0))(w, batch)
        return jnp.sum(jnp.where(mask, values, 0.0))
      return jax.grad(batch_log_likelihood)(w), carry

    per_batch, _ = mapper_fn(batch_gradient, None, masking=True)
    return jax.grad(log_prior)(w) + per_batch.sum(axis=0)

  return full_gradient, release_fn


def cv_gradient_fn(loader, plain):
  """The estimator to give ``control_variates`` with ``data=None``: the
  full-data gradient when asked for ``None``, else ``plain``'s batch
  estimate; and its release."""
  full_gradient, release_fn = full_gradient_fn(loader)

  def gradient_or_full(position, minibatch):
    if minibatch is None:  # control_variates asks for the full data
      return full_gradient(position)
    return plain(position, minibatch)

  return gradient_or_full, release_fn


def test_full_data_mapper_gives_the_exact_centre_gradient(regression):
  data, mean, _ = regression
  full_gradient, release_fn = full_gradient_fn(
      jax_data.NumpyDataLoader(**data))
  centre = jnp.asarray(mean + 0.05, jnp.float32)
  got = jax.jit(full_gradient)(centre)
  release_fn()
  x, y = data["x"].astype(np.float64), data["y"].astype(np.float64)
  w = np.asarray(centre, np.float64)
  want = x.T @ (y - x @ w) / SIGMA**2 - w / PRIOR_SD**2
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=0.05)


def test_control_variates_lower_the_variance_on_the_same_batches(regression):
  data, mean, _ = regression
  loader = jax_data.NumpyDataLoader(**data)
  plain = grad_estimator(log_prior, log_likelihood, N)
  gradient_or_full, release_full = cv_gradient_fn(loader, plain)

  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 50, 32)
  centre = jnp.asarray(mean, jnp.float32)
  position = centre + 0.03  # a few posterior sds away

  @jax.jit
  def both_estimates(data_state):
    cv = control_variates(gradient_or_full, centre, None)

    def step(carry, batch):
      return carry, (plain(position, batch), cv(position, batch))

    _, (plain_g, cv_g) = jax_data.scan(step, None, data_state,
                                       batch_fn=batch_fn, length=400)
    return plain_g, cv_g

  plain_g, cv_g = both_estimates(init_fn(seed=5))
  release_fn()
  release_full()
  # Both estimate the same gradient; the control variates' spread is far
  # smaller (for this linear model, by about the ratio of the distance to
  # the centre to the posterior's extent).
  plain_var = np.var(np.asarray(plain_g), axis=0)
  cv_var = np.var(np.asarray(cv_g), axis=0)
  assert np.all(cv_var < plain_var / 10), (cv_var, plain_var)
  np.testing.assert_allclose(np.mean(np.asarray(cv_g), axis=0),
                             np.mean(np.asarray(plain_g), axis=0),
                             atol=4 * np.sqrt(plain_var.max() / 400))


def test_sgld_with_control_variates_recovers_the_posterior(regression):
  data, mean, sd = regression
  loader = jax_data.NumpyDataLoader(**data)
  plain = grad_estimator(log_prior, log_likelihood, N)
  gradient_or_full, release_full = cv_gradient_fn(loader, plain)

  centre = jnp.asarray(mean, jnp.float32)
  kernel = blackjax.sgld(control_variates(gradient_or_full, centre, None))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 50, 32)
  positions, _ = run_chains(kernel, batch_fn, stacked_states(init_fn),
                            1e-5, 2000)
  release_fn()
  release_full()
  kept = positions[:, 500:]
  np.testing.assert_array_less(np.abs(kept.mean(axis=(0, 1)) - mean),
                               TOLERANCE)
  # With the gradient noise gone, the spread is near the true one.
  spread = kept.std(axis=(0, 1))
  np.testing.assert_array_less(spread, 1.5 * sd)
  np.testing.assert_array_less(0.6 * sd, spread)


def test_numpyro_model_with_sgld_agrees_with_nuts():
  import numpyro.distributions as dist
  from numpyro import handlers
  from numpyro.infer import MCMC
  from numpyro.infer import NUTS
  from numpyro.infer.util import log_density

  count = 500
  rng = np.random.default_rng(7)
  x = rng.normal(size=(count, 2)).astype(np.float32)
  y = (x @ np.array([0.7, -1.3]) + 0.3
       + 0.5 * rng.normal(size=count)).astype(np.float32)

  def model(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    with numpyro.plate("data", count, subsample_size=x.shape[0]):
      numpyro.sample("y", dist.Normal(x @ w + b, 0.5), obs=y)

  mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=1000,
              progress_bar=False)
  mcmc.run(jax.random.key(0), x, y)
  nuts = {k: np.asarray(v) for k, v in mcmc.get_samples().items()}

  # The plate scales the batch's log-likelihood by count / batch size;
  # its subsample indices are those of the batch.
  loader = jax_data.NumpyDataLoader(x=x, y=y, index=np.arange(count))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # cache over one epoch
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, 50, 25)

  def log_posterior(params, batch):
    batch_model = handlers.substitute(model, data={"data": batch["index"]})
    return log_density(batch_model, (batch["x"], batch["y"]), {},
                       params)[0]

  step_size = 2e-5

  def one_chain(key, params, data_state):
    def step(carry, batch):
      key, params = carry
      key, noise_key = jax.random.split(key)
      grads = jax.grad(log_posterior)(params, batch)
      leaves, treedef = jax.tree.flatten(params)
      noise = treedef.unflatten([
          jax.random.normal(k, leaf.shape) for k, leaf in
          zip(jax.random.split(noise_key, len(leaves)), leaves)])
      params = jax.tree.map(
          lambda p, g, n: p + 0.5 * step_size * g + jnp.sqrt(step_size) * n,
          params, grads, noise)
      return (key, params), params

    (_, _), samples = jax_data.scan(step, (key, params), data_state,
                                    batch_fn=batch_fn, length=6000)
    return samples

  start = {"w": jnp.zeros((CHAINS, 2)), "b": jnp.zeros(CHAINS)}
  samples = jax.jit(jax.vmap(one_chain))(
      jax.random.split(jax.random.key(1), CHAINS), start,
      stacked_states(init_fn))
  release_fn()
  for name in ("w", "b"):
    sgld = np.asarray(samples[name][:, 1000:])
    sgld = sgld.reshape((-1,) + sgld.shape[2:])
    # Means within 0.01 (NUTS: sd 0.02-0.025); sds within 30 %.
    np.testing.assert_array_less(
        np.abs(sgld.mean(axis=0) - nuts[name].mean(axis=0)), 0.01)
    np.testing.assert_allclose(sgld.std(axis=0), nuts[name].std(axis=0),
                               rtol=0.3)
