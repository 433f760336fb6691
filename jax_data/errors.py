"""The errors jax_data raises by name."""


class HostLoaderError(RuntimeError):
  """A host loader failed while producing a chunk for compiled code."""


class PipelineReleasedError(RuntimeError):
  """A released pipeline was used."""


class CheckpointError(ValueError):
  """A checkpoint could not be restored: the file is corrupt, truncated or
  not a jax_data checkpoint, a field is missing or malformed, or it does not
  fit the pipeline. The message names the field or what differs."""
