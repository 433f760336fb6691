"""What a type checker infers from jax_data's annotations (it ships
``py.typed``): a typed user program checks clean under mypy, with the
types it names, and mistakes in one are reported."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import jax_data

ROOT = pathlib.Path(jax_data.__file__).resolve().parent.parent

PROGRAM = textwrap.dedent('''
    from typing import Any, Dict, Tuple, assert_type

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_data
    from jax_data import CacheState, MiniBatchInformation
    from jax_data.tensorflow_loader import TensorflowDataLoader

    loader = jax_data.NumpyDataLoader(x=np.arange(100, dtype=np.float32))
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, 4, 8)
    pipeline: jax_data.RandomBatch = jax_data.random_reference_data(
        loader, 4, 8)
    state = init_fn(seed=0)
    assert_type(state, CacheState)
    state, batch = batch_fn(state)
    state, (batch, info) = batch_fn(state, information=True)
    assert_type(info, MiniBatchInformation)
    release_fn()


    def step(carry: jax.Array, batch: Dict[str, jax.Array]
             ) -> Tuple[jax.Array, jax.Array]:
      return carry + jnp.sum(batch["x"]), carry


    (total, state), ys = jax_data.scan(step, jnp.float32(0), state,
                                       batch_fn=batch_fn, length=3)
    assert_type(state, CacheState)

    mapper_fn, mapper_release = jax_data.full_data_mapper(
        loader, 2, 10, progress=lambda done, total: print(done),
        **jax_data.process_shard())
    values, _ = mapper_fn(lambda b, c: (b["x"], c), None)
    init_full, map_fn, full_release = jax_data.full_reference_data(
        loader, 2, 10, **jax_data.process_shard())


    class Source:
      def __len__(self) -> int:
        return 10

      def __getitem__(self, i: int) -> Dict[str, Any]:
        return {"x": np.float32(i)}


    records = jax_data.SourceDataLoader(Source())
    jax_data.save_checkpoint(b"positions.npz", pipeline, state)
    state = jax_data.restore_checkpoint("positions.npz", pipeline,
                                        lanes=np.arange(1))
    loader_type: type = TensorflowDataLoader
    ''')

# Optional packages are not followed (their own annotations are theirs).
CONFIG = textwrap.dedent("""
    [mypy]
    follow_imports = silent
    disallow_untyped_defs = True
    [mypy-tensorflow.*,tensorflow_datasets.*,orbax.*,grain.*,array_record.*,datasets.*,h5py.*]
    follow_imports = skip
    ignore_missing_imports = True
    """)


def _mypy(tmp_path, programs):
  """mypy over ``programs`` (file name: source) at once, so that the two
  tests below share one run: building mypy's cache of JAX and NumPy from
  nothing took 21-23 s a run on a slow machine. Its exit code and output,
  and the output's lines per file."""
  pytest.importorskip("mypy")
  for name, program in programs.items():
    (tmp_path / name).write_text(program)
  (tmp_path / "mypy.ini").write_text(CONFIG)
  env = dict(os.environ, MYPYPATH=str(ROOT))
  done = subprocess.run(
      [sys.executable, "-m", "mypy", "--config-file", "mypy.ini",
       "--cache-dir", str(tmp_path / "cache"), *programs],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
      check=False)
  out = done.stdout + done.stderr
  return done.returncode, out, {
      name: [line for line in out.splitlines() if line.startswith(name + ":")]
      for name in programs}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
  """One mypy run over the typed user program and a copy with two
  mistakes."""
  wrong = PROGRAM.replace(
      "release_fn()\n",
      "release_fn()\n"
      "jax_data.random_referenc_data(loader, 4, 8)\n"
      "assert_type(batch_fn(state, information=True)[1], Any)\n", 1)
  assert wrong != PROGRAM
  return _mypy(tmp_path_factory.mktemp("typing"),
               {"user.py": PROGRAM, "wrong.py": wrong})


def test_a_typed_user_program_checks_clean(checked):
  rc, out, lines = checked
  assert lines["user.py"] == [], out
  assert rc in (0, 1), out  # 1: wrong.py's mistakes, below
  assert "Found 2 errors in 1 file (checked 2 source files)" in out, out


def test_mistakes_in_a_typed_user_program_are_reported(checked):
  rc, out, lines = checked
  assert rc == 1, out
  wrong = "\n".join(lines["wrong.py"])
  assert 'Module has no attribute "random_referenc_data"' in wrong, out
  assert "Expression is of type" in wrong, out  # the tuple, not Any
  assert "Found 2 errors" in out, out
