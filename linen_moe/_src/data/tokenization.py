"""Hugging Face tokenizers (`tokenizer.json`, the `tokenizers` package):
loading one with its checks, finding the one beside a checkpoint, its
end-of-document token, and training a small one on your own text.

Imports no jax.
"""

from __future__ import annotations

from collections.abc import Sequence
import json
import os
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
# Names that released tokenizers give their end-of-text token, most usual
# first; `end_of_document_id` takes the first one the vocabulary has.
EOD_TOKENS = (
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "<|im_end|>",
    "[SEP]",
)
DEFAULT_EOD = EOD_TOKENS[0]
UNKNOWN = "<unk>"


def find_tokenizer(directory: str | os.PathLike) -> str | None:
  """The tokenizer a Hugging Face checkpoint ships beside its weights.

  Args:
    directory: the checkpoint's directory.

  Returns:
    `directory/tokenizer.json` if there is one, else None.
  """
  path = os.path.join(os.fspath(directory), TOKENIZER_FILE)
  return path if os.path.isfile(path) else None


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None):
  """The `tokenizers.Tokenizer` in `path` (a `tokenizer.json`).

  Args:
    path: the tokenizer file.
    vocab_size: the model's; the tokenizer's vocabulary (added tokens
      included) must fit in it (None: not checked).

  Returns:
    The tokenizer.

  Raises:
    ValueError: the file does not exist, is not a tokenizer, or its
      vocabulary is larger than `vocab_size`.
  """
  from tokenizers import Tokenizer  # noqa: PLC0415

  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ValueError(f"tokenizer {path}: no such file.")
  try:
    tokenizer = Tokenizer.from_file(path)
  except Exception as e:  # noqa: BLE001 (the Rust side raises Exception)
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    raise ValueError(
        f"tokenizer {path}: cannot be read as a tokenizer.json "
        f"({type(e).__name__}: {first})."
    ) from None
  size = tokenizer.get_vocab_size(with_added_tokens=True)
  if vocab_size is not None and size > vocab_size:
    raise ValueError(
        f"tokenizer {path}: its vocabulary of {size} tokens is larger than "
        f"the model's vocab_size={vocab_size}; its ids >= {vocab_size} would "
        "have no embedding (use the model's own tokenizer, or a model with "
        f"vocab_size >= {size})."
    )
  return tokenizer


def _configured_eos(path: str) -> str | None:
  """The `eos_token` of a `tokenizer_config.json` beside `path`, if any."""
  config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
  try:
    with open(config, encoding="utf-8") as f:
      eos = json.load(f).get("eos_token")
  except (OSError, ValueError, AttributeError):
    return None
  if isinstance(eos, dict):
    eos = eos.get("content")
  return eos if isinstance(eos, str) else None


def end_of_document_id(tokenizer: Any, path: str | None = None) -> int:
  """The id of the tokenizer's end-of-document token.

  Args:
    tokenizer: a `tokenizers.Tokenizer`.
    path: its file; the `eos_token` of a `tokenizer_config.json` beside it
      comes first.

  Returns:
    The id of that `eos_token`, else of the first of `EOD_TOKENS` that the
    vocabulary has.

  Raises:
    ValueError: it has none of them (name one with `eod_id`, `--eod-id`).
  """
  names = list(EOD_TOKENS)
  if path is not None and (eos := _configured_eos(path)):
    names.insert(0, eos)
  for name in names:
    token_id = tokenizer.token_to_id(name)
    if token_id is not None:
      return int(token_id)
  where = f"tokenizer {path}" if path else "the tokenizer"
  raise ValueError(
      f"{where}: has no end-of-document token (none of {EOD_TOKENS}); give "
      "its id with eod_id (--eod-id)."
  )


def _check_text_files(files: Sequence[str]) -> None:
  """Raises unless every file of `files` (one at least) holds text."""
  if isinstance(files, (str, os.PathLike)) or not files:
    raise ValueError(
        f"train_bpe_tokenizer: files={files!r} must be a non-empty list of "
        "text files."
    )
  for file in files:
    if not os.path.isfile(file):
      raise ValueError(f"train_bpe_tokenizer: {file} does not exist.")
    with open(file, encoding="utf-8", errors="replace") as f:
      if not any(line.strip() for line in f):
        raise ValueError(
            f"train_bpe_tokenizer: {file} is empty: it holds no text to "
            "learn a vocabulary from."
        )


def train_bpe_tokenizer(
    files: Sequence[str],
    vocab_size: int,
    path: str | os.PathLike | None = None,
):
  """A small BPE tokenizer trained on `files` (deterministic).

  Words split on white space (kept as the "▁" mark, so decoding restores
  the text); merges learnt until `vocab_size` tokens; `<|endoftext|>`
  (the end-of-document token) and "<unk>" are ids 0 and 1. When the text
  has more distinct characters than fit, the rarest ones become "<unk>".

  Args:
    files: UTF-8 text files.
    vocab_size: tokens in all, added ones included, at most (the
      vocabulary is smaller when the text has no more merges to learn).
    path: where to save it as a `tokenizer.json` (None: not saved).

  Returns:
    The `tokenizers.Tokenizer`.

  Raises:
    TypeError: if `vocab_size` is not an int.
    ValueError: if it is below 3, `files` is empty, or a file does not
      exist or holds no text (white space only).
  """
  from tokenizers import Tokenizer  # noqa: PLC0415
  from tokenizers import decoders  # noqa: PLC0415
  from tokenizers import models  # noqa: PLC0415
  from tokenizers import normalizers  # noqa: PLC0415
  from tokenizers import pre_tokenizers  # noqa: PLC0415
  from tokenizers import trainers  # noqa: PLC0415

  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
    raise TypeError(f"train_bpe_tokenizer: vocab_size={vocab_size!r} not int.")
  if vocab_size < 3:
    raise ValueError(
        f"train_bpe_tokenizer: vocab_size={vocab_size} must be >= 3."
    )
  _check_text_files(files)
  tokenizer = Tokenizer(models.BPE(unk_token=UNKNOWN))
  tokenizer.normalizer = normalizers.NFC()
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
  tokenizer.decoder = decoders.Metaspace()
  special = [DEFAULT_EOD, UNKNOWN]
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=special,
      limit_alphabet=vocab_size - len(special),
      show_progress=False,
  )
  tokenizer.train([os.fspath(f) for f in files], trainer)
  if path is not None:
    tokenizer.save(os.fspath(path))
  return tokenizer
