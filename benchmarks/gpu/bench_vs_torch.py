"""The MoE layer on the GPU, forward + backward, bf16, beside torch's in one
process: ours (each `grouped_matmul`), a dense gated MLP of the same
FLOPs, a torch layer of the same math on `torch._grouped_mm` built as
torchtitan builds it (its permutation included: `torch_moe.TitanMoE`), and
transformers' own sparse MoE block (`MixtralSparseMoeBlock` at 8 experts,
`Qwen3MoeSparseMoeBlock` at 128) with each experts backend, all on the
same weights and input.

Shapes: `bench_maxtext_layer.SHAPES` (4 x 4096 tokens; 8 experts of 2048 x
5632 top-2, Mixtral's routing; 128 of 2048 x 768 top-8, Qwen3's). Every
variant computes the gradients of sum(out * cot) with respect to the
weights and the input; medians of --rounds alternating rounds:

  dense           `bench_maxtext_layer.dense_step`: hidden k * H, no routing
  ours_<impl>     `linen_moe.RoutedMoE`, grouped_matmul = auto, kernel,
                  ragged_dot, blocked
  torch_titan     `TitanMoE`
  hf_<backend>    transformers' block, `_experts_implementation` = grouped_mm,
                  eager (batched_mm where its per-pair weight copies fit)

Per variant: ms, TFLOP/s of the useful 18 T k D H, the fraction of dense
(the issue's bars: >= 0.80 at 8 experts, >= 0.55 at 128), and ours' speed
over the fastest torch layer (torch ms / ours ms: >= 1.0 at 8, >= 1.3 at
128); each variant's out, weight gradients and input gradient against
ours_ragged_dot (max and norm relative differences; bf16: 2e-2). Writes
--out/bench_vs_torch.json after each shape.

  python benchmarks/gpu/bench_vs_torch.py --out DIR          # on the GPU
  python benchmarks/gpu/bench_vs_torch.py --cpu-dry-run --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "device"))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import bench_maxtext_layer as layer_bench  # noqa: E402
import gpu_timing  # noqa: E402
import jax  # noqa: E402

OURS = ("auto", "kernel", "ragged_dot", "blocked")
HF_BACKENDS = ("grouped_mm", "eager", "batched_mm")
REFERENCE = "ours_ragged_dot"
# batched_mm copies each pair's expert weights: run it only below this.
BATCHED_MM_BYTES = 8 << 30
# The bars: ours over the fastest torch layer, by expert count.
TORCH_BARS = {8: 1.0, 128: 1.3}


def family(shape) -> str:
  """transformers' block of the shape's routing."""
  return "mixtral" if shape.routing == "topk_then_softmax" else "qwen3_moe"


def batched_mm_bytes(shape) -> int:
  """Bytes of batched_mm's per-pair copies of the gate-up weights."""
  return shape.tokens * shape.top_k * shape.emb * 2 * shape.mlp * 2


def torch_bar(shape) -> float:
  return TORCH_BARS.get(shape.experts, TORCH_BARS[128])


def verdicts(ms: dict[str, float], shape) -> dict:
  """The reporting arithmetic: fractions of dense, the fastest torch
  layer, and each of ours over it (torch ms / ours ms), with the bars."""
  of_dense = gpu_timing.fractions(ms, "dense")
  torch_ms = {n: t for n, t in ms.items() if n.startswith(("torch", "hf_"))}
  fastest = min(torch_ms, key=torch_ms.get) if torch_ms else None
  over = (
      {n: torch_ms[fastest] / t for n, t in ms.items() if n.startswith("ours")}
      if fastest
      else {}
  )
  return {
      "of_dense": of_dense,
      "bar_of_dense": shape.bar,
      "fastest_torch": fastest,
      "ours_over_fastest_torch": over,
      "bar_over_torch": torch_bar(shape),
  }


def jax_variants(shape, ops, workers: int) -> tuple[dict, dict]:
  """({name: thunk}, {name: error}) of dense and ours, compiled `workers`
  at a time."""
  jobs = {
      "dense": (
          layer_bench.dense_step(),
          (ops["dense"], ops["x"], ops["cot"]),
      )
  }
  for impl in OURS:
    jobs[f"ours_{impl}"] = (
        layer_bench.our_step(shape, impl, False),
        (ops["params"], ops["x"], ops["cot"]),
    )
  compiled, errors = gpu_timing.compile_all(jobs, workers)
  return {
      name: gpu_timing.jax_thunk(call, *jobs[name][1])
      for name, call in compiled.items()
  }, errors


