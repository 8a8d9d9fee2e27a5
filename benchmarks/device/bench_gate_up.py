"""The gate and up projections on the chip: two grouped-matmul calls beside
the paired kernels (`pallas_gate_up`: the forward as two calls, the
backward as one call each way) at several tiles, forward + backward, bf16,
in one process.

Variants, each the gradients of `sum(out0 * c0 + out1 * c1)` with respect
to the rows and both weights (the forward alone timed too):

  two             two `pallas_grouped_matmul` calls, the single problem's
                  tiles (`gmm_tiling.choose_tiling`), XLA adding the two
                  input gradients
  paired          `paired_grouped_matmul` with its default tiles
                  (`pallas_gate_up.paired_tiling`)
  paired_single   the single problem's tiles unchanged (the VMEM limit
                  raised for the second weight)
  paired_half_n   those with the tiles along N (the forward's and the
                  weight gradient's output tile, the input gradient's
                  contraction tile) the next smaller divisor of N that is a
                  multiple of 128

Before 2026-12-07 the paired forward was one call for both weights, and
"paired_half_k" (every K tile one step smaller) was measured; the
figures are in benchmarks/device/README.md.

Equal groups (M / G rows each). Printed per variant: ms forward + backward,
ms forward, and the forward + backward as a fraction of `two`'s.
Writes --out/bench_gate_up.json after every shape.

  python benchmarks/device/bench_gate_up.py --out DIR             # on a TPU
  python benchmarks/device/bench_gate_up.py --interpret --out DIR  # anywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import bench_gmm
import jax
import jax.numpy as jnp

# The kernels have no public name: the layer reaches them through
# `MoEConfig.grouped_matmul` ("kernel", or "auto" on a TPU).
from linen_moe._src.kernels.tpu import gmm_tiling  # noqa: TID251
from linen_moe._src.kernels.tpu import pallas_gate_up  # noqa: TID251
from linen_moe._src.kernels.tpu import pallas_grouped  # noqa: TID251

BF16 = jnp.bfloat16
# M, K, N, G: the sorted rows of bench_maxtext_layer.py's two layers, and
# of a Mixtral-8x7B layer at 4 x 4096 tokens.
SHAPES = ("32768,2048,5632,8", "131072,2048,768,128", "32768,4096,14336,8")
INTERPRET_SHAPES = ("512,256,384,4",)
VARIANTS = ("two", "paired", "paired_single", "paired_half_n")


def variant_tiling(name, m, k, n, g, chip) -> gmm_tiling.GmmTiling | None:
  """The tiles of a paired variant (None for "two": the single problem's
  own, chosen by the kernel)."""
  if name == "two":
    return None
  if name == "paired":
    return pallas_gate_up.paired_tiling(m, k, n, g, BF16, chip)
  tiling = gmm_tiling.choose_tiling(m, k, n, g, BF16, chip)
  (am, ak, an), (bm, bn, bk), (cm, ck, cn) = (
      tiling.gmm,
      tiling.gmm_t,
      tiling.tgmm,
  )

  def smaller(tile, size):
    return pallas_gate_up.smaller_tile(tile, size) or tile

  if name == "paired_half_n":
    an, bn, cn = (smaller(t, n) for t in (an, bn, cn))
  elif name != "paired_single":
    raise ValueError(f"unknown variant {name!r}; one of {VARIANTS}.")
  tiling = dataclasses.replace(
      tiling, gmm=(am, ak, an), gmm_t=(bm, bn, bk), tgmm=(cm, ck, cn)
  )
  return pallas_gate_up.with_paired_limit(tiling, k, n, BF16, chip)


def build(name, m, k, n, g, chip, interpret):
  """(forward + backward fn, forward fn, tiling) of variant `name`."""
  tiling = variant_tiling(name, m, k, n, g, chip)

  def forward(lhs, w0, w1, sizes):
    if name == "two":
      return tuple(
          pallas_grouped.pallas_grouped_matmul(
              lhs, w, sizes, interpret=interpret, chip=chip
          )
          for w in (w0, w1)
      )
    return pallas_gate_up.paired_grouped_matmul(
        lhs, w0, w1, sizes, tiling=tiling, interpret=interpret, chip=chip
    )

  def loss(lhs, w0, w1, sizes, c0, c1):
    out0, out1 = forward(lhs, w0, w1, sizes)
    f32 = jnp.float32
    return jnp.sum(out0.astype(f32) * c0) + jnp.sum(out1.astype(f32) * c1)

  both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  fwd = jax.jit(lambda lhs, w0, w1, sizes, c0, c1: forward(lhs, w0, w1, sizes))
  return both, fwd, tiling


def bench_shape(shape, args, chip) -> dict:
  m, k, n, g = shape
  keys = jax.random.split(jax.random.key(0), 5)
  lhs = jax.random.normal(keys[0], (m, k), BF16)
  w0 = jax.random.normal(keys[1], (g, k, n), BF16) / k**0.5
  w1 = jax.random.normal(keys[2], (g, k, n), BF16) / k**0.5
  c0 = jax.random.normal(keys[3], (m, n), BF16)
  c1 = jax.random.normal(keys[4], (m, n), BF16)
  sizes = jnp.full((g,), m // g, jnp.int32)
  operands = (lhs, w0, w1, sizes, c0, c1)
  calls, result = {}, {"shape": [m, k, n, g], "variants": {}}
  for name in args.variants:
    entry = result["variants"][name] = {}
    try:
      both, fwd, tiling = build(name, m, k, n, g, chip, args.interpret)
      entry["tiling"] = None if tiling is None else dataclasses.asdict(tiling)
      jax.block_until_ready((both(*operands), fwd(*operands)))
      calls[name], calls[f"{name} forward"] = both, fwd
    except Exception as e:  # noqa: BLE001 (a refused tiling is a result)
      entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
  seconds = bench_gmm.alternating_medians(
      calls, dict.fromkeys(calls, operands), args.repeats
  )
  for name, entry in result["variants"].items():
    if name in seconds:
      entry["ms"] = seconds[name] * 1e3
      entry["forward_ms"] = seconds[f"{name} forward"] * 1e3
  base = result["variants"].get("two", {}).get("ms")
  print(f"== {m} x {k} x {n}, {g} groups", flush=True)
  for name, entry in result["variants"].items():
    if "ms" not in entry:
      print(f"  {name:14s} {entry['error']}", flush=True)
      continue
    ratio = f", {base / entry['ms']:.2f}x two's speed" if base else ""
    tiles = entry["tiling"] and {
        op: entry["tiling"][op] for op in ("gmm", "gmm_t", "tgmm")
    }
    print(
        f"  {name:14s} {entry['ms']:8.3f} ms (forward"
        f" {entry['forward_ms']:.3f}){ratio} {tiles or ''}",
        flush=True,
    )
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", nargs="+", help="M,K,N,G")
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=".", help="where to write the JSON")
  parser.add_argument(
      "--interpret", action="store_true", help="Pallas interpret mode (CPU)"
  )
  args = parser.parse_args(argv)
  for name in args.variants:
    if name not in VARIANTS:
      parser.error(f"unknown variant {name!r}; one of {VARIANTS}")
  shapes = args.shapes or (INTERPRET_SHAPES if args.interpret else SHAPES)
  chip = "v5e" if args.interpret else gmm_tiling.current_chip()
  if args.interpret:
    args.repeats = min(args.repeats, 2)
  print(
      f"{jax.devices()[0].device_kind}, jax {jax.__version__}, chip {chip}",
      flush=True,
  )
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "bench_gate_up.json")
  results = []
  for text in shapes:
    shape = tuple(int(x) for x in text.split(","))
    results.append(bench_shape(shape, args, chip))
    with open(path, "w", encoding="utf-8") as f:
      json.dump({"jax": jax.__version__, "chip": chip, "results": results}, f)
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
