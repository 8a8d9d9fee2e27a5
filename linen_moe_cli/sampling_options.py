"""How `linen-moe generate` renders a prompt and draws its continuation:
one `SamplingOptions`, built from the flags (`commands/generate.py`) and
read by `prompt_job`.

Imports no jax: the command builds it before the job is imported.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
  """What every prompt of one `linen-moe generate` run is decoded with.

  Each field is a flag (`top_k` is `--top-k`), checked by the command;
  `linen_moe.decoding.generate` and `generate_stream` take the sampling
  ones under the same names.

  Attributes:
    max_new_tokens: the most new tokens a prompt, >= 1 (`--max-new-tokens`).
    temperature: the sampling temperature, >= 0; 0 is greedy.
    top_k: draw among the k likeliest tokens (0: all of them).
    top_p: the nucleus: the likeliest tokens whose probabilities sum to at
      least top_p, in (0, 1] (1: all of them).
    min_p: drop the tokens less likely than min_p times the likeliest, in
      [0, 1] (0: none).
    seed: the sampling seed; the i-th prompt of a prompts file (from 0)
      draws with `seed + i`.
    stop_ids: token ids that end a row (`--stop-id`, inclusive); None:
      the checkpoint's generation_config.json `eos_token_id`
      (`prompt_job.stop_ids_of`).
    chat: a text prompt is rendered with the tokenizer's chat template, as
      a user turn followed by the assistant's header.
    system: with `chat`, a system turn before the user's (None: none).
  """

  max_new_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int = 0
  stop_ids: tuple[int, ...] | None = None
  chat: bool = False
  system: str | None = None
