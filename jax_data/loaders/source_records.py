"""Records of a random-access source: reading, transforming and checking
them against the first record's format.

What :class:`~jax_data.SourceDataLoader` and its worker processes share: a
:class:`RecordReader` reads records ``source[i]`` (or batches of them with
``__getitems__``), applies the transform, checks each against the
:class:`RecordFormat` of the first record (a record that differs is named
by a :class:`RecordError`) and writes their leaves into rows of a chunk.

A worker process reads records without importing JAX (over a second and
~160 MiB a worker): records that are one array or number, or a dict, tuple or
list of them, are taken apart here as ``jax.tree_util`` would take them
apart; JAX is imported only for other records (nested, ``None`` leaves,
registered nodes) and for the first record's format, which the parent
finds.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from jax_data.errors import RecordError  # noqa: F401 (its old home)
from jax_data.loaders.file_rows import CLOSED_HDF5
from jax_data.loaders.file_rows import closed_hdf5
from jax_data.loaders.narrowing import cannot_hold
from jax_data.loaders.narrowing import first_outside
from jax_data.loaders.narrowing import narrows
from jax_data.loaders.narrowing import within

# Records a batched read asks for at once (see RecordReader.fill).
_BLOCK = 16_384

# What jax.tree_util takes as a leaf whatever a program registers: NumPy
# arrays (memmaps too) and Python numbers by their exact type (a subclass
# may be a registered pytree node: JAX takes it apart), and NumPy's and
# ml_dtypes' scalars. A record of them, or a dict, tuple or list of them,
# is taken apart without JAX.
_LEAF_TYPES = frozenset((np.ndarray, np.memmap, bool, int, float, complex))


def _is_leaf(value: Any) -> bool:
  return type(value) in _LEAF_TYPES or isinstance(value, np.generic)


class RecordFormat:
  """The structure, key paths, shapes and dtypes of the first record.

  Pickled for worker processes without its JAX treedef where the
  container and keys describe the structure (``stackable``): a worker then
  never needs JAX for it, and :attr:`treedef` is made again on first use.
  """

  def __init__(self, treedef, paths: List[str], leaves: List[np.ndarray]):
    self._treedef = treedef
    self.paths = paths
    self.shapes = [leaf.shape for leaf in leaves]
    self.dtypes = [leaf.dtype for leaf in leaves]
    # Records that are one array, or a dict, tuple or list of arrays: their
    # container and keys (positions), so that a batch of them is stacked
    # leaf by leaf in C. (A None child is a node of no leaves: not one.)
    node = treedef.node_data()
    self.container: Optional[type] = None
    self.keys: Tuple[Any, ...] = ()
    self.stackable = treedef.num_nodes == treedef.num_leaves == 1 or (
        node is not None and node[0] in (dict, tuple, list)
        and all(child.num_nodes == 1 and child.num_leaves == 1
                for child in treedef.children()))
    if treedef.num_nodes > 1 and self.stackable:
      self.container = node[0]
      self.keys = (tuple(node[1]) if node[0] is dict
                   else tuple(range(treedef.num_leaves)))

  @property
  def treedef(self) -> Any:
    """The first record's JAX treedef."""
    if self._treedef is None:  # unpickled: stackable, so one level
      import jax  # pylint: disable=import-outside-toplevel
      if self.container is None:
        skeleton: Any = 0
      elif self.container is dict:
        skeleton = {key: 0 for key in self.keys}
      else:
        skeleton = self.container(0 for _ in self.keys)
      self._treedef = jax.tree_util.tree_structure(skeleton)
    return self._treedef

  def __getstate__(self) -> dict:
    state = dict(self.__dict__)
    if self.stackable:
      state["_treedef"] = None
    return state

  def plain_leaves(self, record: Any) -> Optional[List[Any]]:
    """The leaves of ``record`` in ``jax.tree_util``'s order, found without
    JAX, if it has the first record's container and keys and its leaves
    are arrays or numbers; else None (ask JAX)."""
    if not self.stackable:
      return None
    if self.container is None:
      return [record] if _is_leaf(record) else None
    if type(record) is not self.container or len(record) != len(self.keys):
      return None
    try:
      leaves = [record[key] for key in self.keys]
    except KeyError:
      return None
    return leaves if all(_is_leaf(leaf) for leaf in leaves) else None

  def columns(self, records: List[Any]) -> Optional[List[List[Any]]]:
    """The records' leaves, one list per leaf, if every record has the
    first's structure at the top level (one array, or the same container
    with the same keys or length); else None."""
    if self.container is None:
      return [records]
    kind, count = self.container, len(self.keys)
    try:
      if not all(type(r) is kind and len(r) == count for r in records):
        return None
      return [[r[k] for r in records] for k in self.keys]
    except KeyError:
      return None

  def stack(self, records: List[Any]) -> Optional[List[np.ndarray]]:
    """The records stacked leaf by leaf, or None where one of them does
    not match the first record (the record-by-record path then names it).
    """
    columns = self.columns(records) if self.stackable else None
    if columns is None:
      return None
    stacked = []
    for column, shape, dtype in zip(columns, self.shapes, self.dtypes):
      # Leaves of another dtype would be promoted silently (int32 among
      # int64, a Python int among floats, a bool among ints) and pass the
      # check after the stack: NumPy or JAX scalars and arrays are checked
      # one by one, Python scalars by their type.
      scalars = set()
      for value in column:
        have = getattr(value, "dtype", None)
        if have is None:
          scalars.add(type(value))
        elif have != dtype:
          return None
      if any(_scalar_dtype(kind) != dtype for kind in scalars):
        return None
      # np.array stacks arrays of one shape 4x as fast as np.stack (655k
      # records of 4 float32: 0.21 s against 0.80 s); np.stack again
      # where it promoted or nested differently.
      for stack in (np.array, np.stack):
        try:
          array = stack(column)
        except Exception:  # pylint: disable=broad-except
          # Mixed shapes; or a leaf that fails to read when converted
          # (an h5py dataset): the record-by-record path names it.
          continue
        if array.shape[1:] == shape and array.dtype == dtype:
          stacked.append(array)
          break
      else:
        return None
    return stacked

  def describe(self) -> str:
    return "{" + ", ".join(
        f"{path}: {dtype}{list(shape)}" for path, shape, dtype in
        zip(self.paths, self.shapes, self.dtypes)) + "}"


