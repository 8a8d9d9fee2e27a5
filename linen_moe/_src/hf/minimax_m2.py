"""MiniMax-M2's config.json <-> `ModelConfig` (`model_type: minimax_m2`,
transformers' `MiniMaxM2ForCausalLM`).

Grouped-query attention with an explicit `head_dim` and no biases, q and k
each RMS-normalised over all their heads at once before the rotary
embedding (`qk_norm_over_heads`: weights [N * D], [K * D]), partial rotary
(the legacy `rotary_dim`, or `partial_rotary_factor`), and in every layer
Mixtral-style experts (`intermediate_size` wide, the hub's `w1`, `w3`,
`w2`) chosen by sigmoid scores plus the selection-only
`e_score_correction_bias` (kept on the MoE block, not on its gate), the
chosen sigmoids always renormalised. Defaults are transformers'
`MiniMaxM2Config`'s (the released model's sizes).

The released config.json carries keys transformers ignores because it
hard-codes their value (`use_qk_norm`, `qk_norm_type`, `scoring_func`,
`use_routing_bias`, `shared_intermediate_size`, `attn_type_list`, ...):
each is checked to hold that value, so a config.json that asks for another
one is an error naming the key rather than a silently different model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.hf import fields as f
from linen_moe._src.hf import rope_fields

MODEL_TYPE = "minimax_m2"
ARCHITECTURE = "MiniMaxM2ForCausalLM"
DEFAULT_THETA = 5_000_000.0
# The selection bias's update rate is not published: frozen by default (a
# run field: set it to fine-tune with the aux-loss-free rule).
ROUTED_BIAS_UPDATE_RATE = 0.0
# Keys of the released config.json that transformers does not read, and the
# values its model hard-codes (anything else would be another model).
HARD_CODED = {
    "use_qk_norm": (True,),
    "qk_norm_type": ("per_layer",),
    "scoring_func": ("sigmoid",),
    "use_routing_bias": (True,),
    "shared_intermediate_size": (0,),
}
FIELDS = (
    f.DECODER_FIELDS
    | set(HARD_CODED)
    | {
        "hidden_act",
        "rope_scaling",
        "rope_theta",
        "rotary_dim",
        "partial_rotary_factor",
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "router_jitter_noise",
        "attn_type_list",
        "quantization_config",  # the weights on disk, not the model (load.py)
        # no effect on what transformers computes: the training-only aux loss,
        # the multi-token-prediction modules it never builds, the shared-expert
        # mode of no shared expert, the remote code's map.
        "output_router_logits",
        "router_aux_loss_coef",
        "use_mtp",
        "num_mtp_modules",
        "mtp_transformer_layers",
        "shared_moe_mode",
        "auto_map",
    }
)


def _check_computation(hf: Mapping[str, Any], layers: int) -> None:
  for key, allowed in HARD_CODED.items():
    if key in hf:
      f.require(hf, key, allowed)
  f.zero(hf, "attention_dropout")
  f.zero(hf, "router_jitter_noise")
  types = hf.get("attn_type_list")
  if types is not None and types != [1] * layers:
    raise f.error(
        "attn_type_list",
        types,
        f"transformers' model has softmax attention (1) in all {layers} layers",
    )


def _partial_default(hf: Mapping[str, Any], head_dim: int) -> float:
  """The rotary share when `rope_parameters` gives none: the legacy
  `rotary_dim` over `head_dim` (transformers' conversion), else 1."""
  if hf.get("rotary_dim") is None:
    return 1.0
  return f.read_int(hf, "rotary_dim") / head_dim


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
  """The `ModelConfig` of a MiniMax-M2 config.json (either style)."""
  f.check_known(hf, FIELDS, MODEL_TYPE)
  layers = f.read_int(hf, "num_hidden_layers", 62)
  _check_computation(hf, layers)
  head_dim = f.read_int(hf, "head_dim", 128)
  rope = rope_fields.read(
      hf,
      DEFAULT_THETA,
      head_dim=head_dim,
      partial_default=_partial_default(hf, head_dim),
  )
  given = hf.get("rotary_dim")
  if given is not None and given != rope.get("rotary_dim", head_dim):
    raise f.error(
        "rotary_dim",
        given,
        "the rotary parameters' partial_rotary_factor rotates "
        f"{rope.get('rotary_dim', head_dim)} dims",
    )
  experts = f.num_experts_field(hf)
  dtype = f.dtype_of(hf)
  with f.building_model():
    moe = MoEConfig(
        num_experts=f.read_int(hf, experts, 256),
        num_experts_per_tok=f.read_int(hf, "num_experts_per_tok", 8),
        emb_dim=f.read_int(hf, "hidden_size", 3072),
        moe_mlp_dim=f.read_int(hf, "intermediate_size", 1536),
        mlp_activations=(f.activation(hf, "hidden_act", "silu"), "linear"),
        routing="sigmoid_then_topk",
        norm_topk_prob=True,
        routed_bias=True,
        routed_bias_update_rate=ROUTED_BIAS_UPDATE_RATE,
        load_balance_loss_weight=0.0,
        dtype=dtype,
        param_dtype=dtype,
    )
    return ModelConfig(
        moe=moe,
        vocab_size=f.read_int(hf, "vocab_size", 200064),
        num_layers=layers,
        num_heads=f.read_int(hf, "num_attention_heads", 48),
        head_dim=head_dim,
        num_kv_heads=f.read_int(hf, "num_key_value_heads", 8),
        norm_eps=f.norm_eps(hf),
        qk_norm=True,
        qk_norm_over_heads=True,
        tie_embeddings=f.read_bool(hf, "tie_word_embeddings", False),
        scale_embeddings=False,
        **rope,
    )


# The fields (and values) that make a `ModelConfig` a MiniMax-M2 decoder.
_FIXED = {
    "qk_norm": True,
    "qk_norm_over_heads": True,
    "kv_lora_rank": 0,
    "rope_interleave": False,
    "scale_embeddings": False,
    "router_input_norm": False,
    "post_moe_norms": False,
    "value_norm": False,
    "sliding_window": 0,
    "full_attention_layers": (),
    "dense_layers": (),
    "attention_scale": 0.0,
    "final_logit_softcap": 0.0,
    "post_attention_norm": False,
    "post_mlp_norm": False,
    "layer_scalar": False,
    "attention_sinks": False,
    "attention_qkv_bias": False,
    "attention_out_bias": False,
}
_FIXED_MOE = {
    "routing": "sigmoid_then_topk",
    "routed_bias": True,
    "norm_topk_prob": True,
    "num_routing_groups": 1,
    "routed_scaling_factor": 1.0,
    "shared_experts": 0,
    "per_expert_scale": False,
    "router_bias": False,
    "expert_bias": False,
}


def unsupported(config: ModelConfig) -> list[str]:
  """What a MiniMax-M2 config.json needs that `config` has not, one
  `field=needed (this config: value)` each; [] when it says `config`."""
  bad = f.differing(config, _FIXED | f.NO_LLAMA4, _FIXED_MOE | f.NO_LLAMA4_MOE)
  act = config.moe.mlp_activations[0]
  if act not in f.ACTIVATION_NAMES:
    bad.append(
        f"mlp_activations[0] in {sorted(f.ACTIVATION_NAMES)} (this config: "
        f"{act!r})"
    )
  bad += f.llama3_rope(config)
  return bad


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
  """config.json (transformers 5 style) of a MiniMax-M2 `ModelConfig`:
  the rotary share both as `rotary_dim` and in `rope_parameters`, as
  transformers' own save writes it."""
  moe = config.moe
  return f.common_json(config, MODEL_TYPE, ARCHITECTURE, dtype) | {
      "intermediate_size": moe.moe_mlp_dim,
      "hidden_act": f.ACTIVATION_NAMES[moe.mlp_activations[0]],
      "rope_parameters": rope_fields.to_json(config, partial=True),
      "rotary_dim": config.rotary_dim or config.resolved_head_dim,
      "max_position_embeddings": rope_fields.max_positions(config),
      "num_local_experts": moe.num_experts,
      "num_experts_per_tok": moe.num_experts_per_tok,
      "router_jitter_noise": 0.0,
  }
