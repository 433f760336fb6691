"""Pipelines of the same formats, cache and batch sizes share their compiled
code, and each still serves its own data and chains."""

import contextlib
import logging
from typing import Iterator
from typing import List

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_data
from jax_data import NumpyDataLoader


@contextlib.contextmanager
def compilations() -> Iterator[List[str]]:
  """The names of the computations XLA compiles inside the block."""
  names: List[str] = []

  class Record(logging.Handler):

    def emit(self, record):
      message = record.getMessage()
      if message.startswith("Compiling "):
        names.append(message.split(" with ")[0])

  handler = Record()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles():
      yield names
  finally:
    logger.removeHandler(handler)


def _random(offset: float, mb_size: int = 5, cache: int = 4):
  loader = NumpyDataLoader(x=np.arange(100.0, dtype=np.float32) + offset,
                           y=np.arange(100, dtype=np.int32))
  return jax_data.random_reference_data(loader, cache, mb_size)


def _batches(pipeline, state, count):
  out = []
  for _ in range(count):
    state, batch = pipeline.batch_fn(state)
    out.append(batch)
  return state, out


def test_second_random_pipeline_of_the_same_shape_compiles_nothing():
  first = _random(0.0)
  _batches(first, first.init_fn(seed=3), 6)  # compiles the shared step
  second = _random(1000.0)
  state = second.init_fn(seed=3)
  with compilations() as compiled:
    _batches(second, state, 6)
  assert compiled == []
  first.release_fn()
  second.release_fn()


def test_other_sizes_compile_their_own_step():
  first = _random(0.0, mb_size=5)
  _batches(first, first.init_fn(seed=0), 1)
  other = _random(0.0, mb_size=7)
  with compilations() as compiled:
    _batches(other, other.init_fn(seed=0), 1)
  assert compiled
  first.release_fn()
  other.release_fn()


def test_pipelines_sharing_a_step_keep_their_own_data_and_chains():
  first, second = _random(0.0), _random(1000.0)
  a, b = first.init_fn(seed=7), second.init_fn(seed=7)
  got_a, got_b = [], []
  for _ in range(10):  # interleaved, across several refreshes
    a, batch_a = first.batch_fn(a)
    b, batch_b = second.batch_fn(b)
    got_a.append(batch_a)
    got_b.append(batch_b)
  alone = _random(0.0)
  _, want = _batches(alone, alone.init_fn(seed=7), 10)
  for ga, gb, w in zip(got_a, got_b, want):
    np.testing.assert_array_equal(ga["x"], w["x"])
    np.testing.assert_array_equal(ga["y"], w["y"])
    # Same seed, same indices, the other pipeline's data.
    np.testing.assert_array_equal(gb["x"], w["x"] + 1000.0)
    np.testing.assert_array_equal(gb["y"], w["y"])
  for p in (first, second, alone):
    p.release_fn()


def test_released_pipeline_does_not_disturb_one_sharing_its_step():
  first, second = _random(0.0), _random(1000.0)
  a, b = first.init_fn(seed=1), second.init_fn(seed=1)
  a, _ = first.batch_fn(a)
  first.release_fn()
  with pytest.raises(jax_data.PipelineReleasedError):
    first.batch_fn(a)
  b, batch = second.batch_fn(b)
  assert np.all(np.asarray(batch["x"]) >= 1000.0)
  second.release_fn()


def test_shared_step_refuses_a_state_of_the_other_pipeline_inside_jit():
  first, second = _random(0.0), _random(1000.0)
  foreign = second.init_fn(seed=0)
  with pytest.raises(Exception, match="another pipeline"):
    jax.block_until_ready(jax.jit(first.batch_fn)(foreign))
  first.release_fn()
  second.release_fn()


def test_second_mapper_of_the_same_shape_compiles_nothing():
  def fun(batch, mask, carry):
    return jnp.sum(batch["x"] * mask), carry

  def mapper(offset):
    loader = NumpyDataLoader(x=np.arange(50.0, dtype=np.float32) + offset)
    return jax_data.full_data_mapper(loader, 3, 4)

  first, second = mapper(0.0), mapper(1.0)
  sums, _ = first.mapper_fn(fun, None, masking=True)
  with compilations() as compiled:
    other, _ = second.mapper_fn(fun, None, masking=True)
  assert compiled == []
  assert float(jnp.sum(sums)) == float(np.arange(50.0).sum())
  assert float(jnp.sum(other)) == float(np.arange(50.0).sum() + 50.0)
  first.release_fn()
  second.release_fn()


def test_second_mapper_with_an_unbatched_fun_compiles_nothing():
  def fun(observation, carry):
    return observation["x"] * 2.0, carry

  def mapper(offset):
    loader = NumpyDataLoader(x=np.arange(30.0, dtype=np.float32) + offset)
    return jax_data.full_data_mapper(loader, 2, 4)

  first, second = mapper(0.0), mapper(5.0)
  doubled, _ = first.mapper_fn(fun, None, batched=False)
  with compilations() as compiled:
    other, _ = second.mapper_fn(fun, None, batched=False)
  assert compiled == []
  np.testing.assert_array_equal(doubled, 2.0 * np.arange(30.0))
  np.testing.assert_array_equal(other, 2.0 * (np.arange(30.0) + 5.0))
  first.release_fn()
  second.release_fn()


def test_process_wide_caches_are_bounded_or_weak():
  """The caches of compiled code (jax_data.lifetime.Shared) keep the most
  recently used values within their size, or, weak, only while someone
  holds a value; each value is made once per key."""
  made = []

  def maker(key):
    def make():
      made.append(key)
      return [key]
    return make

  bounded = jax_data.lifetime.Shared(size=2)
  for key in ["a", "b", "a", "c", "a", "b"]:
    assert bounded.get(key, maker(key)) == [key]
    assert len(bounded) <= 2
  # "b" was dropped for "c" (least recently used), then made again.
  assert made == ["a", "b", "c", "b"]

  class Holder:
    pass

  weak = jax_data.lifetime.Shared(weak=True)
  held = weak.get("x", Holder)
  assert weak.get("x", Holder) is held and len(weak) == 1
  del held
  assert len(weak) == 0  # nothing holds it: gone
