"""Times the grouped matmul implementations against a dense-matmul roofline.

For each group-size pattern, times forward and forward+backward (out, dlhs,
drhs for a random cotangent) of "ragged_dot" and "blocked", and of a plain
[T, K] x [K, N] matmul with T = sum(group_sizes): the same useful FLOPs, the
roofline. Dense and blocked runs are interleaved (one of each per round, each
right after an untimed call of itself) so that load from other processes hits
them alike; "ragged_dot", ~10x slower and with G-times larger buffers that
would disturb the others, is timed in its own rounds. Medians are reported.

  python benchmarks/layer/bench_grouped_matmul.py
  python benchmarks/layer/bench_grouped_matmul.py --k 1024 --n 512
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

# The grouped matmul alone (and its slot and block sizes) has no public name:
# the layer reaches it through `MoEConfig.grouped_matmul`, on the group sizes
# its routing makes; this times it on group sizes set here.
from linen_moe._src.kernels import blocked  # noqa: TID251
from linen_moe._src.kernels import grouped_matmul as gmm_lib  # noqa: TID251


def group_sizes_for(pattern: str, m: int, g: int, seed: int) -> np.ndarray:
  """<int32>[G] summing to M: "balanced" (uniform routing) or "skewed"."""
  rng = np.random.default_rng(seed)
  if pattern == "balanced":
    probs = np.full(g, 1.0 / g)
  elif pattern == "skewed":  # Zipf-like: group i gets weight 1 / (i + 1)
    probs = 1.0 / np.arange(1, g + 1)
    probs = rng.permutation(probs / probs.sum())
  else:
    raise ValueError(f"unknown pattern {pattern!r}")
  return rng.multinomial(m, probs).astype(np.int32)


def fwd_and_fwd_bwd(matmul):
  """Jitted forward, and forward+backward returning (out, dlhs, drhs)."""

  def fwd_bwd(lhs, rhs, dout):
    out, vjp = jax.vjp(matmul, lhs, rhs)
    return (out, *vjp(dout))

  return jax.jit(matmul), jax.jit(fwd_bwd)


def time_interleaved(calls: dict, rounds: int, warmup: int) -> dict:
  """{name: median seconds} over `rounds` interleaved rounds."""
  for call in calls.values():
    for _ in range(warmup):
      jax.block_until_ready(call())
  times = {name: [] for name in calls}
  for _ in range(rounds):
    for name, call in calls.items():
      jax.block_until_ready(call())  # the previous candidate's memory churn
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def bench_pattern(args, pattern: str) -> None:
  m, k, n, g = args.m, args.k, args.n, args.g
  dtype = jnp.dtype(args.dtype)
  sizes = group_sizes_for(pattern, m, g, args.seed)
  useful_rows = int(sizes.sum())
  keys = jax.random.split(jax.random.key(args.seed), 4)
  lhs = jax.random.normal(keys[0], (m, k), dtype)
  rhs = jax.random.normal(keys[1], (g, k, n), dtype)
  dout = jax.random.normal(keys[2], (m, n), dtype)
  group_sizes = jnp.asarray(sizes)

  def grouped(impl):
    return lambda x, w: gmm_lib.grouped_matmul(
        x, w, group_sizes, implementation=impl
    )

  # The roofline: the same useful rows through one dense matmul.
  candidates = {
      "dense": (
          lambda x, w: x @ w,
          (lhs[:useful_rows], rhs[0], dout[:useful_rows]),
      ),
      "blocked": (grouped("blocked"), (lhs, rhs, dout)),
      "ragged_dot": (grouped("ragged_dot"), (lhs, rhs, dout)),
  }
  calls = {}
  for name, (matmul, (x, w, dy)) in candidates.items():
    fwd, fwd_bwd = fwd_and_fwd_bwd(matmul)
    calls[f"{name} fwd"] = lambda f=fwd, x=x, w=w: f(x, w)
    calls[f"{name} fwd+bwd"] = lambda f=fwd_bwd, x=x, w=w, dy=dy: f(x, w, dy)
  slow = {name: calls.pop(name) for name in list(calls) if "ragged" in name}
  times = time_interleaved(calls, args.rounds, args.warmup)
  times |= time_interleaved(slow, args.slow_rounds, args.warmup)

  flops_fwd = 2 * useful_rows * k * n
  print(
      f"\n{pattern}: M={m} K={k} N={n} G={g} {dtype.name}, "
      f"slot rows {blocked.slot_rows(m, g)}, overflow block rows "
      f"{blocked.block_rows(m, g)}, group sizes {sizes.tolist()}"
  )
  print(f"{'':22s}{'ms':>9s}{'GFLOP/s':>10s}")
  for name, t in times.items():
    flops = flops_fwd * (3 if name.endswith("fwd+bwd") else 1)
    print(f"{name:22s}{t * 1e3:9.1f}{flops / t / 1e9:10.1f}")
  for part in ("fwd", "fwd+bwd"):
    blocked_s = times[f"blocked {part}"]
    print(
        f"{part:8s} blocked / dense roofline = "
        f"{times[f'dense {part}'] / blocked_s:5.2f}   blocked / ragged_dot = "
        f"{times[f'ragged_dot {part}'] / blocked_s:5.2f}x"
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--m", type=int, default=8192, help="rows (tokens*k)")
  parser.add_argument("--k", type=int, default=512)
  parser.add_argument("--n", type=int, default=1024)
  parser.add_argument("--g", type=int, default=8, help="groups (experts)")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--patterns", nargs="+", default=["balanced", "skewed"])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument(
      "--slow_rounds", type=int, default=3, help="rounds for ragged_dot"
  )
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}")
  for pattern in args.patterns:
    bench_pattern(args, pattern)


if __name__ == "__main__":
  main()
