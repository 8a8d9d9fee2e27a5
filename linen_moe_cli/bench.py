"""Benchmarks of the MoE layer: step time, throughput, roofline, compile, memory.

Each case runs in its own subprocess so that its peak memory (max RSS) is its
own. All cases of one run are measured side by side on the same machine, with
the dense-matmul roofline measured in the same run, so ratios are meaningful
even on a shared, noisy machine. Timings live here, never in unit tests.

Run: `linen-moe bench` (or `python benchmarks/bench_moe.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

from linen_moe._src.config.moe_config import MATMUL_PATHS as PATHS

# name -> (batch, seq, emb_dim, moe_mlp_dim, num_experts, top_k)
SIZES = {
    "tiny": (8, 32, 64, 128, 8, 2),
    "small": (4, 128, 256, 512, 8, 2),
    "medium": (8, 512, 512, 1024, 8, 2),
    "gemma_like": (8, 512, 512, 128, 128, 8),
}


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark case.

  Attributes:
    size: a key of SIZES (or "custom" with explicit dims).
    path: a key of PATHS, or "roofline" for the plain dense matmul.
    quantization: MoEConfig.quantization.
    target: "layer" (RoutedMoE) or "decoder_layer" (one DecoderBlock).
    implementation: grouped matmul implementation of the sparse path.
    dims: (batch, seq, emb, mlp, experts, top_k).
    capacity_factor: overrides the path's capacity factor when > 0.
    dtype: compute and weight dtype.
  """

  size: str
  path: str
  quantization: str = "none"
  target: str = "layer"
  implementation: str = "auto"
  dims: tuple[int, ...] = ()
  capacity_factor: float = 0.0
  dtype: str = "float32"

  def resolved_dims(self) -> tuple[int, ...]:
    return self.dims or SIZES[self.size]

  def useful_flops(self) -> float:
    """FLOPs of one forward+backward counting only the active experts
    (3 matmuls of M x H per routed assignment; backward = 2 x forward), plus
    attention projections and scores for a decoder layer."""
    b, s, m, h, _, k = self.resolved_dims()
    tokens = b * s
    flops = 3 * (2 * tokens * k * 3 * m * h)
    if self.target == "decoder_layer":
      flops += 3 * (2 * tokens * 4 * m * m + 2 * 2 * b * s * s * m)
    return float(flops)


