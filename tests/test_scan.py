"""jax_data.scan: the batches and states of a batch_fn loop, faster."""

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_data
from jax_data.compiled import random_access
from jax_data.serving.group_refresh import GroupRefresh
from jax_data.serving.host import Host


def _loop(batch_fn, f, init, state, xs, length, information=False):
  """The reference: lax.scan with batch_fn in its body."""
  def body(carry, x):
    carry, state = carry
    state, batch = batch_fn(state, information)
    carry, y = f(carry, batch if xs is None else (batch, x))
    return (carry, state), y
  return lax.scan(body, (init, state), xs, length=length)


def _both(batch_fn, f, init, length, chains, state, xs=None):
  """``jax_data.scan`` and its reference (:func:`_loop`) from ``init``
  over ``state`` (and ``xs``, the same for every chain), jitted, each
  vmapped over its chains unless ``chains`` is None."""
  run = lambda s: jax_data.scan(f, init, s, batch_fn=batch_fn, xs=xs,
                                length=length)
  want = lambda s: _loop(batch_fn, f, init, s, xs, length)
  if chains is not None:
    run, want = jax.vmap(run), jax.vmap(want)
  return jax.jit(run)(state), jax.jit(want)(state)


def _step(total, batch):
  return total + jnp.sum(batch["x"]), batch["x"]


def _same(a, b):
  for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _same_run(got, want):
  """Equal carries, batches and counters; the cache is equal too, or
  marked empty where the state ends on a chunk boundary."""
  (carry, state), ys = got
  (want_carry, want_state), want_ys = want
  _same((carry, ys), (want_carry, want_ys))
  for name in ("pipeline", "chain", "chunk", "position"):
    _same(getattr(state, name), getattr(want_state, name))
  empty = np.asarray(state.cached_chunk) == -1
  assert (empty <= (np.asarray(state.position) == 0)).all()
  if not empty.any():
    _same(state, want_state)


@pytest.fixture
def by_step(request, monkeypatch):
  """With ``True`` (the parameter), jax_data.scan unrolls whole chunks'
  steps over buffers of their own at every chain count; for each such
  request, whether a group's read served it (else the general way did)."""
  served = []
  if getattr(request, "param", True):
    monkeypatch.setattr(random_access, "STEP_BYTES", 0)
    original = Host.serve_steps_into
    grouped = GroupRefresh.serve_request

    def counted(self, *args, **kwargs):
      served.append(False)
      original(self, *args, **kwargs)

    def group(self, *args, by_step=False, **kwargs):
      done = grouped(self, *args, by_step=by_step, **kwargs)
      if by_step:
        served[-1] = done
      return done

    monkeypatch.setattr(Host, "serve_steps_into", counted)
    monkeypatch.setattr(GroupRefresh, "serve_request", group)
  return served


@pytest.fixture
def pipeline():
  loader = jax_data.NumpyDataLoader(x=np.arange(103), y=np.arange(103) % 7)
  pipeline = jax_data.random_reference_data(loader, 5, 4)
  yield pipeline
  pipeline.release_fn()


@pytest.mark.parametrize("skip", [0, 1, 4, 5, 7])
@pytest.mark.parametrize("length", [0, 1, 3, 5, 6, 13, 25])
def test_same_batches_and_state_as_batch_fn(pipeline, skip, length):
  init_fn, batch_fn, _ = pipeline
  state = init_fn(seed=3, shuffle=True)
  for _ in range(skip):
    state, _ = batch_fn(state)
  want = jax.jit(lambda s: _loop(batch_fn, _step, 0, s, None, length))(state)
  got = jax.jit(lambda s: jax_data.scan(_step, 0, s, batch_fn=batch_fn,
                                        length=length))(state)
  _same_run(got, want)
  # The state goes on exactly where the loop's would.
  _same(batch_fn(got[0][1]), batch_fn(want[0][1]))


@pytest.mark.parametrize("by_step", [False, True], indirect=True)
def test_xs_information_and_epoch_masks(pipeline, by_step):
  init_fn, batch_fn, _ = pipeline
  state = init_fn(seed=1, shuffle=True, in_epochs=True)
  state, _ = batch_fn(state)
  xs = jnp.arange(60.0)

  def f(carry, item):
    (batch, info), x = item
    # The counts are Python ints, as in the loop of batch_fn.
    mean = jnp.ones(info.batch_size) / float(info.observation_count)
    return carry + jnp.sum(batch["x"] * info.mask * mean) * x, info.mask

  want = _loop(batch_fn, f, 0.0, state, xs, None, information=True)
  got = jax.jit(lambda s, xs: jax_data.scan(
      f, 0.0, s, batch_fn=batch_fn, xs=xs, information=True))(state, xs)
  _same_run(got, want)
  vmapped = jax.jit(jax.vmap(lambda s: jax_data.scan(
      f, 0.0, s, batch_fn=batch_fn, xs=xs, information=True)))(
          init_fn(seed=[1, 2]))
  assert np.asarray(vmapped[1]).shape == (2, 60, 4)
  # Epochs of 103 observations in batches of 4 end with masked fillers.
  assert not np.asarray(got[1]).all()


