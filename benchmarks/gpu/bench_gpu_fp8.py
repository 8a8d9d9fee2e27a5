"""The fp8 train step against bf16's on the GPU, at Mixtral-8x7B's layer
dimensions, and which contractions the compiled fp8 step runs natively.

Variants (`VARIANTS`), each `bench_mfu`'s train step (SGD, the router's
0.01 load-balance loss, the plan's remat) of `mixtral_8x7b` at
`--depths` layers, batch `--batch` x `SEQ` tokens:

  bf16        quantization "none"
  fp8         quantization "fp8" (Flax's delayed scaling: e4m3 forward,
              e5m2 gradients)

Each variant has its own train state (fp8 adds its scale state); the steps
alternate, variant by variant, for --rounds rounds after one untimed, and
the medians give the step ratio (bf16 ms / fp8 ms; the issue's bar: >=
1.3) at each depth and of one layer (the deeper step less the shallower).
Each variant's loss after the same steps on the same tokens sits beside
it.

From each compiled fp8 step (`linen_moe.hlo.contractions`): every
contraction (dot, GEMM custom call) with its call site (`wi_0`, `wi_1`,
`wo`, attention, head) and direction (forward, or backward where its op
path holds "transpose("), the element types of its operands as passed to
it, and whether it runs natively in fp8 (f8 operand types at the
contraction itself, not converted to bf16/f32 before it). Writes
--out/bench_gpu_fp8.json after each depth.

  python benchmarks/gpu/bench_gpu_fp8.py --out DIR          # on the GPU
  python benchmarks/gpu/bench_gpu_fp8.py --cpu-dry-run --out DIR
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "device"))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import bench_mfu  # noqa: E402
import gpu_timing  # noqa: E402

SEQ = 4096
VARIANTS = {"bf16": {}, "fp8": {"quantization": "fp8"}}
F8_TYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3")
SITES = ("wi_0", "wi_1", "wo", "gate", "attention", "head")
# The tiny rehearsal: Mixtral's structure at sizes a CPU runs.
TINY_CHANGES = {
    "emb_dim": 64,
    "moe_mlp_dim": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}


def site_of(op_name: str) -> str:
  """The call site a contraction's op path names (`SITES`), else "other"."""
  for site in ("wi_0", "wi_1", "wo"):
    if f"/{site}" in op_name:
      return site
  if "gate" in op_name:
    return "gate"
  if "attention" in op_name.lower() or "attn" in op_name:
    return "attention"
  if "logits" in op_name or "embed" in op_name or "head" in op_name:
    return "head"
  return "other"


def native_summary(contractions) -> dict:
  """{site/direction: {operand types: count}} of the compiled contractions,
  and the counts natively fp8 (an f8 operand type at the contraction) and
  fed quantized values but converted first (quantized inputs found walking
  back, no f8 operand at the contraction)."""
  table = collections.defaultdict(collections.Counter)
  native = converted = 0
  for c in contractions:
    direction = "backward" if "transpose(" in c.op_name else "forward"
    types = [sorted(t) for t in c.operand_types]
    key = " x ".join("/".join(t) or "?" for t in types)
    table[f"{site_of(c.op_name)}/{direction}"][f"{c.opcode}: {key}"] += 1
    f8_operands = any(
        any(t.startswith("f8") for t in ts) for ts in c.operand_types
    )
    native += f8_operands
    converted += (not f8_operands) and any(
        t.startswith("f8") for t in c.quantized_inputs
    )
  return {
      "contractions": {k: dict(v) for k, v in sorted(table.items())},
      "native_fp8": native,
      "fp8_converted_first": converted,
      "total": len(contractions),
  }


def ratios(ms: dict[str, float]) -> dict[str, float]:
  """{variant: bf16 ms / its ms} (> 1: faster than bf16)."""
  return gpu_timing.fractions(ms, "bf16")


def layer_ratio(step_ms: dict[int, dict[str, float]], depths) -> dict:
  """One layer's ms per variant (deeper step less shallower, per layer)
  and the fp8 ratio of those."""
  d1, d2 = depths
  if not all(d in step_ms for d in depths):
    return {}
  layer = {
      v: (step_ms[d2][v] - step_ms[d1][v]) / (d2 - d1)
      for v in step_ms[d2]
      if v in step_ms[d1]
  }
  return {"layer_ms": layer, "layer_ratio": ratios(layer)}


def config(depth: int, variant: str, tiny: bool):
  import linen_moe  # noqa: PLC0415

  changes = {
      "num_layers": depth,
      "load_balance_loss_weight": bench_mfu.LOAD_BALANCE,
      "remat": "full",
      **(TINY_CHANGES if tiny else {}),
      **VARIANTS[variant],
  }
  return linen_moe.load_model_config("mixtral_8x7b").replace(**changes)


