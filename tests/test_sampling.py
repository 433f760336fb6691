"""Index streams: the exact rules of spec/SAMPLING.md."""

import math

import numpy as np
import pytest

from jax_data import sampling


def _random(n, mb, seed=0, shuffle=False, in_epochs=False, start=0):
  return sampling.RandomStream(sampling.ObservationRange(start, n), mb, seed,
                               shuffle, in_epochs)


def _batches(stream, count, cache=1):
  """``count`` batches drawn ``cache`` at a time."""
  rows, masks = [], []
  while len(rows) < count:
    idx, mask = stream.draw(cache)
    rows.extend(idx)
    masks.extend(np.ones_like(idx, bool) if mask is None else mask)
  return np.array(rows[:count]), np.array(masks[:count])


@pytest.mark.parametrize("n", [3, 10**4, 2**33 + 7])
@pytest.mark.parametrize("mb", [1, 3, 64, 65])
def test_one_draw_per_chunk_equals_one_per_batch(n, mb):
  """Draws are vectorised per chunk; the stream must not change."""
  rng = sampling.default_rng(5)
  expected = [rng.choice(n, size=mb, replace=True) for _ in range(7)]
  stream = _random(n, mb, seed=5)
  got, _ = stream.draw(7)
  np.testing.assert_array_equal(got, expected)
  assert stream._rng.bit_generator.state == rng.bit_generator.state


def test_independent_draws_equal_rng_choice():
  rng = sampling.default_rng(7)
  expected = [rng.choice(1000, size=5, replace=True) for _ in range(20)]
  got, mask = _batches(_random(1000, 5, seed=7), 20)
  np.testing.assert_array_equal(got, expected)
  assert mask.all()


def test_shuffle_stream_is_concatenated_permutations():
  n, mb = 10, 3
  rng = sampling.default_rng(1)
  stream = np.concatenate([rng.choice(n, size=n, replace=False)
                           for _ in range(4)])
  got, mask = _batches(_random(n, mb, seed=1, shuffle=True), 12)
  np.testing.assert_array_equal(got.reshape(-1), stream[:36])
  assert mask.all()


def test_shuffle_duplicates_only_across_permutation_boundary():
  n, mb = 10, 3
  duplicates = 0
  for seed in range(5):
    got, _ = _batches(_random(n, mb, seed=seed, shuffle=True), 30)
    flat = got.reshape(-1)
    for start in range(0, flat.size - n + 1, n):
      # Every aligned window of n indices is one permutation.
      assert sorted(flat[start:start + n]) == list(range(n))
    for j, batch in enumerate(got):
      if len(set(batch.tolist())) < mb:
        duplicates += 1
        spans_boundary = (j * mb) // n != (j * mb + mb - 1) // n
        assert spans_boundary, f"seed {seed}: batch {j} repeats {batch}"
  assert duplicates > 0  # repeats do happen across boundaries


def test_epochs_serve_every_observation_once_with_padding():
  n, mb = 10, 3
  per_epoch = math.ceil(n / mb)
  got, mask = _batches(_random(n, mb, seed=2, shuffle=True, in_epochs=True),
                       per_epoch * 5, cache=4)
  for epoch in range(5):
    rows = got[epoch * per_epoch:(epoch + 1) * per_epoch]
    valid = mask[epoch * per_epoch:(epoch + 1) * per_epoch]
    assert sorted(rows[valid].tolist()) == list(range(n))
    assert (rows[~valid] == 0).all()
    assert valid.sum() == n
    assert not valid[-1, 1:].any()  # the last batch is padded


def test_guide_fourth_batches():
  """Three chains registered independent, shuffle, epochs: seeds 0, 1, 2."""
  cases = [(0, False, False, [4, 6, 6], [True] * 3),
           (1, True, False, [0, 4, 7], [True] * 3),
           (2, True, True, [5, 0, 0], [True, False, False])]
  for seed, shuffle, in_epochs, batch, valid in cases:
    got, mask = _batches(_random(10, 3, seed, shuffle, in_epochs), 4, cache=2)
    assert got[3].tolist() == batch
    assert mask[3].tolist() == valid


@pytest.mark.parametrize("shuffle,in_epochs", [(False, False), (True, False),
                                                (True, True)])
def test_cache_size_does_not_change_stream(shuffle, in_epochs):
  a, ma = _batches(_random(17, 4, 5, shuffle, in_epochs), 40, cache=3)
  b, mb_ = _batches(_random(17, 4, 5, shuffle, in_epochs), 40, cache=5)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(ma, mb_)


