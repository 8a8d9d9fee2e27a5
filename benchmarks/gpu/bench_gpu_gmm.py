"""The expert matmul on the GPU, forward + backward, bf16: every GPU route
of the kernel registry beside a dense matmul of the same FLOPs and
`torch._grouped_mm`, timed in one process, side by side.

For each shape (M rows, K, N, G groups; bf16 operands, float32
accumulation) and each group layout ("equal"; "skewed": one group half the
rows, a quarter of the groups none; `bench_gmm.group_sizes`), out, dlhs
and drhs of a fixed random cotangent, medians of --rounds alternating
rounds:

  dense         `jnp.dot` [M, K] x [K, N]: cuBLAS, the bar's base
  blocked       `grouped_matmul(implementation="blocked")` (pure JAX)
  gpu/<name>    each entry of `registry.entries("gpu")`, loaded as
                `grouped_matmul="kernel"` would load it: XLA's ragged_dot
                as the machine lowers it, the Pallas-Triton lowering flag,
                tokamax per implementation, and any entry registered
                later; one that does not load says why
  torch_grouped_mm  `torch._grouped_mm` forward + backward through
                autograd (where torch imports)

Each as ms, TFLOP/s of the useful 6 M K N and the fraction of dense (dense
ms / its ms; the issue's bars: >= 0.85 at 8 experts, >= 0.70 at 128, and
the best route >= 1.5x torch's at 128), and each route's largest
difference from `gpu/xla_ragged_dot` (out, dlhs, drhs). Writes
--out/bench_gpu_gmm.json after each shape.

  python benchmarks/gpu/bench_gpu_gmm.py --out DIR          # on the GPU
  python benchmarks/gpu/bench_gpu_gmm.py --cpu-dry-run --out DIR
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "device"))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from bench_gmm import group_sizes  # noqa: E402
import gpu_timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# The registry and the grouped matmul's implementations have no public
# name: the layer reaches them through `MoEConfig.grouped_matmul`.
from linen_moe._src.kernels import registry  # noqa: E402, TID251
from linen_moe._src.kernels.grouped_matmul import grouped_matmul  # noqa: E402, TID251

# 8 experts of Mixtral-8x22B-like 2048 x 5632 at 8,192 rows and of
# Mixtral-8x7B's 4096 x 14336 at 32,768; 128 experts of Qwen3-30B-A3B's
# 2048 x 768 at 32,768 tokens top-8 (262,144 rows: the published Hopper
# figures' shape).
SHAPES = ("32768,4096,14336,8", "262144,2048,768,128", "8192,2048,5632,8")
TINY = ("256,64,128,8", "512,64,32,16")
REFERENCE = "gpu/xla_ragged_dot"
BF16 = jnp.bfloat16


def bar(groups: int) -> float:
  """The issue's fraction of dense for the best route."""
  return 0.85 if groups <= 8 else 0.70


def _fwd_bwd(matmul):
  @jax.jit
  def run(lhs, rhs, sizes, dout):
    out, vjp = jax.vjp(lambda a, b: matmul(a, b, sizes), lhs, rhs)
    return out, *vjp(dout)

  return run


def routes(backend: str) -> tuple[dict, dict]:
  """({name: (lhs, rhs, sizes) -> [M, N]}, {name: why it does not load})
  of dense, blocked and every GPU entry of the registry."""
  calls = {
      "dense": lambda a, b, s: jnp.dot(a, b),  # b: [K, N]
      "blocked": lambda a, b, s: grouped_matmul(
          a, b, s, implementation="blocked"
      ),
  }
  missing = {}
  for entry in registry.entries("gpu"):
    if backend != "gpu" and entry.on_cpu is None:
      missing[entry.key] = f"runs only on a GPU: {entry.needs}"
      continue
    kernel, why = registry.load(entry, backend)
    if kernel is None:
      missing[entry.key] = why
    else:
      calls[entry.key] = kernel.fn
  return calls, missing


def summarise(ms: dict[str, float], flops: float) -> dict[str, dict]:
  """{name: {ms, tflops, of_dense, vs_torch}}: the reporting arithmetic
  (of_dense = dense ms / its ms; vs_torch = torch ms / its ms, > 1 is
  faster than `torch._grouped_mm`)."""
  of_dense = gpu_timing.fractions(ms, "dense")
  vs_torch = gpu_timing.fractions(ms, "torch_grouped_mm")
  return {
      name: {
          "ms": t,
          "tflops": gpu_timing.tflops(flops, t),
          "of_dense": of_dense.get(name),
          "vs_torch": vs_torch.get(name),
      }
      for name, t in ms.items()
  }


def best_route(summary: dict[str, dict]) -> str | None:
  """The fastest grouped route of ours (not dense, not torch)."""
  ours = {
      n: s["ms"]
      for n, s in summary.items()
      if n not in ("dense", "torch_grouped_mm")
  }
  return min(ours, key=ours.get) if ours else None


