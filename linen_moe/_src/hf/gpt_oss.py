"""GPT-OSS's config.json <-> `ModelConfig` and its tensors
(`model_type: gpt_oss`, transformers' `GptOssForCausalLM`).

Sliding-window and full-attention layers (`layer_types`, `sliding_window`),
a learned sink logit per query head in every softmax (`attention_sinks`),
biases on q, k, v and o (`attention_bias`), YaRN on every layer (by default
GPT-OSS's own: factor 32, `truncate: false`), top-k of the biased router
logits then a softmax over them, and experts with biases and the clamped
SwiGLU (`swiglu_alpha`, `swiglu_limit`). Defaults are transformers'
`GptOssConfig`'s (the released 120B's sizes).

Tensors are stored as transformers holds them (no conversion on save):
`mlp.router.{weight, bias}`; the experts fused and x @ W,
`mlp.experts.gate_up_proj` [E, M, 2H] whose gate and up columns are
interleaved (gate 0::2, up 1::2, and so its bias [E, 2H]),
`mlp.experts.down_proj` [E, H, M] and its bias [E, M]; the released MXFP4
experts (`*_blocks`, `*_scales`) are read through `mxfp4.py`. The names
are data (`families.GPT_OSS`, its "interleaved_columns" experts layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.hf import fields as f
from linen_moe._src.hf import rope_fields

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = 150000.0
# `GptOssConfig.__post_init__`'s rotary parameters when config.json has none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
FIELDS = f.DECODER_FIELDS | {
    "rope_scaling",
    "rope_theta",
    "sliding_window",
    "layer_types",
    "attention_bias",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "swiglu_alpha",
    "swiglu_limit",
    "output_router_logits",
    "router_aux_loss_coef",
    # no effect on what transformers computes: `GptOssExperts` reads no
    # `hidden_act`; the released file's `experts_per_token` duplicates
    # `num_experts_per_tok`; the pretraining context length.
    "hidden_act",
    "experts_per_token",
    "initial_context_length",
    "quantization_config",  # the weights on disk, not the model (load.py)
}


def _layer_types(hf: Mapping[str, Any], layers: int) -> list[str]:
  """transformers': sliding at even indices, full at odd, by default."""
  default = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
  return f.layer_types(hf, default, (SLIDING, FULL))


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
  """The `ModelConfig` of a GPT-OSS config.json (either style)."""
  f.check_known(hf, FIELDS, MODEL_TYPE)
  f.zero(hf, "attention_dropout")
  layers = f.read_int(hf, "num_hidden_layers", 36)
  types = _layer_types(hf, layers)
  sliding = SLIDING in types
  window = f.read_int(hf, "sliding_window", 128) if sliding else 0
  full = tuple(i for i, t in enumerate(types) if t == FULL) if sliding else ()
  heads = f.read_int(hf, "num_attention_heads", 64)
  kv = hf.get("num_key_value_heads")
  kv = heads if kv is None else f.read_int(hf, "num_key_value_heads")
  bias = f.read_bool(hf, "attention_bias", True)
  balance = 0.0
  if f.read_bool(hf, "output_router_logits", False):
    balance = f.read_number(hf, "router_aux_loss_coef", 0.001)
  experts = f.num_experts_field(hf)
  dtype = f.dtype_of(hf)
  with f.building_model():
    moe = MoEConfig(
        num_experts=f.read_int(hf, experts, 128),
        num_experts_per_tok=f.read_int(hf, "num_experts_per_tok", 4),
        emb_dim=f.read_int(hf, "hidden_size", 2880),
        moe_mlp_dim=f.read_int(hf, "intermediate_size", 2880),
        mlp_activations=("clamped_swiglu", "linear"),
        swiglu_alpha=f.read_number(hf, "swiglu_alpha", 1.702, low=0.0),
        swiglu_limit=f.read_number(hf, "swiglu_limit", 7.0, low=0.0),
        routing="topk_then_softmax",
        router_bias=True,
        expert_bias=True,
        load_balance_loss_weight=balance,
        dtype=dtype,
        param_dtype=dtype,
    )
    return ModelConfig(
        moe=moe,
        vocab_size=f.read_int(hf, "vocab_size", 201088),
        num_layers=layers,
        num_heads=heads,
        head_dim=f.read_int(hf, "head_dim", 64),
        num_kv_heads=kv,
        norm_eps=f.norm_eps(hf, 1e-5),
        tie_embeddings=f.read_bool(hf, "tie_word_embeddings", False),
        scale_embeddings=False,
        sliding_window=window,
        full_attention_layers=full,
        attention_sinks=True,
        attention_qkv_bias=bias,
        attention_out_bias=bias,
        **rope_fields.read(hf, DEFAULT_THETA, DEFAULT_ROPE),
    )


