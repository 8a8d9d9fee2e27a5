"""Adapters on disk: `save_adapters` writes a LoRA run's adapters alone, as
safetensors beside a small JSON of their config."""

from __future__ import annotations

from collections.abc import Mapping
import json
import os

from flax import traverse_util
import numpy as np

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.layer.variables import PARAMS
from linen_moe._src.lora import tree
from linen_moe._src.parallel import sharding

ADAPTERS_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"


def save_adapters(
    config: ModelConfig, variables: Mapping, out: str | os.PathLike
) -> list[str]:
  """Writes the adapters of `variables` to the new directory `out`.

  `adapters.safetensors` holds each adapter leaf under its `params` path
  joined by "/" (e.g. `layers/moe/routed_experts/wi_0_lora_a`, float32
  [L, E, M, r] in a scanned stack); `adapter_config.json` holds `rank`,
  `alpha`, `scale`, `targets`, `dropout` and `scan_layers`.

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
  tree._check_lora(config, "save_adapters")  # noqa: SLF001
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
  from safetensors.numpy import save_file  # noqa: PLC0415

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
  save_file(tensors, paths[0], metadata={"format": "linen_moe.lora"})
  with open(paths[1], "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=2)
    f.write("\n")
  return paths
