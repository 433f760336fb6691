"""Many counter-based chains produced together: one draw of all chains'
indices, one read of all their rows, the same batches as chain by chain."""

import functools
import itertools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_data
from jax_data import counter_streams as cs
from jax_data.counter_chains import CounterStream
from jax_data.counter_chains import chain_batches
from jax_data.counter_chains import uniform_runs
from jax_data.host_loader import StoreLimits
from jax_data.loaders import file_rows
from tests.records import ComputedInBatches

MODES = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("shuffle,in_epochs", MODES)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 65_537, 10**8, 10**12])
def test_chain_batches_equal_each_chains_stream(n, shuffle, in_epochs):
  """Row c of the vectorised draw is chain c's own stream, bit for bit:
  seeds up to 2**64 - 1, chains at far-apart positions, chunks that span
  many epochs (tiny n) or none."""
  seeds = [0, 1, 5, 2**40 + 3, 2**64 - 1]
  firsts = [0, 37, 3, 10**9, 123_456]
  for count, mb in ((10, 64), (3, 5), (1, 1)):
    got, mask = chain_batches(seeds, firsts, count, mb, n, shuffle,
                              in_epochs, start=3)
    assert got.shape == (len(seeds), count, mb) and got.dtype == np.int64
    for c, (seed, first) in enumerate(zip(seeds, firsts)):
      expected, expected_mask = cs.stream_batches(
          seed, first, count, mb, n, shuffle, in_epochs, 3)
      np.testing.assert_array_equal(got[c], expected)
      if expected_mask is None:
        assert mask is None
      else:
        np.testing.assert_array_equal(mask[c], expected_mask)


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 10**6, 2**31 + 1, 2**32,
                               2**32 + 1, 10**12, 2**62 + 1])
def test_uniform_runs_equal_the_streams_definition(n):
  """The in-place hash of runs of positions is ``uniform``'s, bit for bit:
  seeds up to 2**64 - 1; n whose hashes are rejected half the time
  (2**31 + 1), a quarter of the time (2**62 + 1) or never (2**32, 3);
  runs whose positions' low words wrap past 2**32; runs longer than a
  block. Seeds and starts given as arrays (uint64, int64) give the same as
  Python ints."""
  seeds = [0, 1, 5, 2**40 + 3, 2**64 - 1]
  starts = [0, 37, 2**32 - 5, 10**15, 2**62]
  arrays = np.asarray(seeds, np.uint64), np.asarray(starts, np.int64)
  for length in (1, 7, 6400, 40_000):
    got = uniform_runs(seeds, starts, length, n)
    assert got.shape == (5, length) and got.dtype == np.int64
    for c in range(5):
      np.testing.assert_array_equal(
          got[c], cs.uniform(seeds[c], starts[c] + np.arange(length), n))
    np.testing.assert_array_equal(uniform_runs(*arrays, length, n), got)


@pytest.mark.parametrize("n", [7, 1000, 2**33 + 5])
@pytest.mark.parametrize("shuffle, in_epochs", [(False, False), (True, False),
                                                (True, True)])
def test_a_part_of_each_batch_is_those_columns_of_the_batch(n, shuffle,
                                                            in_epochs):
  """What one device of a global batch draws (``columns``) is its columns
  of the whole batches, for one chain and for several."""
  for seeds, firsts in [([3], [5]), ([3, 4, 9], [0, 7, 2**20])]:
    whole, whole_mask = chain_batches(seeds, firsts, 6, 4, n, shuffle,
                                      in_epochs, start=11)
    for columns in (slice(0, 2), slice(2, 4), slice(1, 2)):
      part, mask = chain_batches(seeds, firsts, 6, 4, n, shuffle, in_epochs,
                                 start=11, columns=columns)
      np.testing.assert_array_equal(part, whole[..., columns])
      if whole_mask is None:
        assert mask is None
      else:
        np.testing.assert_array_equal(mask, whole_mask[..., columns])


def test_chain_batches_of_one_chain_and_of_many_blocks():
  """One chain, and more indices than one block of the permutation."""
  got, _ = chain_batches([9], [4], 7, 3, 50, True, False)
  np.testing.assert_array_equal(got[0],
                                cs.stream_batches(9, 4, 7, 3, 50, True,
                                                  False)[0])
  seeds = list(range(40))
  got, _ = chain_batches(seeds, [2] * 40, 40, 64, 10**6, True, False)
  for c in (0, 17, 39):
    np.testing.assert_array_equal(
        got[c], cs.stream_batches(c, 2, 40, 64, 10**6, True, False)[0])


@pytest.mark.parametrize("n", [3, 5, 17, 1000, 65_537, 10**6, 2**24])
def test_rounds_tabulated_per_entry_give_each_entrys_permutation(n):
  """Many chains' offsets, each with its (chain, epoch) entry, through
  every entry's tabulated round functions: each offset as its own seed and
  epoch permute it, cycle-walks included (n = 17 and 65,537 walk often).
  Epochs and offsets per chain, or one row the chains share; a chain's
  entry at epoch 0 far below zero (only entry plus epoch is an entry)."""
  from jax_data.streams.shuffled_chains import permute_tabulated
  bits = cs.domain_bits(n)
  rng = np.random.default_rng(n)
  seeds = [(0, 0), (5, 1), (2**40 + 3, 9), (2**64 - 1, 2**33)]
  with np.errstate(over="ignore"):
    lo, hi = (np.asarray([s >> shift & 0xFFFFFFFF for s, _ in seeds],
                         np.uint32) for shift in (0, 32))
    keys = cs.round_keys((lo, hi), np.asarray([e for _, e in seeds]), np)
  # Chain c's epochs 2**33 + 7 and the next are entries c and c + 1, whose
  # keys are those of seeds[c] and seeds[c + 1].
  first_epoch = 2**33 + 7
  chain_entry = np.arange(3)[:, None] - first_epoch
  epoch = first_epoch + (np.arange(600) >= 250)[None]
  offsets = rng.integers(0, n, (3, 600))
  for epochs, offset in ((epoch, offsets[:1]),
                         (np.repeat(epoch, 3, axis=0), offsets)):
    got = permute_tabulated(keys, chain_entry, epochs, offset, n, bits)
    assert got.shape == (3, 600)
    for c in range(3):
      for part in (slice(0, 250), slice(250, 600)):
        e = c + (part.start > 0)
        seed, key_epoch = seeds[e]
        np.testing.assert_array_equal(
            got[c, part],
            cs.permute(seed, key_epoch,
                       np.broadcast_to(offset, got.shape)[c, part], n))


