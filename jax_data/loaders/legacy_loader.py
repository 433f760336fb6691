"""The predecessor's loader API, both ways round.

* :class:`PredecessorAdapter` is the predecessor's methods
  (``register_random_pipeline``, ``register_ordered_pipeline``,
  ``get_batches``, ``save_state``, ``load_state``) over a host loader's
  cursors; each host loader hands those methods on to one.
* :class:`LegacyCursor` serves a chain of a loader written the predecessor's
  way (it implements those methods itself, with its own chain ids, or
  extends a loader of ours and overrides ``get_batches``) through those
  methods, behind the cursor interface the host uses.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import weakref
from typing import Any
from typing import Callable
from typing import Dict
from typing import Optional
from typing import Protocol
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_data.loaders.chains import UNPORTABLE
from jax_data.loaders.chains import UNSAVED
from jax_data.loaders.chains import ChainCursor
from jax_data.loaders.chains import ChainSpec
from jax_data.loaders.chains import Chunk
from jax_data.loaders.chains import ChunkLayout
from jax_data.loaders.chains import OrderedChain
from jax_data.loaders.chains import Position
from jax_data.loaders.chains import SeekRefused
from jax_data.types import PyTree
from jax_data.validation import check_int
from jax_data.validation import check_saved_state
from jax_data.validation import check_sizes


def _keywords(spec: ChainSpec, count: int) -> dict:
  """The registration keywords that ask the loader for ``spec``: those
  the user gave (no seed where none was), the loader's own options too."""
  observations = spec.observations
  keywords = dict(spec.options)
  if observations.count != count:  # a shard: find its index and count
    keywords.update(shard_index=observations.shard_index,
                    shard_count=observations.shard_count)
  if isinstance(spec, OrderedChain):
    return keywords
  if spec.seed is not None:
    keywords["seed"] = spec.seed
  if spec.shuffle:
    keywords["shuffle"] = True
  if spec.in_epochs:
    keywords["in_epochs"] = True
  return keywords


