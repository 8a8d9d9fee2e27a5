"""Gemma-4's config.json <-> `ModelConfig` (`gemma4_text`, and the text
decoder of the multimodal `gemma4`, whose fields are under `text_config`).

Sliding-window and full-attention layers (`layer_types`, `sliding_window`),
the full layers' own head width and key/value heads (`per_layer_config`, or
the older `global_head_dim` / `num_global_key_value_heads`), their
"proportional" RoPE and base, `attention_k_eq_v`, q/k norms and a weightless
v norm, attention scale 1, the dense MLP beside the routed experts each with
its pre/post norms, the router reading the raw residual with its scale and
`per_expert_scale`, the saved `layer_scalar`, embeddings scaled by
sqrt(hidden_size), a tied head and `final_logit_softcapping`. Defaults are
transformers' `Gemma4TextConfig`'s. Per-layer embeddings
(`hidden_size_per_layer_input > 0`), KV sharing and the other variants are a
ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.hf import fields as f

TEXT_MODEL_TYPE = "gemma4_text"
TEXT_ARCHITECTURE = "Gemma4ForCausalLM"
MODEL_TYPE = "gemma4"
ARCHITECTURE = "Gemma4ForConditionalGeneration"
# The multimodal checkpoint's towers, which the text decoder does not read.
TOWER_PREFIXES = (
    "model.vision_tower.",
    "model.embed_vision.",
    "model.audio_tower.",
    "model.embed_audio.",
)
SLIDING, FULL = "sliding_attention", "full_attention"
# The text decoder's fields (Gemma4TextConfig's).
FIELDS = f.DECODER_FIELDS | {
    "hidden_activation",
    "attention_bias",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "use_bidirectional_attention",
    "vocab_size_per_layer_input",
    "hidden_size_per_layer_input",
    "attention_k_eq_v",
    "num_kv_shared_layers",
    "enable_moe_block",
    "use_double_wide_mlp",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
    "per_layer_config",
    "global_head_dim",
    "num_global_key_value_heads",
}
# The multimodal config's own fields: token ids and the towers' configs,
# none of which touches the text decoder.
OUTER_FIELDS = f.NO_EFFECT | {
    "text_config",
    "vision_config",
    "audio_config",
    "audio_token_id",
    "boa_token_id",
    "boi_token_id",
    "eoa_token_id",
    "eoa_token_index",
    "eoi_token_id",
    "image_token_id",
    "video_token_id",
    "vision_soft_tokens_per_image",
    "tie_word_embeddings",
    "dtype",
    "torch_dtype",
}


def text_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The text decoder's config.json fields: `hf` itself (`gemma4_text`),
  or the `text_config` of a multimodal `gemma4` config (with its dtype
  and tied head)."""
  return f.text_fields(hf, MODEL_TYPE, OUTER_FIELDS, tied_default=True)


def _layer_types(hf: Mapping[str, Any], layers: int) -> list[str]:
  """transformers': 5 sliding then 1 full by default, the last forced full."""
  default = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
  types = f.layer_types(hf, default, (SLIDING, FULL))
  return [*types[:-1], FULL]


def _full_geometry(hf, types, head_dim, kv_heads) -> tuple[int, int]:
  """(head width, key/value heads) of the full-attention layers, from
  `per_layer_config` (transformers 5.24) or `global_head_dim` /
  `num_global_key_value_heads` (the released 5.5-style config)."""
  full = [i for i, t in enumerate(types) if t == FULL]
  per_layer = hf.get("per_layer_config")
  if per_layer is None:
    d = f.read_int(hf, "global_head_dim", 512)
    kv = kv_heads
    if f.read_bool(hf, "attention_k_eq_v", False):
      given = hf.get("num_global_key_value_heads")
      kv = kv if given is None else f.read_int(hf, "num_global_key_value_heads")
    return d, kv
  if not isinstance(per_layer, Mapping):
    raise f.error("per_layer_config", per_layer, "expected a mapping")
  entries = {}
  for key, value in per_layer.items():
    if not str(key).isdigit() or not isinstance(value, Mapping):
      raise f.error("per_layer_config", {key: value}, "expected index: {...}")
    if set(value) - {"head_dim", "num_key_value_heads"}:
      raise f.error(
          f"per_layer_config.{key}",
          dict(value),
          "only head_dim and num_key_value_heads may differ per layer",
      )
    entries[int(key)] = dict(value)
  geometry = {
      i: (
          entries.get(i, {}).get("head_dim", head_dim),
          entries.get(i, {}).get("num_key_value_heads", kv_heads),
      )
      for i in range(len(types))
  }
  shapes = {geometry[i] for i in full}
  sliding = {geometry[i] for i, t in enumerate(types) if t == SLIDING}
  if len(shapes) > 1 or sliding - {(head_dim, kv_heads)}:
    raise f.error(
        "per_layer_config",
        dict(per_layer),
        "every full-attention layer must share one geometry and every "
        "sliding layer the base one",
    )
  return shapes.pop()