def test_xs_of_no_rows_make_no_steps(pipeline):
  init_fn, batch_fn, _ = pipeline
  state = init_fn(seed=2)
  xs = {"key": jnp.zeros((0, 2), jnp.uint32), "t": jnp.zeros((0,))}

  def f(carry, item):
    batch, x = item
    return carry + x["t"], (batch["x"], x["key"])

  got = jax_data.scan(f, 0.0, state, batch_fn=batch_fn, xs=xs)
  want = _loop(batch_fn, f, 0.0, state, xs, None)
  _same_run(got, want)
  assert got[1][0].shape == (0, 4) and got[1][1].shape == (0, 2)


def test_without_jit_and_under_vmap(pipeline):
  init_fn, batch_fn, _ = pipeline
  chains = [init_fn(seed=s) for s in range(3)]
  stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *chains)
  run = lambda s: jax_data.scan(_step, 0, s, batch_fn=batch_fn, length=12)
  got = jax.jit(jax.vmap(run))(stacked)
  for i, state in enumerate(chains):
    _same(jax.tree_util.tree_map(lambda a, i=i: a[i], got), run(state))
    _same_run(run(state), _loop(batch_fn, _step, 0, state, None, 12))


def _loops(jaxpr):
  """The programs of the loops (and other calls) of ``jaxpr``, as text,
  looking through ``custom_vmap`` calls."""
  loops = []
  for eqn in jaxpr.eqns:
    inner = [j.jaxpr if hasattr(j, "jaxpr") else j
             for j in jax.extend.core.jaxprs_in_params(eqn.params)]
    if eqn.primitive.name == "custom_vmap_call":
      loops += _loops(inner[0])
    else:
      loops += [str(j) for j in inner]
  return loops


@pytest.mark.parametrize("chains", [1, 3])
def test_a_vmap_of_one_runs_the_chains_own_program(pipeline, chains):
  """A vmap over one chain runs the program of the chain without vmap
  (the same jaxpr), and gives its values; other counts are vmapped."""
  init_fn, batch_fn, _ = pipeline
  states = [init_fn(seed=s, shuffle=True) for s in range(chains)]
  stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *states)
  run = lambda s: jax_data.scan(_step, 0, s, batch_fn=batch_fn, length=12)
  got = jax.jit(jax.vmap(run))(stacked)
  for i, state in enumerate(states):
    _same(jax.tree_util.tree_map(lambda a, i=i: a[i], got), jax.jit(run)(state))
  plain = _loops(jax.make_jaxpr(run)(states[0]).jaxpr)
  vmapped = _loops(jax.make_jaxpr(jax.vmap(run))(stacked).jaxpr)
  assert len(plain) > 3
  assert (vmapped == plain) == (chains == 1)


@pytest.mark.parametrize("form", ["jit", "jit of vmap of one",
                                  "vmap of one of jit"])
def test_checkify_sees_into_the_steps(pipeline, form):
  """checkify's automatic checks and a step's own checks reach the user
  through jax_data.scan under jit, vmapped over one chain too: the
  one-lane program was a custom_vmap that checkify did not look into (a
  NaN went unreported; a check raised "not functionalized")."""
  from jax.experimental import checkify
  init_fn, batch_fn, _ = pipeline

  def run(state, length, nan_at):
    def step(count, batch):
      checkify.check(count < 6, "step {i} of at most 6", i=count)
      return count + 1, jnp.log(batch["x"] - 1e6 * (count == nan_at))
    return jax_data.scan(step, 0, state, batch_fn=batch_fn, length=length)

  checked = lambda length, nan_at=-1: checkify.checkify(
      lambda s: run(s, length, nan_at), errors=checkify.all_checks)
  wrap = {"jit": jax.jit,
          "jit of vmap of one": lambda f: jax.jit(jax.vmap(f)),
          "vmap of one of jit": lambda f: jax.vmap(jax.jit(f))}[form]
  state = init_fn(seed=0)
  if form != "jit":
    state = jax.tree_util.tree_map(lambda a: a[None], state)
  error, _ = wrap(checked(4))(state)
  assert error.get() is None
  error, (_, ys) = wrap(checked(5, nan_at=4))(state)
  assert np.isnan(np.asarray(ys)[..., 4, :]).any()
  assert "nan generated by primitive: log" in error.get()
  error, _ = wrap(checked(8))(state)
  assert "step 6 of at most 6" in error.get()


@pytest.mark.parametrize("x64", [False, True])
def test_a_python_int_carry_that_the_step_adds_a_float_to(pipeline, x64):
  """init=0 and a step adding 0.5 (a weak float): lax.scan promotes the
  carry to the float type; the chunked loops failed on it."""
  init_fn, batch_fn, _ = pipeline
  step = lambda total, batch: (total + 0.5, batch["x"])
  with jax.enable_x64(x64):
    state = init_fn(seed=1)
    want = jax.jit(lambda s: _loop(batch_fn, step, 0, s, None, 13))(state)
    got = jax.jit(lambda s: jax_data.scan(step, 0, s, batch_fn=batch_fn,
                                          length=13))(state)
    _same_run(got, want)
    assert got[0][0].dtype == want[0][0].dtype
    assert np.issubdtype(got[0][0].dtype, np.floating)


