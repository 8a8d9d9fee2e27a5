"""DeepSeek-V3's config.json <-> `ModelConfig` (`model_type: deepseek_v3`).

Multi-head latent attention (`kv_lora_rank`, `q_lora_rank`, the three head
widths), YaRN or default RoPE with `rope_interleave`, `first_k_dense_replace`
dense layers of `intermediate_size`, then MoE layers: sigmoid routing of
`n_routed_experts` in `n_group` groups (top `topk_group`), the selection-only
`e_score_correction_bias` (`routed_bias`, kept training by the aux-loss-free
rule at DeepSeek-V3's rate 0.001), `routed_scaling_factor`, `norm_topk_prob`,
and `n_shared_experts` shared experts of `moe_intermediate_size`. Every
default is transformers' `DeepseekV3Config`'s (the released model's sizes).
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.hf import fields as f

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# DeepSeek-V3's bias update speed (its paper's gamma), so that the loaded
# `e_score_correction_bias` keeps balancing the experts when fine-tuned.
ROUTED_BIAS_UPDATE_RATE = 0.001
# The config.json fields that a released checkpoint carries, each read here
# (or known to change nothing transformers computes: training-only losses,
# parallelism, the multi-token-prediction layers it never builds).
FIELDS = f.NO_EFFECT | {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "n_shared_experts",
    "n_routed_experts",
    "routed_scaling_factor",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "qk_head_dim",
    "v_head_dim",
    "head_dim",
    "n_group",
    "topk_group",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "norm_topk_prob",
    "hidden_act",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "rope_interleave",
    "attention_bias",
    "attention_dropout",
    "dtype",
    "torch_dtype",
    "quantization_config",  # the weights on disk, not the model (load.py)
    "moe_layer_freq",
    "scoring_func",
    "topk_method",
    # no effect on what transformers computes:
    "num_nextn_predict_layers",
    "num_mtp_layers",
    "output_router_logits",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "pretraining_tp",
    "auto_map",
}
_YARN_KEYS = frozenset({
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
})


def mtp_layers(hf: Mapping[str, Any]) -> int:
  """The multi-token-prediction layers a checkpoint holds past
  `num_hidden_layers` (transformers builds none of them)."""
  value = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
  return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The `ModelConfig` rotary fields, from either config.json style."""
  field, params = f.rope_parameters(hf)
  kind = f.rope_type(params)
  base = f.theta(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  out: dict[str, Any] = {
      "rope_max_wavelength": base,
      "rope_interleave": f.read_bool(hf, "rope_interleave", True),
  }
  if kind == "default":
    f.check_keys(field, params, {"rope_type", "type", "rope_theta"})
    return out
  if kind != "yarn":
    raise f.error(
        f"{field}.rope_type", kind, "only 'default' and 'yarn' are implemented"
    )
  f.check_keys(field, params, _YARN_KEYS)
  key = "original_max_position_embeddings"
  original = params.get(key) or hf.get("max_position_embeddings", 4096)
  if (
      isinstance(original, bool)
      or not isinstance(original, int)
      or original < 1
  ):
    raise f.error(f"{field}.{key}", original, "expected an integer >= 1")
  factor = params.get("factor")
  if factor is None:  # transformers: the ratio of the context lengths
    factor = f.read_int(hf, "max_position_embeddings", 4096) / original
  if isinstance(factor, bool) or not isinstance(factor, (int, float)):
    raise f.error(f"{field}.factor", factor, "expected a number")
  return out | {
      "rope_type": "yarn",
      "rope_factor": float(factor),
      "rope_original_max_len": original,
      "rope_beta_fast": float(params.get("beta_fast") or 32),
      "rope_beta_slow": float(params.get("beta_slow") or 1),
      "rope_mscale": float(params.get("mscale") or 0.0),
      "rope_mscale_all_dim": float(params.get("mscale_all_dim") or 0.0),
  }


def _check_computation(hf: Mapping[str, Any]) -> None:
  """Fields whose other values change what transformers computes, or that
  transformers' model ignores though the original code read them."""
  if hf.get("attention_bias", False):
    raise f.error("attention_bias", hf["attention_bias"], "no biases")
  f.zero(hf, "attention_dropout")
  f.require(hf, "moe_layer_freq", (1,), 1)
  f.require(hf, "scoring_func", ("sigmoid",), "sigmoid")
  f.require(hf, "topk_method", ("noaux_tc",), "noaux_tc")
  heads = f.read_int(hf, "num_attention_heads", 128)
  kv = hf.get("num_key_value_heads")
  if kv is not None and kv != heads:
    raise f.error(
        "num_key_value_heads",
        kv,
        "MLA expands keys and values to every head: must be "
        f"num_attention_heads={heads}",
    )


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
  """The `ModelConfig` of a DeepSeek-V3 config.json (either style)."""
  f.check_known(hf, FIELDS, MODEL_TYPE)
  _check_computation(hf)
  dn = f.read_int(hf, "qk_nope_head_dim", 128)
  dr = f.read_int(hf, "qk_rope_head_dim", 64)
  for field, value in (("head_dim", dr), ("qk_head_dim", dn + dr)):
    if hf.get(field) is not None and hf[field] != value:
      raise f.error(field, hf[field], f"transformers sets it to {value}")
  q_rank = hf.get("q_lora_rank", 1536)
  q_rank = 0 if q_rank is None else f.read_int(hf, "q_lora_rank")
  layers = f.read_int(hf, "num_hidden_layers", 61)
  dense = min(f.read_int(hf, "first_k_dense_replace", 3, minimum=0), layers)
  width = f.read_int(hf, "moe_intermediate_size", 2048)
  dtype = f.dtype_of(hf)
  with f.building_model():
    moe = MoEConfig(
        num_experts=f.read_int(hf, "n_routed_experts", 256),
        num_experts_per_tok=f.read_int(hf, "num_experts_per_tok", 8),
        emb_dim=f.read_int(hf, "hidden_size", 7168),
        moe_mlp_dim=width,
        mlp_activations=(f.activation(hf, "hidden_act", "silu"), "linear"),
        shared_experts=f.read_int(hf, "n_shared_experts", 1),
        shared_mlp_dim=width,
        routing="sigmoid_then_topk",
        norm_topk_prob=f.read_bool(hf, "norm_topk_prob", True),
        routed_scaling_factor=f.read_number(hf, "routed_scaling_factor", 2.5),
        num_routing_groups=f.read_int(hf, "n_group", 8),
        topk_routing_group=f.read_int(hf, "topk_group", 4),
        routed_bias=True,
        routed_bias_update_rate=ROUTED_BIAS_UPDATE_RATE,
        load_balance_loss_weight=0.0,
        dtype=dtype,
        param_dtype=dtype,
    )
    return ModelConfig(
        moe=moe,
        vocab_size=f.read_int(hf, "vocab_size", 129280),
        num_layers=layers,
        num_heads=f.read_int(hf, "num_attention_heads", 128),
        norm_eps=f.norm_eps(hf),
        tie_embeddings=f.read_bool(hf, "tie_word_embeddings", False),
        scale_embeddings=False,
        dense_layers=tuple(range(dense)),
        dense_mlp_dim=f.read_int(hf, "intermediate_size", 18432)
        if dense
        else 0,
        kv_lora_rank=f.read_int(hf, "kv_lora_rank", 512),
        q_lora_rank=q_rank,
        qk_nope_head_dim=dn,
        qk_rope_head_dim=dr,
        v_head_dim=f.read_int(hf, "v_head_dim", 128),
        **_rope(hf),
    )


# The fields (and values) a DeepSeek-V3 config.json cannot change.
_FIXED = {
    "scale_embeddings": False,
    "router_input_norm": False,
    "post_moe_norms": False,
    "sliding_window": 0,
    "attention_scale": 0.0,
    "final_logit_softcap": 0.0,
    "post_attention_norm": False,
    "post_mlp_norm": False,
    "layer_scalar": False,
}
_FIXED_MOE = {
    "routing": "sigmoid_then_topk",
    "routed_bias": True,
    "per_expert_scale": False,
}


def unsupported(config: ModelConfig) -> list[str]:
  """The fields of `config` that a DeepSeek-V3 config.json cannot say."""
  moe = config.moe
  bad = []
  if not config.kv_lora_rank:
    bad.append(
        "kv_lora_rank >= 1, multi-head latent attention (this config: 0)"
    )
  bad += f.differing(config, _FIXED, _FIXED_MOE)
  if moe.shared_experts < 1 or moe.shared_mlp_dim != moe.moe_mlp_dim:
    bad.append(
        "shared_experts >= 1 of shared_mlp_dim=moe_mlp_dim (this config: "
        f"{moe.shared_experts} of {moe.shared_mlp_dim}, moe_mlp_dim="
        f"{moe.moe_mlp_dim})"
    )
  if config.dense_layers != tuple(range(len(config.dense_layers))):
    bad.append(
        "dense_layers a prefix (0, 1, ...) (this config: "
        f"{config.dense_layers})"
    )
  if moe.mlp_activations[0] not in f.ACTIVATION_NAMES:
    bad.append(
        f"mlp_activations[0] in {sorted(f.ACTIVATION_NAMES)} (this config: "
        f"{moe.mlp_activations[0]!r})"
    )
  return bad


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
  """config.json (transformers 5 style) of a DeepSeek-V3 `ModelConfig`."""
  moe = config.moe
  rope: dict[str, Any] = {
      "rope_theta": config.rope_max_wavelength,
      "rope_type": config.rope_type,
  }
  if config.rope_type == "yarn":
    rope |= {
        "factor": config.rope_factor,
        "original_max_position_embeddings": config.rope_original_max_len,
        "beta_fast": config.rope_beta_fast,
        "beta_slow": config.rope_beta_slow,
    }
    for key, value in (
        ("mscale", config.rope_mscale),
        ("mscale_all_dim", config.rope_mscale_all_dim),
    ):
      if value:
        rope[key] = value
  dn, dr = config.qk_nope_head_dim, config.qk_rope_head_dim
  max_len = max(4096, config.rope_original_max_len)
  if config.rope_type == "yarn":
    max_len = math.ceil(config.rope_original_max_len * config.rope_factor)
  return {
      "architectures": [ARCHITECTURE],
      "model_type": MODEL_TYPE,
      "vocab_size": config.vocab_size,
      "hidden_size": moe.emb_dim,
      "intermediate_size": config.dense_mlp_dim or moe.moe_mlp_dim,
      "moe_intermediate_size": moe.moe_mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_heads,
      "n_shared_experts": moe.shared_experts,
      "n_routed_experts": moe.num_experts,
      "routed_scaling_factor": moe.routed_scaling_factor,
      "kv_lora_rank": config.kv_lora_rank,
      "q_lora_rank": config.q_lora_rank or None,
      "qk_rope_head_dim": dr,
      "qk_nope_head_dim": dn,
      "qk_head_dim": dn + dr,
      "head_dim": dr,
      "v_head_dim": config.v_head_dim,
      "n_group": moe.num_routing_groups,
      "topk_group": moe.topk_routing_group,
      "num_experts_per_tok": moe.num_experts_per_tok,
      "first_k_dense_replace": len(config.dense_layers),
      "norm_topk_prob": moe.norm_topk_prob,
      "hidden_act": f.ACTIVATION_NAMES[moe.mlp_activations[0]],
      "rms_norm_eps": config.norm_eps,
      "tie_word_embeddings": config.tie_embeddings,
      "rope_parameters": rope,
      "rope_interleave": config.rope_interleave,
      "max_position_embeddings": max_len,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "num_nextn_predict_layers": 0,
      "dtype": dtype,
      "bos_token_id": None,
      "eos_token_id": None,
      "pad_token_id": None,
  }
