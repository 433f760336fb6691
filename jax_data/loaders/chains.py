"""What a chain of a host loader is: its spec, the layout of its chunks, and
the cursor through which the loader produces them.

A chain is a stream of chunks, each ``cache_size`` batches of ``mb_size``
observations. Its spec (:class:`RandomChain`, :class:`OrderedChain`) is a
frozen value that says what it draws; a loader opens a
:class:`ChainCursor` for it (``HostDataLoader.open_chain``), which produces
the chunks into buffers of a :class:`ChunkLayout` and saves and restores
its position. Pure NumPy.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
import threading
from typing import Any
from typing import Callable
from typing import Dict
from typing import Hashable
from typing import List
from typing import Literal
from typing import Mapping
from typing import Optional
from typing import Sequence
from typing import Tuple
from typing import Union
from typing import get_args

import numpy as np

from jax_data.streams.sampling import ObservationRange
from jax_data.validation import check_bool
from jax_data.validation import check_int
from jax_data.validation import check_keywords

#: A loader's own keywords of a chain, beyond jax_data's: ``(name, value)``
#: pairs sorted by name.
Options = Tuple[Tuple[str, Any], ...]

#: The kinds of index streams of a random chain.
#: A random chain's index stream: the predecessor's exact streams
#: (``spec/SAMPLING.md``) or counter-based ones (:mod:`jax_data.
#: counter_streams`).
Stream = Literal["exact", "counter"]
STREAMS: Tuple[Stream, ...] = get_args(Stream)

# A chain's position: a small JSON-compatible dict (of dicts, lists, ints,
# strings, bools).
Position = Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class BatchPart:
  """Part ``index`` of ``count`` equal parts of every batch: the columns
  ``[index * n, (index + 1) * n)`` of batches of ``count * n``
  observations, where ``n`` is the chunk layout's ``mb_size``. The part of
  a global batch that one device along a mesh axis holds
  (:mod:`jax_data.compiled.global_batches`).
  """
  index: int
  count: int


@dataclasses.dataclass(frozen=True)
class RandomChain:
  """A chain of random mini-batches (``spec/SAMPLING.md``).

  Attributes:
    seed: The chain's seed; None until the chain is added to a loader,
      which sets it to the chain's number.
    observations: The observations it draws from (a shard, or all).
    shuffle: Draw without replacement, permutation after permutation.
    in_epochs: With ``shuffle``, one permutation per epoch, the last batch
      padded and masked.
    stream: ``"exact"``: the streams of ``spec/SAMPLING.md`` (the
      predecessor's batches); ``"counter"``: counter-based streams
      (:mod:`jax_data.streams.counter_streams`), O(1) in memory and in seeking.
    part: None: the chain's batches whole; else the part of each batch it
      keeps: it draws the whole chain's indices and reads only its rows.
    options: The keywords a loader takes beyond jax_data's own (those its
      ``random_keywords`` add), as ``(name, value)`` pairs sorted by name;
      ``dict(spec.options)`` in its ``open_chain``.
  """
  seed: Optional[int]
  observations: ObservationRange
  shuffle: bool = False
  in_epochs: bool = False
  stream: Stream = "exact"
  part: Optional[BatchPart] = None
  options: Options = ()


def batch_rows(spec: ChainSpec, mb_size: int) -> int:
  """The observations of a whole batch of ``spec`` whose chunks hold
  ``mb_size`` of each (a part's chunks hold a part of each batch)."""
  part = getattr(spec, "part", None)
  return mb_size if part is None else mb_size * part.count


@dataclasses.dataclass(frozen=True)
class OrderedChain:
  """A chain that passes over ``observations`` in order, pass after pass;
  the last batch of a pass is padded and masked.

  Attributes:
    observations: The observations of a pass.
    batches: None: a pass is the batches the observations fill; else this
      many, the rest all masked (a full-data pass padded to whole chunks;
      one device's share of a pass split over a mesh axis,
      :mod:`jax_data.compiled.global_passes`).
    fillers_from: The first observation of the fillers of the pass's last
      batch; None: the chain's first. A device's share of a split pass
      fills as the whole pass does, from the pass's first.
    options: The keywords a loader takes beyond jax_data's own (those its
      ``ordered_keywords`` add), as ``(name, value)`` pairs sorted by name.
  """
  observations: ObservationRange
  batches: Optional[int] = None
  fillers_from: Optional[int] = None
  options: Options = ()


ChainSpec = Union[RandomChain, OrderedChain]


def spec_to_json(spec: ChainSpec) -> Dict[str, Any]:
  """A spec as a JSON-compatible dict (for checkpoints)."""
  for name, value in spec.options:
    try:
      json.dumps(value)
    except (TypeError, ValueError) as e:
      raise TypeError(
          f"the chain's keyword {name}={value!r} cannot be saved in a "
          f"checkpoint, which holds a chain's keywords as JSON ({e}); "
          "pass numbers, strings, lists or dicts of them") from None
  # Without the options: asdict would deep-copy their values.
  fields = dataclasses.asdict(dataclasses.replace(spec, options=()))
  fields["observations"] = list(dataclasses.astuple(spec.observations))
  for name in ("part", "batches", "fillers_from"):  # as plain chains
    if name in fields and fields[name] is None:
      del fields[name]
  del fields["options"]
  if spec.options:
    fields["options"] = dict(spec.options)
  return {"kind": type(spec).__name__, **fields}


def spec_from_json(data: Mapping[str, Any]) -> ChainSpec:
  """The spec that :func:`spec_to_json` wrote, with every field checked.

  Raises:
    ValueError: ``data`` is not such a dict; the message names the field.
  """
  kinds = {"RandomChain": RandomChain, "OrderedChain": OrderedChain}
  try:
    fields = dict(data)
    kind = kinds[fields.pop("kind")]
    start, count, index, shards = (
        check_int(name, value, minimum=minimum) for name, value, minimum in
        zip(("start", "count", "shard_index", "shard_count"),
            fields.pop("observations"), (0, 1, 0, 1)))
    check_int("shard_index", index, maximum=shards - 1)
    observations = ObservationRange(start, count, index, shards)
    options = fields.pop("options", {})
    if not isinstance(options, Mapping) or not all(
        isinstance(name, str) for name in options):
      raise ValueError(f"options must map names to values, got {options!r}")
    options = tuple(sorted(options.items()))
    if kind is OrderedChain:
      check_keywords("an ordered chain's spec", fields,
                     ("batches", "fillers_from"))
      batches, fillers = fields.get("batches"), fields.get("fillers_from")
      return OrderedChain(
          observations,
          None if batches is None else check_int("batches", batches,
                                                 minimum=1),
          None if fillers is None else check_int("fillers_from", fillers,
                                                 minimum=0), options)
    check_keywords("a random chain's spec", fields,
                   ("seed", "shuffle", "in_epochs", "stream", "part"))
    shuffle = check_bool("shuffle", fields.get("shuffle", False))
    in_epochs = check_bool("in_epochs", fields.get("in_epochs", False))
    if in_epochs and not shuffle:
      raise ValueError("in_epochs=True needs shuffle=True")
    # Checkpoints written before counter streams hold exact ones.
    stream = fields.get("stream", "exact")
    if stream not in STREAMS:
      raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
    part = fields.get("part")
    if part is not None:
      check_keywords("a batch part", part, ("index", "count"))
      count = check_int("part count", part["count"], minimum=1)
      part = BatchPart(check_int("part index", part["index"], minimum=0,
                                 maximum=count - 1), count)
    seed = fields.get("seed")  # None: a predecessor-style loader's own
    return RandomChain(None if seed is None else check_int(
        "seed", seed, minimum=0), observations, shuffle, in_epochs, stream,
                       part, options)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"not a chain spec: {data!r} ({type(e).__name__}: {e})"
                     ) from e


