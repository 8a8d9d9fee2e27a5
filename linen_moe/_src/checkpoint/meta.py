"""A checkpoint's JSON metadata: the model config and the RNG key.

`config_dict` / `config_from_dict` write and read the `ModelConfig` as flat
JSON values (a field added since a checkpoint was written takes its default);
`check_model_config` compares a saved config with the model it restores into,
ignoring `RUN_FIELDS` (the fields a resumed run may change, said on the fields
themselves); `rng_to_json` / `rng_from_json` carry a typed PRNG key.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any

import jax
import numpy as np

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.model_config import run_fields
from linen_moe._src.config.moe_config import MoEConfig

# The config fields a restore may change: said on the fields themselves.
RUN_FIELDS = run_fields()


def config_dict(config: ModelConfig) -> dict[str, Any]:
  """The config as flat JSON values, named as `ModelConfig.replace` takes them.

  Args:
    config: the model config.

  Returns:
    The field values by name, the `moe` fields beside the decoder's, tuples
    as lists.
  """
  fields = dataclasses.asdict(config)
  flat = {**fields.pop("moe"), **fields}
  return {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()}


def config_from_dict(saved: Mapping[str, Any]) -> ModelConfig:
  """The `ModelConfig` a `config_dict` describes.

  Args:
    saved: a `config_dict` (as a checkpoint's metadata holds it); a field
      it lacks (added to the config since) has its default.

  Returns:
    The validated `ModelConfig`.

  Raises:
    ValueError: if a value is invalid (as the config constructors).
    TypeError: if `saved` holds a key that is no config field, or lacks a
      field without a default (`num_experts`, ...).
  """
  moe_names = {f.name for f in dataclasses.fields(MoEConfig)}
  values = {**_field_defaults(), **saved}
  moe = {k: v for k, v in values.items() if k in moe_names}
  own = {k: v for k, v in values.items() if k not in moe_names}
  tuples = {
      k: tuple(v) for k, v in {**moe, **own}.items() if isinstance(v, list)
  }
  moe |= {k: v for k, v in tuples.items() if k in moe}
  own |= {k: v for k, v in tuples.items() if k in own}
  return ModelConfig(moe=MoEConfig(**moe), **own)


def _field_defaults() -> dict[str, Any]:
  """The JSON defaults of the config fields that have one."""
  out = {}
  for cls in (MoEConfig, ModelConfig):
    for f in dataclasses.fields(cls):
      if f.default is not dataclasses.MISSING:
        value = f.default
        out[f.name] = list(value) if isinstance(value, tuple) else value
  return out


def check_model_config(saved: Mapping[str, Any], config: ModelConfig, where):
  """Checks that `config` is the model `saved` describes, but for `RUN_FIELDS`.

  Args:
    saved: a `config_dict`, as a checkpoint's metadata holds it.
    config: the config of the model being restored into.
    where: what to name in the error (the checkpoint's step directory).

  Raises:
    ValueError: naming every differing field (outside `RUN_FIELDS`) with its
      value in the checkpoint and here.
  """
  current = config_dict(config)
  # A field added after the checkpoint was written has its default there.
  saved = {**_field_defaults(), **saved}
  diffs = [
      f"{k}={saved.get(k, '<absent>')!r} there, {current.get(k, '<absent>')!r}"
      " here"
      for k in sorted(set(saved) | set(current))
      if k not in RUN_FIELDS and saved.get(k) != current.get(k)
  ]
  if diffs:
    raise ValueError(
        f"Checkpoint {where} was trained with another model config: "
        f"{'; '.join(diffs)}. Only {sorted(RUN_FIELDS)} may change when a "
        "run resumes."
    )


def rng_to_json(rng: jax.Array) -> dict[str, Any]:
  """A typed PRNG key as JSON (its implementation and raw key data).

  Args:
    rng: a typed key (`jax.random.key`), of any shape.

  Returns:
    ``{"impl": name, "data": key data}``, the implementation's name and the
    raw uint32 key data as nested lists.
  """
  return {
      "impl": str(jax.random.key_impl(rng)),
      "data": np.asarray(jax.random.key_data(rng)).tolist(),
  }


def rng_from_json(data: Mapping[str, Any]) -> jax.Array:
  """The inverse of `rng_to_json`.

  Args:
    data: {"impl": ..., "data": ...} as `rng_to_json` writes it.

  Returns:
    The typed PRNG key.
  """
  raw = np.asarray(data["data"], np.uint32)
  return jax.random.wrap_key_data(raw, impl=data["impl"])
