"""The errors jax_data raises by name."""


class HostLoaderError(RuntimeError):
  """A host loader failed while producing a chunk for compiled code."""


class PipelineReleasedError(RuntimeError):
  """A released pipeline was used."""
