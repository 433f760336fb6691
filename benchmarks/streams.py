"""Case (f): shuffled chains over 1e8 and 1e12 records with counter-based
index streams: time to the first batch, memory, and seek.

Each measurement runs in a fresh child process over a virtual
random-access source (a record of 4 float32 computed from its index, with
``__getitems__``), ``random_reference_data(loader, 10, 64)`` and ``C``
shuffled chains ``init_fn(seed=c, shuffle=True, stream=...)`` stacked for
one jitted ``vmap`` of ``batch_fn``. Reported:

* the first call after compilation (the first chunk of every chain);
* the growth of the resident set from before the chains were made to the
  end of that call, less what XLA's compilation of the call added, next to
  the bytes of the caches themselves (the device caches and the chunks the
  host stores for them);
* a chain restored at draw 1e9 and at draw 1e3 (a state whose chunk
  counter is set there): the first batch of each;
* the exact streams (``stream="exact"``) of today as the reference, at
  sizes they can reach.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import numpy as np
from common import Section
from common import Target
from common import format_bytes
from common import format_count
from common import run_child

RECORD_BYTES = 16  # 4 float32
CACHE, MB = 10, 64


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of case (f): (records, chains, stream) per row."""
  rows: tuple[tuple[int, int, str], ...]
  seek_records: int


FULL = Config(rows=((10**7, 4, "exact"), (10**8, 4, "counter"),
                    (10**12, 4, "counter"), (10**8, 1024, "counter"),
                    (10**12, 1024, "counter")),
              seek_records=10**8)
SMOKE = Config(rows=((10**5, 2, "exact"), (10**8, 2, "counter")),
               seek_records=10**6)


def run(config: Config, repeats: int) -> Section:
  """Measures every row in its own child process.

  Args:
    config: Sizes.
    repeats: Unused: each row is one fresh process.
  """
  del repeats
  results = []
  for records, chains, stream in config.rows:
    result = _child_run({"what": "first", "records": records,
                         "chains": chains, "stream": stream})
    print(f"  {format_count(records)} records, {chains} chains, {stream}: "
          f"first batch {result['first_s']:.3f} s, RSS "
          f"+{format_bytes(result['growth'])}", flush=True)
    results.append((records, chains, stream, result))
  seek = _child_run({"what": "seek", "records": config.seek_records})
  return _section(config, results, seek)


def _child_run(request: dict[str, Any]) -> dict[str, Any]:
  return run_child(os.path.abspath(__file__), "--child", request)


def _section(config: Config, results: list, seek: dict[str, Any]
             ) -> Section:
  rows = []
  first_ok, memory_ok = [], []
  for records, chains, stream, result in results:
    caches = result["cache_bytes"]
    beyond = result["growth"] - caches
    rows.append([format_count(records), str(chains), stream,
                 f"{result['first_s']:.3f} s", format_bytes(result["growth"]),
                 format_bytes(caches), format_bytes(max(beyond, 0))])
    if stream == "counter" and records >= 10**8:
      first_ok.append(result["first_s"] < 1.0)
      memory_ok.append(beyond < (64 << 20 if chains <= 4 else 256 << 20))
  full = config is FULL
  ratio = seek["far_s"] / seek["near_s"]
  return Section(
      key="streams",
      title="(f) Shuffled chains over 1e8-1e12 records: counter-based "
            "index streams",
      description=(
          "A virtual random-access source (a record of 4 float32 computed "
          "from its index), random_reference_data(loader, 10, 64), C "
          "shuffled chains stacked for one jitted vmap of batch_fn; each "
          "row a fresh process. First batch: the first call after "
          "compilation. RSS growth: from before the chains were made to "
          "the end of that call, less what compiling the call added. "
          "Caches: the device caches (C x 10 x 64 records and masks) and "
          "the chunks the host stores for them (up to 4 per chain). "
          "'exact' is stream='exact', today's streams, at a size they reach "
          "in seconds."),
      headers=["records", "chains", "stream", "first batch",
               "RSS growth", "caches", "beyond the caches"],
      rows=rows,
      notes=[f"A chain restored at draw 1e9 serves its first batch in "
             f"{seek['far_s'] * 1e3:.1f} ms, one at draw 1e3 in "
             f"{seek['near_s'] * 1e3:.1f} ms ({ratio:.2f}x; "
             f"{format_count(config.seek_records)} records, no replay)."],
      targets=[
          Target("(f) first batch, 4 and 1,024 counter chains, 1e8 and "
                 "1e12", "< 1 s",
                 ", ".join(f"{r[3]['first_s']:.2f} s" for r in results
                           if r[2] == "counter"),
                 all(first_ok) if full else None),
          Target("(f) RSS beyond the caches, 4 / 1,024 chains",
                 "< 64 / 256 MiB",
                 ", ".join(format_bytes(max(r[3]["growth"]
                                            - r[3]["cache_bytes"], 0))
                           for r in results if r[2] == "counter"),
                 all(memory_ok) if full else None),
          Target("(f) first batch at draw 1e9 / at draw 1e3", "<= 2x",
                 f"{ratio:.2f}x", ratio <= 2 if full else None),
      ])


