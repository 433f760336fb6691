"""The errors jax_data raises by name."""


class HostLoaderError(RuntimeError):
  """A host loader failed while producing a chunk for compiled code."""


class PipelineReleasedError(RuntimeError):
  """A released pipeline was used."""


class RecordError(ValueError):
  """A record of a source could not be read, or does not fit the format of
  the first record (:class:`~jax_data.SourceDataLoader`); the message names
  the record. Inside compiled code it reaches the caller in a
  :class:`HostLoaderError`'s message."""


class CheckpointError(ValueError):
  """A checkpoint could not be restored: the file is corrupt, truncated or
  not a jax_data checkpoint, a field is missing or malformed, or it does not
  fit the pipeline. The message names the field or what differs."""


def foreign_state(where: str, foreign: int, pipeline: int) -> ValueError:
  """The error for a state whose ``pipeline`` field is another pipeline's:
  a state of another pipeline, or one saved in another process and put
  back leaf by leaf (a pipeline's identity is new in every process)."""
  return ValueError(
      f"{where} got a state of another pipeline (id {foreign}; this "
      f"pipeline's id is {pipeline}); use the states of this pipeline's "
      "init_fn. To restore a state in another process, save "
      "tree = jax_data.state_to_pytree(pipeline, state) and restore "
      "jax_data.state_from_pytree(pipeline, tree), or in Orbax use "
      "jax_data.DataSave / DataRestore")