def _rope(hf: Mapping[str, Any], types: list[str]) -> dict[str, Any]:
  """The rotary fields: sliding layers "default", full layers "default"
  or "proportional" (with `partial_rotary_factor`), each its own base."""
  params = hf.get("rope_parameters")
  if params is None:
    params = {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    }
  if not isinstance(params, Mapping) or set(params) - {SLIDING, FULL}:
    raise f.error(
        "rope_parameters",
        params,
        f"expected one mapping per layer type {[SLIDING, FULL]}",
    )
  out: dict[str, Any] = {}
  for kind in set(types):
    field = f"rope_parameters.{kind}"
    p = params.get(kind)
    if not isinstance(p, Mapping):
      raise f.error(field, p, "expected the layer type's rotary parameters")
    rope = f.rope_type(p)
    allowed = {"default"} if kind == SLIDING else {"default", "proportional"}
    if rope not in allowed:
      raise f.error(f"{field}.rope_type", rope, f"allowed {sorted(allowed)}")
    keys = {"rope_type", "type", "rope_theta"}
    if rope == "proportional":
      keys |= {"partial_rotary_factor", "factor"}
      if p.get("factor", 1.0) != 1.0:
        raise f.error(f"{field}.factor", p["factor"], "only 1 is implemented")
    f.check_keys(field, p, keys)
    base = f.theta(p.get("rope_theta", 10000.0))
    if kind == SLIDING:
      out["rope_max_wavelength"] = base
    else:
      out["full_rope_base"] = base
      if rope == "proportional":
        fraction = p.get("partial_rotary_factor", 1.0)
        out["full_rope_fraction"] = f.read_number(
            {f"{field}.partial_rotary_factor": fraction},
            f"{field}.partial_rotary_factor",
            low=0.0,
        )
  return out


def _check_computation(hf: Mapping[str, Any]) -> None:
  if f.read_int(hf, "hidden_size_per_layer_input", 256, minimum=0):
    raise f.error(
        "hidden_size_per_layer_input",
        hf.get("hidden_size_per_layer_input", 256),
        "per-layer embeddings (the small Gemma-4 models) are not "
        "implemented; only 0",
    )
  f.zero(hf, "num_kv_shared_layers")
  f.require(hf, "use_double_wide_mlp", (False,), False)
  f.require(hf, "use_bidirectional_attention", (None, "vision"))
  f.require(hf, "attention_bias", (False,), False)
  f.zero(hf, "attention_dropout")
  if not f.read_bool(hf, "enable_moe_block", False):
    raise f.error(
        "enable_moe_block",
        hf.get("enable_moe_block", False),
        "a Gemma-4 without its MoE block is a dense model; only MoE models "
        "load here",
    )


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
  """The `ModelConfig` of a Gemma-4 config.json (`gemma4_text`, or the text
  decoder of a multimodal `gemma4`)."""
  hf = text_fields(hf)
  f.check_known(hf, FIELDS, TEXT_MODEL_TYPE)
  _check_computation(hf)
  layers = f.read_int(hf, "num_hidden_layers", 30)
  heads = f.read_int(hf, "num_attention_heads", 8)
  kv_heads = f.read_int(hf, "num_key_value_heads", 4)
  head_dim = f.read_int(hf, "head_dim", 256)
  types = _layer_types(hf, layers)
  full = tuple(i for i, t in enumerate(types) if t == FULL)
  full_dim, full_kv = _full_geometry(hf, types, head_dim, kv_heads)
  cap = hf.get("final_logit_softcapping")
  window = f.read_int(hf, "sliding_window", 512) if SLIDING in types else 0
  dtype = f.dtype_of(hf)
  emb = f.read_int(hf, "hidden_size", 2304)
  with f.building_model():
    moe = MoEConfig(
        num_experts=f.read_int(hf, "num_experts"),
        num_experts_per_tok=f.read_int(hf, "top_k_experts"),
        emb_dim=emb,
        moe_mlp_dim=f.read_int(hf, "moe_intermediate_size"),
        mlp_activations=(
            f.activation(hf, "hidden_activation", "gelu_pytorch_tanh"),
            "linear",
        ),
        shared_experts=1,  # the dense MLP beside the experts
        shared_mlp_dim=f.read_int(hf, "intermediate_size", 9216),
        routing="softmax_then_topk",
        norm_topk_prob=True,
        per_expert_scale=True,
        load_balance_loss_weight=0.0,
        dtype=dtype,
        param_dtype=dtype,
    )
    return ModelConfig(
        moe=moe,
        vocab_size=f.read_int(hf, "vocab_size", 262_144),
        num_layers=layers,
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=kv_heads,
        norm_eps=f.norm_eps(hf),
        qk_norm=True,
        value_norm=True,
        attention_scale=1.0,
        tie_embeddings=f.read_bool(hf, "tie_word_embeddings", True),
        scale_embeddings=True,
        sliding_window=window,
        router_input_norm=True,
        post_moe_norms=True,
        shared_pre_norm=True,
        post_attention_norm=True,
        post_mlp_norm=True,
        layer_scalar=True,
        final_logit_softcap=0.0
        if cap is None
        else f.read_number(hf, "final_logit_softcapping", low=0.0),
        full_attention_layers=full,
        full_head_dim=full_dim if full else 0,
        full_kv_heads=full_kv if full else 0,
        full_k_eq_v=bool(full) and f.read_bool(hf, "attention_k_eq_v", False),
        **_rope(hf, types),
    )


