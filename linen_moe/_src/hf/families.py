"""The model families a Hugging Face checkpoint may hold, as data.

A `Family` is what differs between transformers' models in their files:
the `model_type`, the config fields each reads (beyond the common ones in
`config_map`), the name of a layer's MoE module and of its experts' three
projections on disk. Everything they compute alike is in `config_map` and
`tensor_names`; nothing else branches on a family.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

from linen_moe._src.hf import deepseek
from linen_moe._src.hf import gemma4
from linen_moe._src.hf import glm4_moe
from linen_moe._src.hf import gpt_oss
from linen_moe._src.hf import llama4
from linen_moe._src.hf import minimax_m2


@dataclasses.dataclass(frozen=True)
class Family:
  """One transformers model family.

  Attributes:
    name: the family's name as its authors write it ("Qwen3-MoE"); a
      multimodal checkpoint's text decoder shares its family's.
    model_type: config.json's `model_type`.
    architecture: the `architectures` entry transformers writes.
    default_rope_theta: the RoPE base when config.json gives none.
    moe_module: the MoE module of a layer in the hub's per-expert names
      (`model.layers.N.<moe_module>.gate.weight`, `.experts.E.<proj>`).
    expert_projections: the hub's names of one expert's (gate, up, down)
      projections.
    expert_width_field: the config field of the routed experts' width.
    dense_width_field: the config field of a dense layer's MLP width, or
      None when the family has no dense layers.
    qk_norm: the family's attention normalises q and k per head.
    norm_topk_prob: whether the chosen experts' softmax weights are
      renormalised when config.json does not say (`norm_topk_prob`).
    fields: the family's own config fields besides the common ones,
      each handled by `config_map`.
    prefix: the text decoder's tensors are named `{prefix}layers.N...`
      (`lm_head.weight` apart).
    codec: the family's own config.json mapping, a module with
      `model_config(hf)`, `hf_config(config, dtype)` and
      `unsupported(config)`; None: `config_map`'s (Mixtral, Qwen3-MoE).
    skipped_prefixes: tensors on disk that are no part of the text decoder
      (a multimodal checkpoint's towers): skipped on load, with a message.
    text_config: the decoder's fields are under this field of config.json
      (a multimodal config), or at the top (None).
    router: the router's module under the MoE module (`gate`, GPT-OSS's
      `router`).
    experts_layout: how the routed experts are stored: "rows", as
      `nn.Linear` weights W [out, in] (one per expert, or fused
      [E, rows, in], gate rows then up rows); "interleaved_columns", fused
      as x @ W, `gate_up_proj` [E, M, 2H] with gate and up columns
      alternating (GPT-OSS); "split_columns", the same with the gate
      columns first (Llama-4).
    shared_module: the shared experts' module under the MoE module.
    dense_module: a dense layer's MLP module.
    lm_head: the untied head's tensor.
    selection_bias: the name, under the MoE module, of the routed layer's
      selection bias (`routed_bias`): DeepSeek-V3's under its router,
      MiniMax-M2's on the MoE block itself.
  """

  name: str
  model_type: str
  architecture: str
  default_rope_theta: float
  moe_module: str
  expert_projections: tuple[str, str, str]
  expert_width_field: str
  dense_width_field: str | None
  qk_norm: bool
  norm_topk_prob: bool
  fields: tuple[str, ...]
  prefix: str = "model."
  codec: Any = None
  skipped_prefixes: tuple[str, ...] = ()
  text_config: str | None = None
  router: str = "gate"
  experts_layout: str = "rows"
  selection_bias: str = "gate.e_score_correction_bias"
  shared_module: str = "shared_experts"
  dense_module: str = "mlp"
  lm_head: str = "lm_head.weight"


MIXTRAL = Family(
    name="Mixtral",
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    default_rope_theta=1e6,
    moe_module="block_sparse_moe",
    expert_projections=("w1", "w3", "w2"),
    expert_width_field="intermediate_size",
    dense_width_field=None,
    qk_norm=False,
    norm_topk_prob=True,  # Mixtral always renormalises
    fields=("router_jitter_noise",),
)

QWEN3_MOE = Family(
    name="Qwen3-MoE",
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    default_rope_theta=1e4,
    moe_module="mlp",
    expert_projections=("gate_proj", "up_proj", "down_proj"),
    expert_width_field="moe_intermediate_size",
    dense_width_field="intermediate_size",
    qk_norm=True,
    norm_topk_prob=False,
    fields=(
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "attention_bias",
        "use_sliding_window",
        "max_window_layers",
    ),
)

DEEPSEEK_V3 = Family(
    name="DeepSeek-V3",
    model_type=deepseek.MODEL_TYPE,
    architecture=deepseek.ARCHITECTURE,
    default_rope_theta=1e4,
    moe_module="mlp",
    expert_projections=("gate_proj", "up_proj", "down_proj"),
    expert_width_field="moe_intermediate_size",
    dense_width_field="intermediate_size",
    qk_norm=False,
    norm_topk_prob=True,
    fields=(),
    codec=deepseek,
)

GEMMA4_TEXT = Family(
    name="Gemma-4",
    model_type=gemma4.TEXT_MODEL_TYPE,
    architecture=gemma4.TEXT_ARCHITECTURE,
    default_rope_theta=1e4,
    moe_module="",  # `layers.N.experts`, `layers.N.router`
    expert_projections=("gate_proj", "up_proj", "down_proj"),
    expert_width_field="moe_intermediate_size",
    dense_width_field="intermediate_size",
    qk_norm=True,
    norm_topk_prob=True,
    fields=(),
    codec=gemma4,
)

# The multimodal checkpoint: its text decoder under `model.language_model.`,
# its config under `text_config`; the towers are not loaded.
GEMMA4 = dataclasses.replace(
    GEMMA4_TEXT,
    model_type=gemma4.MODEL_TYPE,
    architecture=gemma4.ARCHITECTURE,
    prefix="model.language_model.",
    skipped_prefixes=gemma4.TOWER_PREFIXES,
    text_config="text_config",
)

GPT_OSS = Family(
    name="GPT-OSS",
    model_type=gpt_oss.MODEL_TYPE,
    architecture=gpt_oss.ARCHITECTURE,
    default_rope_theta=gpt_oss.DEFAULT_THETA,
    moe_module="mlp",
    expert_projections=("gate_up_proj", "gate_up_proj", "down_proj"),
    expert_width_field="intermediate_size",
    dense_width_field=None,
    qk_norm=False,
    norm_topk_prob=True,
    fields=(),
    codec=gpt_oss,
    router="router",
    experts_layout="interleaved_columns",
)

GLM4_MOE = Family(
    name="GLM-4.5",
    model_type=glm4_moe.MODEL_TYPE,
    architecture=glm4_moe.ARCHITECTURE,
    default_rope_theta=glm4_moe.DEFAULT_THETA,
    moe_module="mlp",
    expert_projections=("gate_proj", "up_proj", "down_proj"),
    expert_width_field="moe_intermediate_size",
    dense_width_field="intermediate_size",
    qk_norm=False,  # `use_qk_norm`: glm4_moe.py
    norm_topk_prob=True,
    fields=(),
    codec=glm4_moe,
)

MINIMAX_M2 = Family(
    name="MiniMax-M2",
    model_type=minimax_m2.MODEL_TYPE,
    architecture=minimax_m2.ARCHITECTURE,
    default_rope_theta=minimax_m2.DEFAULT_THETA,
    moe_module="block_sparse_moe",
    expert_projections=("w1", "w3", "w2"),
    expert_width_field="intermediate_size",
    dense_width_field=None,
    qk_norm=True,
    norm_topk_prob=True,
    fields=(),
    codec=minimax_m2,
    selection_bias="e_score_correction_bias",
)

LLAMA4_TEXT = Family(
    name="Llama-4",
    model_type=llama4.TEXT_MODEL_TYPE,
    architecture=llama4.TEXT_ARCHITECTURE,
    default_rope_theta=llama4.DEFAULT_THETA,
    moe_module="feed_forward",
    expert_projections=("gate_up_proj", "gate_up_proj", "down_proj"),
    expert_width_field="intermediate_size",
    dense_width_field="intermediate_size_mlp",
    qk_norm=False,
    norm_topk_prob=False,
    fields=(),
    codec=llama4,
    router="router",
    experts_layout="split_columns",
    shared_module="shared_expert",
    dense_module="feed_forward",
)

# The multimodal checkpoint: its text decoder under `language_model.`, its
# config under `text_config`; the vision tower is not loaded.
LLAMA4 = dataclasses.replace(
    LLAMA4_TEXT,
    model_type=llama4.MODEL_TYPE,
    architecture=llama4.ARCHITECTURE,
    prefix="language_model.model.",
    lm_head="language_model.lm_head.weight",
    skipped_prefixes=llama4.TOWER_PREFIXES,
    text_config="text_config",
)

FAMILIES = {
    f.model_type: f
    for f in (
        MIXTRAL,
        QWEN3_MOE,
        DEEPSEEK_V3,
        GEMMA4_TEXT,
        GEMMA4,
        GPT_OSS,
        GLM4_MOE,
        MINIMAX_M2,
        LLAMA4_TEXT,
        LLAMA4,
    )
}

# The `model_type`s of config.json that load.
MODEL_TYPES = tuple(sorted(FAMILIES))


class FamilyEntry(NamedTuple):
  """One family as the entry points name it (`--help`, the README, the
  guides and `linen_moe.hf`'s docstring, each checked against this table
  by tests/hf/test_hf_family_table.py).

  Attributes:
    name: the family's name ("GPT-OSS").
    model_types: the config.json `model_type`s of it that load (the text
      decoder's first, then a multimodal checkpoint's).
    peft_experts: whether its routed experts' adapters have a PEFT form
      (`save_peft_adapters`): transformers' fused `[E, rows, in]` layout
      has one (PEFT loaded it for Mixtral, Qwen3-MoE, DeepSeek-V3 and
      Gemma-4); the x @ W layouts (GPT-OSS, Llama-4) have none here, and
      `linen-moe export --format adapters` writes their experts' adapters
      in this library's files instead.
  """

  name: str
  model_types: tuple[str, ...]
  peft_experts: bool


def _table() -> tuple[FamilyEntry, ...]:
  by_name: dict[str, list[Family]] = {}
  for family in FAMILIES.values():
    by_name.setdefault(family.name, []).append(family)
  return tuple(
      FamilyEntry(
          name,
          tuple(f.model_type for f in members),
          members[0].experts_layout == "rows",
      )
      for name, members in by_name.items()
  )


# The families `load_checkpoint` reads, once each, in the order the
# documentation lists them: the one table the entry points name.
SUPPORTED_FAMILIES = _table()


def names_text(entries=SUPPORTED_FAMILIES) -> str:
  """The families' names as a sentence's list: "A, B and C"."""
  names = [e.name for e in entries]
  if len(names) == 1:
    return names[0]
  return f"{', '.join(names[:-1])} and {names[-1]}"