@pytest.mark.parametrize("init", [0, 0.0, (0, 1.5)])
@pytest.mark.parametrize("x64", [False, True])
def test_a_python_number_carry_takes_the_steps_dtype(pipeline, init, x64):
  """A Python-number init that the step turns into the batch's dtype
  (0 for a sum of float32 data; 0.0 under x64) is promoted as lax.scan
  promotes it; it failed with 'cond branches must have equal output
  types'."""
  init_fn, batch_fn, _ = pipeline
  step = lambda total, batch: (jax.tree_util.tree_map(
      lambda t: t + jnp.sum(batch["x"].astype(jnp.float32)), total),
      batch["x"])
  with jax.enable_x64(x64):
    state = init_fn(seed=1)
    want = jax.jit(lambda t, s: _loop(batch_fn, step, t, s, None, 13))(
        init, state)
    got = jax.jit(lambda t, s: jax_data.scan(step, t, s, batch_fn=batch_fn,
                                             length=13))(init, state)
    _same_run(got, want)
    assert ([leaf.dtype for leaf in jax.tree_util.tree_leaves(got[0][0])]
            == [np.float32] * len(jax.tree_util.tree_leaves(init)))
    (carry, _), _ = jax.vmap(lambda s: jax_data.scan(
        step, init, s, batch_fn=batch_fn, length=13))(init_fn(seed=range(2)))
    assert ([leaf.dtype for leaf in jax.tree_util.tree_leaves(carry)]
            == [np.float32] * len(jax.tree_util.tree_leaves(init)))


@pytest.mark.parametrize("length", [0, 3, 13])
@pytest.mark.parametrize("chains", [None, 2])
def test_ys_of_python_numbers_stay_weakly_typed(pipeline, length, chains):
  """As lax.scan's do, so they promote alike later (times a bfloat16: a
  bfloat16, not a float32); the buffer they were written into made them
  strong."""
  init_fn, batch_fn, _ = pipeline
  step = lambda count, batch: (count + 1, (count * 0.5, 1.0,
                                           jnp.sum(batch["x"])))
  got, want = _both(batch_fn, step, 0, length, chains,
                    init_fn(seed=range(chains) if chains else 1))
  got_ys, want_ys = got[1], want[1]
  assert [y.weak_type for y in got_ys] == [True, True, False]
  assert [y.weak_type for y in want_ys] == [True, True, False]
  _same(got_ys, want_ys)
  assert (got_ys[0] * jnp.bfloat16(2)).dtype == jnp.bfloat16


@pytest.mark.parametrize("by_step", [False, True], indirect=True)
@pytest.mark.parametrize("length", [3, 13])
@pytest.mark.parametrize("chains", [None, 2])
def test_a_weak_carry_returned_strong_types_the_ys_as_lax_scan(
    pipeline, by_step, length, chains):
  """init=0.0 and a step adding a float32 sum: lax.scan traces the step
  once with the carry weak, so a y of ``carry * bfloat16(1)`` is a
  bfloat16 at every step; the chunked loops traced it again with the carry
  made strong (a float32 y), or failed writing one into the other."""
  init_fn, batch_fn, _ = pipeline
  step = lambda total, batch: (total + jnp.sum(batch["x"].astype(
      jnp.float32)), (total * jnp.bfloat16(1), total))
  got, expected = _both(batch_fn, step, 0.0, length, chains,
                        init_fn(seed=range(chains) if chains else 1))
  _same_run(got, expected)
  typed = lambda tree: [(jax.typeof(a).dtype, jax.typeof(a).weak_type)
                        for a in jax.tree_util.tree_leaves(tree)]
  assert typed((got[0][0], got[1])) == typed((expected[0][0], expected[1]))
  assert got[1][0].dtype == jnp.bfloat16


@pytest.mark.parametrize("by_step", [False, True], indirect=True)
@pytest.mark.parametrize("length", [3, 13])
@pytest.mark.parametrize("chains", [None, 2])
def test_weakly_typed_xs_reach_the_step_weak_as_lax_scan(
    pipeline, by_step, length, chains):
  """A schedule of Python numbers (jnp.full(length, 0.1), weakly typed)
  driving a bfloat16 carry: lax.scan gives the step weak elements, so the
  carry stays bfloat16 and a y of the element is weak; the elements the
  chunked loops traced the step with were strong, and the carry was
  refused as float32 ("f must return a carry of init's shapes and
  dtypes")."""
  init_fn, batch_fn, _ = pipeline
  step = lambda w, bx: (w - bx[1] * w + jnp.sum(bx[0]["x"]).astype(
      jnp.bfloat16), bx[1])
  xs = jnp.full(length, 0.1)
  got, expected = _both(batch_fn, step, jnp.bfloat16(1), length, chains,
                        init_fn(seed=range(chains) if chains else 1), xs)
  _same_run(got, expected)
  typed = lambda tree: [(jax.typeof(a).dtype, jax.typeof(a).weak_type)
                        for a in jax.tree_util.tree_leaves(tree)]
  assert typed((got[0][0], got[1])) == typed((expected[0][0], expected[1]))
  assert got[0][0].dtype == jnp.bfloat16 and jax.typeof(got[1]).weak_type


