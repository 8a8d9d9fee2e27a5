"""Times the decode expert matmul (`triton_decode`, unmeasured) against the
weight-read limit, beside the grouped-matmul routes at the same sizes.

One projection of a decode step, in each of L layers (one call runs them
all, as a step does, so that what is timed is not the launch and the
weights are not in L2): B tokens' top-k choices, T = B * k rows, each
times its expert's [K, N] weight. What a step must read is the
weights of the distinct routed experts, U of them a layer: U * K * N bytes
(plus int8's U * N * 4 scale bytes, float8's 8). The *weight-read
limit* is those bytes over the device's measured copy bandwidth (a jitted
`a + 1` over a large array: 2 x its bytes a call, read and written);
`fraction_of_limit` = limit seconds / measured seconds, each route against
the limit of the weights it reads (issue 63's bar for the whole decode
step: >= 0.80 at batch 1 and 8).

Routes, medians of alternating rounds:

  decode        `triton_decode.decode_matmul` in the weights' type (int8
                and float8 through `decode_matmul_stored`, the serving
                layer's numbers: the rows quantized first).
  triton_gmm    the grouped matmul route: rows sorted by expert (the sort
                timed with it), our Pallas-Triton grouped matmul's forward
                over all E groups, in bfloat16.
  ragged_dot    the same with `jax.lax.ragged_dot` as XLA lowers it.

  python benchmarks/gpu/bench_triton_decode.py --out DIR         # a GPU
  python benchmarks/gpu/bench_triton_decode.py --cpu-dry-run --out DIR

`--cpu-dry-run`: tiny shapes, the Pallas kernels in interpret mode, one
round: the same code path, no meaningful time. Writes
DIR/bench_triton_decode.json. From Python: `time_decode(...)`.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import gpu_timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# The kernels have no public name (the layer reaches them through the
# kernel registry); this times them alone, on routing set here.
from linen_moe._src.kernels.gpu import decode_stored  # noqa: TID251
from linen_moe._src.kernels.gpu import triton_decode  # noqa: TID251
from linen_moe._src.kernels.gpu import triton_grouped  # noqa: TID251

# name: (E, K, N, top-k, layers): a Qwen3-30B-A3B expert's gate projection
# (128 of 2048 x 768, top-8) and a Mixtral-8x7B one's (8 of 4096 x 14336,
# top-2), over enough layers that a call's routed weights (at batch 1: 16
# x 25 MB, 4 x 235 MB in bfloat16) are several times the H200's 50 MB L2.
SHAPES = {
    "qwen3_30b_a3b": (128, 2048, 768, 8, 16),
    "mixtral_8x7b": (8, 4096, 14336, 2, 4),
}
DRY_SHAPES = {"dry": (6, 40, 24, 2, 2)}
BATCHES = (1, 8)
WEIGHTS = ("bfloat16", "int8", "float8_e4m3fn")
COPY_BYTES, DRY_COPY_BYTES = 1 << 30, 1 << 20


def routing(
    batch: int, top_k: int, num_experts: int, layers: int = 1, seed: int = 0
):
  """<int32>[L, B, k]: per layer each token's k distinct experts,
  uniformly drawn."""
  rng = np.random.default_rng(seed)
  draw = lambda: rng.choice(num_experts, top_k, replace=False)  # noqa: E731
  return np.asarray(
      [[draw() for _ in range(batch)] for _ in range(layers)], np.int32
  )


def weight_bytes(ids, k: int, n: int, w_dtype: str) -> int:
  """Bytes of the distinct routed experts' [K, N] weights and their
  scales, summed over layers (ids <int>[L, B, k]): int8's [N] float32 per
  expert, float8's two float32 scalars a layer (its scale and input
  scale, one a tensor)."""
  ids = np.asarray(ids)
  layers = ids.shape[0]
  distinct = sum(np.unique(layer).size for layer in ids)
  values = distinct * k * n * jnp.dtype(w_dtype).itemsize
  if w_dtype == "int8":
    return values + distinct * n * 4
  return values + (8 * layers if w_dtype == "float8_e4m3fn" else 0)


# {name: median seconds} of {name: (call, args)}; tests replace it.
_alternating = gpu_timing.call_medians


def copy_bandwidth(nbytes: int = COPY_BYTES, rounds: int = 5) -> float:
  """Bytes per second of a device copy: a jitted `a + 1` over `nbytes` of
  bfloat16 reads and writes 2 * nbytes a call."""
  a = jnp.zeros((nbytes // 2,), jnp.bfloat16)
  call = jax.jit(lambda v: v + 1)
  seconds = _alternating({"copy": (call, (a,))}, rounds, 1)["copy"]
  return 2 * nbytes / seconds


def _weights(e, k, n, w_dtype, seed=1):
  key = jax.random.key(seed)
  w = jax.random.normal(key, (e, k, n), jnp.float32)
  if w_dtype == "int8":
    values = jnp.clip(jnp.round(w * 40), -127, 127).astype(jnp.int8)
    return values, jnp.full((e, 1, n), 1 / 40, jnp.float32)
  if w_dtype == "float8_e4m3fn":
    return w.astype(jnp.float8_e4m3fn), jnp.ones((1,), jnp.float32)
  return w.astype(jnp.dtype(w_dtype)), None


def _decode(x, w, ids, scale, *, interpret):
  """The decode route: bfloat16 weights as they are; int8 and float8 as a
  serving layer reads them (`decode_matmul_stored`: its input quantized)."""
  if scale is None:
    return triton_decode.decode_matmul(x, w, ids, interpret=interpret)
  input_scale = None if w.dtype == jnp.int8 else jnp.ones((1,), jnp.float32)
  return decode_stored.decode_matmul_stored(
      x, w, ids, scale, input_scale, interpret=interpret
  )


def _grouped(matmul, num_experts):
  """The grouped-matmul route: sort the rows by expert, multiply, unsort."""

  def run(x, w, ids, scale):
    del scale  # bfloat16 weights
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=num_experts).astype(jnp.int32)
    out = matmul(x[order], w, sizes)
    return jnp.zeros_like(out).at[order].set(out)

  return run


def _layers(route):
  """One jitted call of `route` over the layers, each its own weights and
  routing, unrolled (no layer's weights sliced out of a stack, which XLA
  may copy), the outputs summed."""

  def run(x, ws, ids, scales):
    outs = [route(x, *a) for a in zip(ws, ids, scales, strict=True)]
    return sum(o.astype(jnp.float32) for o in outs)

  return jax.jit(run)


def time_decode(
    e: int,
    k: int,
    n: int,
    top_k: int,
    batch: int,
    layers: int = 1,
    *,
    w_dtype: str = "bfloat16",
    bandwidth: float | None = None,
    ids=None,
    rounds: int = 5,
    warmup: int = 1,
    interpret: bool = False,
) -> dict:
  """One projection at batch `batch` of top-`top_k` in each of `layers`
  layers (a call: all of them, as a decode step), each route timed.

  Args:
    e, k, n, top_k: E experts of [K, N], top-k routing.
    batch: tokens B (T = B * top_k rows).
    layers: L, each with its own weights and routing.
    w_dtype: the decode kernel's weight type (the grouped routes run
      bfloat16 weights).
    bandwidth: copy bytes per second (default `copy_bandwidth()`).
    ids: <int>[L, B, top_k] routing (default `routing(batch, top_k, e,
      layers)`).
    rounds, warmup: of `_alternating`.
    interpret: Pallas interpret mode (`--cpu-dry-run`).

  Returns:
    {"e", "k", "n", "top_k", "batch", "layers", "w_dtype",
    "distinct_experts" (summed over layers),
    "weight_bytes" and "limit_s" (the decode route's: its weights' bytes,
    those over the bandwidth), "copy_bytes_per_s", "seconds": {route},
    "bytes_per_s": {route: its weight bytes / its seconds},
    "fraction_of_limit": {route: bytes_per_s / copy_bytes_per_s},
    "decode_speedup": {route: its seconds / decode's}, "interpret", the
    device}. The grouped routes read bfloat16 weights: their bytes and
    limit are bfloat16's.
  """
  ids = routing(batch, top_k, e, layers) if ids is None else np.asarray(ids)
  if ids.shape != (layers, batch, top_k):
    raise ValueError(
        f"ids must have shape [L, B, k]={(layers, batch, top_k)}; got "
        f"{ids.shape}."
    )
  bandwidth = copy_bandwidth() if bandwidth is None else bandwidth
  flat = tuple(jnp.asarray(i.reshape(-1), jnp.int32) for i in ids)
  x = jax.random.normal(jax.random.key(2), (batch * top_k, k), jnp.bfloat16)
  ws, scales = zip(
      *(_weights(e, k, n, w_dtype, seed=1 + i) for i in range(layers)),
      strict=True,
  )
  w16 = tuple(_weights(e, k, n, "bfloat16", 1 + i)[0] for i in range(layers))
  none = (None,) * layers
  triton_gmm = functools.partial(
      triton_grouped.triton_grouped_matmul, interpret=interpret
  )
  calls = {
      "decode": (
          _layers(functools.partial(_decode, interpret=interpret)),
          (x, ws, flat, scales),
      ),
      "triton_gmm": (_layers(_grouped(triton_gmm, e)), (x, w16, flat, none)),
      "ragged_dot": (
          _layers(_grouped(jax.lax.ragged_dot, e)),
          (x, w16, flat, none),
      ),
  }
  seconds = _alternating(calls, rounds, warmup)
  route_bytes = {
      "decode": weight_bytes(ids, k, n, w_dtype),
      "triton_gmm": weight_bytes(ids, k, n, "bfloat16"),
      "ragged_dot": weight_bytes(ids, k, n, "bfloat16"),
  }
  limit_s = route_bytes["decode"] / bandwidth
  return {
      "e": e,
      "k": k,
      "n": n,
      "top_k": top_k,
      "batch": batch,
      "layers": layers,
      "w_dtype": w_dtype,
      "distinct_experts": sum(np.unique(layer).size for layer in ids),
      "weight_bytes": route_bytes["decode"],
      "copy_bytes_per_s": bandwidth,
      "limit_s": limit_s,
      "seconds": seconds,
      "fraction_of_limit": {
          r: route_bytes[r] / bandwidth / s for r, s in seconds.items()
      },
      "bytes_per_s": {r: route_bytes[r] / s for r, s in seconds.items()},
      "decode_speedup": {r: s / seconds["decode"] for r, s in seconds.items()},
      "interpret": interpret,
      **gpu_timing.device_fields(),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--cpu-dry-run", action="store_true")
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args(argv)
  dry = args.cpu_dry_run
  shapes = DRY_SHAPES if dry else SHAPES
  rounds = 1 if dry else args.rounds
  bandwidth = copy_bandwidth(DRY_COPY_BYTES if dry else COPY_BYTES, rounds)
  print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
  record = {"copy_bytes_per_s": bandwidth, "timings": []}
  for name, (e, k, n, top_k, layers) in shapes.items():
    for batch in BATCHES:
      for w_dtype in WEIGHTS:
        r = time_decode(
            e, k, n, top_k, batch, layers, w_dtype=w_dtype,
            bandwidth=bandwidth,
            rounds=rounds, warmup=0 if dry else 1, interpret=dry,
        )  # fmt: skip
        record["timings"].append({"shape": name, **r})
        fractions = ", ".join(
            f"{route} {f:.3f}" for route, f in r["fraction_of_limit"].items()
        )
        print(
            f"{name} B={batch} {w_dtype}: {r['distinct_experts']} experts,"
            f" {r['weight_bytes'] / 1e6:.2f} MB, limit"
            f" {r['limit_s'] * 1e6:.1f} us; fraction of limit: {fractions}"
        )
  if args.out:
    path = gpu_timing.write_json(args.out, "bench_triton_decode.json", record)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
