"""One chain under ``jax.vmap`` against the same chain without it.

The many-chains issue asks that a vmap of one chain run within 1.05x of
the chain alone. This script separates what ``jax_data`` adds from what
XLA's CPU runtime does to any vmapped loop of this shape. Each case runs
case (a)'s SGLD step (logistic regression, N = 1e5, D = 32, mb = 64,
chunks of 100 batches) in one jitted call of ``--steps`` steps, plain and
as a ``jax.vmap`` over a batch of one, round-robin, and reports the
median time per step of each and the median of the per-repeat ratios:

* ``scan over a chunk (no data access)``: no ``jax_data`` at all; an
  outer loop whose every iteration scans a chunk of 100 batches held in
  the program, the loop ``jax_data.scan`` runs;
* ``compute only``: the same steps reusing one fixed batch (no chunk);
* ``jax_data.scan``: the sampler over a counter-based stream.

Each runs with JAX's default PRNG (threefry2x32, whose CPU lowering is a
loop) and with ``unsafe_rbg`` (XLA's RngBitGenerator, no loop), each in a
fresh process: the sampler splits a key and draws noise at every step.

Run: ``python benchmarks/vmap_one.py [--steps 20000] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

IMPLS = ("threefry2x32", "unsafe_rbg")
CASES = ("scan over a chunk (no data access)", "compute only",
         "jax_data.scan")


def _child(request: dict) -> dict:
  import time

  import jax
  jax.config.update("jax_default_prng_impl", request["impl"])
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from models import logistic_data
  from models import sgld_update

  import jax_data

  n, d, mb, cache, steps = 100_000, 32, 64, 100, request["steps"]
  data = logistic_data(n, d)
  chunk = {k: jnp.asarray(v[:cache * mb].reshape((cache, mb) + v.shape[1:]))
           for k, v in data.items()}
  fixed = {k: v[0] for k, v in chunk.items()}

  def step(carry, batch):
    theta, key = carry
    return sgld_update(theta, key, batch, n, 1e-5), None

  def over_chunks(theta, key):
    def outer(_, carry):
      return lax.scan(step, carry, chunk)[0]
    return lax.fori_loop(0, steps // cache, outer, (theta, key))

  def compute_only(theta, key):
    return lax.scan(lambda c, _: step(c, fixed), (theta, key), None,
                    length=steps)[0]

  loader = jax_data.NumpyDataLoader(**data)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, cache, mb)

  def scanned(theta, key, state):
    ((theta, key), state), _ = jax_data.scan(
        step, (theta, key), state, batch_fn=batch_fn, length=steps)
    return theta, key, state

  def pair(fn, extra):
    plain = jax.jit(fn)
    vmapped = jax.jit(jax.vmap(fn))
    carry_p = (jnp.zeros(d), jax.random.key(0)) + extra(0)
    carry_v = jax.tree_util.tree_map(lambda a: a[None],
                                     (jnp.zeros(d), jax.random.key(1))
                                     + extra(1))
    return [plain, carry_p], [vmapped, carry_v]

  def no_state(_):
    return ()

  def state_of(seed):
    return (init_fn(seed=seed, stream="counter"),)

  # Steps each case runs: the loop over chunks runs whole chunks only.
  done = {CASES[0]: steps // cache * cache, CASES[1]: steps, CASES[2]: steps}
  runs = {CASES[0]: pair(over_chunks, no_state),
          CASES[1]: pair(compute_only, no_state),
          CASES[2]: pair(scanned, state_of)}
  for entries in runs.values():
    for entry in entries:
      entry[1] = jax.block_until_ready(entry[0](*entry[1]))
  times = {case: ([], []) for case in runs}
  for _ in range(request["repeats"]):
    for case, entries in runs.items():
      for k, entry in enumerate(entries):
        start = time.perf_counter()
        entry[1] = jax.block_until_ready(entry[0](*entry[1]))
        times[case][k].append((time.perf_counter() - start) / done[case])
  release_fn()
  result = {}
  for case, (plain, vmapped) in times.items():
    ratios = [v / p for p, v in zip(plain, vmapped)]
    result[case] = {"plain": float(np.median(plain)),
                    "vmapped": float(np.median(vmapped)),
                    "ratio": float(np.median(ratios))}
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20_000)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  if args.steps < 100:  # the loop over chunks runs whole chunks of 100
    parser.error(f"--steps must be at least 100, got {args.steps}")
  from common import run_child
  print("| PRNG | case | plain | vmap of one | vmap / plain |")
  print("|---|---|---|---|---|")
  for impl in IMPLS:
    result = run_child(os.path.abspath(__file__), "--child",
                       {"impl": impl, "steps": args.steps,
                        "repeats": args.repeats})
    for case in CASES:
      r = result[case]
      print(f"| {impl} | {case} | {r['plain'] * 1e6:.2f} µs | "
            f"{r['vmapped'] * 1e6:.2f} µs | {r['ratio']:.2f}x |", flush=True)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  if len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(json.dumps(_child(json.loads(sys.argv[2]))))
  else:
    main()
