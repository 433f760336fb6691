"""Checkpoints of the data position: device-side state and host-side chains.

A chain's stream is a pure function of its spec and of the chunk index, so
a checkpoint holds the pipeline's fingerprint, per chain its spec and the
nearest snapshot of the loader cursor's position, and the ``(chunk,
position)`` counters of the state. The device cache is not saved:
a restored state fetches its chunk again, and continues with exactly the
batches the original would have served.

:func:`save_checkpoint` / :func:`restore_checkpoint` write and read a file;
:func:`state_to_pytree` / :func:`state_from_pytree` give a pytree of NumPy
arrays to save alongside model parameters with any pytree checkpointer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import uuid
import zipfile
import zlib
from typing import Any
from typing import BinaryIO
from typing import Dict
from typing import Iterable
from typing import Mapping
from typing import Optional
from typing import Sequence
from typing import SupportsIndex
from typing import Tuple
from typing import Union

import jax
import numpy as np

from jax_data.compiled import pipeline as pl
from jax_data.compiled.states import WRAPPED
from jax_data.errors import CheckpointError
from jax_data.streams import counter_streams as cs
from jax_data.streams import device_streams
from jax_data.streams.device_streams import DEVICE_MODES
from jax_data.types import CacheState
from jax_data.validation import check_int

FORMAT_VERSION = 2
# The hash of counter-based independent draws (counter_streams.uniform);
# checkpoints without the field were saved with 1.
COUNTER_DRAWS = cs.UNIFORM_VERSION
# The permutations of counter-based shuffled streams
# (counter_streams.permute); checkpoints without the field: 1.
COUNTER_PERMUTATION = cs.PERMUTE_VERSION
_FIELDS = ("chain", "chunk", "position", "cached_chunk", "key")


def state_to_pytree(pipeline: Any, state: CacheState) -> Dict[str, np.ndarray]:
  """The data position as a pytree of NumPy arrays.

  Save it with model parameters (pickle, ``numpy.savez``, orbax); restore
  with :func:`state_from_pytree` on a pipeline built the same way.

  Args:
    pipeline: The tuple a pipeline constructor returned (or its functions
      packed into a tuple again), or its init_fn.
    state: A state of the pipeline; stacked states (for vmap or pmap) too.

  Returns:
    ``{"host": uint8 JSON bytes, "chunk", "position": int32, "key": uint32}``.
  """
  return pytree_of(pipeline, state, "state_to_pytree")


def pytree_of(pipeline: Any, state: CacheState, where: str
              ) -> Dict[str, np.ndarray]:
  """:func:`state_to_pytree`, whose errors name ``where``."""
  pipeline = pl.of(pipeline)
  lanes, arrays = pipeline.saved_lanes(state, where)
  chains = []
  if pipeline.host is not None:
    for lane in np.ndindex(*lanes):
      saved = pipeline.host.save_chain(int(arrays["chain"][lane]),
                                       int(arrays["chunk"][lane]))
      # A chain whole: a global batch's part chain saves the chain it is
      # a part of (its position is the whole chain's).
      saved["spec"].pop("part", None)
      chains.append(saved)
  host = {"version": FORMAT_VERSION, "lanes": list(lanes), "chains": chains,
          "counter_draws": COUNTER_DRAWS,
          "counter_permutation": COUNTER_PERMUTATION,
          "fingerprint": pipeline.fingerprint,
          # The dtypes a loader serves, and so its data's digest, follow it.
          "x64": bool(jax.config.jax_enable_x64),
          # A device loader's jax.random chains draw by it too.
          "threefry_partitionable": bool(
              jax.config.jax_threefry_partitionable)}
  if pipeline.host is None:  # -1: a jax.random chain; -2 - mode: counter
    host["device_chains"] = arrays["chain"].astype(np.int64).ravel().tolist()
  if pipeline.global_state:
    # Every process of a job saves the same chains.
    host["global"] = True
  encoded = json.dumps(host, default=_json_default).encode()
  return {"host": np.frombuffer(encoded, np.uint8).copy(),
          "chunk": arrays["chunk"].astype(np.int32),
          "position": arrays["position"].astype(np.int32),
          "key": arrays["key"].astype(np.uint32)}


def concatenate_trees(trees: Sequence[Mapping[str, Any]]
                      ) -> Dict[str, np.ndarray]:
  """The saved states of ``trees`` (from :func:`state_to_pytree`, e.g. one
  per process) as one, their lanes one after the other on one axis; what
  :func:`state_from_pytree` then restores whole or in part (``lanes``), in
  any number of processes.

  Raises:
    CheckpointError: a tree is not a checkpoint, or they come from
      different pipelines or format versions (the message shows both).
  """
  if not trees:
    raise CheckpointError("no saved states to concatenate")
  hosts, arrays = [], {"chunk": [], "position": [], "key": []}
  for tree in trees:
    missing = sorted({"host", *arrays} - set(tree))
    if missing:
      raise CheckpointError(
          f"checkpoint has no field {', '.join(map(repr, missing))}: it is "
          "not a jax_data checkpoint, or was cut short")
    try:
      host = json.loads(np.asarray(tree["host"], np.uint8).tobytes()
                        .decode())
      count = math.prod(host["lanes"])
    except (TypeError, ValueError, KeyError) as e:
      raise CheckpointError(
          f"the checkpoint's host field is not jax_data's JSON: {e}") from e
    if hosts:
      _check("format version", host.get("version"), hosts[0].get("version"))
      _check("pipeline", host.get("fingerprint"),
             hosts[0].get("fingerprint"))
    _check_counter_versions(host)  # each part: the merge keeps one
    hosts.append(host)
    for name, parts in arrays.items():
      value = np.asarray(tree[name])
      lead = len(host["lanes"])
      parts.append(value.reshape((count,) + value.shape[lead:]))
  host = dict(hosts[0], lanes=[sum(math.prod(h["lanes"]) for h in hosts)],
              chains=[c for h in hosts for c in h.get("chains", [])],
              counter_draws=COUNTER_DRAWS,
              counter_permutation=COUNTER_PERMUTATION)
  if all("device_chains" in h for h in hosts):
    host["device_chains"] = [c for h in hosts for c in h["device_chains"]]
  encoded = json.dumps(host, default=_json_default).encode()
  return {"host": np.frombuffer(encoded, np.uint8).copy(),
          **{name: np.concatenate(parts) for name, parts in arrays.items()}}


def _json_default(value):
  if isinstance(value, np.integer):
    return int(value)
  if isinstance(value, np.bool_):
    return bool(value)
  if isinstance(value, np.ndarray):
    return value.tolist()
  raise TypeError(f"cannot save {value!r} in a checkpoint")


def state_from_pytree(pipeline: Any, tree: Mapping[str, Any],
                      lanes: Optional[Iterable[SupportsIndex]] = None
                      ) -> CacheState:
  """Restores a state from :func:`state_to_pytree` (``tree`` is not
  changed).

  The chains are registered anew on the pipeline's loader; the pipeline's
  fingerprint (loader, observation count, batch and cache size, a digest of
  the data) must match the saved one, and every field is checked before a
  chain is registered. A chain is its spec (seed, mode, stream) and its
  position, never a device or a process: reshape the restored state for
  another device count, or restore some of its lanes in each process.

  Args:
    pipeline: The pipeline, as for :func:`state_to_pytree`.
    tree: What :func:`state_to_pytree` returned.
    lanes: Restore only these lanes of the saved state, numbered in C order
      of its lane shape (e.g. ``range(4 * p, 4 * p + 4)`` in process ``p``
      of a state of 8 chains); the state then has one axis of
      ``len(lanes)``. None: all lanes, in the saved shape.

  Raises:
    CheckpointError: a field is missing or malformed, a counter is out of
      range, or the version or fingerprint differs (the message shows both
      sides); no chain is left registered then.
  """
  pipeline = pl.of(pipeline)
  with pipeline.restoring():
    host, arrays = _read_tree(tree, pipeline)
    if lanes is not None:
      saved = tuple(host["lanes"])
      host, arrays = _some_lanes(host, arrays, lanes)
      refused = pipeline.lanes_refused(host["lanes"][0])
      total = math.prod(saved)
      # Where no pick of its chains would fit, restore_lanes says so.
      if refused and any(not pipeline.lanes_refused(count)
                         for count in range(1, total + 1)):
        raise ValueError(
            f"lanes={lanes!r} picks {host['lanes'][0]} of the {total} "
            f"chains of the checkpoint (its lanes {saved}), but {refused}")
    lanes = tuple(host["lanes"])
    # A device loader's chains without device_chains (saved before it)
    # are jax.random ones; a host fills in its own chains.
    chain = np.full(lanes, device_streams.RANDOM_KIND, np.int32)
    if pipeline.host is None and "device_chains" in host:
      chain = _device_chains(host["device_chains"], lanes)
    if pipeline.host is None and (chain == device_streams.RANDOM_KIND).any():
      _check_random_settings(host)
    return pipeline.restore_lanes(host["chains"], arrays, lanes, chain)


def _check_random_settings(host: Dict[str, Any]) -> None:
  """Refuses to restore ``jax.random`` chains (a device loader's
  ``init_fn(key=...)``) under the settings their draws follow, where they
  differ from the saved ones: ``jax.random.randint`` draws int64 indices
  under x64 and int32 ones without, and threefry's bits depend on
  ``jax_threefry_partitionable``; the same key then gives other batches.
  Checkpoints that did not record a setting are not checked for it."""
  here = {"jax_enable_x64": bool(jax.config.jax_enable_x64),
          "jax_threefry_partitionable": bool(
              jax.config.jax_threefry_partitionable)}
  saved = {"jax_enable_x64": host.get("x64"),
           "jax_threefry_partitionable": host.get("threefry_partitionable")}
  differ = [f"{name}={saved[name]} when saved and {here[name]} here"
            for name in here
            if saved[name] is not None and saved[name] != here[name]]
  if differ:
    raise CheckpointError(
        "checkpoint does not fit: its jax.random chains (init_fn(key=...)) "
        f"draw other batches from the same key under other settings: "
        f"{'; '.join(differ)}. Restore with the settings it was saved with")


def _check_counter_versions(host: Dict[str, Any]) -> None:
  """Refuses a checkpoint of counter-based chains whose stream changed
  since it was saved: independent draws saved with another hash
  (:data:`COUNTER_DRAWS`), shuffled ones with other permutations
  (:data:`COUNTER_PERMUTATION`). From the same position such chains would
  draw other batches than they would have."""
  changes = (("counter_draws", COUNTER_DRAWS, ("independent",),
              ("2026-11-28", "2026-11-30"),
              "independent batches (stream='counter', shuffle=False) with "
              "the hash", cs.UNIFORM_CHANGES),
             ("counter_permutation", COUNTER_PERMUTATION,
              ("shuffle", "epochs"), ("2026-11-29", "2026-11-30"),
              "shuffled batches (stream='counter', shuffle=True) with the "
              "permutations", cs.PERMUTE_CHANGES))
  for field, version, modes, dates, what, why in changes:
    saved = host.get(field, 1)
    if saved != version and _has_counter_chains(host, modes):
      date = dates[0] if saved == 1 else dates[-1]
      raise CheckpointError(
          f"checkpoint does not fit: its chains draw counter-based {what} "
          f"of version {saved} (jax_data before {date}), and this jax_data "
          f"draws them with version {version}, "
          f"{why.get(saved, 'another stream')}; restored, the "
          "chains would go on with other batches than they would have. "
          "Start them anew (init_fn), or finish the run with the jax_data "
          "that saved it")


def _has_counter_chains(host: Dict[str, Any], modes: Tuple[str, ...]
                        ) -> bool:
  """Whether a checkpoint holds counter-based chains in one of ``modes``
  (``random_mode``'s names): host chains' saved streams, or device chains
  numbered ``-2 - mode`` (an index into ``DEVICE_MODES``)."""

  def found(value: Any) -> bool:
    if isinstance(value, dict):
      return ((value.get("stream") == "counter"
               and value.get("mode") in modes)
              or any(found(v) for v in value.values()))
    return isinstance(value, list) and any(found(v) for v in value)

  device = host.get("device_chains")
  numbers = {-2 - DEVICE_MODES.index(mode) for mode in modes}
  return found(host.get("chains")) or (
      isinstance(device, list) and any(c in numbers for c in device))


def _read_tree(tree: Any, pipeline: pl.Pipeline
               ) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
  """The host part and the counters of a checkpoint pytree, every field
  checked against the pipeline."""
  if not isinstance(tree, Mapping):
    raise CheckpointError(
        "tree must be the dict state_to_pytree returned, got "
        f"{type(tree).__name__}")
  missing = sorted({"host", "chunk", "position", "key"} - set(tree))
  if missing:
    raise CheckpointError(
        f"checkpoint has no field {', '.join(map(repr, missing))}: it is not "
        "a jax_data checkpoint, or was cut short")
  if any(isinstance(leaf, jax.core.Tracer)
         for leaf in jax.tree_util.tree_leaves(tree)):
    raise TypeError(
        "state_from_pytree needs a concrete tree, got a traced one (inside "
        "jax.jit, vmap or scan): restore the state outside, and give the "
        "compiled function the state it returns")
  try:
    host = json.loads(np.asarray(tree["host"], np.uint8).tobytes().decode())
  except (TypeError, ValueError) as e:
    raise CheckpointError(
        f"the checkpoint's host field is not jax_data's JSON: {e}") from e
  if not isinstance(host, dict):
    raise CheckpointError(f"the checkpoint's host field is {host!r}, not a "
                          "dict")
  _check("format version", host.get("version"), FORMAT_VERSION)
  _check_counter_versions(host)
  pipeline.prepare_restore(host.get("fingerprint"), host.get("lanes"))
  saved, here = host.get("fingerprint"), pipeline.fingerprint
  if pipeline.host is None and isinstance(saved, dict) and (
      saved.get("data") is None):
    here = {**here, "data": None}  # a device loader's, saved without one
  if (isinstance(saved, dict) and saved.get("data") != here.get("data")
      and saved.get("data") is not None
      and saved.get("data") in pipeline.earlier_data_digests()):
    # Saved by an earlier version, whose digest sampled fewer rows: the
    # data match by that digest.
    here = {**here, "data": saved["data"]}
  x64 = bool(jax.config.jax_enable_x64)
  if saved != here and host.get("x64", x64) != x64:
    raise CheckpointError(
        f"checkpoint does not fit: it was saved with jax_enable_x64="
        f"{not x64}, and here jax_enable_x64={x64}. Loaders serve 64-bit "
        "data as float64/int64 with it and float32/int32 without, so the "
        "data's digest and batches differ; restore with the setting the "
        "checkpoint was saved with")
  _check("pipeline", saved, here, pipeline.fit_hint(saved))
  lanes = host.get("lanes")
  if not isinstance(lanes, list) or not all(
      isinstance(n, int) and not isinstance(n, bool) and n >= 0
      for n in lanes):
    raise CheckpointError(
        f"the checkpoint's lanes are {lanes!r}, not a list of sizes")
  lanes = tuple(lanes)
  chains = host.get("chains")
  expected = math.prod(lanes) if pipeline.host is not None else 0
  if not isinstance(chains, list) or len(chains) != expected:
    raise CheckpointError(
        f"the checkpoint holds {chains!r} as its chains, expected a list of "
        f"{expected} (one per lane of {lanes})")
  key_shape = lanes + np.shape(pipeline.template.key)
  arrays = {"chunk": _counters(tree, "chunk", lanes, np.int32),
            "position": _counters(tree, "position", lanes, np.int32),
            "key": _counters(tree, "key", key_shape, np.uint32)}
  cache_size = np.shape(pipeline.template.mask)[0]
  positions = arrays["position"]
  if ((positions < 0) | (positions >= max(cache_size, 1))).any():
    raise CheckpointError(
        f"the checkpoint's positions {positions.tolist()} are outside "
        f"0 .. {max(cache_size, 1) - 1}, the batches of this pipeline's cache")
  if (arrays["chunk"] < 0).any():
    raise CheckpointError(
        f"the checkpoint's chunks {arrays['chunk'].tolist()} must not be "
        f"negative; {WRAPPED}")
  return host, arrays


def _device_chains(saved: Any, lanes: Tuple[int, ...]) -> np.ndarray:
  """The kinds of a device-resident pipeline's chains (checked)."""
  codes = np.asarray(saved)
  if (codes.shape != (math.prod(lanes),) or codes.dtype.kind != "i"
      or not device_streams.are_kinds(codes)):
    raise CheckpointError(
        f"the checkpoint's device_chains are {saved!r}, expected one of "
        f"{device_streams.RANDOM_KIND} to {device_streams.LOWEST_KIND} per "
        f"lane of {lanes}")
  return codes.astype(np.int32).reshape(lanes)


def _some_lanes(host: Dict[str, Any], arrays: Dict[str, np.ndarray],
                lanes: Any) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
  """The host part and counters of the saved lanes ``lanes`` only."""
  saved = tuple(host["lanes"])
  count = math.prod(saved)
  try:
    picked = [check_int("lane", lane, minimum=0, maximum=count - 1)
              for lane in lanes]
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"lanes must be lane numbers between 0 and {count - 1} (the saved "
        f"state has lanes {saved}), got lanes={lanes!r}: {e}") from e
  if not picked:
    raise ValueError(f"lanes must name at least one lane, got {lanes=}")
  flat = {k: v.reshape((count,) + v.shape[len(saved):])[picked]
          for k, v in arrays.items()}
  chains = host["chains"]
  picked_host = dict(host, lanes=[len(picked)],
                     chains=[chains[i] for i in picked] if chains else [])
  saved_chains = host.get("device_chains")
  if isinstance(saved_chains, list) and len(saved_chains) == count:
    picked_host["device_chains"] = [host["device_chains"][i] for i in picked]
  return picked_host, flat


