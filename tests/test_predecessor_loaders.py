"""Loaders written the predecessor's way (JaxSGMC's ``HostDataLoader``
contract: ``_format``, ``register_*_pipeline``, ``get_batches`` returning a
mask or None, optional ``save_state``/``load_state``) serve pipelines as
they are."""

import collections
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_data
from jax_data.loaders.chains import ObservationRange
from jax_data.loaders.chains import OrderedChain
from jax_data.loaders.chains import RandomChain
from jax_data.loaders.chains import spec_from_json
from jax_data.loaders.chains import spec_to_json

N = 10


class Predecessor(jax_data.HostDataLoader):
  """Batches in order (random chains too), wrapping round with no padding
  and a None mask; records the keywords of each registration."""

  def __init__(self, count=N):
    self._count = count
    self.chains = []  # [cache_size, mb_size, keywords, position]

  @property
  def _format(self):
    return {"base": jax.ShapeDtypeStruct((), jnp.int32)}

  @property
  def static_information(self):
    return {"observation_count": self._count}

  def register_random_pipeline(self, cache_size=1, mb_size=None, **kwargs):
    self.chains.append([cache_size, mb_size, kwargs, 0])
    return len(self.chains) - 1

  register_ordered_pipeline = register_random_pipeline

  def get_batches(self, chain_id):
    cache, mb, keywords, position = self.chains[chain_id]
    rows = (position + np.arange(cache * mb)) % N
    self.chains[chain_id][3] = position + cache * mb
    scale = 100 if keywords.get("augment") else 1
    return {"base": (scale * rows).reshape(cache, mb).astype(np.int32)}, None


class Saving(Predecessor):

  def save_state(self, chain_id):
    return {"position": self.chains[chain_id][3]}

  def load_state(self, chain_id, data):
    self.chains[chain_id][3] = data["position"]


class Unsaving(Predecessor):
  """As the predecessor's HDF5 loader: no checkpoints."""

  def save_state(self, chain_id):
    raise NotImplementedError("Saving of the DataLoader state is not "
                              "supported.")

  def load_state(self, chain_id, data):
    raise NotImplementedError("Loading is not supported.")


def test_the_predecessors_format_property_is_the_observation_format():
  loader = Saving()
  assert loader.observation_format == loader._format
  assert isinstance(jax_data.NumpyDataLoader(x=np.arange(3)),
                    jax_data.HostDataLoader)
  with pytest.raises(TypeError, match="abstract"):
    type("Formless", (jax_data.HostDataLoader,), {
        "static_information": {"observation_count": 3}})()


class SixtyFourBits(Predecessor):
  """As the predecessor's NumpyDataLoader over np.arange: a format of the
  array's int64, and batches of NumPy's int64."""

  @property
  def _format(self):
    return {"base": jax.ShapeDtypeStruct((), np.int64)}

  def get_batches(self, chain_id):
    batches, mask = super().get_batches(chain_id)
    return {"base": batches["base"].astype(np.int64)}, mask


def test_a_format_of_64_bit_dtypes_serves_them_as_jax_holds_them():
  """Without jax_enable_x64, int64 is served as int32, as the
  predecessor's arrays were (before: a bare error from pure_callback)."""
  loader = SixtyFourBits()
  assert loader.observation_format["base"].dtype == np.int32
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 2,
                                                                 3)
  state, drawn = init_fn(), []
  for _ in range(3):
    state, batch = batch_fn(state)
    assert batch["base"].dtype == np.int32
    drawn.extend(np.asarray(batch["base"]).tolist())
  assert drawn == list(range(9))
  release_fn()
  mapper_fn, release_fn = jax_data.full_data_mapper(SixtyFourBits(), 2, 5)
  np.testing.assert_array_equal(
      mapper_fn(lambda b, c: (b["base"] * 2, c), None)[0], 2 * np.arange(N))
  release_fn()


