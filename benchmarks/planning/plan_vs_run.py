"""A plan beside the run it plans, on the accelerator this runs on (a TPU
chip or an NVIDIA GPU), written as JSON for the device runs to collect.

  python benchmarks/planning/plan_vs_run.py --target tpu:v5e-1 \
      --config qwen3_30b_a3b --set num_layers=2 num_experts=32 \
      vocab_size=32768 --batch-size 4 --seq-len 4096 --remat full

  # one H200, the two cases of docs/guides/planning.md (blocked: 23.1 GiB
  # planned, 85.1 ms; ragged_dot at a quarter of the batch: 43.2 GiB):
  python benchmarks/planning/plan_vs_run.py --target gpu:h200-1 \
      --config qwen3_30b_a3b --set num_layers=2 num_experts=32 \
      vocab_size=32768 grouped_matmul=blocked --batch-size 16 \
      --seq-len 4096 --remat full --steps 6 --out $OUT/plan --tag blocked
  python benchmarks/planning/plan_vs_run.py --target gpu:h200-1 \
      --config qwen3_30b_a3b --set num_layers=2 num_experts=32 \
      vocab_size=32768 grouped_matmul=ragged_dot --batch-size 4 \
      --seq-len 4096 --remat full --steps 6 --out $OUT/plan --tag ragged_dot

  # a rehearsal on this CPU (no chip figures: no roofline to compare)
  python benchmarks/planning/plan_vs_run.py --target cpu:1 \
      --config tiny_mixtral --batch-size 4 --seq-len 32 --steps 3 --out DIR

1. plan   `linen-moe plan --json` for `--target` (`bench_plans.run_case`,
          a child process that compiles through libtpu's or the CUDA
          plugin's topology with jax on the CPU, `JAX_PLATFORMS=cpu`: the
          accelerator stays free): its per-device peak, temporaries and
          roofline step time.
2. run    the same train step (`linen_moe.training.ShardedTraining`, AdamW,
          a data=1 mesh) on this process's first device: initialised,
          compiled (once: the compiled program is the one called, where
          the runtime takes it), `--steps` steps of random tokens; the
          compiled program's own `memory_analysis()`, the device's peak
          bytes in use (`memory_stats()`, from a fresh process: it holds
          this run alone), and the median step time after the first.
3. compare  `compare`: the temporaries and arguments of the two compiles
          to the byte (the difference, and their ratio), the plan's peak
          against the device's, the run's step time over the roofline's
          and its model TFLOP/s and MFU. Printed, and with `--out` written
          to DIR/plan_vs_run.json (plan_vs_run_TAG.json with `--tag`):
          {"plan", "run", "compare"}.

The plan is right when its compiled bytes are the device's own compile's,
when the device refuses the steps the plan says do not fit (`--batch-size`
past its memory: the plan exits 1, the run reports the device's refusal),
and when its step time is the least the run can take. On a GPU the plan
compiles without autotuning (no GPU to measure) and with the cuDNN of the
GPU's description, while the run's compile autotunes on the GPU with the
runtime's cuDNN: the bytes may differ, and that difference is the
measurement. Pin the grouped matmul (`--set grouped_matmul=blocked`, or
`ragged_dot` to see what XLA does with it on the device): "auto" with
Tokamax picks its kernel from the device it runs on, which a compile-only
GPU is not. Meant for a machine with one accelerator; `--target` must name
that device (benchmarks/device/README.md, benchmarks/gpu/).
"""

from __future__ import annotations

import argparse
import json
import os
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
  try:
    compiled = sharded.lower(state, tokens, rng).compile()
  except Exception as e:  # noqa: BLE001 - the device's own refusal, reported
    return {"device": device.device_kind, "refused": _first_line(e)}
  stats = compiled.memory_analysis()
  compile_s = time.perf_counter() - start
  # The compiled program itself, called: a GPU's compile (autotuning) is
  # minutes of a short device call. jax 0.10.2's TPU refused that call
  # ("compiled for 55 inputs but called with 50"): `step` compiles again.
  call = "compiled"

  def one_step(state):
    nonlocal call
    if call == "compiled":
      try:
        with sharded.context():
          return compiled(state, tokens, rng)
      except (TypeError, ValueError):
        call = "step"
    return sharded.step(state, tokens, rng)

  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    try:
      state, metrics = one_step(state)
      jax.block_until_ready(metrics)
    except Exception as e:  # noqa: BLE001 - out of memory while running
      return {"device": device.device_kind, "refused": _first_line(e)}
    times.append(time.perf_counter() - start)
  memory = device.memory_stats() or {}
  return {
      "device": device.device_kind,
      "platform": device.platform,
      "jax": jax.__version__,
      "called": call,
      "device_bytes_limit": memory.get("bytes_limit"),
      "compiled_temp_bytes": int(stats.temp_size_in_bytes),
      "compiled_argument_bytes": int(stats.argument_size_in_bytes),
      "device_peak_bytes": memory.get("peak_bytes_in_use"),
      "step_s": statistics.median(times[1:] or times),
      "compile_s": compile_s,
      "loss": float(metrics["loss"]),
  }


def _first_line(error: Exception) -> str:
  lines = [line for line in str(error).splitlines() if line.strip()]
  return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def _ratio(a, b):
  return None if a is None or b in (None, 0) else a / b


