"""config.json's rotary parameters <-> the `ModelConfig` rotary fields.

Both styles transformers has written: `rope_parameters` (transformers 5,
with `rope_theta` inside) and the older `rope_scaling` beside a top-level
`rope_theta`. Read here for every family with one rotary embedding on all
its layers: "default", "yarn" (transformers' `_compute_yarn_parameters`:
`factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`,
`mscale`, `mscale_all_dim`, `truncate`), "llama3" for the families that
have it (Llama-4: `factor`, `low_freq_factor`, `high_freq_factor`,
`original_max_position_embeddings`), and for the families that rotate
part of each head (GLM-4.5) its `partial_rotary_factor`. A key that
changes the rotary embedding in a way not implemented (e.g. yarn's
explicit `attention_factor`) is an error naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any

from linen_moe._src.hf import fields as f

BASE_KEYS = frozenset({"rope_type", "type", "rope_theta"})
YARN_KEYS = BASE_KEYS | {
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
}
LLAMA3_KEYS = BASE_KEYS | {
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
}


def _original(hf: Mapping[str, Any], field: str, params: Mapping) -> int:
  """`original_max_position_embeddings`, else `max_position_embeddings`
  (transformers' standardisation)."""
  key = "original_max_position_embeddings"
  original = params.get(key) or hf.get("max_position_embeddings", 4096)
  if (
      isinstance(original, bool)
      or not isinstance(original, int)
      or original < 1
  ):
    raise f.error(f"{field}.{key}", original, "expected an integer >= 1")
  return original


def _llama3(hf: Mapping[str, Any], field: str, params: Mapping) -> dict:
  values = {}
  for key in ("factor", "low_freq_factor", "high_freq_factor"):
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise f.error(f"{field}.{key}", value, "expected a number")
    values[key] = float(value)
  return {
      "rope_type": "llama3",
      "rope_factor": values["factor"],
      "rope_low_freq_factor": values["low_freq_factor"],
      "rope_high_freq_factor": values["high_freq_factor"],
      "rope_original_max_len": _original(hf, field, params),
  }


def _yarn(hf: Mapping[str, Any], field: str, params: Mapping) -> dict:
  original = _original(hf, field, params)
  factor = params.get("factor")
  if factor is None:  # transformers: the ratio of the context lengths
    factor = f.read_int(hf, "max_position_embeddings", 4096) / original
  if isinstance(factor, bool) or not isinstance(factor, (int, float)):
    raise f.error(f"{field}.factor", factor, "expected a number")
  truncate = params.get("truncate", True)
  if not isinstance(truncate, bool):
    raise f.error(f"{field}.truncate", truncate, "expected true or false")
  return {
      "rope_type": "yarn",
      "rope_factor": float(factor),
      "rope_original_max_len": original,
      "rope_beta_fast": float(params.get("beta_fast") or 32),
      "rope_beta_slow": float(params.get("beta_slow") or 1),
      "rope_mscale": float(params.get("mscale") or 0.0),
      "rope_mscale_all_dim": float(params.get("mscale_all_dim") or 0.0),
      "rope_truncate": truncate,
  }


def _rotary_dim(
    hf: Mapping[str, Any], field: str, given: Mapping, head_dim: int, default
) -> dict[str, Any]:
  """`rotary_dim` = int(head_dim * partial_rotary_factor), the factor from
  the rotary parameters, else config.json's top level, else `default`
  (transformers' order); {} when every dim rotates."""
  key = "partial_rotary_factor"
  where = f"{field}.{key}" if key in given else key
  factor = given.get(key, hf.get(key, default))
  if (
      isinstance(factor, bool)
      or not isinstance(factor, (int, float))
      or not 0 < factor <= 1
  ):
    raise f.error(where, factor, "expected a share in (0, 1]")
  dim = int(head_dim * factor)
  if dim % 2 or dim < 2:
    raise f.error(
        where, factor, f"it rotates {dim} of {head_dim} dims: not an even count"
    )
  return {} if dim == head_dim else {"rotary_dim": dim}


def read(
    hf: Mapping[str, Any],
    default_theta: float,
    params: Mapping | None = None,
    head_dim: int | None = None,
    partial_default: float = 1.0,
    kinds: tuple[str, ...] = ("default", "yarn"),
) -> dict[str, Any]:
  """The `ModelConfig` rotary fields (`rope_max_wavelength`, YaRN's, and
  `rotary_dim`) of a config.json.

  Args:
    hf: the config.json.
    default_theta: the base when config.json gives none.
    params: the rotary parameters to read when config.json has none
      (a family's default, e.g. GPT-OSS's YaRN); None: "default".
    head_dim: the head width, for a family that rotates part of it
      (`partial_rotary_factor`, default `partial_default`); None: the key
      is not implemented for the family.
    partial_default: the share that rotates when config.json gives none.
    kinds: the rope types the family implements, of "default", "yarn"
      and "llama3" (Llama-4's, without YaRN).

  Raises:
    ValueError: a `rope_type` not in `kinds`, or a key not implemented;
      the message names it.
  """
  field, given = f.rope_parameters(hf)
  if not given and params is not None:
    given = dict(params)
  kind = f.rope_type(given)
  base = f.theta(given.get("rope_theta", hf.get("rope_theta", default_theta)))
  out: dict[str, Any] = {"rope_max_wavelength": base}
  partial = set()
  if head_dim is not None:
    partial = {"partial_rotary_factor"}
    out |= _rotary_dim(hf, field, given, head_dim, partial_default)
  if kind not in kinds:
    names = " and ".join(
        [", ".join(repr(k) for k in kinds[:-1]), repr(kinds[-1])]
    )
    raise f.error(f"{field}.rope_type", kind, f"only {names} are implemented")
  if kind == "default":
    f.check_keys(field, given, BASE_KEYS | partial)
    return out
  if kind == "llama3":
    f.check_keys(field, given, LLAMA3_KEYS | partial)
    return out | _llama3(hf, field, given)
  f.check_keys(field, given, YARN_KEYS | partial)
  return out | _yarn(hf, field, given)


def to_json(config, partial: bool = False) -> dict[str, Any]:
  """`rope_parameters` (transformers 5 style) of a `ModelConfig`; with
  `partial`, its `partial_rotary_factor` (1 when every dim rotates)."""
  rope: dict[str, Any] = {
      "rope_theta": config.rope_max_wavelength,
      "rope_type": config.rope_type,
  }
  if partial:
    head_dim = config.resolved_head_dim
    rope["partial_rotary_factor"] = (config.rotary_dim or head_dim) / head_dim
  if config.rope_type == "llama3":
    return rope | {
        "factor": config.rope_factor,
        "low_freq_factor": config.rope_low_freq_factor,
        "high_freq_factor": config.rope_high_freq_factor,
        "original_max_position_embeddings": config.rope_original_max_len,
    }
  if config.rope_type != "yarn":
    return rope
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
  if not config.rope_truncate:
    rope["truncate"] = False
  return rope


def max_positions(config) -> int:
  """A `max_position_embeddings` for the config.json of a `ModelConfig`:
  YaRN's extended context, else at least 4096 (default RoPE never reads
  it)."""
  if config.rope_type in ("yarn", "llama3"):
    return math.ceil(config.rope_original_max_len * config.rope_factor)
  return max(4096, config.rope_original_max_len)