def test_registrations_get_the_keywords_given():
  """No seed where none was given (the loader's own default, as the
  predecessor registered it); a seed given and the loader's own declared
  options reach it, and its batches."""

  class WithOption(Saving):
    random_keywords = jax_data.HostDataLoader.random_keywords + ("augment",)

  loader = WithOption()
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(loader, 2,
                                                                 3)
  _, plain = batch_fn(init_fn())
  _, augmented = batch_fn(init_fn(seed=7, augment=True))
  assert [keywords for _, _, keywords, _ in loader.chains] == [
      {}, {"augment": True, "seed": 7}]
  np.testing.assert_array_equal(plain["base"], [0, 1, 2])
  np.testing.assert_array_equal(augmented["base"], [0, 100, 200])
  release_fn()


def test_options_travel_in_the_spec_and_its_json():
  """A loader's own keywords are in the spec its open_chain gets, and in
  the spec a checkpoint writes; specs without them write as before."""
  observations = ObservationRange(0, 5)
  for spec in (RandomChain(3, observations, options=(("augment", True),)),
               OrderedChain(observations, options=(("crop", 4),)),
               RandomChain(3, observations)):
    saved = spec_to_json(spec)
    assert ("options" in saved) == bool(spec.options)
    assert spec_from_json(saved) == spec
  with pytest.raises(ValueError, match="options must map names"):
    spec_from_json({**spec_to_json(RandomChain(3, observations)),
                    "options": [1, 2]})


@pytest.mark.parametrize("information", [False, True])
def test_a_none_mask_of_an_ordered_chain_is_taken_by_position(information):
  """The guide's masked sum of squares over a loader whose last batch wraps
  round unpadded with a None mask: 285, as the predecessor masked by
  position; a split into chunks with a partial last one too."""

  def masked(batch, mask, carry):
    return jnp.sum(mask * batch["base"]**2), carry

  def informed(batch, mask, carry):
    batch, info = batch
    return jnp.sum(info.mask * batch["base"]**2), carry

  fun = informed if information else masked
  for cache, mb in ((3, 4), (2, 3), (1, 7)):
    init_fn, map_fn, release_fn = jax_data.full_reference_data(
        Saving(), cache, mb)
    _, (sums, _) = map_fn(fun, init_fn(), None, masking=True,
                          information=information)
    assert int(jnp.sum(sums)) == 285, (cache, mb)
    release_fn()
  mapper_fn, release_fn = jax_data.full_data_mapper(Saving(), 3, 4)
  sums, _ = mapper_fn(masked, None, masking=True)
  assert int(jnp.sum(sums)) == 285
  release_fn()


@pytest.mark.parametrize("loader_class", [Predecessor, Unsaving])
def test_a_loader_without_save_state_serves_in_order(loader_class):
  """Random batches in order need no save_state; going back (a state used
  again after the chain moved on) says what is missing, and the chain
  still serves its next chunk."""
  init_fn, batch_fn, release_fn = jax_data.random_reference_data(
      loader_class(), 2, 3, verify_calls=False)
  step = jax.jit(batch_fn)
  state = first = init_fn()
  for k in range(40):  # past the chunks a chain keeps
    state, batch = step(state)
    assert np.asarray(batch["base"]).tolist() == [
        (3 * k + i) % N for i in range(3)]
  with pytest.raises(Exception, match="cannot go back to an earlier chunk"):
    jax.block_until_ready(step(first))
  _, batch = step(state)
  assert np.asarray(batch["base"]).tolist() == [(120 + i) % N
                                                for i in range(3)]
  release_fn()


def test_the_predecessors_methods_name_a_pipelines_chain():
  """``save_state`` of a chain that a pipeline made says where its
  position lives instead of that it does not exist."""
  loader = jax_data.NumpyDataLoader(x=np.arange(N))
  init_fn, _, release_fn = jax_data.random_reference_data(loader, 2, 3)
  init_fn(seed=1)
  with pytest.raises(ValueError, match="chain_id=0 .* is a pipeline's "
                     "chain .*save_checkpoint"):
    loader.save_state(0)
  with pytest.raises(ValueError, match=r"chain_id=5 .* does not exist \(1 "
                     "chains numbered\\)"):
    loader.get_batches(5)
  release_fn()


