"""Decoding of the NNX decoder with its KV cache.

    tokens = greedy_generate(model, prompt, num_tokens)
    result = generate(model, prompts, max_new_tokens=n, temperature=0.8)

`generate` (prompts of any lengths, sampling, stop ids) and
`greedy_generate` hand the model's variables to the Linen decoder's
(`linen_moe.decoding.generate`, `greedy_generate`: one program, the
layers unrolled, no copy of a scanned stack's weights): the same blocks,
the same math.
`decoding_model` builds a decoding twin (`Decoder(config, decode=True)`,
built abstractly, with a zero cache of [B, max_len]) for stepping an NNX
model token by token.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp

from linen_moe import decoding
from linen_moe.frontend import validate_tokens_if_concrete
from linen_moe.variables import CACHE
from nnx_adapter._decoder import Decoder
from nnx_adapter._decoder import linen_to_nnx
from nnx_adapter._decoder import nnx_to_linen


def decoding_model(model: Decoder, batch: int, max_len: int) -> Decoder:
  """A decoding twin of `model`, with an empty cache.

  Args:
    model: an NNX `Decoder`, not itself decoding.
    batch: B, >= 1.
    max_len: the cache length, >= 1.

  Returns:
    A `Decoder(config, decode=True)` holding `model`'s variables and a zero
    cache for B rows of up to `max_len` tokens.

  Raises:
    ValueError: if `batch` or `max_len` is < 1.
  """
  if batch < 1 or max_len < 1:
    raise ValueError(
        f"batch={batch} and max_len={max_len} must both be positive."
    )
  config = model.config
  twin = nnx.eval_shape(
      lambda: Decoder(
          config,
          rngs=nnx.Rngs(0),
          sample_shape=(batch, max_len),
          decode=True,
      )
  )
  variables = nnx_to_linen(model)
  cache = nnx_to_linen(twin).get(CACHE, {})
  variables[CACHE] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
  return linen_to_nnx(variables, twin)


def greedy_generate(
    model: Decoder,
    prompt: jax.Array,
    num_tokens: int,
    max_len: int | None = None,
) -> jax.Array:
  """The prompt [B, P] followed by `num_tokens` greedy tokens: [B, P + n].

  Args:
    model: an NNX `Decoder` (float or serving), not itself decoding.
    prompt: <int>[B, P], P >= 1.
    num_tokens: tokens to generate, >= 1.
    max_len: cache length, at least P + num_tokens (the default).

  Returns:
    [B, P + num_tokens], the prompt then the generated tokens.

  Raises:
    TypeError: the prompt's ids are not integers.
    ValueError: a prompt that is not [B, P >= 1], an id of a concrete prompt
      outside [0, vocab_size) (named), `num_tokens` < 1, a decoding `model`,
      or a `max_len` too short.
  """
  if jnp.ndim(prompt) != 2 or jnp.shape(prompt)[1] < 1:
    raise ValueError(
        f"prompt must be [batch, length >= 1]; got {jnp.shape(prompt)}."
    )
  validate_tokens_if_concrete(prompt, model.config.vocab_size, name="prompt")
  prompt = jnp.asarray(prompt)
  if num_tokens < 1:
    raise ValueError(f"num_tokens={num_tokens} must be >= 1.")
  if getattr(model, "decode", False):
    raise ValueError("model must be a plain Decoder, not a decoding one.")
  p = prompt.shape[1]
  max_len = p + num_tokens if max_len is None else max_len
  if max_len < p + num_tokens:
    raise ValueError(
        f"max_len={max_len} cannot hold the prompt ({p}) and {num_tokens} "
        "new tokens."
    )
  variables = nnx_to_linen(model)
  variables.pop(CACHE, None)
  return decoding.greedy_generate(
      model.config, variables, prompt, num_tokens, max_len
  )


def generate(
    model: Decoder,
    prompts,
    *,
    max_new_tokens: int,
    sampling: decoding.Sampling | None = None,
    stop_ids=(),
    seed=0,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> decoding.GenerationResult:
  """New tokens for prompts of any lengths, greedy or sampled.

  The NNX face of `linen_moe.decoding.generate`: the model's variables run
  through the same program (left-padded rows, one `lax.while_loop`, stop
  ids, the same keys), so the tokens are the Linen decoder's.

  Args:
    model: an NNX `Decoder` (float or serving), not itself decoding.
    prompts: a non-empty sequence of non-empty token-id sequences.
    max_new_tokens: the most new tokens per prompt, >= 1.
    sampling: a `linen_moe.decoding.Sampling`, or None (greedy).
    stop_ids: token ids that end a row (included in its tokens).
    seed: an int, or one int per prompt.
    temperature: deprecated: `sampling=Sampling(temperature=...)`.
    top_k: deprecated, as `temperature`.
    top_p: deprecated, as `temperature`.
    min_p: deprecated, as `temperature`.

  Returns:
    A `linen_moe.decoding.GenerationResult`.

  Raises:
    TypeError: as `linen_moe.decoding.generate`.
    ValueError: as `linen_moe.decoding.generate`, and for a decoding
      `model`.
  """
  if getattr(model, "decode", False):
    raise ValueError("model must be a plain Decoder, not a decoding one.")
  variables = nnx_to_linen(model)
  variables.pop(CACHE, None)
  return decoding.generate(
      model.config,
      variables,
      prompts,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      stop_ids=stop_ids,
      seed=seed,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      min_p=min_p,
  )
