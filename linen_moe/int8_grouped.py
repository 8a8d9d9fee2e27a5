"""An int8 grouped matmul with per-expert weight scales. Knows nothing of MoE.

AQT has no grouped matmul we can train with (`aqt_ragged_dot` is forward-only
and shares one scale across all groups), so this is a small one that says
exactly what it quantizes:

  forward  out = (q(lhs) @ q(rhs[g])) * s_lhs * s_rhs[g]
           q(lhs) <int8>[M, K] with one scale per row, s_lhs [M, 1];
           q(rhs) <int8>[G, K, N] with one scale per group and output
           channel, s_rhs [G, 1, N]; int32 accumulation.
  dlhs     the same int8 grouped matmul of the cotangent [M, N] (one scale
           per row) with rhs^T [G, N, K] (one scale per group and column of
           rhs). This is AQT's `dlhs_bits=8`, but with round-to-nearest where
           AQT rounds the cotangent stochastically.
  drhs     float: the gradient of the float grouped matmul at the float
           operands (straight-through), like AQT's `drhs_bits=None`.

Quantization is symmetric absmax: scale = max|x| / 127, q = round(x / scale).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linen_moe import grouped_matmul as gmm_lib

INT8_MAX = 127.0


def quantize_int8(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """Symmetric absmax int8 along `axis`: (q <int8>, scale <float32>).

  `scale` has the shape of `x` with `axis` kept as 1; x ~= q * scale.
  """
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
  q = jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return q, scale


def _int8_forward(lhs, rhs, group_sizes, implementation):
  """[M, K] x [G, K, N] -> <float32>[M, N], both operands int8-quantized."""
  q_lhs, lhs_scale = quantize_int8(lhs, axis=1)  # [M, K], [M, 1]
  q_rhs, rhs_scale = quantize_int8(rhs, axis=1)  # [G, K, N], [G, 1, N]
  acc = gmm_lib.grouped_matmul(
      q_lhs,
      q_rhs,
      group_sizes,
      implementation=implementation,
      preferred_element_type=jnp.int32,
  )  # <int32>[M, N]
  num_groups = rhs.shape[0]
  # Rows past sum(group_sizes) get the last group's scale; their acc is 0.
  row_group = jnp.repeat(
      jnp.arange(num_groups),
      group_sizes,
      total_repeat_length=lhs.shape[0],
  )  # [M]
  return acc.astype(jnp.float32) * lhs_scale * rhs_scale[row_group, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def int8_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    implementation: str = "auto",
) -> jax.Array:
  """Int8 `grouped_matmul`: [M, K] x [G, K, N] -> [M, N] in the operands' dtype.

  See the module docstring for what is quantized in each direction.
  """
  out = _int8_forward(lhs, rhs, group_sizes, implementation)
  return out.astype(jnp.result_type(lhs, rhs))


def _fwd(lhs, rhs, group_sizes, implementation):
  out = int8_grouped_matmul(lhs, rhs, group_sizes, implementation)
  return out, (lhs, rhs, group_sizes)


def _bwd(implementation, residuals, g):
  lhs, rhs, group_sizes = residuals
  rhs_t = jnp.swapaxes(rhs, 1, 2)  # [G, N, K]
  dlhs = _int8_forward(g, rhs_t, group_sizes, implementation)
  _, rhs_vjp = jax.vjp(
      lambda r: gmm_lib.grouped_matmul(
          lhs, r, group_sizes, implementation=implementation
      ),
      rhs,
  )
  (drhs,) = rhs_vjp(g.astype(jnp.result_type(lhs, rhs)))
  return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


int8_grouped_matmul.defvjp(_fwd, _bwd)
