"""A plan beside the run it plans, on the accelerator this runs on.

  python benchmarks/planning/plan_vs_run.py --target tpu:v5e-1 \
      --config qwen3_30b_a3b --set num_layers=2 num_experts=32 \
      vocab_size=32768 --batch-size 4 --seq-len 4096 --remat full

1. plan   `linen_moe.planning.plan` for `--target`, in a child process
          that compiles through libtpu's topology with jax on the CPU
          (the chip stays free): its per-device peak, temporaries and
          roofline step time.
2. run    the same train step (`linen_moe.training.ShardedTraining`, AdamW,
          a data=1 mesh) on this process's first device: initialised,
          compiled, `--steps` steps of random tokens; the compiled
          program's own `memory_analysis()`, the device's peak bytes in
          use (`memory_stats()`, from a fresh process: it holds this run
          alone), and the median step time after the first.

The plan is right when its peak matches the device's (and its step time
is the least the run can take). Meant for a machine with one accelerator
(benchmarks/device/README.md); `--target` must name that chip's slice.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

GIB = 2**30


def _config(args):
  from common import whole_model  # noqa: PLC0415

  cfg = whole_model.model_config(args.config).replace(remat=args.remat)
  return whole_model.with_changes(cfg, args.set)


def plan_child(args) -> None:
  from linen_moe import planning  # noqa: PLC0415

  target = planning.parse_target(args.target)
  planning.prepare_process(target)
  p = planning.plan(
      _config(args), target, batch_size=args.batch_size, seq_len=args.seq_len
  )
  d = p.per_device
  print(
      json.dumps({
          "peak_bytes": d.peak_bytes,
          "temp_bytes": d.temp_bytes,
          "argument_bytes": d.argument_bytes,
          "fits": p.fits,
          "estimated_step_s": p.estimated_step_s,
          "flops_per_step": p.flops_per_step,
          "compile_s": p.compile_s,
          "chip": p.chip,
      })
  )


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
  stats = sharded.lower(state, tokens, rng).compile().memory_analysis()
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    state, metrics = sharded.step(state, tokens, rng)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
  return {
      "device": device.device_kind,
      "compiled_temp_bytes": int(stats.temp_size_in_bytes),
      "compiled_argument_bytes": int(stats.argument_size_in_bytes),
      "device_peak_bytes": peak,
      "step_s": statistics.median(times[1:]),
      "compile_s": compile_s,
      "loss": float(metrics["loss"]),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="tpu:v5e-1")
  parser.add_argument("--config", default="qwen3_30b_a3b")
  parser.add_argument("--set", nargs="*", default=[], help="FIELD=VALUE")
  parser.add_argument("--batch-size", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--remat", default="full")
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    plan_child(args)
    return
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  child = subprocess.run(
      [sys.executable, __file__, "--child", *sys.argv[1:]],
      env=env,
      capture_output=True,
      text=True,
      check=False,
  )
  if child.returncode:  # the run still says what it measured
    print(child.stderr[-3000:], file=sys.stderr)
    print(json.dumps({"plan": None, "run": run(args)}))
    raise SystemExit(f"the plan failed (exit {child.returncode})")
  planned = json.loads(child.stdout.strip().splitlines()[-1])
  ran = run(args)
  flops = planned["flops_per_step"]
  roofline = planned["estimated_step_s"] or float("nan")  # none off a chip
  print(
      f"{args.config} {' '.join(args.set)} remat={args.remat},"
      f" {args.batch_size} x {args.seq_len}, on {ran['device']}:"
  )
  print(
      f"  plan ({args.target}, compiled in {planned['compile_s']:.0f} s):"
      f" peak {planned['peak_bytes'] / GIB:.2f} GiB, temp"
      f" {planned['temp_bytes'] / GIB:.2f} GiB, fits {planned['fits']},"
      f" roofline step {roofline * 1e3:.0f} ms"
  )
  peak = ran["device_peak_bytes"]
  measured = (
      "no memory_stats() on this device"
      if peak is None
      else (
          f"device peak {peak / GIB:.2f} GiB"
          f" ({peak / planned['peak_bytes']:.3f} of the plan's)"
      )
  )
  print(
      f"  run: {measured}; compiled temp"
      f" {ran['compiled_temp_bytes'] / GIB:.2f} GiB; step"
      f" {ran['step_s'] * 1e3:.0f} ms ({roofline / ran['step_s']:.2f} of the"
      f" roofline's speed), {flops / ran['step_s'] / 1e12:.1f} model"
      f" TFLOP/s; loss {ran['loss']:.3f}"
  )
  print(json.dumps({"plan": planned, "run": ran}))


if __name__ == "__main__":
  main()
