"""Llama-4's config.json <-> `ModelConfig` (`llama4_text`, transformers'
`Llama4ForCausalLM`, and the text decoder of the multimodal `llama4`
checkpoints, whose fields are under `text_config`).

RoPE layers and NoPE layers (`no_rope_layers`: 1 = RoPE): the NoPE ones
are full causal attention with temperature tuning
(`attn_temperature_tuning`, `floor_scale`, `attn_scale`) and are our
`full_attention_layers` with `full_nope`; the RoPE ones rotate adjacent
lane pairs (`rope_interleave`, with "llama3" scaling or none), attend in
chunks of `attention_chunk_size` and, with `use_qk_norm`, RMS-normalise q
and k without a weight after the rotary embedding. MoE layers
(`moe_layers`, by default every `interleave_moe_layer_step`-th) route each
token to one expert by the top logit, whose sigmoid scales the expert's
INPUT (`weights_on_input`), beside a shared expert of the same width; the
other layers are dense MLPs of `intermediate_size_mlp`. Defaults are
transformers' `Llama4TextConfig`'s (Scout's sizes).

The released configs hold `attn_temperature_tuning: 4`, which transformers
5.25's strict config refuses; any truthy value is read as on, as the
model's code tests it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.hf import fields as f
from linen_moe._src.hf import rope_fields

TEXT_MODEL_TYPE = "llama4_text"
TEXT_ARCHITECTURE = "Llama4ForCausalLM"
MODEL_TYPE = "llama4"
ARCHITECTURE = "Llama4ForConditionalGeneration"
DEFAULT_THETA = 500_000.0
CHUNKED, FULL = "chunked_attention", "full_attention"
# The multimodal checkpoint's vision tower, which the text decoder does not
# read.
TOWER_PREFIXES = ("vision_model.", "multi_modal_projector.")
FIELDS = f.DECODER_FIELDS | {
    "intermediate_size_mlp",
    "hidden_act",
    "rope_scaling",
    "rope_theta",
    "attention_bias",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_layers",
    "interleave_moe_layer_step",
    "use_qk_norm",
    "no_rope_layers",
    "no_rope_layer_interval",
    "attention_chunk_size",
    "layer_types",
    "attn_temperature_tuning",
    "floor_scale",
    "attn_scale",
    "router_jitter_noise",
    "quantization_config",  # the weights on disk, not the model (load.py)
    # no effect on what transformers computes (no aux loss is computed).
    "output_router_logits",
    "router_aux_loss_coef",
    "for_llm_compressor",
}
# The multimodal config's own fields.
OUTER_FIELDS = f.NO_EFFECT | {
    "text_config",
    "vision_config",
    "boi_token_index",
    "eoi_token_index",
    "image_token_index",
    "tie_word_embeddings",
    "dtype",
    "torch_dtype",
}


def text_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The text decoder's config.json fields: `hf` itself (`llama4_text`),
  or the `text_config` of a multimodal `llama4` config (with its dtype)."""
  return f.text_fields(hf, MODEL_TYPE, OUTER_FIELDS, tied_default=False)


def _flags(hf: Mapping, field: str, default: list[int]) -> list[int]:
  value = hf.get(field) or default
  if (
      not isinstance(value, list)
      or len(value) != len(default)
      or any(v not in (0, 1) or isinstance(v, bool) for v in value)
  ):
    raise f.error(field, value, f"expected {len(default)} of 0 / 1")
  return value


