"""One of several JAX processes for tests/test_distributed.py.

Not a test module: tests/test_distributed.py starts it as a script,

  python distributed_worker.py PORT PROCESS_ID PROCESS_COUNT DATA.npy OUT.npz

It joins ``jax.distributed`` on 127.0.0.1:PORT, maps a Gaussian
log-likelihood over this process's shard of the observations in DATA.npy
(``full_data_mapper(..., **jax_data.process_shard())``), combines the shards'
values with a cross-process collective and writes what it saw to OUT.npz.
Importing it (pytest's doctest collection does) has no side effects.
"""

import math
import os
import sys
import traceback

# Locations of the Gaussian model: log N(x | mu, SIGMA ** 2), float32.
MUS = (-0.5, 0.0, 0.25, 1.5)
SIGMA = 1.3
CACHE = 4  # batches per host call
MB = 16  # observations per batch; 1001 // 2 is not a multiple: padding
# A checkpoint of CHAINS counter-based random chains (random_reference_data(
# NumpyDataLoader(index=arange(N)), 3, 8), seeds SEED + c, shuffled, at
# chunk STEPS) that the test writes to the workers' directory.
CHECKPOINT = "chains.npz"
CHAINS = 8
SEED = 40
STEPS = 2


def gaussian_loglik(x, mu, sigma=SIGMA):
  """log N(x | mu, sigma ** 2), element-wise; works on NumPy and JAX."""
  z = (x - mu) / sigma
  return -0.5 * z * z - math.log(sigma) - 0.5 * math.log(2 * math.pi)


def _orbax_pipeline(jax_data, np, count):
  return jax_data.random_reference_data(
      jax_data.NumpyDataLoader(index=np.arange(count)), 3, 8)


def _draw(step, state, steps, np):
  drawn = []
  for _ in range(steps):
    state, batch = step(state)
    drawn.append(np.asarray(batch["index"]))
  return state, np.stack(drawn)


def join(argv):
  """Joins the job of ``argv`` (``PORT PROCESS_ID PROCESS_COUNT``):
  returns ``(jax, process_id, process_count)``. Cross-process collectives
  on CPU go over Gloo (jax 0.10.2 offers gloo, mpi or megascale; gloo is
  the default and needs nothing installed), named anyway before
  ``initialize`` so that ``process_allgather`` works."""
  port, process_id, process_count = (int(a) for a in argv[1:4])
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=process_count,
                             process_id=process_id,
                             initialization_timeout=30)
  return jax, process_id, process_count


def orbax_restore(argv):
  """Another job: every process restores its share of the chains that an
  Orbax step (saved by the first job's processes) holds, and draws."""
  count, out_path, directory = int(argv[4]), argv[5], argv[7]
  jax, process_id, process_count = join(argv)
  import numpy as np
  import orbax.checkpoint as ocp

  import jax_data
  pipeline = _orbax_pipeline(jax_data, np, count)
  with ocp.CheckpointManager(directory) as manager:
    restored = manager.restore(1, args=ocp.args.Composite(
        data=jax_data.DataRestore(pipeline))).data
  _, drawn = _draw(jax.jit(jax.vmap(pipeline[1])), restored, 4, np)
  np.savez(out_path, drawn=drawn, local_device_count=jax.local_device_count())
  pipeline[2]()
  jax.distributed.shutdown()
  return 0


def orbax_restore_global(argv):
  """Another job, two devices per process: the chains that an Orbax step
  (saved by the first job's processes, each its own) holds, restored into
  a pipeline of global batches whose chain axis lies within each process
  and batch axis across them; draws the global batches."""
  count, out_path, directory = int(argv[4]), argv[5], argv[7]
  jax, _, _ = join(argv)
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh

  import jax_data
  # Axis 0 (chains): a process's two devices; axis 1 (rows): the processes.
  devices = np.array(jax.devices()).reshape(-1, 2).T
  grid = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(index=np.arange(count)), 3, 8,
      mesh=Mesh(devices, ("chains", "rows")), batch_axis="rows",
      chain_axis="chains")
  with ocp.CheckpointManager(directory) as manager:
    state = manager.restore(1, args=ocp.args.Composite(
        data=jax_data.DataRestore(grid))).data
  drawn = []
  for _ in range(4):
    state, batch = grid[1](state)
    drawn.append(np.asarray(multihost_utils.process_allgather(
        batch["index"], tiled=True)))
  np.savez(out_path, drawn=np.stack(drawn))
  grid[2]()
  multihost_utils.sync_global_devices("drawn")
  jax.distributed.shutdown()
  return 0


