"""``cached_batches_count="auto"``: a random pipeline's cache chosen by its
number of chains when they are made, restored exactly, refused where the
chains come too late."""

import json
import re
import warnings

import jax
import numpy as np
import pytest
from jax import lax

import jax_data
from jax_data import NumpyDataLoader
from jax_data.compiled import pipeline as pl

# Rows of 4,096 float32 and a mask byte: 64 KiB a batch of 16, so that a few
# chains already share the CPU budget of 16 MiB.
N, MB, WIDE = 600, 16, 4096


@pytest.fixture(autouse=True)
def _cores_of_large_l3(monkeypatch):
  """The figures below are those of a machine whose cores share 64 MiB of
  L3 (a CPU budget of 16 MiB) whatever this one's are: the choice by the
  L3 has tests of its own (test_the_budget_follows_the_cores_l3)."""
  monkeypatch.setattr(pl, "usable_cache_bytes",
                      lambda level: pl.AUTO_L3_BYTES if level == 3 else None)


def _wide():
  rows = np.arange(N * WIDE, dtype=np.float32).reshape(N, WIDE)
  return NumpyDataLoader(x=rows)


def _first_columns(pipeline, state, steps):
  """The batches' first columns under ``vmap``, and the final states."""
  _, batch_fn, _ = pipeline

  def run(state):
    return jax_data.scan(lambda c, b: (c, b["x"][:, 0]), 0, state,
                         batch_fn=batch_fn, length=steps)

  (_, state), rows = jax.jit(jax.vmap(run))(state)
  return np.asarray(rows), state


