"""Validation of the `ModelConfig` fields of the families' attention and
blocks beyond Mixtral's: multi-head latent attention, YaRN, llama3,
interleaved and partial rotary embeddings, full-attention layers of their
own geometry (Gemma-4) or without RoPE (Llama-4), chunked attention,
sinks, biases and norms of q and k, and the extra norms and scalars of a
Gemma-4 block.

Kept apart from `config.py` (which calls `check` from
`ModelConfig.__post_init__`); imports no jax.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any

ROPE_TYPES = ("default", "yarn", "llama3")
# `ModelConfig.attention` (linen_moe._src.models.attention.attend).
ATTENTION_IMPLEMENTATIONS = (
    "auto",
    "einsum",
    "blockwise",
    "dot_product",
    "splash",
)

_INTS = (
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_original_max_len",
    "full_head_dim",
    "full_kv_heads",
    "rotary_dim",
    "attention_chunk",
    "attention_temperature_floor",
)
_BOOLS = (
    "rope_interleave",
    "full_k_eq_v",
    "value_norm",
    "post_attention_norm",
    "post_mlp_norm",
    "shared_pre_norm",
    "layer_scalar",
    "rope_truncate",
    "attention_sinks",
    "attention_qkv_bias",
    "attention_out_bias",
    "qk_norm_over_heads",
    "full_nope",
    "qk_norm_after_rope",
)
# name -> (lowest allowed, whether the lowest is allowed itself)
_FLOATS = {
    "rope_factor": (0.0, False),
    "rope_beta_fast": (0.0, False),
    "rope_beta_slow": (0.0, False),
    "rope_mscale": (0.0, True),
    "rope_mscale_all_dim": (0.0, True),
    "attention_scale": (0.0, True),
    "full_rope_base": (0.0, True),
    "full_rope_fraction": (0.0, False),
    "final_logit_softcap": (0.0, True),
    "rope_low_freq_factor": (0.0, False),
    "rope_high_freq_factor": (0.0, False),
    "attention_temperature_scale": (0.0, True),
}
_MLA = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_FULL = ("full_head_dim", "full_kv_heads", "full_rope_base", "full_k_eq_v")

Fail = Callable[[str, str, Any, str], None]


def _types(cfg, fail: Fail) -> None:
  for name in _INTS:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      fail("ModelConfig", name, value, "expected an integer >= 0")
  for name in _BOOLS:
    if not isinstance(getattr(cfg, name), bool):
      fail("ModelConfig", name, getattr(cfg, name), "expected a bool")
  for name, (low, closed) in _FLOATS.items():
    value = getattr(cfg, name)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
        or (value == low and not closed)
    ):
      bound = ">=" if closed else ">"
      fail("ModelConfig", name, value, f"expected a number {bound} {low:g}")
    object.__setattr__(cfg, name, float(value))
  if cfg.rope_type not in ROPE_TYPES:
    fail("ModelConfig", "rope_type", cfg.rope_type, f"allowed {ROPE_TYPES}")
  if cfg.attention not in ATTENTION_IMPLEMENTATIONS:
    fail(
        "ModelConfig",
        "attention",
        cfg.attention,
        f"allowed values are {ATTENTION_IMPLEMENTATIONS}",
    )


def _mla(cfg, fail: Fail) -> None:
  if cfg.kv_lora_rank == 0:
    for name in _MLA:
      if getattr(cfg, name):
        fail(
            "ModelConfig",
            name,
            getattr(cfg, name),
            "multi-head latent attention needs kv_lora_rank > 0",
        )
    return
  for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
    if getattr(cfg, name) <= 0:
      fail("ModelConfig", name, getattr(cfg, name), "MLA needs it > 0")
  if cfg.qk_rope_head_dim % 2:
    fail(
        "ModelConfig",
        "qk_rope_head_dim",
        cfg.qk_rope_head_dim,
        "RoPE needs an even width",
    )
  if cfg.num_kv_heads not in (0, cfg.num_heads):
    fail(
        "ModelConfig",
        "num_kv_heads",
        cfg.num_kv_heads,
        "MLA expands keys and values to every head (0 or num_heads)",
    )
  for name in (
      "qk_norm",
      "value_norm",
      "full_attention_layers",
      "attention_sinks",
      "attention_qkv_bias",
      "attention_out_bias",
  ):
    if getattr(cfg, name):
      fail("ModelConfig", name, getattr(cfg, name), "not with MLA")


def _full_layers(cfg, fail: Fail) -> None:
  layers = cfg.full_attention_layers
  if not isinstance(layers, (tuple, list)) or not all(
      isinstance(i, int) and not isinstance(i, bool) for i in layers
  ):
    fail("ModelConfig", "full_attention_layers", layers, "expected indices")
  normal = tuple(sorted(set(layers)))
  if len(normal) != len(layers) or any(
      not 0 <= i < cfg.num_layers for i in normal
  ):
    fail(
        "ModelConfig",
        "full_attention_layers",
        layers,
        f"expected distinct indices in [0, num_layers={cfg.num_layers})",
    )
  object.__setattr__(cfg, "full_attention_layers", normal)
  if not normal:
    for name in (*_FULL, "full_rope_fraction"):
      default = 1.0 if name == "full_rope_fraction" else 0
      if getattr(cfg, name) != default:
        fail(
            "ModelConfig",
            name,
            getattr(cfg, name),
            "it shapes the full-attention layers, and there are none",
        )
    return
  if cfg.full_rope_fraction > 1:
    fail(
        "ModelConfig",
        "full_rope_fraction",
        cfg.full_rope_fraction,
        "expected a share in (0, 1]",
    )
  if 0 < cfg.full_rope_base <= 1:
    fail("ModelConfig", "full_rope_base", cfg.full_rope_base, "expected > 1")
  kv = cfg.full_kv_heads or cfg.num_kv_heads or cfg.num_heads
  if cfg.num_heads % kv:
    fail(
        "ModelConfig",
        "full_kv_heads",
        cfg.full_kv_heads,
        f"must divide num_heads={cfg.num_heads}",
    )
  if cfg.full_head_dim % 2:
    fail("ModelConfig", "full_head_dim", cfg.full_head_dim, "must be even")
  own_rope = cfg.full_rope_base > 0 or cfg.full_rope_fraction < 1
  if own_rope and cfg.rope_type != "default":
    fail(
        "ModelConfig",
        "rope_type",
        cfg.rope_type,
        "full-attention layers with a RoPE of their own (full_rope_base, "
        "full_rope_fraction) take only 'default' beside them",
    )


def _rotary_dim(cfg, fail: Fail) -> None:
  r = cfg.rotary_dim
  if not r:
    return
  if cfg.kv_lora_rank:
    fail("ModelConfig", "rotary_dim", r, "not with MLA (qk_rope_head_dim)")
  if cfg.full_rope_base or cfg.full_rope_fraction < 1:
    fail(
        "ModelConfig",
        "rotary_dim",
        r,
        "not beside full-attention layers with a RoPE of their own",
    )
  widths = [cfg.head_dim or cfg.moe.emb_dim // cfg.num_heads]
  if cfg.full_attention_layers and cfg.full_head_dim:
    widths.append(cfg.full_head_dim)
  if r % 2 or r > min(widths):
    fail(
        "ModelConfig",
        "rotary_dim",
        r,
        f"expected an even width <= the head width {min(widths)}",
    )


def _llama4(cfg, fail: Fail) -> None:
  """Chunked attention, NoPE full layers, the q/k norm after the rotary
  embedding, temperature tuning and llama3 RoPE (Llama-4's fields)."""
  if cfg.attention_chunk and cfg.sliding_window:
    fail(
        "ModelConfig",
        "attention_chunk",
        cfg.attention_chunk,
        f"not with sliding_window={cfg.sliding_window} (one or the other)",
    )
  if cfg.kv_lora_rank:
    for name in ("attention_chunk", "full_nope", "qk_norm_after_rope"):
      if getattr(cfg, name):
        fail("ModelConfig", name, getattr(cfg, name), "not with MLA")
  full = bool(cfg.full_attention_layers)
  for name in ("full_nope", "attention_temperature_floor"):
    if getattr(cfg, name) and not full:
      fail(
          "ModelConfig",
          name,
          getattr(cfg, name),
          "it shapes the full-attention layers, and there are none",
      )
  if cfg.full_nope and (cfg.full_rope_base or cfg.full_rope_fraction < 1):
    fail("ModelConfig", "full_nope", True, "NoPE layers have no RoPE base")
  if cfg.attention_temperature_scale and not cfg.attention_temperature_floor:
    fail(
        "ModelConfig",
        "attention_temperature_scale",
        cfg.attention_temperature_scale,
        "needs attention_temperature_floor > 0",
    )
  if cfg.rope_type != "llama3" and (
      cfg.rope_low_freq_factor != 1 or cfg.rope_high_freq_factor != 4
  ):
    fail(
        "ModelConfig",
        "rope_low_freq_factor",
        (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor),
        "the low / high frequency factors are read by rope_type='llama3' "
        "only (1 and 4 otherwise)",
    )
  if (
      cfg.rope_type == "llama3"
      and cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor
  ):
    fail(
        "ModelConfig",
        "rope_high_freq_factor",
        cfg.rope_high_freq_factor,
        f"must exceed rope_low_freq_factor={cfg.rope_low_freq_factor}",
    )


def check(cfg, fail: Fail) -> None:
  """Raises (through `fail(cls, field, value, allowed)`) on a bad value of
  one of these fields; normalises the numbers to floats and the layer
  indices to a sorted tuple."""
  _types(cfg, fail)
  _mla(cfg, fail)
  _full_layers(cfg, fail)
  _rotary_dim(cfg, fail)
  if cfg.qk_norm_over_heads and not cfg.qk_norm:
    fail(
        "ModelConfig",
        "qk_norm_over_heads",
        cfg.qk_norm_over_heads,
        "it shapes the q/k norms: needs qk_norm",
    )
  _llama4(cfg, fail)
  if cfg.rope_type in ("yarn", "llama3") and cfg.rope_original_max_len < 1:
    fail(
        "ModelConfig",
        "rope_original_max_len",
        cfg.rope_original_max_len,
        f"{'YaRN' if cfg.rope_type == 'yarn' else 'llama3 RoPE'} needs the "
        "pretraining context length (>= 1)",
    )
  if cfg.shared_pre_norm and not (
      cfg.post_moe_norms and cfg.moe.shared_experts > 0
  ):
    fail(
        "ModelConfig",
        "shared_pre_norm",
        cfg.shared_pre_norm,
        "needs post_moe_norms and shared experts",
    )
