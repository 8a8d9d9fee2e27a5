"""Plans of the full-size configs for the hardware users rent: each case is
one `linen-moe plan --json` in a child process (the compile never runs the
step), and the cases come back as a Markdown table (what
benchmarks/reference/plans.md records).

A TPU slice needs libtpu in the Python that runs the plan (`--python`, e.g.
a venv with the `tpu-plan` extra: `VENV=DIR scripts/setup_venv.sh tpu-plan`
from a checkout); `cpu:N` needs nothing.
Full-size compiles take minutes each on a small machine.

Usage:
  python benchmarks/planning/bench_plans.py \\
      --case qwen3_30b_a3b,tpu:v5p-16,fsdp=8,8,4096,full \\
      --python ~/venv-tpu-plan/bin/python --jsonl plans.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# config, target, mesh, batch, seq, remat: the recorded reference plans.
REFERENCE = (
    "qwen3_30b_a3b,tpu:v5p-16,fsdp=8,8,4096,full",
    "mixtral_8x7b,tpu:v5p-16,fsdp=8,8,4096,full",
    "gemma4_26b,tpu:v5p-16,fsdp=8,8,4096,full",
    "deepseek_v3_671b,tpu:v5p-256,fsdp=32,expert=4,128,4096,full",
    "qwen3_30b_a3b,cpu:8,fsdp=8,8,4096,full",
)

GIB = 2**30


def parse_case(text: str) -> dict:
  """ "config,target,mesh...,batch,seq,remat" (the mesh may hold commas)."""
  parts = text.split(",")
  if len(parts) < 6:
    raise ValueError(
        f"case {text!r}: expected config,target,mesh,batch,seq,remat"
    )
  return {
      "config": parts[0],
      "target": parts[1],
      "mesh": ",".join(parts[2:-3]),
      "batch": int(parts[-3]),
      "seq": int(parts[-2]),
      "remat": parts[-1],
  }


def command(case: dict, python: str, extra: tuple[str, ...] = ()) -> list[str]:
  """`linen-moe plan --json` of `case`, then the `extra` arguments."""
  return [
      python,
      "-m",
      "linen_moe_cli.main",
      "plan",
      "--config",
      case["config"],
      "--target",
      case["target"],
      "--mesh",
      case["mesh"],
      "--batch-size",
      str(case["batch"]),
      "--seq-len",
      str(case["seq"]),
      "--remat",
      case["remat"],
      "--json",
      *extra,
  ]


def run_case(
    case: dict,
    python: str,
    timeout: int,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> dict:
  """The plan's JSON (with `exit_status` and `wall_s`), or its error;
  `env`: the child's environment (None: this process's)."""
  start = time.perf_counter()
  proc = subprocess.run(
      command(case, python, extra),
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
      env=env,
  )
  out = {"case": case, "exit_status": proc.returncode}
  lines = proc.stdout.strip().splitlines()
  if lines and lines[-1].startswith("{"):
    out.update(json.loads(lines[-1]))
  else:
    out["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
  out["wall_s"] = time.perf_counter() - start
  return out


def _roofline(step, mfu, bound) -> str:
  """The roofline's cell: an MFU bound only where memory bounds it (a
  compute-bound roofline's MFU is the peak by construction)."""
  if step is None:
    return "-"
  if bound == "compute" or (bound is None and mfu >= 1.0):
    return f"{step:.3g} s, compute-bound"
  return f"{step:.3g} s, MFU <= {mfu:.0%}"


def row(plan: dict) -> str:
  case = plan["case"]
  head = (
      f"| {case['config']} | {case['target']} | {case['mesh']} | "
      f"{case['batch']} x {case['seq']} | {case['remat']} |"
  )
  if "per_device" not in plan:
    return f"{head} error: {plan.get('error')} | | | | |"
  d = plan["per_device"]
  step = plan.get("estimated_step_s")
  mfu = plan.get("estimated_mfu")
  return (
      f"{head} {d['parameter_bytes'] / GIB:.1f} | "
      f"{d['optimizer_state_bytes'] / GIB:.1f} | {d['temp_bytes'] / GIB:.1f} "
      f"| {d['peak_bytes'] / GIB:.1f} / {plan['device_memory_bytes'] / GIB:.1f}"
      f" | {'yes' if plan['fits'] else 'no'} | {plan['flops_per_step']:.3g} | "
      + _roofline(step, mfu, plan.get("roofline_bound"))
      + f" | {plan.get('compile_s', 0):.0f} s |"
  )


HEADER = (
    "| config | target | mesh | batch x seq | remat | params GiB | "
    "optimizer GiB | temp GiB | peak / device GiB | fits | FLOPs / step | "
    "roofline | compile |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
      "--case",
      action="append",
      default=None,
      help=(
          "config,target,mesh,batch,seq,remat (repeatable; default: the "
          "reference cases)"
      ),
  )
  p.add_argument(
      "--python",
      default=sys.executable,
      help="the Python that runs each plan (one with libtpu for TPU slices)",
  )
  p.add_argument("--timeout", type=int, default=3600, help="seconds per case")
  p.add_argument("--jsonl", default=None, help="append each plan here")
  p.add_argument(
      "--set",
      action="append",
      default=[],
      metavar="FIELD=VALUE",
      help=(
          "a config override for every case (repeatable; `linen-moe plan "
          "--set`), e.g. --set param_dtype=bfloat16"
      ),
  )
  args = p.parse_args(argv)
  cases = [parse_case(c) for c in args.case or REFERENCE]
  extra = tuple(f"--set={item}" for item in args.set)
  print(HEADER, flush=True)
  for case in cases:
    plan = run_case(case, args.python, args.timeout, extra)
    plan["set"] = list(args.set)
    if args.jsonl:
      with open(args.jsonl, "a", encoding="utf-8") as f:
        f.write(json.dumps(plan) + "\n")
    print(row(plan), flush=True)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  sys.exit(main())
