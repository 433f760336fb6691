"""Every row of the bad-input table in docs/reliability.rst is a test."""

import os
import re
import warnings

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


def _namespace():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loader = NumpyDataLoader(x=np.arange(10))
    init_fn, batch_fn, _ = random_reference_data(loader, 2, 3)
    map_init, map_fn, _ = full_reference_data(loader, 2, 3)
  return dict(np=np, jax_data=jax_data, NumpyDataLoader=NumpyDataLoader,
              random_reference_data=random_reference_data,
              full_reference_data=full_reference_data,
              full_data_mapper=full_data_mapper, loader=loader,
              init_fn=init_fn, batch_fn=batch_fn, map_init=map_init,
              map_fn=map_fn)


@pytest.mark.parametrize("expression,raised,message", _rows())
def test_documented_error(expression, raised, message):
  namespace = _namespace()
  if raised == "UserWarning":
    with pytest.warns(UserWarning, match=re.escape(message)):
      eval(expression, namespace)  # pylint: disable=eval-used
    return
  errors = {"TypeError": TypeError, "ValueError": ValueError}
  with pytest.raises(errors[raised]) as info:
    eval(expression, namespace)  # pylint: disable=eval-used
  assert message in str(info.value)
