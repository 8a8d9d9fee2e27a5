"""`linen-moe generate --hf-dir DIR | --checkpoint-dir DIR`: a model's
continuation of a prompt (greedy or sampled, streamed to the terminal as it
is drawn) or of every prompt of a file (JSONL results), with the KV cache,
from float or quantized serving weights.

The model comes from a Hugging Face checkpoint (`linen_moe.hf`; int8 / fp8
serving weights are quantized as the tensors are read) or from a training
checkpoint of `linen-moe train` (`checkpoint.read_variables`; converted with
`quantization.quantize_weights`). Float weights run through the contractions of
`quantization` (none by default; a training checkpoint's own mode, with its
fp8 state, or none). A text prompt is tokenized with a `tokenizer.json` (the
`tokenizers` package), wrapped first in the tokenizer's chat template with
`--chat`, and the continuation decoded with it.

One prompt streams: `decoding.generate_stream` is a Python loop over the
compiled prefill and decode step, each token fetched as it is drawn and its
text printed at once (a host callback inside `generate`'s one program
would print too, but ties the program to the terminal; a step's dispatch
is small beside a step of a real model). A prompts file runs through
`decoding.generate` in batches of `batch_size`: one program per batch
bucket, no dispatch per token.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy as np

from linen_moe import decoding
from linen_moe.tokens import validate_tokens
from linen_moe_cli.generate_options import GenerateOptions


@dataclasses.dataclass(frozen=True)
class Continuation:
  """A prompt and its continuation.

  Attributes:
    prompt_ids: <int32>[P], the prompt's token ids.
    new_ids: <int32>[N], the generated ones (up to a stop id, inclusive).
    text: the continuation decoded with the tokenizer (None without one).
    weights: "float" or the serving mode.
    finish_reason: "stop" or "length".
    seconds: from the first call to the last token (load excluded).
    first_seconds: from the first call to the first token: the prefill
      and the programs' compile.
  """

  prompt_ids: np.ndarray
  new_ids: np.ndarray
  text: str | None
  weights: str
  finish_reason: str = "length"
  seconds: float = 0.0
  first_seconds: float = 0.0


def load_model(
    hf_dir, checkpoint_dir, serve: str, quantization: str | None, tokenizer=None
):
  """The model of the Hugging Face checkpoint `hf_dir`, else of the
  training checkpoint `checkpoint_dir`, with its tokenizer and stop ids
  (`linen_moe.decoding.load_model`): serving weights of `serve`, or
  ("none") float weights computed in `quantization` (None: "none")."""
  return decoding.load_model(
      hf_dir or checkpoint_dir,
      serve=serve,
      quantization=quantization or "none",
      tokenizer=tokenizer,
  )


def _stops(model, sampling: GenerateOptions) -> list[int]:
  """`--stop-id`s when given, else the model's (its generation config's
  `eos_token_id`)."""
  if sampling.stop_ids is not None:
    return list(sampling.stop_ids)
  return list(model.stop_ids)


def _encode(tok, tokenizer: str, text: str, sampling: GenerateOptions):
  """The ids of `text`, rendered first with the tokenizer's chat template
  when `sampling.chat`: a user turn after an optional system turn, then
  the generation prompt as far as a chat fine-tune's training text holds
  it (`ChatTemplate.generation_prompt_ids`), so the reply starts where
  the loss mask started."""
  if not sampling.chat:
    return tok.encode(text).ids
  from linen_moe.data import load_chat_template  # noqa: PLC0415

  template = load_chat_template(tokenizer)
  system = sampling.system
  messages = [{"role": "system", "content": system}] if system else []
  messages.append({"role": "user", "content": text})
  return template.generation_prompt_ids(messages, tok)


def _decoding_args(sampling: GenerateOptions, stops: list[int]) -> dict:
  """`decoding.generate`'s and `generate_stream`'s keywords, but the seed."""
  return {
      "max_new_tokens": sampling.max_new_tokens,
      "sampling": sampling.sampling,
      "stop_ids": stops,
  }


def _weights(serve: str, quantization: str | None) -> str:
  weights = "float" if serve == "none" else serve
  if serve == "none" and quantization not in (None, "none"):
    weights += f" (in {quantization}'s contractions)"
  return weights


class _TextStream:
  """Prints a continuation's text as its tokens come: the decoded text of
  all the ids so far, less what is printed (held back while it ends in an
  incomplete character)."""

  def __init__(self, tok, out):
    self.tok, self.out, self.ids, self.printed = tok, out, [], ""

  def add(self, token: int) -> None:
    self.ids.append(token)
    text = self.tok.decode(self.ids)
    if text.endswith("\ufffd") or not text.startswith(self.printed):
      return
    self.out.write(text[len(self.printed) :])
    self.out.flush()
    self.printed = text


def generate(
    *,
    hf_dir: str | None,
    checkpoint_dir: str | None,
    prompt_ids: list[int] | None,
    prompt: str | None,
    tokenizer: str | None,
    sampling: GenerateOptions,
    serve: str = "none",
    quantization: str | None = None,
    out=None,
) -> Continuation:
  """One prompt's continuation (see the module docstring), drawn as
  `sampling` says, its text written to `out` as it is drawn (after
  "weights:", "prompt ids:" and "text: " lines; stdout by default); a
  prompt id outside the model's vocabulary is a ValueError before any
  decoding."""
  out = sys.stdout if out is None else out
  model = load_model(hf_dir, checkpoint_dir, serve, quantization, tokenizer)
  config, variables, tok = model.config, model.variables, model.tokenizer
  if prompt is not None:
    prompt_ids = _encode(tok, model.tokenizer_path, prompt, sampling)
    if not prompt_ids:
      raise ValueError(f"--prompt {prompt!r} encodes to no tokens.")
  validate_tokens(
      np.asarray([prompt_ids], np.int32), config.vocab_size, name="prompt"
  )
  stops = _stops(model, sampling)
  weights = _weights(serve, quantization)
  stream = decoding.generate_stream(
      config,
      variables,
      prompt_ids,
      seed=sampling.seed,
      **_decoding_args(sampling, stops),
  )
  out.write(f"weights: {weights}\nprompt ids: {list(prompt_ids)}\n")
  text = None if tok is None else _TextStream(tok, out)
  if text is not None:
    out.write("text: ")
    out.flush()
  start, new, first = time.perf_counter(), [], 0.0
  for token in stream:
    if not new:
      first = time.perf_counter() - start
    new.append(token)
    if text is not None:
      text.add(token)
  seconds = time.perf_counter() - start
  if text is not None:
    out.write("\n")
  reason = "stop" if new and new[-1] in stops else "length"
  decoded = None if tok is None else tok.decode(new)
  return Continuation(
      np.asarray(prompt_ids),
      np.asarray(new),
      decoded,
      weights,
      reason,
      seconds,
      first,
  )


def format_report(result: Continuation) -> str:
  """The lines after the streamed text: the new ids, why the row ended,
  the time to the first token (the prefill and the compile) and the
  decoding rate of the tokens after it."""
  n = len(result.new_ids)
  decode_s = result.seconds - result.first_seconds
  rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
  return "\n".join([
      f"new ids: {result.new_ids.tolist()}",
      f"finish: {result.finish_reason}",
      (
          f"{n} new tokens in {result.seconds:.2f} s: the first after "
          f"{result.first_seconds:.2f} s (prefill and compile), then "
          f"{rate:.1f} tokens/s"
      ),
  ])


def read_prompts(path: str) -> list[dict]:
  """The prompts of a file: one per line, as text, or JSONL objects with
  "prompt" (text) or "prompt_ids" (token ids); blank lines are skipped.

  Raises:
    ValueError: a JSON line that is not an object with one of them (named
      by its line number), or a file without prompts.
  """
  prompts = []
  with open(path, encoding="utf-8") as f:
    for number, raw in enumerate(f, 1):
      text = raw.rstrip("\n")
      if not text.strip():
        continue
      if text.lstrip().startswith("{"):
        try:
          record = json.loads(text)
        except json.JSONDecodeError as e:
          raise ValueError(f"--prompts-file {path}:{number}: {e}") from None
        if not isinstance(
            record.get("prompt_ids", record.get("prompt")), (str, list)
        ):
          raise ValueError(
              f'--prompts-file {path}:{number}: a JSON line needs "prompt"'
              ' (text) or "prompt_ids" (token ids).'
          )
        prompts.append(record)
      else:
        prompts.append({"prompt": text})
  if not prompts:
    raise ValueError(f"--prompts-file {path} holds no prompts.")
  return prompts


def generate_file(
    *,
    hf_dir: str | None,
    checkpoint_dir: str | None,
    prompts_file: str,
    tokenizer: str | None,
    sampling: GenerateOptions,
    output: str | None = None,
    batch_size: int = 8,
    serve: str = "none",
    quantization: str | None = None,
) -> str:
  """Every prompt of `prompts_file` (`read_prompts`), decoded in batches of
  `batch_size` by `decoding.generate` as `sampling` says; one JSONL line
  per prompt, in order, to `output` (stdout when None): "prompt",
  "prompt_ids", "new_ids", "text" (with a tokenizer), "finish_reason". The
  i-th prompt of the file (from 0) draws with the seed `sampling.seed + i`
  (`generate`'s per-prompt seeds), whatever the batch size. Returns the
  summary line (count, tokens/s, and the first batch's time, which holds
  the compile)."""
  records = read_prompts(prompts_file)
  model = load_model(hf_dir, checkpoint_dir, serve, quantization, tokenizer)
  config, variables, tok = model.config, model.variables, model.tokenizer
  rows = []
  for i, record in enumerate(records):
    if "prompt_ids" in record:
      rows.append([int(t) for t in record["prompt_ids"]])
      continue
    if tok is None:
      raise ValueError(
          f"--prompts-file line {i + 1} is text: it needs a tokenizer "
          "(--tokenizer FILE, or DIR/tokenizer.json), or give prompt_ids."
      )
    rows.append(_encode(tok, model.tokenizer_path, record["prompt"], sampling))
  stops = _stops(model, sampling)
  sink = sys.stdout if output is None else open(output, "w", encoding="utf-8")
  start, total, compiled = time.perf_counter(), 0, None
  try:
    for first in range(0, len(rows), batch_size):
      if first == batch_size:  # the first batch compiled the program
        compiled = time.perf_counter() - start
      batch = rows[first : first + batch_size]
      seeds = [sampling.seed + first + j for j in range(len(batch))]
      result = decoding.generate(
          config,
          variables,
          batch,
          seed=seeds,
          **_decoding_args(sampling, stops),
      )
      for j, (new, reason) in enumerate(
          zip(result.tokens, result.finish_reasons, strict=True)
      ):
        record = records[first + j]
        line = {
            "prompt": record.get("prompt"),
            "prompt_ids": batch[j],
            "new_ids": list(new),
            "finish_reason": reason,
        }
        if tok is not None:
          line["text"] = tok.decode(list(new))
        sink.write(json.dumps(line) + "\n")
        total += len(new)
      sink.flush()
  finally:
    if output is not None:
      sink.close()
  seconds = time.perf_counter() - start
  first = " (compile included)"
  if compiled is not None:
    first = f" (the first batch, with the compile, {compiled:.2f} s)"
  return (
      f"{len(rows)} prompts, {total} new tokens in {seconds:.2f} s{first}: "
      f"{total / seconds:.1f} tokens/s"
  )