def pmap_chains(argv):
  """Another job, two devices per process: a chain per local device under
  pmap; the refresh's devices meet on their own process's host."""
  count, out_path = int(argv[4]), argv[5]
  import warnings  # pylint: disable=g-import-not-at-top

  jax, process_id, process_count = join(argv)
  import numpy as np

  import jax_data
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(index=np.arange(count)), 3, 8)
  local = jax.local_device_count()
  state = jax.tree_util.tree_map(
      lambda *s: np.stack(s),
      *[init_fn(seed=100 + local * process_id + d) for d in range(local)])
  step = jax.pmap(batch_fn)
  drawn = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(5):  # past a refresh: cache 3
      state, batch = step(state)
      drawn.append(np.asarray(batch["index"]))
  stalls = sum("asked for chunk" in str(w.message) for w in caught)
  np.savez(out_path, drawn=np.stack(drawn), stalls=stalls,
           local_device_count=local, device_count=jax.device_count())
  release_fn()
  jax.distributed.shutdown()
  return 0


GLOBAL_MB = 8  # rows of one chain's global batch
GLOBAL_STEPS = 5  # past a refresh: cache 3
GLOBAL_SEEDS = (11, 12)  # the chains of the 2-D mesh


def global_data(np, count):
  """The logistic-regression data of the global-batch job."""
  x = np.random.default_rng(1).normal(size=(count, 3)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5], np.float32) > 0).astype(np.float32)
  return {"x": x, "y": y, "index": np.arange(count)}


def logistic_loss(jnp, w, batch):
  """The negative log-likelihood of a batch; works on NumPy and JAX."""
  z = batch["x"] @ w
  return jnp.sum(jnp.logaddexp(0.0, z) - batch["y"] * z)


def masked(jax, batch, mask):
  """``batch`` with the rows that ``mask`` marks invalid zeroed (their loss
  is then log 2 each: the loss of the valid rows is ``logistic_loss`` of
  it less ``log 2`` per invalid row)."""
  return jax.tree_util.tree_map(
      lambda v: v * mask.reshape((-1,) + (1,) * (v.ndim - 1)), batch)


def global_batches(argv):
  """Another job (1 or 2 devices per process): one chain's global batch over
  every device (a data-parallel gradient step), and chains x batch rows on
  a 2-D mesh whose batch axis spans the processes."""
  count, out_path = int(argv[4]), argv[5]
  jax, process_id, process_count = join(argv)
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh

  import jax_data
  loader = jax_data.NumpyDataLoader(**global_data(np, count))
  devices = np.array(jax.devices())
  gather = lambda x: np.asarray(multihost_utils.process_allgather(
      x, tiled=True))

  pipeline = jax_data.random_reference_data(
      loader, 3, GLOBAL_MB, mesh=Mesh(devices, ("data",)), batch_axis="data")
  init_fn, batch_fn, release_fn = pipeline

  @jax.jit
  def step(w, state):
    state, batch = batch_fn(state)
    grad = jax.grad(lambda w: logistic_loss(jnp, w, batch))(w)
    return w - 0.01 * grad, state, batch["index"]

  w, state = jnp.zeros(3), init_fn(seed=7, shuffle=True)
  drawn, weights = [], []
  for _ in range(GLOBAL_STEPS):
    w, state, index = step(w, state)
    drawn.append(gather(index))
    weights.append(gather(w))
  # This process's host serves the parts of its own devices only.
  parts = sorted(pipeline.host.chain(n).spec.part.index
                 for n in pipeline.host.chains())
  after = []
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError:
    ocp = None
  if ocp is not None:  # the global state, saved by every process
    directory = os.path.join(os.path.dirname(out_path), "global-orbax")
    with ocp.CheckpointManager(directory) as manager:
      manager.save(1, args=ocp.args.Composite(
          data=jax_data.DataSave(pipeline, state)))
      manager.wait_until_finished()
    for _ in range(GLOBAL_STEPS):
      w, state, index = step(w, state)
      after.append(gather(index))
  release_fn()

  # A full-data pass split over every device: one value inside jit.
  mapper_fn, release_fn = jax_data.full_data_mapper(
      loader, 2, 16, mesh=Mesh(devices, ("data",)), batch_axis="data")

  @jax.jit
  def full_loss(w):
    losses, _ = mapper_fn(
        lambda b, m, c: (logistic_loss(jnp, w, masked(jax, b, m)), c),
        None, masking=True)
    return jnp.sum(losses)

  full = np.asarray(gather(full_loss(jnp.ones(3))[None]))
  release_fn()

  mesh = Mesh(devices.reshape(process_count, -1), ("data", "chains"))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 3, GLOBAL_MB, mesh=mesh, batch_axis="data",
      chain_axis="chains")

  @jax.jit
  def scanned(state):
    return jax_data.scan(lambda c, b: (c, b["index"]), 0, state,
                         batch_fn=batch_fn, length=GLOBAL_STEPS)

  (_, state), index = scanned(init_fn(seed=list(GLOBAL_SEEDS),
                                      shuffle=True, in_epochs=True))
  grid = gather(index)
  release_fn()

  # A mesh of one device of each process (of two): each process's host
  # waits for that device's requests only, not for its other device's.
  subset, stalls = np.zeros((0, GLOBAL_MB), np.int32), 0
  if jax.local_device_count() > 1:
    import warnings  # pylint: disable=g-import-not-at-top
    mesh = Mesh(devices.reshape(process_count, -1)[:, 0], ("data",))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      init_fn, batch_fn, release_fn = jax_data.random_reference_data(
          loader, 3, GLOBAL_MB, mesh=mesh, batch_axis="data")
      state, subset = init_fn(seed=7, shuffle=True), []
      for _ in range(GLOBAL_STEPS):
        state, batch = batch_fn(state)
        subset.append(gather(batch["index"]))
      release_fn()
      mapper_fn, release_fn = jax_data.full_data_mapper(
          loader, 2, 16, mesh=mesh, batch_axis="data")
      subset_full = mapper_fn(
          lambda b, m, c: (logistic_loss(jnp, jnp.ones(3),
                                         masked(jax, b, m)), c),
          None, masking=True)[0]
      full = np.concatenate([full, gather(jnp.sum(subset_full)[None])])
      release_fn()
    stalls = sum("asked for chunk" in str(w.message) for w in caught)
  multihost_utils.sync_global_devices("jax_data global batches done")
  np.savez(out_path, drawn=np.stack(drawn), weights=np.stack(weights),
           after=np.array(after), full=full, subset=np.array(subset),
           stalls=stalls, parts=np.array(parts), grid=grid,
           local_device_count=jax.local_device_count(),
           device_count=jax.device_count())
  jax.distributed.shutdown()
  return 0


