"""Counter-based index streams: bijections, quality, the same stream on the
host and on the device, and on every loader that reads rows by index."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jax_data
from jax_data import counter_chains
from jax_data import counter_streams as cs
from jax_data.counter_chains import CounterStream
from jax_data.streams import device_streams
from tests.records import Computed

# Significance of the statistical tests: with fixed seeds each test is
# deterministic; a correct generator fails one with this probability.
ALPHA = 1e-3


@pytest.mark.parametrize("n", [0, 2**63, 2**63 + 5, 2**64 - 1])
def test_a_domain_past_int64_indices_is_refused(n):
  """The host's indices are int64: past 2**63 they came out negative."""
  for draw in (lambda: cs.permute(1, 0, np.arange(10), n),
               lambda: cs.uniform(1, np.arange(10), n)):
    with pytest.raises(ValueError, match=f"1 <= n < 2\\*\\*63 .*got n={n}"):
      draw()
  assert cs.permute(1, 0, np.arange(1000), 2**63 - 1).min() >= 0
  assert cs.uniform(1, np.arange(1000), 2**63 - 1).min() >= 0


@pytest.mark.parametrize("n", [10, 1000, 10**6])
def test_offsets_outside_the_epoch_are_refused(n):
  """An offset is in 0 .. n - 1: one in [n, 2**b) gave an observation
  twice, a negative one wrapped round, past the domain (2**b) the walk
  never came back, and up to 16 observations NumPy's IndexError said
  nothing of offsets. Concrete JAX offsets are checked as NumPy's."""
  bits = cs.domain_bits(n)
  for bad in ([n], [-1], [0, 1, 2**bits - 1], [2**bits], [2**bits + 5]):
    for offsets in (np.array(bad), jnp.asarray(bad, jnp.int32)):
      xp = np if isinstance(offsets, np.ndarray) else jnp
      with pytest.raises(ValueError, match=re.escape(
          f"offsets must be in 0 .. n - 1 (n={n}), got offsets={bad}")):
        cs.permute(3, 0, offsets, n, xp)
  many = np.arange(-3, n + 20)
  with pytest.raises(ValueError, match=re.escape(
      f"{many.size} offsets of which [-3, -2, -1, {n}, {n + 1}] and more")):
    cs.permute(3, 0, many, n)
  with pytest.raises(TypeError, match=r"offsets must be integers.*float64"):
    cs.permute(3, 0, np.array([1.0]), n)
  for epoch in (-1, 2**64, np.array([0, -1])):
    with pytest.raises(ValueError, match=r"epoch must be .*got epoch="):
      cs.permute(3, epoch, np.array([0, 1]), n)
  with pytest.raises(ValueError, match=re.escape(
      "positions must be in 0 .. 2**63 - 1, got positions=[-1]")):
    cs.uniform(3, np.array([-1]), n)
  perm = cs.permute(3, 2**64 - 1, np.arange(n), n)
  np.testing.assert_array_equal(np.sort(perm), np.arange(n))


def test_bad_seeds_and_batch_arguments_are_named():
  """A seed is an integer in 0 .. 2**64 - 1: -1 drew seed 2**64 - 1's
  stream and 2**64 + 7 seed 7's, a float or a string failed deep inside.
  Empty batches and a truthy string for shuffle were served silently.
  Seeds' uint32 words, as the chains pass them, still draw."""
  draws = {
      "uniform": lambda seed: cs.uniform(seed, np.arange(3), 1000),
      "permute": lambda seed: cs.permute(seed, 0, np.arange(3), 1000),
      "stream_batches": lambda seed: cs.stream_batches(seed, 0, 2, 3, 1000,
                                                       True, False),
      "round_keys": lambda seed: cs.round_keys(seed, 0)}
  for draw in draws.values():
    for seed in (-1, 2**64, 2**64 + 7):
      with pytest.raises(ValueError, match=re.escape(
          f"seed must be between 0 and {2**64 - 1}, got seed={seed}")):
        draw(seed)
    for seed in (1.5, "3", None, [0, 1], True):
      with pytest.raises(TypeError, match=re.escape(
          f"seed must be an integer, got seed={seed!r}")):
        draw(seed)
  for bad, message in (
      (dict(mb_size=0), (ValueError, "mb_size must be at least 1, got "
                                     "mb_size=0")),
      (dict(count=-1), (ValueError, "count must be at least 0, got "
                                    "count=-1")),
      (dict(first=-1), (ValueError, "first must be at least 0, got "
                                    "first=-1")),
      (dict(count=2.0), (TypeError, "count must be an integer, got "
                                    "count=2.0")),
      (dict(shuffle="no"), (TypeError, "shuffle must be True or False, got "
                                       "shuffle='no'")),
      (dict(in_epochs=1), (TypeError, "in_epochs must be True or False, "
                                      "got in_epochs=1")),
      # These failed deep inside, or gave negative or float indices.
      (dict(n=1.5), (TypeError, "n must be an integer, got n=1.5")),
      (dict(n=True), (TypeError, "n must be an integer, got n=True")),
      (dict(start=-3), (ValueError, "start must be at least 0, got "
                                    "start=-3")),
      (dict(start=1.5), (TypeError, "start must be an integer")),
      (dict(first=2**62), (ValueError, "positions past 2**63 - 1 (int64), "
                                       f"got first={2**62}")),
      (dict(columns=5), (TypeError, "columns must be a slice")),
      (dict(first=jnp.uint32(0), xp=jnp, columns=slice(0, 1)),
       (TypeError, "with NumPy only"))):
    arguments = {**dict(seed=3, first=0, count=2, mb_size=3, n=1000,
                        shuffle=True, in_epochs=False), **bad}
    with pytest.raises(message[0], match=re.escape(message[1])):
      cs.stream_batches(**arguments)
  assert cs.stream_batches(3, 0, 0, 3, 1000, True, False)[0].shape == (0, 3)
  for call, message in (
      (lambda: cs.permute(0, 0, np.arange(1), 1.5), "n must be an integer"),
      (lambda: cs.uniform(0, np.arange(3), 10.0), "n must be an integer"),
      (lambda: cs.permute(0, np.array([0, 1]), np.arange(3), 10),
       r"epoch and offsets must broadcast together, got epoch of shape "
       r"\(2,\) and offsets of shape \(3,\)"),
      (lambda: cs.uniform((1, 2, 3), np.arange(3), 10),
       r"seed given as a tuple must be the seeds' \(low, high\) uint32"),
      # A tuple of positions skipped the range check and read as words.
      (lambda: cs.uniform(0, (-1, -2), 10), "positions given as a tuple")):
    with pytest.raises((TypeError, ValueError), match=message):
      call()
  seeds = np.array([0, 2**64 - 1], np.uint64)
  np.testing.assert_array_equal(
      cs.uniform(counter_chains.uint32_words(seeds), np.array([5, 5]), 1000),
      [cs.uniform(int(s), np.array([5]), 1000)[0] for s in seeds])


@pytest.mark.parametrize("n", [10, 1000, 10**6])
def test_traced_offsets_outside_the_epoch_end(n):
  """Traced offsets cannot be checked: those outside 0 .. n - 1 give
  unspecified observations (in 0 .. n - 1), never a walk without end, and
  leave the others' as they are."""
  bits = cs.domain_bits(n)
  offsets = np.array([0, n - 1, n, 2**bits - 1, 2**bits, 2**32 - 1, 5])
  got = jax.jit(lambda o: cs.permute(3, 0, o, n, jnp))(
      jnp.asarray(offsets, jnp.uint32))
  assert np.all(np.asarray(got) < n)
  inside = offsets < n
  np.testing.assert_array_equal(np.asarray(got)[inside],
                                cs.permute(3, 0, offsets[inside], n))


