"""What a run keeps of its tokenizer: its files and stop id, in the run's
directory.

A run on text (`data` with a `tokenizer`, or the tokenizer of the
Hugging Face checkpoint it starts from) copies into its `checkpoint_dir`
the tokenizer's `tokenizer.json` and the files beside it that say how to
use it (`TOKENIZER_FILES`: its config, special tokens and chat template;
a lone tokenizer.json gets a tokenizer_config.json that transformers reads
it with), and writes `generation_config.json` with the stop id it trained with (the
end-of-document id) — or copies the starting checkpoint's. `linen-moe
generate` of the run then tokenizes and stops with them, a resumed run
reads the same tokenizer without a `tokenizer`, and the Hugging Face
export hands them to transformers (`kept_files`).

Imports no jax.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os
import shutil
from typing import Any

from linen_moe._src.data import tokenization
from linen_moe._src.hf import generation_config as generation_config_file

TOKENIZER_CONFIG = "tokenizer_config.json"
# The tokenizer's own file, then those beside it that transformers reads.
TOKENIZER_FILES = (
    tokenization.TOKENIZER_FILE,
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "chat_template.jinja",
)
GENERATION_CONFIG = generation_config_file.FILE


def _same(a: str, b: str) -> bool:
  return os.path.abspath(a) == os.path.abspath(b)


def kept_tokenizer(directory: str | None) -> str | None:
  """The tokenizer.json a run kept in `directory`, or None."""
  if directory is None:
    return None
  return tokenization.find_tokenizer(directory)


def _write_json(path: str, value: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2)
    f.write("\n")


def generation_config(opts: Any, tokenizer: str | None) -> dict[str, Any]:
  """The generation_config.json of a run: the starting Hugging Face
  checkpoint's or run's (when it has one), with the end-of-document id the run's
  data used (`eod_id`, or its tokenizer's) as `eos_token_id` where that
  says none; {} when neither is known."""
  out: dict[str, Any] = {}
  start = getattr(opts, "init_from_hf", None) or getattr(
      opts, "init_from", None
  )
  if start is not None:
    out = dict(generation_config_file.read(start) or {})
  if out.get("eos_token_id") is not None:
    return out
  eos = getattr(opts, "eod_id", None)
  if eos is None and tokenizer is not None:
    loaded = tokenization.load_tokenizer(tokenizer)
    try:
      eos = tokenization.end_of_document_id(loaded, tokenizer)
    except ValueError:
      eos = None
  return out if eos is None else out | {"eos_token_id": int(eos)}


def keep(
    opts: Any, tokenizer: str | None, main_process: bool = True
) -> list[str]:
  """Copies the run's tokenizer files into `opts.checkpoint_dir` and writes
  its generation_config.json there (with a tokenizer, or the starting
  checkpoint's; a run without a directory keeps nothing).

  Args:
    opts: the run's `RunOptions`.
    tokenizer: the tokenizer.json the run reads (None: the run has no
      tokenizer, e.g. synthetic data or token ids).
    main_process: whether this process writes (process 0 of a group).

  Returns:
    The paths written.

  Raises:
    ValueError: the directory keeps another tokenizer.json than
      `tokenizer` (a resumed run reads the one it trained with).
  """
  directory = opts.checkpoint_dir
  if directory is None or not main_process:
    return []
  written = [] if tokenizer is None else _copy_tokenizer(tokenizer, directory)
  generation = generation_config(opts, tokenizer)
  if tokenizer is not None:
    config = os.path.join(directory, TOKENIZER_CONFIG)
    if not os.path.isfile(config):  # e.g. one `train_bpe_tokenizer` made
      _write_json(config, _tokenizer_config(tokenizer, generation))
      written.append(config)
  if tokenizer is not None or generation:
    path = os.path.join(directory, GENERATION_CONFIG)
    _write_json(path, generation)
    written.append(path)
  return written


def _copy_tokenizer(tokenizer: str, directory: str) -> list[str]:
  """Copies `tokenizer` and the `TOKENIZER_FILES` beside it into
  `directory`, unless it keeps another tokenizer.json."""
  source_dir = os.path.dirname(os.path.abspath(tokenizer))
  kept = os.path.join(directory, tokenization.TOKENIZER_FILE)
  if os.path.isfile(kept) and not filecmp.cmp(tokenizer, kept, shallow=False):
    raise ValueError(
        f"tokenizer {tokenizer}: {directory} trained with another tokenizer, "
        f"{kept}; resume with that one (leave out `tokenizer`), or start a "
        "new run in another `checkpoint_dir`."
    )
  written = []
  for name in TOKENIZER_FILES:
    source = (
        tokenizer
        if name == tokenization.TOKENIZER_FILE
        else (os.path.join(source_dir, name))
    )
    target = os.path.join(directory, name)
    if not os.path.isfile(source) or _same(source, target):
      continue
    shutil.copyfile(source, target)
    written.append(target)
  return written


def _tokenizer_config(tokenizer: str, generation: dict) -> dict[str, Any]:
  """A tokenizer_config.json for a lone tokenizer.json: transformers'
  `AutoTokenizer` then reads the tokenizer.json as it is
  (`PreTrainedTokenizerFast`), not as the model family's own tokenizer
  class would rebuild it, and knows its end-of-document token."""
  out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
  eos = generation.get("eos_token_id")
  if isinstance(eos, int):
    text = tokenization.load_tokenizer(tokenizer).id_to_token(eos)
    if text is not None:
      out["eos_token"] = text
  return out


@dataclasses.dataclass(frozen=True)
class KeptFiles:
  """What a run directory keeps for the users of its model (`keep`).

  Attributes:
    tokenizer: its `tokenizer.json`, or None.
    tokenizer_files: every tokenizer file it keeps (`TOKENIZER_FILES` that
      exist there), for a Hugging Face export.
    generation_config: its `generation_config.json` (the stop id as
      `eos_token_id`), or None when it keeps none.
  """

  tokenizer: str | None
  tokenizer_files: tuple[str, ...]
  generation_config: dict[str, Any] | None

  @property
  def stop_ids(self) -> list[int]:
    """`generation_config`'s `eos_token_id` as a list (none: [])."""
    return generation_config_file.stop_ids(self.generation_config)


def kept_files(directory: str | os.PathLike) -> KeptFiles:
  """What the run in `directory` kept of its tokenizer (`keep`).

  Args:
    directory: a run's `checkpoint_dir`.

  Returns:
    The `KeptFiles` (no files and no generation config for a run on
    synthetic data or token ids).

  Raises:
    ValueError: `directory` does not exist, or its generation_config.json
      is not a JSON object.
  """
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise ValueError(f"{directory} does not exist.")
  paths = [os.path.join(directory, name) for name in TOKENIZER_FILES]
  files = tuple(p for p in paths if os.path.isfile(p))
  config = generation_config_file.read(directory)
  return KeptFiles(kept_tokenizer(directory), files, config)
