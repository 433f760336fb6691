"""Checkpoints of the data position: device-side state and host-side chains.

A chain's stream is a pure function of how it was registered and of the
chunk index, so a checkpoint holds, per chain, the keywords that re-create
it, its fingerprint, the nearest snapshot of the loader's position, and the
``(chunk, position)`` counters of the state. The device cache is not saved:
a restored state fetches its chunk again, and continues with exactly the
batches the original would have served.

:func:`save_checkpoint` / :func:`restore_checkpoint` write and read a file;
:func:`state_to_pytree` / :func:`state_from_pytree` give a pytree of NumPy
arrays to save alongside model parameters with any pytree checkpointer.
"""

from __future__ import annotations

import json
import os
from typing import Any
from typing import Dict
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

from jax_data import pipeline as pl
from jax_data.types import CacheState

FORMAT_VERSION = 2
_FIELDS = ("chain", "chunk", "position", "cached_chunk", "key")


def _lanes(state: CacheState, template: CacheState):
  """The leading (vmap/pmap) axes of a state, e.g. () or (4,)."""
  if not isinstance(state, CacheState):
    raise TypeError(f"state must be a CacheState, got {type(state).__name__}")
  shape = np.shape(state.chain)
  if np.shape(state.key)[len(shape):] != np.shape(template.key):
    raise TypeError("state does not belong to this pipeline")
  return shape


def state_to_pytree(pipeline: Any, state: CacheState) -> Dict[str, np.ndarray]:
  """The data position as a pytree of NumPy arrays.

  Save it with model parameters (pickle, ``numpy.savez``, orbax); restore
  with :func:`state_from_pytree` on a pipeline built the same way.

  Args:
    pipeline: The tuple a pipeline constructor returned, or its init_fn.
    state: A state of the pipeline; stacked states (for vmap or pmap) too.

  Returns:
    ``{"host": uint8 JSON bytes, "chunk", "position": int32, "key": uint32}``.
  """
  pipeline = pl.of(pipeline)
  lanes = _lanes(state, pipeline.template)
  arrays = {f: np.asarray(getattr(state, f)) for f in _FIELDS}
  chains = []
  if pipeline.host is not None:
    for lane in np.ndindex(*lanes):
      chains.append(pipeline.host.save_chain(int(arrays["chain"][lane]),
                                             int(arrays["chunk"][lane])))
  host = {"version": FORMAT_VERSION, "lanes": list(lanes), "chains": chains,
          "fingerprint": pipeline.fingerprint}
  encoded = json.dumps(host, default=_json_default).encode()
  return {"host": np.frombuffer(encoded, np.uint8).copy(),
          "chunk": arrays["chunk"].astype(np.int32),
          "position": arrays["position"].astype(np.int32),
          "key": arrays["key"].astype(np.uint32)}


def _json_default(value):
  if isinstance(value, np.integer):
    return int(value)
  if isinstance(value, np.bool_):
    return bool(value)
  if isinstance(value, np.ndarray):
    return value.tolist()
  raise TypeError(f"cannot save {value!r} in a checkpoint")


def state_from_pytree(pipeline: Any, tree: Dict[str, Any]) -> CacheState:
  """Restores a state from :func:`state_to_pytree` (``tree`` is not
  changed).

  The chains are registered anew on the pipeline's loader; the pipeline's
  fingerprint (loader, observation count, batch and cache size, a digest of
  the data) must match the saved one.

  Raises:
    ValueError: a version or fingerprint differs; the message shows both.
  """
  pipeline = pl.of(pipeline)
  try:
    host = json.loads(np.asarray(tree["host"], np.uint8).tobytes().decode())
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"tree is not a jax_data checkpoint: {e}") from e
  _check("format version", host.get("version"), FORMAT_VERSION)
  _check("pipeline", host.get("fingerprint"), pipeline.fingerprint)
  lanes = tuple(host["lanes"])
  chunk = np.asarray(tree["chunk"], np.int32).reshape(lanes)
  position = np.asarray(tree["position"], np.int32).reshape(lanes)
  key = np.asarray(tree["key"], np.uint32).reshape(
      lanes + np.shape(pipeline.template.key))
  chain = np.full(lanes, -1, np.int32)
  if pipeline.host is not None:
    for lane, saved in zip(np.ndindex(*lanes), host["chains"]):
      chain[lane] = pipeline.host.restore_chain(saved)
  template = pipeline.template

  def build(lane_chain, lane_chunk, lane_position, lane_key):
    return template._replace(
        chain=jnp.int32(lane_chain), chunk=jnp.int32(lane_chunk),
        position=jnp.int32(lane_position), cached_chunk=jnp.int32(-1),
        key=jnp.asarray(lane_key, jnp.uint32))

  if not lanes:
    return build(chain, chunk, position, key)
  states = [build(chain[i], chunk[i], position[i], key[i])
            for i in np.ndindex(*lanes)]
  stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)
  return jax.tree_util.tree_map(
      lambda x: x.reshape(lanes + x.shape[1:]), stacked)


def _check(what: str, saved: Any, here: Any) -> None:
  """Raises if ``saved`` differs from ``here``, naming the fields that
  differ and showing both sides."""
  if saved == here:
    return
  differ = ""
  if isinstance(saved, dict) and isinstance(here, dict):
    differ = "; ".join(
        f"{k} is {saved.get(k)!r} in the checkpoint but {here.get(k)!r} here"
        for k in sorted(set(saved) | set(here), key=str)
        if saved.get(k) != here.get(k)) + "; "
  raise ValueError(
      f"checkpoint does not fit: {differ}its {what} is {saved!r}, but here "
      f"it is {here!r}")


def save_checkpoint(path: Union[str, os.PathLike], pipeline: Any,
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
    path: File to write; written to a temporary name first, then renamed.
    pipeline: The tuple a pipeline constructor returned, or its init_fn.
    state: The state to save (stacked states too).
  """
  tree = state_to_pytree(pipeline, state)
  path = os.fspath(path)
  partial = path + ".partial"
  with open(partial, "wb") as f:
    np.savez(f, **tree)
  os.replace(partial, path)


def restore_checkpoint(path: Union[str, os.PathLike], pipeline: Any
                       ) -> CacheState:
  """Reads a state written by :func:`save_checkpoint` into ``pipeline``.

  The pipeline is built as the saved one was (same loader data, batch and
  cache sizes); its chains are registered anew.

  Raises:
    ValueError: the checkpoint's version or fingerprints differ from this
      pipeline's; the message shows both sides.
  """
  with np.load(os.fspath(path)) as data:
    tree = {k: data[k] for k in data.files}
  return state_from_pytree(pipeline, tree)
