"""Hugging Face `config.json` <-> `ModelConfig`.

`model_config` reads both styles transformers has written: the one of
transformers 5 (`rope_parameters`, `dtype`) and the older one most hub
checkpoints carry (`rope_theta`, `rope_scaling`, `torch_dtype`). Every field
is accounted for: mapped to a `ModelConfig` field, checked to hold a value
we compute as transformers does (a value that would change the computation
in a way we do not implement is a `ValueError` naming the field), or known
to change nothing (`fields.NO_EFFECT`). An unknown field is an error too: we cannot
tell that it changes nothing.

`hf_config` is the inverse, in the transformers 5 style, for a `ModelConfig`
that one of the families can express.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any

from linen_moe._src.config.activations import CLAMPED_SWIGLU
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.hf import fields
from linen_moe._src.hf.families import FAMILIES
from linen_moe._src.hf.families import Family
from linen_moe._src.hf.fields import ACTIVATIONS
from linen_moe._src.hf.fields import DTYPES  # noqa: F401 (load, save)

_error, _int, _zero = fields.error, fields.read_int, fields.zero
_dtype = fields.dtype_of
_ACTIVATION_NAMES = fields.ACTIVATION_NAMES

# Fields Mixtral and Qwen3-MoE read the same way.
_COMMON = fields.DECODER_FIELDS | {
    "hidden_act",
    "rope_theta",
    "rope_scaling",
    "sliding_window",
    "num_experts_per_tok",
    "num_local_experts",
    "num_experts",
    "output_router_logits",
    "router_aux_loss_coef",
}
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta"})
# The ModelConfig fields of the families with a codec of their own, which
# Mixtral and Qwen3-MoE keep at their defaults.
_NEWER_FIELDS = (
    "kv_lora_rank",
    "rope_interleave",
    "rope_type",
    "attention_scale",
    "full_attention_layers",
    "value_norm",
    "post_attention_norm",
    "post_mlp_norm",
    "shared_pre_norm",
    "layer_scalar",
    "final_logit_softcap",
    "attention_sinks",
    "attention_qkv_bias",
    "attention_out_bias",
    "rotary_dim",
    "qk_norm_over_heads",
    "attention_chunk",
    "full_nope",
    "qk_norm_after_rope",
    "attention_temperature_floor",
)


def family_of(hf: Mapping[str, Any]) -> Family:
  """The `Family` of a config.json, or a ValueError listing the supported
  model types."""
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(
        f"config.json: model_type={model_type!r} is not supported; supported "
        f"model types are {sorted(FAMILIES)}."
    )
  return FAMILIES[model_type]


def _rope_theta(hf, family: Family) -> float:
  """The RoPE base, from either style; any rotary scaling is an error."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
  if not isinstance(params, Mapping):
    raise _error(field, params, "expected a mapping or null")
  unknown = sorted(set(params) - _ROPE_KEYS)
  kind = params.get("rope_type", params.get("type", "default"))
  if kind != "default":
    raise _error(
        f"{field}.rope_type",
        kind,
        "only 'default' RoPE is implemented (no rotary scaling)",
    )
  if unknown:
    raise _error(
        field,
        dict(params),
        f"its keys {unknown} change the rotary embedding and are not "
        "implemented",
    )
  theta = params.get("rope_theta", hf.get("rope_theta"))
  theta = family.default_rope_theta if theta is None else theta
  if isinstance(theta, bool) or not isinstance(theta, (int, float)):
    raise _error("rope_theta", theta, "expected a number")
  return float(theta)


def _dense_layers(hf, family: Family, num_layers: int) -> tuple[int, ...]:
  """Qwen3's rule: layer i is MoE iff i is not in `mlp_only_layers` and
  (i + 1) % `decoder_sparse_step` == 0."""
  if family.dense_width_field is None:
    return ()
  step = _int(hf, "decoder_sparse_step", 1)
  only = hf.get("mlp_only_layers") or []
  if not isinstance(only, list) or not all(
      isinstance(i, int) and 0 <= i < num_layers for i in only
  ):
    raise _error(
        "mlp_only_layers", only, f"expected layer indices < {num_layers}"
    )
  return tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)