@dataclasses.dataclass(frozen=True)
class LeafFormat:
  """Shape and dtype of one leaf of an observation (no batch axes)."""
  shape: Tuple[int, ...]
  dtype: np.dtype


#: The most bytes a pipeline's device cache may take per chain (batches,
#: their masks), and so a chunk: larger caches buy no speed, and a
#: mistyped size would exhaust memory before anything runs
#: (``jax_data.pipeline.MAX_CACHE_BYTES``).
MAX_CACHE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
  """The arrays of one chunk: leaves with leading ``(cache_size, mb_size)``.

  Leaves are in the order of ``jax.tree_util.tree_leaves`` of the loader's
  ``observation_format``.
  """
  cache_size: int
  mb_size: int
  leaves: Tuple[LeafFormat, ...]

  @property
  def lead(self) -> Tuple[int, int]:
    return (self.cache_size, self.mb_size)

  def leaf_shapes(self) -> List[Tuple[int, ...]]:
    return [self.lead + leaf.shape for leaf in self.leaves]

  def formats(self, lanes: int) -> List[Tuple[Tuple[int, ...], np.dtype]]:
    """Each leaf's and then the mask's (shape, dtype) for ``lanes``
    chunks stacked on a leading axis."""
    return [((lanes,) + shape, dtype) for shape, dtype in zip(
        self.leaf_shapes() + [self.lead], [leaf.dtype for leaf in
                                           self.leaves] + [np.dtype(bool)])]

  @functools.cached_property
  def nbytes(self) -> int:
    """Bytes of one chunk, mask included (computed once: every request
    that stores a chunk reads it)."""
    rows = self.cache_size * self.mb_size
    return rows * (1 + sum(int(np.prod(leaf.shape, dtype=np.int64))
                           * leaf.dtype.itemsize for leaf in self.leaves))

  def new_chunk(self, allocate: Callable[..., np.ndarray] = np.empty
                ) -> "Chunk":
    """A chunk of this layout, its arrays made by ``allocate(shape,
    dtype)``: ``np.empty`` (default), ``np.zeros``, a buffer pool's."""
    return Chunk([allocate(shape, leaf.dtype) for shape, leaf in
                  zip(self.leaf_shapes(), self.leaves)],
                 allocate(self.lead, np.dtype(bool)))

  def check(self, chunk: "Chunk") -> "Chunk":
    """``chunk``, checked against the layout (what a cursor returned).

    Raises:
      ValueError: a leaf or the mask of another shape or dtype (a loader's
        error, not something to cast).
    """
    self._check_arrays(chunk.leaves, chunk.mask, ())
    return chunk

  def check_span(self, span: "Span", chunks: int) -> "Span":
    """``span`` of ``chunks`` chunks, checked against the layout at once,
    as :meth:`check` checks each of its chunks."""
    self._check_arrays(span.leaves, span.mask, (chunks,))
    return span

  def _check_arrays(self, leaves: Sequence[Any], mask: Any,
                    lanes: Tuple[int, ...]) -> None:
    if len(leaves) != len(self.leaves):
      raise ValueError(
          f"the cursor returned {len(leaves)} arrays, expected "
          f"{len(self.leaves)} as in the loader's observation_format")
    for leaf, shape, fmt in zip(leaves, self.leaf_shapes(), self.leaves):
      shape = lanes + shape
      if not isinstance(leaf, np.ndarray) or leaf.shape != shape or (
          leaf.dtype != fmt.dtype):
        raise ValueError(
            f"the cursor returned an array of shape {np.shape(leaf)} and "
            f"dtype {getattr(leaf, 'dtype', type(leaf).__name__)}, expected "
            f"shape {shape} and dtype {fmt.dtype}")
    if (not isinstance(mask, np.ndarray) or mask.shape != lanes + self.lead
        or mask.dtype != np.bool_):
      raise ValueError(
          f"the cursor returned a mask of shape {np.shape(mask)}, expected "
          f"{lanes + self.lead} and dtype bool")


