"""Where one `linen-moe bench` case spends its step: XLA op times.

Compiles the case's forward+backward (`linen_moe_cli.bench.compiled_step`),
runs it under `jax.profiler` and prints the slowest ops of the compiled
program, milliseconds per step (mean over `--steps` steps), with the step's
total. `dot`/`ynn_fusion` ops are the matmuls; `gather`/`select` fusions move
rows.

  PYTHONPATH=. python benchmarks/profile_case.py --size gemma_like --path sparse
  PYTHONPATH=. python benchmarks/profile_case.py --dims 4 128 256 512 64 2
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile

import jax

from linen_moe_cli import bench

# Host-side events of the profiler, not ops of the program.
_NOT_OPS = ("ThunkExecutor", "$", "Pjit", "Slinky", "CommonPjRt", "PjRt")


def op_times(run, steps: int) -> collections.Counter:
  """Milliseconds per call of each XLA op `run()` executes (mean over
  `steps` calls under `jax.profiler`, after one call outside it), by op
  name (fusions by their HLO name).

  Self time: an op that contains others on its thread (a `while`, a `call`)
  counts only the time its children do not, so the sum is the work done.
  """
  jax.block_until_ready(run())
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(steps):
        jax.block_until_ready(run())
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and not e["name"].startswith(_NOT_OPS):
      by_thread[e.get("pid"), e.get("tid")].append(e)
  total = collections.Counter()
  for thread in by_thread.values():
    thread.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []  # [end, event], outermost first
    for e in thread:
      while stack and stack[-1][0] <= e["ts"]:
        stack.pop()
      if stack:  # a child: not the parent's own time
        total[stack[-1][1]["name"]] -= e["dur"] / 1e3 / steps
      total[e["name"]] += e["dur"] / 1e3 / steps  # ms per call
      stack.append((e["ts"] + e["dur"], e))
  return total


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="gemma_like")
  parser.add_argument("--path", default="sparse")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument(
      "--dims", type=int, nargs=6, help="batch seq emb mlp experts top_k"
  )
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--top", type=int, default=20)
  a = parser.parse_args()
  case = bench.Case(
      size=a.size, path=a.path, dtype=a.dtype, dims=tuple(a.dims or ())
  )
  compiled, args, _ = bench.compiled_step(case)
  total = op_times(lambda: compiled(*args), a.steps)
  print(f"ops of one step, ms (sum of all ops {sum(total.values()):.1f})")
  for name, ms in total.most_common(a.top):
    print(f"{ms:8.1f}  {name}")


if __name__ == "__main__":
  main()
