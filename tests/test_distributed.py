"""Several processes: each maps over its shard of the observations.

Two real JAX processes join ``jax.distributed`` on 127.0.0.1 (CPU, one device
each) and run tests/distributed_worker.py; their shards' log-likelihoods,
combined, must equal the single-process full-data value. Random chains
restricted to a shard are tested in this process.

How the shards are combined: with a real cross-process collective,
``jax.experimental.multihost_utils.process_allgather``. On CPU it runs over
Gloo (``jax_cpu_collectives_implementation="gloo"``, the default of jax
0.10.2, which the worker also sets before ``jax.distributed.initialize``).
Each worker also writes its own partial value to a file, so the test checks
the collective against a plain sum of the files as well.
"""

import contextlib
import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_data
from jax_data import NumpyDataLoader
from jax_data.sampling import ObservationRange

WORKER = pathlib.Path(__file__).with_name("distributed_worker.py")
PROCESSES = 2
N = 1001  # odd: the two shards differ in size (500 and 501)
TIMEOUT_S = 180  # the workers take a few seconds; this only stops hangs


def _load_worker():
  spec = importlib.util.spec_from_file_location("_jax_data_dist_worker",
                                                WORKER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


worker = _load_worker()


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker_env(devices=1):
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  # ``devices`` CPU devices per process, not conftest's forced count.
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if devices > 1:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  else:
    env.pop("XLA_FLAGS", None)
  # The workers import the same jax_data as this test.
  root = str(pathlib.Path(jax_data.__file__).resolve().parent.parent)
  env["PYTHONPATH"] = os.pathsep.join(
      [root] + [p for p in [env.get("PYTHONPATH")] if p])
  return env


def _run_workers(tmp_path, data_path, processes=PROCESSES, extra=(),
                 name="worker", devices=1, until_all=False):
  """Starts the workers, waits for all, kills them on a failure (unless
  ``until_all``: only when the time is up) or timeout.

  Returns ``([(returncode, output_text, out_path), ...], report)``.
  """
  port = _free_port()
  env = _worker_env(devices)
  procs = []
  timed_out = False
  with contextlib.ExitStack() as stack:
    try:
      for i in range(processes):
        log = stack.enter_context(open(tmp_path / f"{name}{i}.log", "wb"))
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), str(processes),
             str(data_path), str(tmp_path / f"{name}{i}.npz"), *extra],
            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True))
      # Wait for all; stop at once when one fails (the others would wait
      # for it in jax.distributed) or when the time is up.
      deadline = time.monotonic() + TIMEOUT_S
      while any(p.poll() is None for p in procs):
        if not until_all and any(p.poll() not in (None, 0) for p in procs):
          break
        if time.monotonic() > deadline:
          timed_out = True
          break
        time.sleep(0.05)
    finally:
      for p in procs:  # only our own workers, by their process group
        if p.poll() is None:
          with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
          p.wait()
  results = [(p.returncode,
              (tmp_path / f"{name}{i}.log").read_text(errors="replace"),
              tmp_path / f"{name}{i}.npz") for i, p in enumerate(procs)]
  report = "\n".join(
      f"--- worker {i} (exit {rc}) on port {port} ---\n{text[-4000:]}"
      for i, (rc, text, _) in enumerate(results))
  assert not timed_out, f"workers ran past {TIMEOUT_S} s:\n{report}"
  return results, report


def _numpy_loglik(x, mu):
  return float(np.sum(worker.gaussian_loglik(x.astype(np.float64), mu)))


