"""`linen-moe generate`: greedy decoding with a KV cache.

With `--hf-dir DIR` (a Hugging Face checkpoint) or `--checkpoint-dir DIR`
(a `linen-moe train` checkpoint), the model's continuation of `--prompt
TEXT` (tokenized with DIR/tokenizer.json or `--tokenizer`) or `--prompt-ids
1,2,3`, from float weights or `--quantization` serving weights
(`prompt_job`). Without either, the benchmark: train the decoder of
`--config` briefly, convert its expert weights for serving and decode
float and converted side by side (`generate_job`).
"""

from __future__ import annotations

import argparse
import os

from linen_moe_cli import model_args
from linen_moe_cli import options


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "generate",
      help=(
          "greedy decoding with a KV cache: a model's continuation of a "
          "prompt (--hf-dir, --checkpoint-dir), or float vs converted "
          "serving weights of a briefly trained --config"
      ),
  )
  model_args.add_model_args(p)
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
      "--train-steps",
      type=int,
      default=50,
      help="without a DIR: train this many steps first, in the serving mode",
  )
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=16)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3, help="timed runs")
  p.add_argument("--seed", type=int, default=0)
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
  flag = "--hf-dir" if args.hf_dir else "--checkpoint-dir"
  if not os.path.isdir(directory):
    raise ValueError(f"{flag} {directory} is not a directory.")
  if args.hf_dir and not os.path.isfile(os.path.join(directory, "config.json")):
    raise ValueError(f"--hf-dir {directory} holds no config.json.")
  if args.prompt is None and args.prompt_ids is None:
    raise ValueError(f"{flag} needs --prompt TEXT or --prompt-ids 1,2,3.")
  options.check_int("new_tokens", args.new_tokens, 1)
  extra = set(model_args.model_overrides(args)) - {"quantization"}
  if extra:
    raise ValueError(
        f"{flag}: the model is the checkpoint's; {sorted(extra)} cannot be "
        "overridden (--quantization chooses float or serving weights)."
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
      "quantization": args.quantization or "none",
  }


def run(args: argparse.Namespace) -> int:
  if args.hf_dir or args.checkpoint_dir:
    job = _checked(args)
    from linen_moe_cli import prompt_job  # noqa: PLC0415 (imports jax)

    print(prompt_job.format_report(prompt_job.generate(**job)))
    return 0
  if args.prompt is not None or args.prompt_ids is not None:
    raise ValueError(
        "--prompt and --prompt-ids need --hf-dir or --checkpoint-dir."
    )
  from linen_moe_cli import generate_job  # noqa: PLC0415 (imports jax)

  overrides = model_args.model_overrides(args)
  overrides.pop("quantization", None)
  result = generate_job.generate(
      args.config,
      overrides,
      quantization=args.quantization or "int8",
      train_steps=args.train_steps,
      batch_size=args.batch_size,
      prompt_len=args.prompt_len,
      new_tokens=args.new_tokens,
      seed=args.seed,
      repeats=args.repeats,
  )
  print(generate_job.format_report(result))
  return 0
