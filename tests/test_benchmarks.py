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
      [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--smoke",
       "--repeats", "1"],  # every case's code runs once: what this checks
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  for row in ("(a)", "(b)", "(c)", "(d)", "(e)", "(f)", "(g)",
              "out-of-core"):
    assert row in done.stdout, done.stdout[-3000:]


def test_chains_rows_pool_their_processes(monkeypatch):
  """Case (g) times a row in several fresh processes: samples pool, and a
  ratio is the median over processes of each one's median per-repeat
  ratio, its range shown; a contender failed in any process is failed."""
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  import chains  # pylint: disable=import-outside-toplevel

  def process(a, b, c=None):
    out = {"a": {"samples": a, "median": sorted(a)[len(a) // 2]},
           "b": {"samples": b, "median": sorted(b)[len(b) // 2]}}
    out["c"] = ({"failed": "out of memory"} if c is None else
                {"samples": c, "median": c[0]})
    return out

  pooled = chains._pooled([process([1.0, 3.0, 2.0], [2.0, 2.0, 2.0], [1.0]),
                           process([6.0], [2.0]),
                           process([4.0], [8.0], [1.0])])
  assert pooled["a"]["samples"] == [1.0, 3.0, 2.0, 6.0, 4.0]
  assert pooled["a"]["median"] == 3.0
  assert pooled["a"]["processes"] == [[1.0, 3.0, 2.0], [6.0], [4.0]]
  assert chains._ratios(pooled, "a", "b") == [1.0, 3.0, 0.5]
  assert chains._ratio(pooled, "a", "b") == 1.0
  assert chains._spread(pooled, "a", "b") == "1.00x (0.50-3.00)"
  assert pooled["c"] == {"failed": "out of memory"}
  one = chains._pooled([process([1.0, 3.0], [2.0, 2.0], [1.0])])
  assert chains._spread(one, "a", "b") == "1.00x"


@pytest.mark.skipif(sys.platform != "linux",
                    reason="the benchmarks read /proc (peak RSS)")
def test_source_loader_memory_rows(monkeypatch):
  """``chains.py --source-memory``'s rows: a SourceDataLoader's peak above
  the start, the caches and the bound, per cache size (tiny here)."""
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  monkeypatch.setenv("PYTHONPATH", ROOT)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  import chains  # pylint: disable=import-outside-toplevel
  rows = chains.source_memory(n=2_000, chains=4, caches=(2, 3), calls=1)
  assert [row["cache"] for row in rows] == [2, 3]
  for row in rows:
    assert row["caches"] == 4 * row["cache"] * 64 * (4 * 33 + 1)
    assert row["bound"] == 2 * row["caches"] + (256 << 20)
    assert 0 <= row["peak"] < row["bound"]
