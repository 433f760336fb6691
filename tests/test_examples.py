"""The examples run (quick mode), print their summary and write a figure."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=300):
  env = dict(os.environ, PYTHONPATH=ROOT, MPLBACKEND="Agg")
  env.pop("XLA_FLAGS", None)  # the examples run on one device as users do
  return subprocess.run([sys.executable, os.path.join(ROOT, script), *args],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)


def test_main_example_quick(tmp_path):
  for module in ("sklearn", "matplotlib", "tqdm"):  # the examples extra
    pytest.importorskip(module)
  figure = tmp_path / "sgld.png"
  done = _run("examples/sgld_digits.py", "--quick", "--out", str(figure))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "accuracy" in done.stdout.lower()
  assert str(figure) in done.stdout
  with open(figure, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_tfds_example_quick(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  done = _run("examples/tfds_example.py", "--quick")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "accuracy" in done.stdout.lower()


def test_sources_example_quick():
  for module in ("grain", "array_record", "datasets", "h5py", "PIL"):
    pytest.importorskip(module)
  done = _run("examples/sources_mnist.py", "--quick")
  assert done.returncode == 0, done.stderr[-3000:]
  lines = [line for line in done.stdout.splitlines() if "test accuracy" in line]
  assert len(lines) == 5, done.stdout
  assert ("every source gave the same batches and the same accuracy: yes"
          in done.stdout), done.stdout


def test_blackjax_example_quick(tmp_path):
  pytest.importorskip("blackjax")
  figure = tmp_path / "sghmc.png"
  done = _run("examples/blackjax_sghmc.py", "--quick", "--out", str(figure))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Warning" not in done.stderr, done.stderr[-3000:]
  accuracy = [line for line in done.stdout.splitlines()
              if line.strip().startswith("all chains: accuracy")]
  assert len(accuracy) == 1, done.stdout
  # Logistic regression separates these tumours well: far above the 63 %
  # of always answering "benign".
  assert float(accuracy[0].split()[3]) > 85.0, done.stdout
  with open(figure, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