@pytest.mark.parametrize("shuffle,in_epochs", [(False, False), (True, False),
                                                (True, True)])
def test_state_round_trip_continues_stream(shuffle, in_epochs):
  original = _random(23, 5, 9, shuffle, in_epochs)
  original.draw(7)
  state = original.get_state()
  frozen = repr(state)
  expected = original.draw(11)
  restored = _random(23, 5, 9, shuffle, in_epochs)
  restored.set_state(state)
  got = restored.draw(11)
  np.testing.assert_array_equal(got[0], expected[0])
  assert repr(state) == frozen  # set_state did not mutate it


def test_state_of_other_mode_is_rejected():
  state = _random(10, 2).get_state()
  with pytest.raises(ValueError, match="mode 'independent'"):
    _random(10, 2, shuffle=True).set_state(state)


def test_ordered_passes_start_at_zero():
  n, mb = 10, 4
  stream = sampling.OrderedStream(sampling.ObservationRange(0, n), mb)
  idx, mask = stream.draw(7)  # two passes of 3 batches and one more
  assert idx[:3].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
  assert mask[2].tolist() == [True, True, False, False]
  np.testing.assert_array_equal(idx[3:6], idx[:3])
  assert idx[6].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("n,mb,start", [(10, 4, 0), (12, 4, 0), (23, 5, 7)])
def test_ordered_draws_are_the_ordered_batches_from_any_batch(n, mb, start):
  # Within a pass (a range) or across its end (modulo, masked): the same
  # indices and mask as ordered_batches, for every first batch and count.
  observations = sampling.ObservationRange(start, n)
  stream = sampling.OrderedStream(observations, mb)
  for first in range(stream.batches_per_pass):
    for count in range(1, 2 * stream.batches_per_pass + 2):
      stream.set_state({"mode": "ordered", "batch": first})
      idx, mask = stream.draw(count)
      want_idx, want_mask = sampling.ordered_batches(first, count, mb,
                                                     observations)
      np.testing.assert_array_equal(idx, want_idx)
      np.testing.assert_array_equal(mask, want_mask)
      assert idx.dtype == want_idx.dtype and mask.dtype == bool
      assert stream.get_state()["batch"] == (
          (first + count) % stream.batches_per_pass)


def test_a_pass_of_more_batches_ends_in_batches_of_its_first_observation():
  """A pass padded to more batches than the observations fill (a device's
  share of a split pass) keeps the spec's last batch, fillers 0, 1, ...,
  and then whole invalid batches of its first observation alone, one row
  to read rather than the pass again."""
  observations = sampling.ObservationRange(7, 10)
  stream = sampling.OrderedStream(observations, 4, 5)
  idx, mask = stream.draw(6)
  assert idx.tolist() == [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 7, 8],
                          [7] * 4, [7] * 4, [7, 8, 9, 10]]
  assert mask.tolist() == [[True] * 4, [True] * 4, [True, True, False, False],
                           [False] * 4, [False] * 4, [True] * 4]


def test_shards_are_disjoint_and_cover():
  for n in (1, 7, 10, 101):
    for k in range(1, min(n, 5) + 1):
      shards = [sampling.ObservationRange.shard(n, i, k) for i in range(k)]
      covered = [j for s in shards for j in range(s.start, s.start + s.count)]
      assert covered == list(range(n))


def test_sharded_stream_draws_inside_its_shard():
  got, _ = _batches(_random(5, 2, seed=1, shuffle=True, start=20), 10)
  assert set(got.reshape(-1)) == set(range(20, 25))


# -- shuffle buffer -----------------------------------------------------------


def _buffer_stream(count, buffer_size, seed, steps, chunk):
  stream = sampling.BufferShuffle(count, buffer_size, seed)
  stream.seek(0)
  parts = [stream.take(min(chunk, steps - i)) for i in range(0, steps, chunk)]
  return np.concatenate(parts)


@pytest.mark.parametrize("count,buffer_size", [(10, 1), (23, 5), (20, 50),
                                               (3000, 100), (7, 7)])
