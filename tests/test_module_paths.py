"""The modules' paths from before the folders keep working
(jax_data.module_paths)."""

import importlib
import importlib.util
import pickle
import subprocess
import sys

import jax_data
from jax_data import module_paths


def test_every_old_path_is_the_moved_module_itself():
  for old, new in module_paths.MOVED.items():
    if "tensorflow" in old:
      continue  # imports TensorFlow: below, in a fresh process
    module = importlib.import_module(old)
    assert module is importlib.import_module(new), old
    assert module.__name__ == new and module.__spec__.name == new
    assert getattr(jax_data, old.rsplit(".", 1)[1]) is module


def test_jax_data_scan_is_still_the_function():
  import jax_data.sampling  # pylint: disable=g-import-not-at-top,unused-import
  assert callable(jax_data.scan) and jax_data.scan.__name__ == "scan"


def test_old_paths_import_tensorflow_only_when_asked_for():
  script = """
import sys
import jax_data
import jax_data.sampling
from jax_data.host_loader import StoreLimits
assert "tensorflow" not in sys.modules, "imported TensorFlow"
"""
  if importlib.util.find_spec("tensorflow") is not None:  # optional
    script += """
from jax_data.tensorflow_loader import TensorflowDataLoader
assert TensorflowDataLoader.__module__ == "jax_data.loaders.tensorflow_loader"
assert jax_data.TensorflowDataLoader is TensorflowDataLoader
"""
  script += 'print("ok")'
  done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                        text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "ok"


def test_objects_pickle_under_the_new_paths_and_load_by_the_old():
  limits = jax_data.host_loader.StoreLimits(ahead=1)
  assert type(limits).__module__ == "jax_data.loaders.host_loader"
  assert pickle.loads(pickle.dumps(limits)) == limits
  # A pickle written before the move names the old module (protocol 0:
  # the names are text lines).
  old = pickle.dumps(limits, protocol=0).replace(
      b"jax_data.loaders.host_loader", b"jax_data.host_loader")
  assert b"jax_data.host_loader" in old
  assert pickle.loads(old) == limits


def test_the_package_imports_jax_only_for_a_name_that_needs_it():
  """``import jax_data`` and the worker processes' module import no JAX (a
  SourceDataLoader's worker imports jax_data.loaders.source_workers, and
  with it the package); the public names load on first use and are then
  the package's own; dir() lists them all."""
  script = """
import sys
import jax_data
from jax_data.loaders import source_records, source_workers
assert "jax" not in sys.modules, "imported JAX"
assert set(jax_data.__all__) <= set(dir(jax_data))
scan = jax_data.scan
assert "jax" in sys.modules and scan.__module__ == "jax_data.compiled.scan"
assert vars(jax_data)["scan"] is scan
for name in jax_data.__all__:  # TensorFlow and Orbax: optional
  if name not in ("TensorflowDataLoader", "DataCheckpointHandler",
                  "DataRestore", "DataSave"):
    assert getattr(jax_data, name) is vars(jax_data)[name], name
print("ok")
"""
  done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                        text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "ok"


def test_a_star_import_needs_neither_tensorflow_nor_orbax():
  """``from jax_data import *`` gives the public names but those of
  optional dependencies, without TensorFlow and Orbax installed (here:
  made unimportable); those names still say what to install."""
  script = """
import sys
sys.modules["tensorflow"] = None  # as if not installed
sys.modules["orbax"] = sys.modules["orbax.checkpoint"] = None
from jax_data import *
assert scan.__name__ == "scan" and NumpyDataLoader.__name__ == "NumpyDataLoader"
import jax_data
for name in ("TensorflowDataLoader", "DataSave"):
  assert name in dir(jax_data) and name not in jax_data.__all__
  try:
    getattr(jax_data, name)
  except ImportError as e:
    assert "pip install" in str(e), e
  else:
    raise AssertionError(name + " loaded")
print("ok")
"""
  done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                        text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "ok"
