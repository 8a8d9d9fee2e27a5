"""Causal self-attention of the reference decoders, with a KV cache.

Grouped-query attention (`num_kv_heads` key/value heads, each serving
`G = num_heads / num_kv_heads` consecutive query heads, as transformers'
`repeat_kv`), an explicit `head_dim`, optional per-head q/k RMSNorm before
the rotary embedding (Qwen3, Gemma-4), and an optional sliding window
(query i sees key j iff 0 <= i - j < W, transformers' sliding causal mask).
Gemma-4's full-attention layers (`ModelConfig.full_attention_layers`) have
a geometry of their own (`Geometry`): their head width, key/value heads and
rotary embedding, no window, and with `full_k_eq_v` no value projection
(the values are the raw key projection); `value_norm` normalises each value
head, and `attention_scale` replaces 1/sqrt(D). Softmax in float32,
probabilities cast back to the compute dtype before the values (`attend`,
shared with `mla.py`).

Shapes: B batch, S queries, T keys, M emb_dim, N query heads, K key/value
heads, G = N / K, D head_dim.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.layer import checkpoint_names
from linen_moe._src.models.kv_cache import write_cache
from linen_moe._src.models.norms import RMSNorm
from linen_moe._src.models.norms import rms_normalize
from linen_moe._src.models.rotary import Rope
from linen_moe._src.models.rotary import rope_of
from linen_moe._src.parallel import sharding


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

  def setup(self):
    out_axes = tuple(
        i for i in range(len(self.shape)) if i not in self.fan_in_axes
    )
    init = nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", self.fan_in_axes, out_axes
    )  # lecun_normal over the contracted axes, as DenseGeneral's
    # In setup, so that `kernel` can be read without a call (MLA's
    # absorbed decoding contracts the kernel itself).
    self.kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(init, self.names),
        self.shape,
        self.param_dtype,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel.astype(self.dtype)
    return jnp.einsum(self.eqn, x.astype(self.dtype), kernel)


def attention_mask(
    positions: jax.Array,
    key_positions: jax.Array,
    window: int,
    segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
) -> jax.Array:
  """<bool>[B, S, T]: query at positions [B, S] sees the key at
  key_positions [B, T] iff 0 <= q - k (causal), with a window W > 0
  q - k < W, and with segment ids (<int32>[B, S] and [B, T]) both in the
  same segment (padding, segment 0, sees padding only, so no row is empty)."""
  distance = positions[:, :, None] - key_positions[:, None, :]  # [B, S, T]
  visible = distance >= 0
  if window > 0:
    visible &= distance < window
  if segment_ids is not None:
    visible &= segment_ids[:, :, None] == key_segment_ids[:, None, :]
  return visible


def softmax_probs(
    logits: jax.Array, visible: jax.Array, dtype: jnp.dtype
) -> jax.Array:
  """Masked softmax over the last axis of float32 `logits` [B, ..., S, T]
  (`visible` <bool>[B, S, T]), cast to `dtype`."""
  extra = logits.ndim - visible.ndim
  visible = visible.reshape(
      visible.shape[:1] + (1,) * extra + visible.shape[1:]
  )
  logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(logits, axis=-1).astype(dtype)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    positions: jax.Array,
    key_positions: jax.Array,
    window: int,
    scale: float,
    dtype: jnp.dtype,
    segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Causal grouped-query attention: q [B, S, N, Dk], k [B, T, K, Dk], v
  [B, T, K, Dv] -> [B, S, N, Dv]; query head n reads key / value head
  n // (N / K). Which keys a query sees: `attention_mask` of the positions
  (<int32>[B, S], [B, T]), the window and the segment ids. Logits and
  softmax in float32."""
  visible = attention_mask(
      positions, key_positions, window, segment_ids, key_segment_ids
  )
  b, s, n, dk = q.shape
  kv = k.shape[2]
  q = q.reshape(b, s, kv, n // kv, dk)  # [B, S, K, G, Dk]
  logits = jnp.einsum("BSKGD,BTKD->BKGST", q, k).astype(jnp.float32) * scale
  probs = softmax_probs(logits, visible, dtype)  # [B, K, G, S, T]
  out = jnp.einsum("BKGST,BTKD->BSKGD", probs, v)  # [B, S, K, G, Dv]
  return out.reshape(b, s, n, v.shape[-1])


@dataclasses.dataclass(frozen=True)
class Geometry:
  """The shape of one kind of layer's attention.

  Attributes:
    heads: N, query heads.
    kv_heads: K, key / value heads.
    head_dim: D.
    window: the sliding window W (0 = the whole causal past).
    k_eq_v: no value projection: the values are the raw keys.
    rope: the rotary embedding of the queries and keys.
  """

  heads: int
  kv_heads: int
  head_dim: int
  window: int
  k_eq_v: bool
  rope: Rope


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
    )
  d = cfg.full_head_dim or cfg.resolved_head_dim
  return Geometry(
      cfg.num_heads,
      cfg.full_kv_heads or cfg.resolved_kv_heads,
      d,
      0,
      cfg.full_k_eq_v,
      rope_of(cfg, d, full=True),
  )


class CausalSelfAttention(nn.Module):
  """Causal self-attention with RoPE, and a KV cache in decode mode.

  Parameters: `query/kernel` [M, N, D], `key/kernel` and `value/kernel`
  [M, K, D] (no `value` with `Geometry.k_eq_v`), `out/kernel` [N, D, M];
  with `qk_norm`, `query_norm/scale` and `key_norm/scale` [D] (D, K of
  the layer's `Geometry`).

  With `decode`, the keys and values live in the `cache` collection
  (`cached_key`, `cached_value`: [B, max_len, K, D], created by `init` on a
  [B, max_len] sample): a call writes its S new ones at positions[0, 0] ..
  + S - 1 (every row of the batch at the same positions) and attends over
  the whole cache, the mask (causal, and the sliding window) reading each
  slot's position. The parameters are the same in both modes.

  Attributes:
    config: the `ModelConfig`.
    decode: keep and extend a KV cache.
    full: a full-attention layer (`ModelConfig.full_attention_layers`).
  """

  config: ModelConfig
  decode: bool = False
  full: bool = False

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array | None = None,
  ) -> jax.Array:
    """[B, S, M] -> [B, S, M]; positions and segment ids (optional, 0 =
    padding) <int32>[B, S]."""
    cfg = self.config
    geo = geometry(cfg, self.full)
    n, kv, d, m = geo.heads, geo.kv_heads, geo.head_dim, cfg.moe.emb_dim
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

    q, k = project("query", n), project("key", kv)
    v = k if geo.k_eq_v else project("value", kv)  # the raw projection
    if cfg.qk_norm:
      q = RMSNorm(cfg.norm_eps, name="query_norm")(q)
      k = RMSNorm(cfg.norm_eps, name="key_norm")(k)
    if cfg.value_norm:
      v = rms_normalize(v, cfg.norm_eps)
    q, k = geo.rope(q, positions), geo.rope(k, positions)
    key_positions, key_segment_ids = positions, segment_ids
    if self.decode:
      cached, key_positions = write_cache(
          self, {"key": k, "value": v}, positions
      )
      k, v = cached["key"], cached["value"]
      segment_ids = key_segment_ids = None
    q, k, v = checkpoint_names.tag_qkv(q, k, v)
    attended = attend(
        q,
        k,
        v,
        positions=positions,
        key_positions=key_positions,
        window=geo.window,
        scale=cfg.attention_scale or d**-0.5,
        dtype=dt,
        segment_ids=segment_ids,
        key_segment_ids=key_segment_ids,
    )  # [B, S, N, D]
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
