"""Test set-up for tests and doctests: four CPU devices, quiet TensorFlow."""

import importlib.util
import os

import pytest

# Set before JAX is imported anywhere: several devices for pmap/shard_map.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Not test modules: Sphinx configuration, scripts with their own entry points.
collect_ignore = ["docs/conf.py", "examples", "benchmarks", "setup.py"]

# Without TensorFlow (it is optional) its module and page are not collected;
# tests/test_tensorflow_loader.py skips itself.
if importlib.util.find_spec("tensorflow") is None:
  collect_ignore += ["jax_data/tensorflow_loader.py", "docs/tensorflow.rst"]


@pytest.fixture(params=["in_place", "copied"])
def bridge_path(request, monkeypatch):
  """Runs a test with each way compiled code receives chunks on CPU:
  written in place (``buffer_callback``, the default) and returned by
  ``pure_callback`` (what other platforms use)."""
  from jax_data import bridge
  monkeypatch.setattr(bridge, "IN_PLACE", request.param == "in_place")
  return request.param
