"""What `ModelConfig.scan_unroll` trades: compile time against step time.

  python benchmarks/model/bench_scan_unroll.py [--model tiny_mixtral]
      [--layers 2 4 8 16] [--repeats 2]

For each stack depth L, compiles the train step (`training.make_train_step`
with the default optimizer, batch 4 x 64 random tokens, built as
`bench_model.py` builds it, `common/whole_model.Ours`) of `--model` with L layers twice
over, a loop of one layer per iteration (`scan_unroll=1`) and every layer in
line (`scan_unroll=L`), alternating, and prints the best compile seconds of
each, their ratio, the median step of each, and what `scan_unroll=0` (the
default) picks for L (`linen_moe.models.resolved_unroll`: in line up to a
threshold, read off that rule). The variables are the same stacked ones
either way. Programs are compiled from scratch: the persistent compilation
cache is not used here.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import linen_moe
from linen_moe import frontend

from common import whole_model

BATCH, SEQ = 4, 64


def default_unroll(layers: int) -> str:
  """What `scan_unroll=0` runs for a stack of `layers`: "in line" (no
  loop), or the layers per loop iteration."""
  unroll = frontend.resolved_unroll(0, layers)
  return "in line" if unroll is True else f"loop of {unroll}"


def in_line_up_to(limit: int = 1024) -> int:
  """The deepest stack `scan_unroll=0` puts in line (the rule's threshold,
  read off `frontend.resolved_unroll`): in line up to it, a loop beyond."""
  return max(
      n for n in range(1, limit) if frontend.resolved_unroll(0, n) is True
  )


def _compile_and_step(cfg) -> tuple[float, float]:
  """(compile seconds, median step seconds) of cfg's train step, built and
  timed as the whole-model benchmark does (`whole_model.Ours`)."""
  ours = whole_model.Ours(cfg, None)
  compile_s = ours.setup_train(BATCH, SEQ)["compile_s"]
  steps = [ours.train() for _ in range(5)]
  return compile_s, statistics.median(steps[1:])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="tiny_mixtral")
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  base = linen_moe.load_model_config(args.model)
  print(
      f"{args.model} train step, batch {BATCH} x {SEQ}; best of {args.repeats}"
      f" compiles; in line by default up to {in_line_up_to()} layers"
  )
  print(
      f"{'layers':>6} {'loop compile':>13} {'in line':>8} {'ratio':>6}"
      f" {'loop step':>10} {'in line':>8} {'default':>12}"
  )
  for layers in args.layers:
    cfg = base.replace(num_layers=layers)
    best = {1: (float("inf"), 0.0), layers: (float("inf"), 0.0)}
    for _ in range(args.repeats):
      for unroll in best:
        compile_s, step_s = _compile_and_step(cfg.replace(scan_unroll=unroll))
        if compile_s < best[unroll][0]:
          best[unroll] = (compile_s, step_s)
    (loop_c, loop_s), (line_c, line_s) = best[1], best[layers]
    print(
        f"{layers:>6} {loop_c:>12.2f}s {line_c:>7.2f}s {line_c / loop_c:>5.2f}x"
        f" {loop_s * 1e3:>8.1f}ms {line_s * 1e3:>6.1f}ms"
        f" {default_unroll(layers):>12}"
    )


if __name__ == "__main__":
  main()