def test_two_processes_map_their_shards_and_combine_to_the_full_value(
    tmp_path):
  x = np.random.default_rng(0).normal(0.3, 1.3, N).astype(np.float32)
  data_path = tmp_path / "x.npy"
  np.save(data_path, x)

  # Chains saved in this process, restored a half in each worker.
  pipeline = jax_data.random_reference_data(
      NumpyDataLoader(index=np.arange(N)), 3, 8)
  states = [pipeline[0](seed=worker.SEED + c, shuffle=True, stream="counter")
            for c in range(worker.CHAINS)]
  stacked = jax.tree_util.tree_map(lambda *s: jnp.stack(s), *states)
  for _ in range(worker.STEPS):
    stacked, _ = jax.jit(jax.vmap(pipeline[1]))(stacked)
  jax_data.save_checkpoint(tmp_path / worker.CHECKPOINT, pipeline, stacked)
  pipeline[2]()

  results, report = _run_workers(tmp_path, data_path)
  assert all(rc == 0 for rc, _, _ in results), report
  outs = [dict(np.load(out)) for _, _, out in results]
  from jax_data.counter_streams import stream_batches
  per_process = worker.CHAINS // PROCESSES
  for i, out in enumerate(outs):
    for lane, chain in enumerate(range(per_process * i,
                                       per_process * (i + 1))):
      expected, _ = stream_batches(worker.SEED + chain, worker.STEPS, 3, 8,
                                   N, True, False)
      np.testing.assert_array_equal(out["continued"][:, lane], expected,
                                    err_msg=report)

  # The single-process full-data value: the same map without shards, and
  # NumPy in float64.
  mapper_fn, release_fn = jax_data.full_data_mapper(
      NumpyDataLoader(x=x), worker.CACHE, worker.MB)

  def loglik(mu):
    sums, _ = mapper_fn(
        lambda b, m, c: (jnp.sum(jnp.where(
            m, worker.gaussian_loglik(b["x"], mu), 0.0)), c), None,
        masking=True)
    return jnp.sum(sums)

  mus = jnp.asarray(worker.MUS, jnp.float32)
  full = np.asarray(jax.jit(jax.vmap(loglik))(mus))
  release_fn()
  full_numpy = [_numpy_loglik(x, mu) for mu in worker.MUS]
  np.testing.assert_allclose(full, full_numpy, rtol=1e-5)

  shards = [ObservationRange.shard(N, i, PROCESSES) for i in range(PROCESSES)]
  orbax_files = sorted(p.name for p in tmp_path.glob("orbax/1/data/*"))
  for i, (out, shard) in enumerate(zip(outs, shards)):
    # Through Orbax, each process saved and restored its own chains.
    if importlib.util.find_spec("orbax") is not None:
      assert int(out["orbax_same"]) == 1, report
      assert f"data.process-{i}-of-{PROCESSES}.npz" in orbax_files, (
          orbax_files)
    assert int(out["device_count"]) == PROCESSES, report
    assert int(out["local_device_count"]) == 1, report
    # Combined with the collective: every process holds the full value.
    np.testing.assert_allclose(out["total"], full, rtol=1e-5, err_msg=report)
    # Also as one value inside compiled code (pmap, psum over processes).
    np.testing.assert_allclose(out["in_jit"], full, rtol=1e-5,
                               err_msg=report)
    np.testing.assert_allclose(out["total"], full_numpy, rtol=1e-5)
    # Gathered in process order; each process's part is its shard's value.
    np.testing.assert_array_equal(
        out["partials"], np.stack([o["partial"] for o in outs]))
    np.testing.assert_allclose(
        out["partial"],
        [_numpy_loglik(x[shard.start:shard.start + shard.count], mu)
         for mu in worker.MUS], rtol=1e-5)
    # Each process saw exactly its contiguous shard, in order.
    np.testing.assert_array_equal(
        out["seen"], np.arange(shard.start, shard.start + shard.count))
    gathered = out["indices"]
    for j in range(PROCESSES):
      np.testing.assert_array_equal(gathered[j][gathered[j] >= 0],
                                    outs[j]["seen"])
    # Its random chain, restricted by process_shard(), stayed in the shard.
    drawn = out["drawn"]
    assert drawn.min() >= shard.start, (i, drawn)
    assert drawn.max() < shard.start + shard.count, (i, drawn)

  if importlib.util.find_spec("orbax") is not None:
    _restore_on_other_topologies(tmp_path, outs)

  # The file route agrees with the collective.
  np.testing.assert_allclose(sum(o["partial"] for o in outs), full,
                             rtol=1e-5)
  # Disjoint shards that cover every observation once.
  seen = [set(o["seen"].tolist()) for o in outs]
  assert len(seen[0]) + len(seen[1]) == N
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == set(range(N))


def _draw(loader, shard, batches, **kwargs):
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 3, 8)
  state = init_fn(**shard, **kwargs)

  @jax.jit
  def run(state):
    return lax.scan(lambda s, _: batch_fn(s, information=True), state, None,
                    length=batches)

  _, (batch, info) = run(state)
  release_fn()
  return np.asarray(batch["index"]), np.asarray(info.mask)


@pytest.mark.parametrize("mode", [
    {"seed": 3},
    {"seed": 3, "shuffle": True},
    {"seed": 3, "shuffle": True, "in_epochs": True}])
