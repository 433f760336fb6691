"""The benchmarks' smoke mode runs (no timing is checked: machines are
shared and noisy; the full run writes docs/benchmarks.md)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_smoke_mode():
  pytest.importorskip("jax_sgmc")
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)  # one device, as the benchmarks measure
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--smoke"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  for row in ("(a)", "(b)", "(c)", "(d)", "(e)", "(f)", "(g)",
              "out-of-core"):
    assert row in done.stdout, done.stdout[-3000:]
