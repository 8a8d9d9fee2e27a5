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
from typing import Any

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.hf import fields as f
from linen_moe._src.hf import rope_fields

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# DeepSeek-V3's bias update speed (its paper's gamma), so that the loaded
# `e_score_correction_bias` keeps balancing the experts when fine-tuned.
ROUTED_BIAS_UPDATE_RATE = 0.001
# The config.json fields that a released checkpoint carries, each read here
# (or known to change nothing transformers computes: training-only losses,
# parallelism, the multi-token-prediction layers it never builds).
FIELDS = f.DECODER_FIELDS | {
    "moe_intermediate_size",
    "n_shared_experts",
    "n_routed_experts",
    "routed_scaling_factor",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "qk_head_dim",
    "v_head_dim",
    "n_group",
    "topk_group",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "norm_topk_prob",
    "hidden_act",
    "rope_scaling",
    "rope_theta",
    "rope_interleave",
    "attention_bias",
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


def mtp_layers(hf: Mapping[str, Any]) -> int:
  """The multi-token-prediction layers a checkpoint holds past
  `num_hidden_layers` (transformers builds none of them)."""
  value = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
  return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The `ModelConfig` rotary fields, from either config.json style."""
  out = rope_fields.read(hf, 10000.0)
  return out | {"rope_interleave": f.read_bool(hf, "rope_interleave", True)}


# `DeepseekV3Config`'s defaults of the keys `sigmoid_moe` and
# `leading_dense` read.
DEFAULTS = {
    "hidden_size": 7168,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "intermediate_size": 18432,
}


def sigmoid_moe(hf: Mapping[str, Any], defaults: Mapping) -> dict[str, Any]:
  """The `MoEConfig` fields of DeepSeek-V3's MoE, which GLM-4.5 shares:
  sigmoid scores with the selection-only `e_score_correction_bias`
  (`routed_bias`), `n_group` / `topk_group`, `routed_scaling_factor`,
  `norm_topk_prob`, and `n_shared_experts` of `moe_intermediate_size`.
  `defaults`: the family's config defaults of those keys."""
  width = f.read_int(
      hf, "moe_intermediate_size", defaults["moe_intermediate_size"]
  )
  experts = (
      "n_routed_experts" if "n_routed_experts" in hf else "num_local_experts"
  )
  dtype = f.dtype_of(hf)
  return {
      "num_experts": f.read_int(hf, experts, defaults["n_routed_experts"]),
      "num_experts_per_tok": f.read_int(
          hf, "num_experts_per_tok", defaults["num_experts_per_tok"]
      ),
      "emb_dim": f.read_int(hf, "hidden_size", defaults["hidden_size"]),
      "moe_mlp_dim": width,
      "mlp_activations": (f.activation(hf, "hidden_act", "silu"), "linear"),
      "shared_experts": f.read_int(
          hf, "n_shared_experts", defaults["n_shared_experts"]
      ),
      "shared_mlp_dim": width,
      "routing": "sigmoid_then_topk",
      "norm_topk_prob": f.read_bool(
          hf, "norm_topk_prob", defaults["norm_topk_prob"]
      ),
      "routed_scaling_factor": f.read_number(
          hf, "routed_scaling_factor", defaults["routed_scaling_factor"]
      ),
      "num_routing_groups": f.read_int(hf, "n_group", defaults["n_group"]),
      "topk_routing_group": f.read_int(
          hf, "topk_group", defaults["topk_group"]
      ),
      "routed_bias": True,
      "load_balance_loss_weight": 0.0,
      "dtype": dtype,
      "param_dtype": dtype,
  }


def leading_dense(
    hf: Mapping[str, Any], layers: int, defaults: Mapping
) -> dict[str, Any]:
  """`dense_layers` (the first `first_k_dense_replace`) and their
  `dense_mlp_dim` (`intermediate_size`)."""
  k = f.read_int(
      hf, "first_k_dense_replace", defaults["first_k_dense_replace"], minimum=0
  )
  dense = min(k, layers)
  width = 0
  if dense:
    width = f.read_int(hf, "intermediate_size", defaults["intermediate_size"])
  return {"dense_layers": tuple(range(dense)), "dense_mlp_dim": width}


def moe_json(config: ModelConfig) -> dict[str, Any]:
  """The config.json keys of `sigmoid_moe` and `leading_dense`."""
  moe = config.moe
  return {
      "intermediate_size": config.dense_mlp_dim or moe.moe_mlp_dim,
      "moe_intermediate_size": moe.moe_mlp_dim,
      "n_shared_experts": moe.shared_experts,
      "n_routed_experts": moe.num_experts,
      "routed_scaling_factor": moe.routed_scaling_factor,
      "n_group": moe.num_routing_groups,
      "topk_group": moe.topk_routing_group,
      "num_experts_per_tok": moe.num_experts_per_tok,
      "first_k_dense_replace": len(config.dense_layers),
      "norm_topk_prob": moe.norm_topk_prob,
      "hidden_act": f.ACTIVATION_NAMES[moe.mlp_activations[0]],
  }


def moe_unsupported(config: ModelConfig) -> list[str]:
  """What `sigmoid_moe` and `leading_dense` need that `config` has not,
  one `field=needed (this config: value)` each."""
  moe, bad = config.moe, []
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
  with f.building_model():
    moe = MoEConfig(
        **sigmoid_moe(hf, DEFAULTS),
        routed_bias_update_rate=ROUTED_BIAS_UPDATE_RATE,
    )
    return ModelConfig(
        moe=moe,
        vocab_size=f.read_int(hf, "vocab_size", 129280),
        num_layers=layers,
        num_heads=f.read_int(hf, "num_attention_heads", 128),
        norm_eps=f.norm_eps(hf),
        tie_embeddings=f.read_bool(hf, "tie_word_embeddings", False),
        scale_embeddings=False,
        **leading_dense(hf, layers, DEFAULTS),
        kv_lora_rank=f.read_int(hf, "kv_lora_rank", 512),
        q_lora_rank=q_rank,
        qk_nope_head_dim=dn,
        qk_rope_head_dim=dr,
        v_head_dim=f.read_int(hf, "v_head_dim", 128),
        **_rope(hf),
    )


# The fields (and values) a DeepSeek-V3 config.json cannot change.
FIXED = {
    "scale_embeddings": False,
    "router_input_norm": False,
    "post_moe_norms": False,
    "sliding_window": 0,
    "attention_scale": 0.0,
    "final_logit_softcap": 0.0,
    "post_attention_norm": False,
    "post_mlp_norm": False,
    "layer_scalar": False,
    "attention_sinks": False,
    "attention_qkv_bias": False,
    "attention_out_bias": False,
}
FIXED_MOE = {
    "routing": "sigmoid_then_topk",
    "routed_bias": True,
    "per_expert_scale": False,
    "router_bias": False,
    "expert_bias": False,
}


def unsupported(config: ModelConfig) -> list[str]:
  """What a DeepSeek-V3 config.json needs that `config` has not, one
  `field=needed (this config: value)` each; [] when it says `config`."""
  bad = []
  if not config.kv_lora_rank:
    bad.append(
        "kv_lora_rank >= 1, multi-head latent attention (this config: 0)"
    )
  bad += f.differing(config, FIXED | f.NO_LLAMA4, FIXED_MOE | f.NO_LLAMA4_MOE)
  bad += f.llama3_rope(config)
  return bad + moe_unsupported(config)


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
  """config.json (transformers 5 style) of a DeepSeek-V3 `ModelConfig`."""
  moe = config.moe
  rope = rope_fields.to_json(config)
  dn, dr = config.qk_nope_head_dim, config.qk_rope_head_dim
  max_len = rope_fields.max_positions(config)
  return {
      "architectures": [ARCHITECTURE],
      "model_type": MODEL_TYPE,
      "vocab_size": config.vocab_size,
      "hidden_size": moe.emb_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_heads,
      **moe_json(config),
      "kv_lora_rank": config.kv_lora_rank,
      "q_lora_rank": config.q_lora_rank or None,
      "qk_rope_head_dim": dr,
      "qk_nope_head_dim": dn,
      "qk_head_dim": dn + dr,
      "head_dim": dr,
      "v_head_dim": config.v_head_dim,
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