def test_chains_that_start_together_keep_their_streams(monkeypatch):
  """Chains whose chunks start at the same batch share the positions'
  epochs and offsets: each still gets its own stream, across an epoch's
  end, in tiles of chains that start together and tiles that do not, with
  the round functions tabulated and not."""
  from jax_data.streams import counter_chains
  from jax_data.streams import shuffled_chains
  tabulated = []

  def spied(*args):
    tabulated.append(args[3].size)
    return permute_tabulated(*args)

  permute_tabulated = shuffled_chains.permute_tabulated
  monkeypatch.setattr(shuffled_chains, "permute_tabulated", spied)
  seeds = list(range(10, 22))
  # (n, firsts, count, mb, block): tiles of 4 chains across an epoch's
  # end; of 6 chains, one tile mixed; of 2 chains over many tiny epochs.
  for n, firsts, count, mb, block in (
      (1000, [14] * 12, 6, 64, 1600),
      (65_537, [5] * 5 + [9] * 7, 20, 64, 7680),
      (17, [3] * 12, 6, 4, 48)):
    monkeypatch.setattr(counter_chains, "_BLOCK", block)
    for shuffle, in_epochs in MODES[1:]:
      got, mask = chain_batches(seeds, firsts, count, mb, n, shuffle,
                                in_epochs)
      for c, (seed, first) in enumerate(zip(seeds, firsts)):
        want, want_mask = cs.stream_batches(seed, first, count, mb, n,
                                            shuffle, in_epochs)
        np.testing.assert_array_equal(got[c], want)
        if want_mask is not None:
          np.testing.assert_array_equal(mask[c], want_mask)
  # Offsets shared by a tile's chains (one row), and a tile's own.
  assert {384, 1280, 6 * 1280} <= set(tabulated)


@pytest.mark.parametrize("mode", [dict(shuffle=False, in_epochs=False),
                                  dict(shuffle=True, in_epochs=False),
                                  dict(shuffle=True, in_epochs=True)],
                         ids=["draws", "shuffled", "epochs"])
def test_a_draw_split_over_threads_gives_the_streams(mode, monkeypatch):
  """Many chains' indices drawn in parts by several threads at once (a
  loader's gather threads) are each chain's own stream, whatever the parts
  and blocks (larger in large draws): rows of every part written once,
  rejected hashes drawn again wherever they fall."""
  from jax_data.loaders.gather import Gatherer
  from jax_data.streams import counter_chains
  gatherer = Gatherer(threads=2)
  threads = set()

  def finest(work, size, least):  # two parts, however small
    def part(low, high):
      threads.add(threading.get_ident())
      work(low, high)
    gatherer.split(part, size, 1)

  monkeypatch.setattr(counter_chains, "_HASH_BLOCK", 40)
  monkeypatch.setattr(counter_chains, "_BLOCK", 40)
  seeds, firsts, mb = [3, 1, 4, 1, 5, 9, 2], [0, 7, 2, 9, 0, 1, 30], 8
  # Half the hashes of 2**31 + 1 are rejected; 40 batches are enough
  # indices for blocks four times as large.
  for n, count in itertools.product((50, 2**31 + 1), (3, 40)):
    got, got_mask = chain_batches(seeds, firsts, count, mb, n,
                                  split=finest, **mode)
    for c, (seed, first) in enumerate(zip(seeds, firsts)):
      want, want_mask = cs.stream_batches(seed, first, count, mb, n, **mode)
      np.testing.assert_array_equal(got[c], want)
      if want_mask is not None:
        np.testing.assert_array_equal(got_mask[c], want_mask)
  assert len(threads) == 2
  gatherer.close()


def _loaders(n):
  loaders = [jax_data.NumpyDataLoader(x=np.arange(n)),
             jax_data.SourceDataLoader(ComputedInBatches(n), workers=0)]
  try:
    import tensorflow as tf

    from jax_data.tensorflow_loader import TensorflowDataLoader
    loaders.append(TensorflowDataLoader(
        tf.data.Dataset.from_tensor_slices({"x": np.arange(n)}),
        in_memory=True))
  except ImportError:  # the tensorflow extra is optional
    pass
  return loaders


# Store limits: the default (chunks produced ahead into the store), and
# one under which every request of several chains is read in place.
IN_PLACE = StoreLimits(store_bytes=1)


@pytest.mark.parametrize("limits", [StoreLimits(), IN_PLACE],
                         ids=["ahead", "read_in_place"])
@pytest.mark.parametrize("mode", [{}, {"shuffle": True},
                                  {"shuffle": True, "in_epochs": True}])
def test_vmapped_chains_draw_each_chains_stream(mode, limits, pipelines):
  """Chains served together under vmap (and one of them restored at
  another position) get exactly the batches each chain's stream gives on
  its own, on every loader and callback path, whether their chunks are
  produced ahead or read straight into compiled code's buffers (then the
  host keeps none of them)."""
  n, cache, mb, chains = 103, 3, 8, 6
  shuffle, in_epochs = (mode.get("shuffle", False),
                        mode.get("in_epochs", False))
  for loader in _loaders(n):
    loader.store_limits = limits
    pipeline = pipelines.random_reference_data(loader, cache, mb)
    init_fn, batch_fn, release_fn = pipeline
    states = [init_fn(seed=20 + c, stream="counter", **mode)
              for c in range(chains)]
    tree = jax_data.state_to_pytree(pipeline, states[2])
    tree["chunk"] = np.int32(40)  # far ahead of the others
    states[2] = jax_data.state_from_pytree(pipeline, tree)
    stacked = jax.tree_util.tree_map(lambda *s: jnp.stack(s), *states)
    step = jax.jit(jax.vmap(functools.partial(batch_fn, information=True)))
    got = []
    for _ in range(2 * cache + 1):
      stacked, (batch, info) = step(stacked)
      got.append(np.where(info.mask, batch["x"], -1))
    got = np.stack(got, axis=1)  # (chains, steps, mb)
    for c in range(chains):
      first = 40 * cache if c == 2 else 0
      expected, mask = cs.stream_batches(20 + c, first, 2 * cache + 1, mb,
                                         n, shuffle, in_epochs)
      if mask is not None:
        expected = np.where(mask, expected, -1)
      np.testing.assert_array_equal(got[c], expected, err_msg=repr(loader))
    if limits is IN_PLACE:
      host = pipeline.host
      assert host.wait_idle()
      assert not any(host.chain(c).chunks for c in host.chains())
    release_fn()