# The fields (and values) that make a `ModelConfig` a GPT-OSS decoder.
_FIXED = {
    "attention_sinks": True,
    "scale_embeddings": False,
    "router_input_norm": False,
    "post_moe_norms": False,
    "qk_norm": False,
    "value_norm": False,
    "kv_lora_rank": 0,
    "dense_layers": (),
    "rope_interleave": False,
    "attention_scale": 0.0,
    "final_logit_softcap": 0.0,
    "post_attention_norm": False,
    "post_mlp_norm": False,
    "layer_scalar": False,
    "full_head_dim": 0,
    "full_kv_heads": 0,
    "full_rope_base": 0.0,
    "full_rope_fraction": 1.0,
    "full_k_eq_v": False,
    "rotary_dim": 0,
}
_FIXED_MOE = {
    "mlp_activations": ("clamped_swiglu", "linear"),
    "routing": "topk_then_softmax",
    "router_bias": True,
    "expert_bias": True,
    "shared_experts": 0,
    "routed_bias": False,
    "per_expert_scale": False,
    "num_routing_groups": 1,
    "routed_scaling_factor": 1.0,
}


def unsupported(config: ModelConfig) -> list[str]:
  """What a GPT-OSS config.json needs that `config` has not, one
  `field=needed (this config: value)` each; [] when it says `config`."""
  bad = f.differing(config, _FIXED | f.NO_LLAMA4, _FIXED_MOE | f.NO_LLAMA4_MOE)
  if config.attention_qkv_bias != config.attention_out_bias:
    bad.append(
        "attention_out_bias=attention_qkv_bias, config.json's one "
        f"attention_bias (this config: {config.attention_out_bias}, "
        f"attention_qkv_bias={config.attention_qkv_bias})"
    )
  if config.full_attention_layers and not config.sliding_window:
    bad.append(
        "sliding_window >= 1 on the layers not in full_attention_layers "
        "(this config: 0)"
    )
  bad += f.llama3_rope(config)
  return bad


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
  """config.json (transformers 5 style) of a GPT-OSS `ModelConfig`."""
  moe = config.moe
  full = set(config.full_attention_layers)
  sliding = config.sliding_window > 0
  types = [
      SLIDING if sliding and i not in full else FULL
      for i in range(config.num_layers)
  ]
  return f.common_json(config, MODEL_TYPE, ARCHITECTURE, dtype) | {
      "intermediate_size": moe.moe_mlp_dim,
      "rope_parameters": rope_fields.to_json(config),
      "max_position_embeddings": rope_fields.max_positions(config),
      "sliding_window": config.sliding_window or 128,
      "layer_types": types,
      "attention_bias": config.attention_qkv_bias,
      "num_local_experts": moe.num_experts,
      "num_experts_per_tok": moe.num_experts_per_tok,
      "swiglu_alpha": moe.swiglu_alpha,
      "swiglu_limit": moe.swiglu_limit,
      "output_router_logits": moe.load_balance_loss_weight > 0,
      "router_aux_loss_coef": moe.load_balance_loss_weight or 0.001,
  }