def _model_config(case: Case):
  from linen_moe._src.config.model_config import ModelConfig  # noqa: PLC0415
  from linen_moe._src.config.moe_config import MoEConfig  # noqa: PLC0415

  b, s, m, h, e, k = case.resolved_dims()
  path = dict(PATHS[case.path])
  if case.capacity_factor > 0:
    path["capacity_factor"] = case.capacity_factor
  moe = MoEConfig(
      num_experts=e,
      num_experts_per_tok=k,
      emb_dim=m,
      moe_mlp_dim=h,
      quantization=case.quantization,
      grouped_matmul=case.implementation,
      dtype=case.dtype,
      param_dtype=case.dtype,
      load_balance_loss_weight=0.01,
      **path,
  )
  heads = max(1, m // 64)
  return ModelConfig(moe=moe, num_layers=1, num_heads=heads), (b, s, m)


def _time(fn, args, repeats: int) -> tuple[float, float]:
  """Median wall and CPU seconds (all threads of this process) of one call.

  On a shared machine, wall time grows with the load of other processes; CPU
  time much less, so it is the steadier measure of the work a step does.
  """
  import jax  # noqa: PLC0415

  jax.block_until_ready(fn(*args))
  wall, cpu = zip(*(time_call(fn, args) for _ in range(repeats)), strict=True)
  return sorted(wall)[len(wall) // 2], sorted(cpu)[len(cpu) // 2]


def time_call(fn, args) -> tuple[float, float]:
  """Wall and CPU seconds (all threads of this process) of one call, run to
  completion."""
  import jax  # noqa: PLC0415

  start, start_cpu = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, time.process_time() - start_cpu


ROOFLINE_SHAPE = (8192, 512, 1024)  # [M, K] x [K, N], float32


def roofline_step(shape: tuple[int, int, int] = ROOFLINE_SHAPE):
  """(jitted forward+backward of a plain float32 matmul, its arguments).

  The loss is half the sum of squares of `x @ w`, so its cotangent is the
  product itself: all three matmuls (forward, input and weight gradients)
  run. (A plain sum would let XLA drop the forward product and count flops
  it never ran.)
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  m, k, n = shape
  x = jax.random.normal(jax.random.key(0), (m, k))
  w = jax.random.normal(jax.random.key(1), (k, n))

  def loss(x, w):
    return 0.5 * jnp.sum(jnp.square(jnp.dot(x, w)))

  return jax.jit(jax.grad(loss, argnums=(0, 1))), (x, w)


def _roofline(repeats: int) -> dict[str, float]:
  """GFLOP/s of a plain float32 matmul, forward+backward, of medium shape,
  per wall second and per CPU second."""
  step, args = roofline_step()
  seconds, cpu = _time(step, args, repeats)
  m, k, n = ROOFLINE_SHAPE
  flops = 3 * 2 * m * k * n
  return {
      "step_s": seconds,
      "cpu_s": cpu,
      "gflops": flops / seconds / 1e9,
      "cpu_gflops": flops / cpu / 1e9,
  }


def compiled_step(case: Case) -> tuple[Any, tuple[Any, ...], float]:
  """(compiled forward+backward, its arguments, compile seconds) of a case.

  The step returns the gradients of the parameters, the other variables and
  the input `x`.
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from linen_moe._src.layer.moe import RoutedMoE  # noqa: PLC0415
  from linen_moe._src.layer.variables import AQT_RNG_STREAM  # noqa: PLC0415
  from linen_moe._src.models.decoder import DecoderBlock  # noqa: PLC0415

  cfg, (b, s, m) = _model_config(case)
  x = jax.random.normal(jax.random.key(0), (b, s, m), jnp.dtype(case.dtype))
  if case.target == "layer":
    module = RoutedMoE(cfg.moe)
    args = (x,)
  else:
    module = DecoderBlock(cfg)
    args = (x, jnp.broadcast_to(jnp.arange(s), (b, s)))
  variables = jax.jit(module.init)(jax.random.key(1), *args)
  params = variables.pop("params")
  rngs = {AQT_RNG_STREAM: jax.random.key(2)}

  def loss(params, others, *args):
    out, aux = module.apply({"params": params, **others}, *args, rngs=rngs)
    lb = (
        aux["load_balance_loss"]
        if isinstance(aux, dict)
        else aux.load_balance_loss
    )
    return jnp.mean(jnp.square(out.astype(jnp.float32))) + lb

  # The input's gradient too, as a layer inside a model needs it: without
  # it XLA drops the input-gradient matmuls of the first expert projections.
  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  start = time.perf_counter()
  compiled = step.lower(params, variables, *args).compile()
  return compiled, (params, variables, *args), time.perf_counter() - start


def run_case(case: Case, repeats: int = 5) -> dict[str, Any]:
  """Compiles and times one forward+backward of the case, in this process."""
  if case.path == "roofline":
    return _roofline(repeats)
  compiled, args, compile_s = compiled_step(case)
  b, s = case.resolved_dims()[:2]
  seconds, cpu = _time(compiled, args, repeats)
  # Measured right after the case, in the same process and under the same
  # machine load, so the ratio between the two is meaningful.
  roofline = _roofline(repeats)
  return {
      "step_s": seconds,
      "cpu_s": cpu,
      "compile_s": compile_s,
      "tokens_per_s": b * s / seconds,
      "useful_gflops": case.useful_flops() / seconds / 1e9,
      "roofline_gflops": roofline["gflops"],
      # The same ratio in CPU seconds: steadier on a loaded machine.
      "cpu_roofline_fraction": (
          case.useful_flops() / cpu / 1e9 / roofline["cpu_gflops"]
      ),
  }


def _max_rss_mib() -> float:
  import resource  # noqa: PLC0415

  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case_subprocess(
    case: Case, repeats: int, timeout: float = 900
) -> dict[str, Any]:
  """Runs `run_case` in a fresh Python; adds its peak RSS (MiB)."""
  cmd = [
      sys.executable,
      "-m",
      "linen_moe_cli.bench",
      "--case",
      json.dumps(dataclasses.asdict(case)),
      "--repeats",
      str(repeats),
  ]
  try:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False
    )
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f}s"}
  if proc.returncode != 0:
    tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
    return {"error": tail[0][:300]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _case_main(argv: list[str]) -> int:
  import argparse  # noqa: PLC0415

  p = argparse.ArgumentParser()
  p.add_argument("--case", required=True)
  p.add_argument("--repeats", type=int, default=5)
  a = p.parse_args(argv)
  fields = json.loads(a.case)
  fields["dims"] = tuple(fields.get("dims") or ())
  result = run_case(Case(**fields), a.repeats)
  result["max_rss_mib"] = _max_rss_mib()
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  sys.exit(_case_main(sys.argv[1:]))