def readable() -> None:
  """The :attr:`Chunk.check` of chunks that can always be read."""


@dataclasses.dataclass
class Chunk:
  """One chunk: a NumPy array per leaf and the mask of valid observations.

  Attributes:
    leaves: Arrays of shapes ``layout.leaf_shapes()`` and the layout's
      dtypes.
    mask: shape=(cache_size, mb_size), bool.
    check: Called right before the leaves are read (handed to compiled
      code), it raises if they can no longer be read: leaves that are views
      of a memory-mapped file whose file has since shrunk (reading them
      would kill the process with SIGBUS).
    span: ``(span, g)`` for the ``g``-th chunk of chains produced together
      (:meth:`ChainCursor.produce_group`): a request for exactly those
      chunks, in that order, is copied in one piece per leaf.
  """
  leaves: List[np.ndarray]
  mask: np.ndarray
  check: Callable[[], None] = readable
  span: Optional[Tuple["Span", int]] = None


class LaterRows:
  """The rows of a :class:`Span` not read yet: ``take(outs, interleaved)``
  reads every chunk's rows into ``outs`` (one array per leaf, a leading
  lane axis; ``interleaved``: laid out with the lane axis second, batch by
  batch). A span's chunks produced ahead are then only their rows' numbers
  until served: a refresh read whole goes straight into compiled code's
  buffers (:meth:`Span.read_into`), not into the span's and copied again
  (84 MB a refresh of 1,024 chains of 10 batches of 64 rows of 32 floats).
  Its own leaves are read once, when first needed (:meth:`Span.read`)."""

  def __init__(self, take: Callable[[Sequence[np.ndarray], bool], None]):
    self._take = take
    self._lock = threading.Lock()
    self._pending = True

  def read(self, leaves: Sequence[np.ndarray]) -> None:
    """Reads the rows into the span's own ``leaves``, once."""
    with self._lock:
      if self._pending:
        self._take(leaves, False)
        self._pending = False

  def read_into(self, outs: Sequence[np.ndarray]) -> bool:
    """Reads the rows into ``outs`` if the span's leaves are not read (else
    a copy of them is as fast) and each of ``outs`` is laid out lane axis
    first or second without gaps; whether it did."""
    with self._lock:
      if not self._pending:
        return False
    if all(out.flags.c_contiguous for out in outs):
      interleaved = False
    elif all(out.swapaxes(0, 1).flags.c_contiguous for out in outs):
      interleaved = True
    else:
      return False
    self._take(outs, interleaved)
    return True