@pytest.mark.parametrize("n", [1, 2, 3, 16, 17, 1000, 65_537, 1_000_000])
def test_every_index_exactly_once_per_epoch(n):
  for seed in (0, 1, 2**40 + 7):
    for epoch in (0, 1, 2**33):
      perm = cs.permute(seed, epoch, np.arange(n), n)
      assert perm.dtype == np.int64
      np.testing.assert_array_equal(np.sort(perm), np.arange(n))


@pytest.mark.parametrize("n", [1, 3, 16, 17, 1000, 65_537])
def test_the_device_draws_the_host_stream(n):
  """jax.numpy computes the same indices as NumPy, bit for bit, in every
  mode, from any first batch, inside jit."""
  for shuffle, in_epochs in ((False, False), (True, False), (True, True)):
    host, mask = cs.stream_batches(5, 37, 20, 4, n, shuffle, in_epochs, 3)
    device, device_mask = jax.jit(
        lambda first, s=shuffle, e=in_epochs: cs.stream_batches(
            5, first, 20, 4, n, s, e, 3, jnp))(jnp.uint32(37))
    np.testing.assert_array_equal(np.asarray(device), host)
    if in_epochs:
      np.testing.assert_array_equal(np.asarray(device_mask), mask)
    else:
      assert mask is None and device_mask is None


def test_independent_draws_over_two_to_the_32_observations():
  """n = 2**32, the most the device takes and the one n whose hash needs
  no reduction: host and device agree (it overflowed once)."""
  positions = np.arange(1000) + 2**31
  host = cs.uniform(7, positions, 2**32)
  assert host.min() >= 0 and host.max() < 2**32
  device = jax.jit(lambda p: cs.uniform(7, p, 2**32, jnp))(
      jnp.asarray(positions, jnp.uint32))
  np.testing.assert_array_equal(np.asarray(device).astype(np.int64), host)


def test_a_permutation_of_two_to_the_32_observations_on_the_device():
  """n = 2**32, the most the device takes: every uint32 is an offset, and
  host and device agree (``uint32(n)`` overflowed before any was drawn)."""
  offsets = np.array([0, 1, 2, 2**31, 2**32 - 2, 2**32 - 1])
  host = cs.permute(7, 3, offsets, 2**32)
  assert host.min() >= 0 and host.max() < 2**32
  assert len(set(host.tolist())) == offsets.size
  device = jax.jit(lambda o: cs.permute(7, 3, o, 2**32, jnp))(
      jnp.asarray(offsets, jnp.uint32))
  np.testing.assert_array_equal(np.asarray(device).astype(np.int64), host)


@pytest.mark.parametrize("n", [2**31 + 11, 2**32 - 5, 2**32])
@pytest.mark.parametrize("shuffle, in_epochs", [(False, False), (True, False),
                                                (True, True)])
def test_stream_batches_on_the_device_past_int32(n, shuffle, in_epochs):
  """Indices past 2**31 came back negative (int32), and a shuffled
  stream's n past 2**31 - 1 raised JAX's OverflowError: uint32 now."""
  host, mask = cs.stream_batches(7, 5, 2, 3, n, shuffle, in_epochs)
  device, device_mask = cs.stream_batches(7, jnp.uint32(5), 2, 3, n, shuffle,
                                          in_epochs, xp=jnp)
  assert device.dtype == jnp.uint32
  np.testing.assert_array_equal(np.asarray(device).astype(np.int64), host)
  assert (mask is None) == (device_mask is None)
  small, _ = cs.stream_batches(7, jnp.uint32(5), 2, 3, 1000, shuffle,
                               in_epochs, xp=jnp)
  assert small.dtype == jnp.int32  # as before, below 2**31