def _sliding_window(hf, family: Family) -> int:
  window = hf.get("sliding_window")
  if "use_sliding_window" in family.fields and not hf.get(
      "use_sliding_window", False
  ):
    return 0  # transformers sets sliding_window to None then
  if window is None:
    return 0
  return _int(hf, "sliding_window")


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
  """The `ModelConfig` computing what transformers computes for a config.json.

  Args:
    hf: the parsed config.json, either style (transformers 5's
      `rope_parameters` / `dtype`, or the older `rope_theta` /
      `rope_scaling` / `torch_dtype`).

  Returns:
    The validated `ModelConfig` (scanned layers, no quantization).

  Raises:
    TypeError: `hf` is not a mapping.
    ValueError: an unsupported `model_type` (the message lists the supported
      ones), a field that changes the computation in a way not implemented
      (unknown rotary scaling, attention biases, dropout, router jitter,
      ...), an unknown field, or an invalid value; the message names it.
  """
  if not isinstance(hf, Mapping):
    raise TypeError(f"config.json must be a mapping; got {type(hf).__name__}.")
  family = family_of(hf)
  if family.codec is not None:
    return family.codec.model_config(hf)
  known = set(_COMMON | set(family.fields))
  known |= {family.expert_width_field}
  if family.dense_width_field:
    known.add(family.dense_width_field)
  unknown = sorted(set(hf) - known)
  if unknown:
    raise ValueError(
        f"config.json has field(s) {unknown} that a {family.model_type} "
        "model does not have here; they may change the computation, so they "
        "are not ignored."
    )
  for field in ("attention_dropout", "router_jitter_noise"):
    _zero(hf, field)
  if hf.get("attention_bias", False):
    raise _error("attention_bias", hf["attention_bias"], "no attention biases")
  emb, heads = _int(hf, "hidden_size"), _int(hf, "num_attention_heads")
  layers = _int(hf, "num_hidden_layers")
  kv_heads = hf.get("num_key_value_heads")
  kv_heads = heads if kv_heads is None else _int(hf, "num_key_value_heads")
  head_dim = hf.get("head_dim")
  head_dim = emb // heads if head_dim is None else _int(hf, "head_dim")
  act = hf.get("hidden_act", "silu")
  if act not in ACTIVATIONS:
    raise _error("hidden_act", act, f"expected one of {sorted(ACTIVATIONS)}")
  experts_field = fields.num_experts_field(hf)
  dense = _dense_layers(hf, family, layers)
  dtype = _dtype(hf)
  eps = hf.get("rms_norm_eps", 1e-6)
  if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
    raise _error("rms_norm_eps", eps, "expected a positive number")
  balance = 0.0
  if hf.get("output_router_logits", False):
    balance = float(hf.get("router_aux_loss_coef", 0.001))
  dense_width = 0
  if dense:
    dense_width = _int(hf, family.dense_width_field)
  experts, top_k = _int(hf, experts_field), _int(hf, "num_experts_per_tok")
  width, vocab = _int(hf, family.expert_width_field), _int(hf, "vocab_size")
  theta, window = _rope_theta(hf, family), _sliding_window(hf, family)
  with fields.building_model():
    moe = MoEConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        emb_dim=emb,
        moe_mlp_dim=width,
        mlp_activations=(ACTIVATIONS[act], "linear"),
        # softmax over every expert in float32, top-k, renormalised or not.
        routing="softmax_then_topk",
        norm_topk_prob=bool(hf.get("norm_topk_prob", family.norm_topk_prob)),
        load_balance_loss_weight=balance,
        dtype=dtype,
        param_dtype=dtype,
    )
    return ModelConfig(
        moe=moe,
        vocab_size=vocab,
        num_layers=layers,
        num_heads=heads,
        head_dim=head_dim,
        rope_max_wavelength=theta,
        norm_eps=float(eps),
        num_kv_heads=kv_heads,
        qk_norm=family.qk_norm,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        scale_embeddings=False,
        sliding_window=window,
        dense_layers=dense,
        dense_mlp_dim=dense_width,
    )


