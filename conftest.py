"""Test set-up for tests and doctests: four CPU devices, quiet TensorFlow."""

import os

# Set before JAX is imported anywhere: several devices for pmap/shard_map.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Not test modules: Sphinx configuration, scripts with their own entry points.
collect_ignore = ["docs/conf.py", "examples", "benchmarks", "setup.py"]