@pytest.mark.parametrize("n, mb", [(2**32 - 1, 7), (2**32, 3), (1000, 7)])
def test_stream_batches_on_the_device_masks_an_epochs_padding(n, mb):
  """The padding of an epoch's last batch near 2**32 wrapped past it in
  uint32 and read as valid; start + n past 2**32 is refused (the indices
  wrapped)."""
  last = -(-n // mb) - 1
  host, mask = cs.stream_batches(5, last, 2, mb, n, True, True)
  device, device_mask = jax.jit(lambda f: cs.stream_batches(
      5, f, 2, mb, n, True, True, xp=jnp))(jnp.uint32(last))
  np.testing.assert_array_equal(np.asarray(device_mask), mask)
  np.testing.assert_array_equal(np.asarray(device).astype(np.int64), host)
  assert not mask[0].all() and mask[1].all()
  with pytest.raises(ValueError, match=r"start \+ n = "):
    cs.stream_batches(5, jnp.uint32(0), 1, mb, n, False, False,
                      start=2**32 - n + 1, xp=jnp)


def test_the_device_refuses_epochs_and_positions_it_cannot_hold():
  """uint32 there: an array epoch of 2**33 drew epoch 0's permutation, a
  position of 2**32 + 1 position 1's draw, in silence."""
  offsets = jnp.arange(6, dtype=jnp.uint32)
  with pytest.raises(ValueError, match=r"epoch must be in 0 \.\. 2\*\*32 - 1 "
                     r"as an array with jax.numpy"):
    cs.permute(5, np.full(6, 2**33), offsets, 1000, jnp)
  with pytest.raises(ValueError, match=r"positions must be in 0 \.\. 2\*\*32 "
                     r"- 1 with jax.numpy"):
    cs.uniform(9, np.array([2**32 + 1]), 1000, jnp)
  # A Python int epoch takes all 64 bits, on the device too.
  np.testing.assert_array_equal(
      cs.permute(5, 2**33, offsets, 1000, jnp),
      cs.permute(5, 2**33, np.arange(6), 1000))


def test_large_domains_on_the_host():
  """Indices above 2**32 (records up to 1e12 and beyond): every index in
  range, a seek to any position in O(1), epochs far apart distinct."""
  for n in (2**32 + 3, 10**12, 3 * 10**11):
    offsets = np.arange(10_000) + n - 10_000
    perm = cs.permute(9, 2**40, offsets, n)
    assert perm.min() >= 0 and perm.max() < n
    assert len(np.unique(perm)) == offsets.size
    drawn = cs.uniform(9, np.arange(10_000) + 10**15, n)
    assert drawn.min() >= 0 and drawn.max() < n
    assert len(np.unique(drawn)) > 9_990  # collisions are rare at this n


def test_domains_just_above_a_power_of_two_hold_every_index():
  """The bijection's domain is the power of two at or above n, computed in
  integers: for n just above 2**49 .. 2**60, where a float log2 rounds
  down, the last indices are in range (they cycle-walked forever)."""
  for n in (2**49 + 1, 2**50 + 1, 2**50 + 2, 2**53 + 1, 2**60 + 1,
            2**60 + 2_900, 5, 2**32, 2**32 + 1):
    assert 2**cs.domain_bits(n) >= n > 2**(cs.domain_bits(n) - 1) or n < 5
    offsets = np.arange(n - 3, n)
    perm = cs.permute(4, 1, offsets, n)
    assert perm.min() >= 0 and perm.max() < n
    assert len(np.unique(perm)) == 3
    if n < 2**63:  # n as a NumPy integer too
      np.testing.assert_array_equal(cs.permute(4, 1, offsets, np.int64(n)),
                                    perm)


@pytest.mark.parametrize("epochs", [1, 2, 8, 9, 40])
def test_an_epoch_per_offset_permutes_as_each_epoch_alone(epochs):
  """The host permutes a chunk epoch by epoch with keys hashed in Python
  ints, or (many epochs) with a key per offset: the same bijection either
  way, and the same as the device's uint32 arithmetic."""
  rng = np.random.default_rng(epochs)
  for n, seed in ((3, 0), (16, 1), (17, 2), (1000, 5), (65_537, 2**40 + 3),
                  (10**8, 2**64 - 1)):
    offsets = rng.integers(0, n, 300)
    epoch = np.sort(rng.integers(2**33, 2**33 + epochs, 300))
    each = [int(cs.permute(seed, int(e), np.array([o]), n)[0])
            for e, o in zip(epoch, offsets)]
    assert cs.permute(seed, epoch, offsets, n).tolist() == each
    for e in (0, 7, 2**33 + 1):
      with np.errstate(over="ignore"):  # uint32 arithmetic wraps
        keys = [int(k) for k in cs.round_keys(seed, e, np)]
      assert cs.round_keys_int(seed, e) == keys
  for n in (1000, 16):
    device = jax.jit(lambda e, o, n=n: cs.permute(5, e, o, n, jnp))(
        jnp.asarray(epoch % 1000, jnp.uint32), jnp.asarray(offsets % n,
                                                           jnp.uint32))
    np.testing.assert_array_equal(
        device, cs.permute(5, epoch % 1000, offsets % n, n))


def test_position_of_an_index_is_uniform_across_seeds():
  """Where index 0 lands in a permutation of 16, over 4,000 seeds: a
  chi-square test of uniformity."""
  n, seeds = 16, 4000
  where = [int(np.flatnonzero(cs.permute(s, 0, np.arange(n), n) == 0)[0])
           for s in range(seeds)]
  counts = np.bincount(where, minlength=n)
  assert stats.chisquare(counts).pvalue > ALPHA


def test_consecutive_draws_are_independent():
  """Pairs of consecutive indices: independent draws over a 10 x 10 table
  are uniform, and consecutive elements of permutations of 8 are uniform
  over the 56 ordered pairs of distinct elements."""
  pairs = cs.uniform(3, np.arange(200_001), 10)
  table = np.bincount(pairs[:-1] * 10 + pairs[1:], minlength=100)
  assert stats.chisquare(table).pvalue > ALPHA
  n = 8
  counts = np.zeros((n, n), int)
  for seed in range(3000):
    perm = cs.permute(seed, 0, np.arange(n), n)
    np.add.at(counts, (perm[:-1], perm[1:]), 1)
  assert counts.trace() == 0
  assert stats.chisquare(counts[~np.eye(n, dtype=bool)]).pvalue > ALPHA


def _parity(perm):
  """0 for an even permutation, 1 for an odd one: ``n`` less its cycles."""
  seen, cycles = np.zeros(perm.size, bool), 0
  for start in range(perm.size):
    cycles += not seen[start]
    while not seen[start]:
      seen[start], start = True, perm[start]
  return (perm.size - cycles) % 2


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_small_epochs_are_uniform_over_all_permutations(n):
  """Epochs of up to 16 observations are the order of keyed hashes: over
  60,000 epochs every permutation of n comes about equally often (a
  Feistel network on so small a domain reached few of them, at n = 5
  p ~ 0), and as often from the device as from the host."""
  epochs = np.repeat(np.arange(60_000), n)
  perms = cs.permute(11, epochs, np.tile(np.arange(n), 60_000), n).reshape(
      -1, n)
  codes = np.zeros(len(perms), np.int64)  # each permutation's Lehmer code
  for i in range(n):
    codes = codes * (n - i) + (perms[:, i + 1:] < perms[:, i:i + 1]).sum(1)
  counts = np.bincount(codes, minlength=math.factorial(n))
  assert counts.size == math.factorial(n)
  assert stats.chisquare(counts).pvalue > ALPHA
  device = jax.jit(lambda e, o: cs.permute(11, e, o, n, jnp))(
      jnp.asarray(epochs[:600 * n], jnp.uint32),
      jnp.asarray(np.tile(np.arange(n), 600), jnp.uint32))
  np.testing.assert_array_equal(device, perms[:600].reshape(-1))


@pytest.mark.parametrize("n", [8, 16, 17, 32, 33, 100, 1024])
def test_epochs_are_odd_as_often_as_even(n):
  """A Feistel network on halves of two bits or more is an even
  permutation (every epoch of 32 or 1,024 was even, and of 31 97 % odd);
  with the finishing key's swap of observations 0 and 1 the parity of
  2,000 epochs is a fair coin's."""
  odd = sum(_parity(cs.permute(3, epoch, np.arange(n), n))
            for epoch in range(2000))
  assert stats.binomtest(odd, 2000).pvalue > ALPHA


def test_old_shuffled_positions_and_checkpoints_are_refused():
  """Shuffled counter streams changed their permutations (version 2): a
  position or checkpoint of shuffled counter chains saved before would go
  on with other batches, so it is refused, naming the change, by
  load_state, state_from_pytree and in merged checkpoints, on host and
  device loaders."""
  from jax_data.compiled.checkpoint import concatenate_trees
  data = {"x": np.arange(100)}
  for loader in (jax_data.NumpyDataLoader(**data),
                 jax_data.DeviceNumpyDataLoader(**data)):
    pipeline = jax_data.random_reference_data(loader, 3, 4)
    init_fn = pipeline[0]
    for mode in ({"shuffle": True}, {"shuffle": True, "in_epochs": True}):
      tree = jax_data.state_to_pytree(
          pipeline, init_fn(seed=range(2), stream="counter", **mode))
      old = _saved_before(tree, "counter_permutation")
      with pytest.raises(jax_data.CheckpointError,
                         match=r"shuffled batches .* version 1 "
                         r"\(jax_data before 2026-11-29\)"):
        jax_data.state_from_pytree(pipeline, old)
      for parts in ([tree, old], [old, tree]):
        with pytest.raises(jax_data.CheckpointError, match="version 1"):
          concatenate_trees(parts)
  loader = jax_data.NumpyDataLoader(**data)
  chain = loader.register_random_pipeline(3, 4, seed=5, stream="counter",
                                          shuffle=True)
  saved = loader.save_state(chain)
  assert saved["stream"]["permutation"] == cs.PERMUTE_VERSION
  loader.load_state(chain, saved)
  del saved["stream"]["permutation"]
  with pytest.raises(ValueError, match="version 1 of the counter-based "
                     "shuffled streams"):
    loader.load_state(chain, saved)


def test_chains_of_different_seeds_share_no_structure():
  """Two permutations of 1,000 agree at one position on average (a
  random pair does); the agreements of 2,000 seed pairs fit Poisson(1)."""
  n, pairs = 1000, 2000
  agree = np.array([
      np.sum(cs.permute(s, 0, np.arange(n), n)
             == cs.permute(s + 1, 0, np.arange(n), n))
      for s in range(pairs)])
  observed = np.bincount(np.minimum(agree, 4), minlength=5)
  expected = stats.poisson(1).pmf(np.arange(4)) * pairs
  expected = np.append(expected, pairs - expected.sum())
  assert stats.chisquare(observed, expected).pvalue > ALPHA
  # Indices drawn with replacement by neighbouring seeds are uncorrelated.
  a = cs.uniform(1, np.arange(100_000), 1000)
  b = cs.uniform(2, np.arange(100_000), 1000)
  assert abs(np.corrcoef(a, b)[0, 1]) < 4 / np.sqrt(a.size)


def test_no_seed_draws_another_seeds_batches():
  """Independent draws of 1,024 chains (seeds 0 .. 1023, what
  init_fn(seed=range(1024)) gives), 200 batches of 64 over 1,000
  observations: no batch of any chain is another batch's multiset of
  indices (a chance match is about 1e-100). When a hash absorbed the
  seed only before the position, one seed's stream was another's with
  positions XORed by a constant: chain 165's batch j was chain 117's
  batch j ^ 86."""
  chains, batches, mb = 1024, 200, 64
  runs = counter_chains.uniform_runs(np.arange(chains), np.zeros(chains,
                                                                 np.int64),
                                     batches * mb, 1000)
  drawn = np.sort(runs.reshape(chains * batches, mb), axis=1)
  assert len(np.unique(drawn, axis=0)) == chains * batches


@pytest.mark.parametrize("n, expected", [(2**31, 233), (2**32 - 5, 116),
                                         (2**33, 58)])
def test_draws_over_billions_repeat_as_draws_with_replacement(n, expected):
  """10**6 draws of one chain repeat an observation about k**2 / (2 n)
  times, as draws with replacement do. With one 32-bit hash, a bijection
  of the position, they repeated about half as often at n = 2**31, and
  never at n = 2**32 - 5 or 2**33. Poisson counts: the bounds hold with
  probability above 1 - 1e-6."""
  drawn = cs.uniform(11, np.arange(10**6), n)
  repeats = drawn.size - np.unique(drawn).size
  low, high = stats.poisson(expected).ppf([1e-7, 1 - 1e-7])
  assert low <= repeats <= high, (repeats, expected)


@pytest.mark.parametrize("n", [2**24 + 1, 2**28 + 3, 2**32, 2**33 + 7,
                               10**12])
def test_the_draws_of_many_seeds_are_uniform_over_billions(n):
  """One draw from each of 2**20 seeds (independent draws from the
  marginal) collides in about k**2 / (2 n) pairs, as uniform draws do.
  When a draw's second hash word was a function of its first, a third of
  the observations could not be drawn at n = 2**32 (about twice the
  pairs), and above 2**32 only 2**32 of them (128 pairs at n = 1e12, where
  0.55 are expected). Poisson counts: the bounds hold with probability
  above 1 - 1e-6."""
  seeds = np.arange(2**20, dtype=np.uint64)
  drawn = cs.uniform(counter_chains.uint32_words(seeds),
                     np.zeros(seeds.size, np.int64), n)
  assert drawn.min() >= 0 and drawn.max() < n
  _, counts = np.unique(drawn, return_counts=True)
  pairs = int((counts * (counts - 1) // 2).sum())
  expected = seeds.size * (seeds.size - 1) / (2 * n)
  low, high = stats.poisson(expected).ppf([1e-7, 1 - 1e-7])
  assert low <= pairs <= high, (pairs, expected)


def test_seeds_of_one_32_bit_state_draw_streams_of_their_own():
  """Seeds 1 and 2658119697165189120 leave the same 32-bit state once
  their words are hashed, and drew the same stream while the hash absorbed
  that state again rather than the words; among 2**20 random 64-bit seeds
  126 pairs did. Now no two of those seeds' first four draws over 2**24
  agree (chance: 3e-17 pairs), and the pair's streams differ."""
  n = 2**24
  pair = [cs.uniform(seed, np.arange(1000), n)
          for seed in (1, 2658119697165189120)]
  assert np.mean(pair[0] == pair[1]) < 0.01
  seeds = np.unique(np.random.default_rng(5).integers(
      0, 2**63, 2**20, dtype=np.int64).astype(np.uint64) * np.uint64(2))
  words = counter_chains.uint32_words(seeds)
  first = [cs.uniform(words, np.full(seeds.size, t, np.int64), n)
           for t in range(4)]
  signature = np.stack(first, axis=1)
  assert np.unique(signature, axis=0).shape[0] == seeds.size


def test_the_epochs_of_many_chains_have_keys_of_their_own():
  """The keys of 4,096 seeds' first 256 epochs (1,048,576 epochs) are all
  different: 64 bits, whose collisions are 3e-8 likely here. Keyed by one
  32-bit state, about 128 epochs had another's keys, and the state of a
  seed XORed with the epoch, so that epoch e of seed 268 was epoch
  e ^ 365 of seed 3,466 (every e)."""
  seeds = np.repeat(np.arange(4096, dtype=np.uint64), 256)
  epochs = np.tile(np.arange(256), 4096)
  with np.errstate(over="ignore"):
    keys = cs.round_keys(counter_chains.uint32_words(seeds), epochs, np)
  pairs = keys[0].astype(np.uint64) << np.uint64(32) | keys[1]
  assert np.unique(pairs).size == pairs.size
  n = 10**6
  for e in range(16):
    assert not np.array_equal(cs.permute(268, e, np.arange(64), n),
                              cs.permute(3466, e ^ 365, np.arange(64), n))


def test_a_chunk_costs_no_replay():
  """A stream positioned at batch 1e9 draws what a stream that got there
  batch by batch would: the same function of the batch number."""
  stream = CounterStream(jax_data.sampling.ObservationRange(0, 10**8),
                            64, 4, True, True)
  stream.seek_batch(10**9)
  indices, mask = stream.draw(10)
  again, again_mask = cs.stream_batches(4, 10**9, 10, 64, 10**8, True, True)
  np.testing.assert_array_equal(indices, again)
  np.testing.assert_array_equal(mask, again_mask)
  assert stream.get_state()["batch"] == 10**9 + 10
  # What it keeps is the batches drawn ahead: a few chunks' indices and
  # masks, whatever the number of records.
  ahead = counter_chains._DRAW_WORDS  # pylint: disable=protected-access
  assert 0 < stream.held_bytes() <= (ahead + 64 * 10) * 9
  stream.trim()
  assert stream.held_bytes() == 0
  np.testing.assert_array_equal(stream.draw(10)[0], cs.stream_batches(
      4, 10**9 + 10, 10, 64, 10**8, True, True)[0])


@pytest.mark.parametrize("mode", [{}, {"shuffle": True},
                                  {"shuffle": True, "in_epochs": True}])
def test_every_loader_draws_the_same_counter_stream(mode, tmp_path,
                                                    pipelines):
  """NumpyDataLoader in memory and over a memmap, SourceDataLoader with
  threads, TensorflowDataLoader in memory: the same batches for the same
  seed, equal to the stream."""
  n, mb, cache = 103, 8, 3
  path = tmp_path / "x.npy"
  np.save(path, np.arange(n))
  loaders = [jax_data.NumpyDataLoader(x=np.arange(n)),
             jax_data.NumpyDataLoader(copy=False,
                                      x=np.load(path, mmap_mode="r")),
             jax_data.SourceDataLoader(Computed(n), workers=2)]
  try:
    import tensorflow as tf

    from jax_data.tensorflow_loader import TensorflowDataLoader
    loaders.append(TensorflowDataLoader(
        tf.data.Dataset.from_tensor_slices({"x": np.arange(n)}),
        in_memory=True))
  except ImportError:  # the tensorflow extra is optional
    pass
  expected, mask = cs.stream_batches(11, 0, 7, mb, n,
                                     mode.get("shuffle", False),
                                     mode.get("in_epochs", False))
  for loader in loaders:
    init_fn, batch_fn, release_fn = pipelines.random_reference_data(
        loader, cache, mb)
    state = init_fn(seed=11, stream="counter", **mode)
    got = []
    for _ in range(7):
      state, batch = batch_fn(state, information=True)
      batch, info = batch
      got.append(np.where(info.mask, batch["x"], 0))
    if mask is not None:
      expected = np.where(mask, expected, 0)
    np.testing.assert_array_equal(np.stack(got), expected)
    release_fn()


def test_stream_keyword_defaults_and_errors():
  """``stream="auto"`` is exact up to 2**20 observations (the data guide's
  batches) and counter-based above; a bad value is named; loaders that
  draw their own streams do not take it."""
  from jax_data.host_loader import AUTO_COUNTER_ABOVE
  small = jax_data.NumpyDataLoader(x=np.arange(10))
  assert small.chain_spec(False).stream == "exact"
  assert small.chain_spec(False, stream="counter").stream == "counter"
  large = jax_data.SourceDataLoader(Computed(AUTO_COUNTER_ABOVE + 1))
  assert large.chain_spec(False, shuffle=True).stream == "counter"
  assert large.chain_spec(False, stream="exact").stream == "exact"
  with pytest.raises(ValueError, match="stream='count'"):
    small.chain_spec(False, stream="count")


def test_a_position_of_the_other_kind_is_refused():
  from jax_data.sampling import ObservationRange
  from jax_data.sampling import RandomStream
  counter = CounterStream(ObservationRange(0, 10), 2, 0, True, False)
  exact = RandomStream(ObservationRange(0, 10), 2, 0, True, False)
  with pytest.raises(ValueError, match="counter-based stream"):
    exact.set_state(counter.get_state())
  with pytest.raises(ValueError, match="exact stream"):
    counter.set_state(exact.get_state())


def test_checkpoint_keeps_the_stream_kind(tmp_path):
  """A checkpoint of a counter-based chain restores one that continues the
  same stream."""
  loader = jax_data.NumpyDataLoader(x=np.arange(100))
  pipeline = jax_data.random_reference_data(loader, 3, 4)
  init_fn, batch_fn, _ = pipeline
  state = init_fn(seed=2, shuffle=True, stream="counter")
  for _ in range(5):
    state, _ = batch_fn(state)
  jax_data.save_checkpoint(tmp_path / "c.npz", pipeline, state)
  restored = jax_data.restore_checkpoint(tmp_path / "c.npz", pipeline)
  expected = cs.stream_batches(2, 5, 6, 4, 100, True, False)[0]
  for row in expected:
    state, batch = batch_fn(state)
    restored, again = batch_fn(restored)
    np.testing.assert_array_equal(batch["x"], row)
    np.testing.assert_array_equal(again["x"], row)


def _saved_before(tree, field):
  """``tree`` (state_to_pytree's) as a jax_data before the version
  ``field`` came wrote it: without it."""
  host = json.loads(bytes(np.asarray(tree["host"])).decode())
  del host[field]
  return {**tree, "host": np.frombuffer(json.dumps(host).encode(), np.uint8)}


def _saved_before_the_new_draws(tree):
  """``tree`` without the version of the independent draws' hash, as a
  jax_data before 2026-11-28 wrote it (which had no version of the
  permutations either: that one is kept, to test the draws' alone)."""
  return _saved_before(tree, "counter_draws")


@pytest.mark.parametrize("loader_class", ["host", "device"])
def test_checkpoints_of_the_old_independent_draws_are_refused(loader_class):
  """Independent counter draws changed their hash: a checkpoint of such
  chains saved before would go on with other batches, so it is refused,
  naming the change; shuffled counter chains and exact streams, whose
  draws did not change, restore."""
  data = {"x": np.arange(100)}
  loader = (jax_data.NumpyDataLoader(**data) if loader_class == "host" else
            jax_data.DeviceNumpyDataLoader(**data))
  pipeline = jax_data.random_reference_data(loader, 3, 4)
  init_fn, batch_fn, _ = pipeline
  old = _saved_before_the_new_draws(jax_data.state_to_pytree(
      pipeline, init_fn(seed=range(2))))
  with pytest.raises(jax_data.CheckpointError,
                     match=r"independent batches .* version 1 "
                     r"\(jax_data before 2026-11-28\)"):
    jax_data.state_from_pytree(pipeline, old)
  for kind in ({"shuffle": True, "stream": "counter"},
               {"stream": "exact"} if loader_class == "host" else
               {"key": jax.random.PRNGKey(0)}):
    state = init_fn(**({"seed": 3} if "key" not in kind else {}), **kind)
    state, _ = batch_fn(state)
    restored = jax_data.state_from_pytree(pipeline, _saved_before_the_new_draws(
        jax_data.state_to_pytree(pipeline, state)))
    for _ in range(4):
      state, batch = batch_fn(state)
      restored, again = batch_fn(restored)
      np.testing.assert_array_equal(again["x"], batch["x"])


def test_old_independent_positions_are_refused_when_merged_or_loaded():
  """Parts of a checkpoint merged (as Orbax merges the processes' parts):
  an old part of independent counter chains is refused wherever it comes
  in the list, and an old part of shuffled chains merges with a new one.
  A chain's position saved the predecessor's way (save_state) without
  the draws' version is refused by load_state."""
  from jax_data.compiled.checkpoint import concatenate_trees
  loader = jax_data.NumpyDataLoader(x=np.arange(100))
  pipeline = jax_data.random_reference_data(loader, 3, 4)
  init_fn = pipeline[0]
  new = jax_data.state_to_pytree(pipeline, init_fn(seed=range(2)))
  old = _saved_before_the_new_draws(jax_data.state_to_pytree(
      pipeline, init_fn(seed=range(2, 4))))
  for parts in ([new, old], [old, new]):
    with pytest.raises(jax_data.CheckpointError, match="version 1"):
      concatenate_trees(parts)
  old_shuffled = _saved_before_the_new_draws(jax_data.state_to_pytree(
      pipeline, init_fn(seed=range(4, 6), shuffle=True, stream="counter")))
  merged = concatenate_trees([old_shuffled, new])
  assert jax_data.state_from_pytree(pipeline, merged).chain.shape == (4,)
  chain = loader.register_random_pipeline(3, 4, seed=5, stream="counter")
  saved = loader.save_state(chain)
  assert saved["stream"]["draws"] == cs.UNIFORM_VERSION
  del saved["stream"]["draws"]
  with pytest.raises(ValueError, match="version 1 of the counter-based "
                     "independent draws"):
    loader.load_state(chain, saved)


def _saved_with(tree, field, version):
  """``tree`` (state_to_pytree's) with ``field`` at ``version``, as the
  jax_data of that version wrote it."""
  host = json.loads(bytes(np.asarray(tree["host"])).decode())
  host[field] = version
  return {**tree, "host": np.frombuffer(json.dumps(host).encode(), np.uint8)}


@pytest.mark.parametrize("version", [2, 3])
def test_checkpoints_of_the_draws_and_epochs_of_2026_11_29_are_refused(
    version):
  """Versions 2 and 3 of the independent draws, and 2 of the permutations,
  drew other streams (tests above): their checkpoints are refused, naming
  the change."""
  loader = jax_data.NumpyDataLoader(x=np.arange(1000))
  pipeline = jax_data.random_reference_data(loader, 3, 4)
  init_fn, _, release_fn = pipeline
  old = _saved_with(jax_data.state_to_pytree(
      pipeline, init_fn(seed=range(2), stream="counter")), "counter_draws",
                    version)
  with pytest.raises(jax_data.CheckpointError, match=re.escape(
      f"version {version} (jax_data before 2026-11-30), and this jax_data "
      f"draws them with version {cs.UNIFORM_VERSION}, ") + ".*" + re.escape(
          "whose seeds' streams are their own")):
    jax_data.state_from_pytree(pipeline, old)
  shuffled = _saved_with(jax_data.state_to_pytree(
      pipeline, init_fn(seed=range(2), shuffle=True, stream="counter")),
                         "counter_permutation", 2)
  with pytest.raises(jax_data.CheckpointError, match=re.escape(
      f"version {cs.PERMUTE_VERSION}, whose seeds' epochs are their own")):
    jax_data.state_from_pytree(pipeline, shuffled)
  release_fn()


def test_a_state_far_ahead_is_served_without_replay():
  """A counter-based chain's state at draw 1e9 (a pytree whose chunk
  counter was moved there) restores and serves the stream's batch at once:
  the source reads the records of the chunks served and produced ahead,
  none of the 1e8 chunks before."""
  source = _Counting(10**8)
  loader = jax_data.SourceDataLoader(source, workers=0)
  pipeline = jax_data.random_reference_data(loader, 10, 64)
  init_fn, batch_fn, release_fn = pipeline
  state = init_fn(seed=6, shuffle=True)  # counter-based: 1e8 > 2**20
  tree = jax_data.state_to_pytree(pipeline, state)
  tree["chunk"] = np.int32(10**9 // 10)
  far = jax_data.state_from_pytree(pipeline, tree)
  source.reads = 0
  far, batch = batch_fn(far)
  expected = cs.stream_batches(6, 10**9, 1, 64, 10**8, True, False)[0][0]
  np.testing.assert_array_equal(batch["x"], expected)
  release_fn()
  assert source.reads <= 3 * 10 * 64  # this chunk and two ahead


class _Counting(Computed):

  reads = 0

  def __getitem__(self, i):
    self.reads += 1
    return super().__getitem__(i)


def test_restore_onto_another_topology(tmp_path):
  """8 chains saved under pmap on 4 devices (2 per device) restore under
  pmap on 2 devices (4 per device) and under vmap on one: a chain is its
  (seed, chain number), never its device, and each continues its stream."""
  if jax.local_device_count() < 4:
    pytest.skip("needs 4 devices (XLA_FLAGS in conftest.py)")
  n, cache, mb = 1000, 3, 4
  loader = jax_data.NumpyDataLoader(x=np.arange(n))
  pipeline = jax_data.random_reference_data(loader, cache, mb)
  init_fn, batch_fn, _ = pipeline
  states = [init_fn(seed=100 + c, shuffle=True, stream="counter")
            for c in range(8)]
  stacked = jax.tree_util.tree_map(lambda *s: jnp.stack(s).reshape(
      (4, 2) + s[0].shape), *states)
  step = jax.pmap(jax.vmap(batch_fn), devices=jax.devices()[:4])
  for _ in range(5):
    stacked, _ = step(stacked)
  path = tmp_path / "eight.npz"
  jax_data.save_checkpoint(path, pipeline, stacked)

  def stream(c, first, count):
    return cs.stream_batches(100 + c, first, count, mb, n, True, False)[0]

  on_two = jax.tree_util.tree_map(
      lambda x: x.reshape((2, 4) + x.shape[2:]),
      jax_data.restore_checkpoint(path, pipeline))
  two = jax.pmap(jax.vmap(batch_fn), devices=jax.devices()[:2])
  on_one = jax.tree_util.tree_map(
      lambda x: x.reshape((8,) + x.shape[2:]),
      jax_data.restore_checkpoint(path, pipeline))
  one = jax.jit(jax.vmap(batch_fn))
  for k in range(4):
    on_two, got_two = two(on_two)
    on_one, got_one = one(on_one)
    expected = np.stack([stream(c, 5 + k, 1)[0] for c in range(8)])
    np.testing.assert_array_equal(
        np.asarray(got_two["x"]).reshape(8, mb), expected)
    np.testing.assert_array_equal(np.asarray(got_one["x"]), expected)


def test_lanes_of_a_checkpoint_restore_apart(tmp_path):
  """Each process restores its own lanes of a checkpoint of 8 chains (4
  each): every chain continues its stream; bad lanes are named."""
  n, cache, mb = 1000, 3, 4
  loader = jax_data.NumpyDataLoader(x=np.arange(n))
  pipeline = jax_data.random_reference_data(loader, cache, mb)
  init_fn, batch_fn, _ = pipeline
  stacked = jax.tree_util.tree_map(
      lambda *s: jnp.stack(s),
      *[init_fn(seed=50 + c, shuffle=True, stream="counter")
        for c in range(8)])
  step = jax.jit(jax.vmap(batch_fn))
  for _ in range(4):
    stacked, _ = step(stacked)
  path = tmp_path / "eight.npz"
  jax_data.save_checkpoint(path, pipeline, stacked)
  for process in range(2):
    lanes = range(4 * process, 4 * process + 4)
    mine = jax_data.restore_checkpoint(path, pipeline, lanes=lanes)
    _, got = step(mine)
    expected = [cs.stream_batches(50 + c, 4, 1, mb, n, True, False)[0][0]
                for c in lanes]
    np.testing.assert_array_equal(np.asarray(got["x"]), np.stack(expected))
  with pytest.raises(ValueError, match=r"lanes=\[8\].*between 0 and 7"):
    jax_data.restore_checkpoint(path, pipeline, lanes=[8])


def test_worker_processes_draw_the_same_counter_stream():
  loader = jax_data.SourceDataLoader(Computed(103), workers=2,
                                     processes=True)
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 3, 8)
  state = init_fn(seed=11, shuffle=True, stream="counter")
  got = []
  for _ in range(4):
    state, batch = batch_fn(state)
    got.append(np.asarray(batch["x"]))
  release_fn()
  np.testing.assert_array_equal(
      np.stack(got), cs.stream_batches(11, 0, 4, 8, 103, True, False)[0])


def test_tensorflow_shuffle_options_need_counter_streams():
  tf = pytest.importorskip("tensorflow")
  from jax_data.tensorflow_loader import TensorflowDataLoader
  data = tf.data.Dataset.from_tensor_slices({"x": np.arange(10)})
  in_memory = TensorflowDataLoader(data, in_memory=True)
  assert in_memory.chain_spec(False).stream == "exact"  # its buffer
  with pytest.raises(ValueError, match="stream='counter'"):
    jax_data.random_reference_data(in_memory, 2, 3)[0](shuffle=True)
  with pytest.raises(TypeError, match="stream"):
    TensorflowDataLoader(data).chain_spec(False, stream="counter")


@pytest.mark.parametrize("mode", [{}, {"shuffle": True},
                                  {"shuffle": True, "in_epochs": True}])
def test_the_device_loader_draws_the_host_loaders_stream(mode, tmp_path):
  """DeviceNumpyDataLoader with the same keywords serves the batches of
  NumpyDataLoader, under jit and vmap beside a jax.random chain, and its
  checkpoint keeps the kind of each chain."""
  x = np.arange(1000)
  device = jax_data.random_reference_data(jax_data.DeviceNumpyDataLoader(x=x),
                                          3, 16)
  host_init, host_batch, _ = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(x=x), 3, 16)
  init_fn, batch_fn, _ = device
  step = jax.jit(jax.vmap(lambda s: batch_fn(s, information=True)))
  states = jax.tree_util.tree_map(
      lambda *s: jnp.stack(s), init_fn(key=jax.random.PRNGKey(1)),
      init_fn(seed=5, stream="counter", **mode))
  host = host_init(seed=5, stream="counter", **mode)
  for k in range(6):
    if k == 3:
      jax_data.save_checkpoint(tmp_path / "d.npz", device, states)
      states = jax_data.restore_checkpoint(tmp_path / "d.npz", device)
    states, (batch, info) = step(states)
    host, (expected, expected_info) = host_batch(host, information=True)
    np.testing.assert_array_equal(info.mask[1], expected_info.mask)
    np.testing.assert_array_equal(
        np.where(info.mask[1], batch["x"][1], 0),
        np.where(expected_info.mask, expected["x"], 0))
  with pytest.raises(ValueError, match="stream='counter'"):
    init_fn(seed=5, shuffle=True)


def test_device_chains_without_a_seed_are_numbered_as_host_chains():
  """Counter-based device chains made without a seed take the number of
  chains made before them, as a host loader's chains take their number
  (one given seed 0 counts too; a refused init_fn does not): such chains
  draw different streams (they drew the same, perfectly correlated), each
  its host counterpart's."""
  x = np.arange(1000)
  init_fn, batch_fn, _ = jax_data.random_reference_data(
      jax_data.DeviceNumpyDataLoader(x=x), 2, 8)
  host_init, host_batch, _ = jax_data.random_reference_data(
      jax_data.NumpyDataLoader(x=x), 2, 8)
  mode = dict(shuffle=True, stream="counter")
  with pytest.raises(ValueError, match="in_epochs=True needs shuffle"):
    init_fn(in_epochs=True, stream="counter")  # made nothing: no number
  drawn = [np.asarray(jax.jit(batch_fn)(init_fn(**kwargs))[1]["x"])
           for kwargs in (dict(mode, seed=0), mode, mode)]
  assert not np.array_equal(drawn[0], drawn[1])
  assert not np.array_equal(drawn[1], drawn[2])
  for got, kwargs in zip(drawn, (dict(mode, seed=0), mode, mode)):
    np.testing.assert_array_equal(got,
                                  host_batch(host_init(**kwargs))[1]["x"])


def test_unseeded_device_lanes_and_full_passes_are_numbered_as_on_the_host():
  """init_fn(seed=[None, None]) gave every lane seed 0 (the same batches in
  both), and a full-data pipeline's chain was not counted, where the host
  counts its ordered chains: the next unseeded chain drew another stream
  than the host's."""
  x = np.arange(1000)
  drawn = {}
  for loader_class in (jax_data.NumpyDataLoader,
                       jax_data.DeviceNumpyDataLoader):
    loader = loader_class(x=x)
    pipeline = jax_data.random_reference_data(loader, 2, 4)
    init_fn, batch_fn, _ = pipeline
    states = init_fn(seed=[None, 7, None])
    lanes = jax.vmap(batch_fn)(states)[1]["x"]
    full_init = jax_data.full_reference_data(loader, 2, 4)[0]
    full_init(), full_init()  # one ordered chain, however many states
    jax_data.full_data_mapper(loader, 2, 4)  # and another
    # Three chains restored: registered anew, and counted (the device's
    # were not).
    jax_data.state_from_pytree(pipeline,
                               jax_data.state_to_pytree(pipeline, states))
    after = batch_fn(init_fn(stream="counter"))[1]["x"]
    drawn[loader_class] = np.asarray(lanes), np.asarray(after)
  host, device = drawn.values()
  assert not np.array_equal(device[0][0], device[0][2])
  for got, want in zip(device, host):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", [{}, {"shuffle": True, "in_epochs": True}])
def test_a_sequence_of_seeds_on_the_device_draws_the_host_loaders_chains(
    mode):
  """init_fn(seed=range(C)) with no stream: the device loader's chains are
  counter-based, as a host loader's are, and draw the same batches."""
  x = np.arange(97)
  batches = []
  for loader in (jax_data.NumpyDataLoader(x=x),
                 jax_data.DeviceNumpyDataLoader(x=x)):
    init_fn, batch_fn, release_fn = jax_data.random_reference_data(
        loader, 4, 8)

    def draw(state, batch_fn=batch_fn):
      state, (batch, info) = batch_fn(state, information=True)
      return state, jnp.where(info.mask, batch["x"], -1)

    states, step, drawn = init_fn(seed=range(3), **mode), jax.jit(
        jax.vmap(draw)), []
    for _ in range(15):
      states, batch = step(states)
      drawn.append(np.asarray(batch))
    batches.append(np.stack(drawn))
    release_fn()
  np.testing.assert_array_equal(batches[1], batches[0])
  init_fn = jax_data.random_reference_data(
      jax_data.DeviceNumpyDataLoader(x=x), 4, 8)[0]
  with pytest.raises(ValueError, match="stream='counter'"):
    init_fn(seed=3)  # one chain: a host loader's would be exact
  with pytest.raises(ValueError, match="stream='exact'"):
    init_fn(seed=range(3), stream="exact")


@pytest.mark.parametrize("loader_class", [jax_data.NumpyDataLoader,
                                          jax_data.DeviceNumpyDataLoader])
def test_a_vmap_of_no_chains(loader_class):
  """States of no chains (sliced from stacked ones) give empty batches."""
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader_class(x=np.arange(10.0)), 1, 3)
  none = jax.tree_util.tree_map(lambda a: a[:0], init_fn(seed=range(2)))
  states, batch = jax.jit(jax.vmap(batch_fn))(none)
  assert batch["x"].shape == (0, 3) and states.chain.shape == (0,)
  release_fn()


def test_device_batches_beyond_the_counter_streams_words():
  """mb_size of 2**16 or more: a jax.random chain of the device loader
  draws its batches, and a counter-based one is refused by init_fn,
  naming the size, before anything is traced."""
  mb = 2**16
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      jax_data.DeviceNumpyDataLoader(x=np.arange(mb + 7)), 1, mb)
  _, batch = jax.jit(batch_fn)(init_fn(key=jax.random.PRNGKey(1)))
  x = np.asarray(batch["x"])
  assert x.shape == (mb,) and x.min() >= 0 and x.max() < mb + 7
  for kwargs in ({"seed": 1, "stream": "counter"}, {"seed": range(2)}):
    with pytest.raises(ValueError, match=f"mb_size below 2\\*\\*16 .*"
                       f"got mb_size={mb} and an observation count of "
                       f"{mb + 7}"):
      init_fn(**kwargs)
  release_fn()


