"""Property-based tests over observation counts, batch and cache sizes,
seeds."""

import collections
import math
import pickle

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jax_data
from jax_data import NumpyDataLoader
from jax_data.loaders import source_records

# Derandomized: the same examples in every CI run, no flaky failures.
PROPERTY = settings(deadline=None, derandomize=True, max_examples=40)
SLOW = settings(deadline=None, derandomize=True, max_examples=8)


@st.composite
def sizes(draw, max_n=60):
  n = draw(st.integers(1, max_n))
  mb = draw(st.integers(1, n))
  cache = draw(st.integers(1, 6))
  seed = draw(st.integers(0, 2**32 - 1))
  return n, mb, cache, seed


def _chunks(loader, chain, count):
  rows, masks = [], []
  for _ in range(count):
    batches, mask = loader.get_batches(chain)
    rows.extend(batches["x"])
    masks.extend(mask)
  return np.array(rows), np.array(masks)


@PROPERTY
@given(sizes())
def test_epochs_cover_every_observation_once(params):
  n, mb, cache, seed = params
  loader = NumpyDataLoader(x=np.arange(n))
  chain = loader.register_random_pipeline(cache, mb, seed=seed, shuffle=True,
                                          in_epochs=True)
  per_epoch = math.ceil(n / mb)
  rows, masks = _chunks(loader, chain, math.ceil(3 * per_epoch / cache))
  for e in range(3):
    part = slice(e * per_epoch, (e + 1) * per_epoch)
    assert sorted(rows[part][masks[part]].tolist()) == list(range(n))
    assert (rows[part][~masks[part]] == 0).all()


@PROPERTY
@given(sizes())
def test_shuffle_repeats_only_across_permutation_boundaries(params):
  n, mb, cache, seed = params
  loader = NumpyDataLoader(x=np.arange(n))
  chain = loader.register_random_pipeline(cache, mb, seed=seed, shuffle=True)
  rows, masks = _chunks(loader, chain, math.ceil(3 * n / (mb * cache)) + 1)
  assert masks.all()
  flat = rows.reshape(-1)
  for start in range(0, flat.size - n + 1, n):
    assert sorted(flat[start:start + n].tolist()) == list(range(n))
  for j, batch in enumerate(rows):
    if len(set(batch.tolist())) < mb:
      assert (j * mb) // n != (j * mb + mb - 1) // n


@PROPERTY
@given(sizes())
def test_ordered_passes_in_order(params):
  n, mb, cache, _ = params
  loader = NumpyDataLoader(x=np.arange(n))
  chain = loader.register_ordered_pipeline(cache, mb)
  per_pass = math.ceil(n / mb)
  rows, masks = _chunks(loader, chain, math.ceil(3 * per_pass / cache))
  for p in range(3):
    part = slice(p * per_pass, (p + 1) * per_pass)
    assert rows[part][masks[part]].tolist() == list(range(n))
    assert masks[part].sum() == n


@PROPERTY
@given(sizes(), st.sampled_from([dict(), dict(shuffle=True),
                                 dict(shuffle=True, in_epochs=True)]))
def test_cache_size_never_changes_the_stream(params, mode):
  n, mb, cache, seed = params
  loader = NumpyDataLoader(x=np.arange(n))
  a = loader.register_random_pipeline(cache, mb, seed=seed, **mode)
  b = loader.register_random_pipeline(cache + 1, mb, seed=seed, **mode)
  # Both draw 4 * cache * (cache + 1) batches.
  rows_a, masks_a = _chunks(loader, a, 4 * (cache + 1))
  rows_b, masks_b = _chunks(loader, b, 4 * cache)
  assert rows_a.tolist() == rows_b.tolist()
  assert masks_a.tolist() == masks_b.tolist()


@SLOW
@pytest.mark.filterwarnings("ignore:the cache holds")
@given(sizes(max_n=30), st.sampled_from([dict(), dict(shuffle=True),
                                         dict(shuffle=True, in_epochs=True)]))
def test_checkpoint_at_every_step_then_restore(params, mode):
  n, mb, cache, seed = params
  original = jax_data.random_reference_data(NumpyDataLoader(x=np.arange(n)),
                                            cache, mb)
  fresh = jax_data.random_reference_data(NumpyDataLoader(x=np.arange(n)),
                                         cache, mb)
  state = original[0](seed=seed, **mode)
  for _ in range(2 * cache + 2):
    restored = jax_data.state_from_pytree(
        fresh, jax_data.state_to_pytree(original, state))
    state, (batch, info) = original[1](state, information=True)
    _, (again, again_info) = fresh[1](restored, information=True)
    assert again["x"].tolist() == batch["x"].tolist()
    assert again_info.mask.tolist() == info.mask.tolist()


