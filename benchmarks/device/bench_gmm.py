"""The grouped expert matmul on the chip, forward + backward, beside a dense
matmul of the same FLOPs, in one process: a tile sweep of the Pallas kernels
that writes the tile table, then each implementation side by side.

For each shape (M rows, K, N, G groups; bf16 operands, float32
accumulation) and each group layout ("equal": M / G rows each; "skewed":
one group half the rows, a quarter of the groups none, the rest sharing the
other half):

  sweep   each op of the Pallas kernels (forward `gmm`, input gradient
          `gmm_t`, weight gradient `tgmm`) alone, for the tiles
          `gmm_tiling.sweep_candidates` lists, on each layout of
          --sweep-layouts (default equal); the least total time per op
          becomes the shape's tiles.
  compare out, dlhs and drhs of a random cotangent, medians of --repeats
          rounds that alternate the implementations call by call:
            dense       `jnp.dot` [M, K] x [K, N] (no groups)
            ragged_dot  `jax.lax.ragged_dot`
            megablox    jax's megablox `gmm`, its default tiles (128 x 128 x
                        128)
            pallas      ours, with the swept (else the package's) tiles
            int8        the "int8" mode's grouped matmul on our kernels:
                        int8 forward and dlhs (scales in the epilogue,
                        the rule's tiles), float drhs; its quantization
                        included
          each printed in ms and as a fraction of dense (dense ms / its ms).

Writes, under --out: bench_gmm.json (every timing) and gmm_tiles.json (the
package's table with this chip's entries replaced: copy it to
linen_moe/_src/kernels/tpu/gmm_tiles.json), after each shape, so that a run cut
short keeps what it measured.

  python benchmarks/device/bench_gmm.py --out DIR          # on a TPU
  python benchmarks/device/bench_gmm.py --interpret --shapes 256,256,256,4 \\
      --repeats 1 --top 1 --out DIR                         # anywhere, slowly
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# The kernels and their tiles have no public name: the layer reaches them
# through `MoEConfig.grouped_matmul="kernel"`; this times them alone.
from linen_moe._src.kernels import accelerator  # noqa: TID251
from linen_moe._src.kernels.tpu import gmm_tiling  # noqa: TID251
from linen_moe._src.kernels.tpu import pallas_gmm  # noqa: TID251
from linen_moe._src.kernels.tpu import pallas_grouped  # noqa: TID251

SHAPES = ("8192,2048,5632,8", "32768,4096,14336,8", "32768,2048,768,128")
IMPLEMENTATIONS = ("dense", "ragged_dot", "megablox", "pallas", "int8")
BF16 = jnp.bfloat16


def group_sizes(m: int, g: int, layout: str) -> np.ndarray:
  """<int32>[G] summing to M: "equal" or "skewed" (group 0 half the rows,
  the last quarter of the groups none, the others the rest evenly)."""
  if layout == "equal":
    sizes = np.full(g, m // g)
  else:
    sizes = np.zeros(g, np.int64)
    sizes[0] = m // 2
    sharing = max(1, g - 1 - g // 4)
    sizes[1 : 1 + sharing] = (m - m // 2) // sharing
  sizes[0] += m - sizes.sum()
  return sizes.astype(np.int32)


def _time(fn, args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def alternating_medians(calls: dict, args: dict, repeats: int) -> dict:
  """{name: median seconds}: one untimed call each, then `repeats` rounds
  calling each once in turn."""
  for name, fn in calls.items():
    jax.block_until_ready(fn(*args[name]))
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, fn in calls.items():
      times[name].append(_time(fn, args[name]))
  return {name: statistics.median(t) for name, t in times.items()}


def _fwd_bwd(matmul):
  @jax.jit
  def run(lhs, rhs, sizes, dout):
    out, vjp = jax.vjp(lambda a, b: matmul(a, b, sizes), lhs, rhs)
    return out, vjp(dout)

  return run


def implementations(tiling, interpret: bool) -> dict:
  """{name: jitted (lhs, rhs, sizes, dout) -> (out, (dlhs, drhs))}; dense
  takes rhs [K, N]."""
  from jax.experimental.pallas.ops.tpu import megablox  # noqa: PLC0415

  calls = {
      "dense": _fwd_bwd(lambda a, b, s: jnp.dot(a, b)),
      "ragged_dot": _fwd_bwd(jax.lax.ragged_dot),
      "megablox": _fwd_bwd(
          lambda a, b, s: megablox.gmm(
              a, b, s, BF16, (128, 128, 128), None, None, False, interpret
          )
      ),
      "pallas": _fwd_bwd(
          functools.partial(
              pallas_grouped.pallas_grouped_matmul,
              tiling=tiling,
              interpret=interpret,
          )
      ),
  }
  try:  # the int8 mode's grouped matmul (its module imports flax)
    from linen_moe._src.kernels import int8_grouped  # noqa: PLC0415, TID251
  except ImportError as e:
    print(f"  int8: not run ({e})")
    return calls
  calls["int8"] = _fwd_bwd(
      lambda a, b, s: int8_grouped.int8_grouped_matmul(a, b, s, "kernel")
  )
  return calls


def compile_all(jobs: dict, workers: int) -> dict:
  """{key: compiled executable, or the exception compiling it raised} of
  {key: (jitted fn, args)}, compiled in `workers` threads at once (XLA and
  Mosaic compile outside the GIL; a big tile takes ~10 s on one core)."""

  def build(fn, args):
    try:
      return fn.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 (a refused tiling is a result)
      return e

  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = {key: pool.submit(build, *job) for key, job in jobs.items()}
  return {key: f.result() for key, f in futures.items()}


def _op_call(op, tiles, limit, interpret):
  kw = dict(tiling=tiles, out_dtype=BF16, interpret=interpret)
  kw["vmem_limit_bytes"] = limit
  if op == "tgmm":
    return jax.jit(functools.partial(pallas_gmm.tgmm, **kw))
  return jax.jit(
      functools.partial(pallas_gmm.gmm, transpose_rhs=op == "gmm_t", **kw)
  )


def sweep(shape, operands, chip, args) -> tuple[dict, list]:
  """({op: fastest tiles}, records) of each op's sweep candidates, each
  timed on every layout of `args.sweep_layouts` (the fastest: the least
  sum over them)."""
  m, k, n, g = shape
  lhs, rhs, dout = operands
  layouts = {
      layout: jnp.asarray(group_sizes(m, g, layout))
      for layout in args.sweep_layouts
  }

  def op_args(op, sizes):
    return {
        "gmm": (lhs, rhs, sizes),
        "gmm_t": (dout, rhs, sizes),
        "tgmm": (lhs, dout, sizes),
    }[op]

  first = layouts[args.sweep_layouts[0]]
  limit = gmm_tiling.raised_vmem_limit(chip)
  jobs = {
      (op, tiles): (
          _op_call(op, tiles, limit, args.interpret),
          op_args(op, first),
      )
      for op in gmm_tiling.OPS
      for tiles in gmm_tiling.sweep_candidates(
          op, m, k, n, g, BF16, chip, args.top
      )
  }
  start = time.perf_counter()
  compiled = compile_all(jobs, args.workers)
  print(f"  compiled {len(jobs)} in {time.perf_counter() - start:.1f} s")
  best, records, timed = {}, [], {}
  for (op, tiles), call in compiled.items():
    if isinstance(call, Exception):
      records.append({"op": op, "tiles": tiles, "error": str(call)[:300]})
      print(f"  {op} {tiles}: {type(call).__name__}", flush=True)
      continue
    each = {
        layout: alternating_medians(
            {"x": call}, {"x": op_args(op, sizes)}, args.repeats
        )["x"]
        for layout, sizes in layouts.items()
    }
    seconds = sum(each.values())
    timed[op, tiles] = seconds
    ms = {layout: round(s * 1e3, 4) for layout, s in each.items()}
    records.append({"op": op, "tiles": tiles, "ms": seconds * 1e3, **ms})
    print(
        f"  {op} {tiles}: "
        + ", ".join(
            f"{layout} {s * 1e3:.3f} ms ({2 * m * k * n / s / 1e12:.1f}"
            " TFLOP/s)"
            for layout, s in each.items()
        ),
        flush=True,
    )
  for op in gmm_tiling.OPS:
    mine = {t: s for (o, t), s in timed.items() if o == op}
    if mine:
      best[op] = min(mine, key=mine.get)
  return best, records


def bench_shape(spec: str, chip: str, args) -> dict:
  m, k, n, g = (int(x) for x in spec.split(","))
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.normal(size=(m, k)), BF16)
  rhs = jnp.asarray(rng.normal(size=(g, k, n)) / np.sqrt(k), BF16)
  dout = jnp.asarray(rng.normal(size=(m, n)), BF16)
  equal = jnp.asarray(group_sizes(m, g, "equal"))
  print(f"== M={m} K={k} N={n} G={g} ({chip}, bf16)", flush=True)
  tiling = gmm_tiling.choose_tiling(m, k, n, g, BF16, chip)
  sweep_records = []
  if args.top > 0:
    best, sweep_records = sweep((m, k, n, g), (lhs, rhs, dout), chip, args)
    fit = {op: best.get(op, getattr(tiling, op)) for op in gmm_tiling.OPS}
    limit = gmm_tiling.raised_vmem_limit(chip)
    tiling = gmm_tiling.GmmTiling(**fit, vmem_limit_bytes=limit, source="sweep")
  print(f"  tiles: {tiling}", flush=True)
  operands = {name: (lhs, rhs, equal, dout) for name in IMPLEMENTATIONS}
  operands["dense"] = (lhs, rhs[0], equal, dout)
  jobs = implementations(tiling, args.interpret)
  # int8 resolves "kernel" while it is traced; on a CPU, to the Pallas
  # kernels only inside this context.
  on_cpu = accelerator.kernels_on_cpu("pallas")
  with on_cpu if args.interpret else contextlib.nullcontext():
    calls = compile_all(
        {name: (fn, operands[name]) for name, fn in jobs.items()},
        args.workers,
    )
  for name, call in list(calls.items()):
    if isinstance(call, Exception):
      print(f"  {name}: {type(call).__name__}: {str(call)[:300]}", flush=True)
      del calls[name]
  result = {"shape": [m, k, n, g], "tiling": tiling.__dict__, "layouts": {}}
  result["sweep"] = sweep_records
  for layout in ("equal", "skewed"):
    sizes = jnp.asarray(group_sizes(m, g, layout))
    operands = {name: (lhs, rhs, sizes, dout) for name in calls}
    operands["dense"] = (lhs, rhs[0], sizes, dout)
    ms = {
        name: s * 1e3
        for name, s in alternating_medians(
            calls, operands, args.repeats
        ).items()
    }
    result["layouts"][layout] = ms
    flops = 3 * 2 * m * k * n
    for name in calls:
      print(
          f"  {layout:>6} {name:>10}: {ms[name]:9.3f} ms, "
          f"{ms['dense'] / ms[name]:.2f} of dense, "
          f"{flops / ms[name] / 1e9:.1f} TFLOP/s",
          flush=True,
      )
    result.setdefault("errors", {})[layout] = errors(calls, operands)
  return result


@jax.jit
def _relative_error(got, want):
  """max |got - want| / max |want| of each of (out, dlhs, drhs), on the
  device (the arrays are GBs)."""
  leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
  return [
      jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
      / jnp.max(jnp.abs(w.astype(jnp.float32)))
      for g, w in leaves
  ]


def errors(calls: dict, operands: dict) -> dict:
  """{name: [relative error of out, dlhs, drhs]} of the grouped
  implementations against ragged_dot: the chip's own correctness check
  (bf16 outputs: ~1e-2; int8: its quantization's ~2e-2)."""
  if "ragged_dot" not in calls:
    return {}
  want = calls["ragged_dot"](*operands["ragged_dot"])
  out = {}
  for name in ("megablox", "pallas", "int8"):
    if name in calls:
      got = calls[name](*operands[name])
      out[name] = [float(e) for e in _relative_error(got, want)]
      print(
          f"  {name} against ragged_dot (out, dlhs, drhs): "
          + ", ".join(f"{e:.2e}" for e in out[name]),
          flush=True,
      )
  return out


def table_entry(result: dict, chip: str) -> dict:
  """The tile table's entry of one shape's result."""
  m, k, n, g = result["shape"]
  layouts = result["layouts"]

  def total(name):  # both layouts: the routing may skew the groups
    return sum(ms.get(name, math.inf) for ms in layouts.values())

  fastest = "pallas" if total("pallas") < total("ragged_dot") else "ragged_dot"
  return {
      "chip": chip,
      "dtype": "bfloat16",
      "m": m,
      "k": k,
      "n": n,
      "groups": g,
      **{op: list(result["tiling"][op]) for op in gmm_tiling.OPS},
      "ms": {
          layout: {name: round(v, 4) for name, v in ms.items()}
          for layout, ms in layouts.items()
      },
      "fastest": "kernel" if fastest == "pallas" else "ragged_dot",
      "measured": (
          f"{datetime.date.today()}, jax {jax.__version__}, "
          "benchmarks/device/bench_gmm.py"
      ),
  }


def write(out: str, results: list, chip: str) -> None:
  with open(os.path.join(out, "bench_gmm.json"), "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1, default=list)
  new = [table_entry(r, chip) for r in results]
  keys = {
      (e["chip"], e["dtype"], e["m"], e["k"], e["n"], e["groups"]) for e in new
  }
  kept = [
      e
      for e in gmm_tiling.load_table()
      if (e["chip"], e["dtype"], e["m"], e["k"], e["n"], e["groups"])
      not in keys
  ]
  path = os.path.join(out, gmm_tiling.TABLE_FILE)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(
        {"about": _about(), "entries": kept + new}, f, indent=1, default=list
    )
  print(f"wrote {path} ({len(new)} new entries)", flush=True)


def _about() -> str:
  import importlib.resources  # noqa: PLC0415

  text = (
      importlib.resources.files("linen_moe._src.kernels.tpu")
      .joinpath(gmm_tiling.TABLE_FILE)
      .read_text(encoding="utf-8")
  )
  return json.loads(text)["about"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", nargs="+", default=SHAPES, help="M,K,N,G")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument(
      "--workers", type=int, default=os.cpu_count(), help="compile threads"
  )
  parser.add_argument(
      "--top", type=int, default=4, help="sweep candidates per op (0: none)"
  )
  parser.add_argument(
      "--sweep-budget-s",
      type=float,
      default=240,
      help="after this many seconds, later shapes skip the sweep",
  )
  parser.add_argument(
      "--sweep-layouts",
      nargs="+",
      default=["equal"],
      choices=["equal", "skewed"],
      help="group layouts each sweep candidate is timed on (summed)",
  )
  parser.add_argument("--out", default=".", help="where to write the JSON")
  parser.add_argument("--chip", help="the table's chip (default: this one's)")
  parser.add_argument(
      "--interpret", action="store_true", help="Pallas interpret mode (CPU)"
  )
  args = parser.parse_args(argv)
  chip = args.chip or gmm_tiling.current_chip() or gmm_tiling.DEFAULT_CHIP
  print(f"{jax.devices()[0].device_kind} ({chip}), jax {jax.__version__}")
  os.makedirs(args.out, exist_ok=True)
  results, start = [], time.perf_counter()
  for spec in args.shapes:
    if args.top and time.perf_counter() - start > args.sweep_budget_s:
      print(f"past --sweep-budget-s {args.sweep_budget_s}: no more sweeps")
      args.top = 0
    results.append(bench_shape(spec, chip, args))
    write(args.out, results, chip)
  return 0


if __name__ == "__main__":
  sys.exit(main())
