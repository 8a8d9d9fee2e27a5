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

Quantization is AQT's symmetric absmax int8 (`aqt_quantizer.quantizer_make(8)`,
the numerics of the einsum path's `AqtEinsum`): scale = max|x| / 127.5,
q = round_half_even(clip(x * (1 / scale), -127, 127)), so both paths put the
same weights on the same int8 grid (and serving stores that grid, see
`linen_moe.quantization`).

`int8_grouped_matmul_stored` is the forward from an already quantized rhs
(int8 values and their [G, 1, N] scales): the serving path.

Where `implementation` runs the Pallas kernels ("kernel" on a TPU, and
"auto" there at training sizes), the forward and dlhs contractions run the
Pallas int8 grouped matmul (`accelerator.int8_kernel`): int8 operands into
the MXU, int32 accumulation, the scales applied in its epilogue, the same
numbers bit for bit; elsewhere they run `grouped_matmul` on int8 operands
(int32 output) and scale the result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.kernels import accelerator
from linen_moe._src.kernels import grouped_matmul as gmm_lib

INT8_MAX = 127.0
# AQT's int8 scale maps max|x| to the far edge of the last bucket (127.5);
# values are clipped to +-127 before rounding (`IntSymmetric`, preserve_zero
# and not preserve_max_val).
INT8_BOUND = 127.5


def quantize_int8(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """AQT's symmetric absmax int8 along `axis`: (q <int8>, scale <float32>).

  `scale` has the shape of `x` with `axis` kept as 1; x ~= q * scale. Equal,
  bit for bit, to AQT's quantizer calibrated over `axis` (tested).
  """
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  scale = jnp.where(amax == 0, 1.0, amax) / INT8_BOUND
  scaled = x * jax.lax.reciprocal(scale)
  q = jnp.round(jnp.clip(scaled, -INT8_MAX, INT8_MAX)).astype(jnp.int8)
  return q, scale


def as_float32(x: np.ndarray) -> np.ndarray:
  """x in float32 on the host; bfloat16 by widening its bits (exact, and
  several times faster than ml_dtypes' cast)."""
  if x.dtype == jnp.bfloat16:
    wide = x.view(np.uint16).astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)
  return np.asarray(x, np.float32)


def quantize_int8_host(
    x: np.ndarray, axis: int
) -> tuple[np.ndarray, np.ndarray]:
  """`quantize_int8` in NumPy, bit for bit (tested through the checkpoint
  loaders, which quantize on the host as they read without building an XLA
  program per shape)."""
  x = as_float32(x)  # NumPy's half-precision math is slow
  amax = np.maximum(
      np.max(x, axis=axis, keepdims=True), -np.min(x, axis=axis, keepdims=True)
  )
  # XLA divides by the constant bound as a multiply by its float32 inverse.
  inverse_bound = np.float32(1 / INT8_BOUND)
  scale = np.where(amax == 0, np.float32(1), amax) * inverse_bound
  scaled = x * (np.float32(1) / scale)
  np.clip(scaled, -INT8_MAX, INT8_MAX, out=scaled)
  np.rint(scaled, out=scaled)  # half to even, as jnp.round
  return scaled.astype(np.int8), scale


def _int8_forward(lhs, rhs, group_sizes, implementation, bound=None):
  """[M, K] x [G, K, N] -> <float32>[M, N], both operands int8-quantized.
  `bound`: `grouped_matmul`'s `max_group_size`."""
  q_rhs, rhs_scale = quantize_int8(rhs, axis=1)  # [G, K, N], [G, 1, N]
  return _int8_forward_stored(
      lhs, q_rhs, rhs_scale, group_sizes, implementation, bound
  )


