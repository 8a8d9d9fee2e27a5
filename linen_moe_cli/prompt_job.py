"""`linen-moe generate --hf-dir DIR | --checkpoint-dir DIR`: a model's greedy
continuation of a prompt, with the KV cache, from float or quantized serving
weights.

The model comes from a Hugging Face checkpoint (`linen_moe.hf`; int8 / fp8
serving weights are quantized as the tensors are read) or from a training
checkpoint of `linen-moe train` (`checkpoint.read_variables`; converted with
`quantization.quantize_weights`). A text prompt is tokenized with a
`tokenizer.json` (the `tokenizers` package) and the continuation decoded
with it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from linen_moe import decoding
from linen_moe import hf
from linen_moe.tokens import validate_tokens


@dataclasses.dataclass(frozen=True)
class Continuation:
  """A prompt and its greedy continuation.

  Attributes:
    prompt_ids: <int32>[P], the prompt's token ids.
    new_ids: <int32>[N], the generated ones.
    text: the continuation decoded with the tokenizer (None without one).
    weights: "float" or the serving mode.
  """

  prompt_ids: np.ndarray
  new_ids: np.ndarray
  text: str | None
  weights: str


def _model(hf_dir, checkpoint_dir, quantization):
  """(config, variables) in float, or as serving weights of
  `quantization`."""
  serve = quantization != "none"
  if hf_dir is not None:
    return hf.load_checkpoint(hf_dir, quantization=quantization, serving=serve)
  from linen_moe import checkpoint  # noqa: PLC0415 (loads orbax)

  config, variables, _ = checkpoint.read_variables(checkpoint_dir)
  if not serve:
    return config.replace(quantization="none"), {"params": variables["params"]}
  return quantization.quantize_weights(
      config.replace(quantization=quantization), variables
  )


def generate(
    *,
    hf_dir: str | None,
    checkpoint_dir: str | None,
    prompt_ids: list[int] | None,
    prompt: str | None,
    tokenizer: str | None,
    new_tokens: int,
    quantization: str,
) -> Continuation:
  """The greedy continuation (see the module docstring); a prompt id
  outside the model's vocabulary is a ValueError before any decoding."""
  tok = None
  if tokenizer is not None:
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_file(tokenizer)
  if prompt is not None:
    prompt_ids = tok.encode(prompt).ids
    if not prompt_ids:
      raise ValueError(f"--prompt {prompt!r} encodes to no tokens.")
  config, variables = _model(hf_dir, checkpoint_dir, quantization)
  ids = validate_tokens(
      np.asarray([prompt_ids], np.int32), config.vocab_size, name="prompt"
  )
  tokens = decoding.greedy_generate(
      config, variables, jnp.asarray(ids), new_tokens
  )
  new = np.asarray(tokens)[0, len(prompt_ids) :]
  text = None if tok is None else tok.decode(new.tolist())
  weights = "float" if quantization == "none" else quantization
  return Continuation(np.asarray(prompt_ids), new, text, weights)


def format_report(result: Continuation) -> str:
  lines = [
      f"weights: {result.weights}",
      f"prompt ids: {result.prompt_ids.tolist()}",
      f"new ids: {result.new_ids.tolist()}",
  ]
  if result.text is not None:
    lines.append(f"text: {result.text}")
  return "\n".join(lines)