# The fields (and values) that make a `ModelConfig` a Gemma-4 text decoder.
_GEMMA = {
    "qk_norm": True,
    "value_norm": True,
    "attention_scale": 1.0,
    "scale_embeddings": True,
    "router_input_norm": True,
    "post_moe_norms": True,
    "shared_pre_norm": True,
    "post_attention_norm": True,
    "post_mlp_norm": True,
    "layer_scalar": True,
    "kv_lora_rank": 0,
    "dense_layers": (),
    "rope_type": "default",
    "rope_interleave": False,
    "attention_sinks": False,
    "attention_qkv_bias": False,
    "attention_out_bias": False,
    "rotary_dim": 0,
    "qk_norm_over_heads": False,
}
_GEMMA_MOE = {
    "routing": "softmax_then_topk",
    "norm_topk_prob": True,
    "per_expert_scale": True,
    "shared_experts": 1,
    "routed_bias": False,
    "num_routing_groups": 1,
    "routed_scaling_factor": 1.0,
    "router_bias": False,
    "expert_bias": False,
}


def unsupported(config: ModelConfig) -> list[str]:
  """The fields of `config` that a Gemma-4 config.json cannot say."""
  moe = config.moe
  bad = f.differing(config, _GEMMA | f.NO_LLAMA4, _GEMMA_MOE | f.NO_LLAMA4_MOE)
  if moe.mlp_activations[0] not in f.ACTIVATION_NAMES:
    bad.append(
        f"mlp_activations[0] in {sorted(f.ACTIVATION_NAMES)} (this config: "
        f"{moe.mlp_activations[0]!r})"
    )
  sliding = config.num_layers > len(config.full_attention_layers)
  if sliding and config.sliding_window == 0:
    bad.append(
        "sliding_window >= 1 on the layers not in full_attention_layers "
        "(this config: 0)"
    )
  return bad


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
  """config.json (transformers 5 style, `gemma4_text`) of a Gemma-4
  `ModelConfig`."""
  moe = config.moe
  full = set(config.full_attention_layers)
  types = [FULL if i in full else SLIDING for i in range(config.num_layers)]
  rope: dict[str, Any] = {}
  if SLIDING in types:
    rope[SLIDING] = {
        "rope_type": "default",
        "rope_theta": config.rope_max_wavelength,
    }
  if full:
    kind = "proportional" if config.full_rope_fraction < 1 else "default"
    rope[FULL] = {
        "rope_type": kind,
        "rope_theta": config.full_rope_base or config.rope_max_wavelength,
    }
    if kind == "proportional":
      rope[FULL]["partial_rotary_factor"] = config.full_rope_fraction
  geometry = {
      "head_dim": config.full_head_dim or config.resolved_head_dim,
      "num_key_value_heads": config.full_kv_heads or config.resolved_kv_heads,
  }
  return {
      "architectures": [TEXT_ARCHITECTURE],
      "model_type": TEXT_MODEL_TYPE,
      "vocab_size": config.vocab_size,
      "hidden_size": moe.emb_dim,
      "intermediate_size": moe.shared_mlp_dim,
      "moe_intermediate_size": moe.moe_mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.resolved_kv_heads,
      "head_dim": config.resolved_head_dim,
      "per_layer_config": {str(i): geometry for i in sorted(full)},
      "hidden_activation": f.ACTIVATION_NAMES[moe.mlp_activations[0]],
      "rms_norm_eps": config.norm_eps,
      "tie_word_embeddings": config.tie_embeddings,
      "rope_parameters": rope,
      "sliding_window": config.sliding_window or 512,
      "layer_types": types,
      "final_logit_softcapping": config.final_logit_softcap or None,
      "attention_k_eq_v": config.full_k_eq_v,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "enable_moe_block": True,
      "num_experts": moe.num_experts,
      "top_k_experts": moe.num_experts_per_tok,
      "hidden_size_per_layer_input": 0,
      "num_kv_shared_layers": 0,
      "use_double_wide_mlp": False,
      "use_bidirectional_attention": None,
      "dtype": dtype,
      "bos_token_id": None,
      "eos_token_id": None,
      "pad_token_id": 0,
  }
