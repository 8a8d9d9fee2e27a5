"""A plan beside the run it plans, on the accelerator this runs on.

  python benchmarks/planning/plan_vs_run.py --target tpu:v5e-1 \
      --config qwen3_30b_a3b --set num_layers=2 num_experts=32 \
      vocab_size=32768 --batch-size 4 --seq-len 4096 --remat full

1. plan   `linen-moe plan --json` for `--target` (`bench_plans.run_case`,
          a child process that compiles through libtpu's topology with jax
          on the CPU: the chip stays free): its per-device peak,
          temporaries and roofline step time.
2. run    the same train step (`linen_moe.training.ShardedTraining`, AdamW,
          a data=1 mesh) on this process's first device: initialised,
          compiled, `--steps` steps of random tokens; the compiled
          program's own `memory_analysis()`, the device's peak bytes in
          use (`memory_stats()`, from a fresh process: it holds this run
          alone), and the median step time after the first.

The plan is right when its compiled bytes are the chip's own compile's,
when the chip refuses the steps the plan says do not fit (`--batch-size`
past the chip's memory: the plan exits 1 with libtpu's reason, the run
reports the chip's), and when its step time is the least the run can take. Meant for a machine with one accelerator
(benchmarks/device/README.md); `--target` must name that chip's slice.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_plans  # noqa: E402

GIB = 2**30


def _config(args):
  import linen_moe  # noqa: PLC0415

  from common import whole_model  # noqa: PLC0415

  cfg = linen_moe.load_model_config(args.config).replace(remat=args.remat)
  return whole_model.with_changes(cfg, args.set)


def run(args) -> dict:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe import training  # noqa: PLC0415

  cfg = _config(args)
  device = jax.devices()[0]
  mesh = linen_moe.sharding.make_mesh("data=1", [device])
  sharded = training.ShardedTraining(
      linen_moe.Decoder(cfg), training.default_optimizer(), mesh
  )
  tokens = jax.random.randint(
      jax.random.key(1), (args.batch_size, args.seq_len), 0, cfg.vocab_size
  ).astype(jnp.int32)
  tokens = jax.device_put(tokens, sharded.token_sharding())
  rng = jax.random.key(2)
  state = sharded.init(tokens, rng)
  start = time.perf_counter()
  # Compiled twice (here for its memory analysis, by `step` to run): the
  # AOT-compiled step, called, was refused on jax 0.10.2's TPU ("compiled
  # for 55 inputs but called with 50").
  try:
    stats = sharded.lower(state, tokens, rng).compile().memory_analysis()
  except Exception as e:  # noqa: BLE001 - the chip's own refusal, reported
    return {"device": device.device_kind, "refused": _first_line(e)}
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    try:
      state, metrics = sharded.step(state, tokens, rng)
      jax.block_until_ready(metrics)
    except Exception as e:  # noqa: BLE001 - out of memory while running
      return {"device": device.device_kind, "refused": _first_line(e)}
    times.append(time.perf_counter() - start)
  memory = device.memory_stats() or {}
  return {
      "device": device.device_kind,
      "device_bytes_limit": memory.get("bytes_limit"),
      "compiled_temp_bytes": int(stats.temp_size_in_bytes),
      "compiled_argument_bytes": int(stats.argument_size_in_bytes),
      "device_peak_bytes": memory.get("peak_bytes_in_use"),
      "step_s": statistics.median(times[1:]),
      "compile_s": compile_s,
      "loss": float(metrics["loss"]),
  }


def _first_line(error: Exception) -> str:
  lines = [line for line in str(error).splitlines() if line.strip()]
  return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="tpu:v5e-1")
  parser.add_argument("--config", default="qwen3_30b_a3b")
  parser.add_argument("--set", nargs="*", default=[], help="FIELD=VALUE")
  parser.add_argument("--batch-size", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--remat", default="full")
  parser.add_argument("--steps", type=int, default=6)
  args = parser.parse_args()
  case = {
      "config": args.config,
      "target": args.target,
      "mesh": "data=1",
      "batch": args.batch_size,
      "seq": args.seq_len,
      "remat": args.remat,
  }
  extra = tuple(x for item in args.set for x in ("--set", item))
  planned = bench_plans.run_case(case, sys.executable, 1800, extra)
  ran = run(args)
  if "per_device" not in planned or "refused" in ran:
    # A plan that does not fit exits 1 with libtpu's reason; the chip's
    # compiler should refuse the same step.
    print(
        f"{args.config} {' '.join(args.set)} remat={args.remat},"
        f" {args.batch_size} x {args.seq_len}:\n"
        f"  plan ({args.target}): {planned.get('error', 'compiled')}\n"
        f"  run ({ran['device']}): {ran.get('refused', 'compiled and ran')}"
    )
    print(json.dumps({"plan": planned, "run": ran}))
    return
  d = planned["per_device"]
  flops = planned["flops_per_step"]
  roofline = planned["estimated_step_s"] or float("nan")  # none off a chip
  print(
      f"{args.config} {' '.join(args.set)} remat={args.remat},"
      f" {args.batch_size} x {args.seq_len}, on {ran['device']}:"
  )
  print(
      f"  plan ({args.target}, compiled in {planned['compile_s']:.0f} s):"
      f" peak {d['peak_bytes'] / GIB:.2f} GiB, temp"
      f" {d['temp_bytes'] / GIB:.2f} GiB, fits {planned['fits']},"
      f" roofline step {roofline * 1e3:.0f} ms"
  )
  peak = ran["device_peak_bytes"]
  limit = ran["device_bytes_limit"]
  # On a TPU the allocator's peak holds the arrays (arguments, outputs),
  # not the program's temporaries, which the compiled analysis counts.
  measured = (
      "no memory_stats() on this device"
      if peak is None
      else (
          f"allocator peak {peak / GIB:.2f} GiB of {limit / GIB:.2f}"
          f" (the plan's arguments: {d['argument_bytes'] / GIB:.2f})"
      )
  )
  print(
      f"  run: {measured}; compiled arguments"
      f" {ran['compiled_argument_bytes'] / GIB:.2f} GiB, temp"
      f" {ran['compiled_temp_bytes'] / GIB:.2f} GiB; step"
      f" {ran['step_s'] * 1e3:.0f} ms ({roofline / ran['step_s']:.2f} of the"
      f" roofline's speed), {flops / ran['step_s'] / 1e12:.1f} model"
      f" TFLOP/s; loss {ran['loss']:.3f}"
  )
  print(json.dumps({"plan": planned, "run": ran}))


if __name__ == "__main__":
  main()
