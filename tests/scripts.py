"""Test scripts run in a fresh interpreter, as a user's program runs, for
what only a process's exit shows."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What stderr shows of a process that died at exit rather than ending.
_CRASHES = ("Fatal Python error", "terminate called", "Aborted",
            "Segmentation")


def run(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
  """Runs ``script`` (Python source) with this checkout's jax_data."""
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def assert_ended_cleanly(done: subprocess.CompletedProcess) -> None:
  """Exit status 0, the script's main thread done, and no sign of a crash
  at exit."""
  assert done.returncode == 0, done.stderr[-3000:]
  assert "main thread done" in done.stdout, done.stdout
  for sign in _CRASHES:
    assert sign not in done.stderr, done.stderr[-3000:]