@dataclasses.dataclass(frozen=True, eq=False)
class Span:
  """The chunks of chains produced together, as arrays with a leading lane
  axis: chunk ``g``'s leaves are ``leaves[k][g]`` and its mask
  ``mask[g]`` (any strides: a group read in place is interleaved batch by
  batch; an all-valid mask may be a broadcast view). With ``later``, the
  leaves are read when first needed: :meth:`read` before their values."""
  leaves: List[np.ndarray]
  mask: np.ndarray
  later: Optional[LaterRows] = None

  def chunks(self, checks: Sequence[Callable[[], None]]) -> List[Chunk]:
    """Its chunks, views of it, with these checks (one per chunk)."""
    return [_SpanChunk(self, g, check) for g, check in enumerate(checks)]

  def read(self) -> "Span":
    """Itself, its leaves read (see :class:`LaterRows`)."""
    if self.later is not None:
      self.later.read(self.leaves)
    return self

  def read_into(self, outs: Sequence[np.ndarray]) -> bool:
    """Whether its leaves were read straight into ``outs`` (one buffer per
    leaf shaped as its leaves) rather than into its own: see
    :meth:`LaterRows.read_into`."""
    return self.later is not None and self.later.read_into(outs)


class _SpanChunk(Chunk):
  """Chunk ``g`` of a span, whose views are made when first read: a
  refresh copied or read in place as one span never reads them (4.6 ms of
  views at 1,024 lanes)."""

  def __init__(self, span: Span, g: int, check: Callable[[], None]):
    # pylint: disable=super-init-not-called (leaves and mask are views)
    # Not a (span, g) tuple: it would be one more object per lane for the
    # garbage collector, kept as long as the chunk.
    self._span, self._g = span, g
    self.check = check
    self._views: Optional[Tuple[List[np.ndarray], np.ndarray]] = None

  @property  # type: ignore[override]
  def span(self) -> Tuple[Span, int]:
    return self._span, self._g

  def _made(self) -> Tuple[List[np.ndarray], np.ndarray]:
    if self._views is None:
      span, g = self._span.read(), self._g
      self._views = [leaf[g] for leaf in span.leaves], span.mask[g]
    return self._views

  @property  # type: ignore[override]
  def leaves(self) -> List[np.ndarray]:
    return self._made()[0]

  @property  # type: ignore[override]
  def mask(self) -> np.ndarray:
    return self._made()[1]


