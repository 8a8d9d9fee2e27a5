"""megablox `gmm`'s tile sizes on the accelerator this runs on.

For each shape (a decode step's few rows, a training step's many), times
`accelerator.megablox_gmm` forward, and forward + backward (out, dlhs, drhs
of a random cotangent), for row tiles x K/N tiles, beside `lax.ragged_dot`
and the time to read the weights once (a sum over them: the decode step's
floor). Medians of --repeats, each configuration right after an untimed
call of itself. `accelerator.megablox_tiling`'s choice is marked `*`.

  python benchmarks/layer/bench_gmm_tiles.py             # on a TPU
  python benchmarks/layer/bench_gmm_tiles.py --interpret --repeats 1 \\
      --shapes 16,4,256,512                               # anywhere, slowly
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

# The kernel and its tiling have no public name: the layer reaches them
# through `MoEConfig.grouped_matmul="kernel"`; this times them alone.
from linen_moe._src.kernels import accelerator  # noqa: TID251

# M rows, G groups, K, N: the 2.4 B Mixtral shape's decode step (batch 8,
# top-2) and a training step's (4096 tokens), its down projection, and
# Qwen3-30B-A3B's experts (128 of 2048 x 768) at 4096 tokens, top-8.
SHAPES = (
    "16,8,2048,5632",
    "16,8,5632,2048",
    "8192,8,2048,5632",
    "32768,128,2048,768",
)


def _median_s(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _calls(matmul):
  fwd = jax.jit(matmul)

  @jax.jit
  def fwd_bwd(lhs, rhs, sizes, dout):
    out, vjp = jax.vjp(lambda a, b: matmul(a, b, sizes), lhs, rhs)
    return out, vjp(dout)

  return fwd, fwd_bwd


def _megablox(tiles, interpret):
  def matmul(lhs, rhs, sizes):
    saved = accelerator.megablox_tiling
    accelerator.megablox_tiling = lambda m, k, n: tiles
    try:
      return accelerator.megablox_gmm(
          lhs, rhs, sizes, jnp.bfloat16, interpret=interpret
      )
    finally:
      accelerator.megablox_tiling = saved

  return matmul


def _ragged(lhs, rhs, sizes):
  return jax.lax.ragged_dot(
      lhs, rhs, sizes, preferred_element_type=jnp.bfloat16
  )


def bench_shape(spec: str, args) -> None:
  m, g, k, n = (int(x) for x in spec.split(","))
  rng = np.random.default_rng(0)
  sizes = jnp.asarray(rng.multinomial(m, np.full(g, 1 / g)), jnp.int32)
  lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(g, k, n)) / np.sqrt(k), jnp.bfloat16)
  dout = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
  read = _median_s(jax.jit(lambda w: jnp.sum(w, dtype=jnp.float32)), (rhs,), 5)
  chosen = accelerator.megablox_tiling(m, k, n)
  print(
      f"M={m} G={g} K={k} N={n}: reading the weights once"
      f" {read * 1e3:.3f} ms ({rhs.nbytes / read / 1e9:.0f} GB/s)"
  )
  print(f"  {'tiles':>16} {'fwd ms':>9} {'of read':>8} {'fwd+bwd ms':>11}")
  both = functools.reduce(np.gcd, (k, n))
  candidates = [("ragged_dot", _ragged)]
  for row in args.row_tiles:
    tm = min(row, -(-m // 8) * 8)
    for t in args.tiles:
      if both % t and t != 128:
        continue
      tiles = (tm, t, t)
      if ("megablox", tiles) not in [(c[0], c[2]) for c in candidates[1:]]:
        candidates.append(("megablox", _megablox(tiles, args.interpret), tiles))
  for entry in candidates:
    name, matmul = entry[0], entry[1]
    label = name if len(entry) == 2 else "x".join(map(str, entry[2]))
    mark = "*" if len(entry) == 3 and entry[2] == chosen else " "
    fwd, fwd_bwd = _calls(matmul)
    try:
      f = _median_s(fwd, (lhs, rhs, sizes), args.repeats)
      fb = (
          _median_s(fwd_bwd, (lhs, rhs, sizes, dout), args.repeats)
          if m > 64
          else float("nan")
      )
    except Exception as e:  # noqa: BLE001 (a tiling Mosaic refuses is a result)
      print(f" {mark}{label:>16}  {type(e).__name__}: {str(e)[:120]}")
      continue
    print(
        f" {mark}{label:>16} {f * 1e3:>9.3f} {read / f:>8.2f}"
        f" {fb * 1e3:>11.3f}",
        flush=True,
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
  parser.add_argument(
      "--row-tiles", type=int, nargs="+", default=[128, 256, 512]
  )
  parser.add_argument(
      "--tiles", type=int, nargs="+", default=[128, 256, 512, 1024]
  )
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument(
      "--interpret", action="store_true", help="Pallas interpret mode (CPU)"
  )
  args = parser.parse_args()
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, bf16")
  for spec in args.shapes:
    bench_shape(spec, args)


if __name__ == "__main__":
  main()
