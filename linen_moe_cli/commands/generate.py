"""`linen-moe generate`: a model's continuation of a prompt, greedy or
sampled, with the KV cache, streamed to the terminal as it is drawn; or
every prompt of a file, written as JSONL.

The model is a Hugging Face checkpoint (`--hf-dir DIR`) or a `linen-moe
train` checkpoint (`--checkpoint-dir DIR`); the prompt is `--prompt TEXT`
(tokenized with DIR/tokenizer.json or `--tokenizer`; `--chat` wraps it in
the tokenizer's chat template, after a `--system` prompt), `--prompt-ids
1,2,3`, or `--prompts-file FILE` (one prompt a line, or JSONL with
"prompt" or "prompt_ids"; results to `--output FILE` or stdout). Sampling:
`--temperature` (0: greedy), `--top-k`, `--top-p`, `--min-p`, `--seed`;
rows end at a stop id: `--stop-id` (repeatable), else the checkpoint's
generation_config.json `eos_token_id` (`prompt_job`). Two independent
choices say how it runs:
`--serve MODE` converts the expert weights to a quantized storage type
(float weights when absent), and `--quantization MODE` runs float weights
through that mode's quantized contractions (none when absent). Timing a
model: `benchmarks/serving/bench_serving.py`.
"""

from __future__ import annotations

import argparse
import os
import sys

