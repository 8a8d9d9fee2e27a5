"""Model FLOPs of a step, from the config: the matmuls of the parameters a
token uses (a routed expert's weights count top-k / num_experts) and the
attention's score and value contractions, causal and windowed.

A training step costs 3 forward passes (the backward pass is twice the
forward), 6 FLOPs per active matmul parameter and token; one decode step
2 per parameter and token, and its attention over the cache. These are
model FLOPs (MFU's numerator): rematerialisation, padding, masked-out
blocks and dropped tokens are not counted.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.models import attention_geometry
from linen_moe._src.models.decoder import Decoder


def _key_path_names(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def matmul_parameters(config: ModelConfig) -> tuple[int, float]:
  """(total, active per token) parameters of the decoder's matmuls.

  Read from the logical axis names of an abstract init (nothing is
  allocated): a matmul kernel has two or more axes besides a scanned
  stack's "layers" axis; a routed expert's kernel (an "exp" axis) is
  active for top-k / num_experts of the tokens; the embedding table is a
  lookup (no FLOPs) unless the logits reuse it (`tie_embeddings`). Norm
  scales, biases and per-expert scales are not matmuls.

  Args:
    config: the decoder's config.

  Returns:
    (total matmul parameters, active matmul parameters per token).
  """
  # How a matmul or attention is computed does not change a shape, and this
  # init is traced for the host, which may lack the target's kernels (a
  # TPU plan with grouped_matmul="kernel" compiled on a CPU host).
  config = config.replace(attention="auto", grouped_matmul="auto")
  boxed = jax.eval_shape(
      lambda: Decoder(config).init(
          jax.random.key(0), jnp.zeros((1, 2), jnp.int32)
      )
  )["params"]
  share = config.moe.num_experts_per_tok / config.moe.num_experts
  total, active = 0, 0.0
  leaves = jax.tree_util.tree_flatten_with_path(
      boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
  )[0]
  for path, leaf in leaves:
    names = tuple(getattr(leaf, "names", None) or ())
    value = leaf.unbox() if isinstance(leaf, nn.meta.AxisMetadata) else leaf
    axes = len(value.shape) - ("layers" in names)
    keys = _key_path_names(path)
    if keys[-1] == "embedding" and not config.tie_embeddings:
      continue
    if axes < 2:
      continue
    size = math.prod(value.shape)
    total += size
    active += size * (share if "exp" in names else 1.0)
  return total, active


def _pairs(seq: int, window: int, chunk: int = 0) -> int:
  """Query-key pairs of causal attention over `seq` positions, each query
  seeing at most `window` keys (itself included; 0 = unlimited), or only
  its own chunk of `chunk` positions."""
  if chunk > 0:
    whole, rest = divmod(seq, chunk)
    return whole * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2
  if window <= 0 or window >= seq:
    return seq * (seq + 1) // 2
  return window * (window + 1) // 2 + (seq - window) * window


def attention_flops(
    config: ModelConfig, batch: int, seq: int, *, decode: bool = False
) -> int:
  """Forward FLOPs of every layer's attention scores and values.

  Per layer 2 * B * pairs * heads * (qk width + v width), pairs the
  query-key pairs the causal (and sliding-window or chunked) mask keeps:
  S (S + 1) / 2 for S positions, fewer with a window or chunks; one decode
  step's query sees min(S, window) cached keys (min(S, chunk) at most,
  chunked).

  Args:
    config: the decoder's config.
    batch: B.
    seq: S, the sequence (decode: the cache length).
    decode: one new token per row against S cached positions.

  Returns:
    FLOPs of one forward pass.
  """
  full_layers = set(config.full_attention_layers)
  total = 0
  for i in range(config.num_layers):
    chunk = 0
    if config.kv_lora_rank > 0:  # multi-head latent attention
      heads, window = config.num_heads, config.sliding_window
      qk = config.qk_nope_head_dim + config.qk_rope_head_dim
      v = config.v_head_dim
    else:
      g = attention_geometry.geometry(config, full=i in full_layers)
      heads, window, qk, v = g.heads, g.window, g.head_dim, g.head_dim
      chunk = g.chunk
    if decode:
      kept = window or chunk
      pairs = min(seq, kept) if kept > 0 else seq
    else:
      pairs = _pairs(seq, window, chunk)
    total += 2 * batch * pairs * heads * (qk + v)
  return total


def model_flops(
    config: ModelConfig, batch: int, seq: int, *, decode: bool = False
) -> int:
  """Model FLOPs of one step: a training step on [B, S] tokens, or (with
  `decode`) one decode step of B tokens against a cache of S positions.

  Training: 6 B S P + 3 A, P the active matmul parameters per token
  (`matmul_parameters`), A the forward attention FLOPs
  (`attention_flops`). Decoding: 2 B P + A.

  Args:
    config: the decoder's config.
    batch: B.
    seq: S.
    decode: one decode step instead of a training step.

  Returns:
    FLOPs, rounded to an integer.
  """
  _, active = matmul_parameters(config)
  attn = attention_flops(config, batch, seq, decode=decode)
  if decode:
    return round(2 * batch * active + attn)
  return round(6 * batch * seq * active + 3 * attn)