def test_buffer_shuffle_passes_hold_every_element_once_within_the_window(
    count, buffer_size):
  stream = _buffer_stream(count, buffer_size, 3, 3 * count, 7)
  for p, one_pass in enumerate(stream.reshape(3, count)):
    elements = one_pass - p * count  # numbered along the passes
    assert sorted(elements.tolist()) == list(range(count))
    # Step t emits only elements the buffer has read: 0 .. t + size - 1.
    assert np.all(elements <= np.arange(count) + buffer_size - 1)
  if buffer_size == 1:
    assert stream.tolist() == list(range(3 * count))  # no shuffling
  elif count > buffer_size:
    assert (stream[:count] != stream[count:2 * count] - count).any()


GOLDEN_BUFFER_STREAM = [3, 2, 5, 4, 6, 7, 0, 8, 9, 1, 13, 14, 15, 10, 11, 17,
                        19, 16, 12, 18, 21, 24, 20, 25, 27]


def test_buffer_shuffle_golden_values():
  # Pinned: a change of the stream definition must be deliberate.
  assert _buffer_stream(10, 4, 7, 25, 25).tolist() == GOLDEN_BUFFER_STREAM


@pytest.mark.parametrize("chunk", [1, 6, 64, 1000])
def test_buffer_shuffle_does_not_depend_on_chunks_or_seeks(chunk):
  # 2**16 + 700 elements: draws come from two blocks of generators.
  count = 2**16 + 700
  whole = _buffer_stream(count, 50, 1, count + 2000, count + 2000)
  assert np.array_equal(_buffer_stream(count, 50, 1, 3000, chunk),
                        whole[:3000])
  stream = sampling.BufferShuffle(count, 50, 1)
  for position in (2**16 - 3, count - 60, count - 1, count + 5):
    stream.seek(position)
    assert np.array_equal(stream.take(chunk), whole[position:position + chunk])
  assert not np.array_equal(_buffer_stream(count, 50, 2, 100, 100),
                            whole[:100])
  # Back and forth among slots drawn ahead, and past them.
  for position in (10, 3, 3, 4000, 3990, 100, 2**16 - 40, 2**16 - 41):
    stream.seek(position)
    assert np.array_equal(stream.take(chunk), whole[position:position + chunk])