from linen_moe.decoding import Sampling
from linen_moe.quantization import MODES
from linen_moe.quantization import SERVING_MODES
from linen_moe_cli import model_args
from linen_moe_cli import options
from linen_moe_cli.generate_options import GenerateOptions


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "generate",
      help=(
          "decoding with a KV cache, greedy or sampled: a checkpoint's "
          "continuation of a prompt, streamed (--hf-dir, --checkpoint-dir), "
          "or of a file of prompts (--prompts-file), from float or serving "
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
      help=(
          "a linen-moe train run's --checkpoint-dir (its latest step; not an"
          " export)"
      ),
  )
  prompt = p.add_mutually_exclusive_group()
  prompt.add_argument(
      "--prompt",
      default=None,
      help="text, tokenized with DIR/tokenizer.json or --tokenizer",
  )
  prompt.add_argument(
      "--prompt-ids", default=None, metavar="IDS", help="token ids, e.g. 1,2,3"
  )
  prompt.add_argument(
      "--prompts-file",
      default=None,
      metavar="FILE",
      help=(
          'one prompt a line, or JSONL with "prompt" (text) or "prompt_ids";'
          " writes one JSONL result a prompt (--output)"
      ),
  )
  p.add_argument(
      "--output",
      default=None,
      metavar="FILE",
      help="--prompts-file's JSONL results (default: stdout)",
  )
  p.add_argument(
      "--batch-size",
      type=int,
      default=8,
      help="--prompts-file: prompts decoded together",
  )
  p.add_argument(
      "--chat",
      action="store_true",
      help="wrap the prompt in the tokenizer's chat template (a user turn)",
  )
  p.add_argument(
      "--system", default=None, help="--chat: a system turn before the prompt"
  )
  p.add_argument(
      "--temperature",
      type=float,
      default=0.0,
      help="sampling temperature, >= 0 (0: greedy)",
  )
  p.add_argument(
      "--top-k", type=int, default=0, help="keep the k likeliest (0: all)"
  )
  p.add_argument(
      "--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]"
  )
  p.add_argument(
      "--min-p", type=float, default=0.0, help="min-p in [0, 1] (0: off)"
  )
  p.add_argument("--seed", type=int, default=0, help="sampling seed")
  p.add_argument(
      "--stop-id",
      type=int,
      action="append",
      default=None,
      metavar="ID",
      help=(
          "a token id that ends a row (repeatable; default: the checkpoint's "
          "generation_config.json eos_token_id)"
      ),
  )
  p.add_argument(
      "--tokenizer",
      default=None,
      metavar="FILE",
      help="a tokenizer.json (default: DIR/tokenizer.json when there is one)",
  )
  p.add_argument(
      "--serve",
      choices=model_args.SERVE,
      default="none",
      metavar="MODE",
      help=(
          "serve expert weights converted to MODE's storage type "
          f"({', '.join(SERVING_MODES)}; a Hugging Face checkpoint's "
          "are converted as they are read); none: float weights"
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
  p.add_argument(
      "--max-new-tokens",
      "--new-tokens",
      dest="new_tokens",
      type=int,
      default=32,
      help="the most new tokens a prompt",
  )
  p.set_defaults(run=run, flags=options.flags_of(p))


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
  if args.prompt is None and args.prompt_ids is None and not args.prompts_file:
    raise ValueError(
        f"{flag} needs --prompt TEXT, --prompt-ids 1,2,3 or --prompts-file "
        "FILE."
    )
  if args.prompts_file and not os.path.isfile(args.prompts_file):
    raise ValueError(f"--prompts-file {args.prompts_file} does not exist.")
  if args.output and not args.prompts_file:
    raise ValueError("--output is for --prompts-file's results.")
  options.check_int("new_tokens", args.new_tokens, 1)
  options.check_int("batch_size", args.batch_size, 1)
  sampling = Sampling(args.temperature, args.top_k, args.top_p, args.min_p)
  if any(i < 0 for i in args.stop_id or ()):
    raise ValueError(f"--stop-id {min(args.stop_id)} must be >= 0.")
  if args.system is not None and not args.chat:
    raise ValueError("--system needs --chat.")
  model_args.check_serve(args)
  tokenizer = args.tokenizer
  default = os.path.join(directory, "tokenizer.json")
  if tokenizer is None and os.path.isfile(default):
    tokenizer = default
  if args.chat and args.prompt is None and not args.prompts_file:
    raise ValueError("--chat wraps a text prompt: --prompt or --prompts-file.")
  if args.prompt is not None or args.chat:
    if tokenizer is None:
      flag = "--prompt" if args.prompt is not None else "--chat"
      raise ValueError(
          f"{flag} needs a tokenizer: {default} does not exist; pass "
          "--tokenizer FILE, or token ids with --prompt-ids."
      )
    notice = options.missing_optional("tokenizers", "--prompt cannot be read")
    if notice:
      raise ValueError(notice)
  if tokenizer is not None and not os.path.isfile(tokenizer):
    raise ValueError(f"--tokenizer {tokenizer} does not exist.")
  sampling = GenerateOptions(
      max_new_tokens=args.new_tokens,
      sampling=sampling,
      seed=args.seed,
      stop_ids=None if args.stop_id is None else tuple(args.stop_id),
      chat=args.chat,
      system=args.system,
  )
  job = {
      "hf_dir": args.hf_dir,
      "checkpoint_dir": args.checkpoint_dir,
      "tokenizer": tokenizer,
      "sampling": sampling,
      "serve": args.serve,
      "quantization": args.serve if args.serve != "none" else args.quantization,
  }
  if args.prompts_file:
    return job | {
        "prompts_file": args.prompts_file,
        "output": args.output,
        "batch_size": args.batch_size,
    }
  return job | {
      "prompt": args.prompt,
      "prompt_ids": (
          None if args.prompt_ids is None else _prompt_ids(args.prompt_ids)
      ),
      "tokenizer": tokenizer if args.prompt is not None or tokenizer else None,
  }


def run(args: argparse.Namespace) -> int:
  job = _checked(args)
  from linen_moe_cli import prompt_job  # noqa: PLC0415 (imports jax)

  try:
    if "prompts_file" in job:
      summary = prompt_job.generate_file(**job)
      print(summary, file=sys.stderr if job["output"] is None else sys.stdout)
      return 0
    print(prompt_job.format_report(prompt_job.generate(**job)))
  except ValueError as e:  # the library's, naming its arguments
    e.args = (options.in_flag_words(str(e), args.flags),)
    raise
  return 0
