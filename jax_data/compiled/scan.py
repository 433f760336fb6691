"""A sampler loop over random mini-batches: :func:`scan`.

``lax.scan`` with ``batch_fn`` in its body checks at every step whether the
cache must be refreshed and slices the step's batch out of the cache that
the scan carries. :func:`scan` gives the same batches and the same final
state, but runs an outer loop over chunks and an inner ``lax.scan`` over
each chunk's batches: the inner steps take their batch as the scanned
element, with no test, no slice and no cache in their carry. Only the
batches before the state's first chunk boundary and after the last one
are served step by step.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Optional
from typing import Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.sharding import PartitionSpec as P

from jax_data.compiled import pipeline as pl
from jax_data.compiled import states
from jax_data.compiled.one_lane import batched_here
from jax_data.compiled.one_lane import names_axes
from jax_data.compiled.one_lane import unbatched_at_one
from jax_data.compiled.pass_loop import cast_varying
from jax_data.compiled.pass_loop import pair
from jax_data.compiled.pass_loop import varying_axes
from jax_data.types import CacheState
from jax_data.types import MiniBatchInformation
from jax_data.types import PyTree
from jax_data.validation import MAX_AXIS
from jax_data.validation import check_bool
from jax_data.validation import check_int
from jax_data.validation import check_jax_values


def scan(f: Callable[[PyTree, Any], Tuple[PyTree, PyTree]], init: PyTree,
         state: CacheState, *, batch_fn: Callable, xs: Optional[PyTree] = None,
         length: Optional[int] = None, information: bool = False,
         device_count: int = 1) -> Tuple[Tuple[PyTree, CacheState], PyTree]:
  """``lax.scan`` over the next ``length`` mini-batches of a data state.

  The same as a ``lax.scan`` whose body calls ``batch_fn`` once per step,
  batch for batch and state for state, but faster: the batches of each
  cached chunk are scanned over as the scan's elements, so a step pays
  neither the refresh test nor a slice out of the cache.

  >>> import numpy as np
  >>> import jax
  >>> import jax.numpy as jnp
  >>> import jax_data
  >>> loader = jax_data.NumpyDataLoader(x=np.arange(100.0))
  >>> init_fn, batch_fn, release_fn = jax_data.random_reference_data(
  ...     loader, cached_batches_count=10, mb_size=4)
  >>> def step(total, batch):
  ...   return total + jnp.sum(batch["x"]), jnp.max(batch["x"])
  >>> @jax.jit
  ... def run(total, state):
  ...   return jax_data.scan(step, total, state, batch_fn=batch_fn,
  ...                        length=25)
  >>> (total, state), maxima = run(0.0, init_fn(seed=0))
  >>> maxima.shape, int(state.chunk), int(state.position)
  ((25,), 2, 5)
  >>> release_fn()

  Args:
    f: ``f(carry, batch) -> (carry, y)``; with ``xs``,
      ``f(carry, (batch, x))``. With ``information=True`` the batch is
      ``(batch, MiniBatchInformation)``, as ``batch_fn`` returns it.
    init: The initial carry.
    state: The data state (from ``init_fn``, ``batch_fn`` or a checkpoint).
    batch_fn: The ``batch_fn`` of a :func:`random_reference_data` pipeline.
    xs: Optional per-step inputs with leading axis ``length``.
    length: Steps; taken from ``xs`` when omitted.
    information: Pass ``MiniBatchInformation`` (with the validity mask of
      epoch-ending batches) along with each batch.
    device_count: As for ``batch_fn``, inside ``pmap`` over several devices.

  Returns:
    ``((carry, state), ys)``: the final carry, the data state after the
    last step, and the stacked ``y`` of each step. The state is at the
    position ``length`` calls of ``batch_fn`` leave, and gives the same
    batches from there on; when it ends on a chunk boundary its cache is
    marked empty (``cached_chunk=-1``) instead of holding the last chunk.

  Call it inside ``jax.jit``, as the example does: outside, its loops are
  built and compiled again on every call (about 0.2 s on a small CPU
  machine), where an eager ``lax.scan`` compiles once per step function.
  An eager call keeps the position known, which reverse mode needs (below),
  and so does a state that the jitted function closes over instead of
  taking it as an argument.

  Where the state's position is a traced value a host loader's loops run
  for a number of steps only known at run time, so reverse-mode
  differentiation (``jax.grad``, ``jax.vjp``) through ``scan`` is not
  supported, as for ``lax.fori_loop`` with dynamic bounds; nor is it under
  a ``jax.vmap`` over states, for any loader: differentiate through a
  ``lax.scan`` whose body calls ``batch_fn`` instead.
  (``DeviceNumpyDataLoader``'s loops are scans of a fixed length, which
  ``jax.grad`` goes through under ``jax.jit`` too.) Forward-mode
  (``jax.jvp``) and ``f``'s own gradients inside the steps (a sampler's
  gradient of its log-density) work.

  Under ``jax.vmap`` over a batch of one chain, the chain's own program
  runs, without the batch axis (:mod:`jax_data.compiled.one_lane`: XLA's
  CPU program for a vmap of one took 1.26x the chain's time alone), unless
  ``f`` names a mapped axis (``lax.psum`` over the vmap's ``axis_name``).
  A step with a collective over a named axis, or an effect (an
  ``io_callback``, a ``jax.debug.print`` or callback), runs as that
  ``lax.scan`` over ``batch_fn``, every lane at the same step
  (:func:`in_lockstep`): no step runs that the ``lax.scan`` would not.
  Outside ``jax.vmap``, and under a ``vmap`` applied to a program traced
  first (a ``vmap`` of a jitted or checkified function), the loops run as
  they are, so that ``checkify`` sees into the steps. Inside ``shard_map``
  over states that vary over the mesh, the carry comes back varying over
  the same axes (each device's chains reach their chunk boundaries at
  their own steps).

  Raises:
    TypeError, ValueError: bad arguments, named with their values.
  """
  try:
    pipeline = pl.of(batch_fn) if callable(batch_fn) else None
  except TypeError:
    pipeline = None
  # The pipeline itself, or its init_fn or release_fn, are not batch_fn.
  if getattr(batch_fn, "__name__", None) != "batch_fn":
    pipeline = None
  if not isinstance(pipeline, pl.RandomPipeline):
    of_kind = ("" if pipeline is None else
               f"got the functions of a {pipeline.kind!r} pipeline: ")
    raise TypeError(
        "batch_fn must be the batch_fn of a random_reference_data pipeline, "
        f"{of_kind or 'got '}batch_fn={batch_fn!r}")
  if not callable(f):
    raise TypeError(f"f must be callable, got f={f!r}")
  information = check_bool("information", information)
  device_count = check_int("device_count", device_count, minimum=1)
  check_jax_values("xs", xs)
  length = _check_length(xs, length)
  check_jax_values("init", init)
  state = pipeline.check_state(state, "scan")
  pipeline.check_open()
  def loop(init, state, xs):
    return pipeline.scan_batches(f, init, state, xs, length, information,
                                 device_count)

  if (not isinstance(state.position, jax.core.Tracer)
      or not batched_here(init, state, xs)):
    # Run as it is where the position is known (the loops are then scans,
    # which reverse-mode differentiation goes through; a vmap over init
    # alone keeps it known), and outside a vmap (a vmap of one is what the
    # one-lane program is for), so that checkify sees into the steps.
    return loop(init, state, xs)
  return unbatched_at_one(loop, init, state, xs)


def _check_length(xs: Optional[PyTree], length: Any) -> int:
  """The number of steps, from ``length`` or the leading axis of ``xs``."""
  leading = {jnp.shape(x)[0] if jnp.ndim(x) else None
             for x in jax.tree_util.tree_leaves(xs)}
  if None in leading or len(leading) > 1:
    scalars = (" (a list of numbers is a pytree of scalars to JAX: give "
               "jnp.asarray(xs))" if None in leading else "")
    raise ValueError(
        "xs must be arrays with one common leading axis, got leading axes "
        f"{sorted(leading, key=str)} of xs={xs!r:.200}{scalars}")
  if length is None:
    if not leading:
      raise ValueError(
          "scan needs length when xs is None or holds no arrays, got "
          f"xs={xs!r}, length=None")
    return leading.pop()
  length = check_int("length", length, minimum=0, maximum=MAX_AXIS)
  if leading and leading != {length}:
    raise ValueError(
        f"length={length} differs from the leading axis {leading.pop()} of xs")
  return length


@custom_vmap
def any_lane(x: jax.Array) -> jax.Array:
  """``x``; under ``vmap``, whether ``x`` holds in any lane (of every
  enclosing ``vmap``), unbatched: the predicate of a ``lax.cond`` that
  stays a ``lax.cond`` instead of running both branches for all lanes."""
  return x


@any_lane.def_vmap
def _any_lane_rule(axis_size, in_batched, x):
  del axis_size
  return (any_lane(jnp.any(x)) if in_batched[0] else x), False


@custom_vmap
def max_lane(x: jax.Array) -> jax.Array:
  """``x``; under ``vmap``, its largest value over the lanes (of every
  enclosing ``vmap``), unbatched: the length of a loop that runs as one
  loop for all lanes, where a per-lane length makes ``vmap`` select every
  part of the loop's carry between its new and old values at every
  iteration."""
  return x


@max_lane.def_vmap
def _max_lane_rule(axis_size, in_batched, x):
  del axis_size
  # initial=0: no lanes (a vmap over zero chains) have no whole chunks.
  return (max_lane(jnp.max(x, initial=0)) if in_batched[0] else x), False


@custom_vmap
def lanes_where(active: jax.Array) -> jax.Array:
  """True: an iteration of a loop that runs only where ``active`` runs
  always, outside ``vmap``; under ``vmap``, ``active``, for a select of
  the lanes whose results are kept. (A ``custom_vmap`` around the select
  itself broke ``jax.jvp``.)"""
  return jnp.ones_like(active)


@lanes_where.def_vmap
def _lanes_where_rule(axis_size, in_batched, active):
  del axis_size
  return active, in_batched[0]


def in_lockstep(closed: Any) -> bool:
  """Whether the steps of ``f`` (its ``closed`` jaxpr for one step) must run
  in the same loop iterations for every lane, as in a ``lax.scan`` that
  calls ``batch_fn``: a collective over a named axis (``lax.psum`` over a
  vmap's ``axis_name``, or over devices) adds the lanes' values of one
  step; an effect other than ``jax.debug``'s (an ``io_callback``) JAX
  refuses inside the ``lax.cond`` that a vmapped :func:`chunked_scan` runs
  its steps in; and a ``jax.debug`` callback or print would run for the
  steps on stale batches that lanes with none left run there (their
  results dropped, not their callbacks)."""
  return names_axes([closed.jaxpr]) or bool(closed.effects)


def promoted_carry(init: PyTree, returned: PyTree, fun: str = "f",
                   given_as: str = "init") -> PyTree:
  """``init`` with its weakly typed leaves (Python numbers) in the dtypes
  ``f`` returns for them, as ``lax.scan`` promotes them (``0`` for a sum
  of float32 batches, or ``0.0`` for one of float32 batches under x64);
  ``init`` itself if none changes. ``fun`` and ``given_as`` name the
  function and the argument ``init`` was given as (the full-data passes'
  ``fun`` and ``carry``).

  Raises:
    TypeError: ``f`` returns a carry of another structure, or a leaf of
      another shape, or of another dtype where ``init``'s is not weak.
  """
  paths, tree = jax.tree_util.tree_flatten_with_path(init)
  formats, returned_tree = jax.tree_util.tree_flatten_with_path(returned)
  if tree != returned_tree:
    difference = _first_difference(paths, formats, fun, given_as)
    raise TypeError(
        f"{fun} must return a carry of {given_as}'s structure: {given_as} "
        f"is {tree}, {fun} returned {returned_tree}{difference}")
  out, changed = [], False
  for (path, leaf), (_, format) in zip(paths, formats):
    given = jax.typeof(leaf)
    if given.shape != format.shape or (
        given.dtype != format.dtype and not given.weak_type):
      raise TypeError(
          f"{fun} must return a carry of {given_as}'s shapes and dtypes: "
          f"{given_as}{jax.tree_util.keystr(path)} is {given.str_short()}, "
          f"{fun} returned "
          f"{jax.typeof(jnp.zeros(format.shape, format.dtype)).str_short()}"
          " for it")
    if given.weak_type and given.dtype != format.dtype:
      # as lax.scan's _promote_weak_typed_input (a weak leaf f returns in
      # its dtype, strong, stays: see weak_in_steps)
      dtype = (jnp.promote_types(given.dtype, format.dtype)
               if getattr(format, "weak_type", False) else format.dtype)
      leaf, changed = lax.convert_element_type(leaf, dtype), True
    out.append(leaf)
  return jax.tree_util.tree_unflatten(tree, out) if changed else init


def weak_in_steps(f: Callable, init: PyTree, returned: PyTree
                  ) -> Tuple[Callable, PyTree]:
  """``f`` and ``init`` for loops of their own that match ``lax.scan``'s:
  a weakly typed leaf of ``init`` (a Python number) that ``f`` returns in
  the same dtype but strong, ``lax.scan`` traces ``f`` with once, weak, and
  its steps' ``y`` follow (``c * bfloat16(1)`` is a bfloat16). The loops
  here trace ``f`` again after a carry has been through one, strong: so
  ``f`` is given such leaves weak again, and ``init`` has them strong, as
  the loops carry them. ``(f, init)`` themselves where no leaf is so.
  """
  leaves, tree = jax.tree_util.tree_flatten(init)
  formats = jax.tree_util.tree_leaves(returned)
  weak = [jax.typeof(leaf).weak_type and not getattr(s, "weak_type", False)
          for leaf, s in zip(leaves, formats)]
  if not any(weak):
    return f, init

  def weakened(carry):
    # A weak type's dtype is its kind's default, a Python zero's; a
    # dynamic update keeps the buffer's weak type.
    return jax.tree_util.tree_unflatten(tree, [
        lax.full(jnp.shape(a), jnp.result_type(a).type(0).item()).at[
            ...].set(a) if w else a
        for a, w in zip(jax.tree_util.tree_leaves(carry), weak)])

  strong = jax.tree_util.tree_unflatten(tree, [
      lax.convert_element_type(a, jnp.result_type(a)) if w else a
      for a, w in zip(leaves, weak)])
  return lambda carry, item: f(weakened(carry), item), strong


def _first_difference(given: list, returned: list, fun: str,
                      given_as: str) -> str:
  """Where two flattened carries' leaf paths first differ, as the end of
  a message ("" if only their nodes differ, e.g. a NamedTuple's type)."""
  keystr = lambda path: jax.tree_util.keystr(path) or "the root"
  for (a, _), (b, _) in zip(given, returned):
    if a != b:
      return (f"; {given_as} has a leaf at {keystr(a)}, {fun} returned one "
              f"at {keystr(b)}")
  shared = min(len(given), len(returned))
  if len(given) != len(returned):
    longer, name = ((given, given_as) if len(given) > shared
                    else (returned, f"{fun}'s carry"))
    return (f"; {name} has {len(longer) - shared} more leaves, the "
            f"first at {keystr(longer[shared][0])}")
  return ""


def _stacked(sharding: Any) -> Any:
  """The sharding of the steps' ``y`` of ``sharding`` stacked along a new
  leading axis, where ``y`` is typed by its sharding (explicit mesh axes,
  ``jax.make_mesh``'s default: the buffer written must be sharded alike);
  else ``None``."""
  spec = getattr(sharding, "spec", None)
  if spec is None or not any(
      kind == jax.sharding.AxisType.Explicit
      for kind in getattr(sharding.mesh, "axis_types", ())):
    return None
  return jax.sharding.NamedSharding(sharding.mesh, P(None, *spec))


def chunked_scan(f, init, state: CacheState, xs, length: int,
                 information: bool, device_count: int, *, fetch, refresh,
                 observation_count: int, mb_size: int, plain,
                 fetch_steps=None):
  """The scan of :func:`scan` over a pipeline with a device cache.

  The steps fall in three parts: the rest of the chunk the state is inside
  (when its position is not 0), whole chunks, and the first batches of one
  more chunk. Whole chunks are scanned over; the other steps read their
  batch out of the cache, as ``batch_fn`` does. The first and last parts
  run only where a lane has steps in them: a call from a chunk boundary
  over whole chunks leaves the cache untouched, where a refresh that kept
  the cache made XLA copy it twice per call (3 of a 100-step call's 7.5 ms
  at 16 chains of case (g)).

  Args:
    fetch: ``fetch(state, chunk, need) -> (batches, mask, state)``:
      chunk ``chunk`` of the state's chain where ``need`` (else batches
      not to be used), and the state, whose cache's buffers it may have
      written the chunk into (the loop over whole chunks carries them on
      and leaves the cache marked empty): the caches themselves, where a
      fresh chunk-sized buffer per call took as much memory again (1,024
      vmapped chains: 83 MiB more) and was faulted in at every call.
    refresh: ``refresh(state) -> state`` whose cache holds
      ``state.chunk``.
    fetch_steps: Optional ``fetch_steps(state, chunk, need) -> [(batch,
      mask)]``: chunk ``chunk`` with each batch in buffers of its own.
      Given, each whole chunk's steps are unrolled over them, not scanned
      over one chunk's buffer (whose batch XLA copies out every step), and
      the cache is left as it is.
    observation_count, mb_size: For ``MiniBatchInformation``.
    plain: ``plain() -> ((carry, state), ys)``: the loop of a ``lax.scan``
      that calls ``batch_fn``, for steps that run in lockstep
      (:func:`in_lockstep`). The chunked loops split each lane's steps at
      its own chunk boundaries, so lanes at different positions run
      different steps in one iteration, and lanes with none left run
      ``f`` on stale batches whose results are dropped: a step that adds
      up the lanes got the sum of misaligned steps.
  """
  cache_size = jnp.shape(state.mask)[0]

  def item(batch, mask, x):
    if information:
      batch = (batch, MiniBatchInformation(
          observation_count=observation_count, mask=mask, batch_size=mb_size))
    return batch if xs is None else (batch, x)

  def x_at(step):
    return jax.tree_util.tree_map(
        lambda a: lax.dynamic_index_in_dim(a, step, keepdims=False), xs)

  batch0, mask0 = states.batch_at(state.batches, state.mask, 0)
  # Also for xs of no rows; weakly typed xs (jnp.full(n, 0.1)) give f weak
  # elements, as lax.scan's do, which a carry of bfloat16 stays bfloat16 by.
  x0 = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a),
                                     weak_type=jax.typeof(a).weak_type),
      xs)
  def trace(init):
    # The information is made inside, as the loops make it: its counts
    # stay Python ints (jnp.ones(info.batch_size) in a step), not tracers.
    closed, returned = jax.make_jaxpr(
        lambda c, b, m, x: pair("f", f, f(c, item(b, m, x)), "(carry, y)",
                                ("the carry", "y")),
        return_shape=True)(init, batch0, mask0, x0)
    return (closed,) + tuple(returned)

  closed, carry_format, y_format = trace(init)
  if in_lockstep(closed):
    return plain()  # a lax.scan, which promotes init as below itself
  promoted = promoted_carry(init, carry_format)
  if promoted is not init:
    init = promoted
    closed, carry_format, y_format = trace(init)
    promoted_carry(init, carry_format)
  f, init = weak_in_steps(f, init, carry_format)
  # Inside shard_map the outputs vary over the mesh axes the inputs vary
  # over: so must the buffer they are written into, a loop carry.
  axes = tuple(sorted(varying_axes((init, state, xs))))

  def zeros(s):
    buffer = jnp.zeros((length,) + s.shape, s.dtype,
                       out_sharding=_stacked(getattr(s, "sharding", None)))
    return lax.pcast(buffer, axes, to="varying") if axes else buffer

  def weak(a, s):
    # lax.scan's ys keep a y's weak type (a y of Python numbers), and so
    # promote as it does; a dynamic update makes a buffer strong. A weak
    # type's dtype is its kind's default, a Python zero's.
    if not getattr(s, "weak_type", False):
      return a
    buffer = lax.full(a.shape, s.dtype.type(0).item(), sharding=_stacked(
        getattr(s, "sharding", None)))
    buffer = lax.pcast(buffer, axes, to="varying") if axes else buffer
    return buffer.at[...].set(a)

  ys = jax.tree_util.tree_map(zeros, y_format)
  if length == 0:
    return (init, state), jax.tree_util.tree_map(weak, ys, y_format)

  def put(ys, y, step):
    return jax.tree_util.tree_map(
        lambda a, v: lax.dynamic_update_index_in_dim(a, v, step, 0), ys, y)

  def one_by_one(carry, ys, batches, mask, first, step, count):
    """``count`` steps from cache position ``first``, from scan step
    ``step`` on."""
    def body(i, loop):
      carry, ys = loop
      batch, batch_mask = states.batch_at(batches, mask, first + i)
      carry, y = f(carry, item(batch, batch_mask, x_at(step + i)))
      return carry, put(ys, y, step + i)

    return lax.fori_loop(0, count, body, (carry, ys))

  def refresh_if(want, state):
    """``refresh(state)`` where ``want``, else ``state``: not a ``lax.cond``
    on ``want``, which under ``vmap`` (a per-chain ``want``) would run the
    refresh for every chain, chunks fetched for nothing included, and then
    select between two copies of the caches. A lane that does not want it
    asks for the chunk its cache holds, which fetches nothing."""
    held = jnp.maximum(state.cached_chunk, 0)
    asked = state._replace(chunk=jnp.where(want, state.chunk, held),
                           cached_chunk=jnp.where(want, state.cached_chunk,
                                                  held))
    done = refresh(asked)
    return done._replace(chunk=state.chunk, cached_chunk=jnp.where(
        want, done.cached_chunk, state.cached_chunk))

  def part(carry, ys, state, first, step, count):
    """``count`` steps of the chunk the state points at, from cache
    position ``first`` and scan step ``step`` on, its cache refreshed
    first where ``count > 0``: all inside a ``lax.cond`` on any lane
    having steps (an unbatched predicate under ``vmap``), so that when
    none has, the cache goes through untouched."""
    def run(loop):
      carry, ys, state = loop
      state = refresh_if(count > 0, state)
      carry, ys = one_by_one(carry, ys, state.batches, state.mask, first,
                             step, count)
      return carry, ys, state

    return lax.cond(any_lane(count > 0), run, lambda loop: loop,
                    (carry, ys, state))

  position = state.position
  if isinstance(position, jax.core.Tracer):
    head = jnp.where(position > 0, jnp.minimum(cache_size - position, length),
                     0)
  else:
    # A known position (an eager call, or a state closed over) keeps the
    # loops' bounds Python ints under jit and jax.checkpoint as well: the
    # loops are then scans, which reverse mode goes through (jnp's values
    # of it would be traced there).
    known = int(position)
    head = min(cache_size - known, length) if known > 0 else 0
  # The rest of the current chunk (a state inside one).
  carry, ys, state = part(init, ys, state, position, 0, head)
  chunk = jnp.where(head > 0, state.chunk + 1, state.chunk)
  rest = length - head
  whole, tail = rest // cache_size, rest % cache_size

  # Under a vmap of per-lane positions the loop runs for the lane with the
  # most whole chunks (max_lane); the others fetch nothing and keep their
  # carry (lanes_where), as a vmapped loop of per-lane lengths keeps it, but
  # for the caches' buffers, which every lane carries on unselected (their
  # contents are spent): a vmapped loop selected the caches too, so XLA
  # copied them first. Both resolve at a vmap applied later as well (see
  # unbatched_at_one); a known position (reverse mode) needs neither.
  lanes_vary = isinstance(whole, jax.core.Tracer)

  def by_step(carry, spent, j, active, step):
    """Chunk ``chunk + j``'s steps, unrolled over a buffer per step."""
    new_carry, chunk_ys = carry, []
    for k, (batch, mask) in enumerate(fetch_steps(spent, chunk + j, active)):
      new_carry, y = f(new_carry, item(batch, mask, None if xs is None
                                       else x_at(step + k)))
      chunk_ys.append(y)
    return new_carry, jax.tree_util.tree_map(lambda *v: jnp.stack(v),
                                             *chunk_ys)

  def over_chunk(j, loop):
    carry, ys, spent = loop
    active = j < whole
    step = head + j * cache_size
    if fetch_steps is not None:
      new_carry, chunk_ys = by_step(carry, spent, j, active, step)
      return finish_chunk(carry, ys, spent, active, step, new_carry,
                          chunk_ys)
    batches, mask, spent = fetch(spent, chunk + j, active)
    # The mask only goes along when f is given it.
    scanned = (batches, mask if information else None)
    if xs is not None:
      scanned += (jax.tree_util.tree_map(
          lambda a: lax.dynamic_slice_in_dim(a, step, cache_size), xs),)

    def inner(carry, scanned):
      return f(carry, item(*scanned[:2], scanned[2] if xs is not None
                           else None))

    new_carry, chunk_ys = lax.scan(inner, carry, scanned)
    return finish_chunk(carry, ys, spent, active, step, new_carry, chunk_ys)

  def finish_chunk(carry, ys, spent, active, step, new_carry, chunk_ys):
    new_ys = jax.tree_util.tree_map(
        lambda a, v: lax.dynamic_update_slice_in_dim(a, v, step, 0), ys,
        chunk_ys)
    if lanes_vary:
      kept = lanes_where(active)
      new_carry, new_ys = jax.tree_util.tree_map(
          lambda a, b: jnp.where(kept, a, b), (new_carry, new_ys),
          (carry, ys))
    return new_carry, new_ys, spent

  # The cache goes on holding the chunk of the head; after whole chunks
  # (whose batches are not kept: the next step starts a new chunk, which
  # batch_fn fetches anyway) it holds none.
  last = jnp.where(head > 0, state.chunk, state.cached_chunk)
  if length >= cache_size:  # else no whole chunk fits
    if lanes_vary:
      # Inside shard_map, lanes_where's select makes the carry vary over
      # the mesh axes the positions vary over: so must the loop's first.
      vary = varying_axes(whole)
      carry = jax.tree_util.tree_map(lambda a: cast_varying(a, vary), carry)
    carry, ys, state = lax.fori_loop(
        0, max_lane(whole) if lanes_vary else whole, over_chunk,
        (carry, ys, state))
    last = jnp.where(whole > 0, -1, last)

  # The first batches of one more chunk.
  tail_state = state._replace(chunk=chunk + whole, position=jnp.int32(0),
                              cached_chunk=last)
  carry, ys, tail_state = part(carry, ys, tail_state, 0,
                               head + whole * cache_size, tail)
  # Where length steps leave the state (its cache: the tail's chunk).
  final = states.advanced(state, length, cache_size)
  final = tail_state._replace(chunk=final.chunk, position=final.position)
  return (carry, final), jax.tree_util.tree_map(weak, ys, y_format)