class LegacyCursor(ChainCursor):
  """A chain served through a loader's ``get_batches``, ``save_state`` and
  ``load_state``.

  Its chunks are checked against the layout: the wrong number of arrays,
  another tree structure (keys named otherwise, a tuple for a dict), a
  wrong shape or dtype is an error that names what differs.

  Args:
    loader: The loader.
    chain: The chain's id for those methods.
    layout: The chunks' arrays.
  """

  def __init__(self, loader: Any, chain: int,
               layout: ChunkLayout, saves: bool = True):
    self._loader = loader
    self._chain = chain
    self._layout = layout
    self._saves = saves
    # The dtypes the loader declares, which JAX may hold narrower (int64
    # as int32 without jax_enable_x64): leaves of them are served so.
    declared = getattr(loader, "_format", loader.observation_format)
    self._declared = [np.dtype(s.dtype)
                      for s in jax.tree_util.tree_leaves(declared)]
    self._structure = jax.tree_util.tree_structure(declared)

  @classmethod
  def registered(cls, loader: Any, spec: ChainSpec,
                 layout: ChunkLayout, saves: bool) -> "LegacyCursor":
    """Registers a chain for ``spec`` with the loader's own
    ``register_*_pipeline`` and serves it; ``saves``: the loader has its
    own ``save_state`` (the predecessor's loaders need not)."""
    count = loader.observation_count
    register = (loader.register_ordered_pipeline
                if isinstance(spec, OrderedChain)
                else loader.register_random_pipeline)
    return cls(loader, register(layout.cache_size, layout.mb_size,
                                **_keywords(spec, count)), layout, saves)

  def produce(self, index: int, out: Chunk) -> Chunk:
    del out, index
    batches, mask = self._loader.get_batches(self._chain)
    leaves = self._checked_leaves(batches)
    if mask is None:
      mask = np.ones(self._layout.lead, bool)
    mask = np.asarray(mask)
    if mask.shape != self._layout.lead or mask.dtype != np.bool_:
      raise ValueError(
          f"get_batches returned a mask of shape {mask.shape} and dtype "
          f"{mask.dtype}, expected shape {self._layout.lead} and bool")
    return Chunk(leaves, mask)

  def _checked_leaves(self, batches: Any):
    leaves = jax.tree_util.tree_leaves(batches)
    expected = self._layout
    if len(leaves) != len(expected.leaves):
      raise ValueError(
          f"get_batches returned {len(leaves)} arrays, expected "
          f"{len(expected.leaves)} as in the loader's observation_format")
    structure = jax.tree_util.tree_structure(batches)
    if structure != self._structure:
      # Served by leaf order, its arrays would pass for other features.
      raise ValueError(
          f"get_batches returned batches of structure {structure}, expected "
          f"{self._structure} as in the loader's observation_format")
    checked = []
    for leaf, shape, fmt, declared in zip(leaves, expected.leaf_shapes(),
                                          expected.leaves, self._declared):
      leaf = np.asarray(leaf)
      if leaf.dtype == declared != fmt.dtype:
        leaf = leaf.astype(fmt.dtype)
      if leaf.shape != shape or leaf.dtype != fmt.dtype:
        raise ValueError(
            f"get_batches returned an array of shape {leaf.shape} and dtype "
            f"{leaf.dtype}, expected shape {shape} (cache_size, mb_size, "
            f"...) and dtype {fmt.dtype} as in the loader's "
            "observation_format")
      checked.append(leaf)
    return checked

  def position(self) -> Position:
    """The loader's ``save_state``; where it has none, or it raises
    ``NotImplementedError`` (the predecessor's loaders could), a position
    that :meth:`seek` refuses, saying why: the chain serves its chunks in
    order, and only going back needs it."""
    if not self._saves:
      return {UNSAVED: f"{type(self._loader).__name__} has no save_state"}
    try:
      state = self._loader.save_state(self._chain)
    except NotImplementedError as e:
      return {UNSAVED: f"its save_state raised NotImplementedError({e})"}
    # A copy, whatever the loader keeps of it (its live bookkeeping, which
    # moves on as chunks are read ahead), in a form a checkpoint holds
    # exactly (JSON turns arrays and tuples into lists).
    try:
      return {_STATE: encode_state(state)}
    except TypeError as e:
      return {UNPORTABLE: f"its save_state returned {e}",
              _STATE: copy.deepcopy(state)}

  def seek(self, position: Position) -> None:
    if isinstance(position, dict) and UNSAVED in position:
      raise SeekRefused(
          f"chain {self._chain} of {self._loader!r} cannot go back to an "
          f"earlier chunk: {position[UNSAVED]}. A loader written the "
          "predecessor's way needs save_state and load_state for a state "
          "used twice, a replay (jax.checkpoint) and checkpoints")
    if isinstance(position, dict) and UNPORTABLE in position:
      state = copy.deepcopy(position[_STATE])
    elif isinstance(position, dict) and set(position) == {_STATE}:
      state = decode_state(position[_STATE])
    else:  # saved as it was, by an earlier version
      state = copy.deepcopy(position)
    try:
      self._loader.load_state(self._chain, state)
    except (TypeError, ValueError, SeekRefused):
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(
          f"load_state of {type(self._loader).__name__} raised "
          f"{type(e).__name__}: {e}") from e

  def close(self) -> None:
    self._loader.release_chain(self._chain)


# The key of a position's encoded save_state (see LegacyCursor.position):
# one no save_state of a loader uses, so that positions saved before it
# (the save_state's value as it was) restore as they did.
_STATE = "__jax_data_save_state__"
# Keys of encoded values JSON does not hold as they are.
_ARRAY, _SCALAR, _TUPLE, _ITEMS = ("__array__", "__scalar__", "__tuple__",
                                   "__items__")
# Kinds of NumPy values held exactly by their dtype.str, up to 8 bytes:
# booleans, integers and floats (ml_dtypes' are held by their name, unicode
# strings of any width).
_KINDS = "biuf"


def _dtype_name(dtype: np.dtype, path: str) -> str:
  """The name that :func:`decode_state` makes ``dtype`` again from."""
  if (dtype.kind in _KINDS and dtype.itemsize <= 8) or dtype.kind == "U":
    return dtype.str  # with its byte order
  if _ml_dtype(dtype):
    return dtype.name  # dtype.str does not tell these apart
  raise TypeError(f"a NumPy value of dtype {dtype} at state{path}")