def compile_programs(args, mesh) -> dict:
  """{(depth, variant): (run, facts)}: every program lowered here, then
  compiled all at once in threads (compiling is most of the time), the
  fp8 steps' contractions read from their HLO."""
  import concurrent.futures  # noqa: PLC0415

  from linen_moe import hlo  # noqa: PLC0415

  lowered, out = {}, {}
  for depth in args.depths:
    for v in VARIANTS:
      run = bench_mfu.training_run(config(depth, v, args.cpu_dry_run), mesh)
      try:
        abstract = bench_mfu.abstract_args(run, mesh, args.batch, args.seq)
        lowered[depth, v] = (run, run.lower(*abstract), time.perf_counter())
      except Exception as e:  # noqa: BLE001 (a variant that fails is a result)
        out[depth, v] = (None, {"error": f"lower: {type(e).__name__}: {e}"})

  def build(item):
    key, (run, low, start) = item
    try:
      compiled = low.compile()
    except Exception as e:  # noqa: BLE001 (an out-of-memory is a result)
      return key, (None, {"error": f"{type(e).__name__}: {e}"[:600]})
    facts = {"compile_s": time.perf_counter() - start}
    facts.update(native_summary(hlo.contractions(compiled.as_text())))
    return key, (run, facts)

  with concurrent.futures.ThreadPoolExecutor(len(lowered) or 1) as pool:
    out.update(dict(pool.map(build, lowered.items())))
  return out


def time_depth(depth: int, programs: dict, args, mesh, deadline) -> dict:
  """The variants' steps at `depth`, alternating, each on its own state."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  group = {"depth": depth, "programs": {}}
  runs = {}
  for v in VARIANTS:
    run, facts = programs[depth, v]
    group["programs"][v] = facts
    if run is not None:
      runs[v] = run
  if not runs:
    return group
  rng = jax.device_put(jax.random.key(1), bench_mfu.replicated(mesh))
  vocab = config(depth, "bf16", args.cpu_dry_run).vocab_size
  tokens = np.random.default_rng(0).integers(0, vocab, (args.batch, args.seq))
  tokens = jax.device_put(
      jnp.asarray(tokens, jnp.int32), next(iter(runs.values())).token_sharding()
  )
  states = {v: run.init(tokens, jax.random.key(0)) for v, run in runs.items()}
  losses = {}

  def stepper(v):
    def call():
      states[v], metrics = runs[v].step(states[v], tokens, rng)
      jax.block_until_ready(states[v])
      losses[v] = float(metrics["loss"])

    return call

  seconds, errors = gpu_timing.alternating_medians(
      {v: stepper(v) for v in runs}, args.rounds, deadline
  )
  group["step_ms"] = {v: s * 1e3 for v, s in seconds.items()}
  group["ratio"] = ratios(group["step_ms"])
  group["loss"] = losses
  group["errors"] = errors
  states.clear()  # the next depth's states need the memory
  return group


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--depths", type=int, nargs=2, default=[1, 2])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=SEQ)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--budget-s", type=float, default=150)
  parser.add_argument("--out", default=".")
  parser.add_argument(
      "--cpu-dry-run",
      action="store_true",
      help="Mixtral's structure at tiny sizes on this host's CPU",
  )
  args = parser.parse_args(argv)
  if args.cpu_dry_run:
    args.batch, args.seq, args.rounds = 1, 32, 1
  import jax  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415

  mesh = linen_moe.sharding.make_mesh("data=1", jax.devices()[:1])
  deadline = gpu_timing.Deadline(args.budget_s)
  result = {
      "environment": gpu_timing.environment(),
      "settings": {**vars(args), "variants": VARIANTS},
      "depths": [],
  }
  programs = compile_programs(args, mesh)
  for depth in args.depths:
    if deadline.passed():
      result["depths"].append({"depth": depth, "cut": "deadline"})
      continue
    group = time_depth(depth, programs, args, mesh, deadline)
    result["depths"].append(group)
    step_ms = {
        g["depth"]: g["step_ms"] for g in result["depths"] if "step_ms" in g
    }
    result.update(layer_ratio(step_ms, tuple(args.depths)))
    print(
        f"== {depth} layer(s): step ms {group.get('step_ms')}, bf16/fp8"
        f" {group.get('ratio')}, loss {group.get('loss')}",
        flush=True,
    )
    fp8 = group["programs"].get("fp8", {})
    print(
        f"  fp8 contractions: {fp8.get('native_fp8')} native fp8,"
        f" {fp8.get('fp8_converted_first')} converted first, of"
        f" {fp8.get('total')}",
        flush=True,
    )
    path = gpu_timing.write_json(args.out, "bench_gpu_fp8.json", result)
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