def _counters(tree: Mapping[str, Any], name: str, shape: Tuple[int, ...],
              dtype: Any) -> np.ndarray:
  """A field of integers of ``shape``, as ``dtype``."""
  value = np.asarray(tree[name])
  if value.dtype.kind not in "iu" or value.shape != shape:
    raise CheckpointError(
        f"the checkpoint's {name} has shape {value.shape} and dtype "
        f"{value.dtype}, expected integers of shape {shape}")
  if not np.array_equal(value.astype(dtype).astype(np.int64),
                        value.astype(np.int64)):
    raise CheckpointError(
        f"the checkpoint's {name} {value.tolist()} does not fit {dtype}")
  return value.astype(dtype)


def _check(what: str, saved: Any, here: Any, hint: str = "") -> None:
  """Raises if ``saved`` differs from ``here``, naming the fields that
  differ and showing both sides (then ``hint``)."""
  if saved == here:
    return
  differ = ""
  if isinstance(saved, dict) and isinstance(here, dict):
    differ = "; ".join(
        f"{k} is {saved.get(k)!r} in the checkpoint but {here.get(k)!r} here"
        for k in sorted(set(saved) | set(here), key=str)
        if saved.get(k) != here.get(k)) + "; "
  raise CheckpointError(
      f"checkpoint does not fit: {differ}its {what} is {saved!r}, but here "
      f"it is {here!r}{hint}")


