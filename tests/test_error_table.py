"""Every row of the bad-input table in docs/reliability.rst is a test."""

import os
import pickle
import re
import warnings

import jax
import numpy as np
import pytest

import jax_data
from jax_data import NumpyDataLoader
from jax_data import full_data_mapper
from jax_data import full_reference_data
from jax_data import random_reference_data

_DOC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs",
                    "reliability.rst")
_ROW = re.compile(r"\* - ``(.+?)``\n\s+- ``(\w+)``\n\s+- ``(.+?)``")


def _rows():
  with open(_DOC, encoding="utf-8") as f:
    rows = _ROW.findall(f.read())
  assert len(rows) >= 20, "the table in docs/reliability.rst was not found"
  return rows


def _namespace(tmp_path):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loader = NumpyDataLoader(x=np.arange(10))
    pipeline = random_reference_data(loader, 2, 3)
    init_fn, batch_fn, _ = pipeline
    map_init, map_fn, _ = full_reference_data(loader, 2, 3)
    other = random_reference_data(NumpyDataLoader(x=np.arange(10)), 2, 3)
    other_data = random_reference_data(NumpyDataLoader(x=np.arange(10) + 1),
                                       2, 3)
  state, _ = batch_fn(init_fn())
  tree = jax_data.state_to_pytree(pipeline, state)
  checkpoint = tmp_path / "state.npz"
  jax_data.save_checkpoint(checkpoint, pipeline, state)
  truncated_file = tmp_path / "truncated.npz"
  truncated_file.write_bytes(checkpoint.read_bytes()[:200])
  npy_file = tmp_path / "array.npy"
  np.save(npy_file, np.arange(3))
  pickle_file = tmp_path / "state.pkl"
  pickle_file.write_bytes(pickle.dumps({"chunk": 1, "position": 0}))

  def states_apart():
    """States of ``pipeline`` for 4 devices, at chunks 0, 1, 2 and 3."""
    states = [init_fn(seed=d) for d in range(4)]
    for device, state in enumerate(states):
      for _ in range(2 * device):
        state, _ = batch_fn(state)
      states[device] = state
    return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *states)

  return dict(jax=jax, np=np, jax_data=jax_data,
              NumpyDataLoader=NumpyDataLoader,
              random_reference_data=random_reference_data,
              full_reference_data=full_reference_data,
              full_data_mapper=full_data_mapper, loader=loader,
              pipeline=pipeline, init_fn=init_fn, batch_fn=batch_fn,
              map_init=map_init, map_fn=map_fn, other_state=other[0](),
              tree=tree, other_data=other_data,
              truncated_file=truncated_file, npy_file=npy_file,
              pickle_file=pickle_file, states_apart=states_apart,
              checkpoint=checkpoint)


@pytest.mark.parametrize("expression,raised,message", _rows())
def test_documented_error(expression, raised, message, tmp_path):
  namespace = _namespace(tmp_path)
  if "TensorflowDataLoader" in expression:  # the optional extra
    tf = pytest.importorskip("tensorflow")
    from jax_data.tensorflow_loader import TensorflowDataLoader
    namespace.update(tf=tf, TensorflowDataLoader=TensorflowDataLoader)
  if raised == "UserWarning":
    with pytest.warns(UserWarning, match=re.escape(message)):
      eval(expression, namespace)  # pylint: disable=eval-used
    return
  errors = {"TypeError": TypeError, "ValueError": ValueError,
            "CheckpointError": jax_data.CheckpointError,
            "IsADirectoryError": IsADirectoryError,
            "FileNotFoundError": FileNotFoundError}
  with pytest.raises(errors[raised]) as info:
    eval(expression, namespace)  # pylint: disable=eval-used
  assert message in str(info.value)