def test_random_chains_stay_in_their_shard(mode):
  loader = NumpyDataLoader(index=np.arange(N))
  covered = set()
  for i in range(PROCESSES):
    shard = ObservationRange.shard(N, i, PROCESSES)
    per_epoch = -(-shard.count // 8)
    indices, mask = _draw(loader, {"shard_index": i,
                                   "shard_count": PROCESSES},
                          per_epoch, **mode)
    valid = indices[mask]
    assert valid.min() >= shard.start and valid.max() < (
        shard.start + shard.count), (i, valid)
    if mode.get("shuffle"):
      # A shuffled chain's first shard.count draws (in epochs: its first
      # epoch, padding masked) are its whole shard, once.
      assert sorted(valid[:shard.count].tolist()) == list(
          range(shard.start, shard.start + shard.count))
    covered |= set(valid.tolist())
  if mode.get("shuffle"):
    assert covered == set(range(N))


def test_process_shard_defaults_to_this_single_process():
  assert jax_data.process_shard() == {"shard_index": jax.process_index(),
                                      "shard_count": jax.process_count()}
  assert jax_data.process_shard() == {"shard_index": 0, "shard_count": 1}
  loader = NumpyDataLoader(index=np.arange(N))
  # One process holds everything: the same draws as without a shard.
  with_shard = _draw(loader, jax_data.process_shard(), 4, seed=5)
  without = _draw(loader, {}, 4, seed=5)
  np.testing.assert_array_equal(with_shard[0], without[0])
  mapper_fn, _ = jax_data.full_data_mapper(loader, 4, 16,
                                           **jax_data.process_shard())
  seen, _ = mapper_fn(lambda b, c: (b["index"], c), None)
  np.testing.assert_array_equal(seen, np.arange(N))


def _restore_on_other_topologies(tmp_path, outs):
  """The Orbax step that the 2 workers saved (2 chains each) restores in
  this one process (all 4 chains, in process order), in a job of 4
  processes of 2 CPU devices each (one chain each), and in a job of 2
  such processes with global batches (all 4 chains in each); every chain
  draws what its worker drew after the save."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  drawn = np.concatenate([o["orbax_drawn"] for o in outs], axis=1)
  pipeline = jax_data.random_reference_data(
      NumpyDataLoader(index=np.arange(N)), 3, 8)
  with ocp.CheckpointManager(tmp_path / "orbax") as manager:
    state = manager.restore(1, args=ocp.args.Composite(
        data=jax_data.DataRestore(pipeline))).data
  step = jax.jit(jax.vmap(pipeline[1]))
  here = []
  for _ in range(drawn.shape[0]):
    state, batch = step(state)
    here.append(np.asarray(batch["index"]))
  np.testing.assert_array_equal(np.stack(here), drawn)
  pipeline[2]()

  results, report = _run_workers(
      tmp_path, N, processes=4,
      extra=("orbax-restore", str(tmp_path / "orbax")), name="restore",
      devices=2)
  assert all(rc == 0 for rc, _, _ in results), report
  for i, (_, _, out) in enumerate(results):
    out = dict(np.load(out))
    assert int(out["local_device_count"]) == 2, report
    np.testing.assert_array_equal(out["drawn"][:, 0], drawn[:, i],
                                  err_msg=report)

  # A pipeline of global batches (the same chains in every process, each
  # batch's rows split over the processes) restores every saved chain
  # whole in every process, not each process its own.
  results, report = _run_workers(
      tmp_path, N, extra=("orbax-restore-global", str(tmp_path / "orbax")),
      name="restore-global", devices=2)
  assert all(rc == 0 for rc, _, _ in results), report
  for _, _, out in results:
    np.testing.assert_array_equal(dict(np.load(out))["drawn"], drawn,
                                  err_msg=report)


def test_two_processes_of_two_devices_pmap_their_own_chains(tmp_path):
  """Under pmap over all 4 devices of 2 processes, each process's host
  serves the refreshes of its 2 devices: they meet there at once (no wait
  for the other process's devices), and every chain draws its own stream."""
  results, report = _run_workers(tmp_path, N, extra=("pmap",), name="pmap",
                                 devices=2)
  assert all(rc == 0 for rc, _, _ in results), report
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      NumpyDataLoader(index=np.arange(N)), 3, 8)
  for i, (_, _, out) in enumerate(results):
    out = dict(np.load(out))
    assert int(out["local_device_count"]) == 2, report
    assert int(out["device_count"]) == 4, report
    assert int(out["stalls"]) == 0, report
    for d in range(2):
      state, expected = init_fn(seed=100 + 2 * i + d), []
      for _ in range(5):
        state, batch = batch_fn(state)
        expected.append(np.asarray(batch["index"]))
      np.testing.assert_array_equal(out["drawn"][:, d], np.stack(expected))
  release_fn()


@pytest.mark.parametrize("processes, devices", [(2, 2), (4, 2), (4, 1)])
def test_global_batches_over_processes_equal_one_process(tmp_path,
                                                         processes, devices):
  """One chain's batch split over the devices of 2 or 4 processes (1 or 2
  each): each process serves only its devices' rows, the global batch
  equals the single-process batch of the seed (also on a mesh of one
  device of each process of two, without waiting for the other's
  requests), and a data-parallel
  gradient step (XLA reduces the gradient across processes) follows the
  single-process one. On a 2-D mesh (batch axis across the processes,
  chains within them), ``jax_data.scan`` draws each chain's single-process
  batches. The global state the processes saved through Orbax restores in
  this one process. A full-data pass split over every device gives the
  single-process value inside jit."""
  results, report = _run_workers(tmp_path, N, processes=processes,
                                 extra=("global",), name="global",
                                 devices=devices)
  assert all(rc == 0 for rc, _, _ in results), report
  data = worker.global_data(np, N)
  loader = NumpyDataLoader(**data)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 3, worker.GLOBAL_MB)
  state, w = init_fn(seed=7, shuffle=True), np.zeros(3, np.float32)
  drawn, weights = [], []
  for _ in range(worker.GLOBAL_STEPS):
    state, batch = batch_fn(state)
    grad = jax.grad(lambda w, b=batch: worker.logistic_loss(jnp, w, b))(w)
    w = w - 0.01 * grad
    drawn.append(np.asarray(batch["index"]))
    weights.append(np.asarray(w))
  mapper_fn, mapper_release = jax_data.full_data_mapper(loader, 2, 16)
  losses, _ = mapper_fn(
      lambda b, m, c: (worker.logistic_loss(
          jnp, jnp.ones(3), worker.masked(jax, b, m)), c),
      None, masking=True)
  full_value = float(jnp.sum(losses))
  mapper_release()
  grid = []
  for seed in worker.GLOBAL_SEEDS:
    # Chains made together (the grid's) draw counter-based streams.
    chain, rows = init_fn(seed=seed, shuffle=True, in_epochs=True,
                          stream="counter"), []
    for _ in range(worker.GLOBAL_STEPS):
      chain, batch = batch_fn(chain)
      rows.append(np.asarray(batch["index"]))
    grid.append(rows)
  release_fn()
  for i, (_, _, out) in enumerate(results):
    out = dict(np.load(out))
    assert int(out["device_count"]) == devices * processes, report
    assert out["parts"].tolist() == list(
        range(devices * i, devices * (i + 1))), report
    np.testing.assert_allclose(
        out["full"], [full_value] * (1 + (devices > 1)), rtol=1e-5,
        err_msg=report)
    np.testing.assert_array_equal(out["drawn"], np.stack(drawn),
                                  err_msg=report)
    # A mesh of one device of each process: the same batches, no stall.
    assert int(out["stalls"]) == 0, report
    if devices > 1:
      np.testing.assert_array_equal(out["subset"], np.stack(drawn),
                                    err_msg=report)
    np.testing.assert_allclose(out["weights"], np.stack(weights),
                               rtol=1e-5, err_msg=report)
    np.testing.assert_array_equal(
        out["grid"], np.stack(grid).transpose(1, 0, 2), err_msg=report)
  if importlib.util.find_spec("orbax") is not None:
    _restore_global_state(tmp_path / "global-orbax", loader, out["after"])


