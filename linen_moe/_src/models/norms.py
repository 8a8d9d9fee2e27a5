"""RMSNorm as Mixtral, Qwen3-MoE and DeepSeek-V3 compute it (Gemma-4's is
the same sum; it multiplies by the scale in float32 before the cast back,
which only a bf16 model can tell apart).

`x / rms(x)` in float32, cast back to the input dtype, then times a learned
`scale` initialised to 1 (transformers' `MixtralRMSNorm`: the cast comes
before the weight multiply).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp


def _rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  scale = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (x32 * scale).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) over the last axis, computed in float32, in x's dtype.

  Its backward keeps only `x` and recomputes the float32 steps from it
  (the same operations, so the same numbers): differentiated as written,
  the norm would keep float32 `x` and the broadcast 1 / rms(x), each
  [..., width], for the backward, four times a bfloat16 `x` (at
  Qwen3-30B-A3B's shape, S = 8192, about 0.6 GB a layer over its four
  norms).
  """
  return _rms_normalize(x, eps)


def _rms_normalize_fwd(x, eps):
  return _rms_normalize(x, eps), x


def _rms_normalize_bwd(eps, x, g):
  # The barrier keeps XLA from merging this recompute with the forward's
  # (which would keep the float32 values alive until here after all).
  x = jax.lax.optimization_barrier(x)
  return jax.vjp(lambda v: _rms_normalize(v, eps), x)[1](g)


rms_normalize.defvjp(_rms_normalize_fwd, _rms_normalize_bwd)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis with a learned `scale` [width], init 1.

  Attributes:
    eps: added to the mean square.
  """

  eps: float = 1e-6

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Normalizes `x` [..., width] and scales it.

    Args:
      x: the input, normalized over its last axis (in float32).

    Returns:
      `x / rms(x) * scale`, in x's dtype.
    """
    scale = self.param(
        "scale",
        nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        (x.shape[-1],),
    )
    return rms_normalize(x, self.eps) * scale.astype(x.dtype)