def _ml_dtype(dtype: np.dtype) -> bool:
  """Whether ``dtype`` is one of ml_dtypes' (bfloat16, float8, int4, ...),
  which JAX names."""
  if dtype.kind != "V" or dtype.fields:
    return False
  try:
    return jnp.dtype(dtype.name) == dtype
  except TypeError:
    return False


def encode_state(value: Any, path: str = "") -> Any:
  """A predecessor-style ``save_state``'s value as JSON holds it exactly:
  NumPy arrays and scalars with their dtype, tuples as tuples, dicts with
  keys other than strings as pairs (:func:`decode_state` undoes it).

  Raises:
    TypeError: a value of another type (a ``Generator``, a complex or
      datetime value, a NamedTuple or ``defaultdict``, whose type would
      be lost); the message names it and where it is.
  """
  if isinstance(value, np.ndarray):
    return {_ARRAY: value.tolist(), "dtype": _dtype_name(value.dtype, path),
            "shape": list(value.shape)}
  if isinstance(value, np.generic):  # before float: np.float64 is one
    return {_SCALAR: value.item(), "dtype": _dtype_name(value.dtype, path)}
  if value is None or type(value) in (bool, int, float, str):
    return value
  if type(value) is list:
    return [encode_state(v, f"{path}[{i}]") for i, v in enumerate(value)]
  if type(value) is tuple:
    return {_TUPLE: [encode_state(v, f"{path}[{i}]")
                     for i, v in enumerate(value)]}
  if type(value) is dict:
    if all(type(k) is str for k in value) and not (
        {_ARRAY, _SCALAR, _TUPLE, _ITEMS, _STATE} & set(value)):
      return {k: encode_state(v, f"{path}[{k!r}]") for k, v in value.items()}
    return {_ITEMS: [[encode_state(k, f"{path} key"),
                      encode_state(v, f"{path}[{k!r}]")]
                     for k, v in value.items()]}
  raise TypeError(f"a {type(value).__name__} at state{path}")


def decode_state(value: Any) -> Any:
  """The value :func:`encode_state` encoded (a fresh object)."""
  if isinstance(value, list):
    return [decode_state(v) for v in value]
  if not isinstance(value, dict):
    return value
  if _ARRAY in value:
    return np.array(value[_ARRAY], dtype=jnp.dtype(value["dtype"])).reshape(
        value["shape"])
  if _SCALAR in value:
    return jnp.dtype(value["dtype"]).type(value[_SCALAR])
  if _TUPLE in value:
    return tuple(decode_state(v) for v in value[_TUPLE])
  if _ITEMS in value:
    return {decode_state(k): decode_state(v) for k, v in value[_ITEMS]}
  return {k: decode_state(v) for k, v in value.items()}


@dataclasses.dataclass
class OwnChain:
  """A chain registered through the predecessor's API."""
  cursor: ChainCursor
  layout: ChunkLayout
  spec: ChainSpec
  next_index: int = 0  # of the chunk produced next, for messages


class LoaderSeam(Protocol):
  """What :class:`PredecessorAdapter` needs of a host loader
  (``jax_data.loaders.host_loader.HostDataLoader``)."""

  observation_format: Any

  @property
  def observation_count(self) -> int:
    """The loader's observations."""

  def chain_spec(self, ordered: bool, **keywords: Any) -> ChainSpec:
    """The checked spec of a chain from registration keywords."""

  def chunk_layout(self, cache_size: int, mb_size: int) -> ChunkLayout:
    """The layout of chunks of ``cache_size`` batches of ``mb_size``."""

  def open_chain(self, spec: ChainSpec, layout: ChunkLayout) -> ChainCursor:
    """A cursor before the chain's first chunk."""

  def number_chain(self, spec: ChainSpec, layout: ChunkLayout,
                   open_cursor: Callable[[int, ChainSpec], ChainCursor]
                   ) -> Tuple[int, ChainSpec, ChainCursor]:
    """Numbers a chain and opens its cursor (``open_cursor(number,
    spec)``)."""

  def chains_numbered(self) -> int:
    """How many chains were numbered, by pipelines and by these
    methods."""


