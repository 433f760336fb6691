"""Keys of compiled full-data passes, and the cache that holds them.

A full-data pipeline compiles one pass per function it maps. A pass must
never compute with values of an earlier call, so it is keyed by what the
traced function does (:class:`Traced`: its jaxpr, with the host callbacks it
makes and its custom differentiation rules keyed by the functions they
call, :func:`value_key`), not by the function object; the arrays it reads
become arguments. :class:`Recent` keeps the most recently used passes.
"""

from __future__ import annotations

import copy
import functools
import re
import struct
import types
import weakref
from typing import Any
from typing import Callable

import jax
import numpy as np
from jax.extend import core as jax_core

from jax_data.types import PyTree

# Compiled passes a full-data pipeline keeps, one per function mapped.
MAX_COMPILED = 16


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class _Same:
  """Equal only to a wrapper of the same object (held, so its ``id`` is not
  reused while a key holds it): for objects whose text hides their state."""

  __slots__ = ("obj",)

  def __init__(self, obj: Any):
    self.obj = obj

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _Same) and other.obj is self.obj

  def __hash__(self) -> int:
    return id(self.obj)


# Values that act alike when equal: kept in a key by value.
_BY_VALUE = (type(None), bool, int, float, complex, str, bytes, np.dtype,
             jax.tree_util.PyTreeDef)
# How deep the functions a callback's closure holds are followed.
_DEPTH = 4


def value_key(value: Any, depth: int = _DEPTH, captured: bool = False,
              traced: bool = False) -> Any:
  """A key equal for values a host function cannot tell apart: equal
  numbers, strings and tuples and small dicts of them; functions of the
  same code over the same closure; otherwise the same object (an array, a
  list or a model is read when the callback runs, through the object).
  ``captured``: ``value`` is bound by a function of the user's (not
  JAX's: :func:`_users`), in its closure, defaults or a
  ``functools.partial``, where a dict is read when the callback runs (and
  may change between calls), so the same object. ``traced``: ``value`` is
  a custom rule's, or reached from one, read when the rule is traced (once
  per pass), not when it runs: an object is keyed by its attributes and a
  function by the globals its code names, so that a changed
  ``self.scale`` or module global makes another pass."""
  if isinstance(value, (float, complex)):
    # By their bits: 0.0 == -0.0, but a host function tells them apart.
    return (type(value), struct.pack("<dd", value.real, value.imag))
  if isinstance(value, _BY_VALUE):
    return (type(value), value)
  if isinstance(value, tuple):
    return tuple(value_key(v, depth, captured, traced) for v in value)
  if (not captured and isinstance(value, dict) and len(value) <= 64 and all(
      isinstance(v, _BY_VALUE) for v in value.values())):
    # Options built anew on each trace and bound as arguments (JAX's print
    # options, a callback's static arguments), read as they were then.
    return (dict, tuple(sorted((repr(k), value_key(v))
                               for k, v in value.items())))
  if depth > 0 and isinstance(value, types.MethodType):
    # A new bound method on every attribute access: its function, and the
    # object itself, whose attributes are read when it is called.
    return (types.MethodType,
            value_key(value.__func__, depth - 1, traced=traced),
            value_key(value.__self__, depth - 1, True, traced))
  if depth > 0 and isinstance(value, functools.partial):
    users = _users(value.func)
    return (functools.partial, value_key(value.func, depth - 1,
                                         traced=traced),
            value_key(value.args, depth - 1, users, traced),
            value_key(tuple(sorted(value.keywords.items())), depth - 1,
                      users, traced))
  if depth > 0 and isinstance(value, types.FunctionType):
    # JAX wraps a callback in a new function on every trace, and user code
    # often passes a new lambda: what it calls is its code and closure.
    cells = []
    # JAX's wrappers close over what each trace builds anew (a dict of
    # static arguments); the user's functions over what they read later.
    users = _users(value)
    for cell in value.__closure__ or ():
      try:
        cells.append(value_key(cell.cell_contents, depth - 1, users,
                               traced))
      except ValueError:  # an empty cell
        cells.append(None)
    named = (tuple((name, value_key(value.__globals__[name], depth - 1, True,
                                    traced))
                   for name in value.__code__.co_names
                   if name in value.__globals__)
             if traced and users else ())  # JAX's own read no settings
    return (value.__code__, tuple(cells),
            value_key(value.__defaults__, depth - 1, users, traced),
            _Same(value.__kwdefaults__) if value.__kwdefaults__ else None,
            _Same(value.__globals__), named)
  attributes = getattr(value, "__dict__", None) if traced else None
  if (depth > 0 and attributes and len(attributes) <= 64
      and not isinstance(value, (type, types.ModuleType))):
    # An object a rule reads attributes of when it is traced.
    return (_Same(value), tuple(sorted(
        (name, value_key(v, depth - 1, True, traced))
        for name, v in attributes.items())))
  return _Same(value)