@pytest.mark.parametrize("count", [np.int64(N), jnp.int32(N)])
def test_an_observation_count_of_any_integer_kind_works(count):
  """A count stated as a NumPy or JAX integer (the predecessor's TF loader
  gave ``jnp.int32``) is a Python int, and full-data passes run; a count
  that is no integer is named."""
  loader = Saving(count)
  assert type(loader.observation_count) is int
  init_fn, map_fn, release_fn = jax_data.full_reference_data(loader, 2, 5)
  _, (values, _) = map_fn(lambda batch, carry: (batch["base"], carry),
                          init_fn(), None)
  np.testing.assert_array_equal(values, np.arange(N))
  release_fn()
  with pytest.raises(TypeError, match=r"static_information\['observation_"
                     r"count'\] must be an integer or None, got 2.5"):
    Saving(2.5).observation_count  # noqa: B018 (the property raises)


def test_the_guides_full_pass_over_a_predecessor_loader():
  """``full_data_mapper`` of a function of two arguments over the
  predecessor-style loader gives one result per observation."""
  mapper_fn, release_fn = jax_data.full_data_mapper(Saving(), 2, 4)
  squares, _ = mapper_fn(
      functools.partial(lambda p, batch, carry: (batch["base"]**p, carry), 2),
      None)
  np.testing.assert_array_equal(squares, np.arange(N)**2)
  release_fn()


def test_a_checkpoint_restores_a_chain_registered_as_it_was(tmp_path):
  """A chain of such a loader made without a seed is saved without one:
  restored, it is registered with the same keywords (none), and it goes
  on with the same batches."""
  loader = Saving()
  pipeline = jax_data.random_reference_data(loader, 2, 3)
  init_fn, batch_fn, release_fn = pipeline
  state, _ = batch_fn(init_fn())
  state, _ = batch_fn(batch_fn(state)[0])
  jax_data.save_checkpoint(tmp_path / "c.npz", pipeline, state)
  _, expected = batch_fn(state)
  restored = jax_data.restore_checkpoint(tmp_path / "c.npz", pipeline)
  _, got = batch_fn(restored)
  assert [keywords for _, _, keywords, _ in loader.chains] == [{}, {}]
  np.testing.assert_array_equal(got["base"], expected["base"])
  release_fn()


@pytest.mark.parametrize("loader_class", [Predecessor, Unsaving])
def test_a_chain_without_save_state_is_refused_when_saved(loader_class,
                                                          tmp_path):
  """The checkpoint of a chain whose loader cannot save its position is
  refused when saved, saying so, not when restored."""
  pipeline = jax_data.random_reference_data(loader_class(), 2, 3)
  init_fn, batch_fn, release_fn = pipeline
  state, _ = batch_fn(init_fn())
  with pytest.raises(jax_data.CheckpointError, match="cannot be saved: "
                     ".*needs save_state and load_state for checkpoints"):
    jax_data.save_checkpoint(tmp_path / "c.npz", pipeline, state)
  release_fn()


class Live(Predecessor):
  """Its save_state is its live bookkeeping (JaxSGMC's users serialised it
  at once), and holds an array, a tuple and NumPy numbers."""

  def save_state(self, chain_id):
    chain = self.chains[chain_id]
    chain[2]["log"] = (np.int64(chain[3]), np.arange(chain[3] % 5))
    return {"keywords": chain[2], "position": chain}

  def load_state(self, chain_id, data):
    position = data["position"][3]
    assert isinstance(data["keywords"]["log"][1], np.ndarray)
    assert data["keywords"]["log"][0] == np.int64(position)
    self.chains[chain_id][3] = position