def _restore_global_state(directory, loader, after):
  """The global state that 2 processes saved through Orbax restores in
  this one process on a mesh of 4 devices, and without a mesh."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  for extra in ({"mesh": mesh, "batch_axis": "data"}, {}):
    pipeline = jax_data.random_reference_data(loader, 3, worker.GLOBAL_MB,
                                              **extra)
    with ocp.CheckpointManager(directory) as manager:
      state = manager.restore(1, args=ocp.args.Composite(
          data=jax_data.DataRestore(pipeline))).data
    for expected in after:
      state, batch = pipeline[1](state)
      np.testing.assert_array_equal(batch["index"], expected)
    pipeline[2]()


@pytest.mark.parametrize("ending", ["osexit", "normal"])
def test_a_loader_failure_in_one_process_ends_every_process(tmp_path,
                                                            ending):
  """The source fails in one process of a data-parallel job: that process
  raises the loader's error, naming the record. Ended at once, as the
  docs say, the other process's collective fails soon after; ended
  normally, its exit first says on stderr why it stalls, and jax.distributed's
  shutdown timeout (shortened here) ends both."""
  start = time.monotonic()
  results, report = _run_workers(tmp_path, N, extra=("fail", ending),
                                 name=f"fail-{ending}", until_all=True)
  assert all(rc != 0 for rc, _, _ in results), report
  failed = results[worker.FAILING_PROCESS][1]
  assert "HostLoaderError" in failed, report
  assert "OSError: corrupt record" in failed, report
  said = ("jax_data: a host callback failed in process "
          f"{worker.FAILING_PROCESS} of this jax.distributed job of 2")
  if ending == "normal":
    assert said in failed, report
    assert "shutdown_timeout_seconds" in failed, report
  else:  # os._exit skips the exit hooks
    assert said not in failed, report
    assert time.monotonic() - start < TIMEOUT_S / 2, report
  other = results[1 - worker.FAILING_PROCESS][1]
  assert "jax_data: a host callback failed" not in other, report