def flatten_record(record: Any) -> Tuple[List[str], List[Any], Any]:
  """Key paths, leaves and treedef of a record."""
  import jax  # pylint: disable=import-outside-toplevel
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(record)
  paths = [jax.tree_util.keystr(path) or "record" for path, _ in with_paths]
  return paths, [leaf for _, leaf in with_paths], treedef


def batched_read(source: Any) -> Optional[Callable[[List[int]], Any]]:
  """The source's ``__getitems__``, if it has one that works: a list of
  indices gives a list of as many records (PyTorch's convention, met by
  Hugging Face, ArrayRecord and TFDS sources). One that raises on a probe
  (a mocked TFDS source binds it wrongly) is not used."""
  batched = getattr(source, "__getitems__", None)
  if not callable(batched):
    return None
  try:
    probe = batched([0])
    if len(probe) != 1:
      return None
  except Exception:  # pylint: disable=broad-except
    return None
  return batched


#: What a source's read or a transform raises that fails its record (named
#: in a RecordError): an Exception, or SystemExit (``sys.exit`` in
#: argparse, a decoder's fatal path). KeyboardInterrupt stops the
#: production instead, as a real Ctrl-C does.
USER_FAILURES = (Exception, SystemExit)


class RecordReader:
  """Reads, transforms and checks the records of a source.

  Args:
    source: Has ``__len__`` and ``__getitem__(int)``.
    transform: Turns a record into a pytree of array-likes; None takes
      records as they are.
    name: The loader's name, for messages.
    first: The format of record 0, if known (a worker process receives
      it); else record 0 is read and its format taken.

  Raises:
    TypeError: ``first`` is None and record 0 has a leaf that is not
      numeric, or no leaves.
    RecordError: ``first`` is None and record 0 cannot be read.
  """

  def __init__(self, source: Any, transform: Optional[Callable], name: str,
               first: Optional[RecordFormat] = None):
    self.source = source
    self.transform = transform
    self.name = name
    self.batched = batched_read(source)
    if first is None:
      # Read as chunks read (sources may type a batched read differently).
      paths, leaves, treedef = flatten_record(
          self.records(np.zeros(1, int))[0])
      first = RecordFormat(treedef, paths, self.check_first(paths, leaves))
    self.first = first

  def load(self, index: int) -> Any:
    """Record ``index``, transformed; a failure names the index."""
    try:
      record = self.source[index]
      return record if self.transform is None else self.transform(record)
    except USER_FAILURES as e:
      if closed_hdf5(self.source):
        raise RecordError(f"{self.name} over {type(self.source).__name__}: "
                          f"{CLOSED_HDF5}") from e
      raise RecordError(
          f"{self.name} over {type(self.source).__name__}: "
          f"record {index}: {type(e).__name__}: {e}") from e

  def array(self, index: int, path: str, leaf: Any) -> np.ndarray:
    """Leaf ``path`` of record ``index`` as an array; a failure (a leaf
    read when converted, as an h5py dataset is) names the record."""
    try:
      return np.asarray(leaf)
    except USER_FAILURES as e:
      raise RecordError(
          f"{self.name} over {type(self.source).__name__}: record {index} "
          f"{path}: {type(e).__name__}: {e}") from e

  def check_first(self, paths: List[str], leaves: List[Any]
                   ) -> List[np.ndarray]:
    # JAX's dtypes: the main process checks the first record, workers not.
    import jax  # pylint: disable=import-outside-toplevel

    # pylint: disable-next=import-outside-toplevel
    from jax_data.validation import is_jax_dtype
    arrays = []
    for path, leaf in zip(paths, leaves):
      array = self.array(0, path, leaf)
      if is_jax_dtype(array.dtype) and not array.dtype.isnative:
        raise TypeError(
            f"record 0 has {path} of dtype {array.dtype}, in the other byte "
            "order than this machine's; turn it into this machine's with "
            "transform= (x.astype(x.dtype.newbyteorder('=')))")
      if not is_jax_dtype(array.dtype):
        raise TypeError(
            f"record 0 has {path} of dtype {array.dtype} ({type(leaf).__name__}"
            "), which cannot become a JAX array; drop it or turn it into "
            "numbers with transform=")
      target = jax.dtypes.canonicalize_dtype(array.dtype)
      if narrows(array.dtype, target):  # refused now, not in compiled code
        check_fits(f"{self.name} over {type(self.source).__name__}", path,
                   np.zeros(1, np.int64), array[None], target)
      arrays.append(array)
    if not arrays:
      raise TypeError("record 0 has no array leaves: " + repr(leaves))
    return arrays

  def leaves(self, index: int, record: Any) -> List[np.ndarray]:
    """The leaves of record ``index``, checked against the first record
    (key paths are computed only for a message)."""
    first = self.first
    leaves = first.plain_leaves(record)
    if leaves is None:
      leaves = self.tree_leaves(index, record)
    arrays = []
    for leaf, shape, dtype, path in zip(leaves, first.shapes, first.dtypes,
                                        first.paths):
      array = leaf if type(leaf) is np.ndarray else self.array(index, path,
                                                               leaf)
      if array.shape != shape or array.dtype != dtype:
        self.wrong_leaf(index, record)
      arrays.append(array)
    return arrays

  def tree_leaves(self, index: int, record: Any) -> List[Any]:
    """The leaves of record ``index`` as ``jax.tree_util`` finds them; a
    record of another structure than the first's is named."""
    import jax  # pylint: disable=import-outside-toplevel
    first = self.first
    leaves, treedef = jax.tree_util.tree_flatten(record)
    if treedef != first.treedef:
      paths, _, _ = flatten_record(record)
      if paths == list(first.paths) or not paths:
        # The same keys in other containers (a tuple for a list, an
        # OrderedDict for a dict), or None leaves: the structures say so.
        what = f"the structure {treedef}", f"{first.treedef}"
      else:
        what = (f"the keys {', '.join(paths)}", f"{', '.join(first.paths)}")
      raise RecordError(
          f"record {index} has {what[0]}, but record 0 has {what[1]}: "
          "records must share one format; record 0 is "
          f"{first.describe()}")
    return leaves

  def wrong_leaf(self, index: int, record: Any) -> None:
    """Raises the error that names a leaf of another shape or dtype."""
    first = self.first
    paths, leaves, _ = flatten_record(record)
    for path, leaf, shape, dtype in zip(paths, leaves, first.shapes,
                                        first.dtypes):
      array = self.array(index, path, leaf)
      if array.shape != shape or array.dtype != dtype:
        raise RecordError(
            f"record {index} has {path} of dtype {array.dtype} and shape "
            f"{list(array.shape)}, but record 0 has {dtype}{list(shape)}: "
            f"records must share one format; record 0 is "
            f"{first.describe()}")

  def records(self, indices: np.ndarray) -> List[Any]:
    """The transformed records of ``indices``, batched where the source
    reads batches."""
    if self.batched is None:
      return [self.load(int(i)) for i in indices]
    try:
      records = list(self.batched(indices.tolist()))
    except USER_FAILURES as e:
      if hasattr(self.source, "__getitem__"):
        # Read one by one, the record that fails names itself.
        for index in indices.tolist():
          self.load(index)
      raise RecordError(
          f"{self.name} over {type(self.source).__name__}: "
          f"records {indices.tolist()[:8]}{'...' if indices.size > 8 else ''}"
          f": {type(e).__name__}: {e}") from e
    if len(records) != indices.size:
      raise RecordError(
          f"__getitems__ of {type(self.source).__name__} returned "
          f"{len(records)} records for {indices.size} indices")
    if self.transform is None:
      return records
    out = []
    for index, record in zip(indices, records):
      try:
        out.append(self.transform(record))
      except USER_FAILURES as e:
        raise RecordError(
            f"{self.name} over {type(self.source).__name__}: "
            f"record {int(index)}: {type(e).__name__}: {e}") from e
    return out

  def fill(self, indices: np.ndarray, rows: np.ndarray,
           out: Sequence[np.ndarray],
           stop: Optional[concurrent.futures.Future] = None) -> None:
    """Reads records ``indices`` into rows ``rows`` of ``out``; once
    ``stop`` is done (the chain's pipeline was released), it returns before
    the next record, leaving the rest unwritten."""
    if self.batched is not None and indices.size > _BLOCK:
      # A block at a time: the records of one block (a Python object
      # each) are freed before the next is read, so their memory is
      # reused, not faulted in anew (1,024 chains' chunks at once: 0.8 s
      # -> 0.2 s on the first read).
      for low in range(0, indices.size, _BLOCK):
        if stop is not None and stop.done():
          return
        part = slice(low, low + _BLOCK)
        self.fill(indices[part], rows[part], out, stop)
      return
    what = f"{self.name} over {type(self.source).__name__}"
    if self.batched is not None:
      records = self.records(indices)
      stacked = self.first.stack(records) if len(records) > 1 else None
      if stacked is not None:  # all alike: written leaf by leaf
        write_columns(what, self.first.paths, indices, rows, out, stacked)
        return
    else:  # one by one: a stop takes effect before the next
      records = (self.load(int(i)) for i in indices)
    # The bounds of leaves whose integers their buffers may not hold.
    bounds = [np.iinfo(leaf.dtype) if narrows(dtype, leaf.dtype) else None
              for dtype, leaf in zip(self.first.dtypes, out)]
    for index, row, record in zip(indices, rows, records):
      for leaf, array, path, fits in zip(
          out, self.leaves(int(index), record), self.first.paths, bounds):
        if fits is not None and not within(array, fits):
          check_fits(what, path, np.asarray([index]), array[None],
                     leaf.dtype)
        leaf[row] = array
      if stop is not None and stop.done():
        return


