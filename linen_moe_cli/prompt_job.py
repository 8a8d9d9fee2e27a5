"""`linen-moe generate --hf-dir DIR | --checkpoint-dir DIR`: a model's greedy
continuation of a prompt, with the KV cache, from float or quantized serving
weights.

The model comes from a Hugging Face checkpoint (`linen_moe.hf`; int8 / fp8
serving weights are quantized as the tensors are read) or from a training
checkpoint of `linen-moe train` (`checkpoint.read_variables`; converted with
`quantization.quantize_weights`). Float weights run through the contractions of
`quantization` (none by default; a training checkpoint's own mode, with its
fp8 state, or none). A text prompt is tokenized with a `tokenizer.json` (the
`tokenizers` package) and the continuation decoded with it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from linen_moe import decoding
from linen_moe import hf
from linen_moe.quantization import quantize_weights
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


def load_model(hf_dir, checkpoint_dir, serve: str, quantization: str | None):
  """(config, variables) of the Hugging Face checkpoint `hf_dir`, else of
  the training checkpoint `checkpoint_dir`: serving weights of `serve`, or
  ("none") float weights computed in `quantization` (None: "none")."""
  serving_weights = serve != "none"
  mode = serve if serving_weights else quantization or "none"
  if hf_dir is not None:
    return hf.load_checkpoint(
        hf_dir, quantization=mode, serving=serving_weights
    )
  from linen_moe import checkpoint  # noqa: PLC0415 (loads orbax)

  config, variables, _ = checkpoint.read_variables(checkpoint_dir)
  if serving_weights:
    return quantize_weights(config.replace(quantization=mode), variables)
  if mode == "none":
    return config.replace(quantization="none"), {"params": variables["params"]}
  if mode != config.moe.quantization:
    raise ValueError(
        f"--quantization {mode}: {checkpoint_dir} trained in"
        f" {config.moe.quantization!r}; its float weights decode in that mode"
        f" or in none (or serve them converted: --serve {mode})."
    )
  return config, variables


def generate(
    *,
    hf_dir: str | None,
    checkpoint_dir: str | None,
    prompt_ids: list[int] | None,
    prompt: str | None,
    tokenizer: str | None,
    new_tokens: int,
    serve: str = "none",
    quantization: str | None = None,
) -> Continuation:
  """The greedy continuation (see the module docstring) from serving weights
  of `serve` ("none": float weights, computed in `quantization`); a prompt
  id outside the model's vocabulary is a ValueError before any decoding."""
  tok = None
  if tokenizer is not None:
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_file(tokenizer)
  if prompt is not None:
    prompt_ids = tok.encode(prompt).ids
    if not prompt_ids:
      raise ValueError(f"--prompt {prompt!r} encodes to no tokens.")
  config, variables = load_model(hf_dir, checkpoint_dir, serve, quantization)
  ids = validate_tokens(
      np.asarray([prompt_ids], np.int32), config.vocab_size, name="prompt"
  )
  tokens = decoding.greedy_generate(
      config, variables, jnp.asarray(ids), new_tokens
  )
  new = np.asarray(tokens)[0, len(prompt_ids) :]
  text = None if tok is None else tok.decode(new.tolist())
  weights = "float" if serve == "none" else serve
  if serve == "none" and quantization not in (None, "none"):
    weights += f" (in {quantization}'s contractions)"
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