def _unsupported(config: ModelConfig, family: Family) -> list[str]:
  """What `family` (Mixtral or Qwen3-MoE) needs that `config` has not: one
  `field=needed (this config: value)` each."""
  moe, bad = config.moe, []

  def need(ok: bool, needed: str, ours: Any) -> None:
    if not ok:
      bad.append(f"{needed} (this config: {ours!r})")

  defaults = ModelConfig(moe=moe)
  for name in _NEWER_FIELDS:  # the other families'
    value, default = getattr(config, name), getattr(defaults, name)
    need(value == default, f"{name}={default!r}", value)
  for name in ("scale_embeddings", "router_input_norm", "post_moe_norms"):
    need(not getattr(config, name), f"{name}=False", True)
  need(moe.shared_experts == 0, "shared_experts=0", moe.shared_experts)
  need(
      moe.routed_scaling_factor == 1,
      "routed_scaling_factor=1.0",
      moe.routed_scaling_factor,
  )
  need(
      moe.num_routing_groups == 1,
      "num_routing_groups=1",
      moe.num_routing_groups,
  )
  need(not moe.routed_bias, "routed_bias=False", True)
  need(not moe.per_expert_scale, "per_expert_scale=False", True)
  for name in ("router_bias", "expert_bias", "weights_on_input"):
    need(not getattr(moe, name), f"{name}=False", True)
  need(
      moe.mlp_activations[0] in _ACTIVATION_NAMES,
      f"mlp_activations[0] in {sorted(_ACTIVATION_NAMES)}",
      moe.mlp_activations[0],
  )
  need(
      config.qk_norm == family.qk_norm,
      f"qk_norm={family.qk_norm}",
      config.qk_norm,
  )
  need(
      family.dense_width_field is not None or not config.dense_layers,
      "dense_layers=()",
      config.dense_layers,
  )
  renormalised = moe.routing == "topk_then_softmax" or (
      moe.routing == "softmax_then_topk" and moe.norm_topk_prob
  )
  routing = f"routing={moe.routing!r}, norm_topk_prob={moe.norm_topk_prob}"
  if "norm_topk_prob" in family.fields:
    need(
        moe.routing in ("softmax_then_topk", "topk_then_softmax"),
        "routing='softmax_then_topk' or 'topk_then_softmax'",
        moe.routing,
    )
  elif not renormalised:
    bad.append(
        "routing='topk_then_softmax', or 'softmax_then_topk' with "
        f"norm_topk_prob=True (this config: {routing})"
    )
  return bad


# The families a `ModelConfig` is written as (no config is two of them:
# their needs exclude each other).
_WRITTEN_AS = (
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
    "gemma4_text",
    "gpt_oss",
    "glm4_moe",
    "minimax_m2",
    "llama4_text",
)


def differences(config: ModelConfig, family: Family) -> list[str]:
  """What `family` needs that `config` has not, one `field=needed (this
  config: value)` each; [] when `family` expresses `config`."""
  if family.codec is not None:
    return family.codec.unsupported(config)
  return _unsupported(config, family)


def _resembled(config: ModelConfig) -> Family:
  """The family whose layers `config` has: latent attention is
  DeepSeek-V3's; attention sinks, router or expert biases or the clamped
  SwiGLU GPT-OSS's; q/k norms over all heads MiniMax-M2's; top-k then
  sigmoid routing, weights on the expert's input or a Llama-4 attention
  field (chunks, NoPE, norms after RoPE, temperature tuning) Llama-4's;
  DeepSeek's routing (sigmoid, groups, routed biases) GLM-4.5's with its
  attention (q/k norms, grouped kv heads, q/k/v biases, partial rotary),
  else DeepSeek-V3's; Gemma-4's MoE block (post-MoE norms, router input
  norm, per-expert scales) Gemma-4's; q/k norms or softmax-then-top-k
  routing Qwen3-MoE's; else Mixtral's."""
  moe = config.moe
  if config.kv_lora_rank:
    return FAMILIES["deepseek_v3"]
  if (
      config.attention_sinks
      or moe.router_bias
      or moe.expert_bias
      or moe.mlp_activations[0] == CLAMPED_SWIGLU
  ):
    return FAMILIES["gpt_oss"]
  if config.qk_norm_over_heads:
    return FAMILIES["minimax_m2"]
  if (
      moe.routing == "topk_then_sigmoid"
      or moe.weights_on_input
      or any(getattr(config, k) != v for k, v in fields.NO_LLAMA4.items())
  ):
    return FAMILIES["llama4_text"]
  if (
      moe.routing == "sigmoid_then_topk"
      or moe.routed_bias
      or moe.num_routing_groups > 1
  ):
    glm = (
        config.qk_norm
        or config.resolved_kv_heads < config.num_heads
        or config.attention_qkv_bias
        or config.rotary_dim
    )
    return FAMILIES["glm4_moe" if glm else "deepseek_v3"]
  if config.post_moe_norms or config.router_input_norm or moe.per_expert_scale:
    return FAMILIES["gemma4_text"]
  if config.qk_norm or moe.routing == "softmax_then_topk":
    return FAMILIES["qwen3_moe"]
  return FAMILIES["mixtral"]


def nearest_family(config: ModelConfig) -> tuple[Family, list[str]]:
  """The family that expresses `config` and [], or else the family whose
  layers it has (`_resembled`: latent attention, DeepSeek-V3; attention
  sinks or GPT-OSS's biases and activation, GPT-OSS; q/k norms over all
  heads, MiniMax-M2; Llama-4's routing or attention, Llama-4; DeepSeek's
  routing, GLM-4.5 with its attention, else DeepSeek-V3; Gemma-4's MoE
  block, Gemma-4; q/k norms or softmax-then-top-k routing, Qwen3-MoE;
  else Mixtral) and what that family needs (`differences`)."""
  for model_type in _WRITTEN_AS:
    if not differences(config, FAMILIES[model_type]):
      return FAMILIES[model_type], []
  family = _resembled(config)
  return family, differences(config, family)


