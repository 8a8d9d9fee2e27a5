"""`linen-moe generate`: a model's greedy continuation of a prompt, with the
KV cache.

The model is a Hugging Face checkpoint (`--hf-dir DIR`) or a `linen-moe
train` checkpoint (`--checkpoint-dir DIR`); the prompt is `--prompt TEXT`
(tokenized with DIR/tokenizer.json or `--tokenizer`) or `--prompt-ids
1,2,3` (`prompt_job`). Two independent choices say how it runs:
`--serve MODE` converts the expert weights to a quantized storage type
(float weights when absent), and `--quantization MODE` runs float weights
through that mode's quantized contractions (none when absent). Timing a
model: `benchmarks/serving/bench_serving.py`.
"""

from __future__ import annotations

import argparse
import os

from linen_moe.quantization import MODES
from linen_moe.quantization import SERVING_MODES
from linen_moe_cli import options

SERVE = ("none", *SERVING_MODES)


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "generate",
      help=(
          "greedy decoding with a KV cache: a checkpoint's continuation of "
          "a prompt (--hf-dir, --checkpoint-dir), from float or serving "
          "weights"
      ),
  )
  source = p.add_mutually_exclusive_group()
  source.add_argument(
      "--hf-dir", default=None, metavar="DIR", help="a Hugging Face checkpoint"
  )
  source.add_argument(
      "--checkpoint-dir",
      default=None,
      metavar="DIR",
      help="a linen-moe train checkpoint directory (its latest step)",
  )
  prompt = p.add_mutually_exclusive_group()
  prompt.add_argument(
      "--prompt", default=None, help="text, tokenized with --tokenizer"
  )
  prompt.add_argument(
      "--prompt-ids", default=None, metavar="IDS", help="token ids, e.g. 1,2,3"
  )
  p.add_argument(
      "--tokenizer",
      default=None,
      metavar="FILE",
      help="a tokenizer.json (default: DIR/tokenizer.json when there is one)",
  )
  p.add_argument(
      "--serve",
      choices=SERVE,
      default="none",
      metavar="MODE",
      help=(
          "serve expert weights converted to MODE's storage type "
          f"({', '.join(SERVING_MODES)}; a Hugging Face checkpoint's "
          "are converted as they are read); default none: float weights"
      ),
  )
  p.add_argument(
      "--quantization",
      choices=tuple(MODES),
      default=None,
      help=(
          "run the float weights through this mode's quantized contractions "
          "(default none; a --checkpoint-dir allows none or the mode it "
          "trained in); with --serve, only the served mode"
      ),
  )
  p.add_argument("--new-tokens", type=int, default=32)
  p.set_defaults(run=run)


def _prompt_ids(text: str) -> list[int]:
  try:
    ids = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    ids = []
  if not ids or any(i < 0 for i in ids):
    raise ValueError(
        f"--prompt-ids {text!r} is invalid: expected comma-separated "
        "non-negative token ids, e.g. 1,2,3."
    )
  return ids


def _checked(args: argparse.Namespace) -> dict:
  """The prompt job's arguments, checked before jax is imported."""
  directory = args.hf_dir or args.checkpoint_dir
  if directory is None:
    raise ValueError(
        "generate needs a model: --hf-dir DIR or --checkpoint-dir DIR "
        "(timing a random model: benchmarks/serving/bench_serving.py)."
    )
  flag = "--hf-dir" if args.hf_dir else "--checkpoint-dir"
  if not os.path.isdir(directory):
    raise ValueError(f"{flag} {directory} is not a directory.")
  if args.hf_dir and not os.path.isfile(os.path.join(directory, "config.json")):
    raise ValueError(f"--hf-dir {directory} holds no config.json.")
  if args.prompt is None and args.prompt_ids is None:
    raise ValueError(f"{flag} needs --prompt TEXT or --prompt-ids 1,2,3.")
  options.check_int("new_tokens", args.new_tokens, 1)
  if args.serve != "none" and args.quantization not in (None, args.serve):
    raise ValueError(
        f"--quantization {args.quantization} with --serve {args.serve}: "
        "serving weights run in their own mode; drop --quantization or "
        f"pass --quantization {args.serve}."
    )
  tokenizer = args.tokenizer
  default = os.path.join(directory, "tokenizer.json")
  if tokenizer is None and os.path.isfile(default):
    tokenizer = default
  if args.prompt is not None:
    if tokenizer is None:
      raise ValueError(
          f"--prompt needs a tokenizer: {default} does not exist; pass "
          "--tokenizer FILE, or token ids with --prompt-ids."
      )
    notice = options.missing_optional("tokenizers", "--prompt cannot be read")
    if notice:
      raise ValueError(notice)
  if tokenizer is not None and not os.path.isfile(tokenizer):
    raise ValueError(f"--tokenizer {tokenizer} does not exist.")
  return {
      "hf_dir": args.hf_dir,
      "checkpoint_dir": args.checkpoint_dir,
      "prompt": args.prompt,
      "prompt_ids": (
          None if args.prompt_ids is None else _prompt_ids(args.prompt_ids)
      ),
      "tokenizer": tokenizer if args.prompt is not None or tokenizer else None,
      "new_tokens": args.new_tokens,
      "serve": args.serve,
      "quantization": args.serve if args.serve != "none" else args.quantization,
  }


def run(args: argparse.Namespace) -> int:
  job = _checked(args)
  from linen_moe_cli import prompt_job  # noqa: PLC0415 (imports jax)

  print(prompt_job.format_report(prompt_job.generate(**job)))
  return 0
