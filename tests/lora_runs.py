"""A QLoRA run on a Hugging Face base with chat data: its inputs and
options, shared by the run's tests (run/test_lora_runs.py: its resume) and
the export's (cli/test_cli_lora.py: `linen-moe export` of it)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax
import numpy as np

from linen_moe import Decoder
from linen_moe import hf
from linen_moe import training
from linen_moe.sharding import unbox

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
QUESTIONS = ("What is 2 + 2?", "Name a prime number.", "Say hello.")
ANSWERS = ("2 + 2 = 4.", "Seven is a prime number.", "Hello!")


def write_inputs(tmp: str) -> tuple[str, str]:
  """Writes the run's base and data into `tmp`.

  Args:
    tmp: an existing directory.

  Returns:
    (base, chats): a Hugging Face checkpoint of the Qwen3-MoE fixture's
    architecture with a vocabulary of 256 (random weights) and the
    Mixtral-style chat tokenizer fixture (200 tokens) beside it; a JSONL
    file of 24 one-turn conversations.
  """
  base = os.path.join(tmp, "base")
  config_json = json.loads(
      (FIXTURES / "hf" / "qwen3_moe_dense0_norm" / "config.json").read_text()
  )
  cfg = hf.model_config(config_json).replace(vocab_size=256)
  tokens = np.zeros((1, 2), np.int32)
  variables = unbox(Decoder(cfg).init(jax.random.key(0), tokens))
  hf.save_checkpoint(cfg, variables, base)
  for name in (
      "tokenizer.json",
      "tokenizer_config.json",
      "chat_template.jinja",
  ):
    shutil.copy(FIXTURES / "chat" / "mixtral" / name, base)
  chats = os.path.join(tmp, "chats.jsonl")
  with open(chats, "w", encoding="utf-8") as f:
    for i in range(24):
      messages = [
          {"role": "user", "content": QUESTIONS[i % 3]},
          {"role": "assistant", "content": ANSWERS[i % 3]},
      ]
      f.write(json.dumps({"messages": messages}) + "\n")
  return base, chats


def options(
    base: str, chats: str, directory: str, **fields
) -> training.RunOptions:
  """Rank-4 adapters (alpha 8) on `base`'s int8 serving weights, 4 steps
  of 4 x 32 tokens of `chats`, saved every 2 steps into `directory`;
  `fields` added."""
  return training.RunOptions(
      init_from_hf=base,
      data=chats,
      data_format="chat",
      lora_rank=4,
      lora_alpha=8.0,
      overrides={"quantization": "int8"},
      frozen_base_serving=True,
      learning_rate=1e-2,  # the LoRA recipe's 2e-4 moves little in 4 steps
      lr_schedule="cosine",
      warmup_steps=1,
      steps=4,
      save_every=2,
      batch_size=4,
      seq_len=32,
      progress=False,
      checkpoint_dir=directory,
      **fields,
  )
