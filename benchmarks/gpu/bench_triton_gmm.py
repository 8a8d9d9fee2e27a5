"""Times our Pallas-Triton grouped matmul, forward + backward, beside a
dense matmul of the same FLOPs, and sweeps its tiles (the autotuning hook
of `triton_tiles.TUNED`, whose defaults are unmeasured).

For each shape lhs [M, K] x rhs [G, K, N] and group pattern ("equal": M /
G rows each; "skewed": one group half the rows, a quarter of the groups
none, the rest equal), times forward + backward (out, dlhs, drhs at a
random cotangent) of the kernel and of a plain [M, K] x [K, N] matmul
(the same 6 M K N FLOPs: every row is in some group), in alternating
rounds (one of each per round, each after an untimed call of itself);
medians. `fraction_of_dense` = dense seconds / ours (issue 63's bar:
>= 0.85 at 8 experts, >= 0.70 at 128).

`--sweep` times each pass (gmm, gmm_t, tgmm) alone over a few candidate
tiles and prints the fastest as a `triton_tiles.TUNED` entry.

  python benchmarks/gpu/bench_triton_gmm.py --out DIR            # a GPU
  python benchmarks/gpu/bench_triton_gmm.py --sweep --out DIR    # a GPU
  python benchmarks/gpu/bench_triton_gmm.py --cpu-dry-run --out DIR

`--cpu-dry-run`: tiny shapes, the kernels in Pallas interpret mode on the
CPU, one round: the same code path, no meaningful time. Writes
DIR/bench_triton_gmm.json. From Python: `time_triton_gmm(...)`,
`sweep_tiles(...)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import gpu_timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# The kernel has no public name (the layer reaches it through the kernel
# registry); this times it alone, on group sizes set here.
from linen_moe._src.kernels.gpu import triton_gmm  # noqa: TID251
from linen_moe._src.kernels.gpu import triton_grouped  # noqa: TID251
from linen_moe._src.kernels.gpu import triton_tiles  # noqa: TID251

# M, K, N, G: gpu_run.py's KERNEL_SHAPES (8 experts of 2048 x 5632, top-2
# of 4 x 4096 tokens; 128 experts of 2048 x 768, top-8).
SHAPES = ((32768, 2048, 5632, 8), (131072, 2048, 768, 128))
DRY_SHAPES = ((64, 32, 48, 4),)
PATTERNS = ("equal", "skewed")
# Candidate tiles of the sweep: (block_m, block_n, block_k, num_warps,
# num_stages, group_m), per pass.
CANDIDATES = {
    "gmm": (
        (128, 128, 64, 4, 4, 8),
        (128, 128, 64, 8, 3, 8),
        (128, 256, 64, 8, 3, 8),
        (64, 128, 64, 4, 4, 8),
        (128, 128, 32, 4, 5, 8),
        (256, 128, 64, 8, 3, 8),
    ),
    "tgmm": (
        (64, 128, 128, 4, 3, 8),
        (64, 128, 128, 8, 3, 8),
        (32, 128, 128, 4, 4, 8),
        (128, 128, 128, 8, 3, 8),
        (64, 256, 128, 8, 3, 8),
        (64, 64, 128, 4, 4, 8),
    ),
}
CANDIDATES["gmm_t"] = CANDIDATES["gmm"]
DRY_CANDIDATES = {
    p: ((16, 16, 16, 4, 3, 2), (32, 16, 16, 4, 3, 2))
    for p in (
        "gmm",
        "gmm_t",
        "tgmm",
    )
}


def group_sizes(pattern: str, m: int, g: int) -> np.ndarray:
  """<int32>[G] summing to M: "equal" or "skewed" (see the module doc)."""
  if pattern == "equal":
    sizes = np.full(g, m // g)
  elif pattern == "skewed":
    sizes = np.zeros(g, int)
    rest = list(range(1 + g // 4, g)) or [0]
    sizes[0] = m // 2 if g > 1 else m
    sizes[rest] += (m - sizes.sum()) // len(rest)
  else:
    raise ValueError(f"pattern must be one of {PATTERNS}; got {pattern!r}.")
  sizes[-1] += m - sizes.sum()
  return sizes.astype(np.int32)


def _operands(m, k, n, g, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(keys[0], (m, k), dtype)
  rhs = jax.random.normal(keys[1], (g, k, n), dtype)
  dout = jax.random.normal(keys[2], (m, n), dtype)
  return lhs, rhs, dout


def _fwd_bwd(matmul):
  def run(lhs, rhs, dout):
    out, vjp = jax.vjp(matmul, lhs, rhs)
    return (out, *vjp(dout))

  return jax.jit(run)


# {name: median seconds} of {name: (call, args)}; tests replace it.
_alternating = gpu_timing.call_medians


def time_triton_gmm(
    m: int,
    k: int,
    n: int,
    g: int,
    *,
    dtype: str = "bfloat16",
    pattern: str = "equal",
    rounds: int = 5,
    warmup: int = 1,
    interpret: bool = False,
    tiling: triton_tiles.Tiling | None = None,
) -> dict:
  """Forward + backward of our Pallas-Triton grouped matmul and of a dense
  matmul of the same FLOPs, medians of alternating rounds.

  Returns:
    {"m", "k", "n", "g", "dtype", "pattern", "seconds": {"ours",
    "dense"}, "fraction_of_dense": dense / ours, "tflops": {"ours",
    "dense"} (6 M K N per second / 1e12), "interpret", and the device}.
  """
  dt = jnp.dtype(dtype)
  lhs, rhs, dout = _operands(m, k, n, g, dt)
  sizes = jnp.asarray(group_sizes(pattern, m, g))
  ours = _fwd_bwd(
      lambda x, w: triton_grouped.triton_grouped_matmul(
          x, w, sizes, tiling=tiling, interpret=interpret
      )
  )
  dense = _fwd_bwd(lambda x, w: x @ w)
  seconds = _alternating(
      {"ours": (ours, (lhs, rhs, dout)), "dense": (dense, (lhs, rhs[0], dout))},
      rounds,
      warmup,
  )
  flops = 6 * m * k * n
  return {
      "m": m,
      "k": k,
      "n": n,
      "g": g,
      "dtype": dt.name,
      "pattern": pattern,
      "seconds": seconds,
      "fraction_of_dense": seconds["dense"] / seconds["ours"],
      "tflops": {name: flops / s / 1e12 for name, s in seconds.items()},
      "interpret": interpret,
      **gpu_timing.device_fields(),
  }


def _pass_call(name: str, tiles, dtype, interpret: bool):
  run = dict(tiles=tiles, out_dtype=dtype, interpret=interpret)
  if name == "gmm":
    return functools.partial(triton_gmm.gmm, **run)
  if name == "gmm_t":
    return functools.partial(triton_gmm.gmm, transpose_rhs=True, **run)
  return functools.partial(triton_gmm.tgmm, **run)


def sweep_tiles(
    m: int,
    k: int,
    n: int,
    g: int,
    *,
    dtype: str = "bfloat16",
    pattern: str = "equal",
    rounds: int = 3,
    interpret: bool = False,
    candidates: dict | None = None,
    budget_s: float = 240.0,
) -> dict:
  """Each pass alone over `candidates` (default `CANDIDATES`), until
  `budget_s` is spent; returns {"entry": the fastest as a
  `triton_tiles.TUNED` entry, "seconds": {pass: {tiles: seconds}}}."""
  dt = jnp.dtype(dtype)
  lhs, rhs, dout = _operands(m, k, n, g, dt)
  sizes = jnp.asarray(group_sizes(pattern, m, g))
  operands = {
      "gmm": (lhs, rhs, sizes),
      "gmm_t": (dout, rhs, sizes),
      "tgmm": (lhs, dout, sizes),
  }
  end = time.perf_counter() + budget_s
  found = {}
  for name in triton_tiles.PASSES:
    found[name] = {}
    for fields in (candidates or CANDIDATES)[name]:
      if time.perf_counter() > end:
        break
      tiles = triton_tiles.Tiles(*fields)
      call = _pass_call(name, tiles, dt, interpret)
      try:
        found[name][fields] = _alternating(
            {"t": (call, operands[name])}, rounds, 1
        )["t"]
      except Exception as e:  # noqa: BLE001 (a tile that does not compile)
        print(f"{name} {fields}: {type(e).__name__}: {str(e)[:200]}")
  default = triton_tiles.default_tiling(triton_gmm.compute_dtype(dt))
  entry = {
      "device_kind": gpu_timing.device_fields()["device_kind"],
      "dtype": dt.name,
  }
  entry.update(m=m, k=k, n=n, groups=g)
  for name, times in found.items():
    best = min(times, key=times.get) if times else None
    entry[name] = best or dataclasses.astuple(getattr(default, name))
  return {
      "entry": entry,
      "seconds": {
          p: {",".join(map(str, f)): s for f, s in t.items()}
          for p, t in found.items()
      },
      **gpu_timing.device_fields(),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--cpu-dry-run", action="store_true")
  parser.add_argument("--sweep", action="store_true")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--budget-s", type=float, default=240.0)
  parser.add_argument(
      "--shape", action="append", default=None, help="M,K,N,G (repeatable)"
  )
  args = parser.parse_args(argv)
  dry = args.cpu_dry_run
  shapes = DRY_SHAPES if dry else SHAPES
  if args.shape:
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape]
  rounds = 1 if dry else args.rounds
  record = {"timings": [], "sweeps": []}
  for shape in shapes:
    for pattern in PATTERNS:
      r = time_triton_gmm(
          *shape, dtype=args.dtype, pattern=pattern, rounds=rounds,
          warmup=0 if dry else 1, interpret=dry,
      )  # fmt: skip
      record["timings"].append(r)
      print(
          f"M,K,N,G={shape} {pattern:6s} {r['dtype']}: ours"
          f" {r['seconds']['ours'] * 1e3:.3f} ms, dense"
          f" {r['seconds']['dense'] * 1e3:.3f} ms, fraction of dense"
          f" {r['fraction_of_dense']:.3f}"
      )
    if args.sweep:
      s = sweep_tiles(
          *shape, dtype=args.dtype, rounds=rounds, interpret=dry,
          candidates=DRY_CANDIDATES if dry else None, budget_s=args.budget_s,
      )  # fmt: skip
      record["sweeps"].append(s)
      print("TUNED entry:", json.dumps(s["entry"]))
  if args.out:
    path = gpu_timing.write_json(args.out, "bench_triton_gmm.json", record)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
