"""Where one layer benchmark case spends its step: XLA op times.

Compiles the case's forward+backward (`common/layer_case.compiled_step`),
runs it under `jax.profiler` and prints the slowest ops of the compiled
program, milliseconds per step (mean over `--steps` steps), with the step's
total. `dot`/`ynn_fusion` ops are the matmuls; `gather`/`select` fusions move
rows.

  python benchmarks/layer/profile_case.py --size gemma_like --path sparse
  python benchmarks/layer/profile_case.py --dims 4 128 256 512 64 2
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common import layer_case
from common import profiling


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
  case = layer_case.Case(
      size=a.size, path=a.path, dtype=a.dtype, dims=tuple(a.dims or ())
  )
  compiled, args, _ = layer_case.compiled_step(case)
  total = profiling.op_times(lambda: compiled(*args), a.steps)
  print(f"ops of one step, ms (sum of all ops {sum(total.values()):.1f})")
  for name, ms in total.most_common(a.top):
    print(f"{ms:8.1f}  {name}")


if __name__ == "__main__":
  main()
