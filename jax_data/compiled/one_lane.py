"""A vmap over a batch of one that runs the unbatched program.

On CPU, XLA compiles a loop vmapped over a batch of one differently from
the same loop without ``vmap``: a chain's :func:`jax_data.scan` under a
``vmap`` of one took 1.26x its time alone (``benchmarks/vmap_one.py``),
although the two compute the same values. :func:`unbatched_at_one` runs a
function so that ``vmap`` with a batch of one drops the batch axis of its
inputs, runs the function's own program and puts the axis back on its
outputs; batches of other sizes are vmapped as usual.

The function is traced once, to a jaxpr whose constants (values the
function closes over, per-chain ones included) become inputs. A function
that names a mapped axis (``lax.psum(x, "chains")`` over the vmap's
``axis_name``, ``lax.axis_index``, or collectives of ``pmap`` and
``shard_map``) is called as it is: dropping the batch axis would unbind
its name.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Iterable
from typing import List

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

_AXIS_PARAMS = ("axes", "axis_name")


def unbatched_at_one(fn: Callable[..., Any], *args: Any) -> Any:
  """``fn(*args)``; under a ``vmap`` over a batch of one, ``fn``'s program
  without the batch axis.

  >>> import jax, jax.numpy as jnp
  >>> jax.vmap(lambda x: unbatched_at_one(jnp.sin, x))(jnp.ones(1)).shape
  (1,)
  """
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  if names_axes([closed.jaxpr]):
    return fn(*args)
  flat = jax.tree_util.tree_leaves(args)
  consts = list(closed.consts)
  count = len(consts)

  def call(inputs: List[Any]) -> List[Any]:
    return jax.core.eval_jaxpr(closed.jaxpr, inputs[:count], *inputs[count:])

  wrapped = custom_vmap(call)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, inputs):
    in_batched = in_batched[0]
    if not any(in_batched):
      outs = call(inputs)
      return outs, [False] * len(outs)
    if axis_size == 1:
      outs = call([x[0] if b else x for x, b in zip(inputs, in_batched)])
      # An output passed through unchanged may be a Python number (a
      # literal of the jaxpr): an array first.
      return [jnp.asarray(out)[None] for out in outs], [True] * len(outs)
    axes = [0 if b else None for b in in_batched]
    outs = jax.vmap(call, in_axes=(axes,))(inputs)
    return outs, [True] * len(outs)

  outs = wrapped(consts + flat)
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape),
                                      outs)


def batched_here(*trees: Any) -> bool:
  """Whether a leaf of ``trees`` is batched by a ``vmap`` traced around
  this call now.

  Not by one applied later to a program traced here (a ``vmap`` of a
  jitted function, or of a function that ``checkify`` or ``lax.scan``
  traced first): only a ``vmap`` around the call resolves a
  ``custom_vmap`` at once. :func:`unbatched_at_one` is left to those, so
  that a program traced without ``vmap`` holds no ``custom_vmap`` that
  other transformations cannot look into (``checkify`` cannot).
  """
  tracers = [leaf for leaf in jax.tree_util.tree_leaves(trees)
             if isinstance(leaf, jax.core.Tracer)]
  if not tracers:
    return False
  seen = []
  probe = custom_vmap(lambda leaves: leaves)

  @probe.def_vmap
  def _rule(axis_size, in_batched, leaves):
    del axis_size
    seen.append(True)
    return leaves, in_batched[0]

  probe(jax.lax.stop_gradient(tracers))  # its output is not used
  return bool(seen)


def names_axes(jaxprs: Iterable[Any]) -> bool:
  """Whether an equation of ``jaxprs`` (or of the jaxprs inside them)
  names a mapped axis: a parameter ``axes`` or ``axis_name`` that holds
  something other than positional (int) axes."""
  for jaxpr in jaxprs:
    for eqn in jaxpr.eqns:
      for key in _AXIS_PARAMS:
        value = eqn.params.get(key)
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(v is not None and not isinstance(v, int) for v in values):
          return True
      if names_axes(jex.jaxprs_in_params(eqn.params)):
        return True
  return False