def write_columns(what: str, paths: Sequence[str], indices: np.ndarray,
                  rows: np.ndarray, out: Sequence[np.ndarray],
                  columns: Sequence[np.ndarray]) -> None:
  """Writes the leaves of records ``indices``, stacked (``columns``), into
  rows ``rows`` of ``out``; integers that a leaf's buffer cannot hold are
  named (:func:`check_fits`; ``what`` names the loader and its source)."""
  for leaf, column, path in zip(out, columns, paths):
    if narrows(column.dtype, leaf.dtype):
      check_fits(what, path, indices, column, leaf.dtype)
    leaf[rows] = column


def check_fits(what: str, path: str, indices: np.ndarray, array: np.ndarray,
               dtype: np.dtype) -> None:
  """Raises a :class:`RecordError` if leaf ``path`` of records ``indices``
  (``array``, a leading record axis) holds integers that ``dtype`` (its
  buffer's: JAX's) cannot (:mod:`~jax_data.loaders.narrowing`)."""
  found = first_outside(array, dtype)
  if found is not None:
    at, value = found
    raise RecordError(
        f"{what}: record {int(indices[at])} has {path} = "
        f"{cannot_hold(value, dtype)} (transform= can make them)")


def _scalar_dtype(kind: type) -> Optional[np.dtype]:
  """The dtype NumPy gives a Python scalar of type ``kind`` (None for a
  type it does not make a number of)."""
  try:
    return np.asarray(kind()).dtype
  except Exception:  # pylint: disable=broad-except
    return None