def _layers(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
  """Which layers are NoPE (full attention), which are MoE, the chunk."""
  interval = f.read_int(hf, "no_rope_layer_interval", 4)
  default = [int((i + 1) % interval != 0) for i in range(layers)]
  rope = _flags(hf, "no_rope_layers", default)
  chunk = hf.get("attention_chunk_size", 8192)
  chunk = 0 if chunk is None else f.read_int(hf, "attention_chunk_size")
  derived = [CHUNKED if r and chunk else FULL for r in rope]
  types = f.layer_types(hf, derived, (CHUNKED, FULL))
  if types != derived:
    raise f.error(
        "layer_types",
        types,
        "the RoPE layers (no_rope_layers 1) must be chunked, the NoPE ones "
        f"full attention: {derived}",
    )
  step = f.read_int(hf, "interleave_moe_layer_step", 1)
  moe = hf.get("moe_layers")
  moe = list(range(step - 1, layers, step)) if moe is None else moe
  if not isinstance(moe, list) or not all(
      isinstance(i, int) and 0 <= i < layers for i in moe
  ):
    raise f.error("moe_layers", moe, f"expected layer indices < {layers}")
  return {
      "nope": tuple(i for i, r in enumerate(rope) if not r),
      "dense": tuple(i for i in range(layers) if i not in moe),
      "chunk": chunk,
  }


def _check_computation(hf: Mapping[str, Any]) -> None:
  f.zero(hf, "attention_dropout")
  f.zero(hf, "router_jitter_noise")
  k = f.read_int(hf, "num_experts_per_tok", 1)
  if k != 1:
    raise f.error(
        "num_experts_per_tok",
        k,
        "the router's sigmoid scales the chosen expert's input; only one "
        "expert a token is implemented",
    )


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
  """The `ModelConfig` of a Llama-4 config.json (`llama4_text`, or the text
  decoder of a multimodal `llama4`)."""
  hf = text_fields(hf)
  f.check_known(hf, FIELDS, TEXT_MODEL_TYPE)
  _check_computation(hf)
  layers = f.read_int(hf, "num_hidden_layers", 48)
  kinds = _layers(hf, layers)
  nope = kinds["nope"]
  temperature = {}
  if nope and hf.get("attn_temperature_tuning", True):  # released: 4
    temperature = {
        "attention_temperature_floor": f.read_int(hf, "floor_scale", 8192),
        "attention_temperature_scale": f.read_number(hf, "attn_scale", 0.1),
    }
  width = f.read_int(hf, "intermediate_size", 8192)
  bias = f.read_bool(hf, "attention_bias", False)
  dtype = f.dtype_of(hf)
  with f.building_model():
    moe = MoEConfig(
        num_experts=f.read_int(hf, "num_local_experts", 16),
        num_experts_per_tok=1,
        emb_dim=f.read_int(hf, "hidden_size", 5120),
        moe_mlp_dim=width,
        mlp_activations=(f.activation(hf, "hidden_act", "silu"), "linear"),
        shared_experts=1,
        shared_mlp_dim=width,
        routing="topk_then_sigmoid",
        weights_on_input=True,
        load_balance_loss_weight=0.0,
        dtype=dtype,
        param_dtype=dtype,
    )
    dense = kinds["dense"]
    return ModelConfig(
        moe=moe,
        vocab_size=f.read_int(hf, "vocab_size", 202048),
        num_layers=layers,
        num_heads=f.read_int(hf, "num_attention_heads", 40),
        head_dim=f.read_int(hf, "head_dim", 128),
        num_kv_heads=f.read_int(hf, "num_key_value_heads", 8),
        norm_eps=f.norm_eps(hf, 1e-5),
        tie_embeddings=f.read_bool(hf, "tie_word_embeddings", False),
        scale_embeddings=False,
        dense_layers=dense,
        dense_mlp_dim=f.read_int(hf, "intermediate_size_mlp", 16384)
        if dense
        else 0,
        rope_interleave=True,
        attention_chunk=kinds["chunk"],
        full_attention_layers=nope,
        full_nope=bool(nope),
        qk_norm_after_rope=f.read_bool(hf, "use_qk_norm", True),
        attention_qkv_bias=bias,
        attention_out_bias=bias,
        **temperature,
        **rope_fields.read(hf, DEFAULT_THETA, kinds=("default", "llama3")),
    )


# The fields (and values) that make a `ModelConfig` a Llama-4 text decoder.
_FIXED = {
    "rope_interleave": True,
    "qk_norm": False,
    "kv_lora_rank": 0,
    "scale_embeddings": False,
    "router_input_norm": False,
    "post_moe_norms": False,
    "value_norm": False,
    "sliding_window": 0,
    "attention_scale": 0.0,
    "final_logit_softcap": 0.0,
    "post_attention_norm": False,
    "post_mlp_norm": False,
    "layer_scalar": False,
    "attention_sinks": False,
    "rotary_dim": 0,
    "full_head_dim": 0,
    "full_kv_heads": 0,
    "full_rope_base": 0.0,
    "full_rope_fraction": 1.0,
    "full_k_eq_v": False,
}
_FIXED_MOE = {
    "routing": "topk_then_sigmoid",
    "weights_on_input": True,
    "norm_topk_prob": False,
    "shared_experts": 1,
    "routed_bias": False,
    "per_expert_scale": False,
    "num_routing_groups": 1,
    "routed_scaling_factor": 1.0,
    "router_bias": False,
    "expert_bias": False,
}


def unsupported(config: ModelConfig) -> list[str]:
  """What a Llama-4 config.json needs that `config` has not, one
  `field=needed (this config: value)` each; [] when it says `config`."""
  moe = config.moe
  bad = f.differing(config, _FIXED, _FIXED_MOE)
  if moe.shared_mlp_dim != moe.moe_mlp_dim:
    bad.append(
        f"shared_mlp_dim=moe_mlp_dim={moe.moe_mlp_dim} (this config: "
        f"{moe.shared_mlp_dim})"
    )
  if config.full_attention_layers and not config.full_nope:
    bad.append(
        "full_nope=True, the full_attention_layers being Llama-4's layers "
        "without RoPE (this config: False)"
    )
  if config.attention_qkv_bias != config.attention_out_bias:
    bad.append(
        "attention_out_bias=attention_qkv_bias, config.json's one "
        f"attention_bias (this config: {config.attention_out_bias}, "
        f"attention_qkv_bias={config.attention_qkv_bias})"
    )
  if config.rope_type not in ("default", "llama3"):
    bad.append(
        f"rope_type='default' or 'llama3' (this config: {config.rope_type!r})"
    )
  if moe.mlp_activations[0] not in f.ACTIVATION_NAMES:
    bad.append(
        f"mlp_activations[0] in {sorted(f.ACTIVATION_NAMES)} (this config: "
        f"{moe.mlp_activations[0]!r})"
    )
  return bad


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
  """config.json (transformers 5 style, `llama4_text`) of a Llama-4
  `ModelConfig`, every layer list explicit."""
  moe = config.moe
  nope = set(config.full_attention_layers)
  chunk = config.attention_chunk
  rope = [int(i not in nope) for i in range(config.num_layers)]
  tuning = config.attention_temperature_floor > 0
  return f.common_json(config, TEXT_MODEL_TYPE, TEXT_ARCHITECTURE, dtype) | {
      "intermediate_size": moe.moe_mlp_dim,
      "intermediate_size_mlp": config.dense_mlp_dim or moe.moe_mlp_dim,
      "hidden_act": f.ACTIVATION_NAMES[moe.mlp_activations[0]],
      "rope_parameters": rope_fields.to_json(config),
      "max_position_embeddings": rope_fields.max_positions(config),
      "attention_bias": config.attention_qkv_bias,
      "num_local_experts": moe.num_experts,
      "num_experts_per_tok": 1,
      "moe_layers": [
          i for i in range(config.num_layers) if i not in config.dense_layers
      ],
      "interleave_moe_layer_step": 1,
      "use_qk_norm": config.qk_norm_after_rope,
      "no_rope_layers": rope,
      "no_rope_layer_interval": 4,
      "attention_chunk_size": chunk or None,
      "layer_types": [CHUNKED if r and chunk else FULL for r in rope],
      "attn_temperature_tuning": tuning,
      "floor_scale": config.attention_temperature_floor if tuning else 8192,
      "attn_scale": config.attention_temperature_scale if tuning else 0.1,
      "router_jitter_noise": 0.0,
  }