def save_checkpoint(path: Union[str, bytes, os.PathLike], pipeline: Any,
                    state: CacheState) -> None:
  """Writes the data position of ``state`` to ``path`` (a ``.npz`` file).

  >>> import os, tempfile
  >>> import numpy as np
  >>> import jax_data
  >>> loader = jax_data.NumpyDataLoader(x=np.arange(100))
  >>> pipeline = jax_data.random_reference_data(loader, 4, 8)
  >>> init_fn, batch_fn, _ = pipeline
  >>> state, _ = batch_fn(init_fn(seed=3, shuffle=True))
  >>> path = os.path.join(tempfile.mkdtemp(), "data.npz")
  >>> jax_data.save_checkpoint(path, pipeline, state)
  >>> restored = jax_data.restore_checkpoint(path, pipeline)
  >>> (batch_fn(state)[1]["x"] == batch_fn(restored)[1]["x"]).all().item()
  True

  Args:
    path: File to write; written to a temporary name of its own first,
      then renamed (so several processes or threads may save to it at
      once: the last rename wins, and each is whole). Temporary files
      that killed saves of it left are removed once ten minutes old.
    pipeline: The tuple a pipeline constructor returned (or its functions
      packed into a tuple again), or its init_fn.
    state: The state to save (stacked states too).
  """
  path = _file_name(path)
  if os.path.isdir(path):
    raise IsADirectoryError(
        f"path must be a file name, got path={path!r}, a directory")
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise FileNotFoundError(
        f"path={path!r} is in {folder!r}, which does not exist")
  tree = pytree_of(pipeline, state, "save_checkpoint")
  partial = _partial_name(folder, os.path.basename(path))
  try:
    with open(partial, "xb") as f:
      np.savez(f, **tree)
    os.replace(partial, path)
  except BaseException:
    # Nothing half-written is left (the file at path is as it was).
    with contextlib.suppress(OSError):
      os.remove(partial)
    raise
  _remove_stale_partials(folder, os.path.basename(path))


