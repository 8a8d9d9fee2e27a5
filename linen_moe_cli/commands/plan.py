"""`linen-moe plan`: compile (never run) the train step, or with `--serve`
the decode step, of a config for a target, and print what a run there
needs: bytes per device against the device's memory, whether it fits,
FLOPs and tokens per step, a roofline step time and MFU
(`linen_moe.planning.plan`).

Targets: `cpu:N` (N simulated CPU devices, always there), Cloud TPU
slices such as `tpu:v5p-64` (with libtpu: the `tpu-plan` extra, `pip
install '.[tpu-plan]'` from a checkout) and NVIDIA GPUs such as
`gpu:h200-1` or `gpu:h100-8` (with jax's CUDA plugin: the `gpu-plan`
extra). The simulated device
count has to be set before jax starts its backends, and this command runs
before anything imports jax, so it sets it here, in this process
(`planning.prepare_process`): no child process, and the compile's errors
reach the user as they are.

Exit status: 0 when the step fits, 1 when it does not (one line on stderr
naming the biggest consumer), 2 for a bad flag (an unknown target, a mesh
whose sizes do not multiply to the target's devices).
"""

from __future__ import annotations

import argparse
import json
import sys

from linen_moe import training
from linen_moe.training import RunOptions
from linen_moe_cli import model_args
from linen_moe_cli import options

GIB = 2**30


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "plan",
      help=(
          "compile (never run) the train or decode step for a target "
          "(cpu:N, tpu:v5p-64, gpu:h200-1, gpu:h100-8, ...) and print its "
          "memory per device, whether it fits, FLOPs and a roofline step "
          "time"
      ),
  )
  model_args.add_model_args(p)
  p.add_argument(
      "--target",
      default="cpu:1",
      help=(
          "cpu:N (N simulated CPU devices) or a Cloud TPU slice: "
          "tpu:v5e-N, tpu:v6e-N (N chips), tpu:v5p-N (N TensorCores, N/2 "
          "chips); TPU slices need libtpu (from a checkout: pip install "
          "'.[tpu-plan]'); or NVIDIA GPUs: gpu:h100-N, gpu:h200-N (N in 1, "
          "2, 4, 8 or a multiple of 8), which need jax's CUDA plugin "
          "(pip install '.[gpu-plan]')"
      ),
  )
  options.add_step_args(
      p,
      "mesh",
      "batch_size",
      "seq_len",
      "grad_accum",
      "remat",
      "frontend",
      mesh=(
          "the device mesh, as for train, e.g. fsdp=16,expert=4 (default: "
          "data=<devices>); the sizes must multiply to the target's devices"
      ),
      batch_size="sequences per step",
      seq_len="tokens per sequence",
  )
  scratch = RunOptions()  # the from-scratch recipe's shape
  p.set_defaults(batch_size=scratch.batch_size, seq_len=scratch.seq_len)
  p.add_argument(
      "--serve",
      nargs="?",
      const="none",
      default=None,
      choices=model_args.SERVE,
      metavar="MODE",
      help=(
          "plan the decode step (batch-size tokens against a KV cache of "
          "seq-len positions) instead of the train step, with the expert "
          "weights stored in MODE as `generate --serve MODE` serves them "
          "(none, the default: float weights)"
      ),
  )
  p.add_argument(
      "--device-memory-gib",
      type=float,
      default=None,
      metavar="GIB",
      help=(
          "one device's memory (default: the chip's; cpu:N: the host's "
          "memory over N)"
      ),
  )
  p.add_argument(
      "--json", action="store_true", help="print the plan as one JSON object"
  )
  p.set_defaults(run=run)


def _overrides(args: argparse.Namespace) -> dict:
  """The config overrides of the flags (`--remat` and a stored `--serve`
  mode included: the config checks them, naming what is allowed)."""
  model_args.check_serve(args)
  overrides = model_args.model_overrides(args)
  if args.serve not in (None, "none"):
    overrides.update(quantization=args.serve, serving=True)
  return overrides