@dataclasses.dataclass(frozen=True)
class FamilyMatch:
  """Whether a `ModelConfig` has a Hugging Face form (`family_match`).

  Attributes:
    model_type: config.json's `model_type` of the family that expresses
      the config or, when none does, of the nearest one
      (`nearest_family`).
    differences: what that family needs that the config has not, one
      `field=needed (this config: value)` each; empty when it expresses
      the config.
  """

  model_type: str
  differences: tuple[str, ...] = ()

  @property
  def exports(self) -> bool:
    """Whether `save_checkpoint` (`linen-moe export --format hf`) writes
    the config."""
    return not self.differences


def family_match(config: ModelConfig) -> FamilyMatch:
  """Which Hugging Face family writes `config`, or which one is nearest
  and what it needs; no jax, no weights, no training.

  Example usage:

    match = hf.family_match(linen_moe.load_model_config("tiny_deepseek_v3"))
    match.exports      # False
    match.model_type   # "deepseek_v3"
    match.differences  # ("kv_lora_rank >= 1, ... (this config: 0)", ...)

  Args:
    config: a `ModelConfig`.

  Returns:
    The `FamilyMatch` (the family's `model_type`, and what it needs; none
    when `save_checkpoint` writes `config`).

  Raises:
    TypeError: `config` is not a `ModelConfig`.
  """
  if not isinstance(config, ModelConfig):
    raise TypeError(
        "family_match: config must be a ModelConfig; got "
        f"{type(config).__name__}."
    )
  family, bad = nearest_family(config)
  return FamilyMatch(family.model_type, tuple(bad))


def exporting_configs(model_type: str) -> list[str]:
  """The shipped configs `save_checkpoint` writes as `model_type`, the tiny
  ones first (read from their YAML files: no jax)."""
  from linen_moe._src.config import files  # noqa: PLC0415

  family = FAMILIES[model_type]
  out = [
      name
      for name in files.available_configs()
      if nearest_family(files.load_model_config(name)) == (family, [])
  ]
  return sorted(out, key=lambda n: (not n.startswith("tiny_"), n))


def family_for(config: ModelConfig) -> Family:
  """The family that expresses `config`, or a ValueError naming the
  nearest family, what it needs (`nearest_family`) and the shipped configs
  it writes."""
  family, bad = nearest_family(config)
  if bad:
    raise ValueError(
        "This ModelConfig has no Hugging Face form: the nearest family, "
        f"{family.model_type}, needs {'; '.join(bad)}. The shipped configs "
        f"that export as {family.model_type}: "
        f"{', '.join(exporting_configs(family.model_type))}."
    )
  return family


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
  """config.json (transformers 5 style) of a `ModelConfig` with weights in
  `dtype`; raises ValueError when no family expresses `config`."""
  family = family_for(config)
  if family.codec is not None:
    return family.codec.hf_config(config, dtype)
  moe = config.moe
  renormalised = moe.routing == "topk_then_softmax" or moe.norm_topk_prob
  out = {
      "architectures": [family.architecture],
      "model_type": family.model_type,
      "vocab_size": config.vocab_size,
      "hidden_size": moe.emb_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.resolved_kv_heads,
      "head_dim": config.resolved_head_dim,
      "hidden_act": _ACTIVATION_NAMES[moe.mlp_activations[0]],
      "rms_norm_eps": config.norm_eps,
      "rope_parameters": {
          "rope_theta": config.rope_max_wavelength,
          "rope_type": "default",
      },
      "tie_word_embeddings": config.tie_embeddings,
      "sliding_window": config.sliding_window or None,
      "attention_dropout": 0.0,
      "num_local_experts": moe.num_experts,
      "num_experts_per_tok": moe.num_experts_per_tok,
      "output_router_logits": moe.load_balance_loss_weight > 0,
      "router_aux_loss_coef": moe.load_balance_loss_weight or 0.001,
      family.expert_width_field: moe.moe_mlp_dim,
      "dtype": dtype,
      "bos_token_id": None,
      "eos_token_id": None,
      "pad_token_id": None,
  }
  if "router_jitter_noise" in family.fields:
    out["router_jitter_noise"] = 0.0
  if family.dense_width_field is not None:
    out[family.dense_width_field] = config.dense_mlp_dim or moe.moe_mlp_dim
    out |= {
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(config.dense_layers),
        "norm_topk_prob": bool(renormalised),
        "attention_bias": False,
        "use_sliding_window": config.sliding_window > 0,
        "max_window_layers": config.num_layers,
    }
  return out