def spanned(chunks: Sequence[Chunk]) -> Optional[Span]:
  """The span whose chunks ``chunks`` are, all of them in its order; None
  if they are not."""
  first = chunks[0].span if chunks else None
  if first is None or len(first[0].mask) != len(chunks):
    return None
  span = first[0]
  for g, chunk in enumerate(chunks):
    at = chunk.span
    if at is None or at[0] is not span or at[1] != g:
      return None
  return span


#: The key of a position that its cursor cannot return to (a loader
#: written the predecessor's way without ``save_state``); its value says
#: why. Such a position is no checkpoint.
UNSAVED = "unsaved"
#: The key of a position that its cursor can return to in this process but
#: that no checkpoint can hold (a predecessor-style ``save_state`` that
#: returned an object JSON cannot hold); its value says why.
UNPORTABLE = "unportable"


class RowsByIndexNeeded(ValueError):
  """Raised when a chain of a :attr:`RandomChain.part` or an
  :attr:`OrderedChain.batches` is opened on a cursor that does not read
  rows by index (:attr:`ChainCursor.serves_parts`); nothing was numbered
  and the cursor is closed."""


class SeekRefused(ValueError):
  """Raised by :meth:`ChainCursor.seek` of a cursor that cannot reach the
  position, before it moved: it still stands where it stood."""


class GroupKey:
  """A :meth:`ChainCursor.group_key`: a hashable tuple whose hash is computed
  once (a refresh of 1,024 chains asks each of them; hashing a layout anew
  took microseconds per chain)."""

  __slots__ = ("parts", "_hash")

  def __init__(self, parts: Tuple[Hashable, ...]):
    self.parts = parts
    self._hash = hash(parts)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    return isinstance(other, GroupKey) and (
        self._hash == other._hash and self.parts == other.parts)