@pytest.mark.parametrize("init, returned, message", [
    (np.float32(0), lambda t: jnp.int32(1), "init is float32.*int32"),
    (np.zeros(2, np.float32), lambda t: jnp.zeros(3), r"float32\[2\].*\[3\]"),
    ((0.0, 1), lambda t: t[0], "structure"),
    # the leaf named by its path, in a carry of many (an optimizer's)
    ({"params": np.zeros(2, np.float32), "opt": (np.int32(0),
                                                 np.float32(0))},
     lambda t: {**t, "opt": (t["opt"][0], jnp.float16(0))},
     r"init\['opt'\]\[1\] is float32\[\], f returned float16\[\]"),
    ({"a": np.float32(0), "b": np.float32(0)},
     lambda t: {"a": t["a"], "c": t["b"]},
     r"init has a leaf at \['b'\], f returned one at \['c'\]"),
    ((np.float32(0),), lambda t: (t[0], t[0]),
     r"f's carry has 1 more leaves, the first at \[1\]"),
    (np.float32(0), lambda t: (t, t),
     r"init has a leaf at the root, f returned one at \[0\]")])
def test_a_carry_of_another_type_is_named(pipeline, init, returned, message):
  init_fn, batch_fn, _ = pipeline
  with pytest.raises(TypeError, match=message):
    jax.jit(lambda s: jax_data.scan(lambda t, b: (returned(t), 0), init, s,
                                    batch_fn=batch_fn, length=7))(init_fn())


@pytest.mark.parametrize("carry, length", [(0, 3), (0.5, 0), (None, 3)])
@pytest.mark.parametrize("chains", [1, 2])
def test_a_carry_passed_through_unchanged_under_vmap(pipeline, chains, carry,
                                                      length):
  """A step that returns a Python-number carry unchanged: the vmap of one
  chain raised "'TypedInt' object is not subscriptable" (its program
  returns the carry as a literal of the jaxpr)."""
  init_fn, batch_fn, _ = pipeline
  run = lambda s: jax_data.scan(lambda c, b: (c, b["x"]), carry, s,
                                batch_fn=batch_fn, length=length)
  states = init_fn(seed=range(chains))
  (got, _), ys = jax.vmap(run)(states)
  assert np.shape(ys) == (chains, length, 4)
  if carry is not None:
    assert np.asarray(got).tolist() == [carry] * chains
  for c in range(chains):
    _, alone = run(jax.tree_util.tree_map(lambda a, c=c: a[c], states))
    np.testing.assert_array_equal(ys[c], alone)


@pytest.mark.parametrize("chains", [1, 3])
def test_steps_that_close_over_per_chain_values_or_name_the_chain_axis(
    pipeline, chains):
  """A step may close over per-chain values (floats and ints) and use
  collectives over the vmap's ``axis_name``; every chain count gives what
  the chains give alone or together."""
  init_fn, batch_fn, _ = pipeline
  states = [init_fn(seed=s) for s in range(chains)]
  stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *states)
  scales = jnp.arange(1.0, chains + 1.0)
  shifts = jnp.arange(chains, dtype=jnp.int32) * 10

  def closing(s, scale, shift):
    def f(total, batch):
      return total + scale * jnp.sum(batch["x"] + shift), batch["y"]
    return jax_data.scan(f, 0.0, s, batch_fn=batch_fn, length=7)

  (totals, _), ys = jax.jit(jax.vmap(closing))(stacked, scales, shifts)
  for c, state in enumerate(states):
    (total, _), y = jax.jit(closing)(state, scales[c], shifts[c])
    np.testing.assert_allclose(totals[c], total, rtol=1e-6)
    _same(ys[c], y)

  def naming(s):
    def f(total, batch):
      return total + lax.psum(jnp.sum(batch["x"]), "c"), lax.axis_index("c")
    return jax_data.scan(f, 0, s, batch_fn=batch_fn, length=7)

  (sums, _), index = jax.jit(jax.vmap(naming, axis_name="c"))(stacked)
  each = [jax.jit(lambda s: jax_data.scan(
      _step, 0, s, batch_fn=batch_fn, length=7))(s)[0][0] for s in states]
  _same(sums, np.full(chains, sum(int(e) for e in each)))
  _same(index, np.repeat(np.arange(chains)[:, None], 7, axis=1))


def _reference(batch_fn, f, init, state, length):
  """The loop jax_data.scan stands for: a lax.scan that calls batch_fn."""
  def body(carry, _):
    carry, state = carry
    state, batch = batch_fn(state)
    carry, y = f(carry, batch)
    return (carry, state), y
  return lax.scan(body, (init, state), None, length=length)