def test_the_rule_fills_the_budget_between_one_and_a_hundred_batches():
  loader = _wide()
  batch = MB * pl.row_bytes(loader)
  assert batch == MB * (4 * WIDE + 1)
  for platform, budget in (("cpu", pl.AUTO_CPU_BYTES),
                           ("gpu", pl.AUTO_DEVICE_BYTES)):
    for chains in (1, 2, 3, 7, 64, 256, 4096):
      size = pl.auto_cache_size(loader, MB, chains, platform)
      assert 1 <= size <= min(pl.AUTO_MAX_BATCHES, -(-N // MB))
      # The most batches within the budget, unless one batch is over it.
      assert size == 1 or size * chains * batch <= budget
      if size < min(pl.AUTO_MAX_BATCHES, -(-N // MB)):
        assert (size + 1) * chains * batch > budget
  # One pass over the data bounds it; small rows reach the most.
  assert pl.auto_cache_size(NumpyDataLoader(x=np.arange(50)), 4, 1,
                            "cpu") == 13
  assert pl.auto_cache_size(NumpyDataLoader(x=np.arange(10**6)), 4, 1,
                            "cpu") == pl.AUTO_MAX_BATCHES


def _cache_tree(root, cores):
  """A sysfs tree of ``cores``: per core, ``(level, type, size, shared)``
  for each cache."""
  for core, caches in enumerate(cores):
    for i, fields in enumerate(caches):
      folder = root / f"cpu{core}" / "cache" / f"index{i}"
      folder.mkdir(parents=True)
      for name, value in zip(("level", "type", "size", "shared_cpu_list"),
                             fields):
        (folder / name).write_text(value + "\n")
  return str(root)


def test_a_cache_level_is_read_once_per_cache(tmp_path, monkeypatch):
  """Each usable core's cache of a level counts once, a cache shared by
  cores once in all; instruction caches and other levels do not count; a
  tree that cannot be read, or has no cache of that level, gives None."""
  from jax_data.loaders import gather
  monkeypatch.setattr(gather.os, "sched_getaffinity", lambda pid: {0, 1})
  own = [[("1", "Data", "32K", str(c)), ("1", "Instruction", "32K", str(c)),
          ("2", "Unified", "1024K", str(c)), ("3", "Unified", "32768K",
                                             "0-1")] for c in (0, 1)]
  tree = _cache_tree(tmp_path / "own", own)
  assert gather.usable_cache_bytes(2, tree) == 2 << 20
  assert gather.usable_cache_bytes(3, tree) == 32 << 20
  assert gather.usable_cache_bytes(1, tree) == 64 << 10
  shared = [[("2", "Unified", "4M", "0-1"), ("2", "Instruction", "1M",
                                             "0-1")]] * 2
  assert gather.usable_cache_bytes(2, _cache_tree(tmp_path / "shared",
                                                  shared)) == 4 << 20
  none = [[("1", "Data", "48K", "0")], [("1", "Data", "48K", "1")]]
  assert gather.usable_cache_bytes(3, _cache_tree(tmp_path / "none",
                                                  none)) is None
  bad = [[("3", "Unified", "lots", "0")], [("3", "Unified", "1M", "1")]]
  assert gather.usable_cache_bytes(3, _cache_tree(tmp_path / "bad",
                                                  bad)) is None
  assert gather.usable_cache_bytes(3, str(tmp_path / "absent")) is None


@pytest.mark.parametrize("l3, budget", [
    (None, pl.AUTO_CPU_BYTES), (pl.AUTO_L3_BYTES, pl.AUTO_CPU_BYTES),
    (480 << 20, pl.AUTO_CPU_BYTES),
    (pl.AUTO_L3_BYTES - 1, pl.AUTO_CPU_LARGE_BYTES),
    (32 << 20, pl.AUTO_CPU_LARGE_BYTES)])
def test_the_budget_follows_the_cores_l3(l3, budget, monkeypatch, pipelines):
  """On a CPU "auto" keeps all caches within 16 MiB where the usable
  cores share 64 MiB of L3 or more (or it cannot be read), within 256 MiB
  where they share less; off a CPU within 256 MiB whatever the L3. The
  pipeline's first chains get the size of that budget."""
  monkeypatch.setattr(pl, "usable_cache_bytes",
                      lambda level: l3 if level == 3 else None)
  assert pl.auto_budget("cpu") == budget
  assert pl.auto_budget("gpu") == pl.AUTO_DEVICE_BYTES
  assert pl.auto_budget("cpu", l3_bytes=l3) == budget
  loader = NumpyDataLoader(x=np.zeros((100_000, 33), np.float32))
  row = pl.row_bytes(loader)
  for chains in (1, 16, 256, 1024):
    want = max(1, min(budget // (chains * 64 * row), pl.AUTO_MAX_BATCHES))
    assert pl.auto_cache_size(loader, 64, chains, "cpu") == want
    assert pl.auto_cache_size(loader, 64, chains, "cpu",
                              budget=budget) == want
  if jax.default_backend() == "cpu":
    init_fn, _, release_fn = pipelines.random_reference_data(
        _wide(), "auto", MB)
    want = min(38, budget // (3 * MB * (4 * WIDE + 1)))
    assert init_fn(seed=range(3)).mask.shape == (3, want, MB)
    release_fn()


@pytest.mark.parametrize("chains", [1, 3, 12])
def test_auto_is_the_rules_size_and_gives_its_batches(chains, pipelines):
  """The states of ``init_fn(seed=range(C))`` hold the rule's batches for
  C chains on this (CPU) device, and the chains give the batches of a
  pipeline made with that number."""
  loader = _wide()
  size = pl.auto_cache_size(loader, MB, chains, jax.default_backend())
  assert size == min(38, 16 * 2**20 // (chains * MB * (4 * WIDE + 1)))
  auto = pipelines.random_reference_data(loader, "auto", MB)
  state = auto[0](seed=range(chains), shuffle=True)
  assert state.mask.shape == (chains, size, MB)
  fixed = pipelines.random_reference_data(_wide(), size, MB)
  want, _ = _first_columns(fixed, fixed[0](seed=range(chains), shuffle=True),
                           2 * size + 5)
  got, _ = _first_columns(auto, state, 2 * size + 5)
  np.testing.assert_array_equal(got, want)
  # Chains made later keep the size, a single one too; a call of so many
  # more that "auto" would choose half the batches or fewer says so, once.
  more = 4 * chains
  smaller = pl.auto_cache_size(loader, MB, more, jax.default_backend())
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert auto[0](seed=range(more)).mask.shape[1] == size
    assert auto[0](seed=range(more)).mask.shape[1] == size
    assert auto[0](seed=1).mask.shape == (size, MB)
  told = [str(w.message) for w in caught]
  assert told == ([] if 2 * smaller > size else [
      f"cached_batches_count='auto' sized this pipeline's caches at {size} "
      f"batches for the {chains} chain(s) of its first init_fn call; this "
      f"init_fn call makes {more} chains, for which it chooses {smaller}. "
      "To size the caches for them, make them with the first init_fn call "
      "of a new pipeline, or give cached_batches_count a number"])
  assert caught == [] or caught[0].filename == __file__
  auto[2]()
  fixed[2]()


def test_a_single_seed_chooses_for_one_chain(pipelines):
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(
      _wide(), "auto", MB)
  state = init_fn(seed=4)
  assert state.mask.shape == (min(38, 16 * 2**20 // (MB * (4 * WIDE + 1))),
                              MB)
  state, batch = jax.jit(batch_fn)(state)
  assert batch["x"].shape == (MB, WIDE)
  release_fn()


def test_states_of_one_seed_held_together_say_so_once(pipelines):
  """States of one chain each, held to stack for ``vmap``, have caches
  sized for one chain: the ``init_fn`` call that brings the chains held to
  so many that "auto" would choose half the batches or fewer warns, once.
  States dropped or donated are not held."""
  loader = _wide()
  init_fn, _, release_fn = pipelines.random_reference_data(loader, "auto",
                                                           MB)
  size = init_fn(seed=0, stream="counter").mask.shape[0]
  platform = jax.default_backend()
  assert size == pl.auto_cache_size(loader, MB, 1, platform)
  # The first count of chains held at once for which "auto" would choose
  # half the batches or fewer.
  many = next(c for c in range(2, 100)
              if 2 * pl.auto_cache_size(loader, MB, c, platform) <= size)
  assert 2 < many < 10
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for seed in range(3 * many):  # each dropped at once
      init_fn(seed=seed, stream="counter")
    # The state of the last call is not counted (a variable bound again
    # still holds it): these make many - 1 chains held at most.
    held = [init_fn(seed=seed, stream="counter") for seed in range(many)]
    held[0].mask.delete()  # as a donated state is
    held.append(init_fn(seed=many, stream="counter"))
  with pytest.warns(UserWarning) as caught:
    held.append(init_fn(seed=many + 1, stream="counter"))
  wanted = pl.auto_cache_size(loader, MB, many, platform)
  assert [str(w.message) for w in caught] == [
      f"cached_batches_count='auto' sized this pipeline's caches at {size} "
      "batches for the 1 chain(s) of its first init_fn call; with this "
      "init_fn call's, the chains of the states its calls returned and "
      f"still held number {many}, for which it chooses {wanted}. To size "
      "the caches for many chains, make them with one "
      "init_fn(seed=range(C)) call, the first of a new pipeline, or give "
      "cached_batches_count a number"]
  assert caught[0].filename == __file__
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once
    held += [init_fn(seed=range(2 * many), stream="counter")]
  release_fn()


def test_a_dropped_state_of_chains_apart_does_not_hide_those_held(
    pipelines):
  """A state of an exact stream (its chains refresh apart, for which
  "auto" chooses more batches), dropped at once, counts neither its chains
  nor their way of refreshing: the counter states held warn as they would
  without it."""
  loader = _wide()
  init_fn, _, release_fn = pipelines.random_reference_data(loader, "auto",
                                                           MB)
  platform = jax.default_backend()
  held = [init_fn(seed=0, stream="counter")]
  size = held[0].mask.shape[0]
  many = next(c for c in range(2, 100)
              if 2 * pl.auto_cache_size(loader, MB, c, platform) <= size)
  init_fn(seed=99, stream="exact")  # dropped at once
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # The last call's state is not counted: many - 1 chains held.
    held += [init_fn(seed=seed, stream="counter")
             for seed in range(1, many)]
  with pytest.warns(UserWarning, match=f"still held number {many},"):
    held.append(init_fn(seed=many, stream="counter"))
  release_fn()


def test_a_state_bound_again_or_traced_is_not_held(pipelines):
  """A variable bound to each new state in turn holds one chain, though
  one chain more would halve the batches "auto" chooses; states made
  while tracing are not noted (nor does noting them fail)."""
  loader = NumpyDataLoader(x=np.zeros((1200, WIDE), np.float32))
  platform = jax.default_backend()
  size = pl.auto_cache_size(loader, MB, 1, platform)
  assert 2 * pl.auto_cache_size(loader, MB, 2, platform) <= size
  init_fn, _, release_fn = pipelines.random_reference_data(loader, "auto",
                                                           MB)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = init_fn(seed=0, stream="counter")
    for seed in range(1, 6):
      state = init_fn(seed=seed, stream="counter")
    assert state.mask.shape == (size, MB)
    traced = jax.jit(lambda: [init_fn(seed=s, stream="counter").chunk
                              for s in (7, 8)])()
  assert len(traced) == 2
  release_fn()


def test_a_restored_auto_pipeline_keeps_the_saved_size(pipelines):
  """A checkpoint of 12 chains (caches of 5 batches) restores into a new
  ``"auto"`` pipeline that made no chain yet with caches of 10, and the
  rest of every chain's stream is the same; one already laid out for other
  sizes says why it does not fit."""
  saved_pipeline = pipelines.random_reference_data(_wide(), "auto", MB)
  state = saved_pipeline[0](seed=range(12), shuffle=True, in_epochs=True)
  _, state = _first_columns(saved_pipeline, state, 13)
  tree = jax_data.state_to_pytree(saved_pipeline, state)
  rest, _ = _first_columns(saved_pipeline, state, 25)
  saved_pipeline[2]()

  again = pipelines.random_reference_data(_wide(), "auto", MB)
  restored = jax_data.state_from_pytree(again, tree)
  assert restored.mask.shape == (12, 5, MB)
  got, _ = _first_columns(again, restored, 25)
  np.testing.assert_array_equal(got, rest)
  with pytest.warns(UserWarning, match="from the checkpoint restored into "
                    "it; this init_fn call makes 40 chains"):
    assert again[0](seed=range(40)).mask.shape[1] == 5  # the size it took
  again[2]()

  other = pipelines.random_reference_data(_wide(), "auto", MB)
  other[0](seed=0)  # laid out for one chain: 38 batches
  with pytest.raises(jax_data.CheckpointError, match=re.escape(
      "cache_size is 5 in the checkpoint but 38 here") + ".*" + re.escape(
          "cached_batches_count='auto' chose 38 batches for the 1 chain(s) "
          "of this pipeline's first init_fn call: restore into a new "
          "pipeline before any init_fn call (it takes the checkpoint's "
          "size), or give cached_batches_count=5")):
    jax_data.state_from_pytree(other, tree)
  other[2]()


def test_a_refused_checkpoint_chooses_no_size(pipelines):
  """A checkpoint refused by a new ``"auto"`` pipeline (saved over other
  data, or cut short) leaves it as it was: the chains ``init_fn`` makes
  next get the rule's size, not the checkpoint's, and the pipeline's
  first caches are sized for them."""
  saved = pipelines.random_reference_data(_wide(), "auto", MB)
  tree = jax_data.state_to_pytree(saved, saved[0](seed=range(12)))
  saved[2]()
  assert json.loads(np.asarray(tree["host"]).tobytes())["fingerprint"][
      "cache_size"] == 5
  rows = np.arange(N * WIDE, dtype=np.float32).reshape(N, WIDE) + 1
  pipeline = pipelines.random_reference_data(NumpyDataLoader(x=rows),
                                            "auto", MB)
  init_fn, _, release_fn = pipeline
  with pytest.raises(jax_data.CheckpointError, match="does not fit: data"):
    jax_data.state_from_pytree(pipeline, tree)
  with pytest.raises(jax_data.CheckpointError, match="no field 'key'"):
    jax_data.state_from_pytree(pipeline, {
        k: v for k, v in tree.items() if k != "key"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = init_fn(seed=0)
  assert state.mask.shape[0] == pl.auto_cache_size(
      NumpyDataLoader(x=rows), MB, 1, jax.default_backend())
  release_fn()


def test_auto_on_a_device_loader_keeps_no_cache(pipelines):
  init_fn, batch_fn, release_fn = pipelines.random_reference_data(
      jax_data.DeviceNumpyDataLoader(x=np.arange(30)), "auto", 4)
  state = init_fn(seed=range(3))
  _, batches = jax.jit(jax.vmap(lambda s: lax.scan(
      lambda st, _: batch_fn(st), s, None, length=5)))(state)
  assert state.mask.shape == (3, 0, 4) and batches["x"].shape == (3, 5, 4)
  release_fn()


def test_where_auto_cannot_choose_it_is_refused_by_name(pipelines):
  loader = NumpyDataLoader(x=np.arange(40))
  for bad, error in (("Auto", TypeError), ("", TypeError)):
    with pytest.raises(error, match=re.escape(
        f"an integer or 'auto', got cached_batches_count={bad!r}")):
      pipelines.random_reference_data(loader, bad, 4)
  for make in (pipelines.full_reference_data, pipelines.full_data_mapper):
    with pytest.raises(ValueError,
                       match="a full-data pass takes a number of batches"):
      make(loader, "auto", 4)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  with pytest.raises(ValueError, match="give cached_batches_count a number"):
    pipelines.random_reference_data(loader, "auto", 4, mesh=mesh,
                                    batch_axis="data")
  # A batch over the cache limit is refused before anything is made.
  row = np.zeros(2**20, np.float32)  # 4 MiB; 65 of them in a batch
  huge = NumpyDataLoader(x=np.broadcast_to(row, (65, row.size)))
  with pytest.raises(ValueError, match=re.escape(
      "cached_batches_count='auto': one batch of mb_size=65 observations of "
      "4194305 bytes takes 260 MiB, over the limit of 256 MiB per chain "
      "(jax_data.pipeline.MAX_CACHE_BYTES); use a smaller mb_size")):
    pipelines.random_reference_data(huge, "auto", 65)
  # Just over: in bytes, where MiB read "256 MiB, over the limit of 256".
  row = np.zeros(2**24, np.float32)  # 64 MiB and a mask byte a row
  edge = NumpyDataLoader(copy=False, x=np.broadcast_to(row, (4, row.size)))
  with pytest.raises(ValueError, match=re.escape(
      "takes 268,435,460 bytes, over the limit of 268,435,456 bytes per "
      "chain")):
    pipelines.random_reference_data(edge, "auto", 4)


def test_an_auto_pipeline_without_chains_refuses_states_and_release_holds(
    pipelines):
  """Before its first chain, a state is not one of the pipeline's (also
  for a checkpoint); a release before any chain refuses chains after."""
  one = pipelines.random_reference_data(NumpyDataLoader(x=np.arange(40)),
                                        3, 4)
  foreign = one[0](seed=0)
  auto = pipelines.random_reference_data(NumpyDataLoader(x=np.arange(40)),
                                         "auto", 4)
  init_fn, batch_fn, release_fn = auto
  with pytest.raises(TypeError, match="has made no chain yet"):
    batch_fn(foreign)
  with pytest.raises(TypeError, match="has made no chain yet"):
    jax_data.scan(lambda c, b: (c, None), 0, foreign, batch_fn=batch_fn,
                  length=2)
  with pytest.raises(TypeError, match="has made no chain yet"):
    jax_data.state_to_pytree(auto, foreign)
  # No state at all is named as such (it was called "a state").
  with pytest.raises(TypeError, match="got state of type NoneType"):
    jax_data.scan(lambda c, b: (c, None), 0, None, batch_fn=batch_fn,
                  length=2)
  release_fn()
  release_fn()
  with pytest.raises(jax_data.PipelineReleasedError):
    init_fn(seed=0)
  one[2]()


def test_bad_init_keywords_choose_nothing(pipelines):
  """A refused ``init_fn`` call lays nothing out: the next one chooses."""
  init_fn, _, release_fn = pipelines.random_reference_data(
      _wide(), "auto", MB)
  with pytest.raises(ValueError, match="seed=-1"):
    init_fn(seed=[1, -1])
  assert init_fn(seed=range(12)).mask.shape == (12, 5, MB)
  release_fn()


def test_chains_that_refresh_one_by_one_keep_a_hundred_batches(pipelines):
  """Exact streams (and tf.data shuffle buffers) refresh chain by chain,
  with a fixed part each: "auto" gives them at least 100 batches where
  they fit (here a pass, 38), counter-based chains the budget's 5."""
  loader = _wide()
  assert pl.auto_cache_size(loader, MB, 12, "cpu", together=False) == 38
  big = NumpyDataLoader(x=np.zeros((100_000, 33), np.float32))
  for chains, want in ((1, 1000), (256, 100), (4096, 100)):
    assert pl.auto_cache_size(big, 64, chains, "cpu",
                              together=False) == want
  for stream, size in (("exact", 38), ("counter", 5)):
    init_fn, _, release_fn = pipelines.random_reference_data(
        _wide(), "auto", MB)
    assert init_fn(seed=range(12),
                   stream=stream).mask.shape == (12, size, MB)
    release_fn()


def test_loaders_of_slow_rows_keep_at_most_a_hundred_batches(pipelines):
  """A SourceDataLoader (a __getitem__ per record) and a TensorflowDataLoader
  read from its pipeline have slow rows: a chain's first refresh reads a
  whole cache, so "auto" keeps at most 100 batches there, where the same
  rows in memory get 1,000; fewer where the budget gives fewer."""
  rows = np.zeros((100_000, 1), np.float32)
  source = jax_data.SourceDataLoader([{"x": row} for row in rows[:1000]],
                                     workers=0)
  fast = [NumpyDataLoader(x=rows)]
  slow = [jax_data.SourceDataLoader(_Rows(rows), workers=0)]
  tf = _tensorflow()
  if tf is not None:
    dataset = tf.data.Dataset.from_tensor_slices({"x": rows})
    fast.append(jax_data.TensorflowDataLoader(dataset, in_memory=True))
    slow.append(jax_data.TensorflowDataLoader(dataset))
  for loader in fast + slow:
    assert loader.slow_rows == (loader in slow)
    for chains, together, want_fast, want_slow in (
        (1, True, 1000, 100), (16, True, 1000, 100), (1, False, 1000, 100),
        (2048, True, 25, 25), (2048, False, 100, 100)):
      assert pl.auto_cache_size(loader, 64, chains, "cpu", together) == (
          want_slow if loader in slow else want_fast)
  init_fn, _, release_fn = pipelines.random_reference_data(source, "auto", 4)
  assert init_fn(seed=0).mask.shape == (100, 4)  # a pass is 250 batches
  release_fn()


class _Rows:
  """A random-access source of records ``{"x": rows[i]}``."""

  def __init__(self, rows):
    self._rows = rows

  def __len__(self):
    return len(self._rows)

  def __getitem__(self, i):
    return {"x": self._rows[i]}


def _tensorflow():
  try:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
  except ImportError:  # optional: the loaders of slow rows then are one
    return None
  return tf


@pytest.mark.parametrize("second", ["init", "restore"])
def test_threads_that_lay_out_an_auto_pipeline_at_once_build_one_host(
    monkeypatch, tmp_path, second):
  """Two threads' first init_fn calls on an "auto" pipeline (or a restore
  beside one) each built a host of their own, and one's state belonged to
  no pipeline (16 of 20 tries of a reviewer's probe), or a restore that
  failed undid init_fn's layout. A slower sizing and building here make
  the calls meet: without the lock, the restore case fails every time."""
  import threading
  import time

  def slowly(function):
    def slow(*args, **kwargs):
      time.sleep(0.1)
      return function(*args, **kwargs)
    return slow

  saved_pipeline = jax_data.random_reference_data(
      NumpyDataLoader(x=np.arange(1000.0, dtype=np.float32)), 5, 4)
  checkpoint = tmp_path / "state.npz"
  jax_data.save_checkpoint(checkpoint, saved_pipeline,
                           saved_pipeline[0](seed=9))
  monkeypatch.setattr(pl, "auto_cache_size", slowly(pl.auto_cache_size))
  monkeypatch.setattr(pl, "assemble", slowly(pl.assemble))
  pipeline = jax_data.random_reference_data(
      NumpyDataLoader(x=np.arange(1000.0, dtype=np.float32)), "auto", 4)
  init_fn, batch_fn, release_fn = pipeline
  barrier, states, errors = threading.Barrier(2), {}, []

  def make(k):
    barrier.wait()
    try:
      if k == 1 and second == "restore":
        states[k] = jax_data.restore_checkpoint(checkpoint, pipeline)
      else:
        states[k] = init_fn(seed=range(3) if k else 7)
    except Exception as error:  # pylint: disable=broad-except
      errors.append(error)

  threads = [threading.Thread(target=make, args=(k,)) for k in range(2)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  if second == "restore" and errors:
    # init_fn came first and chose its size: the checkpoint's does not fit,
    # and saying so undoes nothing of init_fn's
    assert len(errors) == 1 and 1 not in states
    assert isinstance(errors[0], jax_data.CheckpointError)
    assert "cache_size is 5 in the checkpoint" in str(errors[0])
  else:
    assert not errors
  batch_fns = {0: jax.jit(batch_fn), 1: jax.jit(
      batch_fn if second == "restore" else jax.vmap(batch_fn))}
  for k, state in states.items():  # each is this pipeline's
    jax.block_until_ready(batch_fns[k](state))
  release_fn()
