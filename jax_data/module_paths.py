"""The import paths the modules had before they were grouped in folders.

``jax_data.sampling`` is now ``jax_data.streams.sampling``,
``jax_data.tensorflow_loader`` is ``jax_data.loaders.tensorflow_loader``,
and so on (:data:`MOVED`). Both paths name the same module object:
``import jax_data.tensorflow_loader``, ``from jax_data.host_loader import
StoreLimits`` and ``jax_data.sampling.BufferShuffle`` keep working, and a
moved module is imported only when first asked for (TensorFlow stays lazy).
``jax_data.scan`` is the function :func:`jax_data.scan`; its module is
``jax_data.compiled.scan``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Dict
from typing import Optional

#: Old module name (under ``jax_data.``) -> its folder.
_FOLDERS = {
    "compiled": ("bridge", "checkpoint", "device_loader", "distributed",
                 "full_access", "pass_keys", "pass_loop", "pipeline",
                 "random_access", "states"),
    "serving": ("chain_records", "chunk_store", "host", "production"),
    "loaders": ("chains", "file_rows", "gather", "host_loader", "indexed",
                "legacy_loader", "loader", "numpy_loader", "source_loader",
                "source_records", "source_workers", "tensorflow_loader",
                "tensorflow_rows", "tensorflow_streams"),
    "streams": ("counter_chains", "counter_streams", "device_streams",
                "sampling"),
}

#: ``jax_data.<old>`` -> ``jax_data.<folder>.<old>``, and the old module
#: whose class joined another's (the prefetch thread the store's module).
MOVED: Dict[str, str] = {
    **{f"jax_data.{name}": f"jax_data.{folder}.{name}"
       for folder, names in _FOLDERS.items() for name in names},
    "jax_data.prefetch": "jax_data.serving.chunk_store",
    "jax_data.rendezvous": "jax_data.serving.rendezvous",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports a moved module under its old name as the module itself."""

  def find_spec(self, fullname: str, path, target=None
                ) -> Optional[importlib.machinery.ModuleSpec]:
    del path, target
    if fullname not in MOVED:
      return None
    return importlib.util.spec_from_loader(fullname, self)

  def create_module(self, spec) -> types.ModuleType:
    module = importlib.import_module(MOVED[spec.name])
    spec.loader_state = module.__spec__  # the import system replaces it
    return module

  def exec_module(self, module: types.ModuleType) -> None:
    # The import system set the old name's spec on the module: give it its
    # own back (its name stays the new one).
    module.__spec__ = module.__spec__.loader_state


def install() -> None:
  """Lets the old paths be imported (once per process)."""
  if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
    sys.meta_path.append(_OldPaths())


def old(name: str) -> Optional[types.ModuleType]:
  """The module ``jax_data.<name>`` had, imported; None if none moved."""
  if f"jax_data.{name}" not in MOVED:
    return None
  return importlib.import_module(f"jax_data.{name}")