# Seconds after which a temporary file of a save is taken for one that a
# killed writer left: a save writes its file in seconds.
_STALE_PARTIAL_SECONDS = 600.0
_NAME_MAX = 255


def _partial_name(folder: str, name: str) -> str:
  """A temporary name of this writer's own beside the file ``name``:
  every process of a jax.distributed job (or several threads) may save the
  same state to one path, and with one temporary name for all, a writer's
  rename took another's file away. A name too long to take the suffix gets
  a short one of its own."""
  token = uuid.uuid4().hex[:12]
  partial = f"{name}.{token}.partial"
  if len(os.fsencode(partial)) > _NAME_MAX:
    partial = f".jax_data.{token}.partial"
  return os.path.join(folder, partial)


def _remove_stale_partials(folder: str, name: str) -> None:
  """Removes the temporary files of saves of ``name`` (or of names too
  long for a suffix) older than :data:`_STALE_PARTIAL_SECONDS`: a writer
  killed while it wrote (preempted, out of memory) left its whole-sized
  file, and with a name of its own no later save replaces it."""
  def ours(entry: str) -> bool:
    if not entry.endswith(".partial"):
      return False
    if entry == f"{name}.partial":  # a save of an earlier version's
      return True
    for prefix in (f"{name}.", ".jax_data."):
      token = entry[len(prefix):-len(".partial")]
      if (entry.startswith(prefix) and len(token) == 12
          and all(c in "0123456789abcdef" for c in token)):
        return True
    return False

  now = time.time()
  with contextlib.suppress(OSError):
    for entry in os.scandir(folder):
      with contextlib.suppress(OSError):
        if ours(entry.name) and (now - entry.stat().st_mtime
                                 > _STALE_PARTIAL_SECONDS):
          os.remove(entry.path)


