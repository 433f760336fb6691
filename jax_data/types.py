"""Types shared by the loaders, the host bridge and in-jit access."""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Literal
from typing import NamedTuple
from typing import Optional
from typing import Protocol
from typing import Sequence
from typing import Tuple
from typing import Union
from typing import get_args
from typing import overload
from typing import runtime_checkable

import jax
import jax.numpy as jnp

PyTree = Any


#: The ways compiled code can receive chunks (a constructor's ``callback``):
#: ``"auto"`` (in place through ``buffer_callback`` on CPU where JAX offers
#: it, ``pure_callback`` elsewhere) and ``"pure"`` (``pure_callback`` on
#: every platform).
Callback = Literal["auto", "pure"]
CALLBACKS: Tuple[Callback, ...] = get_args(Callback)


@runtime_checkable
class RandomAccessSource(Protocol):
  """What :class:`~jax_data.SourceDataLoader` reads: ``len(source)``
  records, record ``i`` as ``source[i]`` (Grain's ``RandomAccessDataSource``,
  an ArrayRecord data source, a Hugging Face dataset, a PyTorch-style map
  dataset, a list). A source may also give ``__getitems__(indices)``, a
  list of records read in one call."""

  def __len__(self) -> int:
    """The number of records."""

  def __getitem__(self, index: int, /) -> Any:
    """Record ``index``: a pytree of arrays or numbers."""


class MiniBatchInformation(NamedTuple):
  """Static facts about a mini-batch, and which of its observations are valid.

  Attributes:
    observation_count: Number of observations in the dataset (Python int);
      None if the loader does not know it (a ``tf.data`` pipeline of
      unknown length given without ``observation_count``). A random chain
      reports the whole data set's, also when it draws from one shard
      (what scales a mini-batch's log-likelihood to the data's); a
      full-data pass reports the observations it covers, a shard's for a
      pass over a shard (``full_reference_data(..., shard_index=...,
      shard_count=...)``).
    mask: bool array of shape ``(batch_size,)``: True for a real observation,
      False for a filler that pads the last batch of an epoch or pass.
    batch_size: Number of observations in a batch (Python int).
  """
  observation_count: Optional[int]
  mask: jax.Array
  batch_size: int


class CacheState(NamedTuple):
  """Device-side position of one chain: a value, carried through ``jit``.

  The host answers a request for chunk ``k`` of a chain with the same data
  every time, so a state can be used twice, replayed under remat, stacked for
  ``vmap`` or replicated for ``pmap``. Shapes and dtypes are fixed per
  pipeline.

  Attributes:
    pipeline: shape=(), int32. Identity of the pipeline the state belongs
      to; a pipeline refuses the states of others.
    chain: shape=(), int32. Host chain id; for device-resident pipelines
      -1 (a ``jax.random`` chain) or ``-2 - mode`` (a counter-based chain).
    chunk: shape=(), int32. Index of the chunk that holds the next batch.
    position: shape=(), int32. Index of the next batch within that chunk.
    cached_chunk: shape=(), int32. Index of the chunk held in ``batches``;
      -1 when none is held yet (a fresh or restored state).
    batches: Pytree of arrays with leading axes ``(cache_size, mb_size)``;
      an empty dict for pipelines that keep no cache on the device.
    mask: shape=(cache_size, mb_size), bool. Valid observations of ``batches``.
    key: shape=(2,), uint32. For device-resident pipelines, the PRNG key
      of a ``jax.random`` chain or the seed's low and high words of a
      counter-based chain; zeros for host pipelines.
  """
  pipeline: jax.Array
  chain: jax.Array
  chunk: jax.Array
  position: jax.Array
  cached_chunk: jax.Array
  batches: PyTree
  mask: jax.Array
  key: jax.Array

  @classmethod
  def start(cls, pipeline: int, chain: int, mb_size: int,
            cache_size: int = 0, batch_format: Optional[PyTree] = None,
            key: Optional[jax.Array] = None) -> "CacheState":
    """A state positioned before a chain's first batch.

    Args:
      pipeline: The pipeline's identity.
      chain: The chain's number; negative for device-resident pipelines.
      mb_size: Observations per batch.
      cache_size: Batches in the device cache; 0 for pipelines that keep
        no cache in the state (full-data passes, device-resident loaders).
      batch_format: The cache's format (leading axes ``(cache_size,
        mb_size)``); None when ``cache_size`` is 0.
      key: The PRNG key of a device-resident random chain; zeros
        otherwise.
    """
    batches = {} if batch_format is None else jax.tree_util.tree_map(
        lambda s: jnp.zeros(s.shape, s.dtype), batch_format)
    return cls(pipeline=jnp.int32(pipeline), chain=jnp.int32(chain),
               chunk=jnp.int32(0), position=jnp.int32(0),
               cached_chunk=jnp.int32(-1), batches=batches,
               mask=jnp.zeros((cache_size, mb_size), jnp.bool_),
               key=jnp.zeros((2,), jnp.uint32) if key is None else key)

  @classmethod
  def start_chains(cls, pipeline: int, chains: Sequence[int], mb_size: int,
                   cache_size: int, batch_format: PyTree) -> "CacheState":
    """The states of ``chains`` before their first batches, stacked for
    ``jax.vmap`` (a leading axis of ``len(chains)``): what stacking their
    :meth:`start` states gives, with one cache buffer for all of them
    rather than one per chain and then their stack."""
    one = cls.start(pipeline, 0, mb_size, cache_size, batch_format)
    stacked = jax.tree_util.tree_map(
        lambda a: jnp.broadcast_to(a, (len(chains),) + jnp.shape(a)), one)
    return stacked._replace(chain=jnp.asarray(chains, jnp.int32))