# -- child process -------------------------------------------------------


class VirtualSource:
  """``n`` records of 4 float32, computed from the index."""

  def __init__(self, n: int):
    self.n = n

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, index: int) -> np.ndarray:
    return np.full(4, index % 1000, np.float32)

  def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
    values = (np.asarray(indices) % 1000).astype(np.float32)
    return list(np.repeat(values[:, None], 4, axis=1))


def _rss() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  return 0


def child(request: dict[str, Any]) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp

  import jax_data

  jax.block_until_ready(jnp.zeros(1) + 1)
  records = request["records"]
  loader = jax_data.SourceDataLoader(VirtualSource(records), workers=0)
  pipeline = jax_data.random_reference_data(loader, CACHE, MB)
  init_fn, batch_fn, release_fn = pipeline
  if request["what"] == "seek":
    return _seek(pipeline, jax)
  chains = request["chains"]
  step = jax.jit(jax.vmap(batch_fn))
  before = _rss()
  states = [init_fn(seed=c, shuffle=True, stream=request["stream"])
            for c in range(chains)]
  stacked = jax.tree_util.tree_map(lambda *s: jnp.stack(s), *states)
  made = _rss()
  # XLA's compilation is not the chains' memory: left out of the growth.
  compiled = step.lower(stacked).compile()
  compiled_at = _rss()
  start = time.perf_counter()
  jax.block_until_ready(compiled(stacked))
  first = time.perf_counter() - start
  growth = (made - before) + (_rss() - compiled_at)
  device = chains * CACHE * MB * (RECORD_BYTES + 1)
  # The host keeps up to four chunks per chain (docs/reliability.rst).
  host = chains * 4 * CACHE * MB * (RECORD_BYTES + 1)
  release_fn()
  return {"first_s": first, "growth": growth, "cache_bytes": device + host}


def _seek(pipeline: Any, jax: Any) -> dict[str, Any]:
  import jax_data

  init_fn, batch_fn, _ = pipeline
  step = jax.jit(batch_fn)
  times = {}
  for name, draw in (("near_s", 10**3), ("far_s", 10**9)):
    tree = jax_data.state_to_pytree(pipeline, init_fn(seed=1, shuffle=True,
                                                      stream="counter"))
    tree["chunk"] = np.int32(draw // CACHE)
    state = jax_data.state_from_pytree(pipeline, tree)
    step.lower(state).compile()
    best = float("inf")
    for _ in range(3):
      start = time.perf_counter()
      jax.block_until_ready(step(state))
      best = min(best, time.perf_counter() - start)
      tree["chunk"] += 7  # another chunk, not yet produced
      state = jax_data.state_from_pytree(pipeline, tree)
    times[name] = best
  return times


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(json.dumps(child(json.loads(sys.argv[2]))))
