"""`generation_config.json`, the one file that says a model's stop ids
(`eos_token_id`): its name, and its one reader. A Hugging Face checkpoint
ships one; a training run writes one beside its checkpoints (the stop id
it trained with); a Hugging Face export writes it again."""

from __future__ import annotations

from collections.abc import Mapping
import json
import os
from typing import Any

FILE = "generation_config.json"


def read(directory: str | os.PathLike) -> dict[str, Any] | None:
  """The generation config of a checkpoint or run directory.

  Args:
    directory: the directory that may hold `generation_config.json`.

  Returns:
    Its JSON object, or None when there is no such file.

  Raises:
    ValueError: the file is not JSON, or not a JSON object.
  """
  path = os.path.join(os.fspath(directory), FILE)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    try:
      config = json.load(f)
    except ValueError as e:
      raise ValueError(f"{path} cannot be read: {e}.") from None
  if not isinstance(config, dict):
    raise ValueError(f"{path} is not a JSON object.")
  return config


def stop_ids(config: Mapping[str, Any] | None) -> list[int]:
  """The stop ids of a generation config: its `eos_token_id` (an int or a
  list) as a list; [] without a config or the field."""
  eos = (config or {}).get("eos_token_id")
  if eos is None:
    return []
  return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
