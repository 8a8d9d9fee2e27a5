"""Multi-head latent attention (DeepSeek-V2/V3), with a latent KV cache.

As transformers' `DeepseekV3Attention` computes it:

  q           = query_b(norm(query_a(x)))  or  query(x)      [B, S, N, Dn + Dr]
  q_nope, q_r = q[..., :Dn], rope(q[..., Dn:])
  c, k_r      = kv_a(x)[..., :R], rope(kv_a(x)[..., R:])     [B, S, R], [B, S, Dr]
  c           = norm(c)                                      (k_r is not normed)
  k_nope, v   = split(kv_b(c), [Dn, Dv])                     [B, S, N, Dn], [B, S, N, Dv]
  k           = [k_nope | k_r]                               k_r shared by every head
  out         = attention(q, k, v) -> [B, S, N, Dv] -> out   [B, S, M]

with the softmax scale `softmax_scale` (1/sqrt(Dn + Dr) and, under YaRN,
DeepSeek's mscale correction, as transformers applies it). The two
latent norms use eps 1e-6 whatever `norm_eps` is, as transformers' do.

The KV cache keeps the normed latent c [B, T, R] and the rotated key k_r
[B, T, Dr]: (R + Dr) values a token a layer, against N (Dn + Dr + Dv)
for the expanded keys and values (DeepSeek-V3: 576 against 40,960, 71x
fewer). Decoding reads it in the absorbed form, never expanding the cache:
q_nope . k_nope = (q_nope W_k) . c and sum_t p v = (sum_t p c) W_v, where
kv_b = [W_k | W_v] per head. Both forms are the same sums (tested against
transformers' logits and `generate`).

Shapes: B batch, S queries, T keys, M emb_dim, N heads, R kv_lora_rank,
Q q_lora_rank, Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.layer import checkpoint_names
from linen_moe._src.models.attention import Projection
from linen_moe._src.models.attention import attend
from linen_moe._src.models.attention import softmax_probs
from linen_moe._src.models.attention_mask import attention_mask
from linen_moe._src.models.kv_cache import write_cache
from linen_moe._src.models.norms import RMSNorm
from linen_moe._src.models.rotary import rope_of
from linen_moe._src.models.rotary import yarn_mscale
from linen_moe._src.parallel import sharding

# transformers' DeepseekV3RMSNorm default, for q_a_layernorm and
# kv_a_layernorm (it never passes config.rms_norm_eps to them).
LATENT_NORM_EPS = 1e-6


def cache_values_per_token(config: ModelConfig) -> dict[str, int]:
  """Values one token keeps in one layer's KV cache: "latent" (this
  module's cache: R + Dr) and "expanded" (keys and values of every head:
  N (Dn + Dr + Dv))."""
  n = config.num_heads
  dn, dr, dv = (
      config.qk_nope_head_dim,
      config.qk_rope_head_dim,
      config.v_head_dim,
  )
  return {
      "latent": config.kv_lora_rank + dr,
      "expanded": n * (dn + dr + dv),
  }


def softmax_scale(config: ModelConfig) -> float:
  """`attention_scale`, or 1/sqrt(Dn + Dr) times DeepSeek's YaRN correction
  g(mscale_all_dim) ** 2 (transformers' `yarn_apply_mscale`)."""
  if config.attention_scale:
    return config.attention_scale
  scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
  if config.rope_type != "default" and config.rope_mscale_all_dim:
    scale *= yarn_mscale(config.rope_factor, config.rope_mscale_all_dim) ** 2
  return scale


class MultiHeadLatentAttention(nn.Module):
  """Multi-head latent attention (`ModelConfig.kv_lora_rank > 0`).

  Parameters: with `q_lora_rank`, `query_a/kernel` [M, Q],
  `query_a_norm/scale` [Q] and `query_b/kernel` [Q, N, Dn + Dr]; without,
  `query/kernel` [M, N, Dn + Dr]; `kv_a/kernel` [M, R + Dr],
  `kv_a_norm/scale` [R], `kv_b/kernel` [R, N, Dn + Dv], `out/kernel`
  [N, Dv, M]. With `decode`, the cache `cached_latent` [B, C, R] and
  `cached_rope_key` [B, 1, C, Dr], and `cached_position` (see the module
  docstring and `kv_cache.py`).

  Attributes:
    config: the `ModelConfig`.
    decode: keep and extend a KV cache.
  """

  config: ModelConfig
  decode: bool = False

  def _projection(self, eqn, shape, names, fan_in, name):
    cfg = self.config
    return Projection(
        eqn,
        shape,
        names,
        fan_in,
        cfg.moe.dtype,
        cfg.moe.param_dtype,
        cfg.moe.lora_on("attention"),
        name=name,
    )

  def _query(self, x: jax.Array) -> jax.Array:
    """[B, S, M] -> [B, S, N, Dn + Dr]."""
    cfg = self.config
    m, n = cfg.moe.emb_dim, cfg.num_heads
    dq = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if not cfg.q_lora_rank:
      return self._projection(
          "BSM,MND->BSND", (m, n, dq), ("embed", "heads", "kv"), (0,), "query"
      )(x)
    r = cfg.q_lora_rank
    lat = self._projection(
        "BSM,MR->BSR", (m, r), ("embed", "latent"), (0,), "query_a"
    )(x)
    lat = RMSNorm(LATENT_NORM_EPS, name="query_a_norm")(lat)
    return self._projection(
        "BSR,RND->BSND", (r, n, dq), ("latent", "heads", "kv"), (0,), "query_b"
    )(lat)

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
    m, n, r = cfg.moe.emb_dim, cfg.num_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    dt = cfg.moe.dtype
    rope = rope_of(cfg, dr)
    bsnd = sharding.BSM[:2] + ("activation_heads", "activation_kv")

    q = sharding.constrain(self._query(x), bsnd)  # [B, S, N, Dn + Dr]
    q_nope, q_rot = q[..., :dn], rope(q[..., dn:], positions)
    ckv = self._projection(
        "BSM,MR->BSR", (m, r + dr), ("embed", "latent"), (0,), "kv_a"
    )(
        x
    )  # [B, S, R + Dr]
    latent = RMSNorm(LATENT_NORM_EPS, name="kv_a_norm")(ckv[..., :r])
    k_rot = rope(ckv[..., None, r:], positions)  # [B, S, 1, Dr], one head
    kv_b = self._projection(
        "BSR,RND->BSND",
        (r, n, dn + dv),
        ("latent", "heads", "kv"),
        (0,),
        "kv_b",
    )
    scale = softmax_scale(cfg)
    if self.decode:
      cached, key_positions, key_valid, valid = write_cache(
          self,
          {"latent": latent, "rope_key": k_rot},
          positions,
          cfg.sliding_window,
      )
      visible = attention_mask(
          positions, key_positions, cfg.sliding_window, valid, key_valid
      )
      attended = self._absorbed(
          kv_b,
          q_nope,
          q_rot,
          cached["latent"],
          cached["rope_key"],
          visible,
          scale,
      )
    else:
      kv = sharding.constrain(kv_b(latent), bsnd)  # [B, S, N, Dn + Dv]
      k_nope, v = kv[..., :dn], kv[..., dn:]
      k_rot = jnp.broadcast_to(k_rot, (*k_rot.shape[:2], n, dr))
      k = jnp.concatenate([k_nope, k_rot.astype(k_nope.dtype)], axis=-1)
      q = jnp.concatenate([q_nope, q_rot], axis=-1)
      q, k, v = checkpoint_names.tag_qkv(q, k, v)
      attended = attend(
          q,
          k,
          v,
          positions=positions,
          key_positions=positions,
          window=cfg.sliding_window,
          scale=scale,
          dtype=dt,
          segment_ids=segment_ids,
          key_segment_ids=segment_ids,
          implementation=cfg.attention,
          self_attention=True,
      )  # [B, S, N, Dv]
    out = self._projection(
        "BSND,NDM->BSM", (n, dv, m), ("heads", "kv", "embed"), (0, 1), "out"
    )
    return out(attended)

  def _absorbed(self, kv_b, q_nope, q_rot, latent, k_rot, visible, scale):
    """Attention over the cached latent [B, T, R] and rotary keys [B, T, 1,
    Dr] without expanding them: [B, S, N, Dv]."""
    cfg = self.config
    dn, dt = cfg.qk_nope_head_dim, cfg.moe.dtype
    w = kv_b.merged_kernel().astype(dt)  # [R, N, Dn + Dv], adapted
    w_k, w_v = w[..., :dn], w[..., dn:]
    q_latent = jnp.einsum("BSND,RND->BSNR", q_nope, w_k)  # [B, S, N, R]
    logits = jnp.einsum("BSNR,BTR->BNST", q_latent, latent)
    logits += jnp.einsum("BSND,BTD->BNST", q_rot, k_rot[:, :, 0].astype(dt))
    probs = softmax_probs(logits.astype(jnp.float32) * scale, visible, dt)
    context = jnp.einsum("BNST,BTR->BSNR", probs, latent)  # [B, S, N, R]
    return jnp.einsum("BSNR,RND->BSND", context, w_v)  # [B, S, N, Dv]