@pytest.mark.parametrize("rows_per_read", [1, None],
                         ids=["step_by_step", "at_once"])
@pytest.mark.parametrize("limits", [StoreLimits(), IN_PLACE],
                         ids=["ahead", "read_in_place"])
def test_vmapped_scans_get_each_chains_stream(limits, rows_per_read,
                                              pipelines, monkeypatch):
  """``jax_data.scan`` over vmapped chains, whose whole chunks the host
  writes with the lane axis second (on CPU, in place), gives each chain
  exactly its own stream, on every loader; read in place, the rows of all
  chains land in compiled code's buffer batch by batch, with no copy: on a
  CPU device whatever the store's limits (one group of chains, with no
  Python per lane); in ``pure_callback``'s answer where the store reads in
  place. Whether the rows are read one step of every chain at a time, or
  all at once in the order the indices drawn ahead were laid out in."""
  from jax_data.loaders import indexed
  from jax_data.serving import group_refresh
  from jax_data.serving import production

  regions, intos, alike = [], [], []
  made, into = production._Regions, group_refresh._Into  # pylint: disable=protected-access
  same = group_refresh.same_memory

  def spied(*args):
    regions.append(made(*args))
    return regions[-1]

  def spied_into(*args):
    intos.append(into(*args))
    return intos[-1]

  def spied_same(*args):
    alike.append(same(*args))
    return alike[-1]

  monkeypatch.setattr(production, "_Regions", spied)
  monkeypatch.setattr(group_refresh, "_Into", spied_into)
  monkeypatch.setattr(group_refresh, "same_memory", spied_same)
  if rows_per_read is not None:
    # Interleaved reads of one step's rows at a time, as with many chains.
    monkeypatch.setattr(indexed, "_INTERLEAVED_ROWS", rows_per_read)
  n, cache, mb, chains, length = 103, 3, 8, 5, 11
  for loader in _loaders(n):
    loader.store_limits = limits
    pipeline = pipelines.random_reference_data(loader, cache, mb)
    init_fn, batch_fn, release_fn = pipeline
    states = [init_fn(seed=30 + c, shuffle=True, stream="counter")
              for c in range(chains)]
    stacked = jax.tree_util.tree_map(lambda *s: jnp.stack(s), *states)

    def run(state, batch_fn=batch_fn):
      (_, state), xs = jax_data.scan(lambda carry, b: (carry, b["x"]), 0,
                                     state, batch_fn=batch_fn, length=length)
      return state, xs

    vmapped = jax.jit(jax.vmap(run))
    stacked, got = vmapped(stacked)
    _, more = vmapped(stacked)
    got = np.concatenate([np.asarray(got), np.asarray(more)], axis=1)
    for c in range(chains):
      expected, _ = cs.stream_batches(30 + c, 0, 2 * length, mb, n, True,
                                      False)
      np.testing.assert_array_equal(got[c], expected, err_msg=repr(loader))
    release_fn()
  if pipelines.callback == "auto" and jax.default_backend() == "cpu":
    # Whole chunks interleaved, read in place by the group; the refreshes
    # of the first and last steps (batch_fn's path) chain after chain.
    assert not regions
    assert any(i.interleaved for i in intos) and alike and all(alike)
  elif limits is IN_PLACE:  # into pure_callback's answer, lane axis first
    assert not regions
    assert intos and not any(i.interleaved for i in intos) and all(alike)


def test_a_refresh_of_many_chains_reads_once():
  """The chunks of 16 vmapped chains come from one batched read of the
  source, and their next chunks from one more per step ahead."""
  source = ComputedInBatches(10_000)
  loader = jax_data.SourceDataLoader(source, workers=0)
  pipeline = jax_data.random_reference_data(loader, 4, 8)
  init_fn, batch_fn, release_fn = pipeline
  stacked = jax.tree_util.tree_map(
      lambda *s: jnp.stack(s),
      *[init_fn(seed=c, shuffle=True, stream="counter") for c in range(16)])
  step = jax.jit(jax.vmap(batch_fn)).lower(stacked).compile()
  before = source.reads  # the loader probed the source
  jax.block_until_ready(step(stacked))
  assert pipeline.host.wait_idle()
  # Chunk 0 of all chains, then chunks 1 and 2 ahead: 3 reads, not 48.
  assert source.reads - before == 3, source.reads - before
  release_fn()


@pytest.mark.parametrize("limits", [StoreLimits(), IN_PLACE],
                         ids=["ahead", "read_in_place"])
def test_the_same_chain_twice_in_one_request(limits, pipelines):
  """Two lanes of one chain at different chunks (a state used twice, once
  advanced) are served, each its own chunk; nothing deadlocks."""
  n, cache, mb = 500, 2, 4
  loader = jax_data.NumpyDataLoader(x=np.arange(n))
  loader.store_limits = limits
  pipeline = pipelines.random_reference_data(loader, cache, mb)
  init_fn, batch_fn, release_fn = pipeline
  state = init_fn(seed=3, shuffle=True, stream="counter")
  later = jax_data.state_to_pytree(pipeline, state)
  later["chunk"] = np.int32(7)
  later = jax_data.state_from_pytree(pipeline, later)
  stacked = jax.tree_util.tree_map(lambda *s: jnp.stack(s), state, later,
                                   state)
  _, batch = jax.jit(jax.vmap(batch_fn))(stacked)
  x = np.asarray(batch["x"])
  stream = cs.stream_batches(3, 0, 8 * cache, mb, n, True, False)[0]
  np.testing.assert_array_equal(x[0], stream[0])
  np.testing.assert_array_equal(x[1], stream[7 * cache])
  np.testing.assert_array_equal(x[2], stream[0])
  release_fn()