def restore_checkpoint(path: Union[str, bytes, os.PathLike], pipeline: Any,
                       lanes: Optional[Iterable[SupportsIndex]] = None
                       ) -> CacheState:
  """Reads a state written by :func:`save_checkpoint` into ``pipeline``.

  The pipeline is built as the saved one was (same loader data, batch and
  cache sizes); its chains are registered anew.

  Args:
    path: A file :func:`save_checkpoint` wrote.
    pipeline: The pipeline, as for :func:`save_checkpoint`.
    lanes: Restore only these lanes (see :func:`state_from_pytree`).

  Raises:
    CheckpointError: the file is corrupt, truncated or not a checkpoint of
      :func:`save_checkpoint`, or it does not fit this pipeline (the message
      shows both sides).
    OSError: the file cannot be opened (its message names ``path``).
  """
  path = _file_name(path)
  if os.path.isdir(path):
    raise IsADirectoryError(
        f"path must be a checkpoint's file, got path={path!r}, a directory")
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"path={path!r} does not exist: no checkpoint was saved there")
  with open(path, "rb") as f:
    tree = read_tree(f, path)
  return state_from_pytree(pipeline, tree, lanes)


def _file_name(path: Any) -> str:
  """``path`` as a str, if it is a file name (a str, bytes or
  os.PathLike)."""
  try:
    name = os.fsdecode(path)
  except TypeError:
    raise TypeError("path must be a file name (a str, bytes or "
                    f"os.PathLike), got path={path!r}") from None
  if not name or "\0" in name:
    raise ValueError("path must be a file name, got path="
                     f"{path!r}" + (", with a null byte" if name else ""))
  return name