def _summed(carry, batch):
  total = lax.psum(jnp.sum(batch["x"]), "c")
  return carry + total, total


def test_steps_in_lockstep_over_chains_at_different_positions(pipeline):
  """Chains at different positions reach chunk boundaries at different
  steps. A step that adds up the chains (``lax.psum`` over the vmap's
  axis) adds their batches of the same step, and a step with an
  ``io_callback`` runs under vmap: both as in the loop of batch_fn."""
  init_fn, batch_fn, _ = pipeline
  stacked = init_fn(seed=range(3))
  advance = jax.jit(jax.vmap(batch_fn))

  def both(length):
    return [jax.jit(jax.vmap(loop, axis_name="c")) for loop in (
        lambda s: jax_data.scan(_summed, 0, s, batch_fn=batch_fn,
                                length=length),
        lambda s: _reference(batch_fn, _summed, 0, s, length))]

  for skips in ([0, 1, 3], [2, 0, 4]):  # lanes' positions, by steps taken
    states = stacked
    for step in range(max(skips)):
      ahead, _ = advance(states)
      takes = np.asarray(skips) > step
      states = jax.tree_util.tree_map(
          lambda a, b, takes=takes: jnp.where(takes.reshape(
              (-1,) + (1,) * (a.ndim - 1)), a, b), ahead, states)
    for length in (4, 13):
      scanned, looped = both(length)
      _same(scanned(states), looped(states))

  seen = []

  def logged(c, b):
    jax.experimental.io_callback(seen.append, None, jnp.sum(b["x"]),
                                 ordered=False)
    return c + jnp.sum(b["x"]), b["x"]

  got = jax.jit(jax.vmap(lambda s: jax_data.scan(
      logged, 0, s, batch_fn=batch_fn, length=7)))(stacked)
  want = jax.jit(jax.vmap(lambda s: _reference(
      batch_fn, logged, 0, s, 7)))(stacked)
  _same(got, want)
  # Each of the two loops logged every lane's 7 steps, the same sums.
  logs = [int(v) for v in seen]
  assert len(logs) == 42 and sorted(logs[:21]) == sorted(logs[21:])

  # jax.debug callbacks too: lanes at different positions run no step the
  # loop of batch_fn would not (a lane with none left ran f on stale
  # batches, whose results were dropped but whose callbacks ran).
  apart, _ = advance(stacked)
  apart = jax.tree_util.tree_map(lambda a, b: a.at[0].set(b[0]), apart,
                                 stacked)  # lanes at positions 0, 1, 1
  printed = []

  def counted(c, b):
    jax.debug.callback(lambda c, s: printed.append((int(c), int(s))), c,
                       jnp.sum(b["x"]))
    return c + 1, None

  def events(run):
    printed.clear()
    jax.block_until_ready(jax.jit(jax.vmap(run))(apart))
    jax.effects_barrier()
    return sorted(printed)

  got = events(lambda s: jax_data.scan(counted, 0, s, batch_fn=batch_fn,
                                       length=12))
  want = events(lambda s: _reference(batch_fn, counted, 0, s, 12))
  assert len(want) == 36 and max(c for c, _ in want) == 11
  assert got == want


def test_differentiation_through_scan_as_documented(pipeline):
  """Forward mode works, vmapped over one chain or several; reverse mode
  works where the position is known (no jit)."""
  init_fn, batch_fn, _ = pipeline
  state = init_fn(seed=0)

  def total(w, s):
    f = lambda c, b: (c + w * jnp.sum(b["x"]), None)
    return jax_data.scan(f, 0.0, s, batch_fn=batch_fn, length=12)[0][0]

  value = float(total(1.0, state))
  assert float(jax.grad(total)(1.0, state)) == value
  for chains in (1, 3):
    stacked = jax.tree_util.tree_map(lambda a, c=chains: jnp.stack([a] * c),
                                     state)
    out, tangent = jax.jit(jax.vmap(lambda w, s: jax.jvp(
        lambda w: total(w, s), (w,), (1.0,))))(jnp.ones(chains), stacked)
    _same((out, tangent), (np.full(chains, value), np.full(chains, value)))


@pytest.mark.parametrize("chains", [None, 3])
def test_a_scan_between_chunk_boundaries_copies_no_cache(pipeline, chains):
  """The parts of a scan that refresh the cache (a state inside a chunk,
  a last chunk begun) are inside conditionals on any lane needing them:
  the program's main path copies no cache, which XLA otherwise did twice
  per call (13 MB each at 16 chains of case (g), 3 ms of a 90 ms call).
  Nor do those parts: the refresh is a loop of at most one round, where
  a conditional copied the caches the host had written into. (A step
  whose outputs are its batches has them copied into the outputs.)"""
  if jax.default_backend() != "cpu":
    pytest.skip("the layout of XLA's CPU program")
  init_fn, batch_fn, _ = pipeline
  state = init_fn(seed=0) if chains is None else init_fn(seed=range(chains))
  step = lambda total, batch: (total + jnp.sum(batch["x"]), None)
  run = lambda s: jax_data.scan(step, 0, s, batch_fn=batch_fn, length=13)
  run = jax.jit(run if chains is None else jax.vmap(run), donate_argnums=0)
  text = run.lower(state).compile().as_text()
  cache = ",".join(str(d) for d in state.batches["x"].shape)
  copies = [line for line in text.splitlines()
            if " copy(" in line and f"[{cache}]" in line]
  assert not copies, copies