def test_a_failing_record_fails_the_request_and_is_retried():
  """A record that cannot be read fails the request of the chains read
  with it, naming the record; once readable, the same request succeeds
  with the chains' exact streams."""
  n, cache, mb, chains = 50, 2, 5, 4
  source = ComputedInBatches(n)
  loader = jax_data.SourceDataLoader(source, workers=0)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, cache, mb)
  stacked = jax.tree_util.tree_map(
      lambda *s: jnp.stack(s),
      *[init_fn(seed=c, shuffle=True, stream="counter")
        for c in range(chains)])
  source.fail_at = int(cs.stream_batches(1, 0, 1, mb, n, True,
                                         False)[0][0, 0])
  step = jax.jit(jax.vmap(batch_fn))
  with pytest.raises(Exception, match=f"record {source.fail_at}"):
    jax.block_until_ready(step(stacked))
  source.fail_at = None
  _, batch = step(stacked)
  for c in range(chains):
    np.testing.assert_array_equal(
        np.asarray(batch["x"])[c],
        cs.stream_batches(c, 0, 1, mb, n, True, False)[0][0])
  release_fn()


@pytest.mark.parametrize("mode", [{"shuffle": True},
                                  {"shuffle": True, "in_epochs": True}])
def test_an_exact_shuffle_larger_than_memory_is_refused_at_init(mode):
  """An exact shuffled chain over 1e12 records would draw an 8 TB
  permutation at its first batch: ``init_fn`` refuses it, naming the
  stream and the count, and the counter-based stream of the same records
  serves its exact batches."""
  # Each record's index in two leaves that JAX's int32 holds (x64 off).
  loader = jax_data.SourceDataLoader(
      ComputedInBatches(10**12), workers=0,
      transform=lambda r: {"high": r["x"] >> 30, "low": r["x"] & (2**30 - 1)})
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 2, 3)
  with pytest.raises(ValueError, match=r"stream='exact'.*1,000,000,000,000 "
                     r"observations.*stream='counter'"):
    init_fn(seed=4, stream="exact", **mode)
  _, batch = jax.jit(batch_fn)(init_fn(seed=4, stream="counter", **mode))
  expected = cs.stream_batches(4, 0, 1, 3, 10**12, True,
                               mode.get("in_epochs", False))[0][0]
  assert expected.max() >= 2**31  # records whose index int32 cannot hold
  np.testing.assert_array_equal(
      (np.asarray(batch["high"], np.int64) << 30)
      + np.asarray(batch["low"]),
      expected)
  release_fn()


def test_an_exact_shuffle_is_refused_by_its_peak_not_one_permutation(
    monkeypatch):
  """A chain keeps up to two permutations and draws the next beside them
  (32 bytes per observation at its peak): on a machine of 12 MiB, 1.2e6
  observations (9.2 MiB a permutation) are refused, as 3e5 are not."""
  real = os.sysconf
  pages = 12 * 2**20 // real("SC_PAGE_SIZE")
  monkeypatch.setattr(os, "sysconf", lambda name: pages if (
      name == "SC_PHYS_PAGES") else real(name))
  for count, refused in ((1_200_000, True), (300_000, False)):
    loader = jax_data.SourceDataLoader(ComputedInBatches(count), workers=0)
    init_fn, _, release_fn = jax_data.random_reference_data(loader, 2, 3)
    if refused:
      with pytest.raises(ValueError, match=r"keeps up to two: 32 bytes per "
                         r"observation while it draws one"):
        init_fn(seed=4, stream="exact", shuffle=True)
    else:
      init_fn(seed=4, stream="exact", shuffle=True)
    release_fn()


def test_a_chunk_counter_past_int32_says_it_wrapped():
  """A chain at its last int32 chunk is served that chunk's exact batches;
  the step past it wraps the counter, and the request says so rather than
  blaming a hand-built state alone."""
  n, cache, mb = 100, 2, 4
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(x=np.arange(n)), cache, mb)
  last = 2**31 - 1
  state = init_fn(seed=5, stream="counter")._replace(
      chunk=jnp.int32(last), position=jnp.int32(cache - 1))
  step = jax.jit(batch_fn)
  state, batch = step(state)
  np.testing.assert_array_equal(
      np.asarray(batch["x"]),
      cs.stream_batches(5, last * cache + cache - 1, 1, mb, n, False,
                        False)[0][0])
  with pytest.raises(Exception, match=r"chunk=-2147483648 of chain .*"
                     r"wrapped, past 2\*\*31 - 1 chunks"):
    jax.block_until_ready(step(state))
  release_fn()


def test_a_device_chains_wrapped_counter_says_it_counts_batches():
  """A device loader's chain counts batches, not chunks of
  cached_batches_count: the message said chunks alone."""
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      jax_data.DeviceNumpyDataLoader(x=np.arange(10)), 2, 3)
  state = init_fn(seed=0, stream="counter")._replace(
      chunk=jnp.int32(-2**31))
  with pytest.raises(ValueError, match=r"chunk=-2147483648.*past 2\*\*31 - "
                     r"1 chunks of cached_batches_count batches \(batches, "
                     r"on a device loader\)"):
    batch_fn(state)
  release_fn()


def test_a_failing_record_is_named_by_its_chain_and_spares_the_others():
  """A record that only one chain of a group draws fails that chain's
  chunk alone: a request of all chains names that chain, and each other
  chain gets its exact stream on its first request, also when the
  group's failed chunk was read ahead."""
  n, cache, mb, chains = 200, 2, 4, 6
  streams = [cs.stream_batches(c, 0, 3 * cache, mb, n, False, False)[0]
             for c in range(chains)]
  owners = {}  # record -> the (chain, batch) pairs that draw it
  for c, stream in enumerate(streams):
    for b, row in enumerate(stream):
      for record in row.tolist():
        owners.setdefault(record, set()).add((c, b))
  # A record drawn by one chain, in its third chunk only.
  bad, failing = next((record, c) for record, drawn in sorted(owners.items())
                      for c in {c for c, _ in drawn}
                      if all(d == c and b >= 2 * cache for d, b in drawn))
  source = ComputedInBatches(n)
  loader = jax_data.SourceDataLoader(source, workers=0)
  pipeline = jax_data.random_reference_data(loader, cache, mb)
  init_fn, batch_fn, release_fn = pipeline
  state = init_fn(seed=range(chains))
  step = jax.jit(jax.vmap(batch_fn))
  source.fail_at = bad
  for _ in range(2 * cache):  # chunks 0 and 1; chunk 2 is read ahead
    state, _ = step(state)
  assert pipeline.host.wait_idle()
  one = jax.jit(batch_fn)
  for c in set(range(chains)) - {failing}:
    _, batch = one(jax.tree_util.tree_map(lambda a, c=c: a[c], state))
    np.testing.assert_array_equal(np.asarray(batch["x"]),
                                  streams[c][2 * cache])
  with pytest.raises(Exception, match=f"chain {failing}, chunk 2: .*"
                     f"record {bad}"):
    jax.block_until_ready(step(state))
  release_fn()