class PredecessorAdapter:
  """The predecessor's loader methods over a host loader's cursors.

  Chain ids are the loader's chain numbers: registrations by pipelines and
  by these methods count alike.

  Args:
    loader: The host loader.
  """

  def __init__(self, loader: LoaderSeam):
    # Weakly: the loader holds its adapter, and a cycle between them would
    # keep a dropped loader (and its arrays) alive until a garbage
    # collection instead of freeing it at once.
    self._loader_ref = weakref.ref(loader)
    self._lock = threading.Lock()
    # The chains registered here (None once released), by id.
    self._chains: Dict[int, Optional[OwnChain]] = {}

  @property
  def _loader(self) -> LoaderSeam:
    loader = self._loader_ref()
    if loader is None:  # only through a stale reference to the adapter
      raise ReferenceError("the loader of this adapter was dropped")
    return loader

  def register(self, ordered: bool, cache_size: Any, mb_size: Any,
               keywords: Dict[str, Any]) -> int:
    """Registers a chain (``register_random_pipeline`` or
    ``register_ordered_pipeline``); returns its id."""
    loader = self._loader
    spec = loader.chain_spec(ordered, **keywords)
    cache_size, mb_size = check_sizes(cache_size, mb_size,
                                      spec.observations.count)
    layout = loader.chunk_layout(cache_size, mb_size)

    number, spec, cursor = loader.number_chain(
        spec, layout, lambda _, spec: loader.open_chain(spec, layout))
    self.adopt(number, OwnChain(cursor, layout, spec))
    return number

  def adopt(self, number: int, chain: OwnChain) -> None:
    """Serves chain ``number`` through these methods (registered here, or a
    pipeline's chain of a loader that extends one of ours by overriding
    ``get_batches``)."""
    with self._lock:
      self._chains[number] = chain

  def _own_chain(self, chain_id: Any) -> OwnChain:
    chain_id = check_int("chain_id", chain_id, minimum=0)
    with self._lock:
      chain = self._chains.get(chain_id)
      if chain is None:
        if chain_id in self._chains:
          state = "was released"
        elif chain_id < self._loader.chains_numbered():
          state = (
              "is a pipeline's chain (made by init_fn), whose position "
              "lives in the pipeline's state: save that state "
              "(jax_data.save_checkpoint or state_to_pytree) and draw "
              "with batch_fn")
        else:
          state = (f"does not exist ({self._loader.chains_numbered()} "
                   "chains numbered)")
        raise ValueError(f"chain_id={chain_id} of {self._loader!r} {state}")
    return chain

  def get_batches(self, chain_id: Any) -> Tuple[PyTree, jax.Array]:
    """The chain's next chunk as JAX arrays, and advances it."""
    chain = self._own_chain(chain_id)
    # A failed read (a transient error) leaves the chain where it was: the
    # next call reads the same chunk, none is skipped.
    position = chain.cursor.position()
    try:
      chunk = chain.cursor.produce(chain.next_index,
                                   chain.layout.new_chunk())
    except BaseException:
      chain.cursor.seek(position)
      raise
    chain.next_index += 1
    treedef = jax.tree_util.tree_structure(self._loader.observation_format)
    return (treedef.unflatten([jnp.asarray(leaf) for leaf in chunk.leaves]),
            jnp.asarray(chunk.mask))

  def save_state(self, chain_id: Any) -> Dict[str, Any]:
    """The chain's kind and sizes, and the fields of its position."""
    chain = self._own_chain(chain_id)
    return {**chain.cursor.position(), **self._state_fields(chain)}

  def _state_fields(self, chain: OwnChain) -> Dict[str, Any]:
    return {"kind": ("ordered" if isinstance(chain.spec, OrderedChain)
                     else "random"),
            "cache_size": chain.layout.cache_size,
            "mb_size": chain.layout.mb_size,
            "observation_count": self._loader.observation_count}

  def load_state(self, chain_id: Any, data: Dict[str, Any]) -> None:
    """Moves the chain to a position from :meth:`save_state`."""
    chain = self._own_chain(chain_id)
    here = self._state_fields(chain)
    check_saved_state(data, here, f"chain {chain_id} of {self._loader!r}")
    chain.cursor.seek({k: v for k, v in data.items() if k not in here})

  def release_chain(self, chain_id: Any) -> None:
    """Closes a chain's cursor; its id is not reused."""
    chain_id = check_int("chain_id", chain_id, minimum=0)
    with self._lock:
      chain = self._chains.get(chain_id)
      if chain is not None:
        self._chains[chain_id] = None
    if chain is not None:
      chain.cursor.close()