def _buffer_stream_by_definition(count, size, seed, passes):
  """The stream as the class docstring (and spec/SAMPLING.md) defines it,
  one step at a time, each block of slot draws made whole."""
  out = []
  for p in range(passes):
    buffer = list(p * count + np.arange(size))
    for t in range(count - size):
      if t % 2**16 == 0:
        block = np.random.default_rng([seed, p, 0, t // 2**16]).integers(
            0, size, 2**16)
      slot = block[t % 2**16]
      out.append(buffer[slot])
      buffer[slot] = p * count + size + t
    order = np.random.default_rng([seed, p, 1]).permutation(size)
    out.extend(buffer[i] for i in order)
  return np.array(out)


@pytest.mark.parametrize("size", [3, 300, 70_000])
def test_buffer_shuffle_follows_its_definition(size):
  """Slot draws are taken from a generator a chunk at a time, not as whole
  blocks of 2**16: the same values, over a block's end and across
  passes, for slots of one, two and three bytes."""
  count = 2**16 + size + 5
  expected = _buffer_stream_by_definition(count, size, 4, 2)
  assert np.array_equal(_buffer_stream(count, size, 4, 2 * count, 997),
                        expected)



@pytest.mark.parametrize("count", [2**31 - 1, 2**31, 2**40])
def test_buffer_shuffle_holds_the_numbers_of_huge_passes(count):
  """Passes of 2**31 elements and more: what a buffer holds is numbered
  along the stream, and split at a horizon past its pass it keeps all of
  it, also the last element of a pass (a pass of exactly 2**31 once kept
  that one out)."""
  stream = sampling.BufferShuffle(count, 3, 0)
  stream.seek(count + 5)  # pass 1
  held = stream.held()
  numbers = held.numbers()
  assert numbers.dtype == np.int64 and numbers.min() >= count
  kept, rest = held.split(2 * count + 10)
  assert kept.tolist() == sorted(numbers.tolist()) and rest is None
  last = sampling.Held(np.array([count - 1, 0], held.local.dtype), count)
  kept, rest = last.split(2 * count)  # one past the pass
  assert kept.tolist() == [count, 2 * count - 1] and rest is None
  kept, rest = last.split(2 * count - 1)
  assert kept.tolist() == [count] and rest == 2 * count - 1

def test_buffer_shuffle_buffered_is_read_but_not_emitted():
  count, size = 12, 5
  stream = sampling.BufferShuffle(count, size, 0)
  stream.seek(0)
  emitted = []
  for step in range(2 * count):
    first_pass_element = step // count * count
    within = step % count
    read = set(range(first_pass_element,
                     first_pass_element + min(count, size + within)))
    expected = read - set(emitted) if within else set()
    assert set(stream.buffered().tolist()) == expected
    emitted.extend(stream.take(1).tolist())


@pytest.mark.parametrize("count,size,position,steps", [
    (3000, 10, 0, 640), (3000, 10, 1234, 640), (3000, 10, 2600, 640),
    (3000, 10, 2200, 640), (2**16 + 700, 3, 2**16 - 100, 640),
    (2**16 + 700, 3, 2**16 + 10, 64)])
def test_buffer_shuffles_taken_together_take_what_each_takes(
    count, size, position, steps):
  """``take_together`` of 256 shuffles (chains of one vmap) gives each
  one's ``take``, and leaves each where its ``take`` would, also where it
  declines (a pass that drains, a block of draws that ends): the next
  steps are the same."""
  seeds = range(256)
  alone = [sampling.BufferShuffle(count, size, seed) for seed in seeds]
  together = [sampling.BufferShuffle(count, size, seed) for seed in seeds]
  for shuffle in alone + together:
    shuffle.seek(position)
  expected = np.stack([shuffle.take(steps) for shuffle in alone])
  got = sampling.BufferShuffle.take_together(together, steps)
  fits = position + steps <= count - size and (
      position % 2**16 + steps <= 2**16)
  assert (got is not None) == fits
  if got is None:
    got = np.stack([shuffle.take(steps) for shuffle in together])
  np.testing.assert_array_equal(got, expected)
  for a, b in zip(alone, together):
    assert b.position == a.position
    np.testing.assert_array_equal(b.buffered(), a.buffered())
    np.testing.assert_array_equal(b.take(100), a.take(100))



def test_buffer_shuffles_stepped_together_and_alone_in_turn_keep_streams():
  """Chains stepped together draw their slots ahead; steps taken alone in
  between use those draws, and every chain's stream stays its own."""
  count, size = 3000, 10
  shuffles = [sampling.BufferShuffle(count, size, seed) for seed in range(256)]
  for shuffle in shuffles:
    shuffle.seek(0)
  parts = []
  for steps, together in ((640, True), (100, False), (640, True), (7, False),
                          (640, True)):
    if together:
      parts.append(sampling.BufferShuffle.take_together(shuffles, steps))
      assert parts[-1] is not None
    else:
      parts.append(np.stack([shuffle.take(steps) for shuffle in shuffles]))
  got = np.concatenate(parts, axis=1)
  for seed in (0, 1, 255):
    np.testing.assert_array_equal(
        got[seed], _buffer_stream(count, size, seed, got.shape[1],
                                  got.shape[1]))

@pytest.mark.parametrize("seed", range(3))
def test_buffer_shuffles_stepped_together_in_any_sequence_keep_streams(
    monkeypatch, seed):
  """Shuffles stepped together share their buffers and slot draws; random
  sequences of steps together (all of them, reordered, a part), alone,
  seeks, trims and failed steps keep every shuffle's stream its
  definition, over blocks of draws and passes, and what each buffer
  holds what a shuffle stepped alone holds."""
  monkeypatch.setattr(sampling.BufferShuffle, "_TOGETHER_FROM", 2)
  count, size, lanes = 2**16 + 300, 40, 6
  reference = {lane: _buffer_stream_by_definition(count, size, lane, 3)
               for lane in range(lanes)}
  shuffles = [sampling.BufferShuffle(count, size, lane)
              for lane in range(lanes)]
  for shuffle in shuffles:
    shuffle.seek(0)
  rng = np.random.default_rng(seed)
  fill_rows = sampling._fill_rows

  def check(lane, start, got):
    np.testing.assert_array_equal(got, reference[lane][start:start + got.size])

  for _ in range(120):
    op = rng.choice(["all", "all", "all", "reordered", "part", "alone",
                     "seek", "trim", "fail"])
    steps = int(rng.choice([1, 63, 640, 2000, 7000]))
    lanes_now = list(range(lanes))
    if op == "reordered":
      lanes_now = rng.permutation(lanes).tolist()
    elif op == "part":
      lanes_now = sorted(rng.choice(lanes, 3, replace=False).tolist())
    at = [shuffles[lane].position for lane in lanes_now]
    if op in ("all", "reordered", "part"):
      if max(at) + steps > 3 * count - size:
        continue
      taken = sampling.BufferShuffle.take_and_hold_together(
          [shuffles[lane] for lane in lanes_now], steps)
      if taken is None:
        rows = [shuffles[lane].take(steps) for lane in lanes_now]
      else:
        rows = list(taken[0].numbers())
        for held, lane in zip(taken[1].local, lanes_now):
          np.testing.assert_array_equal(
              np.sort(held + taken[1].base),
              np.sort(shuffles[lane].buffered()))
      for lane, start, row in zip(lanes_now, at, rows):
        check(lane, start, row)
    elif op == "alone":
      lane = int(rng.integers(lanes))
      start = shuffles[lane].position
      if start + steps <= 3 * count - size:
        check(lane, start, shuffles[lane].take(steps))
    elif op == "seek":
      target = int(rng.choice(at)) if rng.random() < 0.7 else int(
          rng.integers(0, 2 * count))
      for shuffle in shuffles:
        shuffle.seek(target)
    elif op == "trim":
      lane = int(rng.integers(lanes))
      position = shuffles[lane].position
      shuffles[lane].trim()
      assert shuffles[lane].held_bytes() == 0
      shuffles[lane].seek(position)
    else:  # a step together fails part way; its shuffles seek again
      def failing(*args):
        raise KeyboardInterrupt
      monkeypatch.setattr(sampling, "_fill_rows", failing)
      try:
        sampling.BufferShuffle.take_and_hold_together(shuffles, steps)
      except KeyboardInterrupt:
        assert all(shuffle.position is None for shuffle in shuffles)
        for shuffle, position in zip(shuffles, at):
          shuffle.seek(position)
      monkeypatch.setattr(sampling, "_fill_rows", fill_rows)
    for lane, shuffle in enumerate(shuffles):
      alone = sampling.BufferShuffle(count, size, lane)
      alone.seek(shuffle.position)
      np.testing.assert_array_equal(np.sort(shuffle.buffered()),
                                    np.sort(alone.buffered()))


def test_buffer_shuffles_stepped_together_to_a_blocks_end_draw_the_next():
  """A group stepped together up to the end of a block of slot draws
  takes the next block's draws for its next steps together."""
  count, size = 2**17 + 50, 20
  shuffles = [sampling.BufferShuffle(count, size, seed) for seed in range(256)]
  for shuffle in shuffles:
    shuffle.seek(2**16 - 1280)
  parts = [sampling.BufferShuffle.take_together(shuffles, 640)
           for _ in range(4)]
  assert all(part is not None for part in parts)
  got = np.concatenate(parts, axis=1)
  for seed in (0, 255):
    expected = _buffer_stream_by_definition(count, size, seed, 1)
    np.testing.assert_array_equal(got[seed],
                                  expected[2**16 - 1280:2**16 + 1280])


def test_buffer_shuffles_at_different_steps_are_taken_one_by_one():
  shuffles = [sampling.BufferShuffle(3000, 10, seed) for seed in range(256)]
  for shuffle in shuffles:
    shuffle.seek(100)
  shuffles[7].seek(101)
  assert sampling.BufferShuffle.take_together(shuffles, 64) is None
  assert all(s.position == (101 if i == 7 else 100)
             for i, s in enumerate(shuffles))
  assert sampling.BufferShuffle.take_together(shuffles[:255], 64) is None
  shuffles[0].position = None
  with pytest.raises(RuntimeError, match="seek first"):
    sampling.BufferShuffle.take_together(shuffles, 64)


def test_buffer_shuffle_takes_no_steps():
  stream = sampling.BufferShuffle(10, 3, 0)
  stream.seek(4)
  assert stream.take(0).tolist() == []
  assert stream.position == 4


def test_buffer_shuffle_needs_a_seek_after_a_failure():
  stream = sampling.BufferShuffle(10, 3, 0)
  with pytest.raises(RuntimeError, match="seek first"):
    stream.take(2)


@pytest.mark.parametrize("mode", [dict(), dict(shuffle=True),
                                  dict(shuffle=True, in_epochs=True)])
def test_trimming_never_changes_the_stream(mode):
  """An idle chain's cursor drops its permutations; they are drawn again."""
  expected, _ = _batches(_random(23, 4, seed=9, **mode), 40)
  stream = _random(23, 4, seed=9, **mode)
  rows = []
  for _ in range(40):
    stream.trim()
    rows.extend(stream.draw(1)[0])
  np.testing.assert_array_equal(np.array(rows), expected)