def test_release_while_a_group_is_read():
  """Releasing the pipeline while a group of chains is being read ends
  the waiting request with PipelineReleasedError, not a hang."""
  armed, started, go_on = (threading.Event() for _ in range(3))

  class Slow(ComputedInBatches):
    def __getitems__(self, indices):
      if armed.is_set():  # not the reads of the loader's set-up
        started.set()
        go_on.wait(10)
      return super().__getitems__(indices)

  loader = jax_data.SourceDataLoader(Slow(100), workers=0)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, 2, 4)
  stacked = jax.tree_util.tree_map(
      lambda *s: jnp.stack(s),
      *[init_fn(seed=c, shuffle=True, stream="counter") for c in range(4)])
  step = jax.jit(jax.vmap(batch_fn))
  errors = []
  armed.set()

  def run():
    try:
      jax.block_until_ready(step(stacked))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  thread = threading.Thread(target=run)
  thread.start()
  assert started.wait(30)
  release_fn()
  go_on.set()
  thread.join(30)
  assert not thread.is_alive()
  assert errors and "released" in str(errors[0])


@pytest.mark.parametrize("shuffle,in_epochs", MODES)
@pytest.mark.parametrize("n", [3, 1000, 10**8])
def test_a_stream_drawn_ahead_gives_each_draw_its_own_batches(
    n, shuffle, in_epochs):
  """A chain draws several chunks' indices at once and serves the next
  draws from them: every draw still equals the stream at its position,
  through forward draws, seeks back and ahead, a restored state of another
  seed, trimming and draws of a part's columns."""
  observations = jax_data.sampling.ObservationRange(2, n)
  stream = CounterStream(observations, 5, 11, shuffle, in_epochs)
  rng = np.random.default_rng(0)
  for step in range(60):
    action = rng.integers(6)
    if action == 0:
      stream.seek_batch(int(rng.integers(0, 10**6)))
    elif action == 1:
      stream.set_state({**stream.get_state(),
                        "seed": int(rng.integers(0, 2**63)),
                        "batch": int(rng.integers(0, 100))})
    elif action == 2:
      stream.trim()
    seed, first = stream.seed, stream.get_state()["batch"]
    count = int(rng.integers(1, 40))
    columns = slice(1, 4) if action == 3 else None
    got, mask = stream.draw(count, columns)
    expected, expected_mask = cs.stream_batches(
        seed, first, count, 5, n, shuffle, in_epochs, 2, columns=columns)
    np.testing.assert_array_equal(got, expected, err_msg=str(step))
    if expected_mask is None:
      assert mask is None
    else:
      np.testing.assert_array_equal(mask, expected_mask)
    assert stream.get_state()["batch"] == first + count


@pytest.mark.parametrize("early", [False, True], ids=["after", "beside"])
@pytest.mark.parametrize("shuffle,in_epochs", MODES)
def test_a_group_draws_its_next_indices_ahead(shuffle, in_epochs, early,
                                              monkeypatch):
  """A group of chains produced together draws the indices of its next
  chunks in another thread, once it has read this chunk's rows or (where
  cores are to spare) beside that read and split, and takes them when asked for
  those chunks: every chunk equals each chain's stream through forward
  steps, a seek of one chain, and trims; indices drawn ahead for chunks no
  longer asked for are not used."""
  from jax_data.loaders import gather
  from jax_data.loaders import indexed
  from jax_data.loaders.chains import RandomChain

  caller = threading.get_ident()
  draws = []  # the thread of each draw
  events = []  # the order of reads and of draws handed to another thread
  made = indexed.chain_batches

  split_ahead = []  # whether each draw in another thread was split

  def spied(*args, **kwargs):
    draws.append(threading.get_ident() == caller)
    if not draws[-1]:
      split_ahead.append(kwargs.get("split") is not None)
    return made(*args, **kwargs)

  submit, read = gather.Gatherer.submit, jax_data.NumpyDataLoader._read
  monkeypatch.setattr(indexed, "chain_batches", spied)
  monkeypatch.setattr(gather.Gatherer, "draws_early", early)
  monkeypatch.setattr(gather.Gatherer, "submit", lambda self, work: (
      events.append("ahead"), submit(self, work))[1])
  monkeypatch.setattr(jax_data.NumpyDataLoader, "_read", lambda *a: (
      events.append("read"), read(*a))[1])
  n, cache, mb = 1000, 3, 4
  loader = jax_data.NumpyDataLoader(x=np.arange(n))
  layout = loader.chunk_layout(cache, mb)
  observations = jax_data.sampling.ObservationRange(0, n)
  cursors = [loader.add_chain(RandomChain(
      40 + c, observations, shuffle, in_epochs, "counter"), layout)[2]
             for c in range(4)]
  at = [0] * 4
  for step in range(8):
    if step == 4:  # one chain moves elsewhere: the drawn ahead are stale
      cursors[1].seek(cursors[1].position_at(9))
      at[1] = 9
    if step == 6:
      cursors[0].trim()
    chunks = type(cursors[0]).produce_group(cursors, at, layout, np.empty)
    for c, chunk in enumerate(chunks):
      expected, mask = cs.stream_batches(40 + c, at[c] * cache, cache, mb,
                                         n, shuffle, in_epochs)
      np.testing.assert_array_equal(chunk.leaves[0], expected)
      np.testing.assert_array_equal(
          chunk.mask, np.ones_like(expected, bool) if mask is None else mask)
      assert chunk.span[1] == c
    at = [a + 1 for a in at]
  cursors[0]._drawn[1].result()  # pylint: disable=protected-access
  # In the caller: the first chunk, after the seek, after the trim.
  assert draws.count(True) == 3, draws
  assert draws.count(False) == 8, draws
  assert events == (["ahead", "read"] if early else ["read", "ahead"]) * 8
  assert split_ahead == [early] * 8  # in one thread where cores are few
  for cursor in cursors:
    cursor.close()


