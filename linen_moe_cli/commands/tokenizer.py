"""`linen-moe tokenizer train FILES --vocab-size N --out tokenizer.json`: a
small BPE tokenizer learnt from your own text (`linen_moe.data.
train_bpe_tokenizer`), for `linen-moe train --data FILES --tokenizer
tokenizer.json`.

Every bad input (a missing or empty file, a vocabulary below 3, an --out
that exists or whose folder does not) is one line before any training.
"""

from __future__ import annotations

import argparse
import os

from linen_moe_cli import options

# `linen_moe.data.train_bpe_tokenizer`'s end-of-document token (id 0).
END_OF_DOCUMENT = "<|endoftext|>"


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "tokenizer",
      help="make a tokenizer.json from your own text (tokenizer train)",
  )
  actions = p.add_subparsers(dest="action", required=True)
  t = actions.add_parser(
      "train",
      help=(
          "learn a BPE vocabulary from UTF-8 text files; <|endoftext|> (the"
          " end-of-document and stop token) is id 0, <unk> id 1"
      ),
  )
  t.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files")
  t.add_argument(
      "--vocab-size",
      type=int,
      required=True,
      metavar="N",
      help=(
          "tokens in all, at least 3, at most the model's vocab_size (256 "
          "for the tiny configs)"
      ),
  )
  t.add_argument(
      "--out",
      required=True,
      metavar="FILE",
      help="the tokenizer.json to write (a new file)",
  )
  t.set_defaults(run=run)


def _checked(args: argparse.Namespace) -> None:
  options.check_int("vocab_size", args.vocab_size, 3)
  for file in args.files:
    if os.path.isdir(file):
      raise ValueError(
          f"tokenizer train: {file} is a folder; give its files (e.g."
          f" {os.path.join(file, '*.txt')}, unquoted: the shell expands it)."
      )
    if not os.path.isfile(file):
      glob = ""
      if any(c in file for c in "*?["):  # `train --data` takes it quoted
        glob = " (a glob is not expanded here: leave it unquoted for the shell)"
      raise ValueError(f"tokenizer train: {file} does not exist{glob}.")
  if os.path.exists(args.out):
    raise ValueError(
        f"--out {args.out} exists; it is never overwritten: choose a new file."
    )
  folder = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(folder):
    raise ValueError(f"--out {args.out}: the folder {folder} does not exist.")
  notice = options.missing_optional("tokenizers", "no tokenizer can be trained")
  if notice:
    raise ValueError(notice)


def run(args: argparse.Namespace) -> int:
  _checked(args)
  from linen_moe import data  # noqa: PLC0415

  tokenizer = data.train_bpe_tokenizer(args.files, args.vocab_size, args.out)
  size = tokenizer.get_vocab_size(with_added_tokens=True)
  eod = tokenizer.token_to_id(END_OF_DOCUMENT)
  print(
      f"wrote {args.out}: {size} tokens from {len(args.files)} file(s); "
      f"end of document (stop) id {eod}. Train on your text with: linen-moe "
      f"train --data FILES --tokenizer {args.out} (the model's vocab_size "
      f"must be >= {size})"
  )
  return 0
