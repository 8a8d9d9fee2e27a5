"""Causal self-attention of the reference decoders, with a KV cache.

Grouped-query attention (`num_kv_heads` key/value heads, each serving
`G = num_heads / num_kv_heads` consecutive query heads, as transformers'
`repeat_kv`), an explicit `head_dim`, optional per-head q/k RMSNorm before
the rotary embedding (Qwen3), and an optional sliding window (query i sees
key j iff 0 <= i - j < W, transformers' sliding causal mask). Softmax in
float32, probabilities cast back to the compute dtype before the values.

Shapes: B batch, S queries, T keys, M emb_dim, N query heads, K key/value
heads, G = N / K, D head_dim.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src import sharding
from linen_moe._src.config import ModelConfig
from linen_moe._src.models.norms import RMSNorm
from linen_moe._src.models.rotary import apply_rope
from linen_moe._src.variables import CACHE


class Projection(nn.Module):
  """`einsum(eqn, x, kernel)` with a named kernel: an `nn.DenseGeneral` whose
  kernel carries logical axis names (DenseGeneral initialises a flattened
  kernel, which a mesh cannot constrain with the kernel's names).

  Attributes:
    eqn: the einsum, e.g. "BSM,MND->BSND".
    shape: the kernel shape.
    names: its logical axis names.
    fan_in_axes: kernel axes the input contracts (for the init's fan-in).
    dtype: compute dtype.
    param_dtype: kernel dtype.
  """

  eqn: str
  shape: tuple[int, ...]
  names: tuple[str, ...]
  fan_in_axes: tuple[int, ...]
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    out_axes = tuple(
        i for i in range(len(self.shape)) if i not in self.fan_in_axes
    )
    init = nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", self.fan_in_axes, out_axes
    )  # lecun_normal over the contracted axes, as DenseGeneral's
    kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(init, self.names),
        self.shape,
        self.param_dtype,
    )
    return jnp.einsum(self.eqn, x.astype(self.dtype), kernel.astype(self.dtype))


def attention_mask(
    positions: jax.Array, key_positions: jax.Array, window: int
) -> jax.Array:
  """<bool>[B, S, T]: query at positions [B, S] sees the key at
  key_positions [B, T] iff 0 <= q - k (causal) and, with a window W > 0,
  q - k < W."""
  distance = positions[:, :, None] - key_positions[:, None, :]  # [B, S, T]
  visible = distance >= 0
  if window > 0:
    visible &= distance < window
  return visible


class CausalSelfAttention(nn.Module):
  """Causal self-attention with RoPE, and a KV cache in decode mode.

  Parameters: `query/kernel` [M, N, D], `key/kernel` and `value/kernel`
  [M, K, D], `out/kernel` [N, D, M]; with `qk_norm`, `query_norm/scale` and
  `key_norm/scale` [D].

  With `decode`, the keys and values live in the `cache` collection
  (`cached_key`, `cached_value`: [B, max_len, K, D], created by `init` on a
  [B, max_len] sample): a call writes its S new ones at positions[0, 0] ..
  + S - 1 (every row of the batch at the same positions) and attends over
  the whole cache, the mask (causal, and the sliding window) reading each
  slot's position. The parameters are the same in both modes.

  Attributes:
    config: the `ModelConfig`.
    decode: keep and extend a KV cache.
  """

  config: ModelConfig
  decode: bool = False

  def _cached(self, k: jax.Array, v: jax.Array, positions: jax.Array):
    """(keys, values, key positions [B, T]) after writing k, v to the cache."""
    initialized = self.has_variable(CACHE, "cached_key")
    cached_k = self.variable(CACHE, "cached_key", jnp.zeros, k.shape, k.dtype)
    cached_v = self.variable(CACHE, "cached_value", jnp.zeros, v.shape, v.dtype)
    if not initialized:  # init: the cache is shaped after the sample
      return k, v, positions
    start = (0, positions[0, 0], 0, 0)
    cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, start)
    cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, start)
    b, max_len = k.shape[0], cached_k.value.shape[1]
    key_positions = jnp.broadcast_to(jnp.arange(max_len), (b, max_len))
    return cached_k.value, cached_v.value, key_positions

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    cfg = self.config
    n, kv = cfg.num_heads, cfg.resolved_kv_heads
    d, m = cfg.resolved_head_dim, cfg.moe.emb_dim
    dt, pdt = cfg.moe.dtype, cfg.moe.param_dtype
    bsnd = sharding.BSM[:2] + ("activation_heads", "activation_kv")

    def project(name, heads):  # [B, S, M] -> [B, S, heads, D]
      p = Projection(
          "BSM,MND->BSND",
          (m, heads, d),
          ("embed", "heads", "kv"),
          (0,),
          dt,
          pdt,
          name=name,
      )
      return sharding.constrain(p(x), bsnd)

    q, k, v = project("query", n), project("key", kv), project("value", kv)
    if cfg.qk_norm:
      q = RMSNorm(cfg.norm_eps, name="query_norm")(q)
      k = RMSNorm(cfg.norm_eps, name="key_norm")(k)
    q = apply_rope(q, positions, cfg.rope_max_wavelength)
    k = apply_rope(k, positions, cfg.rope_max_wavelength)
    key_positions = positions
    if self.decode:
      k, v, key_positions = self._cached(k, v, positions)
    b, s = q.shape[:2]
    q = q.reshape(b, s, kv, n // kv, d)  # [B, S, K, G, D]
    logits = jnp.einsum("BSKGD,BTKD->BKGST", q, k).astype(jnp.float32)
    logits = logits * d**-0.5
    visible = attention_mask(positions, key_positions, cfg.sliding_window)
    logits = jnp.where(
        visible[:, None, None], logits, jnp.finfo(jnp.float32).min
    )
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    attended = jnp.einsum("BKGST,BTKD->BSKGD", probs, v).reshape(b, s, n, d)
    out = Projection(
        "BSND,NDM->BSM",
        (n, d, m),
        ("heads", "kv", "embed"),
        (0, 1),
        dt,
        pdt,
        name="out",
    )
    return out(attended)