def _users(function: Any) -> bool:
  """Whether ``function`` is the user's, not one of JAX's wrappers (which
  bind what each trace builds anew: print options, a dict of static
  arguments), so that the values it binds are read when it runs."""
  return not (getattr(function, "__module__", None) or "").startswith(
      "jax.")


# Parameters of ``custom_jvp_call`` and ``custom_vjp_call`` that hold the
# rules, which JAX traces only when the pass is differentiated.
_RULES = ("jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd")


def callbacks(jaxpr: Any) -> list:
  """The keys of the host callbacks of ``jaxpr`` and of its inner jaxprs,
  and of its custom differentiation rules, in order. A jaxpr's text shows a
  callback only by its address, and the function it calls may read values
  captured when ``fun`` was traced; it names a custom rule only by its
  name, and a rule closes over values of the trace (``jax.custom_vjp`` made
  in ``fun``) that its gradient is computed with."""
  keys = []
  for eqn in jaxpr.eqns:
    if "callback" in eqn.params:
      callback = eqn.params["callback"]
      keys.append(value_key(getattr(callback, "callback_func", callback)))
    for name in _RULES:
      if name in eqn.params:
        keys.append((name, tuple(rules(eqn.params[name]))))
    if "rule" in eqn.params:  # custom_vmap's, which batching calls
      rule = eqn.params["rule"]
      keys.append(("rule", value_key(getattr(rule, "rule", rule))))
    # Arrays a jaxpr's text does not show: an inner jit's closed-over
    # constants, and literals that are not scalars (JAX's simplified
    # constants print them as [...]).
    literals = [v.val for v in eqn.invars if isinstance(v, jax_core.Literal)
                and np.ndim(v.val) > 0]
    if literals:
      keys.append(("literals", tuple(const_key(c) for c in literals)))
    for param in eqn.params.values():
      for inner in closed_jaxprs(param):
        if inner.consts:
          keys.append(("consts", tuple(const_key(c) for c in inner.consts)))
      for inner in jaxprs(param):
        keys.extend(callbacks(inner))
  return keys


# Constants up to this many bytes are keyed by their values (a few model
# parameters, read again on every call); larger ones by the array itself.
_CONST_BYTES = 4096


def const_key(const: Any) -> Any:
  """A key of an array a compiled pass holds as a constant (an inner
  ``jax.jit``'s closed-over parameters): equal for equal small arrays,
  else only for the same array, held weakly, so that a key does not keep
  a sampler's parameters alive."""
  if isinstance(const, jax.core.Tracer):
    return object()  # an enclosing trace's value: this call's alone
  try:
    dtype = np.dtype(const.dtype)
  except (AttributeError, TypeError):  # a typed PRNG key array, ...
    return _SameLive(const)
  if np.size(const) * dtype.itemsize <= _CONST_BYTES:
    return (str(dtype), np.shape(const), np.asarray(const).tobytes())
  return _SameLive(const)


class _SameLive:
  """Equal only to a wrapper of the same object while it lives, held
  weakly (an object that cannot be referenced weakly is held)."""

  __slots__ = ("ref", "_id")

  def __init__(self, obj: Any):
    try:
      self.ref = weakref.ref(obj)
    except TypeError:
      self.ref = lambda obj=obj: obj
    self._id = id(obj)

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, _SameLive):
      return False
    mine = self.ref()
    return mine is not None and mine is other.ref()

  def __hash__(self) -> int:
    return self._id


