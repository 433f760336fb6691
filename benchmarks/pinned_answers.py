"""Many vmapped chains on a GPU, answers page-locked or not.

On a GPU every refresh goes through ``jax.pure_callback`` and the runtime
copies the host's answer to the device; ``StoreLimits.page_locked`` (the
default) registers the buffers of those answers as page-locked memory.
This script runs case (g)'s counter chains (SGLD for logistic regression,
N = 1e5, D = 32, mb = 64, chunks of 100 batches; see ``chains.py``) with
``page_locked`` True and False, in fresh processes that alternate, and
prints the median time per step of each. Where no GPU is driven nothing
is registered, and both rows measure the same code.

Run: ``python benchmarks/pinned_answers.py [--chains 16 256 1024]
[--steps 300] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def _child(request: dict) -> dict:
  import dataclasses
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  from chains import _jax_data  # pylint: disable=import-outside-toplevel
  from models import logistic_data

  import jax_data

  chains, n, d = request["chains"], 100_000, 32
  data = logistic_data(n, d)
  loader = jax_data.NumpyDataLoader(**data)
  loader.store_limits = dataclasses.replace(
      loader.store_limits, page_locked=request["page_locked"])
  run, carry, release = _jax_data(
      dict(n=n, chains=chains, mb=64, cache=100, steps=request["steps"]),
      data, jnp.zeros((chains, d)),
      jax.random.split(jax.random.key(0), chains), 1e-5, "counter", loader)
  carry = jax.block_until_ready(run(*carry))  # compiles, registers
  times = []
  for _ in range(request["calls"]):
    start = time.perf_counter()
    carry = jax.block_until_ready(run(*carry))
    times.append((time.perf_counter() - start) / request["steps"])
  release()
  return {"step": float(np.median(times)), "platform": jax.default_backend()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chains", type=int, nargs="+",
                      default=[16, 256, 1024])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--calls", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  from common import run_child
  print("| chains | platform | page-locked | ordinary memory | ratio |")
  print("|---|---|---|---|---|")
  for chains in args.chains:
    steps = {True: [], False: []}
    platform = "?"
    for _ in range(args.rounds):
      for page_locked in (True, False):
        result = run_child(os.path.abspath(__file__), "--child",
                           {"chains": chains, "page_locked": page_locked,
                            "steps": args.steps, "calls": args.calls})
        steps[page_locked].append(result["step"])
        platform = result["platform"]
    locked, ordinary = (statistics.median(steps[k]) for k in (True, False))
    print(f"| {chains} | {platform} | {locked * 1e6:,.1f} µs | "
          f"{ordinary * 1e6:,.1f} µs | {ordinary / locked:.2f}x |",
          flush=True)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  if len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(json.dumps(_child(json.loads(sys.argv[2]))))
  else:
    main()