def run(args: argparse.Namespace) -> int:
  """Checks the flags, compiles the step for the target, prints the plan;
  exit status 1 when it does not fit."""
  from linen_moe import load_model_config  # noqa: PLC0415 (no jax)
  from linen_moe import planning  # noqa: PLC0415 (no jax until used)

  target = planning.parse_target(args.target)
  cfg = load_model_config(args.config, **_overrides(args))
  memory = None
  if args.device_memory_gib is not None:
    if not args.device_memory_gib > 0:
      raise ValueError(
          f"device_memory_gib={args.device_memory_gib!r} "
          "(--device-memory-gib) is invalid: expected a number > 0."
      )
    memory = max(1, int(args.device_memory_gib * GIB))
  planning.check_mesh(args.mesh, target)  # imports jax, starts no backend
  planning.prepare_process(target)  # before jax starts its backends

  result = planning.plan(
      cfg,
      target,
      mesh=args.mesh,
      batch_size=args.batch_size,
      seq_len=args.seq_len,
      grad_accum=args.grad_accum,
      decode=args.serve is not None,
      frontend=training.frontend(args.frontend),
      device_memory_bytes=memory,
  )
  if args.json:
    print(json.dumps({"config": args.config, **result.to_json()}))
  else:
    print(describe(result, args.config))
  if not result.fits:
    print(f"linen-moe: error: {does_not_fit(result)}", file=sys.stderr)
    return 1
  return 0


def _gib(n: float) -> str:
  """Bytes in the largest binary unit that keeps them >= 1."""
  for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{int(n)} B"


def does_not_fit(p) -> str:
  """The one line of a plan that does not fit."""
  d = p.per_device
  consumer = p.per_device.consumers().get(p.biggest_consumer, 0)
  why = f" ({p.note})" if p.note else ""
  if p.biggest_consumer in ("parameters", "optimizer state"):
    hint = "shard it over more devices (--mesh fsdp=N,expert=M)"
  elif p.biggest_consumer == "KV cache":
    hint = "lower --batch-size or --seq-len, or shard the batch further"
  else:
    hint = (
        "lower --batch-size or --seq-len, accumulate gradients "
        "(--grad-accum), or rematerialise (--remat)"
    )
  return (
      f"the {p.step} step does not fit on {p.target}: {_gib(d.peak_bytes)} "
      f"per device at its peak, {_gib(p.device_memory_bytes)} there"
      f"{why}; the biggest consumer is the {p.biggest_consumer} "
      f"({_gib(consumer)} per device): {hint}."
  )


def _roofline(p) -> str:
  """The roofline's line: a lower bound on the step time, and an upper
  bound on MFU only where the memory traffic bounds it (a compute-bound
  roofline's MFU is the peak by construction: no bound at all)."""
  time = (
      f"roofline ({p.chip}): >= {p.estimated_step_s * 1e3:.3g} ms per step, "
      f"<= {p.tokens_per_step / p.estimated_step_s:.3g} tokens/s"
  )
  if p.roofline_bound == "memory":
    return (
        f"{time}, bound by memory traffic at the chip's bandwidth: MFU <= "
        f"{p.estimated_mfu:.1%}"
    )
  return (
      f"{time}, bound by the model FLOPs at the chip's peak (a run's MFU "
      "is measured, not planned)"
  )


def describe(p, config: str) -> str:
  """The plan as a few lines of text."""
  mesh = ",".join(f"{k}={v}" for k, v in p.mesh.items() if v > 1) or "1"
  d = p.per_device
  head = (
      f"{config}: {p.step} step on {p.target} ({p.devices} devices, mesh "
      f"{mesh}), batch {p.batch_size} x seq {p.seq_len}"
  )
  if p.step == "train":
    head += f", grad accum {p.grad_accum}"
  consumers = ", ".join(f"{k} {_gib(v)}" for k, v in d.consumers().items())
  verdict = "fits" if p.fits else "DOES NOT FIT"
  lines = [
      head,
      f"  per device: {consumers}",
      (
          f"  per device: arguments {_gib(d.argument_bytes)}, outputs "
          f"{_gib(d.output_bytes)} ({_gib(d.alias_bytes)} reusing inputs), "
          f"temporaries {_gib(d.temp_bytes)}; peak {_gib(d.peak_bytes)} of "
          f"{_gib(p.device_memory_bytes)}: {verdict}"
      ),
  ]
  if p.compiler_flops_per_step is not None:
    compiler = f"the compiler counts {p.compiler_flops_per_step:.3g}"
  else:
    compiler = f"no compiler FLOPs: {p.compiler_flops_note}"
  lines.append(
      f"  model FLOPs per step {p.flops_per_step:.3g} ({compiler}), tokens "
      f"per step {p.tokens_per_step}"
  )
  if p.estimated_step_s is not None:
    lines.append(f"  {_roofline(p)}")
  if d.host_bytes:
    lines.append(f"  host memory per device: {_gib(d.host_bytes)}")
  lines.append(f"  compiled in {p.compile_s:.1f} s")
  return "\n".join(lines)