def rules(wrapped: Any, depth: int = 2 * _DEPTH) -> list:
  """The keys of the functions a custom rule parameter wraps (the user's
  jvp, fwd or bwd): found through JAX's wrappers (``.f``) and the closures
  of JAX's own thunks, whose other contents (the trace, a memo) are new on
  every trace and say nothing of the rule."""
  if depth < 0:
    return []
  if hasattr(wrapped, "f") and hasattr(wrapped, "transforms"):
    return _static_args(wrapped.transforms) + rules(wrapped.f, depth - 1)
  if isinstance(wrapped, functools.partial):
    return rules(wrapped.func, depth - 1)
  if not isinstance(wrapped, types.FunctionType):
    return []
  if not (wrapped.__module__ or "").startswith("jax._src.interpreters"):
    return [value_key(wrapped, traced=True)]
  found = []
  for cell in wrapped.__closure__ or ():
    try:
      found.extend(rules(cell.cell_contents, depth - 1))
    except ValueError:  # an empty cell
      pass
  return found


def _static_args(transforms: Any, depth: int = 4) -> list:
  """The keys of the static arguments JAX binds to a rule through its
  wrappers' transforms (``custom_vjp``'s ``nondiff_argnums``, held as
  ``Unhashable`` or hashed by id): the rule is traced with them, so a
  gradient clipped at 0.25 is not the pass of one clipped at 0.5. The
  transforms' other contents (tree structures, avals) follow the jaxpr."""
  if depth < 0:
    return []
  if type(transforms).__name__ in ("Unhashable", "_HashableByObjectId"):
    return [value_key(getattr(transforms, "val", transforms), captured=True)]
  if isinstance(transforms, (tuple, list)):
    return [key for part in transforms
            for key in _static_args(part, depth - 1)]
  return []


def closed_jaxprs(param: Any) -> list:
  """The closed jaxprs in one equation parameter (one, or a tuple)."""
  if isinstance(param, jax_core.ClosedJaxpr):
    return [param]
  if isinstance(param, (tuple, list)):
    return [j for p in param for j in closed_jaxprs(p)]
  return []


def jaxprs(param: Any) -> list:
  """The jaxprs in one equation parameter (a jaxpr, or a tuple of them)."""
  if isinstance(param, jax_core.ClosedJaxpr):
    return [param.jaxpr]
  if isinstance(param, jax_core.Jaxpr):
    return [param]
  if isinstance(param, (tuple, list)):
    return [j for p in param for j in jaxprs(p)]
  return []


class Traced:
  """A mapped function traced for one batch: its jaxpr, without the arrays
  it read from closures, globals or attributes (``consts``), which a
  compiled pass takes as arguments. A pass is compiled once per jaxpr and
  the host functions its callbacks call (and its custom rules), so it
  never computes with values of an earlier call: new arrays are new
  arguments, other Python numbers another jaxpr, and a callback that calls
  a new function (say, a closure over this call's values) another pass.
  Functions that trace alike share a pass: a new lambda on every call
  compiles once."""

  def __init__(self, apply: Callable, carry: PyTree, batch: PyTree,
               mask: Any):
    # A new function object: JAX's caches keyed by the function never hand
    # back a trace of an earlier call.
    closed, shapes = jax.make_jaxpr(lambda c, bm: apply(c, bm),
                                    return_shape=True)(carry, (batch, mask))
    self.jaxpr = closed.jaxpr
    self.consts = list(closed.consts)
    self.out_tree = jax.tree_util.tree_structure(shapes)
    self.carry_shapes, self.result_shapes = shapes
    # Host callbacks print as the addresses of wrappers made by each trace;
    # they are keyed by the functions they call instead.
    # Not ``fun`` itself: a key must not hold what it closes over (this
    # call's arrays, or tracers of an enclosing jit), and a new but equal
    # lambda on every call is the same pass.
    self.key = (_ADDRESS.sub("", str(self.jaxpr)),
                tuple(callbacks(self.jaxpr)),
                jax.tree_util.tree_structure((carry, (batch, mask))),
                self.out_tree, tuple(jax.typeof(c) for c in self.consts))

  def lean(self) -> "Traced":
    """This trace without its ``consts``: what a compiled pass keeps, which
    must not hold the arrays of the call that compiled it (a sampler's
    parameters of its first step) until the pipeline is released."""
    lean = copy.copy(self)
    lean.consts = []
    return lean

  def apply(self, consts: list, carry: PyTree, batch_and_mask: Any):
    flat = jax.tree_util.tree_leaves((carry, batch_and_mask))
    out = jax.core.eval_jaxpr(self.jaxpr, consts, *flat)
    return jax.tree_util.tree_unflatten(self.out_tree, out)