def _batches(batch_fn, state, count):
  batches = []
  for _ in range(count):
    state, batch = batch_fn(state)
    batches.append(np.asarray(batch["base"]))
  return np.stack(batches)


def _replayed_and_moved_on(loader):
  """A pipeline over ``loader`` and a state three batches on, after its
  first state was used again (a replay: the first batches again)."""
  pipeline = jax_data.random_reference_data(loader, 2, 3)
  first = pipeline.init_fn()
  state = first
  for _ in range(3):
    state, _ = pipeline.batch_fn(state)
  np.testing.assert_array_equal(_batches(pipeline.batch_fn, first, 3)[0],
                                np.arange(3))
  return pipeline, state


def test_a_live_save_state_restores_and_replays_exactly(tmp_path):
  """A save_state that returns the loader's own bookkeeping (which moves on
  as chunks are read ahead), with arrays, tuples and NumPy numbers in it:
  a checkpoint and a state used again give the batches that followed."""
  pipeline, state = _replayed_and_moved_on(Live())
  jax_data.save_checkpoint(tmp_path / "c.npz", pipeline, state)
  expected = _batches(pipeline.batch_fn, state, 6)
  other = jax_data.random_reference_data(Live(), 2, 3)
  restored = jax_data.restore_checkpoint(tmp_path / "c.npz", other)
  np.testing.assert_array_equal(_batches(other.batch_fn, restored, 6),
                                expected)
  pipeline.release_fn()
  other.release_fn()


class Unportable(Saving):

  def save_state(self, chain_id):
    return {**super().save_state(chain_id), "rng": np.random.default_rng()}


def test_a_save_state_a_checkpoint_cannot_hold_is_refused_when_saved(
    tmp_path):
  """A state a checkpoint cannot hold (a Generator) still serves replays in
  the process; saving it says what and where."""
  pipeline, state = _replayed_and_moved_on(Unportable())
  with pytest.raises(jax_data.CheckpointError, match=re.escape(
      "cannot be saved: its save_state returned a Generator at "
      "state['rng']")):
    jax_data.save_checkpoint(tmp_path / "c.npz", pipeline, state)
  pipeline.release_fn()


def test_a_save_state_is_held_exactly_or_refused_naming_the_value():
  """What a checkpoint holds of a save_state comes back with its types
  (NumPy dtypes and byte orders, np.float64 as np.float64, tuples, int
  keys); a value whose type JSON would lose is refused, naming it."""
  from jax_data.loaders import legacy_loader
  state = {"f64": np.float64(2.5), "names": np.array(["ab", "c"]),
           "big": np.arange(3, dtype=">i4"), "half": np.ones(2, jnp.bfloat16),
           "pair": (1, np.int16(2)), "by_chain": {3: [4.0, None]},
           "flag": np.bool_(True)}
  encoded = json.loads(json.dumps(legacy_loader.encode_state(state)))
  decoded = legacy_loader.decode_state(encoded)
  assert decoded.keys() == state.keys()
  for key, value in state.items():
    got = decoded[key]
    assert type(got) is type(value), key
    assert np.asarray(got).dtype == np.asarray(value).dtype, key
    np.testing.assert_array_equal(np.asarray(got, object),
                                  np.asarray(value, object))
  for value, named in [(np.array([1 + 2j]), "dtype complex128"),
                       (np.ones(2, np.longdouble),
                        f"dtype {np.dtype(np.longdouble)}"),
                       (np.datetime64("2020-01-01"), "dtype datetime64[D]"),
                       (collections.defaultdict(int), "a defaultdict"),
                       (collections.namedtuple("Epoch", "e")(1), "an Epoch")]:
    with pytest.raises(TypeError, match=re.escape(named.split(" ", 1)[1])
                       + r".* at state\['x'\]\[0\]"):
      legacy_loader.encode_state({"x": [value]})


