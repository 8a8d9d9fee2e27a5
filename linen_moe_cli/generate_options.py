"""How `linen-moe generate` renders a prompt and draws its continuation:
one `GenerateOptions`, built from the flags (`commands/generate.py`) and
read by `prompt_job`.

Imports no jax: the command builds it before the job is imported.
"""

from __future__ import annotations

import dataclasses

from linen_moe.decoding import Sampling


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
  """What every prompt of one `linen-moe generate` run is decoded with.

  Each field is a flag (`max_new_tokens` is `--max-new-tokens`), checked by
  the command; `linen_moe.decoding.generate` and `generate_stream` take
  `sampling`'s settings under the same names.

  Attributes:
    max_new_tokens: the most new tokens a prompt, >= 1 (`--max-new-tokens`).
    sampling: how a token is drawn (`--temperature`, `--top-k`, `--top-p`,
      `--min-p`; the library's `Sampling`, checked at construction).
    seed: the sampling seed; the i-th prompt of a prompts file (from 0)
      draws with `seed + i`.
    stop_ids: token ids that end a row (`--stop-id`, inclusive); None:
      the checkpoint's generation_config.json `eos_token_id`
      (`linen_moe.decoding.load_model`'s `stop_ids`).
    chat: a text prompt is rendered with the tokenizer's chat template, as
      a user turn followed by the assistant's header.
    system: with `chat`, a system turn before the user's (None: none).
  """

  max_new_tokens: int = 32
  sampling: Sampling = Sampling()
  seed: int = 0
  stop_ids: tuple[int, ...] | None = None
  chat: bool = False
  system: str | None = None