def test_lanes_of_one_group_are_copied_once_per_leaf(monkeypatch):
  """A refresh whose lanes are one group's chunks in its order is one copy
  per leaf and the mask; the same chunks in another order are copied lane
  by lane, to the same result."""
  from jax_data.loaders.chains import RandomChain
  from jax_data.loaders.chains import spanned
  from jax_data.serving import host as host_module

  n, cache, mb = 500, 2, 3
  loader = jax_data.NumpyDataLoader(x=np.arange(n), y=np.arange(n) * 2.0)
  layout = loader.chunk_layout(cache, mb)
  observations = jax_data.sampling.ObservationRange(0, n)
  cursors = [loader.add_chain(RandomChain(c, observations, True, True,
                                          "counter"), layout)[2]
             for c in range(5)]
  chunks = type(cursors[0]).produce_group(cursors, [0] * 5, layout,
                                          np.empty)
  assert spanned(chunks) is chunks[0].span[0]
  assert spanned(chunks[::-1]) is None and spanned(chunks[:4]) is None
  for order in (list(range(5)), [4, 0, 3, 1, 2]):
    lanes = [chunks[g] for g in order]
    outs = [np.full(shape, -1, dtype)
            for shape, dtype in layout.formats(5)]
    copies = host_module._copies(outs, lanes, None, False)  # pylint: disable=protected-access
    assert len(copies) == (3 if order == sorted(order) else 15)
    for out, source in copies:
      np.copyto(out, source)
    for lane, chunk in enumerate(lanes):
      for out, leaf in zip(outs, chunk.leaves + [chunk.mask]):
        np.testing.assert_array_equal(out[lane], leaf)
  for cursor in cursors:
    cursor.close()


@pytest.mark.parametrize("lane_axis", [0, 1], ids=["lanes_first",
                                                   "lanes_second"])
def test_buffers_given_whole_are_the_regions_of_their_chunks(lane_axis):
  """Compiled code's buffers handed over as one span give a group the same
  regions, and so the same rows in place, as the same buffers handed over
  chunk by chunk; a subset of their lanes is checked chunk by chunk."""
  from jax_data.loaders.chains import Chunk
  from jax_data.loaders.chains import RandomChain
  from jax_data.loaders.chains import Span
  from jax_data.loaders.chains import readable
  from jax_data.serving import production

  n, cache, mb, lanes = 500, 3, 4, 5
  loader = jax_data.NumpyDataLoader(x=np.arange(n), y=np.arange(n) * 2.0)
  layout = loader.chunk_layout(cache, mb)
  observations = jax_data.sampling.ObservationRange(0, n)

  def buffers():  # lane axis first, in memory first or second
    return [np.moveaxis(np.full((shape[1], shape[0]) + shape[2:], -1, dtype),
                        1, 0) if lane_axis else np.full(shape, -1, dtype)
            for shape, dtype in layout.formats(lanes)]

  got = []
  for whole in (True, False):
    outs = buffers()
    if whole:
      targets = Span(outs[:-1], outs[-1]).chunks([readable] * lanes)
    else:
      targets = [Chunk([o[g] for o in outs[:-1]], outs[-1][g])
                 for g in range(lanes)]
    regions = production._Regions(targets, np.empty)  # pylint: disable=protected-access
    assert regions.interleaved == bool(lane_axis)
    cursors = [loader.add_chain(RandomChain(c, observations, True, False,
                                            "counter"), layout)[2]
               for c in range(lanes)]
    chunks = type(cursors[0]).produce_group(cursors, [0] * lanes, layout,
                                            regions)
    for chunk, target in zip(chunks, targets):
      for leaf, out in zip(chunk.leaves, target.leaves):
        assert np.shares_memory(leaf, out)  # read in place
        np.testing.assert_array_equal(leaf, out)
    got.append([o.copy() for o in outs[:-1]])
    for cursor in cursors:
      cursor.close()
  for a, b in zip(*got):
    np.testing.assert_array_equal(a, b)
  # Lanes 1 to 4 of 5: one region each lane after lane, none batch by
  # batch (other lanes' batches lie between theirs).
  outs = buffers()
  some = Span(outs[:-1], outs[-1]).chunks([readable] * lanes)[1:]
  regions = production._Regions(some, np.empty)  # pylint: disable=protected-access
  assert not regions.interleaved
  spans = regions._spans  # pylint: disable=protected-access
  assert all((span is None) == bool(lane_axis) for span in spans)


def test_a_span_is_checked_as_its_chunks_are():
  """A group's span passes the layout's check exactly when each of its
  chunks would, and a failure names the shape expected."""
  from jax_data.loaders.chains import Span
  from jax_data.loaders.chains import readable

  loader = jax_data.NumpyDataLoader(x=np.arange(10.0), y=np.arange(10))
  layout = loader.chunk_layout(3, 2)
  shapes = layout.formats(4)
  good = Span([np.zeros(s, d) for s, d in shapes[:-1]],
              np.ones(*shapes[-1]))
  assert layout.check_span(good, 4) is good
  for chunk in good.chunks([readable] * 4):
    assert layout.check(chunk) is chunk
  wrong_dtype = Span([good.leaves[0].astype(np.float64), good.leaves[1]],
                     good.mask)
  wrong_lanes = Span([leaf[:3] for leaf in good.leaves], good.mask[:3])
  cases = ((wrong_dtype, 4, r"\(4, 3, 2\) and dtype float32"),
           (wrong_lanes, 4, r"\(4, 3, 2\)"), (good, 3, r"\(3, 3, 2\)"))
  for span, lanes, expected in cases:
    with pytest.raises(ValueError, match=f"expected shape {expected}"):
      layout.check_span(span, lanes)
  with pytest.raises(ValueError, match="dtype"):
    layout.check(wrong_dtype.chunks([readable] * 4)[0])


def test_a_span_chunk_is_the_views_of_its_lane():
  """A chunk of a span reads as its lane of every leaf and of the mask,
  the same arrays each time."""
  from jax_data.loaders.chains import Span
  from jax_data.loaders.chains import readable

  x = np.arange(24).reshape(4, 3, 2)
  mask = np.arange(12).reshape(4, 3) % 2 == 0
  chunks = Span([x], mask).chunks([readable] * 4)
  for g, chunk in enumerate(chunks):
    assert chunk.span[1] == g and chunk.check is readable
    np.testing.assert_array_equal(chunk.leaves[0], x[g])
    np.testing.assert_array_equal(chunk.mask, mask[g])
    assert chunk.leaves is chunk.leaves and chunk.mask is chunk.mask
    assert np.shares_memory(chunk.leaves[0], x)


