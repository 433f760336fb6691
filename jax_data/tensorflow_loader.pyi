"""Type stub of the old path jax_data.tensorflow_loader (the predecessor's
jax_sgmc.data.tensorflow_loader), which jax_data.module_paths serves at
run time from jax_data.loaders.tensorflow_loader."""

from jax_data.loaders.tensorflow_loader import (
    TensorflowDataLoader as TensorflowDataLoader,
)
