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

from linen_moe._src import expert
from linen_moe._src import layer_stack
from linen_moe._src.config import ModelConfig
from linen_moe._src.hf.families import Family

Path = tuple[str, ...]
PREFIX = "model."


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


Source = Copy | Matrix | Experts | FusedExperts


def _layer(i: int) -> str:
  return f"{PREFIX}layers.{i}."


def fused_experts(layer: int, names: Collection[str]) -> bool:
  """Whether layer `layer`'s experts are stored fused (transformers 5's
  `mlp.experts.gate_up_proj`) rather than one tensor per expert."""
  return f"{_layer(layer)}mlp.experts.gate_up_proj" in names


def _attention(config: ModelConfig, p: str) -> dict[Path, Source]:
  a = f"{p}self_attn."
  out = {
      ("attention", "query", "kernel"): Matrix(f"{a}q_proj.weight"),
      ("attention", "key", "kernel"): Matrix(f"{a}k_proj.weight"),
      ("attention", "value", "kernel"): Matrix(f"{a}v_proj.weight"),
      ("attention", "out", "kernel"): Matrix(f"{a}o_proj.weight", split=2),
      ("pre_attention_norm", "scale"): Copy(f"{p}input_layernorm.weight"),
  }
  if config.qk_norm:
    out[("attention", "query_norm", "scale")] = Copy(f"{a}q_norm.weight")
    out[("attention", "key_norm", "scale")] = Copy(f"{a}k_norm.weight")
  return out


def _moe(
    family: Family, config: ModelConfig, i: int, fused: bool
) -> dict[Path, Source]:
  p = _layer(i)
  module = f"{p}{'mlp' if fused else family.moe_module}."
  out: dict[Path, Source] = {
      ("pre_moe_norm", "scale"): Copy(f"{p}post_attention_layernorm.weight"),
      ("moe", expert.ROUTER, "kernel"): Matrix(f"{module}gate.weight"),
  }
  gate, up, down = family.expert_projections
  width = config.moe.moe_mlp_dim
  if fused:
    gate_up = f"{module}experts.gate_up_proj"
    out[("moe", "wi_0")] = FusedExperts(gate_up, 0, width, 2 * width)
    out[("moe", "wi_1")] = FusedExperts(gate_up, width, width, 2 * width)
    emb = config.moe.emb_dim
    out[("moe", "wo")] = FusedExperts(f"{module}experts.down_proj", 0, emb, emb)
    return out
  for name, proj in zip(expert.KERNELS, (gate, up, down), strict=True):
    out[("moe", name)] = Experts(
        tuple(
            f"{module}experts.{e}.{proj}.weight"
            for e in range(config.moe.num_experts)
        )
    )
  return out


def _dense(i: int) -> dict[Path, Source]:
  p = _layer(i)
  return {
      ("pre_mlp_norm", "scale"): Copy(f"{p}post_attention_layernorm.weight"),
      ("mlp", "wi_0"): Matrix(f"{p}mlp.gate_proj.weight"),
      ("mlp", "wi_1"): Matrix(f"{p}mlp.up_proj.weight"),
      ("mlp", "wo"): Matrix(f"{p}mlp.down_proj.weight"),
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
      ("embed", "embedding"): Copy(f"{PREFIX}embed_tokens.weight"),
      ("final_norm", "scale"): Copy(f"{PREFIX}norm.weight"),
  }
  if not config.tie_embeddings:
    out[("logits", "kernel")] = Matrix("lm_head.weight")
  for i, kind in enumerate(config.layer_kinds):
    layer = {**_attention(config, _layer(i))}
    if kind == "dense":
      layer |= _dense(i)
    else:
      layer |= _moe(family, config, i, fused_experts(i, names))
    name = layer_stack.layer_name(i)
    out |= {(name, *path): source for path, source in layer.items()}
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
  return {source.name: (shape[0], source.rows, shape[1])}


def tensor_names(srcs: Mapping[Path, Source]) -> list[str]:
  """Every tensor name the sources read, in order, each once."""
  seen: dict[str, None] = {}
  for source in srcs.values():
    names = source.names if isinstance(source, Experts) else (source.name,)
    seen |= dict.fromkeys(names)
  return list(seen)
