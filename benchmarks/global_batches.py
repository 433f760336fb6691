"""Global batches over 1, 2 and 4 processes at the same global batch.

One SGLD chain (logistic regression, N = 1e5 rows of 32 float32 features)
whose batch of 256 rows is split over 4 CPU devices: one process of 4
devices, 2 processes of 2, or 4 of 1, joined by ``jax.distributed`` on
127.0.0.1 (Gloo collectives). The gradient is a sum over the batch, so XLA
adds the devices' parts across the processes at every step. Each call is a
jitted ``jax_data.scan`` of ``--steps`` steps; compute only is the same
loop over one fixed global batch, split the same way. Process 0 reports
the median of ``--repeats`` calls, and what moving one refresh's chunk
(each local device's rows of ``cache`` batches) to the devices costs per
process: ``jax.device_put`` of NumPy arrays of that size, blocked.

Run: ``python benchmarks/global_batches.py [--processes 1 2 4]``; it starts
its own worker processes. All processes run on this machine's cores, so
the figures say what the collectives and the per-process hosts cost, not
what several machines would reach.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

ROWS, FEATURES, CACHE, MB, DEVICES = 100_000, 32, 50, 256, 4


def _worker(port: int, index: int, count: int, steps: int, repeats: int
            ) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=count, process_id=index,
                             initialization_timeout=60)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top

  import jax_data  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
  y = (x @ rng.normal(size=FEATURES) > 0).astype(np.float32)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(x=x, y=y), CACHE, MB, mesh=mesh,
      batch_axis="data")

  def sgld(carry, batch):
    w, key = carry
    key, noise_key = jax.random.split(key)

    def log_likelihood(w):
      z = batch["x"] @ w
      return jnp.sum(batch["y"] * z - jnp.logaddexp(0.0, z))

    grad = -w + ROWS / MB * jax.grad(log_likelihood)(w)
    w = w + 1e-5 * grad + jnp.sqrt(2e-5) * jax.random.normal(noise_key,
                                                              w.shape)
    return (w, key), None

  @jax.jit
  def served(carry, state):
    (carry, state), _ = jax_data.scan(sgld, carry, state, batch_fn=batch_fn,
                                      length=steps)
    return carry, state

  split = NamedSharding(mesh, PartitionSpec("data"))
  fixed = {name: jax.make_array_from_callback(
      (MB,) + value.shape[1:], split, lambda i, v=value: v[:MB][i])
           for name, value in (("x", x), ("y", y))}

  @jax.jit
  def compute_only(carry, batch):
    carry, _ = jax.lax.scan(lambda c, _: sgld(c, batch), carry, None,
                            length=steps)
    return carry

  carry = (jnp.zeros(FEATURES), jax.random.key(0))
  state = init_fn(seed=0, shuffle=True, stream="counter")
  carry, state = served(carry, state)  # compiles
  jax.block_until_ready(compute_only(carry, fixed))
  times = {"jax_data": [], "compute only": []}
  for _ in range(repeats):
    for name in times:
      multihost_utils.sync_global_devices(name)
      start = time.perf_counter()
      if name == "jax_data":
        carry, state = served(carry, state)
        jax.block_until_ready(carry)
      else:
        jax.block_until_ready(compute_only(carry, fixed))
      times[name].append(time.perf_counter() - start)
  rows = MB // DEVICES * CACHE
  chunk = [np.ones((rows, FEATURES), np.float32), np.ones(rows, np.float32),
           np.ones(rows, bool)]
  moves = []
  for _ in range(20):
    start = time.perf_counter()
    jax.block_until_ready([jax.device_put(a, d) for d in jax.local_devices()
                           for a in chunk])
    moves.append(time.perf_counter() - start)
  release_fn()
  multihost_utils.sync_global_devices("done")
  if index == 0:
    print(json.dumps({
        "processes": count, "devices": jax.device_count(),
        "local": jax.local_device_count(),
        **{name: statistics.median(t) for name, t in times.items()},
        "transfer": statistics.median(moves)}), flush=True)
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run(processes: int, steps: int, repeats: int) -> dict:
  """The figures of one job of ``processes`` processes."""
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      f"--xla_force_host_platform_device_count={DEVICES // processes}"))
  root = str(pathlib.Path(__file__).resolve().parent.parent)
  env["PYTHONPATH"] = os.pathsep.join(
      [root] + [p for p in [env.get("PYTHONPATH")] if p])
  procs = [subprocess.Popen(
      [sys.executable, __file__, "--worker", str(port), str(i),
       str(processes), str(steps), str(repeats)], env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(processes)]
  outs = [p.communicate(timeout=900) for p in procs]
  for p, (_, err) in zip(procs, outs):
    if p.returncode:
      raise RuntimeError(f"a worker failed:\n{err[-3000:]}")
  return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--worker", nargs=5, type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    _worker(*args.worker)
    return
  print("| processes x devices | jax_data steps/s | compute only steps/s "
        "| jax_data / compute only | refresh transfer per process |")
  print("|---|---|---|---|---|")
  for processes in args.processes:
    if DEVICES % processes:
      raise SystemExit(f"--processes must divide {DEVICES}, got {processes}")
    r = run(processes, args.steps, args.repeats)
    print(f"| {r['processes']} x {r['local']} | "
          f"{args.steps / r['jax_data']:,.0f} | "
          f"{args.steps / r['compute only']:,.0f} | "
          f"{r['jax_data'] / r['compute only']:.2f}x | "
          f"{r['transfer'] * 1e6:,.0f} µs |", flush=True)


if __name__ == "__main__":
  main()