FAILING_PROCESS = 1  # its source fails after FAILING_AFTER records
FAILING_AFTER = 40


def failing(argv):
  """Another job: data-parallel gradient steps over a global batch (an
  all-reduce each step) whose source fails in process FAILING_PROCESS
  only. ``argv[7]``: ``"osexit"`` ends a failed process as the docs say
  (the caller's ``os._exit``); ``"normal"`` lets the error end Python,
  with jax.distributed's shutdown timeout shortened to
  SHUTDOWN_TIMEOUT_S."""
  count = int(argv[4])
  port, process_id, process_count = (int(a) for a in argv[1:4])
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}", num_processes=process_count,
      process_id=process_id, initialization_timeout=30,
      shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import jax_data
  rows = global_data(np, count)

  class Source:
    """Records of the global-batch data; fails in one process."""
    reads = 0

    def __len__(self):
      return count

    def __getitem__(self, i):
      Source.reads += 1
      if process_id == FAILING_PROCESS and Source.reads > FAILING_AFTER:
        raise OSError(f"corrupt record {i} in process {process_id}")
      return {k: v[i] for k, v in rows.items()}

  init_fn, batch_fn, _ = jax_data.random_reference_data(
      jax_data.SourceDataLoader(Source(), workers=0), 3, GLOBAL_MB,
      mesh=Mesh(np.array(jax.devices()), ("data",)), batch_axis="data")

  @jax.jit
  def step(w, state):
    state, batch = batch_fn(state)
    grad = jax.grad(lambda w: logistic_loss(jnp, w, batch))(w)
    return w - 0.01 * grad, state

  w, state = jnp.zeros(3), init_fn(seed=7)
  for _ in range(10 * FAILING_AFTER):
    w, state = jax.block_until_ready(step(w, state))
  return 0


SHUTDOWN_TIMEOUT_S = 5


def _orbax_round_trip(jax, np, jax_data, count, process_id, directory):
  """1 if this process's chains, saved through Orbax and restored, draw
  what they drew after the save, and those draws; -1 without Orbax."""
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError:
    return -1, np.zeros(0)
  pipeline = _orbax_pipeline(jax_data, np, count)
  states = [pipeline[0](seed=100 + 10 * process_id + c, shuffle=True)
            for c in range(2)]
  state = jax.tree_util.tree_map(lambda *s: np.stack(s), *states)
  step = jax.jit(jax.vmap(pipeline[1]))
  state, _ = step(state)
  with ocp.CheckpointManager(directory) as manager:
    manager.save(1, args=ocp.args.Composite(
        data=jax_data.DataSave(pipeline, state)))
    manager.wait_until_finished()
  _, drawn = _draw(step, state, 4, np)
  with ocp.CheckpointManager(directory) as manager:
    restored = manager.restore(1, args=ocp.args.Composite(
        data=jax_data.DataRestore(pipeline))).data
  _, again = _draw(step, restored, 4, np)
  pipeline[2]()
  return int(np.array_equal(drawn, again)), drawn


