"""Follows requests through jax_data call by call (architecture check).

For each trip (serving a chunk, a group of chains' refresh, registering a
chain, restoring a chain, building a pipeline, and a new pipeline's first
chain and first chunk) it
records, in the calling thread, every call from one jax_data module into
another and prints:

* stops: the jax_data modules the trip enters, in order of first entry
  (the entry module first); the loader seam and the loaders behind it
  (``host_loader``, a loader's module, its cursor and what it reads
  with) are one stop, ``loader``, and the value types and checks every
  layer uses (``chains``, ``validation``, ``errors``, ``types``) are none;
* climbs back: calls from a module into one that imports it, directly or
  not (a call back up into a layer above: a callback);
* handoffs: the distinct (caller, callee) pairs of stops, each call
  from one stop into another counted once: how often the work changes
  hands (a request that zigzags between two modules has both pairs).

Run: ``python benchmarks/trips.py``.
"""

import ast
import pathlib
import sys

import jax
import numpy as np

import jax_data

HELPERS = {"jax_data.validation", "jax_data.errors", "jax_data.types",
           "jax_data.loaders.chains", "jax_data.module_paths", "jax_data"}
# The loader seam and what is behind it: one stop.
LOADER = ("jax_data.loaders.", "jax_data.streams.")


def _above():
  """Module -> the jax_data modules that import it, directly or not."""
  package = pathlib.Path(jax_data.__file__).parent
  imports = {}
  for path in package.rglob("*.py"):
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{a.name}"
                                 for a in node.names]
        found.update(n for n in names if n.startswith("jax_data."))
    name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
    imports[name.removesuffix(".__init__")] = found
  above = {m: set() for m in imports}
  for importer in imports:
    todo, seen = list(imports[importer]), set()
    while todo:
      module = todo.pop()
      if module in seen or module not in imports:
        continue
      seen.add(module)
      above[module].add(importer)
      todo.extend(imports[module])
  return above


ABOVE = _above()


def _stop(module):
  """The stop a module belongs to, or None (not jax_data, or a helper)."""
  if not module.startswith("jax_data") or module in HELPERS:
    return None
  if module.startswith(LOADER):
    return "loader"
  return module.removeprefix("jax_data.")


def follow(name, fn):
  stops, climbs, stack, handoffs = [], [], [], set()

  def profile(frame, event, arg):
    del arg
    if event == "call":
      module = frame.f_globals.get("__name__", "")
      stop = _stop(module)
      caller = next((m for m in reversed(stack) if m is not None),
                    (None, None))
      if stop is not None and stop != caller[0]:
        if module in ABOVE.get(caller[1], ()):
          climbs.append(f"{caller[1]} -> {module} ({frame.f_code.co_name})")
        if stop not in stops:
          stops.append(stop)
        if caller[0] is not None:
          handoffs.add((caller[0], stop))
      stack.append(None if stop is None else (stop, module))
    elif event == "return" and stack:
      stack.pop()

  sys.setprofile(profile)
  try:
    fn()
  finally:
    sys.setprofile(None)
  print(f"{name}: {len(stops)} stops, {len(climbs)} climbs back, "
        f"{len(handoffs)} handoffs")
  print("  stops: " + " -> ".join(stops))
  print("  handoffs: " + ", ".join(f"{a}>{b}" for a, b in sorted(handoffs)))
  for climb in climbs:
    print("  climb: " + climb)


def main():
  data = {"x": np.arange(4000.0).reshape(1000, 4).astype(np.float32)}
  loader = jax_data.NumpyDataLoader(**data)
  pipeline = jax_data.random_reference_data(loader, 4, 8)
  init_fn, batch_fn, _ = pipeline
  state = init_fn(seed=0)
  state, _ = jax.jit(batch_fn)(state)  # compiled; chunk 0 served
  host = pipeline.host
  assert host.wait_idle()
  chain = int(state.chain)
  layout = host.layout
  outs = [np.empty((1,) + s, leaf.dtype) for s, leaf in
          zip(layout.leaf_shapes(), layout.leaves)]
  outs.append(np.empty((1,) + layout.lead, bool))

  def serve(index):
    return lambda: host.serve_into(outs, np.array([host.id]),
                                   np.array([chain]), np.array([index]),
                                   np.array([True]))

  follow("serving a chunk produced ahead", serve(1))
  follow("serving a chunk not stored (far ahead)", serve(9))
  # Eight vmapped counter chains refreshed together on a CPU device: the
  # group's first refresh finds its chains, the next ones know them.
  group = init_fn(seed=range(10, 18), stream="counter")
  lanes = [np.empty((1, 8) + o.shape[1:], o.dtype) for o in outs]

  def refresh(index):
    return lambda: host.serve_into(
        [a[0] for a in lanes], np.full(8, host.id), np.asarray(group.chain),
        np.full(8, index), np.ones(8, bool), cpu=True)

  follow("serving a group of counter chains (its first refresh)",
         refresh(0))
  follow("serving a group of counter chains", refresh(1))
  follow("registering a chain (init_fn)", lambda: init_fn(seed=3))
  spec = loader.chain_spec(False, seed=5, shuffle=True)
  follow("registering a chain (Host.register)", lambda: host.register(spec))
  saved = host.save_chain(chain, 9)
  follow("restoring a chain (Host.restore_chain)",
         lambda: host.restore_chain(saved, 9))
  # A new pipeline makes its chains at its first init_fn and its store at
  # its first request (its constructor makes neither).
  fresh = jax_data.random_reference_data(loader, 4, 8)
  made = []
  follow("registering the first chain of a new pipeline",
         lambda: made.append(fresh.init_fn(seed=1)))
  follow("serving the first chunk of a new pipeline",
         lambda: fresh.host.serve_into(
             outs, np.array([fresh.host.id]), np.array([made[0].chain]),
             np.array([0]), np.array([True])))
  fresh.release_fn()
  follow("a constructor (full_reference_data)",
         lambda: jax_data.full_reference_data(loader, 4, 8))
  follow("a constructor (random_reference_data)",
         lambda: jax_data.random_reference_data(loader, 4, 8))


if __name__ == "__main__":
  main()