def test_a_position_saved_before_the_encoding_restores_as_it_was():
  """A position saved before save_state's value was encoded is that value
  as it was, also one with a key of the encoding's kind."""
  loader = Saving()
  chain = loader.register_random_pipeline(2, 3)
  cursor = jax_data.loaders.legacy_loader.LegacyCursor(
      loader, chain, jax_data.random_reference_data(Saving(), 2, 3).host
      .layout)
  loader.chains[chain][3] = 99
  cursor.seek({"position": 7})
  assert loader.chains[chain][3] == 7


class _FormatMixin:
  @property
  def _format(self):
    return {"base": jax.ShapeDtypeStruct((), jnp.int32)}


def test_a_format_from_a_mixin_is_the_observation_format():
  class Mixed(_FormatMixin, jax_data.HostDataLoader):
    static_information = {"observation_count": N}

    def get_batches(self, chain_id):
      raise AssertionError("not called")

  assert Mixed().observation_format == Mixed()._format


def test_a_loaders_own_keywords_reach_it_alike_after_a_restore(tmp_path):
  """A loader's own keyword is given to its chain as a checkpoint keeps
  it (a NumPy scalar a Python number, a tuple a list), before and after
  a restore; one a checkpoint cannot hold is named when saved."""
  seen = []

  class Scaled(jax_data.NumpyDataLoader):
    random_keywords = jax_data.NumpyDataLoader.random_keywords + ("scale",)

    def open_chain(self, spec, layout):
      seen.append(dict(spec.options))
      return super().open_chain(spec, layout)

  pipeline = jax_data.random_reference_data(Scaled(x=np.arange(N)), 2, 3)
  init_fn, batch_fn, release_fn = pipeline
  state, _ = batch_fn(init_fn(seed=1, scale=np.float32(2.0)))
  jax_data.save_checkpoint(tmp_path / "c.npz", pipeline, state)
  jax_data.restore_checkpoint(tmp_path / "c.npz", pipeline)
  state, _ = batch_fn(init_fn(seed=2, scale=(1, 2)))
  jax_data.save_checkpoint(tmp_path / "d.npz", pipeline, state)
  jax_data.restore_checkpoint(tmp_path / "d.npz", pipeline)
  assert seen == [{"scale": 2.0}] * 2 + [{"scale": [1, 2]}] * 2
  assert type(seen[0]["scale"]) is float
  state, _ = batch_fn(init_fn(seed=3, scale=np.arange(3)))
  with pytest.raises(TypeError, match=r"keyword scale=array\(\[0, 1, 2\]\) "
                     "cannot be saved in a checkpoint"):
    jax_data.save_checkpoint(tmp_path / "e.npz", pipeline, state)
  release_fn()


def test_a_fresh_full_pass_state_per_pass_of_a_loader_that_cannot_seek():
  """A loader without save_state cannot go back to a pass's start: each
  init_fn of a full-data pipeline gives it a chain of its own, so a fresh
  state per pass passes over the data each time (one chain shared by
  every init_fn, as other loaders get, refused the second pass). After
  release, init_fn says the pipeline was released."""
  loader = Unsaving()
  init_fn, map_fn, release_fn = jax_data.full_reference_data(loader, 1, 5)
  total = lambda b, m, c: (jnp.sum(jnp.where(m, b["base"], 0)), c)
  for passes in range(1, 4):
    _, (sums, _) = map_fn(total, init_fn(), None, masking=True)
    assert int(sums.sum()) == N * (N - 1) // 2
    assert len(loader.chains) == passes
  release_fn()
  with pytest.raises(jax_data.PipelineReleasedError):
    init_fn()
  init_fn, _, release_fn = jax_data.full_reference_data(
      jax_data.NumpyDataLoader(x=np.arange(10.0)), 2, 5)
  init_fn()
  release_fn()
  with pytest.raises(jax_data.PipelineReleasedError):
    init_fn()  # the chain it gave before is released with the pipeline