def compare(planned: dict, ran: dict) -> dict:
  """The plan against the run, from their JSON (`run_case`'s, `run`'s).

  Args:
    planned: the plan's JSON (its `per_device`, `estimated_step_s`, ...).
    ran: what `run` measured.

  Returns:
    {"temp_bytes": {"plan", "run", "run_minus_plan", "run_over_plan"},
    the same for "argument_bytes", and "peak_bytes" (the plan's peak
    against the device's peak in use, None without `memory_stats`);
    "step_s": {"roofline", "run", "run_over_roofline"};
    "model_tflops_per_s" and "mfu" of the run (None without the chip's
    peak); "fits_agree": the plan's verdict against the run's}, or only
    "fits_agree" where either side did not compile.
  """
  refused = "refused" in ran
  fits = bool(planned.get("fits")) and planned.get("exit_status", 0) == 0
  out = {"fits_agree": fits == (not refused)}
  if "per_device" not in planned or refused:
    return out
  d = planned["per_device"]
  pairs = {
      "temp_bytes": (d["temp_bytes"], ran["compiled_temp_bytes"]),
      "argument_bytes": (d["argument_bytes"], ran["compiled_argument_bytes"]),
      "peak_bytes": (d["peak_bytes"], ran.get("device_peak_bytes")),
  }
  for name, (plan_bytes, run_bytes) in pairs.items():
    out[name] = {
        "plan": plan_bytes,
        "run": run_bytes,
        "run_minus_plan": None if run_bytes is None else run_bytes - plan_bytes,
        "run_over_plan": _ratio(run_bytes, plan_bytes),
    }
  roofline = planned.get("estimated_step_s")
  out["step_s"] = {
      "roofline": roofline,
      "run": ran["step_s"],
      "run_over_roofline": _ratio(ran["step_s"], roofline),
  }
  flops = planned["flops_per_step"] / ran["step_s"]
  out["model_tflops_per_s"] = flops / 1e12
  peak = None
  if roofline and planned.get("estimated_mfu"):
    # The plan's peak FLOP/s, from its own figures: MFU = F / (peak t).
    peak = planned["flops_per_step"] / (planned["estimated_mfu"] * roofline)
  out["mfu"] = _ratio(flops, peak)
  return out


def _bytes(n) -> str:
  if n is None:
    return "-"
  sign = "-" if n < 0 else ""
  n = abs(n)
  for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{sign}{n / size:.3f} {unit}"
  return f"{sign}{n} B"


def report(head: str, planned: dict, ran: dict, compared: dict) -> str:
  """The comparison as a few lines of text."""
  lines = [head]
  if "per_device" not in planned or "refused" in ran:
    # A plan that does not fit exits 1 with the compiler's reason; the
    # device's compiler should refuse the same step.
    lines.append(f"  plan: {planned.get('error', 'compiled')}")
    lines.append(
        f"  run ({ran['device']}): {ran.get('refused', 'compiled and ran')}"
    )
    lines.append(f"  verdicts agree: {compared['fits_agree']}")
    return "\n".join(lines)
  lines.append(
      f"  plan ({planned['target']}, compiled in"
      f" {planned['compile_s']:.0f} s): fits {planned['fits']},"
      f" {planned.get('compiler_flops_note') or 'compiler FLOPs counted'}"
  )
  for name in ("temp_bytes", "argument_bytes", "peak_bytes"):
    c = compared[name]
    lines.append(
        f"  {name}: plan {_bytes(c['plan'])} ({c['plan']}), run"
        f" {_bytes(c['run'])} ({c['run']}), run - plan"
        f" {_bytes(c['run_minus_plan'])}"
    )
  step = compared["step_s"]
  roofline = step["roofline"]
  mfu = compared["mfu"]
  lines.append(
      f"  step: run {step['run'] * 1e3:.3g} ms ({ran['called']}), roofline"
      + (
          " - (no chip figures)"
          if roofline is None
          else (
              f" {roofline * 1e3:.3g} ms: run / roofline"
              f" {step['run_over_roofline']:.2f}"
          )
      )
      + f"; {compared['model_tflops_per_s']:.1f} model TFLOP/s"
      + ("" if mfu is None else f", MFU {mfu:.1%}")
      + f"; loss {ran['loss']:.3f}"
  )
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="tpu:v5e-1")
  parser.add_argument("--config", default="qwen3_30b_a3b")
  parser.add_argument("--set", nargs="*", default=[], help="FIELD=VALUE")
  parser.add_argument("--batch-size", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--remat", default="full")
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument(
      "--plan-timeout", type=int, default=1800, help="the plan's seconds"
  )
  parser.add_argument(
      "--out", default=None, help="write DIR/plan_vs_run[_TAG].json there"
  )
  parser.add_argument(
      "--tag", default="", help="names the JSON file: several cases, one DIR"
  )
  args = parser.parse_args(argv)
  case = {
      "config": args.config,
      "target": args.target,
      "mesh": "data=1",
      "batch": args.batch_size,
      "seq": args.seq_len,
      "remat": args.remat,
  }
  extra = tuple(x for item in args.set for x in ("--set", item))
  # The plan's child on the CPU alone: the accelerator stays the run's.
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  planned = bench_plans.run_case(
      case, sys.executable, args.plan_timeout, extra, env
  )
  ran = run(args)
  compared = compare(planned, ran)
  head = (
      f"{args.config} {' '.join(args.set)} remat={args.remat},"
      f" {args.batch_size} x {args.seq_len}, planned for {args.target},"
      f" run on {ran['device']}:"
  )
  print(report(head, planned, ran, compared))
  result = {"plan": planned, "run": ran, "compare": compared}
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    name = f"plan_vs_run_{args.tag}.json" if args.tag else "plan_vs_run.json"
    path = os.path.join(args.out, name)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {path}")
  else:
    print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
