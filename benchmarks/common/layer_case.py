"""One case of the MoE layer benchmark: its shapes, its compiled
forward+backward, and its figures (step time, throughput, roofline fraction,
compile seconds).

`layer/bench_moe.py` runs each case in its own process (`--case`), so that
its peak memory (max RSS) is its own; `layer/profile_case.py`,
`layer/bench_ratios.py` and `device/device_run.py` build the same programs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

import linen_moe
from linen_moe.models import DecoderBlock

from common import timing

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
    path: a key of `linen_moe.MATMUL_PATHS`, or "roofline" for the plain dense
      matmul.
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


def model_config(case: Case) -> tuple[linen_moe.ModelConfig, tuple[int, ...]]:
  """(a one-layer `ModelConfig` of the case, its input shape (B, S, M))."""
  b, s, m, h, e, k = case.resolved_dims()
  path = dict(linen_moe.MATMUL_PATHS[case.path])
  if case.capacity_factor > 0:
    path["capacity_factor"] = case.capacity_factor
  moe = linen_moe.MoEConfig(
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
  return linen_moe.ModelConfig(moe=moe, num_layers=1, num_heads=heads), (
      b,
      s,
      m,
  )


def compiled_step(case: Case) -> tuple[Any, tuple[Any, ...], float]:
  """(compiled forward+backward, its arguments, compile seconds) of a case.

  The step returns the gradients of the parameters, the other variables and
  the input `x`.
  """
  cfg, (b, s, m) = model_config(case)
  x = jax.random.normal(jax.random.key(0), (b, s, m), jnp.dtype(case.dtype))
  if case.target == "layer":
    module = linen_moe.RoutedMoE(cfg.moe)
    args = (x,)
  else:
    module = DecoderBlock(cfg)
    args = (x, jnp.broadcast_to(jnp.arange(s), (b, s)))
  variables = jax.jit(module.init)(jax.random.key(1), *args)
  params = variables.pop("params")
  rngs = linen_moe.variables.rng_dict(jax.random.key(2))

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
    return timing.roofline(repeats)
  compiled, args, compile_s = compiled_step(case)
  b, s = case.resolved_dims()[:2]
  seconds, cpu = timing.median_times(compiled, args, repeats)
  # Measured right after the case, in the same process and under the same
  # machine load, so the ratio between the two is meaningful.
  roofline = timing.roofline(repeats)
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