def bench_shape(spec: str, args, torch, deadline) -> dict:
  m, k, n, g = (int(x) for x in spec.split(","))
  rng = np.random.default_rng(0)
  host = {
      "lhs": rng.normal(size=(m, k)).astype(np.float32),
      "rhs": (rng.normal(size=(g, k, n)) / np.sqrt(k)).astype(np.float32),
      "dout": rng.normal(size=(m, n)).astype(np.float32),
  }
  lhs, rhs, dout = (jnp.asarray(host[x], BF16) for x in ("lhs", "rhs", "dout"))
  calls, missing = routes(jax.default_backend())
  steps = {name: _fwd_bwd(fn) for name, fn in calls.items()}
  result = {"shape": [m, k, n, g], "not_loaded": missing, "layouts": {}}
  print(f"== M={m} K={k} N={n} G={g} (bf16)", flush=True)
  for name, why in missing.items():
    print(f"  {name}: not loaded: {why[:200]}", flush=True)
  flops = gpu_timing.grouped_flops(m, k, n)
  for layout in args.layouts:
    if deadline.passed():
      result["cut"] = f"deadline before {layout}"
      break
    sizes_np = group_sizes(m, g, layout)
    sizes = jnp.asarray(sizes_np)
    operands = {
        name: (lhs, rhs[0] if name == "dense" else rhs, sizes, dout)
        for name in steps
    }
    if "compiled" not in result:  # both layouts share the programs
      compiled, result["compile_errors"] = gpu_timing.compile_all(
          {name: (step, operands[name]) for name, step in steps.items()},
          args.workers,
      )
      result["compiled"] = sorted(compiled)
    thunks = {
        name: gpu_timing.jax_thunk(compiled[name], *operands[name])
        for name in compiled
    }
    torch_run = None
    if torch is not None:
      from torch_moe import grouped_mm_call  # noqa: PLC0415

      try:
        torch_run = grouped_mm_call(
            torch, host["lhs"], host["rhs"], sizes_np, host["dout"]
        )
        thunks["torch_grouped_mm"] = gpu_timing.torch_thunk(torch, torch_run)
      except Exception as e:  # noqa: BLE001 (reported)
        result.setdefault("torch_error", str(e)[:600])
    seconds, errors = gpu_timing.alternating_medians(
        thunks, args.rounds, deadline
    )
    ms = {name: s * 1e3 for name, s in seconds.items()}
    summary = summarise(ms, flops)
    best = best_route(summary)
    record = {
        "group_sizes": [int(s) for s in sizes_np],
        "routes": summary,
        "errors": errors,
        "best": best,
        "bar_of_dense": bar(g),
    }
    if seconds and REFERENCE in seconds:
      record["differences"] = differences(
          {n: thunks[n] for n in seconds}, torch_run
      )
    result["layouts"][layout] = record
    for name, s in summary.items():
      print(
          f"  {layout:>6} {name:>22}: {s['ms']:9.3f} ms,"
          f" {s['tflops']:7.1f} TFLOP/s, {s['of_dense'] or 0:.2f} of dense"
          + (f", {s['vs_torch']:.2f}x torch" if s["vs_torch"] else ""),
          flush=True,
      )
    for name, e in errors.items():
      print(f"  {layout:>6} {name:>22}: failed: {e[:200]}", flush=True)
  return result


def differences(thunks: dict, torch_run) -> dict:
  """{route: {out, dlhs, drhs: relative_errors}} against REFERENCE."""
  want = thunks[REFERENCE]()
  out = {}
  for name, thunk in thunks.items():
    if name in (REFERENCE, "dense"):
      continue
    got = torch_run() if name == "torch_grouped_mm" else thunk()
    out[name] = {
        leaf: gpu_timing.relative_errors(a, b)
        for leaf, a, b in zip(("out", "dlhs", "drhs"), got, want, strict=True)
    }
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", nargs="+", help="M,K,N,G each")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument(
      "--layouts",
      nargs="+",
      default=["equal", "skewed"],
      choices=["equal", "skewed"],
  )
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
      help="tiny shapes on this host's CPU, one round, no torch",
  )
  args = parser.parse_args(argv)
  if args.cpu_dry_run:
    args.shapes = args.shapes or list(TINY)
    args.rounds = 1
  shapes = args.shapes or list(SHAPES)
  deadline = gpu_timing.Deadline(args.budget_s)
  torch = None if args.cpu_dry_run else gpu_timing.torch_or_none()
  result = {
      "environment": gpu_timing.environment(),
      "rounds": args.rounds,
      "torch": torch is not None,
      "shapes": [],
  }
  for spec in shapes:
    if deadline.passed():
      result["shapes"].append({"spec": spec, "cut": "deadline"})
    else:
      result["shapes"].append(bench_shape(spec, args, torch, deadline))
    path = gpu_timing.write_json(args.out, "bench_gpu_gmm.json", result)
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
