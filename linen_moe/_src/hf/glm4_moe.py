"""GLM-4.5's config.json <-> `ModelConfig` (`model_type: glm4_moe`,
transformers' `Glm4MoeForCausalLM`: GLM-4.5, GLM-4.6, GLM-4.5-Air).

Grouped-query attention with an explicit `head_dim`, q/k/v biases
(`attention_bias`), optional per-head q/k RMSNorm before the rotary
embedding (`use_qk_norm`), partial rotary (`partial_rotary_factor`, 0.5
when config.json gives none: the first int(head_dim * factor) dims rotate
with frequencies over that width), `first_k_dense_replace` dense layers of
`intermediate_size`, then DeepSeek-V3's MoE (`deepseek.sigmoid_moe`):
sigmoid routing with the selection-only `e_score_correction_bias`, groups,
`routed_scaling_factor`, `norm_topk_prob` and `n_shared_experts` shared
experts. Defaults are transformers' `Glm4MoeConfig`'s (GLM-4.5-Air's
sizes). The tensors are named as DeepSeek-V3's (per expert on the hub);
the multi-token-prediction layer a released checkpoint keeps past
`num_hidden_layers` is skipped with a warning, as transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.hf import deepseek
from linen_moe._src.hf import fields as f
from linen_moe._src.hf import rope_fields

MODEL_TYPE = "glm4_moe"
ARCHITECTURE = "Glm4MoeForCausalLM"
DEFAULT_THETA = 10000.0
# GLM-4.5 trained its selection bias at 0.001 and froze it (rate 0) for its
# last tokens; fine-tuning goes on from there (a run field: change it).
ROUTED_BIAS_UPDATE_RATE = 0.0
DEFAULTS = {
    "hidden_size": 4096,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "intermediate_size": 10944,
}
FIELDS = f.DECODER_FIELDS | {
    "moe_intermediate_size",
    "hidden_act",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "attention_bias",
    "use_qk_norm",
    "n_routed_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "norm_topk_prob",
    "quantization_config",  # the weights on disk, not the model (load.py)
    # no effect on what transformers computes: the MTP layers it never
    # builds, the training-only aux loss.
    "num_nextn_predict_layers",
    "num_mtp_layers",
    "output_router_logits",
    "router_aux_loss_coef",
}


def mtp_layers(hf: Mapping[str, Any]) -> int:
  """The multi-token-prediction layers a checkpoint holds past
  `num_hidden_layers` (transformers builds none of them)."""
  return deepseek.mtp_layers(hf)


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
  """The `ModelConfig` of a GLM-4.5 config.json (either style)."""
  f.check_known(hf, FIELDS, MODEL_TYPE)
  f.zero(hf, "attention_dropout")
  emb = f.read_int(hf, "hidden_size", DEFAULTS["hidden_size"])
  heads = f.read_int(hf, "num_attention_heads", 96)
  head_dim = hf.get("head_dim")
  head_dim = emb // heads if head_dim is None else f.read_int(hf, "head_dim")
  layers = f.read_int(hf, "num_hidden_layers", 46)
  with f.building_model():
    moe = MoEConfig(
        **deepseek.sigmoid_moe(hf, DEFAULTS),
        routed_bias_update_rate=ROUTED_BIAS_UPDATE_RATE,
    )
    return ModelConfig(
        moe=moe,
        vocab_size=f.read_int(hf, "vocab_size", 151552),
        num_layers=layers,
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=f.read_int(hf, "num_key_value_heads", 8),
        norm_eps=f.norm_eps(hf, 1e-5),
        qk_norm=f.read_bool(hf, "use_qk_norm", False),
        attention_qkv_bias=f.read_bool(hf, "attention_bias", False),
        tie_embeddings=f.read_bool(hf, "tie_word_embeddings", False),
        scale_embeddings=False,
        **deepseek.leading_dense(hf, layers, DEFAULTS),
        **rope_fields.read(
            hf, DEFAULT_THETA, head_dim=head_dim, partial_default=0.5
        ),
    )


# The fields (and values) a GLM-4.5 config.json cannot change: DeepSeek-V3's
# less the q/k/v biases, and its multi-head latent attention's own.
_FIXED = {k: v for k, v in deepseek.FIXED.items() if k != "attention_qkv_bias"}
_FIXED |= {
    "kv_lora_rank": 0,
    "rope_interleave": False,
    "value_norm": False,
    "full_attention_layers": (),
    "qk_norm_over_heads": False,
}


def unsupported(config: ModelConfig) -> list[str]:
  """What a GLM-4.5 config.json needs that `config` has not, one
  `field=needed (this config: value)` each; [] when it says `config`."""
  bad = f.differing(
      config,
      _FIXED | f.NO_LLAMA4,
      deepseek.FIXED_MOE | f.NO_LLAMA4_MOE,
  )
  bad += f.llama3_rope(config)
  return bad + deepseek.moe_unsupported(config)


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
  """config.json (transformers 5 style) of a GLM-4.5 `ModelConfig`."""
  return f.common_json(config, MODEL_TYPE, ARCHITECTURE, dtype) | {
      **deepseek.moe_json(config),
      "rope_parameters": rope_fields.to_json(config, partial=True),
      "max_position_embeddings": rope_fields.max_positions(config),
      "attention_bias": config.attention_qkv_bias,
      "use_qk_norm": config.qk_norm,
      "num_nextn_predict_layers": 0,
  }