@pytest.mark.parametrize("n, mb", [(2**32 - 1, 7), (2**32 - 5, 100)])
def test_the_device_masks_an_epochs_last_batch_near_2_32(n, mb):
  """An epoch's last batch whose offsets pass 2**32 (n just below it):
  the device's uint32 offsets wrapped to 0, 1, ... and were marked valid,
  serving the epoch's first observations again; they are fillers, as on
  the host."""
  per_epoch = -(-n // mb)
  for batch in (per_epoch - 1, 2 * per_epoch - 1):
    want, want_mask = cs.stream_batches(3, batch, 1, mb, n, True, True)
    got, mask = jax.jit(lambda b: device_streams.device_batch(
        jnp.asarray([3, 0], jnp.uint32), b, mb, n, 2))(jnp.uint32(batch))
    np.testing.assert_array_equal(np.asarray(mask), want_mask[0])
    np.testing.assert_array_equal(np.asarray(got, np.int64), want[0])


def test_a_counter_stream_ends_at_its_last_position():
  """Positions (batch * mb_size) are int64: a stream asked for batches
  past its last raises, rather than wrap and report a position that no
  restore takes."""
  stream = CounterStream(jax_data.sampling.ObservationRange(0, 1000), 8, 4,
                         False, False)
  last = (2**63 - 1) // 8
  stream.set_state({**stream.get_state(), "batch": last - 1})
  stream.draw(2)
  with pytest.raises(ValueError, match=f"ends at batch {last}"):
    stream.draw(1)
  stream.set_state(stream.get_state())  # where it stopped: restorable


def test_vmapped_device_chains_of_one_kind_draw_only_their_stream(
    monkeypatch):
  """Under vmap, and vmap of vmap, device chains of one kind draw their own
  stream alone (a switch on the batched kind would draw every kind and
  select), and each lane gets its chain's batches; lanes of several kinds
  still get each its own."""
  drawn = []
  device_batch = device_streams.device_batch

  def spy(seed, batch, mb_size, n, mode):
    jax.debug.callback(lambda: drawn.append(mode))
    return device_batch(seed, batch, mb_size, n, mode)

  monkeypatch.setattr(device_streams, "device_batch", spy)
  n, mb = 101, 8
  init_fn, batch_fn, _ = jax_data.random_reference_data(
      jax_data.DeviceNumpyDataLoader(x=np.arange(n)), 1, mb)

  def draw(state):
    state, (batch, info) = batch_fn(state, information=True)
    return state, jnp.where(info.mask, batch["x"], -1)

  one, lanes_of, nested_lanes_of = (jax.jit(draw), jax.jit(jax.vmap(draw)),
                                    jax.jit(jax.vmap(jax.vmap(draw))))

  def run(step, state, lane_axes=0):
    batches = []
    for _ in range(4):
      state, batch = step(state)
      batches.append(batch)
    return np.stack(batches, axis=lane_axes)  # lanes first

  def alone(state):
    return run(one, state)

  def vmapped(states, depth=1):
    return run(lanes_of if depth == 1 else nested_lanes_of, states, depth)

  modes = [{}, {"shuffle": True}, {"shuffle": True, "in_epochs": True}]
  for mode, keywords in enumerate(modes):
    seeds = [3, 0, 7, 11]
    drawn.clear()
    lanes = vmapped(init_fn(seed=seeds, stream="counter", **keywords))
    assert set(drawn) == {mode}
    nested = vmapped(jax.tree_util.tree_map(
        lambda a: a.reshape((2, 2) + a.shape[1:]),
        init_fn(seed=seeds, stream="counter", **keywords)), depth=2)
    for lane, seed in enumerate(seeds):
      want = alone(init_fn(seed=seed, stream="counter", **keywords))
      np.testing.assert_array_equal(lanes[lane], want)
      np.testing.assert_array_equal(nested[lane // 2, lane % 2], want)
  drawn.clear()
  keyed = vmapped(jax.tree_util.tree_map(
      lambda *s: jnp.stack(s),
      *[init_fn(key=k) for k in jax.random.split(jax.random.PRNGKey(2), 3)]))
  assert not drawn  # jax.random chains alone
  assert len({tuple(k.ravel()) for k in keyed}) == 3
  mixed = [init_fn(key=jax.random.PRNGKey(5)),
           init_fn(seed=9, stream="counter", shuffle=True, in_epochs=True)]
  together = vmapped(jax.tree_util.tree_map(lambda *s: jnp.stack(s), *mixed))
  for lane, state in enumerate(mixed):
    np.testing.assert_array_equal(together[lane], alone(state))


@pytest.mark.parametrize("n", [3, 5, 17, 1000, 4097, 65_537, 10**6,
                               2**24, 2**24 + 1])
def test_tabulated_rounds_give_the_same_permutation(n):
  """The host tabulates an epoch's round functions when a chunk has more
  indices than a half has values (n up to 2**24): the same indices as the
  network computed index by index (keys given per index), and as the
  device."""
  bits = cs.domain_bits(n)
  keys = cs.round_keys_int(7, 3)
  offsets = np.random.default_rng(n).integers(0, n, 20_000)
  tabulated = cs.permute_keyed(keys, offsets, n, bits)
  with np.errstate(over="ignore"):
    direct = cs.permute_keyed(
        [np.full(offsets.size, k, np.uint32) for k in keys], offsets, n, bits)
  np.testing.assert_array_equal(tabulated, direct)
  if n < 2**32:
    device = jax.jit(lambda o: cs.permute(7, 3, o, n, jnp))(
        jnp.asarray(offsets, jnp.uint32))
    np.testing.assert_array_equal(np.asarray(device), tabulated)


def test_no_batches_and_batches_larger_than_the_data():
  """A draw of no batches gives empty indices in every mode; the device,
  whose shuffled batch crosses at most one epoch's end, refuses batches
  larger than the data, naming both (an offset past n cycle-walked for
  ever)."""
  for shuffle, in_epochs in ((False, False), (True, False), (True, True)):
    indices, _ = counter_chains.chain_batches([1, 2], [0, 0], 0, 4, 16,
                                              shuffle, in_epochs)
    assert indices.shape == (2, 0, 4)
  with pytest.raises(ValueError, match="mb_size=64 .* count of 17"):
    device_streams.device_batch(jnp.zeros(2, jnp.uint32), 0, 64, 17, 1)


@pytest.mark.parametrize("arguments,error,message", [
    (dict(mb_size=0), ValueError, "mb_size must be at least 1"),
    (dict(mb_size=1.5), TypeError, "mb_size must be an integer"),
    (dict(n="10"), TypeError, "n must be an integer, got n='10'"),
    (dict(mode=True), TypeError, "mode must be an integer, got mode=True"),
    (dict(mode=3), ValueError, "mode must be between 0 and 2"),
    (dict(seed=jnp.array([7, 0, 9], jnp.uint32)), TypeError,
     r"seed must be the seed's two uint32 words .* shape \(3,\)"),
    (dict(seed=jnp.array([7.9, 0.0])), TypeError, "dtype float32"),
    (dict(batch=1.5), TypeError, "batch must be one integer"),
    (dict(batch=2**31), ValueError, "batch must be between 0 and "
     "2147483647"),
])
def test_device_batch_names_a_bad_argument(arguments, error, message):
  """Empty batches came out of mb_size=0, a third seed word and a float
  batch were dropped silently, and the rest failed deep inside JAX."""
  given = {**dict(seed=jnp.zeros(2, jnp.uint32), batch=0, mb_size=3, n=10,
                  mode=0), **arguments}
  with pytest.raises(error, match=message):
    device_streams.device_batch(**given)
  indices, _ = device_streams.device_batch(
      jnp.zeros(2, jnp.uint32), np.int64(3), 3, 10, np.int64(2))
  assert indices.tolist() == cs.stream_batches(
      0, 3, 1, 3, 10, True, True)[0][0].tolist()


# The words of docs/counter_streams.rst ("The words, for a
# reimplementation"), in Python integers, written from that text.
_M = 0xFFFFFFFF
_G = 0x9E3779B9


def _f(x):
  x ^= x >> 16
  x = (x * 0x85EBCA6B) & _M
  x ^= x >> 13
  x = (x * 0xC2B2AE35) & _M
  return x ^ (x >> 16)


def _absorbed(h, *words):
  for w in words:
    h = _f(((h ^ w) * _G) & _M)
  return h


def _doc_uniform(seed, t, n):
  s0, s1, t0, t1 = seed & _M, seed >> 32, t & _M, t >> 32

  def u(tag, a):
    return _absorbed(_absorbed(_G, tag, s0, s1), t0, t1, a, s0, s1)

  span = 2**64 if n > 2**32 else 2**32
  a = 0
  while True:
    low = u(0x85A308D3, a)
    if n <= 2**24:
      h = low
    else:
      high = u(0x13198A2E, a)
      h = low ^ high if n <= 2**32 else (high << 32) | (low ^ high)
    if h < span - span % n:
      return h % n
    a += 1


def _doc_permute(seed, e, o, n):
  s0, s1, e0, e1 = seed & _M, seed >> 32, e & _M, e >> 32
  f, g = (_absorbed(p, e0, e1, p) for p in
          (_absorbed(_G, tag, s0, s1) for tag in (0x243F6A88, 0x082EFA98)))
  k = [_f(((_f(((f ^ r) * _G) & _M) ^ g) * _G) & _M) for r in range(13)]
  if n <= 16:
    h = [_f(((_f(((k[0] ^ i) * _G) & _M) ^ k[1]) * _G) & _M)
         for i in range(n)]
    return next(i for i in range(n) if sum(x < h[i] for x in h) == o)
  b = max(2, (n - 1).bit_length())
  lbits, rbits = b // 2, b - b // 2
  left, right = o >> rbits, o & ((1 << rbits) - 1)
  while True:
    for r in range(12):
      if r % 2 == 0:
        left ^= _f(right ^ k[r]) & ((1 << lbits) - 1)
      else:
        right ^= _f(left ^ k[r]) & ((1 << rbits) - 1)
    if (left << rbits | right) < n:
      break
  value = left << rbits | right
  return value ^ (k[12] & 1) if value < 2 else value


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 1000, 2**24 + 3, 2**32 + 5,
                               10**12])
def test_the_documented_words_give_the_streams(n):
  """docs/counter_streams.rst states the streams' words so that they can
  be implemented again without jax_data: an implementation of that text
  gives the library's draws and permutations."""
  for seed in (0, 1, 2**32 + 7, 2**64 - 1):
    positions = [0, 1, 2, 63, 2**33 + 5, 10**15 + 3]
    assert [_doc_uniform(seed, t, n) for t in positions] == cs.uniform(
        seed, positions, n).tolist()
    for epoch in (0, 1, 2**40 + 9):
      offsets = sorted({0, min(1, n - 1), n // 2, n - 1})
      assert [_doc_permute(seed, epoch, o, n) for o in offsets] == (
          cs.permute(seed, epoch, offsets, n).tolist())