def test_an_answer_keeps_its_first_settlement():
  """The future of a chunk read in place answers as a future does: its
  first result or error, kept; asked before it has one, it says so."""
  import concurrent.futures

  from jax_data.serving.chain_records import Answer
  from jax_data.serving.chain_records import settle

  answer = Answer()
  assert not answer.done()
  with pytest.raises(concurrent.futures.InvalidStateError):
    answer.result()
  settle(answer, "chunk")
  settle(answer, error=ValueError("late"))
  assert answer.done() and answer.result() == "chunk"
  assert answer.exception() is None
  failed = Answer()
  settle(failed, error=ValueError("unreadable"))
  settle(failed, "late")
  assert isinstance(failed.exception(), ValueError)
  with pytest.raises(ValueError, match="unreadable"):
    failed.result()



def test_stored_futures_wake_their_waiters_and_keep_their_first_answer():
  """A stored chunk's future answers as a future does: a request waiting
  in another thread wakes at its first result or error, and later ones
  are ignored; futures that share a condition wake only when their own
  answer comes."""
  import threading

  from jax_data.serving.chain_records import StoredFuture
  from jax_data.serving.chain_records import settle

  changed = threading.Condition(threading.Lock())
  first, second = StoredFuture(changed), StoredFuture(changed)
  got = []
  waiters = [threading.Thread(target=lambda f=f: got.append(f.result()),
                              daemon=True) for f in (first, second)]
  for waiter in waiters:
    waiter.start()
  settle(first, "chunk")
  settle(first, error=ValueError("late"))
  waiters[0].join(10)
  assert got == ["chunk"] and not second.done() and waiters[1].is_alive()
  settle(second, "other")
  waiters[1].join(10)
  assert got == ["chunk", "other"]
  failed = StoredFuture(changed)
  settle(failed, error=ValueError("unreadable"))
  settle(failed, "late")
  assert isinstance(failed.exception(), ValueError)
  with pytest.raises(ValueError, match="unreadable"):
    failed.result()

def _stacked(init_fn, seeds, **mode):
  return jax.tree_util.tree_map(
      lambda *s: jnp.stack(s),
      *[init_fn(seed=s, stream="counter", **mode) for s in seeds])


@pytest.mark.parametrize("rows", ["arrays", "memmap", "dropped"])
def test_a_group_of_chains_is_served_as_one(rows, pipelines, tmp_path,
                                            monkeypatch):
  """On a CPU device, a refresh of vmapped counter-based chains whose rows
  are read as fast as from memory is read straight into compiled code's
  buffers by the group, whatever the store's limits: the chains' records
  and cursors are not touched and nothing is stored, and a chain served
  alone afterwards goes on with its exact stream. Arrays in memory are
  from the first refresh; a memmap's rows once a gather showed them in the
  page cache (the first refresh is the store's, as are all of a memmap
  whose pages are dropped after each read, and all through
  pure_callback: chunks read ahead)."""
  from jax_data.serving import group_refresh

  served = []
  serve = group_refresh.GroupRefresh.serve_into

  def spied(self, *args, **kwargs):
    served.append(serve(self, *args, **kwargs))
    return served[-1]

  monkeypatch.setattr(group_refresh.GroupRefresh, "serve_into", spied)
  n, cache, mb, chains = 1000, 4, 8, 6
  x = np.arange(n)
  if rows != "arrays":
    np.save(tmp_path / "x.npy", x)
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    # Every gather counts as one from the page cache, whatever the load.
    monkeypatch.setattr(file_rows, "_SLOW_ROW_SECONDS", 1.0)
  loader = jax_data.NumpyDataLoader(copy=False, x=x,
                                    drop_file_pages=rows == "dropped")
  pipeline = pipelines.random_reference_data(loader, cache, mb)
  init_fn, batch_fn, release_fn = pipeline
  stacked = _stacked(init_fn, range(50, 50 + chains), shuffle=True)
  host = pipeline.host
  before = [(host.chain(c).next_index, host.chain(c).cursor.position())
            for c in host.chains()]
  step = jax.jit(jax.vmap(batch_fn))
  got = []
  for _ in range(2 * cache + 1):
    stacked, batch = step(stacked)
    got.append(np.asarray(batch["x"]))
  got = np.stack(got, axis=1)
  for c in range(chains):
    np.testing.assert_array_equal(
        got[c], cs.stream_batches(50 + c, 0, 2 * cache + 1, mb, n, True,
                                  False)[0])
  assert host.wait_idle()
  grouped = (rows != "dropped" and pipelines.callback == "auto"
             and jax.default_backend() == "cpu")
  if not grouped:
    assert not any(served)
  elif rows == "memmap":
    assert served[0] is False and served[1:] and all(served[1:])
  else:
    assert served and all(served)
    after = [(host.chain(c).next_index, host.chain(c).cursor.position())
             for c in host.chains()]
    assert after == before
  assert any(host.chain(c).chunks for c in host.chains()) != (
      grouped and rows == "arrays")
  # One chain alone, through the store's path, from where the group left it.
  alone = jax.tree_util.tree_map(lambda a: a[3], stacked)
  _, batch = jax.jit(batch_fn)(alone)
  np.testing.assert_array_equal(
      batch["x"], cs.stream_batches(53, 2 * cache + 1, 1, mb, n, True,
                                    False)[0][0])
  release_fn()


def test_a_chain_taken_out_is_no_longer_served_by_its_group(pipelines):
  """The group a request's chains formed is forgotten once one of them is
  taken out of the pipeline: the next request names the missing chain."""
  loader = jax_data.NumpyDataLoader(x=np.arange(100))
  pipeline = pipelines.random_reference_data(loader, 2, 4)
  init_fn, batch_fn, release_fn = pipeline
  stacked = _stacked(init_fn, range(4))
  step = jax.jit(jax.vmap(batch_fn))
  jax.block_until_ready(step(stacked))
  gone = int(stacked.chain[2])
  pipeline.host.remove_chain(gone)
  with pytest.raises(Exception, match=f"chain {gone} was not created"):
    jax.block_until_ready(step(stacked))
  release_fn()