class ChainCursor(abc.ABC):
  """A chain of a host loader, positioned before one of its chunks.

  The host calls :meth:`produce` for chunks ``0, 1, 2, ...`` in order; after
  :meth:`seek` to the position saved before chunk ``i`` it continues with
  chunk ``i``. Calls for one cursor never overlap; cursors of one loader may
  run in different threads at once.

  Attributes:
    serves_parts: Whether the cursor serves chains with a
      :attr:`RandomChain.part` or an :attr:`OrderedChain.batches` (a loader
      that reads rows by index); the host refuses such chains of other
      cursors.
  """

  serves_parts: bool = False  # and ordered chains' ``batches``

  @abc.abstractmethod
  def produce(self, index: int, out: Chunk) -> Chunk:
    """Chunk ``index``, and moves the cursor past it.

    Args:
      index: The chunk's index in the chain (for messages; the cursor is
        positioned at it).
      out: Buffers of the chunk's layout to write into.

    Returns:
      ``out`` filled, or arrays of the same layout that nothing will ever
      write to (read-only views of the loader's data, a shared all-True
      mask), which saves a copy.
    """

  @abc.abstractmethod
  def position(self) -> Position:
    """Where the cursor stands: small and JSON-compatible (a copy)."""

  @abc.abstractmethod
  def seek(self, position: Position) -> None:
    """Moves to a position from :meth:`position` (it is not mutated).

    Raises:
      ValueError: the position belongs to a chain of another kind or shape;
        the message says what differs.
      SeekRefused: the cursor cannot go there, and did not move.
    """

  def close(self) -> None:  # noqa: B027 (optional, unlike the others)
    """Frees what the cursor holds; it is not used afterwards."""

  def cancel(self) -> None:  # noqa: B027 (optional, unlike the others)
    """Asks a :meth:`produce` running in another thread to stop soon (a
    loader that reads records: before the next one) and raise; later
    calls of :meth:`produce` raise at once. Called by the host, from any
    thread, when the pipeline is released; it returns without waiting."""

  def trim(self) -> None:  # noqa: B027 (optional, unlike the others)
    """Frees what the cursor can rebuild from its position (caches, read
    blocks): the host calls it when the chain has gone idle."""

  def position_at(self, index: int) -> Optional[Position]:
    """The position before chunk ``index``, if the cursor can tell it
    without producing the chunks before (a counter-based stream, an
    ordered one over rows read by index); None (the default): the host
    seeks to a snapshot and replays from there."""
    del index
    return None

  def foreign(self, position: Position) -> Optional[str]:
    """Why ``position``, one the cursor takes, is another chain's than the
    cursor's spec (a seed of its own that differs), or None (the default:
    the cursor cannot tell). A checkpoint's spec and snapshot must agree;
    ``load_state`` may move a chain onto another's stream."""
    del position
    return None

  def position_after(self, position: Position, chunks: int
                     ) -> Optional[Position]:
    """The position ``chunks`` chunks after ``position`` (one of its
    own), if the cursor can tell it without producing them: a stream that
    moves the same number of batches every chunk and seeks to any batch
    by itself (a shuffle buffer replays its pass's draws). The host then
    keeps no snapshot per chunk, only the chain's first position, and
    seeks a chunk asked again straight from it. None (the default): it
    keeps snapshots and replays chunks from them."""
    del position, chunks
    return None

  def held_bytes(self) -> int:
    """About how many bytes :meth:`trim` would free; the host trims the
    cursors of the chains used least recently while those of all chains
    together hold more than its budget."""
    return 0

  def group_key(self) -> Optional[Hashable]:
    """Cursors with equal keys (not None) can produce their chunks together
    through :meth:`produce_group`: the host produces the chunks of several
    chains that one request (vmapped chains) needs in one call. None (the
    default): chunk by chunk."""
    return None

  @classmethod
  def produce_group(cls, cursors: Sequence["ChainCursor"],
                    indices: Sequence[int], layout: ChunkLayout,
                    allocate: Callable[..., np.ndarray]) -> List["Chunk"]:
    """Chunk ``indices[i]`` of ``cursors[i]`` for every ``i``, each cursor
    moved past it, as :meth:`produce` gives them one by one: cursors of
    this class with one :meth:`group_key`, each positioned at its chunk.
    ``allocate(shape, dtype)`` makes buffers to write into. For a request
    read in place (hundreds of vmapped chains) the host answers the first
    call per leaf, in leaf order, that asks for every cursor's rows of that
    leaf one after another (shape ``(len(cursors) * cache_size * mb_size,)
    + leaf shape``) with compiled code's own buffer: rows written there need
    no copy. When ``allocate.interleaved`` is true (a vmapped
    ``jax_data.scan``, whose buffers have the lane axis second), that
    buffer takes the rows batch by batch: every cursor's batch ``j``, in
    cursor order, before any batch ``j + 1``. A cursor keeps no reference
    to a buffer once it returns.

    The default produces them one by one.
    """
    return [cursor.produce(index, layout.new_chunk(allocate))
            for cursor, index in zip(cursors, indices)]
