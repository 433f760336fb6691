"""The counter-based batches of many chains in one vectorised draw: the same
batches as chain by chain."""

import numpy as np
import pytest

from jax_data import counter_streams as cs
from jax_data.counter_chains import chain_batches

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
