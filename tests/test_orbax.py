"""Data positions in Orbax checkpoints (jax_data.compiled.orbax_checkpoint)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jax_data

ocp = pytest.importorskip("orbax.checkpoint")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Built the same way in this process and in a fresh one.
SETUP = """
import jax
import numpy as np
import jax_data
loader = jax_data.NumpyDataLoader(
    x=np.arange(3000.0, dtype=np.float32).reshape(1000, 3))
pipeline = jax_data.random_reference_data(loader, 5, 8)
init_fn, batch_fn, release_fn = pipeline
step = jax.jit(jax.vmap(batch_fn))
"""


def _pipeline():
  scope = {}
  exec(SETUP, scope)  # pylint: disable=exec-used
  return scope["pipeline"], scope["step"], scope["init_fn"]


def _chains(init_fn):
  return jax.tree_util.tree_map(
      lambda *xs: np.stack(xs), *[init_fn(seed=s, shuffle=True, in_epochs=True)
                                  for s in range(4)])


def _run(step, state, steps):
  batches = []
  for _ in range(steps):
    state, batch = step(state)
    batches.append(np.asarray(batch["x"]))
  return state, np.stack(batches)


def _save(directory, step_number, pipeline, state, params, **options):
  manager = ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(**options))
  manager.save(step_number, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params),
      data=jax_data.DataSave(pipeline, state)))
  return manager


def _restore(directory, step_number, pipeline, params):
  with ocp.CheckpointManager(directory) as manager:
    return manager.restore(step_number, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params),
        data=jax_data.DataRestore(pipeline)))


def test_a_fresh_process_continues_the_saved_chains_bit_for_bit(tmp_path):
  """Parameters and the positions of 4 vmapped shuffled chains in one
  CheckpointManager step; a new process restores both and draws exactly the
  batches this one draws after the save."""
  pipeline, step, init_fn = _pipeline()
  state, _ = _run(step, _chains(init_fn), 7)  # mid-cache, mid-epoch
  params = {"w": np.arange(6.0).reshape(2, 3)}
  with _save(tmp_path / "run", 7, pipeline, state, params) as manager:
    manager.wait_until_finished()
  _, expected = _run(step, state, 30)
  np.save(tmp_path / "expected.npy", expected)
  script = SETUP + textwrap.dedent(f"""
      import orbax.checkpoint as ocp
      params = {{"w": np.zeros((2, 3))}}
      with ocp.CheckpointManager({str(tmp_path / "run")!r}) as manager:
        restored = manager.restore(7, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(params),
            data=jax_data.DataRestore(pipeline)))
      state = restored.data
      batches = []
      for _ in range(30):
        state, batch = step(state)
        batches.append(np.asarray(batch["x"]))
      expected = np.load({str(tmp_path / "expected.npy")!r})
      assert (np.stack(batches) == expected).all(), "batches differ"
      assert (restored.params["w"] == np.arange(6.0).reshape(2, 3)).all()
      print("same")
      """)
  env = dict(os.environ, PYTHONPATH=ROOT)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                        text=True, env=env, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip().endswith("same")


def test_an_async_save_keeps_the_position_it_was_given(tmp_path):
  """With asynchronous writes the sampler goes on at once; the checkpoint
  still holds the position at the save, not a later one."""
  pipeline, step, init_fn = _pipeline()
  state, _ = _run(step, _chains(init_fn), 3)
  params = {"w": np.ones(2)}
  manager = _save(tmp_path / "run", 3, pipeline, state, params,
                  enable_async_checkpointing=True)
  later, following = _run(step, state, 40)  # meanwhile: the chains move on
  manager.wait_until_finished()
  manager.close()
  restored = _restore(tmp_path / "run", 3, pipeline, params)
  _, again = _run(step, restored.data, 40)
  np.testing.assert_array_equal(again, following)
  assert not np.array_equal(np.asarray(later.chunk),
                            np.asarray(restored.data.chunk))


def test_a_position_that_does_not_fit_is_refused_with_named_errors(tmp_path):
  pipeline, step, init_fn = _pipeline()
  state, _ = _run(step, _chains(init_fn), 2)
  params = {"w": np.ones(2)}
  with _save(tmp_path / "run", 2, pipeline, state, params) as manager:
    manager.wait_until_finished()
  # Other data: the fingerprint differs.
  other = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(x=np.ones((1000, 3), np.float32)), 5, 8)
  with pytest.raises(jax_data.CheckpointError,
                     match="data is .* in the checkpoint but"):
    _restore(tmp_path / "run", 2, other, params)
  # Another batch size.
  smaller = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(
          x=np.arange(3000.0, dtype=np.float32).reshape(1000, 3)), 5, 4)
  with pytest.raises(jax_data.CheckpointError,
                     match="mb_size is 8 in the checkpoint but 4 here"):
    _restore(tmp_path / "run", 2, smaller, params)
  # A position of another format version.
  [path] = (tmp_path / "run").glob("2/data/data.process-0-of-1.npz")
  with np.load(path) as data:
    tree = {k: data[k] for k in data.files}
  host = json.loads(tree["host"].tobytes())
  host["version"] = 99
  tree["host"] = np.frombuffer(json.dumps(host).encode(), np.uint8)
  with open(path, "wb") as f:
    np.savez(f, **tree)
  with pytest.raises(jax_data.CheckpointError, match="version"):
    _restore(tmp_path / "run", 2, pipeline, params)


def _split_by_process(directory, step_number, pipeline, state, processes):
  """Rewrites a step saved by this process as if ``processes`` processes
  had each saved an equal share of the chains."""
  [own] = (directory / str(step_number) / "data").glob("data.process-*")
  own.unlink()
  share = np.shape(state.chain)[0] // processes
  for i in range(processes):
    lanes = slice(i * share, (i + 1) * share)
    part = jax.tree_util.tree_map(lambda x, lanes=lanes: x[lanes], state)
    np.savez(own.with_name(f"data.process-{i}-of-{processes}.npz"),
             **jax_data.state_to_pytree(pipeline, part))


def test_a_position_saved_by_other_processes_restores_here(tmp_path):
  """Chains saved by 2 processes (a file each) restore in this one
  process, all of them in process order or some lanes, each continuing its
  stream."""
  pipeline, step, init_fn = _pipeline()
  state, _ = _run(step, _chains(init_fn), 3)
  params = {"w": np.ones(2)}
  with _save(tmp_path / "run", 3, pipeline, state, params) as manager:
    manager.wait_until_finished()
  _split_by_process(tmp_path / "run", 3, pipeline, state, 2)
  _, expected = _run(step, state, 12)
  restored = _restore(tmp_path / "run", 3, pipeline, params)
  np.testing.assert_array_equal(_run(step, restored.data, 12)[1], expected)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    some = manager.restore(3, args=ocp.args.Composite(
        data=jax_data.DataRestore(pipeline, lanes=[1, 2]))).data
  np.testing.assert_array_equal(_run(step, some, 12)[1], expected[:, 1:3])


def test_an_incomplete_or_uneven_set_of_positions_says_so(tmp_path):
  pipeline, step, init_fn = _pipeline()
  state, _ = _run(step, _chains(init_fn), 1)
  params = {"w": np.ones(2)}
  with _save(tmp_path / "run", 1, pipeline, state, params) as manager:
    manager.wait_until_finished()
  _split_by_process(tmp_path / "run", 1, pipeline, state, 4)
  # 4 chains of 4 processes restore here, but not when one file is gone.
  (tmp_path / "run" / "1" / "data" / "data.process-2-of-4.npz").unlink()
  with pytest.raises(jax_data.CheckpointError,
                     match=r"processes \[0, 1, 3\] of 4, not of all"):
    _restore(tmp_path / "run", 1, pipeline, params)


def test_other_arguments_are_named():
  handler = jax_data.DataCheckpointHandler()
  with pytest.raises(TypeError, match="DataSave"):
    handler.save(None, args={"not": "DataSave"})
  with pytest.raises(TypeError, match="DataRestore"):
    handler.restore(None, args=None)
  # The arguments themselves, when made (not later, in the background).
  pipeline = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(x=np.arange(10)), 2, 3)
  with pytest.raises(TypeError, match="got pipeline=None"):
    jax_data.DataSave(None, pipeline[0]())
  with pytest.raises(TypeError, match="got state of type NoneType"):
    jax_data.DataSave(pipeline, None)
  with pytest.raises(TypeError, match="got lanes='x'"):
    jax_data.DataRestore(pipeline, lanes="x")
  with pytest.raises(TypeError, match="lanes=1.5"):
    jax_data.DataRestore(pipeline, lanes=[1.5])
  with pytest.raises(ValueError, match=re.escape(
      "lanes must name at least one lane, got lanes=[]")):
    jax_data.DataRestore(pipeline, lanes=[])
  with pytest.raises(ValueError, match="DataSave got a state of another "
                     "pipeline"):
    jax_data.DataSave(pipeline, jax_data.random_reference_data(
        jax_data.NumpyDataLoader(x=np.arange(10)), 2, 3)[0]())
  jax_data.DataRestore(pipeline, lanes=np.arange(1))
  assert jax_data.DataRestore(pipeline, lanes=iter([0])).lanes == [0]