def read_tree(f: BinaryIO, path: str) -> Dict[str, np.ndarray]:
  """The arrays of a checkpoint file opened as ``f`` (named ``path`` in
  messages), checked to be one :func:`save_checkpoint` writes.

  Raises:
    CheckpointError: the file is corrupt, truncated or not a checkpoint.
  """
  _check_kind(path, f.read(len(_NPY_MAGIC)))
  f.seek(0)
  try:
    loaded = np.load(f, allow_pickle=False)
    if not isinstance(loaded, np.lib.npyio.NpzFile):
      raise CheckpointError(
          f"{path} holds one array of shape {np.shape(loaded)}, not a "
          "jax_data checkpoint: save_checkpoint writes a .npz archive")
    with loaded as data:
      tree = {k: data[k] for k in data.files}
  except (EOFError, NotImplementedError, OSError, ValueError,
          zipfile.BadZipFile, zlib.error) as e:
    # NotImplementedError, OSError: a corrupt compression method or
    # offset in the zip's headers.
    if isinstance(e, CheckpointError):
      raise
    # Not NumPy's words on object arrays: they advise loading the file
    # "unsafely" with allow_pickle, which a checkpoint never needs.
    reason = ("it holds Python objects (pickled data), which "
              "save_checkpoint never writes" if "pickle" in str(e) else
              f"{type(e).__name__}: {e}")
    raise CheckpointError(
        f"{path} is not a readable jax_data checkpoint (corrupt, "
        f"truncated, or another kind of file): {reason}") from e
  missing = sorted(set(_TREE_FIELDS) - set(tree))
  if missing:
    raise CheckpointError(
        f"{path} is not a jax_data checkpoint: it is a .npz archive of "
        f"{sorted(tree) or 'no arrays'}, without the fields "
        f"{', '.join(map(repr, missing))} that save_checkpoint writes")
  return tree


# How the files np.load reads begin: .npz archives (a zip, empty or not),
# .npy arrays.
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"
_TREE_FIELDS = ("host", "chunk", "position", "key")


def _check_kind(path: str, head: bytes) -> None:
  """Raises unless ``head``, the first bytes of file ``path``, begins a
  .npz archive or a .npy array (the rest NumPy would only unpickle)."""
  if head.startswith(_ZIP_MAGICS) or head.startswith(_NPY_MAGIC):
    return
  if not head:
    kind = "is empty"
  elif head.startswith(b"\x80"):
    kind = "is a Python pickle"
  else:
    kind = f"begins with the bytes {head!r}"
  raise CheckpointError(
      f"{path} is not a jax_data checkpoint: save_checkpoint writes a .npz "
      f"archive, but the file {kind}")