@pytest.mark.parametrize("by_step", [False, True], indirect=True)
@pytest.mark.parametrize("lengths", [(23, 23), (15, 4), (10, 17)])
def test_vmapped_chains_at_different_positions_as_each_alone(pipeline,
                                                             lengths,
                                                             by_step):
  """Lanes at different positions have different numbers of whole chunks:
  the loop over them runs for the lane with the most, and the others fetch
  nothing and keep their carry and steps' outputs. Each lane's batches,
  carry and state are its chain's alone, over two calls (the second from
  the caches the first left)."""
  init_fn, batch_fn, _ = pipeline
  stacked = init_fn(seed=range(4))
  advance = jax.jit(jax.vmap(batch_fn))
  skips = np.array([0, 2, 5, 9])  # steps taken: positions 0, 2, 0, 4
  states = stacked
  for step in range(skips.max()):
    ahead, _ = advance(states)
    takes = skips > step
    states = jax.tree_util.tree_map(
        lambda a, b, takes=takes: jnp.where(takes.reshape(
            (-1,) + (1,) * (a.ndim - 1)), a, b), ahead, states)
  alone = [jax.tree_util.tree_map(lambda a, c=c: a[c], states)
           for c in range(4)]
  for length in lengths:
    run = lambda s, length=length: jax_data.scan(
        _step, 0, s, batch_fn=batch_fn, length=length)
    got = jax.jit(jax.vmap(run))(states)
    for c in range(4):
      want = jax.jit(run)(alone[c])
      _same_run(jax.tree_util.tree_map(lambda a, c=c: a[c], got), want)
      alone[c] = want[0][1]
    states = got[0][1]


@pytest.mark.parametrize("skip", [0, 2])
@pytest.mark.parametrize("length", [3, 13])
@pytest.mark.parametrize("stream, chains", [("counter", 3), ("exact", 3),
                                            ("counter", None)])
def test_steps_over_buffers_of_their_own_as_batch_fn(pipeline, by_step,
                                                     skip, length, stream,
                                                     chains):
  """Whole chunks' steps unrolled over a buffer per step give each chain
  the batches, carry, outputs and state of batch_fn's loop: chains of one
  group read step by step into those buffers, others (exact streams, one
  chain) served a chunk at a time and each step copied out."""
  init_fn, batch_fn, _ = pipeline
  states = init_fn(seed=range(chains or 1), stream=stream)
  for _ in range(skip):
    states, _ = jax.vmap(batch_fn)(states)
  run = lambda s: jax_data.scan(_step, 0, s, batch_fn=batch_fn,
                                length=length)
  if chains is None:
    alone = [jax.tree_util.tree_map(lambda a: a[0], states)]
    got = [jax.jit(run)(alone[0])]
  else:
    alone = [jax.tree_util.tree_map(lambda a, c=c: a[c], states)
             for c in range(chains)]
    vmapped = jax.jit(jax.vmap(run))(states)
    got = [jax.tree_util.tree_map(lambda a, c=c: a[c], vmapped)
           for c in range(chains)]
  for state, lane in zip(alone, got):
    want = jax.jit(lambda s: _loop(batch_fn, _step, 0, s, None, length))(
        state)
    _same_run(lane, want)
    _same(batch_fn(lane[0][1]), batch_fn(want[0][1]))
  head = (5 - skip) % 5  # the steps left of the chunk the states are in
  if length - head >= 5:  # a whole chunk
    assert by_step, "no whole chunk was served a step at a time"
  grouped = stream == "counter" and chains is not None
  assert all(served == grouped for served in by_step)


@pytest.mark.parametrize("length", [3, 12])
def test_a_vmap_over_no_chains(pipeline, length):
  """A vmap over zero stacked states makes no steps' worth of outputs, as
  the loop of batch_fn does (the longest lane's number of whole chunks,
  over no lanes, is none)."""
  init_fn, batch_fn, _ = pipeline
  none = jax.tree_util.tree_map(lambda a: a[:0], init_fn(seed=range(2)))
  (total, _), ys = jax.jit(jax.vmap(lambda s: jax_data.scan(
      _step, 0, s, batch_fn=batch_fn, length=length)))(none)
  (want, _), want_ys = jax.jit(jax.vmap(lambda s: _loop(
      batch_fn, _step, 0, s, None, length)))(none)
  assert total.shape == want.shape == (0,)
  assert ys.shape == want_ys.shape == (0, length, 4)


