"""The sparse path's row gathers on the chip: XLA's gather beside the Pallas
DMA row gather (`pallas_gather.gather_rows`), in one process, at the sizes
of a Qwen3-30B-A3B layer's train step (bf16, 8 x 4096 tokens, top-8 of 128
experts, emb 2048).

Cases (table [N, M] -> R rows; each timed XLA vs ours, medians of
--repeats rounds alternating call by call, ours checked equal to XLA's):

  dispatch        x [T, M] -> [T * k, M] rows in expert order (each token
                  k times, shuffled): `permute.dispatch_rows`, and the
                  combine's backward `g[order // k]`.
  dispatch_valid  the same with rows past 7/8 of them zero (expert
                  parallelism's masked rows).
  combine_one     one of the combine's k gathers: rows [T * k, M] -> [T, M].
  f32_hbm         float32 [T / 2, M] -> [T * k / 2, M], ours both ways
                  ("vmem" and "hbm" DMA forms).

Each line: ms, GB/s of the rows moved (2 R M bytes: read and written; the
16-bit packing pass is not counted as moved) and that as a fraction of the
chip's HBM roofline (v5e: 819 GB/s). Ours runs with each --block-rows
and --unrolls (row copies issued per loop iteration).

Writes --out/bench_gather.json after every case (a run cut short keeps
what it measured); a case that fails is recorded with its error and the
run goes on.

  python benchmarks/device/bench_gather.py --out DIR            # on a TPU
  python benchmarks/device/bench_gather.py --interpret --out DIR  # anywhere
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# The kernel has no public name: the layer reaches it through
# `MoEConfig.grouped_matmul` ("kernel", or "auto" on a TPU).
from linen_moe._src.kernels.tpu import pallas_gather  # noqa: TID251
from linen_moe._src.kernels.tpu import tpu_chips  # noqa: TID251

BF16 = jnp.bfloat16
# Qwen3-30B-A3B's layer at 8 x 4096 tokens: T tokens, k choices, emb M.
TOKENS, CHOICES, WIDTH = 32768, 8, 2048
INTERPRET_SIZES = (256, 4, 256)


def _time(fn, args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def alternating_medians(calls: dict, args: tuple, repeats: int) -> dict:
  """{name: median seconds}: one untimed call each (the compile), then
  `repeats` rounds calling each once in turn."""
  for fn in calls.values():
    jax.block_until_ready(fn(*args))
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, fn in calls.items():
      times[name].append(_time(fn, args))
  return {name: statistics.median(t) for name, t in times.items()}


def _xla(valid):
  @jax.jit
  def gather(table, index):
    rows = table[index]
    if valid is None:
      return rows
    return jnp.where((jnp.arange(index.shape[0]) < valid)[:, None], rows, 0)

  return gather


def _ours(valid, block_rows, via, interpret, unroll):
  return jax.jit(
      functools.partial(
          pallas_gather.gather_rows,
          valid=valid,
          block_rows=block_rows,
          via=via,
          interpret=interpret,
          unroll=unroll,
      )
  )


def cases(tokens: int, k: int, width: int) -> dict:
  """{name: (table rows, dtype, index fn(rng) -> <int32>[R], valid, vias)}."""
  a = tokens * k

  def tokens_shuffled(rng, n=tokens, r=a):
    return rng.permutation(np.arange(r) % n).astype(np.int32)

  def one_choice(rng):
    return rng.permutation(a)[:tokens].astype(np.int32)

  return {
      "dispatch": (tokens, BF16, tokens_shuffled, None, ("vmem",)),
      "dispatch_valid": (tokens, BF16, tokens_shuffled, a * 7 // 8, ("vmem",)),
      "combine_one": (a, BF16, one_choice, None, ("vmem",)),
      "f32_hbm": (
          tokens // 2,
          jnp.float32,
          functools.partial(tokens_shuffled, n=tokens // 2, r=a // 2),
          None,
          ("vmem", "hbm"),
      ),
  }


def bench_case(name, spec, width, args, roofline) -> dict:
  n, dtype, index_fn, valid, vias = spec
  rng = np.random.default_rng(0)
  index = jnp.asarray(index_fn(rng))
  table = jax.random.normal(jax.random.key(0), (n, width), dtype)
  r = index.shape[0]
  moved = 2 * r * width * jnp.dtype(dtype).itemsize
  calls = {"xla": _xla(valid)}
  for via in vias:
    for block in args.block_rows:
      for unroll in args.unrolls:
        default = unroll == pallas_gather.DEFAULT_UNROLL
        impl = f"ours_{via}_{block}" + ("" if default else f"_u{unroll}")
        calls[impl] = _ours(valid, block, via, args.interpret, unroll)
  result = {
      "case": name,
      "table": [n, width],
      "rows": r,
      "dtype": jnp.dtype(dtype).name,
      "valid": valid,
      "moved_bytes": moved,
      "timings": {},
  }
  want = calls["xla"](table, index)
  for impl, fn in calls.items():  # each guarded: one refusal spares the rest
    entry = result["timings"][impl] = {}
    try:
      if impl != "xla":
        entry["equal"] = bool(jnp.array_equal(fn(table, index), want))
      seconds = alternating_medians({impl: fn}, (table, index), args.repeats)
      entry["ms"] = seconds[impl] * 1e3
      entry["gb_s"] = moved / seconds[impl] / 1e9
      entry["of_roofline"] = entry["gb_s"] * 1e9 / roofline
    except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
      entry["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    shown = entry.get(
        "error"
    ) or f"{entry['ms']:8.3f} ms {entry['gb_s']:7.1f} GB/s {entry['of_roofline']:.2f} of roofline" + (
        "" if impl == "xla" else f" equal={entry['equal']}"
    )
    print(f"{name:15s} {impl:16s} {shown}", flush=True)
  xla_ms = result["timings"]["xla"].get("ms")
  for entry in result["timings"].values():
    if xla_ms and "ms" in entry:
      entry["speedup_vs_xla"] = xla_ms / entry["ms"]
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--sizes",
      default=None,
      help="T,k,M (default: 32768,8,2048; with --interpret: 256,4,256)",
  )
  parser.add_argument("--cases", nargs="+", help="names (default: all)")
  parser.add_argument(
      "--block-rows", nargs="+", type=int, default=[256, 512], help="ours"
  )
  parser.add_argument(
      "--unrolls",
      nargs="+",
      type=int,
      default=[pallas_gather.DEFAULT_UNROLL],
      help="ours: row copies issued per loop iteration",
  )
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--out", default=".", help="where to write the JSON")
  parser.add_argument(
      "--interpret", action="store_true", help="Pallas interpret mode (CPU)"
  )
  args = parser.parse_args(argv)
  if args.sizes:
    tokens, k, width = (int(x) for x in args.sizes.split(","))
  else:
    tokens, k, width = (
        INTERPRET_SIZES if args.interpret else (TOKENS, CHOICES, WIDTH)
    )
  if args.interpret:
    args.repeats = min(args.repeats, 2)
  device = jax.devices()[0]
  chip = tpu_chips.tpu_chip_name(device.device_kind) or "v5e"
  roofline = tpu_chips.TPU_CHIPS[chip].hbm_bandwidth
  print(
      f"{device.device_kind} (roofline of {chip}: {roofline / 1e9:.0f} "
      f"GB/s), jax {jax.__version__}, T={tokens} k={k} M={width}",
      flush=True,
  )
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "bench_gather.json")
  results = []
  for name, spec in cases(tokens, k, width).items():
    if args.cases and name not in args.cases:
      continue
    try:
      results.append(bench_case(name, spec, width, args, roofline))
    except Exception as e:  # noqa: BLE001 (e.g. out of memory: go on)
      print(f"{name}: {type(e).__name__}: {str(e)[:600]}", flush=True)
      results.append({"case": name, "error": f"{type(e).__name__}: {e}"})
    with open(path, "w", encoding="utf-8") as f:
      json.dump(
          {
              "device": device.device_kind,
              "jax": jax.__version__,
              **vars(args),
              "results": results,
          },
          f,
          indent=1,
      )
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
