"""The YAML config files: the shipped names and any path, read and checked.

A YAML file in `configs/` has two sections, `moe:` (the fields of `MoEConfig`)
and `decoder:` (the other fields of `ModelConfig`). `load_moe_config` returns
the `MoEConfig`; `load_model_config` returns the whole `ModelConfig`.
"""

from __future__ import annotations

import importlib.resources
import os
from typing import Any

import yaml

from linen_moe._src.config.checks import check_keys
from linen_moe._src.config.checks import new_names
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig


def available_configs() -> list[str]:
  """Names of the YAML configs shipped with the package.

  Returns:
    The names, sorted, without ".yml" (what `load_model_config` takes).
  """
  root = importlib.resources.files("linen_moe.configs")
  return sorted(p.name[:-4] for p in root.iterdir() if p.name.endswith(".yml"))


def _read_yaml(name_or_path: str | os.PathLike) -> dict[str, Any]:
  path = os.fspath(name_or_path)
  if os.path.sep in path or path.endswith((".yml", ".yaml")):
    if not os.path.exists(path):
      raise ValueError(f"Config file {path!r} does not exist.")
    with open(path, encoding="utf-8") as f:
      data = yaml.safe_load(f)
  else:
    resource = importlib.resources.files("linen_moe.configs") / f"{path}.yml"
    if not resource.is_file():
      raise ValueError(
          f"Unknown config name {path!r}; available: {available_configs()} "
          "(or pass a path to a .yml file)."
      )
    data = yaml.safe_load(resource.read_text(encoding="utf-8"))
  if not isinstance(data, dict) or "moe" not in data:
    raise ValueError(f"Config {path!r} must be a mapping with a 'moe' section.")
  unknown = sorted(set(data) - {"moe", "decoder"})
  if unknown:
    raise ValueError(
        f"Config {path!r} has unknown section(s) {unknown}; allowed: "
        "['decoder', 'moe']."
    )
  return data


def _moe_from_dict(data: dict[str, Any]) -> MoEConfig:
  data = new_names("MoEConfig", data)
  check_keys(MoEConfig, data)
  return MoEConfig(**data)


def load_model_config(
    name_or_path: str | os.PathLike, **overrides: Any
) -> ModelConfig:
  """Reads a YAML config (a shipped name or a path) into a `ModelConfig`.

  Args:
    name_or_path: a name from `available_configs()`, or the path of a .yml /
      .yaml file (anything with a path separator or that suffix).
    **overrides: flat keyword names of `ModelConfig` or `MoEConfig` fields,
      applied after the file.

  Returns:
    The validated `ModelConfig`.

  Raises:
    ValueError: if the file does not exist or the name is unknown, the file
      is not a mapping with a `moe:` section (and at most a `decoder:` one),
      a key is no field (or `decoder:` holds `moe`), or a value is invalid.
    TypeError: as the `ModelConfig` constructor.
  """
  data = _read_yaml(name_or_path)
  moe = _moe_from_dict(dict(data["moe"] or {}))
  decoder = dict(data.get("decoder") or {})
  check_keys(ModelConfig, decoder)
  if "moe" in decoder:
    raise ValueError("The 'decoder' section may not contain 'moe'.")
  return ModelConfig(moe=moe, **decoder).replace(**overrides)


def load_moe_config(
    name_or_path: str | os.PathLike, **overrides: Any
) -> MoEConfig:
  """Reads the `moe:` section of a YAML config into a validated `MoEConfig`.

  Example usage:
    cfg = load_moe_config("tiny_mixtral", quantization="int8")

  Args:
    name_or_path: a name from `available_configs()`, or a .yml / .yaml path.
    **overrides: `MoEConfig` field names, applied over the file's values.

  Returns:
    The validated `MoEConfig` (the file's decoder section is ignored).

  Raises:
    ValueError: if the file does not exist or the name is unknown, it is not
      a mapping with a `moe:` section, a key is no `MoEConfig` field, or a
      value is invalid.
  """
  data = _read_yaml(name_or_path)
  merged = new_names("MoEConfig", dict(data["moe"] or {}))
  overrides = new_names("MoEConfig", overrides)
  check_keys(MoEConfig, overrides)
  merged.update(overrides)
  return _moe_from_dict(merged)