@pytest.mark.parametrize("chains", [None, 3])
def test_whole_chunks_are_written_into_the_states_caches(chains):
  """A scan over whole chunks has the host write them into the buffers of
  the state's caches, whose contents it no longer needs (it leaves them
  marked empty), not into a fresh chunk-sized buffer per call: the
  compiled program's temporary buffers are smaller than one set of
  caches, and it copies none. Before, 1,024 vmapped chains took 83 MiB
  more (a temporary as large as their caches), faulted in at every
  call."""
  if jax.default_backend() != "cpu":
    pytest.skip("the host writes in place on CPU")
  loader = jax_data.NumpyDataLoader(
      x=np.arange(103 * 256, dtype=np.float32).reshape(103, 256))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 5, 4)
  state = init_fn(seed=0) if chains is None else init_fn(seed=range(chains))
  step = lambda total, batch: (total + jnp.sum(batch["x"]), None)
  run = lambda s: jax_data.scan(step, 0.0, s, batch_fn=batch_fn, length=15)
  run = jax.jit(run if chains is None else jax.vmap(run), donate_argnums=0)
  compiled = run.lower(state).compile()
  caches = state.batches["x"].nbytes
  assert compiled.memory_analysis().temp_size_in_bytes < caches / 2
  lanes = [state] if chains is None else [
      jax.tree_util.tree_map(lambda a, c=c: a[c], state)
      for c in range(chains)]
  reference = jax.jit(lambda s: _loop(batch_fn, step, 0.0, s, None, 15))
  want = [float(reference(lane)[0][0]) for lane in lanes]
  (total, after), _ = compiled(state)
  assert np.atleast_1d(np.asarray(total)).tolist() == want
  assert (np.asarray(after.cached_chunk) == -1).all()
  release_fn()


def test_device_loader_falls_back_to_batch_fn():
  loader = jax_data.DeviceNumpyDataLoader(x=np.arange(20))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 1, 3)
  state = init_fn(key=jax.random.PRNGKey(0))
  _same(jax_data.scan(_step, 0, state, batch_fn=batch_fn, length=7),
        _loop(batch_fn, _step, 0, state, None, 7))
  release_fn()


def test_bad_arguments_are_named(pipeline):
  init_fn, batch_fn, release_fn = pipeline
  state = init_fn(seed=0)
  with pytest.raises(ValueError, match="length"):
    jax_data.scan(_step, 0, state, batch_fn=batch_fn)
  with pytest.raises(ValueError, match=r"xs is None or holds no arrays, "
                     r"got xs=\(\), length=None"):
    jax_data.scan(_step, 0, state, batch_fn=batch_fn, xs=())
  with pytest.raises(ValueError, match="length=3 differs"):
    jax_data.scan(_step, 0, state, batch_fn=batch_fn, xs=jnp.zeros(4),
                  length=3)
  with pytest.raises(TypeError, match="f must be callable"):
    jax_data.scan(None, 0, state, batch_fn=batch_fn, length=3)
  # What JAX cannot hold was JAX's error about an inner lambda of the
  # library's ("... was passed to the function at path c").
  with pytest.raises(TypeError, match=r"init\['a'\] must be an array or a "
                     r"number, got 'abc' of type str"):
    jax_data.scan(_step, {"a": "abc"}, state, batch_fn=batch_fn, length=3)
  with pytest.raises(TypeError, match=r"y must be an array or a number "
                     r"\(returned by f=.*\), got 's'"):
    jax_data.scan(lambda c, b: (c, "s"), 0, state, batch_fn=batch_fn,
                  length=3)
  with pytest.raises(TypeError, match="batch_fn must be"):
    jax_data.scan(_step, 0, state, batch_fn=lambda s: s, length=3)
  mapper = jax_data.full_data_mapper(
      jax_data.NumpyDataLoader(x=np.arange(8)), 1, 2)
  with pytest.raises(TypeError, match="random_reference_data"):
    jax_data.scan(_step, 0, state, batch_fn=mapper.mapper_fn, length=3)
  mapper.release_fn()
  release_fn()
  with pytest.raises(jax_data.PipelineReleasedError):
    jax_data.scan(_step, 0, state, batch_fn=batch_fn, length=3)


def test_vmapped_chains_fetch_each_chunk_once(pipeline):
  """Under vmap, a scan over whole chunks from a chunk boundary asks the
  host once per chunk: the parts before the first boundary and after the
  last, empty here, fetch nothing (a per-chain ``lax.cond`` would run
  them for every chain, chunk and all)."""
  init_fn, batch_fn, _ = pipeline
  stacked = jax.tree_util.tree_map(
      lambda *s: jnp.stack(s), *[init_fn(seed=c) for c in range(3)])
  run = jax.jit(jax.vmap(lambda s: jax_data.scan(
      _step, 0, s, batch_fn=batch_fn, length=15)))
  host = pipeline.host
  (_, stacked), _ = run(stacked)
  before = host.requests
  (_, stacked), ys = run(stacked)
  jax.block_until_ready(ys)
  assert host.requests - before == 3  # 15 steps, 5 batches per chunk
  for c in range(3):  # and the batches are the chains' own
    state = init_fn(seed=c)
    want = jax.jit(lambda s: _loop(batch_fn, _step, 0, s, None, 30))(state)
    np.testing.assert_array_equal(np.asarray(ys[c]),
                                  np.asarray(want[1][15:]))


