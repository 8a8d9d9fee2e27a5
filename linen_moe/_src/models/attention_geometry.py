"""What one kind of layer's attention is (`Geometry`), and what it does to its
queries and keys before they meet (`position_qk`).

A decoder's layers are of two kinds (`ModelConfig.full_attention_layers`
and the others), each with its geometry: heads, head width, which keys a
query sees (a sliding window, chunks, or the whole causal past) and its
rotary embedding (or none: Llama-4's NoPE layers). Between the projections
and the attention, each family transforms q and k in its own order, all of
it config fields:

  qk_norm              weighted RMSNorm per head (or over all heads with
                       `qk_norm_over_heads`), before the rotary embedding
                       (Qwen3, Gemma-4, GLM-4.5, MiniMax-M2)
  rope                 the layer's rotary embedding, if it has one
  qk_norm_after_rope   weightless RMSNorm per head after it, on the layers
                       that rotate (Llama-4)
  temperature          the query times log1p(floor((p + 1) / F)) * s + 1,
                       on the full-attention layers (Llama-4's NoPE ones)

Shapes: B batch, S positions, N query heads, K key/value heads, D head
width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.models.norms import RMSNorm
from linen_moe._src.models.norms import rms_normalize
from linen_moe._src.models.rotary import Rope
from linen_moe._src.models.rotary import rope_of


@dataclasses.dataclass(frozen=True)
class Geometry:
  """The shape of one kind of layer's attention.

  Attributes:
    heads: N, query heads.
    kv_heads: K, key / value heads.
    head_dim: D.
    window: the sliding window W (0 = none).
    k_eq_v: no value projection: the values are the raw keys.
    rope: the rotary embedding of the queries and keys (None: NoPE).
    chunk: chunked attention's C (0 = none): a query sees the keys of its
      own chunk of C positions.
  """

  heads: int
  kv_heads: int
  head_dim: int
  window: int
  k_eq_v: bool
  rope: Rope | None
  chunk: int = 0

  @property
  def cache_window(self) -> int:
    """The positions the KV cache of the layer must keep (0 = all)."""
    return self.window or self.chunk


def geometry(cfg: ModelConfig, full: bool = False) -> Geometry:
  """The attention geometry of a full-attention layer of `cfg` (`full`) or
  of its other layers."""
  if not full:
    d = cfg.resolved_head_dim
    return Geometry(
        cfg.num_heads,
        cfg.resolved_kv_heads,
        d,
        cfg.sliding_window,
        False,
        rope_of(cfg, d),
        cfg.attention_chunk,
    )
  d = cfg.full_head_dim or cfg.resolved_head_dim
  return Geometry(
      cfg.num_heads,
      cfg.full_kv_heads or cfg.resolved_kv_heads,
      d,
      0,
      cfg.full_k_eq_v,
      None if cfg.full_nope else rope_of(cfg, d, full=True),
  )


def _qk_norm(cfg: ModelConfig, name: str, x: jax.Array) -> jax.Array:
  """`qk_norm` of q or k [B, S, heads, D]: per head (a [D] scale), or with
  `qk_norm_over_heads` one RMS over all the heads' dims (MiniMax-M2: a
  [heads * D] scale)."""
  if not cfg.qk_norm_over_heads:
    return RMSNorm(cfg.norm_eps, name=name)(x)
  flat = x.reshape(*x.shape[:2], -1)  # [B, S, heads * D]
  return RMSNorm(cfg.norm_eps, name=name)(flat).reshape(x.shape)


def temperature(cfg: ModelConfig, positions: jax.Array) -> jax.Array:
  """<float32>[B, S, 1, 1]: Llama-4's query scale at each position,
  log1p(floor((p + 1) / F)) * s + 1 (transformers counts p by index; for
  packed documents and left padding these are each document's positions)."""
  p = positions.astype(jnp.float32)
  floor = float(cfg.attention_temperature_floor)
  scale = jnp.log1p(jnp.floor((p + 1.0) / floor))
  return (scale * cfg.attention_temperature_scale + 1.0)[:, :, None, None]


def position_qk(
    cfg: ModelConfig,
    geo: Geometry,
    full: bool,
    q: jax.Array,
    k: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """q [B, S, N, D], k [B, S, K, D] as the layer's attention reads them
  (see the module docstring; called from a Linen module's compact
  method, whose `query_norm`, `key_norm` it creates with `qk_norm`)."""
  if cfg.qk_norm:
    q, k = _qk_norm(cfg, "query_norm", q), _qk_norm(cfg, "key_norm", k)
  if geo.rope is not None:
    q, k = geo.rope(q, positions), geo.rope(k, positions)
    if cfg.qk_norm_after_rope:
      q, k = rms_normalize(q, cfg.norm_eps), rms_normalize(k, cfg.norm_eps)
  if full and cfg.attention_temperature_floor:
    q = (q.astype(jnp.float32) * temperature(cfg, positions)).astype(q.dtype)
  return q, k
