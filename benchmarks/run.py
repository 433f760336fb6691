"""jax_data benchmarks: jax_data side by side with the device-resident limit,
jax-sgmc 0.1.5 and a Python loop, in one process.

Usage (from the repository root)::

  python benchmarks/run.py                 # full run: an hour or more
  python benchmarks/run.py --smoke         # CI: small sizes, one or two minutes
  python benchmarks/run.py --write docs/benchmarks.md
  python benchmarks/run.py --smoke --only sgld full

Cases: ``sgld`` (a), ``mlp`` (b), ``full`` (c), ``tf`` (d), ``sources`` (e),
``streams`` (f), ``chains`` (g) and ``memmap``
(out-of-core; the full run writes 4 GiB of memmap files to the temporary
directory, ``TMPDIR``, and deletes them afterwards). The script prints
every case's table as it finishes, then the acceptance targets and the
device memory of each pipeline; with ``--write`` it also writes them, with
the machine, versions and date, to a Markdown file. Targets are reported,
never asserted: the exit status is non-zero only when a benchmark fails to
run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

# Quiet TensorFlow's C++ logging (read when TensorFlow is imported).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import chains
import full_pass
import mlp
import out_of_core
import report
import sgld
import sources
import streams
import tf_images
from common import MEMORY_HEADERS
from common import Section
from common import environment
from common import load_average
from common import markdown_table

CASES = {
    "sgld": sgld,
    "mlp": mlp,
    "full": full_pass,
    "tf": tf_images,
    "sources": sources,
    "memmap": out_of_core,
    "streams": streams,
    "chains": chains,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description="jax_data benchmarks (see docs/benchmarks.md)")
  parser.add_argument("--smoke", action="store_true",
                      help="small sizes and few repeats, for CI")
  parser.add_argument("--write", metavar="PATH",
                      help="write the report as Markdown to PATH")
  parser.add_argument("--only", nargs="+", choices=sorted(CASES),
                      metavar="CASE",
                      help=f"run only these cases ({', '.join(CASES)})")
  parser.add_argument("--repeats", type=int, default=None,
                      help="measurements per contender (default 7, smoke 2)")
  args = parser.parse_args(argv)
  if args.repeats is not None and args.repeats < 1:
    parser.error(f"--repeats must be at least 1, got {args.repeats}")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the cases, prints their tables and writes the report.

  Args:
    argv: Command-line arguments (default: ``sys.argv[1:]``).

  Returns:
    The exit status: 0 (targets are reported, not asserted).
  """
  args = parse_args(argv)
  repeats = args.repeats or (2 if args.smoke else 7)
  env = environment()
  load_at_start = load_average()
  mode = "smoke" if args.smoke else "full"
  print(f"jax_data benchmarks ({mode} run, {repeats} repeats)")
  print("\n".join(f"  {k}: {v}" for k, v in env.items()))
  print(f"  load average (1 / 5 / 15 min): {load_at_start}", flush=True)

  start = time.perf_counter()
  sections: list[Section] = []
  durations: dict[str, float] = {}
  for key in args.only or list(CASES):
    module = CASES[key]
    config = module.SMOKE if args.smoke else module.FULL
    print(f"\n== {key} ==", flush=True)
    case_start = time.perf_counter()
    section = module.run(config, repeats)
    durations[key] = time.perf_counter() - case_start
    sections.append(section)
    print()
    print(section.markdown(), flush=True)
  total = time.perf_counter() - start
  env["load average (1 / 5 / 15 min)"] = (
      f"{load_at_start} at the start, {load_average()} at the end")

  targets = [t for s in sections for t in s.targets]
  memory = [row for s in sections for row in s.memory]
  print("\n== targets ==")
  print(markdown_table(["target", "limit", "measured", "holds"],
                       [[t.name, t.limit, t.measured, t.verdict]
                        for t in targets]))
  print("\n== device memory of the pipelines ==")
  print(markdown_table(MEMORY_HEADERS, memory))
  print(f"\nload average (1 / 5 / 15 min): "
        f"{env['load average (1 / 5 / 15 min)']}")
  print(f"total {total:.0f} s (" + ", ".join(
      f"{k} {v:.0f} s" for k, v in durations.items()) + ")")
  if args.write:
    text = report.markdown(env, mode, repeats, sections, durations, total)
    with open(args.write, "w") as f:
      f.write(text)
    print(f"wrote {args.write}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
