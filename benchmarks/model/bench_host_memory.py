"""What `LINEN_MOE_REUSE_HOST_MEMORY=1` trades: step time against memory.

  python benchmarks/model/bench_host_memory.py [--steps 20] [--repeats 2]

Runs the whole-model benchmark's train step (`common/whole_model.Ours`, the
Mixtral shape, batch 8 x 256) back to back in fresh processes, alternating
glibc's malloc defaults, the restart with the tunables of
`LINEN_MOE_REUSE_HOST_MEMORY=1` (`common/host_memory.py`; each step
followed by `host_memory.settle`, as `linen-moe train` does),
and the same restart without that pause, and prints for each process: the
train step's compile seconds, the median step seconds, the median minor
page faults and kernel seconds per step, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common import host_memory

# name: (LINEN_MOE_REUSE_HOST_MEMORY, pause after each step)
SETTINGS = {
    "glibc defaults": ("0", True),
    "reused": ("1", True),
    "reused, no pause": ("1", False),
}


def child(steps: int, settle: bool) -> None:
  """One process's figures, as a JSON line on stdout."""
  host_memory.reexec_with_reused_memory()
  from common import whole_model  # noqa: PLC0415 (after the restart)

  if not settle:
    host_memory.settle = lambda: None  # what Ours.train calls

  ours = whole_model.Ours(
      whole_model.model_config(whole_model.MIXTRAL_SHAPE), None
  )
  compile_s = ours.setup_train(8, 256)["compile_s"]
  times, faults, kernel = [], [], []
  for _ in range(steps):
    before = resource.getrusage(resource.RUSAGE_SELF)
    times.append(ours.train())
    after = resource.getrusage(resource.RUSAGE_SELF)
    faults.append(after.ru_minflt - before.ru_minflt)
    kernel.append(after.ru_stime - before.ru_stime)
  print(
      json.dumps({
          "compile_s": compile_s,
          "step_s": statistics.median(times),
          "faults": statistics.median(faults),
          "kernel_s": statistics.median(kernel),
          "peak_rss_gb": (
              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
          ),
      })
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument(
      "--no-settle", action="store_true", help=argparse.SUPPRESS
  )
  args = parser.parse_args()
  if args.child:
    child(args.steps, not args.no_settle)
    return
  print(
      f"train step of the Mixtral shape, batch 8 x 256, {args.steps} steps"
      " per process; medians per step"
  )
  print(
      f"{'malloc':>16} {'compile':>8} {'step':>7} {'faults':>8}"
      f" {'kernel':>7} {'peak RSS':>9}"
  )
  for _ in range(args.repeats):
    for name, (asked, settle) in SETTINGS.items():
      env = dict(os.environ, **{host_memory.OPT_IN: asked})
      argv = [sys.executable, __file__, "--child", "--steps", str(args.steps)]
      done = subprocess.run(
          argv + ([] if settle else ["--no-settle"]),
          env=env,
          capture_output=True,
          text=True,
          check=False,
      )
      if done.returncode:
        raise SystemExit(f"{name}: the process failed:\n{done.stderr[-3000:]}")
      r = json.loads(done.stdout.strip().splitlines()[-1])
      print(
          f"{name:>16} {r['compile_s']:>7.2f}s {r['step_s']:>6.2f}s"
          f" {r['faults']:>8,.0f} {r['kernel_s']:>6.2f}s"
          f" {r['peak_rss_gb']:>7.2f}GB"
      )


if __name__ == "__main__":
  main()
