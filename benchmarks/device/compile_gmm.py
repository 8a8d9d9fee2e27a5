"""Compiles the Pallas grouped matmul for a TPU through libtpu, without the
TPU: every tile the chip's sweep would time (`gmm_tiling.sweep_candidates`)
for each op (forward `gmm`, input gradient `gmm_t`, weight gradient
`tgmm`), and the whole forward + backward with the tiles the package would
choose, at the issue's shapes (bf16). Mosaic must accept each (its VMEM
limits), and the compiled program's `cost_analysis()` FLOPs must be the
useful ones: 2 M K N per op, three times that forward + backward (plus
the visit schedule's few, at most `_SCHEDULE_FLOPS` of them). Then the
same shape as a gated MLP's gate and up projections in one call each way
(`pallas_gate_up`: two weights, forward + backward), twice the FLOPs.

Needs jax[tpu] (libtpu) and no flax: the kernels import only jax.

  python benchmarks/device/compile_gmm.py --target tpu:v5e-1 \\
      [--top 8] [--shapes 8192,2048,5632,8 ...] [--json compile.json]

Prints one line per compile and a summary; exit status 1 if any compile
failed or its FLOPs were not the expected ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# The kernels and their tiles have no public name: the layer reaches them
# through `MoEConfig.grouped_matmul="kernel"`; this compiles them alone.
from linen_moe._src.planning import targets  # noqa: TID251

# M rows, K, N, G groups: the expert matmuls (Mixtral-8x7B-like at
# 2048 x 5632 and 4096 x 14336; Qwen3-30B-A3B's 128 experts of 2048 x 768
# at 4096 tokens x top-8).
SHAPES = ("8192,2048,5632,8", "32768,4096,14336,8", "32768,2048,768,128")
# The most FLOPs beyond the useful 2 M K N an op may report, as a share.
_SCHEDULE_FLOPS = 1e-5


def _compile(fn, *args):
  """(seconds, FLOPs of cost_analysis) of compiling `fn` for `args`."""
  import jax  # noqa: PLC0415

  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return seconds, float(cost.get("flops", -1))


def check_shape(m, k, n, g, device, top: int) -> list[dict]:
  """Compile records of one shape: each sweep candidate of each op, then
  forward + backward with the chosen tiles."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import tpu_programs  # noqa: PLC0415 (imports jax)

  from linen_moe._src.kernels.tpu import gmm_tiling  # noqa: TID251
  from linen_moe._src.kernels.tpu import pallas_gate_up  # noqa: TID251
  from linen_moe._src.kernels.tpu import pallas_gmm  # noqa: TID251
  from linen_moe._src.kernels.tpu import pallas_grouped  # noqa: TID251
  from linen_moe._src.kernels.tpu import tpu_chips  # noqa: TID251

  chip = tpu_chips.tpu_chip_name(device.device_kind)
  place = tpu_programs.placer(device)
  bf16 = jnp.bfloat16

  def arg(*shape, dtype=bf16):
    return place(shape, dtype)

  sizes = arg(g, dtype=jnp.int32)
  useful = 2 * m * k * n
  limit = gmm_tiling.raised_vmem_limit(chip)
  records = []

  def record(what, tiles, fn, args, want):
    rec = {"shape": [m, k, n, g], "op": what, "tiles": tiles, "chip": chip}
    try:
      rec["compile_s"], rec["flops"] = _compile(fn, *args)
      # The kernels' own FLOPs, plus the schedule's few (cumulative sums
      # over the groups and visits: ~2e5 at 128 groups).
      rec["extra_flops"] = rec["flops"] - want
      rec["ok"] = 0 <= rec["extra_flops"] <= _SCHEDULE_FLOPS * want
    except Exception as e:  # noqa: BLE001 (Mosaic's refusals are reported)
      rec["ok"], rec["error"] = False, f"{type(e).__name__}: {str(e)[:400]}"
    records.append(rec)
    status = "ok" if rec["ok"] else "FAIL"
    detail = (
        rec.get("error")
        or f"{rec['compile_s']:.1f} s, {rec['flops']:.4g} FLOPs"
    )
    print(f"{status} {m}x{k}x{n} G={g} {what} {tiles}: {detail}", flush=True)

  ops = {
      "gmm": (dict(transpose_rhs=False), (arg(m, k), arg(g, k, n))),
      "gmm_t": (dict(transpose_rhs=True), (arg(m, n), arg(g, k, n))),
  }
  for op in gmm_tiling.OPS:
    for tiles in gmm_tiling.sweep_candidates(op, m, k, n, g, bf16, chip, top):
      if op == "tgmm":
        fn = lambda a, b, s, t=tiles: pallas_gmm.tgmm(  # noqa: E731
            a, b, s, tiling=t, out_dtype=bf16, vmem_limit_bytes=limit
        )
        args = (arg(m, k), arg(m, n), sizes)
      else:
        kw, operands = ops[op]
        fn = lambda a, b, s, t=tiles, kw=kw: pallas_gmm.gmm(  # noqa: E731
            a, b, s, tiling=t, out_dtype=bf16, vmem_limit_bytes=limit, **kw
        )
        args = (*operands, sizes)
      record(op, list(tiles), fn, args, useful)

  tiling = gmm_tiling.choose_tiling(m, k, n, g, bf16, chip)

  def fwd_bwd(lhs, rhs, s, dout):
    out, vjp = jax.vjp(
        lambda a, b: pallas_grouped.pallas_grouped_matmul(
            a, b, s, tiling=tiling
        ),
        lhs,
        rhs,
    )
    return out, vjp(dout)

  chosen = [list(getattr(tiling, op)) for op in gmm_tiling.OPS]
  args = (arg(m, k), arg(g, k, n), sizes, arg(m, n))
  record(f"fwd+bwd ({tiling.source})", chosen, fwd_bwd, args, 3 * useful)

  paired = pallas_gate_up.paired_tiling(m, k, n, g, bf16, chip)

  def paired_fwd_bwd(lhs, w0, w1, s, d0, d1):
    outs, vjp = jax.vjp(
        lambda a, b, c: pallas_gate_up.paired_grouped_matmul(
            a, b, c, s, tiling=paired
        ),
        lhs,
        w0,
        w1,
    )
    return outs, vjp((d0, d1))

  chosen = [list(getattr(paired, op)) for op in gmm_tiling.OPS]
  args = (arg(m, k), arg(g, k, n), arg(g, k, n), sizes, arg(m, n), arg(m, n))
  record("gate+up fwd+bwd", chosen, paired_fwd_bwd, args, 6 * useful)
  return records


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="tpu:v5e-1")
  parser.add_argument("--shapes", nargs="+", default=SHAPES, help="M,K,N,G")
  parser.add_argument("--top", type=int, default=8)
  parser.add_argument("--json", help="write the records here")
  args = parser.parse_args(argv)
  target = targets.parse_target(args.target)
  targets.prepare_process(target)
  import jax  # noqa: PLC0415

  device = targets.target_devices(target)[0]
  print(f"jax {jax.__version__}, {args.target}: {device.device_kind}")
  records = []
  for shape in args.shapes:
    m, k, n, g = (int(x) for x in shape.split(","))
    records += check_shape(m, k, n, g, device, args.top)
  failed = [r for r in records if not r["ok"]]
  print(
      f"{len(records) - len(failed)} of {len(records)} compiled with the "
      "expected FLOPs"
  )
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(records, f, indent=1)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
