"""Which tensor on disk each parameter of the decoder is, and how.

`sources(family, config, names)` maps every parameter of the unrolled
decoder (`("layers_3", "attention", "query", "kernel")`, ...) to a `Source`:
the tensor(s) it comes from and the one transform between them. transformers
stores an `nn.Linear(in, out)` as `weight [out, in]`; our kernels are
`[in..., out...]`, the same matrix transposed with its axes split (heads,
head dim). So every parameter is one of:

  Copy          the tensor as it is (norm scales, the embedding [V, M]).
  Matrix        W.T with its axes split: W [out, in] -> kernel
                [*in_dims, *out_dims], `split` = len(in_dims).
  Experts       [E, in, out] stacked from one W_e [out, in] per expert
                (the hub's names: `experts.{e}.w1.weight`, ...).
  FusedExperts  the same from transformers 5's fused `[E, rows, in]`
                tensor, rows [row0, row0 + width) of it (`gate_up_proj`:
                gate rows first, then up rows; `down_proj`).
  Columns       every `step`-th column of a tensor stored as the kernel
                ([..., in, out]: x @ W), from column `start` on: GPT-OSS's
                interleaved `gate_up_proj` [E, M, 2H] (gate 0::2, up
                1::2) and its biases, Llama-4's halves (step 1).
  Reshaped      the tensor with the parameter's shape (a bias [N * D] on
                disk is [N, D] here).

The loader reads any slice of a parameter from its source, the saver
writes the source from the parameter, and the checks compare the names and
shapes on disk with `expected_shapes`. Both namings of the experts are
read; the hub's is written (what `save_pretrained` writes by default).
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Mapping
import dataclasses
import math

from linen_moe._src.config import expert_weights
from linen_moe._src.config import stack_plan
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.hf.families import Family

Path = tuple[str, ...]
ROWS = "rows"  # `Family.experts_layout`: nn.Linear weights, W [out, in]


@dataclasses.dataclass(frozen=True)
class Copy:
  name: str


@dataclasses.dataclass(frozen=True)
class Matrix:
  name: str
  split: int = 1


@dataclasses.dataclass(frozen=True)
class Experts:
  names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class FusedExperts:
  name: str
  row0: int
  width: int
  rows: int  # the fused tensor's second axis


@dataclasses.dataclass(frozen=True)
class Columns:
  name: str
  start: int
  step: int
  cols: int  # the tensor's last axis


@dataclasses.dataclass(frozen=True)
class Reshaped:
  name: str


Source = Copy | Matrix | Experts | FusedExperts | Columns | Reshaped


def _layer(family: Family, i: int) -> str:
  return f"{family.prefix}layers.{i}."


def _module(family: Family, i: int, fused: bool) -> str:
  """The prefix of layer i's MoE module: `...mlp.` (fused, or the family's
  hub name), or the layer itself (Gemma-4's `layers.N.experts`)."""
  p = _layer(family, i)
  if not family.moe_module:
    return p
  if family.experts_layout != ROWS:
    return f"{p}{family.moe_module}."
  return f"{p}{'mlp' if fused else family.moe_module}."


def fused_experts(family: Family, layer: int, names: Collection[str]) -> bool:
  """Whether layer `layer`'s experts are stored fused (`experts.gate_up_proj`:
  transformers 5's form, and Gemma-4's only one) rather than one tensor per
  expert."""
  if not family.moe_module or family.experts_layout != ROWS:
    return True
  return f"{_module(family, layer, True)}experts.gate_up_proj" in names


def _attention(config: ModelConfig, p: str, full: bool) -> dict[Path, Source]:
  a = f"{p}self_attn."
  out: dict[Path, Source] = {
      ("pre_attention_norm", "scale"): Copy(f"{p}input_layernorm.weight"),
      ("attention", "out", "kernel"): Matrix(f"{a}o_proj.weight", split=2),
  }
  if config.post_attention_norm:
    out[("post_attention_norm", "scale")] = Copy(
        f"{p}post_attention_layernorm.weight"
    )
  if config.kv_lora_rank:
    return out | _latent_attention(config, a)
  out[("attention", "query", "kernel")] = Matrix(f"{a}q_proj.weight")
  out[("attention", "key", "kernel")] = Matrix(f"{a}k_proj.weight")
  if not (full and config.full_k_eq_v):
    out[("attention", "value", "kernel")] = Matrix(f"{a}v_proj.weight")
  if config.qk_norm:
    out[("attention", "query_norm", "scale")] = Copy(f"{a}q_norm.weight")
    out[("attention", "key_norm", "scale")] = Copy(f"{a}k_norm.weight")
  return out | _attention_extras(config, a, full)


def _attention_extras(config: ModelConfig, a: str, full: bool) -> dict:
  """The biases of the projections and the sinks (GPT-OSS, GLM-4.5)."""
  out: dict[Path, Source] = {}
  if config.attention_qkv_bias:
    for name, proj in (("query", "q"), ("key", "k"), ("value", "v")):
      if name != "value" or not (full and config.full_k_eq_v):
        out[("attention", name, "bias")] = Reshaped(f"{a}{proj}_proj.bias")
  if config.attention_out_bias:
    out[("attention", "out", "bias")] = Copy(f"{a}o_proj.bias")
  if config.attention_sinks:
    out[("attention", "sinks")] = Copy(f"{a}sinks")
  return out


def _latent_attention(config: ModelConfig, a: str) -> dict[Path, Source]:
  """DeepSeek's MLA (`models/mla.py`): q_a_proj / q_a_layernorm / q_b_proj
  (or q_proj), kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj."""
  out: dict[Path, Source] = {
      ("attention", "kv_a", "kernel"): Matrix(f"{a}kv_a_proj_with_mqa.weight"),
      ("attention", "kv_a_norm", "scale"): Copy(f"{a}kv_a_layernorm.weight"),
      ("attention", "kv_b", "kernel"): Matrix(f"{a}kv_b_proj.weight"),
  }
  if not config.q_lora_rank:
    return out | {("attention", "query", "kernel"): Matrix(f"{a}q_proj.weight")}
  return out | {
      ("attention", "query_a", "kernel"): Matrix(f"{a}q_a_proj.weight"),
      ("attention", "query_a_norm", "scale"): Copy(f"{a}q_a_layernorm.weight"),
      ("attention", "query_b", "kernel"): Matrix(f"{a}q_b_proj.weight"),
  }


def _experts(
    family: Family, config: ModelConfig, module: str, fused: bool, at: Path
) -> dict[Path, Source]:
  """The routed experts' kernels under `at` (`wi_0`, `wi_1`, `wo`), from
  the fused `experts.gate_up_proj` / `experts.down_proj` or per expert."""
  width = config.moe.moe_mlp_dim
  if family.experts_layout != ROWS:
    return _column_experts(family, config, module, at)
  if fused:
    gate_up, emb = f"{module}experts.gate_up_proj", config.moe.emb_dim
    return {
        (*at, "wi_0"): FusedExperts(gate_up, 0, width, 2 * width),
        (*at, "wi_1"): FusedExperts(gate_up, width, width, 2 * width),
        (*at, "wo"): FusedExperts(f"{module}experts.down_proj", 0, emb, emb),
    }
  projections = family.expert_projections
  return {
      (*at, name): Experts(
          tuple(
              f"{module}experts.{e}.{proj}.weight"
              for e in range(config.moe.num_experts)
          )
      )
      for name, proj in zip(expert_weights.KERNELS, projections, strict=True)
  }


def _column_experts(
    family: Family, config: ModelConfig, module: str, at: Path
) -> dict[Path, Source]:
  """Experts stored as x @ W: `experts.gate_up_proj` [E, M, 2H] (gate and
  up columns interleaved, or gate then up), `experts.down_proj` [E, H, M]
  as the kernel is, and with `expert_bias` their `_bias` tensors."""
  width = config.moe.moe_mlp_dim
  gate_up, down = f"{module}experts.gate_up_proj", f"{module}experts.down_proj"
  if family.experts_layout == "interleaved_columns":
    gate, up = (0, 2), (1, 2)
  else:
    gate, up = (0, 1), (width, 1)
  names = [gate_up]
  if config.moe.expert_bias:
    names.append(f"{gate_up}_bias")
  out: dict[Path, Source] = {}
  for name in names:
    suffix = name.removeprefix(gate_up)
    out[(*at, f"wi_0{suffix}")] = Columns(name, *gate, 2 * width)
    out[(*at, f"wi_1{suffix}")] = Columns(name, *up, 2 * width)
  out[(*at, "wo")] = Copy(down)
  if config.moe.expert_bias:
    out[(*at, "wo_bias")] = Copy(f"{down}_bias")
  return out


def _mlp(name: str, at: Path) -> dict[Path, Source]:
  """A gated MLP's kernels under `at` from `{name}.{gate,up,down}_proj`."""
  return {
      (*at, "wi_0"): Matrix(f"{name}.gate_proj.weight"),
      (*at, "wi_1"): Matrix(f"{name}.up_proj.weight"),
      (*at, "wo"): Matrix(f"{name}.down_proj.weight"),
  }


def _routed_at(config: ModelConfig) -> Path:
  """Where the routed layer's variables sit in a block."""
  return ("moe", "routed_experts") if config.shared_in_moe else ("moe",)


def _moe(
    family: Family, config: ModelConfig, i: int, fused: bool
) -> dict[Path, Source]:
  p = _layer(family, i)
  if config.post_moe_norms:
    return _gemma_moe(family, config, i)
  module = _module(family, i, fused)
  at = _routed_at(config)
  out: dict[Path, Source] = {
      ("pre_moe_norm", "scale"): Copy(f"{p}post_attention_layernorm.weight"),
      (*at, expert_weights.ROUTER, "kernel"): Matrix(
          f"{module}{family.router}.weight"
      ),
  }
  if config.moe.router_bias:
    out[(*at, expert_weights.ROUTER, "bias")] = Copy(
        f"{module}{family.router}.bias"
    )
  out |= _experts(family, config, module, fused, at)
  if config.shared_in_moe:  # DeepSeek's `mlp.shared_experts`
    out |= _mlp(f"{module}{family.shared_module}", ("moe", "shared_experts"))
  return out


def _gemma_moe(family: Family, config: ModelConfig, i: int) -> dict:
  """Gemma-4's block: the dense MLP (`mlp.*`, our shared experts) and the
  routed experts (`experts.*`, `router.*`) side by side, each with its
  pre/post norms, then `post_feedforward_layernorm` on their sum."""
  p = _layer(family, i)

  def norm(name):
    return Copy(f"{p}{name}.weight")

  out: dict[Path, Source] = {
      ("pre_moe_norm", "scale"): norm("pre_feedforward_layernorm_2"),
      ("post_routed_norm", "scale"): norm("post_feedforward_layernorm_2"),
      ("moe", expert_weights.ROUTER, "kernel"): Matrix(
          f"{p}router.proj.weight"
      ),
      ("moe", "per_expert_scale"): Copy(f"{p}router.per_expert_scale"),
      ("router_input_scale",): Copy(f"{p}router.scale"),
      ("pre_shared_norm", "scale"): norm("pre_feedforward_layernorm"),
      ("post_shared_norm", "scale"): norm("post_feedforward_layernorm_1"),
  }
  out |= _experts(family, config, p, True, ("moe",))
  return out | _mlp(f"{p}mlp", ("shared_experts",))


def _dense(family: Family, config: ModelConfig, i: int) -> dict[Path, Source]:
  p = _layer(family, i)
  norm = "pre_feedforward" if config.post_attention_norm else "post_attention"
  return {
      ("pre_mlp_norm", "scale"): Copy(f"{p}{norm}_layernorm.weight"),
      **_mlp(f"{p}{family.dense_module}", ("mlp",)),
  }


def sources(
    family: Family,
    config: ModelConfig,
    names: Collection[str] = (),
) -> dict[Path, Source]:
  """{unrolled params path: Source} of every parameter of the float decoder
  of `config`; a layer whose experts `names` (the tensors on disk) holds
  fused is read fused, every other one per expert."""
  out: dict[Path, Source] = {
      ("embed", "embedding"): Copy(f"{family.prefix}embed_tokens.weight"),
      ("final_norm", "scale"): Copy(f"{family.prefix}norm.weight"),
  }
  if not config.tie_embeddings:
    out[("logits", "kernel")] = Matrix(family.lm_head)
  for i, (kind, full) in enumerate(config.block_kinds):
    layer = _attention(config, _layer(family, i), full)
    if kind == "dense":
      layer |= _dense(family, config, i)
    else:
      layer |= _moe(family, config, i, fused_experts(family, i, names))
    if config.post_mlp_norm:
      layer[("post_mlp_norm", "scale")] = Copy(
          f"{_layer(family, i)}post_feedforward_layernorm.weight"
      )
    name = stack_plan.layer_name(i)
    out |= {(name, *path): source for path, source in layer.items()}
  return out


def state_sources(
    family: Family, config: ModelConfig, names: Collection[str] = ()
) -> dict[Path, Source]:
  """{unrolled `updated_by_rule` path: Source} of the saved buffers:
  DeepSeek's `e_score_correction_bias` (our `routed_bias`) and Gemma-4's
  `layer_scalar`."""
  out: dict[Path, Source] = {}
  for i, kind in enumerate(config.layer_kinds):
    name = stack_plan.layer_name(i)
    if config.layer_scalar:
      out[(name, "layer_scalar")] = Copy(f"{_layer(family, i)}layer_scalar")
    if kind == "moe" and config.moe.routed_bias:
      module = _module(family, i, fused_experts(family, i, names))
      out[(name, *_routed_at(config), "routed_bias")] = Copy(
          f"{module}{family.selection_bias}"
      )
  return out


def expected_shapes(
    source: Source, shape: tuple[int, ...]
) -> dict[str, tuple[int, ...]]:
  """{tensor name: its shape on disk} of a parameter of `shape` read from
  `source`."""
  if isinstance(source, Copy):
    return {source.name: shape}
  if isinstance(source, Matrix):
    n_in = math.prod(shape[: source.split])
    return {source.name: (math.prod(shape[source.split :]), n_in)}
  if isinstance(source, Experts):
    return {name: (shape[2], shape[1]) for name in source.names}
  if isinstance(source, Columns):
    return {source.name: (*shape[:-1], source.cols)}
  if isinstance(source, Reshaped):
    return {source.name: (math.prod(shape),)}
  return {source.name: (shape[0], source.rows, shape[1])}


def tensor_names(srcs: Mapping[Path, Source]) -> list[str]:
  """Every tensor name the sources read, in order, each once."""
  seen: dict[str, None] = {}
  for source in srcs.values():
    names = source.names if isinstance(source, Experts) else (source.name,)
    seen |= dict.fromkeys(names)
  return list(seen)