Batch = PyTree


class InitFn(Protocol):
  """Creates the state of a new chain; keywords go to the loader."""

  def __call__(self, **kwargs: Any) -> CacheState:
    ...


class BatchFn(Protocol):
  """Returns the next batch of a chain and the advanced state; with
  ``information=True`` the batch and its :class:`MiniBatchInformation`."""

  @overload
  def __call__(self, state: CacheState, information: Literal[False] = False,
               device_count: int = 1) -> Tuple[CacheState, Batch]:
    ...

  @overload
  def __call__(self, state: CacheState, information: Literal[True],
               device_count: int = 1
               ) -> Tuple[CacheState, Tuple[Batch, MiniBatchInformation]]:
    ...

  @overload
  def __call__(self, state: CacheState, information: bool = False,
               device_count: int = 1) -> Tuple[CacheState, MiniBatch]:
    ...


class ReleaseFn(Protocol):
  """Drops every reference the pipeline holds to its loader (idempotent)."""

  def __call__(self) -> None:
    ...


class MapFn(Protocol):
  """Maps ``fun`` over every observation of the dataset once."""

  def __call__(self, fun: Callable, data_state: CacheState, carry: PyTree,
               masking: bool = False, information: bool = False,
               device_count: int = 1) -> Tuple[CacheState, Tuple[Any, Any]]:
    ...


class MapperFn(Protocol):
  """Maps ``fun`` over every observation; the data state stays on the host."""

  def __call__(self, fun: Callable, carry: PyTree, masking: bool = False,
               information: bool = False, batched: bool = True,
               device_count: int = 1) -> Tuple[Any, Any]:
    ...


#: A mini-batch as ``batch_fn`` returns it: the batch, or with
#: ``information=True`` the batch and its :class:`MiniBatchInformation`
#: (a name the predecessor exported, for annotations).
MiniBatch = Union[Batch, Tuple[Batch, MiniBatchInformation]]

#: What :func:`~jax_data.random_reference_data` returns, unpacked:
#: ``(init_fn, batch_fn, release_fn)`` (a name the predecessor exported).
RandomBatch = Tuple[InitFn, BatchFn, ReleaseFn]

#: What :func:`~jax_data.full_reference_data` returns, unpacked:
#: ``(init_fn, map_fn, release_fn)`` (a name the predecessor exported).
OrderedBatch = Tuple[InitFn, MapFn, ReleaseFn]


# A device loader's programs serialize with jax.export (a host loader's
# call the host, which JAX does not serialize); they take and return these.
for _type in (CacheState, MiniBatchInformation):
  try:
    jax.export.register_namedtuple_serialization(
        _type, serialized_name=f"jax_data.{_type.__name__}")
  except ValueError:  # registered already (the module was reloaded)
    pass
del _type