def test_a_group_whose_read_fails_reports_it_as_any_chunk(tmp_path,
                                                          pipelines):
  """A failure while a group is read in place (a memmap's file truncated
  under it) reaches the caller as the store's path reports it, naming the
  array and the file; the pipeline stays usable once the file is whole."""
  path = tmp_path / "x.npy"
  np.save(path, np.arange(4000, dtype=np.int64))
  loader = jax_data.NumpyDataLoader(copy=False,
                                    x=np.load(path, mmap_mode="r"))
  loader.store_limits = IN_PLACE
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(
      loader, 2, 4)
  stacked = _stacked(init_fn, range(4), shuffle=True)
  step = jax.jit(jax.vmap(batch_fn))
  jax.block_until_ready(step(stacked))
  whole = path.read_bytes()
  with open(path, "r+b") as f:
    f.truncate(1000)
  with pytest.raises(Exception, match="OSError: the file of array 'x'.*was "
                     "truncated to 1000 bytes"):
    jax.block_until_ready(step(stacked))
  path.write_bytes(whole)
  _, batch = step(stacked)
  np.testing.assert_array_equal(
      np.asarray(batch["x"])[1],
      cs.stream_batches(1, 0, 1, 4, 4000, True, False)[0][0])
  release_fn()


def test_same_memory_ignores_the_strides_of_axes_of_one():
  """A lane-first view of a buffer whose lane axis is second in memory is
  the buffer's memory when its batches axis has length one (NumPy gives
  such axes any stride), and not when the layouts differ."""
  from jax_data.serving.group_refresh import same_memory
  buffer = np.zeros((1, 5, 3))  # (batches, lanes, rows)
  view = np.moveaxis(buffer, 1, 0)
  assert same_memory(view, buffer.reshape(5, 1, 3))
  assert same_memory(view, view)
  longer = np.zeros((2, 5, 3))
  assert not same_memory(np.moveaxis(longer, 1, 0), longer.reshape(5, 2, 3))


def test_indices_drawn_ahead_in_step_order_keep_their_values():
  """Indices drawn ahead for a read with the lane axis second are laid out
  step by step: the same values, whose step-major order is a view; those
  of more rows than one read takes stay as drawn."""
  from jax_data.loaders import indexed

  drawn = np.random.default_rng(0).integers(0, 100, (5, 3, 4))
  ordered = indexed._interleaved_order(drawn)  # pylint: disable=protected-access
  np.testing.assert_array_equal(ordered, drawn)
  flat = ordered.transpose(1, 0, 2).reshape(-1)
  assert np.shares_memory(flat, ordered)
  np.testing.assert_array_equal(flat, drawn.transpose(1, 0, 2).reshape(-1))
  many = np.zeros((1, indexed._INTERLEAVED_ROWS + 1, 1), np.int64)  # pylint: disable=protected-access
  assert indexed._interleaved_order(many) is many  # pylint: disable=protected-access


@pytest.mark.parametrize("rows", ["arrays", "memmap", "dropped"])
@pytest.mark.parametrize("cache", [1, 3])
@pytest.mark.parametrize("shuffle,in_epochs", MODES)
def test_a_vmapped_scan_reads_a_group_into_its_buffers_as_they_are(
    cache, shuffle, in_epochs, rows, tmp_path, monkeypatch):
  """A vmapped ``jax_data.scan`` of counter-based chains on a CPU: a whole
  chunk's refresh is read by the group straight into compiled code's
  buffers, whose bytes are laid out lane axis second, as they are
  (``GroupRefresh.serve_lanes_second_into``), and every chain's batches
  and masks are its own stream, over chunks and calls, epochs' fillers
  masked. A memmap's refreshes too small to read in place are the store's
  (produced ahead) until a gather showed its rows in the page cache, and
  all of them where its pages are dropped after each read; the group is
  asked once per refresh, not again through lane-first views."""
  if jax.default_backend() != "cpu":
    pytest.skip("compiled code's buffers are the host's on a CPU")
  from jax_data.serving import group_refresh
  from jax_data.serving.host import Host

  served, tried = [], []
  serve = group_refresh.GroupRefresh.serve_lanes_second_into
  serve_views = Host.serve_into

  def spied(self, *args, **kwargs):
    served.append(serve(self, *args, **kwargs))
    return served[-1]

  def spied_views(self, *args, **kwargs):
    tried.append(kwargs.get("group_tried", False))
    return serve_views(self, *args, **kwargs)

  monkeypatch.setattr(group_refresh.GroupRefresh, "serve_lanes_second_into",
                      spied)
  monkeypatch.setattr(Host, "serve_into", spied_views)
  n, mb, seeds, length = 50, 4, [20, 21, 7, 2**40, 3], 3 * cache + 4
  x = np.arange(n)
  if rows != "arrays":
    np.save(tmp_path / "x.npy", x)
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    # Every gather counts as one from the page cache, whatever the load.
    monkeypatch.setattr(file_rows, "_SLOW_ROW_SECONDS", 1.0)
  loader = jax_data.NumpyDataLoader(copy=False, x=x, y=np.arange(n) * 2.0,
                                    drop_file_pages=rows == "dropped")
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader, cache, mb)
  state = _stacked(init_fn, seeds, shuffle=shuffle, in_epochs=in_epochs)

  def f(carry, item):
    batch, info = item
    return carry, (batch["x"], batch["y"], info.mask)

  run = jax.jit(jax.vmap(lambda s: jax_data.scan(
      f, 0, s, batch_fn=batch_fn, length=length, information=True)))
  for call in range(2):
    (_, state), (x, y, mask) = run(state)
    for c, seed in enumerate(seeds):
      want, want_mask = cs.stream_batches(seed, call * length, length, mb, n,
                                          shuffle, in_epochs)
      np.testing.assert_array_equal(x[c], want)
      np.testing.assert_array_equal(y[c], want * 2.0)
      np.testing.assert_array_equal(
          mask[c], np.ones(want.shape, bool) if want_mask is None
          else want_mask)
  if rows == "arrays":
    assert served and all(served)
  elif rows == "memmap":
    assert served[0] is False and served[1:] and all(served[1:])
  else:
    assert served and not any(served)
  # Each refresh the group declined went the store's way without asking it
  # again; the others never got there.
  assert sum(tried) == served.count(False)
  if in_epochs:
    assert not np.asarray(mask).all()  # the check saw fillers
  release_fn()
