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

`attend` is one function with several implementations
(`ModelConfig.attention`), all of the same numbers:

- "einsum": the reference; the whole float32 score matrix [B, K, G, S, T]
  and a [B, S, T] mask, memory quadratic in S.
- "blockwise" (`attention_blockwise.py`): key / value blocks with an online
  softmax and a custom VJP that recomputes each block's probabilities, so
  forward and backward memory are linear in S; blocks wholly outside the
  causal past or the window are skipped. Plain JAX, every platform.
- "dot_product" (`attention_fused.py`): `jax.nn.dot_product_attention`:
  cuDNN's fused kernel on GPU (bfloat16 / float16, no segment ids), XLA's
  implementation with the exact mask elsewhere.
- "splash" (`attention_fused.py`): the Pallas splash attention kernels,
  TPU only, under `shard_map` when a mesh is set.
- "auto": on CPU "einsum" below `CPU_BLOCKWISE_FROM` query positions and
  "blockwise" from there; on GPU "dot_product" where cuDNN takes the call
  (bfloat16 / float16, no segment ids, sinks or chunks, head widths
  multiples of 8 up to `CUDNN_MAX_HEAD_DIM`), on TPU "splash" where S is a
  multiple of 128 (and not chunks beside segment ids), and "blockwise"
  otherwise.

A request the platform or the call cannot honour is a ValueError naming
why, never a quiet fallback. The KV-cache decode step always runs the
einsum (S is one token to a prompt over the cache; MLA's absorbed form has
its own einsum).

Shapes: B batch, S queries, T keys, M emb_dim, N query heads, K key/value
heads, G = N / K, D head_dim.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src.config.decoder_fields import ATTENTION_IMPLEMENTATIONS
from linen_moe._src.config.lora import LoRAConfig
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.kernels.platform import target_platform
from linen_moe._src.layer import checkpoint_names
from linen_moe._src.lora import adapters as lora_adapters
from linen_moe._src.models import attention_blockwise
from linen_moe._src.models import attention_fused
from linen_moe._src.models.attention_geometry import geometry
from linen_moe._src.models.attention_geometry import position_qk
from linen_moe._src.models.attention_mask import attention_mask
from linen_moe._src.models.kv_cache import write_cache
from linen_moe._src.models.norms import rms_normalize
from linen_moe._src.parallel import sharding

IMPLEMENTATIONS = ATTENTION_IMPLEMENTATIONS
# "auto" on CPU: blockwise from this query length on, the einsum below it
# (measured: benchmarks/model/bench_attention.py --crossover).
CPU_BLOCKWISE_FROM = 1024
# "auto" on GPU takes cuDNN up to this head width.
CUDNN_MAX_HEAD_DIM = 128


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
    lora: the kernel's adapter (None: none).
    use_bias: add a learned `bias` over the kernel's output axes (zeros at
      init).
  """

  eqn: str
  shape: tuple[int, ...]
  names: tuple[str, ...]
  fan_in_axes: tuple[int, ...]
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  lora: LoRAConfig | None = None
  use_bias: bool = False

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
    if self.use_bias:
      out = [i for i in range(len(self.shape)) if i not in self.fan_in_axes]
      self.bias = self.param(
          "bias",
          nn.with_logical_partitioning(
              nn.initializers.zeros, tuple(self.names[i] for i in out)
          ),
          tuple(self.shape[i] for i in out),
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
    if self.use_bias:
      out = out + self.bias.astype(self.dtype)
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


def softmax_probs(
    logits: jax.Array,
    visible: jax.Array,
    dtype: jnp.dtype,
    sinks: jax.Array | None = None,
) -> jax.Array:
  """Masked softmax over the last axis of float32 `logits` [B, ..., S, T]
  (`visible` <bool>[B, S, T]), cast to `dtype`. With `sinks` (float32,
  broadcasting against [B, ..., S, 1]) each row's sink logit joins the
  denominator, as transformers' GPT-OSS does: a softmax over the logits and
  the sink, the sink's column dropped."""
  extra = logits.ndim - visible.ndim
  visible = visible.reshape(
      visible.shape[:1] + (1,) * extra + visible.shape[1:]
  )
  logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
  if sinks is None:
    return jax.nn.softmax(logits, axis=-1).astype(dtype)
  sink = jnp.broadcast_to(sinks, (*logits.shape[:-1], 1)).astype(jnp.float32)
  probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)
  return probs[..., :-1].astype(dtype)


