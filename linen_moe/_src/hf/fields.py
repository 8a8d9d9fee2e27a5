"""Reading config.json fields: typed, checked, each error naming the field.

The helpers every family's mapping (`config_map`, `deepseek`, `gemma4`)
reads config.json with. A value we cannot compute as transformers does is a
`ValueError` saying `config.json: field=value is not supported: ...`.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Set
import contextlib
from typing import Any

# Fields that change nothing we compute (generation defaults, bookkeeping,
# the position limit that "default" RoPE never reads).
NO_EFFECT = frozenset({
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "max_position_embeddings",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "torchscript",
    "id2label",
    "label2id",
    "tokenizer_class",
})
# The keys every family's decoder config.json has and reads alike (each
# family adds its own to these).
DECODER_FIELDS = NO_EFFECT | {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_dropout",
    "dtype",
    "torch_dtype",
}
# transformers' `hidden_act` -> our expert activation, and back.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu",
    "gelu_new": "gelu",
    "gelu": "gelu_exact",
    "relu": "relu",
}
ACTIVATION_NAMES = {"silu": "silu", "gelu": "gelu_pytorch_tanh"}
ACTIVATION_NAMES |= {"gelu_exact": "gelu", "relu": "relu"}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def error(field: str, value: Any, expected: str) -> ValueError:
  return ValueError(
      f"config.json: {field}={value!r} is not supported: {expected}."
  )


@contextlib.contextmanager
def building_model() -> Iterator[None]:
  """Says "config.json describes no valid model" on a config constructor's
  ValueError; an error that already names its config.json field passes as
  it is."""
  try:
    yield
  except ValueError as e:
    if str(e).startswith("config.json:"):
      raise
    raise ValueError(f"config.json describes no valid model: {e}") from e


def check_known(hf: Mapping, known: Set[str], model_type: str) -> None:
  """Raises unless every field of `hf` is in `known`."""
  unknown = sorted(set(hf) - set(known))
  if unknown:
    raise ValueError(
        f"config.json has field(s) {unknown} that a {model_type} model does "
        "not have here; they may change the computation, so they are not "
        "ignored."
    )


def read_int(hf: Mapping, field: str, default=None, minimum: int = 1) -> int:
  value = hf.get(field, default)
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise error(field, value, f"expected an integer >= {minimum}")
  return value


def read_number(hf: Mapping, field: str, default=None, low=None) -> float:
  """A number (> `low` when given)."""
  value = hf.get(field, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise error(field, value, "expected a number")
  if low is not None and not value > low:
    raise error(field, value, f"expected a number > {low:g}")
  return float(value)


def read_bool(hf: Mapping, field: str, default: bool) -> bool:
  value = hf.get(field, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise error(field, value, "expected true or false")
  return value


def require(hf: Mapping, field: str, allowed: tuple, default=None) -> None:
  """Raises unless `hf[field]` (or `default`) is one of `allowed`."""
  value = hf.get(field, default)
  if value not in allowed:
    raise error(field, value, f"only {list(allowed)} is implemented")


def zero(hf: Mapping, field: str) -> None:
  value = hf.get(field, 0) or 0
  if value != 0:
    raise error(field, value, "only 0 is implemented")


def num_experts_field(hf: Mapping) -> str:
  """The key that holds the number of routed experts: `num_local_experts`
  where the file has it (Mixtral's name, kept by GPT-OSS and MiniMax-M2),
  else `num_experts`."""
  return "num_local_experts" if "num_local_experts" in hf else "num_experts"


def dtype_of(hf: Mapping) -> str:
  value = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  if value not in DTYPES:
    raise error("dtype", value, f"expected one of {sorted(DTYPES)}")
  return DTYPES[value]


def activation(hf: Mapping, field: str, default: str) -> str:
  act = hf.get(field, default)
  if act not in ACTIVATIONS:
    raise error(field, act, f"expected one of {sorted(ACTIVATIONS)}")
  return ACTIVATIONS[act]


# The Llama-4 fields, which every other family keeps at these values.
NO_LLAMA4 = {
    "attention_chunk": 0,
    "full_nope": False,
    "qk_norm_after_rope": False,
    "attention_temperature_floor": 0,
}
NO_LLAMA4_MOE = {"weights_on_input": False}


def llama3_rope(config) -> list[str]:
  """What a family reading only "default" and "yarn" rotary embeddings
  needs of a config with Llama-4's rotary scaling (`rope_type='llama3'`):
  [] for any other config."""
  if config.rope_type != "llama3":
    return []
  return ["rope_type='default' or 'yarn' (this config: 'llama3')"]


def differing(config, fixed: Mapping, fixed_moe: Mapping) -> list[str]:
  """`field=required (this config: value)` of each field of a
  `ModelConfig` (`fixed`) or of its `moe` (`fixed_moe`) that differs from
  the value a family requires."""
  return [
      f"{k}={v!r} (this config: {getattr(obj, k)!r})"
      for obj, table in ((config, fixed), (config.moe, fixed_moe))
      for k, v in table.items()
      if getattr(obj, k) != v
  ]


def text_fields(
    hf: Mapping[str, Any],
    model_type: str,
    outer_fields: Set[str],
    tied_default: bool,
) -> dict[str, Any]:
  """The text decoder's config.json fields of a family with a multimodal
  checkpoint: `hf` itself, or the `text_config` of a multimodal config of
  `model_type` (whose own keys must be `outer_fields`), with its dtype; its
  tied head must be the outer config's (both default `tied_default`)."""
  if hf.get("model_type") != model_type:
    return dict(hf)
  check_known(hf, outer_fields, model_type)
  text = hf.get("text_config")
  if not isinstance(text, Mapping):
    raise error("text_config", text, "expected the text decoder's config")
  text = dict(text)
  outer_tied = read_bool(hf, "tie_word_embeddings", tied_default)
  if read_bool(text, "tie_word_embeddings", tied_default) != outer_tied:
    raise error(
        "text_config.tie_word_embeddings",
        text.get("tie_word_embeddings"),
        f"it must equal tie_word_embeddings={outer_tied}",
    )
  for key in ("dtype", "torch_dtype"):
    if key not in text and key in hf:
      text[key] = hf[key]
  return text


def norm_eps(hf: Mapping, default: float = 1e-6) -> float:
  return read_number(hf, "rms_norm_eps", default, low=0.0)


def rope_parameters(hf: Mapping) -> tuple[str, dict]:
  """(the field's name, its mapping) of the rotary parameters in either
  style: transformers 5's `rope_parameters`, or the older `rope_scaling`
  (its `rope_theta` then top-level)."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
  if not isinstance(params, Mapping):
    raise error(field, params, "expected a mapping or null")
  return field, dict(params)


def rope_type(params: Mapping) -> str:
  """transformers' `rope_type`, or the older `type`, or "default"."""
  return params.get("rope_type", params.get("type", "default"))


def check_keys(field: str, params: Mapping, allowed: Set[str]) -> None:
  unknown = sorted(set(params) - set(allowed))
  if unknown:
    raise error(
        field,
        dict(params),
        f"its keys {unknown} change the rotary embedding and are not "
        "implemented",
    )


def theta(value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise error("rope_theta", value, "expected a number")
  return float(value)


def layer_types(
    hf: Mapping, default: list[str], allowed: tuple[str, ...]
) -> list[str]:
  """config.json's `layer_types` (`default` when absent): one of `allowed`
  per layer, as many as `default` has."""
  types = hf.get("layer_types")
  if types is None:
    return list(default)
  if (
      not isinstance(types, list)
      or len(types) != len(default)
      or any(t not in allowed for t in types)
  ):
    raise error(
        "layer_types", types, f"expected {len(default)} of {list(allowed)}"
    )
  return types


def common_json(
    config, model_type: str, architecture: str, dtype: str
) -> dict[str, Any]:
  """The config.json keys every decoder-only family writes alike (the
  transformers 5 style) for a `ModelConfig` with weights in `dtype`."""
  return {
      "architectures": [architecture],
      "model_type": model_type,
      "vocab_size": config.vocab_size,
      "hidden_size": config.moe.emb_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.resolved_kv_heads,
      "head_dim": config.resolved_head_dim,
      "rms_norm_eps": config.norm_eps,
      "tie_word_embeddings": config.tie_embeddings,
      "attention_dropout": 0.0,
      "dtype": dtype,
      "bos_token_id": None,
      "eos_token_id": None,
      "pad_token_id": None,
  }
