"""The decode expert matmul (`triton_decode`, unmeasured) from stored
serving weights with a serving layer's numbers: the few rows quantized as
its stored-kernel contraction (`quantization/stored_weights`) quantizes
them, `triton_decode.decode_matmul` on the int8 / float8 values, then the
rows' scale.

Apart from `triton_decode` because the int8 rows take AQT's quantizer
(`int8_grouped.quantize_int8`), whose module reaches the kernel registry,
which loads `triton_decode`.
"""

from __future__ import annotations

import functools

from flax.linen import fp8_ops
import jax
import jax.numpy as jnp

from linen_moe._src.kernels.gpu import triton_decode
from linen_moe._src.kernels.int8_grouped import quantize_int8

STORED_DTYPES = triton_decode.W_DTYPES[3:]  # int8, float8 e4m3fn / e5m2


def decode_matmul_stored(
    x: jax.Array,
    values: jax.Array,
    expert_ids: jax.Array,
    scale: jax.Array,
    input_scale: jax.Array | None = None,
    *,
    tiles: triton_decode.Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:
  """A serving layer's stored-kernel contraction (`stored_weights`), the
  decode kernel's way: the same numbers to float32 rounding (the order of
  the float32 accumulation and of the scales' products).

    int8    x quantized per row (AQT's int8, `quantize_int8(x, axis=1)`:
            q <int8>[T, K], s_x [T, 1]); out = (q @ values[e] * scale[e])
            * s_x. The int32 accumulation becomes float32 (exact while
            K * 127^2 < 2^24, K <= 1040; float32 rounding past it).
    float8  x quantized to values' type with `input_scale`
            (`fp8_ops.quantize`); out = (q @ values[e]) * scale *
            input_scale.

  Args:
    x: [T, K] float16, bfloat16 or float32.
    values: <int8>[E, K, N] or <float8_e4m3fn / e5m2>[E, K, N].
    expert_ids: <int>[T].
    scale: int8's <f32>[E, 1, N]; float8's <f32>[1].
    input_scale: float8's <f32>[1]; None for int8.
    tiles, interpret: `triton_decode.decode_matmul`'s.

  Returns:
    [T, N] in x's dtype.

  Raises:
    ValueError: values neither int8 nor float8, or `input_scale` given
      for int8 / missing for float8; and `triton_decode.decode_matmul`'s
      errors.
  """
  dtype = jnp.dtype(values.dtype)
  if dtype not in STORED_DTYPES:
    raise ValueError(
        f"values has dtype {dtype.name}; stored weights are "
        f"{', '.join(d.name for d in STORED_DTYPES)}."
    )
  if (dtype == jnp.int8) != (input_scale is None):
    raise ValueError(
        "input_scale is float8's (the scale its input is quantized with) "
        f"and int8 takes none; got values {dtype.name} with input_scale "
        f"{'None' if input_scale is None else input_scale.shape}."
    )
  run = functools.partial(
      triton_decode.decode_matmul, tiles=tiles, interpret=interpret
  )
  if dtype == jnp.int8:
    q, row_scale = quantize_int8(x, axis=1)  # [T, K], [T, 1]
    out = run(q.astype(x.dtype), values, expert_ids, scale, jnp.float32)
    return (out * row_scale).astype(x.dtype)
  q = fp8_ops.quantize(x, dtype, input_scale, x.dtype)
  out = run(q.astype(x.dtype), values, expert_ids, scale, jnp.float32)
  return (out * input_scale.astype(jnp.float32)).astype(x.dtype)
