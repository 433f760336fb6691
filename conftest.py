"""Test set-up for tests and doctests: four CPU devices, quiet TensorFlow."""

import functools
import importlib.util
import os
import types

import pytest

# Set before JAX is imported anywhere: several devices for pmap/shard_map,
# and LLVM's optimisation level 0. The tests check what programs compute,
# not how fast; they compile hundreds of small programs, which level 0
# compiles in about 12% less of the suite's time (tests/test_scan.py and
# tests/test_counter_chains.py: 79 s, 70 s at level 0). The benchmarks'
# test runs them without these flags, compiled as users compile.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4"
                      " --xla_backend_optimization_level=0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Nothing downloads in tests: Hugging Face stays offline.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Not test modules: Sphinx configuration, scripts with their own entry points.
collect_ignore = ["docs/conf.py", "examples", "benchmarks", "setup.py"]

# Without TensorFlow (it is optional) its module and page are not collected;
# tests/test_tensorflow_loader.py skips itself.
if importlib.util.find_spec("tensorflow") is None:
  collect_ignore += ["jax_data/loaders/tensorflow_loader.py",
                     "jax_data/loaders/tensorflow_rows.py",
                     "jax_data/loaders/tensorflow_reads.py",
                     "jax_data/loaders/tensorflow_streams.py",
                     "docs/tensorflow.rst",
                     # one section of the guide reads a tf.data pipeline
                     "docs/user_guide.rst"]
# Without Orbax (the orbax extra) its module is not collected;
# tests/test_orbax.py skips itself.
if importlib.util.find_spec("orbax") is None:
  collect_ignore += ["jax_data/compiled/orbax_checkpoint.py"]
# The sources page runs every kind of source (the sources extra).
if any(importlib.util.find_spec(m) is None for m in (
    "grain", "array_record", "datasets", "h5py", "PIL",
    "tensorflow_datasets")):
  collect_ignore += ["docs/sources.rst"]
# The samplers page runs BlackJAX and NumPyro (the samplers extra).
if any(importlib.util.find_spec(m) is None for m in ("blackjax", "numpyro")):
  collect_ignore += ["docs/samplers.rst"]


def pytest_xdist_auto_num_workers():
  """``-n auto`` (setup.cfg): a worker process per usable core, at most 4.

  Most tests compile and check values on one core (tests/test_random_access.py
  used 1.2 cores alone), so on 2 cores two workers ran the suite in 636 s
  where one process took 1,163 s. Past 4, the processes' own threads and
  the tests that start several JAX processes would crowd each other."""
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    usable = os.cpu_count() or 1
  return max(1, min(4, usable))


@pytest.fixture(params=["auto", "pure"], ids=["in_place", "copied"])
def pipelines(request):
  """The pipeline constructors, bound to one way compiled code receives
  chunks on CPU: written in place (``callback="auto"``, the default,
  ``buffer_callback``) or returned by ``pure_callback`` (``"pure"``, what
  other platforms use)."""
  import jax_data
  callback = request.param
  bind = lambda f: functools.partial(f, callback=callback)
  return types.SimpleNamespace(
      callback=callback,
      random_reference_data=bind(jax_data.random_reference_data),
      full_reference_data=bind(jax_data.full_reference_data),
      full_data_mapper=bind(jax_data.full_data_mapper))
