"""Adapters on disk: `save_adapters` writes a LoRA run's adapters alone, as
safetensors beside a small JSON of their config (this library's layout;
PEFT's is `linen_moe.hf.save_peft_adapters`)."""

from __future__ import annotations

from collections.abc import Mapping
import json
import os

from flax import traverse_util
import numpy as np

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.variables import PARAMS
from linen_moe._src.lora import tree
from linen_moe._src.lora.adapters import SUFFIX_A
from linen_moe._src.lora.adapters import SUFFIX_B
from linen_moe._src.parallel import sharding

ADAPTERS_FILE = "adapters.safetensors"
CONFIG_FILE = "adapters.json"
# Where linen_moe 0.2 wrote the config: PEFT's file name, in another
# schema. `load_adapters` still reads it.
LEGACY_CONFIG_FILE = "adapter_config.json"


def save_adapters(
    config: ModelConfig, variables: Mapping, out: str | os.PathLike
) -> list[str]:
  """Writes the adapters of `variables` to the new directory `out`.

  `adapters.safetensors` holds each adapter leaf under its `params` path
  joined by "/" (e.g. `layers/moe/routed_experts/wi_0_lora_a`, float32
  [L, E, M, r] in a scanned stack); `adapters.json` holds `rank`,
  `alpha`, `scale`, `targets`, `dropout` and `scan_layers`. (For PEFT and
  transformers: `linen_moe.hf.save_peft_adapters`.)

  Args:
    config: the adapted decoder's `ModelConfig` (`lora_rank >= 1`).
    variables: its variables (boxed or not), adapters included.
    out: a directory to create; it must not exist.

  Returns:
    The paths written.

  Raises:
    ValueError: if `config` has no LoRA, `variables` hold no adapters, or
      `out` exists.
  """
  tree.check_lora(config, "save_adapters")
  variables = sharding.unbox(dict(variables))
  adapters, _ = tree.split(variables.get(PARAMS, {}))
  if not adapters:
    raise ValueError(
        "save_adapters found no adapters (`*_lora_a`, `*_lora_b` params) in "
        "variables."
    )
  out = os.fspath(out)
  if os.path.exists(out):
    raise ValueError(f"save_adapters: out={out} exists; it never overwrites.")
  from safetensors.numpy import save  # noqa: PLC0415

  os.makedirs(out)
  flat = traverse_util.flatten_dict(adapters, sep="/")
  tensors = {k: np.asarray(v, np.float32) for k, v in sorted(flat.items())}
  lora = config.moe.lora
  meta = {
      "rank": lora.rank,
      "alpha": lora.alpha,
      "scale": lora.scale,
      "targets": list(lora.targets),
      "dropout": lora.dropout,
      "scan_layers": config.scan_layers,
  }
  paths = [os.path.join(out, ADAPTERS_FILE), os.path.join(out, CONFIG_FILE)]
  # Written as any new file (the umask's mode; safetensors' save_file
  # makes it private).
  with open(paths[0], "wb") as f:
    f.write(save(tensors, metadata={"format": "linen_moe.lora"}))
  with open(paths[1], "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=2)
    f.write("\n")
  return paths


def load_adapters(
    config: ModelConfig, variables: Mapping, directory: str | os.PathLike
) -> tuple[ModelConfig, dict]:
  """Adds the adapters `save_adapters` wrote in `directory` to a base.

  Args:
    config: the base decoder's `ModelConfig` (its LoRA fields are replaced
      by the directory's).
    variables: the base's variables, without adapters (boxed or not).
    directory: a directory `save_adapters` wrote.

  Returns:
    (config, variables): the config with the adapters' rank, alpha,
    targets and dropout, and the variables with the adapters in `params`.

  Raises:
    ValueError: if the files are missing, or an adapter does not fit the
      base (no such kernel, another layer layout or shape).
  """
  directory = os.fspath(directory)
  paths = [os.path.join(directory, f) for f in (ADAPTERS_FILE, CONFIG_FILE)]
  legacy = os.path.join(directory, LEGACY_CONFIG_FILE)
  if not os.path.isfile(paths[1]) and os.path.isfile(legacy):
    paths[1] = legacy  # written by linen_moe 0.2
  for path in paths:
    if not os.path.isfile(path):
      raise ValueError(f"load_adapters: no {path} (see save_adapters).")
  with open(paths[1], encoding="utf-8") as f:
    meta = json.load(f)
  if "peft_type" in meta:
    raise ValueError(
        f"load_adapters: {paths[1]} is PEFT's adapter config "
        "(`hf.save_peft_adapters`, for transformers); load_adapters reads "
        "what save_adapters writes."
    )
  from safetensors.numpy import load_file  # noqa: PLC0415

  config = config.replace(
      lora_rank=int(meta["rank"]),
      lora_alpha=float(meta["alpha"]),
      lora_targets=tuple(meta["targets"]),
      lora_dropout=float(meta["dropout"]),
  )
  variables = sharding.unbox(dict(variables))
  params = traverse_util.flatten_dict(dict(variables[PARAMS]), sep="/")
  adapters = load_file(paths[0])
  for name, value in adapters.items():
    kernel = name.removesuffix(SUFFIX_A).removesuffix(SUFFIX_B)
    if kernel not in params:
      raise ValueError(
          f"load_adapters: the adapter {name} has no kernel {kernel} in the "
          f"base's params (saved with scan_layers={meta.get('scan_layers')}; "
          f"the base has scan_layers={config.scan_layers})."
      )
    params[name] = value
  variables[PARAMS] = traverse_util.unflatten_dict(params, sep="/")
  return config, variables