def torch_variants(torch, shape, ops, skipped: dict) -> dict:
  """{name: (thunk, the raw step)} of TitanMoE and transformers' blocks."""
  import numpy as np  # noqa: PLC0415
  import torch_moe  # noqa: PLC0415

  params = jax.tree.map(lambda a: np.asarray(a, np.float32), ops["params"])
  x, cot = (np.asarray(ops[n], np.float32) for n in ("x", "cot"))
  out = {}
  titan = torch_moe.TitanMoE(torch, params, shape.top_k, normalize=True)
  out["torch_titan"] = torch_moe.layer_step(torch, titan, x, cot)
  try:
    import transformers  # noqa: PLC0415
  except ImportError as e:
    skipped["hf"] = f"transformers does not import: {e}"
    return out
  for backend in HF_BACKENDS:
    if backend == "batched_mm" and batched_mm_bytes(shape) > BATCHED_MM_BYTES:
      skipped[f"hf_{backend}"] = (
          f"its per-pair weight copies: {batched_mm_bytes(shape) / 2**30:.0f}"
          " GiB"
      )
      continue
    try:
      block = torch_moe.hf_block(
          torch, transformers, family(shape), params, shape.top_k, backend
      )
      out[f"hf_{backend}"] = torch_moe.layer_step(torch, block, x, cot)
    except Exception as e:  # noqa: BLE001 (a backend missing is a result)
      skipped[f"hf_{backend}"] = f"{type(e).__name__}: {e}"[:400]
  return out


def compare(raw: dict, reference: str) -> dict:
  """{variant: {"leaves": {leaf: relative_errors}, "agree": all within
  bf16 rounding}} of (out, weight grads, x grad) against `reference`'s,
  all in our layout."""
  want = _leaves(raw[reference]())
  out = {}
  for name, run in raw.items():
    if name in (reference, "dense"):
      continue
    got = _leaves(run())
    out[name] = {
        leaf: (
            gpu_timing.relative_errors(got[leaf], want[leaf])
            if leaf in got
            else "missing"
        )
        for leaf in want
    }
  return {
      name: {
          "leaves": leaves,
          "agree": all(
              e != "missing" and gpu_timing.agree(e) for e in leaves.values()
          ),
      }
      for name, leaves in out.items()
  }


def _leaves(result) -> dict:
  out, grads, dx = result
  flat = {"out": out, "x_grad": dx}
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    flat["/".join(str(getattr(k, "key", k)) for k in path)] = leaf
  return flat


def bench_shape(label, shape, args, torch, deadline) -> dict:
  print(f"== {label}: {shape}", flush=True)
  ops = layer_bench.operands(shape)
  raw, skipped = jax_variants(shape, ops, args.workers)
  if torch is not None:
    for name, run in torch_variants(torch, shape, ops, skipped).items():
      raw[name] = gpu_timing.torch_thunk(torch, run)
  else:
    skipped["torch"] = "torch does not import here"
  seconds, errors = gpu_timing.alternating_medians(raw, args.rounds, deadline)
  ms = {n: s * 1e3 for n, s in seconds.items()}
  flops = layer_bench.useful_flops(shape)
  result = {
      "shape": dataclasses.asdict(shape),
      "ms": ms,
      "tflops": {n: gpu_timing.tflops(flops, t) for n, t in ms.items()},
      "errors": errors,
      "skipped": skipped,
      **verdicts(ms, shape),
  }
  for n, t in ms.items():
    print(
        f"  {n:>16}: {t:9.3f} ms, {result['tflops'][n]:7.1f} TFLOP/s,"
        f" {result['of_dense'].get(n, 0):.2f} of dense",
        flush=True,
    )
  for n, e in {**errors, **skipped}.items():
    print(f"  {n:>16}: not run: {e[:200]}", flush=True)
  if REFERENCE in seconds:
    result["differences"] = compare({n: raw[n] for n in seconds}, REFERENCE)
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--shapes",
      nargs="+",
      default=list(layer_bench.SHAPES),
      choices=list(layer_bench.SHAPES),
  )
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--budget-s", type=float, default=240)
  parser.add_argument(
      "--workers",
      type=int,
      default=min(8, os.cpu_count() or 1),
      help="programs compiled at once",
  )
  parser.add_argument("--out", default=".")
  parser.add_argument(
      "--cpu-dry-run",
      action="store_true",
      help="tiny shapes on this host's CPU, one round",
  )
  args = parser.parse_args(argv)
  table = layer_bench.TINY if args.cpu_dry_run else layer_bench.SHAPES
  rounds = 1 if args.cpu_dry_run else args.rounds
  args.rounds = rounds
  deadline = gpu_timing.Deadline(args.budget_s)
  torch = gpu_timing.torch_or_none()
  result = {"environment": gpu_timing.environment(), "shapes": {}}
  for label in args.shapes:
    if deadline.passed():
      result["shapes"][label] = {"cut": "deadline"}
    else:
      result["shapes"][label] = bench_shape(
          label, table[label], args, torch, deadline
      )
    path = gpu_timing.write_json(args.out, "bench_vs_torch.json", result)
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