def _int8_forward_stored(
    lhs, q_rhs, rhs_scale, group_sizes, implementation, bound=None
):
  """[M, K] x <int8>[G, K, N] (scales [G, 1, N]) -> <float32>[M, N]."""
  q_lhs, lhs_scale = quantize_int8(lhs, axis=1)  # [M, K], [M, 1]
  kernel = accelerator.int8_kernel(implementation, lhs.shape[0])
  if kernel is not None:  # int8 into the MXU, scales in its epilogue
    return kernel(q_lhs, lhs_scale, q_rhs, rhs_scale, group_sizes)
  acc = gmm_lib.grouped_matmul(
      q_lhs,
      q_rhs,
      group_sizes,
      implementation=implementation,
      preferred_element_type=jnp.int32,
      max_group_size=bound,
  )  # <int32>[M, N]
  num_groups = q_rhs.shape[0]
  # Rows past sum(group_sizes) get the last group's scale; their acc is 0.
  row_group = jnp.repeat(
      jnp.arange(num_groups),
      group_sizes,
      total_repeat_length=lhs.shape[0],
  )  # [M]
  return acc.astype(jnp.float32) * lhs_scale * rhs_scale[row_group, 0]


def int8_grouped_matmul_stored(
    lhs: jax.Array,
    q_rhs: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    implementation: str = "auto",
    max_group_size: int | None = None,
) -> jax.Array:
  """Forward of `int8_grouped_matmul` from a stored, already quantized rhs.

  lhs [M, K] float (quantized here, one scale per row); q_rhs <int8>[G, K, N]
  and rhs_scale <float32>[G, 1, N], as `quantize_int8(rhs, axis=1)` returns
  them. Returns [M, N] in lhs's dtype. The int8 weights go straight into the
  grouped matmul (int32 accumulation); no float copy of them is made.
  """
  if q_rhs.dtype != jnp.int8:
    raise TypeError(f"q_rhs must be int8; got {q_rhs.dtype}.")
  g, _, n = q_rhs.shape
  if rhs_scale.shape != (g, 1, n):
    raise ValueError(
        f"rhs_scale must have shape [G, 1, N]={(g, 1, n)}; got "
        f"{rhs_scale.shape}."
    )
  out = _int8_forward_stored(
      lhs, q_rhs, rhs_scale, group_sizes, implementation, max_group_size
  )
  return out.astype(lhs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def int8_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    implementation: str = "auto",
    max_group_size: int | None = None,
) -> jax.Array:
  """Int8 `grouped_matmul`: [M, K] x [G, K, N] -> [M, N] in the operands' dtype.

  See the module docstring for what is quantized in each direction;
  `max_group_size` is `grouped_matmul`'s.
  """
  out = _int8_forward(lhs, rhs, group_sizes, implementation, max_group_size)
  return out.astype(jnp.result_type(lhs, rhs))


def _fwd(lhs, rhs, group_sizes, implementation, bound):
  out = int8_grouped_matmul(lhs, rhs, group_sizes, implementation, bound)
  return out, (lhs, rhs, group_sizes)


def _bwd(implementation, bound, residuals, g):
  lhs, rhs, group_sizes = residuals
  kernel = accelerator.int8_kernel(implementation, lhs.shape[0])
  if kernel is not None:
    # rhs quantized along N is rhs^T quantized along its first axis, bit for
    # bit; the kernel contracts it transposed, so no [G, N, K] copy is made.
    q_rhs, rhs_scale = quantize_int8(rhs, axis=2)  # [G, K, N], [G, K, 1]
    q_g, g_scale = quantize_int8(g, axis=1)  # [M, N], [M, 1]
    dlhs = kernel(
        q_g,
        g_scale,
        q_rhs,
        jnp.swapaxes(rhs_scale, 1, 2),
        group_sizes,
        transpose_rhs=True,
    )
  else:
    rhs_t = jnp.swapaxes(rhs, 1, 2)  # [G, N, K]
    dlhs = _int8_forward(g, rhs_t, group_sizes, implementation, bound)
  _, rhs_vjp = jax.vjp(
      lambda r: gmm_lib.grouped_matmul(
          lhs,
          r,
          group_sizes,
          implementation=implementation,
          max_group_size=bound,
      ),
      rhs,
  )
  (drhs,) = rhs_vjp(g.astype(jnp.result_type(lhs, rhs)))
  return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


int8_grouped_matmul.defvjp(_fwd, _bwd)