# Records as a source may give them: arrays, numbers, None and containers,
# nested; a record and the first record are drawn alike, so that many
# share the first's structure.
_LEAVES = st.sampled_from([np.zeros(2, np.float32), np.float32(1),
                           np.int64(2), 3, 4.5, True, None, "text"])
_KEYS = st.sampled_from(["a", "b", "c"])


def _nodes(children):
  return st.one_of(
      st.dictionaries(_KEYS, children, max_size=3),
      st.lists(children, max_size=3),
      st.lists(children, max_size=3).map(tuple),
      st.dictionaries(_KEYS, children, max_size=3).map(
          lambda d: collections.OrderedDict(sorted(d.items()))))


_RECORDS = st.recursive(_LEAVES, _nodes, max_leaves=6)


@settings(deadline=None, derandomize=True, max_examples=400)
@given(_RECORDS, _RECORDS)
def test_records_taken_apart_without_jax_as_jax_does(first, record):
  """A worker process takes apart the records that share the first's
  container and keys, and whose leaves are arrays and numbers, without
  JAX (RecordFormat.plain_leaves): always into JAX's leaves in JAX's
  order, and never a record JAX sees as another structure. A record
  whose dict was built in another key order is still the same record.
  After a pickle (as a worker receives it) the format is the same."""
  paths, leaves, treedef = source_records.flatten_record(first)
  if not leaves:
    return  # the loader refuses such a first record
  try:
    arrays = [np.asarray(leaf) for leaf in leaves]
  except Exception:  # pylint: disable=broad-except
    return
  first_format = source_records.RecordFormat(treedef, paths, arrays)
  received = pickle.loads(pickle.dumps(first_format))
  assert received.treedef == treedef
  if isinstance(record, dict):
    record = dict(reversed(list(record.items())))
  for fmt in (first_format, received):
    plain = fmt.plain_leaves(record)
    want, structure = jax.tree_util.tree_flatten(record)
    if plain is not None:
      assert structure == treedef
      assert len(plain) == len(want)
      assert all(p is w for p, w in zip(plain, want))
    elif structure == treedef and fmt.stackable and all(
        isinstance(leaf, (np.ndarray, np.generic, int, float))
        for leaf in want):
      raise AssertionError(f"{record!r} was given to JAX: it need not be")


@pytest.mark.parametrize("record", [
    {"x": np.zeros(3, np.float32), "y": np.int32(1)},
    (np.zeros(3), 2.0), [np.zeros(3)], np.zeros((2, 2)), np.float32(3)])
def test_a_records_format_pickles_without_jax(record):
  """The format of a record that is an array or number, or a dict, tuple
  or list of them, reaches a worker process without a JAX treedef (whose
  unpickling imports JAX), and makes the same treedef there."""
  paths, leaves, treedef = source_records.flatten_record(record)
  fmt = source_records.RecordFormat(treedef, paths,
                                    [np.asarray(leaf) for leaf in leaves])
  pickled = pickle.dumps(fmt)
  assert b"jax." not in pickled.replace(b"jax_data.", b"")
  assert pickle.loads(pickled).treedef == treedef
  nested = {"x": {"v": np.zeros(2)}}
  paths, leaves, treedef = source_records.flatten_record(nested)
  fmt = source_records.RecordFormat(treedef, paths,
                                    [np.asarray(leaf) for leaf in leaves])
  assert pickle.loads(pickle.dumps(fmt)).treedef == treedef


class _Boxed(np.ndarray):
  """An array subclass registered as a pytree node (one child: the array
  viewed as a plain one)."""


jax.tree_util.register_pytree_node(
    _Boxed, lambda b: ((b.view(np.ndarray),), None),
    lambda _, children: children[0].view(_Boxed))


def test_a_subclass_registered_as_a_node_goes_to_jax():
  """A record's leaf whose type subclasses an array but is a pytree node
  is taken apart by JAX, not taken as a leaf."""
  first = {"x": np.zeros(2)}
  paths, leaves, treedef = source_records.flatten_record(first)
  fmt = source_records.RecordFormat(treedef, paths, leaves)
  boxed = {"x": np.ones(2).view(_Boxed)}
  assert fmt.plain_leaves(boxed) is None
  reader = source_records.RecordReader([first, boxed], None, "test")
  with pytest.raises(source_records.RecordError, match="record 1 has"):
    reader.leaves(1, boxed)  # one level deeper than record 0's x