def einsum_attend(
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
    sinks: jax.Array | None = None,
    chunk: int = 0,
) -> jax.Array:
  """The reference: the whole float32 score matrix [B, K, G, S, T] and the
  [B, S, T] mask (`attend` "einsum")."""
  visible = attention_mask(
      positions, key_positions, window, segment_ids, key_segment_ids, chunk
  )
  b, s, n, dk = q.shape
  kv = k.shape[2]
  q = q.reshape(b, s, kv, n // kv, dk)  # [B, S, K, G, Dk]
  logits = jnp.einsum("BSKGD,BTKD->BKGST", q, k).astype(jnp.float32) * scale
  if sinks is not None:  # [N] -> [1, K, G, 1, 1]
    sinks = sinks.reshape(1, kv, n // kv, 1, 1)
  probs = softmax_probs(logits, visible, dtype, sinks)  # [B, K, G, S, T]
  out = jnp.einsum("BKGST,BTKD->BSKGD", probs, v)  # [B, S, K, G, Dv]
  return out.reshape(b, s, n, v.shape[-1])


def resolve_implementation(
    implementation: str,
    *,
    platform: str,
    q_len: int,
    kv_len: int,
    dtype: jnp.dtype,
    head_dims: tuple[int, int],
    has_segments: bool,
    self_attention: bool,
    has_sinks: bool = False,
    has_chunk: bool = False,
) -> str:
  """The implementation `attend` runs for `implementation` ("auto" picks
  one; see the module docstring's rule). Raises a ValueError for an unknown
  name; the platform checks of the fused ones are theirs."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"attention={implementation!r} is not an attention implementation; "
        f"allowed: {IMPLEMENTATIONS}."
    )
  if implementation != "auto":
    return implementation
  if not self_attention:
    return "einsum"
  if platform == "cpu":
    return "blockwise" if q_len >= CPU_BLOCKWISE_FROM else "einsum"
  if platform == "gpu":
    fits = (
        jnp.dtype(dtype).name in attention_fused.CUDNN_DTYPES
        and not has_segments
        and not has_sinks
        and not has_chunk
        and max(head_dims) <= CUDNN_MAX_HEAD_DIM
        and all(d % 8 == 0 for d in head_dims)
    )
    return "dot_product" if fits else "blockwise"
  if platform == "tpu":
    fits = q_len == kv_len and q_len % attention_fused.SPLASH_MULTIPLE == 0
    fits = fits and not (has_chunk and has_segments)
    return "splash" if fits else "blockwise"
  return "blockwise"


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
    implementation: str = "einsum",
    self_attention: bool = False,
    sinks: jax.Array | None = None,
    chunk: int = 0,
) -> jax.Array:
  """Causal grouped-query attention: q [B, S, N, Dk], k [B, T, K, Dk], v
  [B, T, K, Dv] -> [B, S, N, Dv]; query head n reads key / value head
  n // (N / K). Which keys a query sees: `attention_mask` of the positions
  (<int32>[B, S], [B, T]), the window and the segment ids. Logits and
  softmax in float32.

  `implementation`: one of `IMPLEMENTATIONS` (`ModelConfig.attention`; see
  the module docstring). `self_attention`: the keys are the queries' own
  tokens, and each segment's positions count up by one per token (the
  decoders' layout, not a KV cache): blockwise skips the blocks no query of
  a block can see, and the fused kernels mask by index. `sinks`: an
  optional <float32>[N], query head n's sink logit in each of its rows'
  softmax denominators (no value; `ModelConfig.attention_sinks`), in
  every implementation (cuDNN excepted: a ValueError). `chunk` C > 0:
  chunked attention (Llama-4), a query sees only the keys of its own
  chunk of C positions (cuDNN, and splash with segment ids, cannot: a
  ValueError).

  Raises:
    ValueError: an unknown implementation, or one the platform or this
      call's layout cannot run (the message says why), before any work.
  """
  platform = target_platform()
  name = resolve_implementation(
      implementation,
      platform=platform,
      q_len=q.shape[1],
      kv_len=k.shape[1],
      dtype=dtype,
      head_dims=(q.shape[-1], v.shape[-1]),
      has_segments=segment_ids is not None,
      self_attention=self_attention,
      has_sinks=sinks is not None,
      has_chunk=chunk > 0,
  )
  common = dict(
      positions=positions,
      key_positions=key_positions,
      window=window,
      scale=scale,
      dtype=dtype,
      segment_ids=segment_ids,
      key_segment_ids=key_segment_ids,
      sinks=sinks,
      chunk=chunk,
  )
  if name == "einsum":
    return einsum_attend(q, k, v, **common)
  if name == "blockwise":
    return attention_blockwise.attend(
        q, k, v, self_attention=self_attention, **common
    )
  if name == "dot_product":
    return attention_fused.dot_product_attend(
        q, k, v, self_attention=self_attention, platform=platform, **common
    )
  return attention_fused.splash_attend(
      q,
      k,
      v,
      window=window,
      scale=scale,
      dtype=dtype,
      segment_ids=segment_ids,
      self_attention=self_attention,
      platform=platform,
      sinks=sinks,
      chunk=chunk,
  )


class CausalSelfAttention(nn.Module):
  """Causal self-attention with RoPE, and a KV cache in decode mode.

  Parameters: `query/kernel` [M, N, D], `key/kernel` and `value/kernel`
  [M, K, D] (no `value` with `Geometry.k_eq_v`), `out/kernel` [N, D, M];
  with `qk_norm`, `query_norm/scale` and `key_norm/scale` [D] ([N * D],
  [K * D] with `qk_norm_over_heads`; D, K of the layer's `Geometry`);
  with `attention_qkv_bias` a `bias` [N or K, D] beside each of the first
  three kernels, with `attention_out_bias` `out/bias` [M]; with
  `attention_sinks`, `sinks` [N]. What q and k go through before they
  meet (norms, rotary, temperature) is `attention_geometry.position_qk`.

  With `decode`, the keys and values live in the `cache` collection
  (`cached_key`, `cached_value`: [B, K, C, D], and `cached_position`,
  created by `init` on a [B, max_len] sample; C is max_len, or the window
  or chunk for a sliding-window or chunked layer's ring buffer,
  `kv_cache.py`): a call writes its S new ones at their rows' positions
  (negative: padding, not written) and attends over the cache, the mask
  (causal, the sliding window, the chunk) reading each slot's stored
  position. The parameters are the same in both modes.

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
          cfg.moe.lora_on("attention"),
          cfg.attention_qkv_bias,
          name=name,
      )
      return sharding.constrain(p(x), bsnd)

    q, k = project("query", n), project("key", kv)
    v = k if geo.k_eq_v else project("value", kv)  # the raw projection
    if cfg.value_norm:
      v = rms_normalize(v, cfg.norm_eps)
    q, k = position_qk(cfg, geo, self.full, q, k, positions)
    key_positions, key_segment_ids = positions, segment_ids
    implementation = cfg.attention
    if self.decode:  # S is 1 .. a prompt: the einsum over the cache
      implementation = "einsum"
      cached, key_positions, key_valid, valid = write_cache(
          self, {"key": k, "value": v}, positions, geo.cache_window
      )
      k, v = cached["key"], cached["value"]
      segment_ids, key_segment_ids = valid.astype(jnp.int32), key_valid
      key_segment_ids = key_segment_ids.astype(jnp.int32)
    q, k, v = checkpoint_names.tag_qkv(q, k, v)
    sinks = None
    if cfg.attention_sinks:
      sinks = self.param(
          "sinks",
          nn.with_logical_partitioning(nn.initializers.zeros, ("heads",)),
          (n,),
          pdt,
      ).astype(jnp.float32)
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
        implementation=implementation,
        self_attention=not self.decode,
        sinks=sinks,
        chunk=geo.chunk,
    )  # [B, S, N, D]
    out = Projection(
        "BSND,NDM->BSM",
        (n, d, m),
        ("heads", "kv", "embed"),
        (0, 1),
        dt,
        pdt,
        cfg.moe.lora_on("attention"),
        cfg.attention_out_bias,
        name="out",
    )
    return out(attended)