def test_reverse_mode_through_the_device_loaders_scan_under_jit():
  """DeviceNumpyDataLoader's loops are scans of a fixed length: jax.grad
  through jax_data.scan under jit gives the gradient of the eager loop
  (it failed on the one-lane custom_vmap, which only a vmap needs)."""
  loader = jax_data.DeviceNumpyDataLoader(x=np.arange(23, dtype=np.float32))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 3, 4)
  state = init_fn(seed=0, stream="counter")

  def loss(w, state):
    step = lambda c, b: (c + jnp.sum(jnp.sin(w * b["x"])), None)
    (total, _), _ = jax_data.scan(step, 0.0, state, batch_fn=batch_fn,
                                  length=8)
    return total

  def reference(w, state):
    return _loop(batch_fn, lambda c, b: (c + jnp.sum(jnp.sin(w * b["x"])),
                                         None), 0.0, state, None, 8)[0][0]

  np.testing.assert_allclose(jax.jit(jax.grad(loss))(0.3, state),
                             jax.grad(reference)(0.3, state), rtol=1e-5)
  release_fn()


def test_jax_export_of_a_device_loaders_program():
  """A device loader's program, taking and returning states and batch
  information, serializes with jax.export and runs as the original does; a
  host loader's calls the host, which JAX does not serialize."""
  pytest.importorskip("flatbuffers")  # JAX's serialization needs it
  from jax import export
  loader = jax_data.DeviceNumpyDataLoader(x=np.arange(23, dtype=np.float32))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 3, 4)
  state = init_fn(seed=0, stream="counter")
  run = jax.jit(lambda s: jax_data.scan(_step, 0.0, s, batch_fn=batch_fn,
                                        length=9, information=False))
  draw = jax.jit(lambda s: batch_fn(s, information=True))
  for fn in (run, draw):
    exported = export.deserialize(export.export(fn)(state).serialize())
    _same(exported.call(state), fn(state))
  release_fn()
  host = jax_data.random_reference_data(jax_data.NumpyDataLoader(
      x=np.arange(23.0)), 3, 4)
  with pytest.raises(NotImplementedError, match="host_callbacks"):
    export.export(jax.jit(host.batch_fn))(host.init_fn()).serialize()
  host.release_fn()


@pytest.mark.parametrize("kind", ["host", "device"])
def test_reverse_mode_with_respect_to_the_carry(kind):
  """jax.grad with respect to init through jax_data.scan: eagerly, and
  under a vmap over init alone (the state shared), for every loader; under
  jit for the device loader, and for every loader with the state closed
  over. The vmap probe took JVP tracers and broke the linearization."""
  make = {"host": jax_data.NumpyDataLoader,
          "device": jax_data.DeviceNumpyDataLoader}[kind]
  loader = make(x=np.arange(23, dtype=np.float32))
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 3, 4)
  state = init_fn(seed=0, stream="counter")
  step = lambda c, b: (c * 0.9 + jnp.sum(jnp.sin(b["x"])) * c, None)

  def loss(w, state):
    return jax_data.scan(step, w, state, batch_fn=batch_fn, length=8)[0][0]

  def reference(w, state):
    return _loop(batch_fn, step, w, state, None, 8)[0][0]

  want = jax.grad(reference)(0.3, state)
  np.testing.assert_allclose(jax.grad(loss)(0.3, state), want, rtol=1e-5)
  np.testing.assert_allclose(
      jax.vmap(jax.grad(loss), in_axes=(0, None))(jnp.array([0.3, 0.3]),
                                                  state), [want] * 2,
      rtol=1e-5)
  if kind == "device":
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(0.3, state), want,
                               rtol=1e-5)
  # A state closed over keeps its position known under jit and
  # jax.checkpoint too, at a chunk's start and inside one: its loops were
  # while loops there, which reverse mode does not go through.
  for known in (state, batch_fn(batch_fn(state)[0])[0]):
    want = jax.grad(lambda w, s=known: reference(w, s))(0.3)
    closed = lambda w, s=known: loss(w, s)
    for run in (jax.jit(jax.grad(closed)), jax.grad(jax.checkpoint(closed)),
                jax.jit(jax.grad(jax.checkpoint(closed)))):
      np.testing.assert_allclose(run(0.3), want, rtol=1e-5)
  release_fn()


@pytest.mark.parametrize("xs, message", [
    (np.array([object()] * 2), "xs must be an array or a number, got array"),
    (["a", "b"], r"xs\[0\] must be an array or a number, got 'a'"),
])
def test_xs_that_jax_takes_for_no_array_are_named(pipeline, xs, message):
  """As init is: they failed inside JAX's dtype rules."""
  init_fn, batch_fn, _ = pipeline
  with pytest.raises(TypeError, match=message):
    jax_data.scan(lambda c, bx: (c, None), 0.0, init_fn(seed=0),
                  batch_fn=batch_fn, xs=xs)
