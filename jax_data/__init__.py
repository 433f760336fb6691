"""jax_data: host data for jit-compiled JAX loops.

Mini-batches and full-data maps inside ``jit``, ``lax.scan``, ``vmap`` and
``pmap``, served from host memory, memmaps or ``tf.data`` pipelines.
"""

import importlib
from typing import TYPE_CHECKING
from typing import Any
from typing import List

from jax_data.module_paths import install as _install_old_paths
from jax_data.module_paths import old as _old_module

__version__ = "0.1.0"

_install_old_paths()  # jax_data.sampling etc.: see jax_data.module_paths

# The public names but those of optional dependencies (_OPTIONAL below):
# `from jax_data import *` neither imports TensorFlow or Orbax nor fails
# without them.
__all__ = [
    "CacheState",
    "CheckpointError",
    "DataLoader",
    "DeviceDataLoader",
    "DeviceNumpyDataLoader",
    "HostDataLoader",
    "HostLoaderError",
    "MiniBatch",
    "MiniBatchInformation",
    "NumpyDataLoader",
    "OrderedBatch",
    "PipelineReleasedError",
    "RandomBatch",
    "RecordError",
    "SourceDataLoader",
    "full_data_mapper",
    "full_reference_data",
    "process_shard",
    "random_reference_data",
    "restore_checkpoint",
    "save_checkpoint",
    "scan",
    "state_from_pytree",
    "state_to_pytree",
]

# Where each public name lives. None is imported with the package: a worker
# process of SourceDataLoader(processes=True) imports
# jax_data.loaders.source_workers, and so this file, and need not import
# JAX (over a second and ~160 MiB a worker) to read records. A name is
# imported on first use and then kept here, so later uses are plain lookups.
_PUBLIC = {
    "restore_checkpoint": "jax_data.compiled.checkpoint",
    "save_checkpoint": "jax_data.compiled.checkpoint",
    "state_from_pytree": "jax_data.compiled.checkpoint",
    "state_to_pytree": "jax_data.compiled.checkpoint",
    "DeviceNumpyDataLoader": "jax_data.compiled.device_loader",
    "process_shard": "jax_data.compiled.distributed",
    "full_data_mapper": "jax_data.compiled.full_access",
    "full_reference_data": "jax_data.compiled.full_access",
    "random_reference_data": "jax_data.compiled.random_access",
    "scan": "jax_data.compiled.scan",
    "CheckpointError": "jax_data.errors",
    "HostLoaderError": "jax_data.errors",
    "PipelineReleasedError": "jax_data.errors",
    "RecordError": "jax_data.errors",
    "HostDataLoader": "jax_data.loaders.host_loader",
    "DataLoader": "jax_data.loaders.loader",
    "DeviceDataLoader": "jax_data.loaders.loader",
    "NumpyDataLoader": "jax_data.loaders.numpy_loader",
    "SourceDataLoader": "jax_data.loaders.source_loader",
    "CacheState": "jax_data.types",
    "MiniBatch": "jax_data.types",
    "MiniBatchInformation": "jax_data.types",
    "OrderedBatch": "jax_data.types",
    "RandomBatch": "jax_data.types",
}

_ORBAX = ("DataCheckpointHandler", "DataRestore", "DataSave")
# Public too, loaded on first use with TensorFlow or Orbax; not in __all__.
_OPTIONAL = ("TensorflowDataLoader",) + _ORBAX


def __dir__() -> List[str]:
  return sorted(set(globals()) | set(__all__) | set(_OPTIONAL))


# Type checkers see the lazily loaded names as they are, and an unknown
# name as an error (a module __getattr__ would make every name Any); "as"
# re-exports the optional names, which __all__ leaves out.
if TYPE_CHECKING:
  from jax_data.compiled.checkpoint import restore_checkpoint
  from jax_data.compiled.checkpoint import save_checkpoint
  from jax_data.compiled.checkpoint import state_from_pytree
  from jax_data.compiled.checkpoint import state_to_pytree
  from jax_data.compiled.device_loader import DeviceNumpyDataLoader
  from jax_data.compiled.distributed import process_shard
  from jax_data.compiled.full_access import full_data_mapper
  from jax_data.compiled.full_access import full_reference_data
  from jax_data.compiled.orbax_checkpoint import (
    DataCheckpointHandler as DataCheckpointHandler,
  )
  from jax_data.compiled.orbax_checkpoint import DataRestore as DataRestore
  from jax_data.compiled.orbax_checkpoint import DataSave as DataSave
  from jax_data.compiled.random_access import random_reference_data
  from jax_data.compiled.scan import scan
  from jax_data.errors import CheckpointError
  from jax_data.errors import HostLoaderError
  from jax_data.errors import PipelineReleasedError
  from jax_data.errors import RecordError
  from jax_data.loaders.host_loader import HostDataLoader
  from jax_data.loaders.loader import DataLoader
  from jax_data.loaders.loader import DeviceDataLoader
  from jax_data.loaders.numpy_loader import NumpyDataLoader
  from jax_data.loaders.source_loader import SourceDataLoader
  from jax_data.loaders.tensorflow_loader import (
    TensorflowDataLoader as TensorflowDataLoader,
  )
  from jax_data.types import CacheState
  from jax_data.types import MiniBatch
  from jax_data.types import MiniBatchInformation
  from jax_data.types import OrderedBatch
  from jax_data.types import RandomBatch
else:

  def __getattr__(name: str) -> Any:
    """Loads a public name on first use: ``TensorflowDataLoader`` with
    TensorFlow, the Orbax arguments with Orbax, the rest with JAX; a
    module's old path (``jax_data.sampling``) gives the module."""
    if name in _PUBLIC:
      value = getattr(importlib.import_module(_PUBLIC[name]), name)
      globals()[name] = value
      return value
    if name == "TensorflowDataLoader":
      try:
        from jax_data.loaders.tensorflow_loader import TensorflowDataLoader
      except ImportError as e:
        raise ImportError(
            "jax_data.TensorflowDataLoader needs TensorFlow: "
            'pip install "jax_data[tensorflow]"') from e
      return TensorflowDataLoader
    if name in _ORBAX:
      try:
        from jax_data.compiled import orbax_checkpoint
      except ImportError as e:
        raise ImportError(
            f"jax_data.{name} needs Orbax: "
            'pip install "jax_data[orbax]"') from e
      return getattr(orbax_checkpoint, name)
    module = _old_module(name)
    if module is not None:
      return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
