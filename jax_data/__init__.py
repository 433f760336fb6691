"""jax_data: host data for jit-compiled JAX loops.

Mini-batches and full-data maps inside ``jit``, ``lax.scan``, ``vmap`` and
``pmap``, served from host memory, memmaps or ``tf.data`` pipelines.
"""

from jax_data.checkpoint import restore_checkpoint
from jax_data.checkpoint import save_checkpoint
from jax_data.checkpoint import state_from_pytree
from jax_data.checkpoint import state_to_pytree
from jax_data.device_loader import DeviceNumpyDataLoader
from jax_data.distributed import process_shard
from jax_data.errors import CheckpointError
from jax_data.errors import HostLoaderError
from jax_data.errors import PipelineReleasedError
from jax_data.full_access import full_data_mapper
from jax_data.full_access import full_reference_data
from jax_data.host_loader import HostDataLoader
from jax_data.loader import DataLoader
from jax_data.loader import DeviceDataLoader
from jax_data.numpy_loader import NumpyDataLoader
from jax_data.random_access import random_reference_data
from jax_data.scan import scan
from jax_data.source_loader import SourceDataLoader
from jax_data.types import CacheState
from jax_data.types import MiniBatch
from jax_data.types import MiniBatchInformation
from jax_data.types import OrderedBatch
from jax_data.types import RandomBatch

__version__ = "0.1.0"

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
    "SourceDataLoader",
    "TensorflowDataLoader",
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


def __getattr__(name: str):
  """Loads ``TensorflowDataLoader``, and with it TensorFlow, on first use."""
  if name == "TensorflowDataLoader":
    try:
      from jax_data.tensorflow_loader import TensorflowDataLoader
    except ImportError as e:
      raise ImportError(
          "jax_data.TensorflowDataLoader needs TensorFlow: "
          'pip install "jax_data[tensorflow]"') from e
    return TensorflowDataLoader
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
