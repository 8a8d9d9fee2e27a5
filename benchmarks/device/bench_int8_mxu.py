"""Does int8 reach the matrix unit at twice bf16's rate, and where does the
int8 grouped matmul's time go? One process on the chip, forward only.

A v5e's MXU multiplies int8 at 2x its bf16 rate (394 against 197 TOP/s),
yet the "int8" mode's grouped matmul on our kernels ran at bf16's speed
(`bench_gmm.py`). For each shape (M rows, K, N, G groups of equal size)
this times, in alternating rounds (medians of --repeats):

  dense_bf16   `jnp.dot` [M, K] x [K, N], bf16 operands, float32 out
  dense_int8   the same on int8 operands, int32 out (XLA's own int8)
  gmm_bf16     our Pallas `gmm` at the tile table's forward tiles
  gmm_int8 T   our int8 `gmm` (int8 operands, scales in its epilogue,
               float32 out) at tiles T: the bf16 table's, then the best of
               `gmm_tiling.sweep_candidates` for int8
  quant_lhs    `int8_grouped.quantize_int8` of the [M, K] rows
  quant_rhs    the same of the [G, K, N] weights (per group and column)
  int8_path    the "int8" mode's whole forward on our kernels (both
               quantizations and the int8 gmm)

each in ms and TOP/s (2 M K N over its time; the quantizations in GB/s of
what they read and write). Writes --out/bench_int8_mxu.json.

  python benchmarks/device/bench_int8_mxu.py --out DIR        # on a TPU
  python benchmarks/device/bench_int8_mxu.py --interpret \\
      --shapes 256,256,512,4 --repeats 1 --top 1 --out DIR     # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_gmm  # noqa: E402

from linen_moe._src.kernels import int8_grouped  # noqa: E402, TID251

# The kernels have no public name (the layer reaches them through
# `quantization="int8"` with `grouped_matmul="kernel"`): this times them
# alone.
from linen_moe._src.kernels.tpu import gmm_tiling  # noqa: E402, TID251
from linen_moe._src.kernels.tpu import pallas_gmm  # noqa: E402, TID251

SHAPES = ("16384,4096,14336,8", "32768,2048,768,128")


def calls(m, k, n, g, chip, top, interpret) -> dict:
  """{name: (jitted fn, args)} of every timed program at one shape."""
  keys = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  w = jax.random.normal(keys[1], (g, k, n), jnp.bfloat16) * 0.05
  sizes = jnp.asarray(bench_gmm.group_sizes(m, g, "equal"))
  qx, sx = int8_grouped.quantize_int8(x, axis=1)
  qw, sw = int8_grouped.quantize_int8(w, axis=1)
  out = {
      "dense_bf16": (
          jax.jit(
              lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
          ),
          (x, w[0]),
      ),
      "dense_int8": (
          jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32)),
          (qx, qw[0]),
      ),
  }
  bf16 = gmm_tiling.choose_tiling(m, k, n, g, jnp.bfloat16, chip)
  out["gmm_bf16"] = (
      jax.jit(
          lambda a, b, s: pallas_gmm.gmm(
              a,
              b,
              s,
              tiling=bf16.gmm,
              out_dtype=jnp.bfloat16,
              interpret=interpret,
              vmem_limit_bytes=bf16.vmem_limit_bytes,
          )
      ),
      (x, w, sizes),
  )
  tiles = [bf16.gmm] + [
      t
      for t in gmm_tiling.sweep_candidates(
          "gmm", m, k, n, g, jnp.int8, chip, top
      )
      if t != bf16.gmm
  ]
  limit = gmm_tiling.raised_vmem_limit(chip)
  for t in tiles:
    out[f"gmm_int8 {t[0]}x{t[1]}x{t[2]}"] = (
        jax.jit(
            lambda a, sa, b, sb, s, t=t: pallas_gmm.gmm(
                a,
                b,
                s,
                tiling=t,
                out_dtype=jnp.float32,
                interpret=interpret,
                vmem_limit_bytes=limit,
                scales=(sa, sb),
            )
        ),
        (qx, sx, qw, sw, sizes),
    )
  out["quant_lhs"] = (
      jax.jit(lambda a: int8_grouped.quantize_int8(a, axis=1)),
      (x,),
  )
  out["quant_rhs"] = (
      jax.jit(lambda b: int8_grouped.quantize_int8(b, axis=1)),
      (w,),
  )
  impl = "kernel"
  out["int8_path"] = (
      jax.jit(lambda a, b, s: int8_grouped.int8_grouped_matmul(a, b, s, impl)),
      (x, w, sizes),
  )
  return out


def bench_shape(spec: str, chip, args) -> dict:
  m, k, n, g = (int(v) for v in spec.split(","))
  jobs = calls(m, k, n, g, chip, args.top, args.interpret)
  compiled = bench_gmm.compile_all(
      {name: (fn, a) for name, (fn, a) in jobs.items()}, args.workers
  )
  result = {"shape": spec, "errors": {}}
  ok = {}
  for name, c in compiled.items():
    if isinstance(c, Exception):
      result["errors"][name] = f"{type(c).__name__}: {c}"[:300]
    else:
      ok[name] = c
  seconds = bench_gmm.alternating_medians(
      ok, {name: jobs[name][1] for name in ok}, args.repeats
  )
  flops = 2 * m * k * n
  moved = {  # bytes read and written: bf16 in, int8 and float32 scales out
      "quant_lhs": m * k * 3 + m * 4,
      "quant_rhs": g * k * n * 3 + g * n * 4,
  }
  result["ms"] = {name: s * 1e3 for name, s in seconds.items()}
  result["rate"] = {
      name: moved[name] / s / 1e9 if name in moved else flops / s / 1e12
      for name, s in seconds.items()
  }
  for name, s in seconds.items():
    unit = "GB/s" if name in moved else "TOP/s"
    print(
        f"  {spec} {name}: {s * 1e3:.3f} ms, {result['rate'][name]:.1f} {unit}",
        flush=True,
    )
  for name, e in result["errors"].items():
    print(f"  {spec} {name}: {e[:200]}", flush=True)
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", nargs="+", default=SHAPES, help="M,K,N,G")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--top", type=int, default=4, help="int8 tiles swept")
  parser.add_argument("--workers", type=int, default=min(8, os.cpu_count()))
  parser.add_argument("--interpret", action="store_true")
  parser.add_argument("--out", default=".")
  args = parser.parse_args(argv)
  chip = None if args.interpret else gmm_tiling.current_chip()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
  results = []
  for spec in args.shapes:
    results.append(bench_shape(spec, chip, args))
    os.makedirs(args.out, exist_ok=True)
    with open(
        os.path.join(args.out, "bench_int8_mxu.json"), "w", encoding="utf-8"
    ) as f:
      json.dump(
          {"jax": jax.__version__, "chip": chip, "results": results},
          f,
          indent=1,
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
