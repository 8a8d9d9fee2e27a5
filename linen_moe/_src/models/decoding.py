"""Batched greedy decoding of the reference decoder with a KV cache.

    tokens = greedy_generate(config, variables, prompt, num_tokens)

`prefill` runs the prompt [B, P] through `Decoder(config, decode=True)`,
filling every layer's KV cache, and returns the first greedy token; each
`decode_step` feeds one token per row [B, 1] and returns the next. Both are
jitted (one program each, for a given batch, prompt length and cache size)
and work on every path, float or serving (`linen_moe.serving`) configs
alike. The rows of a batch share their positions (prompts of one length).

Greedy decoding with the cache produces the tokens that running the full
forward on the growing sequence produces (tested) on the dropless paths. On
the dense path with token dropping it need not: the capacity of an expert
depends on the length of the sequence it is computed over.
"""

from __future__ import annotations

from collections.abc import Mapping
import functools

import jax
import jax.numpy as jnp

from linen_moe._src import sharding
from linen_moe._src.model_config import ModelConfig
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.tokens import validate_tokens_if_concrete
from linen_moe._src.variables import CACHE

PyTree = dict


def init_cache(config: ModelConfig, batch: int, max_len: int) -> PyTree:
  """An empty `cache` collection for `batch` rows of up to `max_len` tokens.

  Zeros; the shapes come from `jax.eval_shape`, so no parameter is
  initialised.

  Args:
    config: the decoder's config.
    batch: B, >= 1.
    max_len: the cache length, >= 1 (prompt plus generated tokens).

  Returns:
    The `cache` collection, every attention's `cached_key` and
    `cached_value` [B, max_len, K, D] (with a leading stack axis when
    scanned) and the decoder's `index` <int32>[].

  Raises:
    ValueError: if `batch` or `max_len` is < 1.
  """
  if batch < 1 or max_len < 1:
    raise ValueError(
        f"batch={batch} and max_len={max_len} must both be positive."
    )
  sample = jax.ShapeDtypeStruct((batch, max_len), jnp.int32)
  shapes = jax.eval_shape(
      lambda t: Decoder(config, decode=True).init(jax.random.key(0), t),
      sample,
  )[CACHE]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _extend(config: ModelConfig, variables, cache, tokens):
  """Appends tokens [B, S] to the cache: (greedy next token [B], logits of the
  last position [B, V], new cache)."""
  (logits, _), mutated = Decoder(config, decode=True).apply(
      {**variables, CACHE: cache}, tokens, mutable=[CACHE]
  )
  last = logits[:, -1]
  return jnp.argmax(last, axis=-1).astype(jnp.int32), last, mutated[CACHE]


def check_room(cache: PyTree, new_tokens: int) -> None:
  """Raises when a concrete `cache` has no room for `new_tokens` more.

  A traced cache is not checked (inside jit a write past the end is
  clamped, the documented contract).

  Args:
    cache: a `cache` collection (`init_cache`, or one a step returned).
    new_tokens: how many tokens the next call appends.

  Raises:
    ValueError: if the tokens held plus `new_tokens` exceed the cache length.
  """
  index = cache.get("index") if isinstance(cache, Mapping) else None
  if index is None or isinstance(index, jax.core.Tracer):
    return
  lengths = {
      leaf.shape[-3]
      for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
      if getattr(path[-1], "key", None) == "cached_key"
  }
  if not lengths:
    return
  held, max_len = int(index), min(lengths)
  if held + new_tokens > max_len:
    raise ValueError(
        f"The cache holds {held} of its max_len={max_len} tokens: "
        f"{new_tokens} more do not fit (make it with init_cache(..., "
        f"max_len >= {held + new_tokens}))."
    )


def prefill(config: ModelConfig, variables: Mapping, cache, prompt):
  """Runs the prompt into an empty cache; the cache passed in is donated.

  Args:
    config: the decoder's config.
    variables: the decoder's variables, without `cache`.
    cache: an empty cache (`init_cache`) with room for P tokens and those
      to come.
    prompt: <int32>[B, P].

  Returns:
    (next token <int32>[B], its logits <float32>[B, V], the new cache).

  Raises:
    ValueError: if a concrete cache has no room for the P tokens (traced,
      a write past `max_len` is clamped).
  """
  check_room(cache, prompt.shape[1])
  return _extend(config, variables, cache, prompt)


def decode_step(config: ModelConfig, variables: Mapping, cache, token):
  """Feeds one token per row; the cache passed in is donated.

  Args:
    config: the decoder's config.
    variables: the decoder's variables, without `cache`.
    cache: the cache from `prefill` or the last `decode_step`, with a free
      slot.
    token: <int32>[B], one token per row.

  Returns:
    (next token <int32>[B], its logits <float32>[B, V], the new cache).

  Raises:
    ValueError: if a concrete cache is full (traced, a write past
      `max_len` is clamped).
  """
  check_room(cache, 1)
  return _extend(config, variables, cache, token[:, None])


def greedy_generate(
    config: ModelConfig,
    variables: Mapping,
    prompt: jax.Array,
    num_tokens: int,
    max_len: int | None = None,
) -> jax.Array:
  """The prompt [B, P] followed by `num_tokens` greedy tokens: [B, P + n].

  Args:
    config: the decoder's config (a serving config for converted variables).
    variables: the decoder's variables (params, and the fp8 state of a
      training-mode fp8 config); no `cache`.
    prompt: <int>[B, P], P >= 1.
    num_tokens: tokens to generate, >= 1.
    max_len: cache length, at least P + num_tokens (the default).

  Returns:
    [B, P + num_tokens], the prompt then the generated tokens.

  Raises:
    TypeError: the prompt's ids are not integers.
    ValueError: a prompt that is not [B, P >= 1], an id of a concrete
      prompt outside [0, vocab_size) (named), or `num_tokens` / `max_len`
      out of range, or `variables` holding a cache.
  """
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(
        f"prompt must be [batch, length >= 1]; got {prompt.shape}."
    )
  validate_tokens_if_concrete(prompt, config.vocab_size, name="prompt")
  if num_tokens < 1:
    raise ValueError(f"num_tokens={num_tokens} must be >= 1.")
  b, p = prompt.shape
  needed = p + num_tokens
  max_len = needed if max_len is None else max_len
  if max_len < needed:
    raise ValueError(
        f"max_len={max_len} cannot hold the prompt ({p}) and {num_tokens} new "
        "tokens."
    )
  variables = sharding.unbox(dict(variables))
  if CACHE in variables:
    raise ValueError("variables must not hold a cache; it is made here.")
  cache = init_cache(config, b, max_len)
  token, _, cache = prefill(config, variables, cache, prompt.astype(jnp.int32))
  out = [token]
  for _ in range(num_tokens - 1):
    token, _, cache = decode_step(config, variables, cache, token)
    out.append(token)
  return jnp.concatenate([prompt, jnp.stack(out, axis=1)], axis=1)
