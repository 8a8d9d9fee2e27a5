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
from linen_moe._src.layer.variables import CACHE
from linen_moe._src.lora import adapters as lora_adapters
from linen_moe._src.lora.config import LoRAConfig
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
  lora: LoRAConfig | None = None

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
    if self.lora is not None:  # `lora_adapters`: A over the fan-in axes
      n_in = len(self.fan_in_axes)
      if tuple(self.fan_in_axes) != tuple(range(n_in)):
        raise ValueError(
            f"LoRA needs a kernel's fan-in axes first; got {self.fan_in_axes}"
        )
      self.lora_a, self.lora_b = lora_adapters.declare(
          self,
          "kernel",
          self.shape,
          self.names,
          self.lora,
          self.param_dtype,
          n_in=n_in,
      )

  def merged_kernel(self) -> jax.Array:
    """The kernel in the compute dtype, with its adapter's delta folded in
    (for a caller that contracts the kernel itself: MLA's absorbed
    decoding)."""
    kernel = self.kernel
    if self.lora is not None:
      kernel = lora_adapters.merged_kernel(
          kernel, self.lora_a, self.lora_b, self.lora.scale
      )
    return kernel.astype(self.dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel.astype(self.dtype)
    x = x.astype(self.dtype)
    out = jnp.einsum(self.eqn, x, kernel)
    if self.lora is None:
      return out
    delta = lora_adapters.einsum_delta(
        self,
        self.eqn,
        x,
        self.lora_a,
        self.lora_b,
        self.lora.scale,
        self.lora.dropout,
    )
    return lora_adapters.add_delta(out, delta)


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
    visible: jax.Array,
    scale: float,
    dtype: jnp.dtype,
) -> jax.Array:
  """Grouped-query attention: q [B, S, N, Dk], k [B, T, K, Dk], v [B, T,
  K, Dv], `visible` <bool>[B, S, T] -> [B, S, N, Dv]; query head n reads
  key / value head n // (N / K). Logits and softmax in float32."""
  b, s, n, dk = q.shape
  kv = k.shape[2]
  q = q.reshape(b, s, kv, n // kv, dk)  # [B, S, K, G, Dk]
  logits = jnp.einsum("BSKGD,BTKD->BKGST", q, k).astype(jnp.float32) * scale
  probs = softmax_probs(logits, visible, dtype)  # [B, K, G, S, T]
  out = jnp.einsum("BKGST,BTKD->BSKGD", probs, v)  # [B, S, K, G, Dv]
  return out.reshape(b, s, n, v.shape[-1])


def write_cache(module: nn.Module, new: dict, positions: jax.Array):
  """The cache of a decoding attention: ({name: whole cache [B, max_len,
  ...]}, key positions [B, max_len]) after writing each `new` [B, S, ...]
  at positions[0, 0] .. + S - 1 (every row at the same positions) into the
  `cache` variable `cached_{name}`. At init (no cache yet) the cache is
  shaped after `new` and `new` is returned as it is."""
  initialized = module.has_variable(CACHE, f"cached_{next(iter(new))}")
  cached = {
      name: module.variable(
          CACHE, f"cached_{name}", jnp.zeros, x.shape, x.dtype
      )
      for name, x in new.items()
  }
  if not initialized:
    return new, positions
  out = {}
  for name, x in new.items():
    start = (0, positions[0, 0]) + (0,) * (x.ndim - 2)
    cached[name].value = jax.lax.dynamic_update_slice(
        cached[name].value, x, start
    )
    out[name] = cached[name].value
  b, max_len = positions.shape[0], out[name].shape[1]
  return out, jnp.broadcast_to(jnp.arange(max_len), (b, max_len))


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
  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
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
          cfg.moe.lora_on("attention"),
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
    key_positions = positions
    if self.decode:
      cached, key_positions = write_cache(
          self, {"key": k, "value": v}, positions
      )
      k, v = cached["key"], cached["value"]
    visible = attention_mask(positions, key_positions, geo.window)
    scale = cfg.attention_scale or d**-0.5
    attended = attend(q, k, v, visible, scale, dt)  # [B, S, N, D]
    out = Projection(
        "BSND,NDM->BSM",
        (n, d, m),
        ("heads", "kv", "embed"),
        (0, 1),
        dt,
        pdt,
        cfg.moe.lora_on("attention"),
        name="out",
    )
    return out(attended)