def main(argv):
  data_path, out_path = argv[4:6]
  jax, process_id, process_count = join(argv)

  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils

  import jax_data

  shard = jax_data.process_shard()
  assert shard == {"shard_index": process_id,
                   "shard_count": process_count}, shard

  x = np.load(data_path)
  count = x.shape[0]
  loader = jax_data.NumpyDataLoader(x=x, index=np.arange(count))
  mapper_fn, release_fn = jax_data.full_data_mapper(loader, CACHE, MB,
                                                    **shard)

  def loglik(mu):
    sums, _ = mapper_fn(
        lambda b, m, c: (jnp.sum(jnp.where(m, gaussian_loglik(b["x"], mu),
                                           0.0)), c), None, masking=True)
    return jnp.sum(sums)

  mus = jnp.asarray(MUS, jnp.float32)
  partial = np.asarray(jax.jit(jax.vmap(loglik))(mus))  # this shard's sums
  # The full-data value as one value inside compiled code: pmap over every
  # process's device, each passing over its process's shard, summed over
  # the processes by psum.
  in_jit = np.asarray(jax.pmap(
      lambda mu: jax.lax.psum(jax.vmap(loglik)(mu), "processes"),
      axis_name="processes")(np.asarray(mus)[None]))[0]
  seen, _ = jax.jit(lambda: mapper_fn(lambda b, c: (b["index"], c), None))()
  seen = np.asarray(seen)
  release_fn()

  # A random chain restricted to this process's shard, by the same keywords.
  init_fn, batch_fn, release_random = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(index=np.arange(count)), 3, 8)
  state = init_fn(seed=7, shuffle=True, **shard)
  drawn = []
  for _ in range(5):
    state, batch = batch_fn(state)
    drawn.append(np.asarray(batch["index"]))
  release_random()

  # This process's lanes of a checkpoint of CHAINS counter-based chains
  # that the test saved in one process: each continues its stream.
  pipeline = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(index=np.arange(count)), 3, 8)
  per_process = CHAINS // process_count
  lanes = range(per_process * process_id, per_process * (process_id + 1))
  restored = jax_data.restore_checkpoint(CHECKPOINT, pipeline, lanes=lanes)
  step = jax.jit(jax.vmap(pipeline[1]))
  continued = []
  for _ in range(3):
    restored, batch = step(restored)
    continued.append(np.asarray(batch["index"]))
  pipeline[2]()

  # Orbax: every process saves its own chains into one CheckpointManager
  # step (a file each), draws on, restores them and draws the same.
  orbax_same, orbax_drawn = _orbax_round_trip(
      jax, np, jax_data, count, process_id,
      os.path.join(os.path.dirname(os.path.abspath(out_path)), "orbax"))

  # Combine across processes with a real collective (gloo on CPU). Shards
  # differ in size by one, so the index lists are padded with -1 first.
  longest = -(-count // process_count)
  padded = np.full(longest, -1, np.int32)
  padded[:seen.size] = seen
  partials = np.asarray(multihost_utils.process_allgather(partial))
  indices = np.asarray(multihost_utils.process_allgather(padded))
  multihost_utils.sync_global_devices("jax_data distributed test done")

  np.savez(out_path, partial=partial, partials=partials,
           total=partials.sum(axis=0), seen=seen, indices=indices,
           drawn=np.stack(drawn), continued=np.stack(continued),
           device_count=jax.device_count(), orbax_same=orbax_same,
           in_jit=in_jit,
           orbax_drawn=orbax_drawn,
           local_device_count=jax.local_device_count())
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  if sys.argv[6:8] == ["fail", "normal"]:
    sys.exit(failing(sys.argv))  # the failure ends Python as usual
  try:
    mode = sys.argv[6:7]
    status = (orbax_restore(sys.argv) if mode == ["orbax-restore"] else
              orbax_restore_global(sys.argv)
              if mode == ["orbax-restore-global"] else
              pmap_chains(sys.argv) if mode == ["pmap"] else
              global_batches(sys.argv) if mode == ["global"] else
              failing(sys.argv) if mode == ["fail"] else
              main(sys.argv))
  except BaseException:  # noqa: BLE001 - report anything, then leave
    # A failed process must not linger: at exit jax.distributed would wait
    # (up to its shutdown timeout) for the other processes, which in turn
    # wait for this one. Print the error and leave at once.
    traceback.print_exc()
    status = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)
