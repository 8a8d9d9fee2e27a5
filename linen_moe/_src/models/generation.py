"""Generation with the KV cache: prompts of any lengths, greedy or sampled,
stop ids.

`generate` left-pads the prompts into one batch and runs the prefill and a
`lax.while_loop` of decode steps as one program that ends when every row
drew a stop id; `generate_stream` yields one prompt's tokens as they are
drawn. How a token is drawn (temperature, top-k, top-p, min-p) is one
`Sampling`, checked once, which the command line builds from its flags too
(0.2's loose keywords, `temperature=...`, still work, with a warning).
The cache and its steps are `decoding`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Mapping
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src import deprecation
from linen_moe._src.config.checks import check_int as _check_int
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.sampling import Sampling
from linen_moe._src.config.variables import CACHE
from linen_moe._src.models import decoding
from linen_moe._src.models import layer_stack
from linen_moe._src.models.sampling import sample_tokens
from linen_moe._src.parallel import sharding

# The smallest prompt-length bucket: prompts are left padded to a power of
# two >= this, so that prompts of nearby lengths share a program.
MIN_PROMPT_BUCKET = 32
# The smallest stop-id bucket: up to this many stop ids share a program.
MIN_STOP_BUCKET = 8
# Finish reasons.
STOP, LENGTH = "stop", "length"


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  """What `generate` returns.

  Attributes:
    tokens: per prompt, in the order given, its new token ids, up to and
      including its first stop id.
    finish_reasons: per prompt, "stop" (it drew a stop id) or "length"
      (`max_new_tokens` drawn without one).
  """

  tokens: tuple[tuple[int, ...], ...]
  finish_reasons: tuple[str, ...]


def bucket(n: int, minimum: int = 1) -> int:
  """The power of two >= max(n, minimum): a batch, prompt-length or cache
  bucket of `generate`."""
  n = max(n, minimum)
  return 1 << (n - 1).bit_length()


@functools.partial(jax.jit, static_argnums=(0, 1))
def _generate_rows(
    config: ModelConfig,
    cache_len: int,
    variables,
    prompt,
    pad,
    active,
    stop_ids,
    keys,
    max_new,
    temperature,
    top_k,
    top_p,
    min_p,
):
  """`generate` as one program: a left-padded prompt <int32>[B, P] (row
  b's tokens in its last P - pad[b] columns), then a `lax.while_loop` of
  decode steps until every row has stopped or `max_new` tokens are drawn.
  Returns <int32>[B, cache_len - P] (new tokens, -1 after a row's stop id,
  and in rows not `active`) and <bool>[B] (the row drew a stop id)."""
  variables = layer_stack.to_unrolled(variables, config.stack_plan)
  config = decoding.unrolled_config(config)
  b, p = prompt.shape
  width = cache_len - p
  cache = decoding.init_cache(config, b, cache_len)
  cache["pad"] = pad

  def choose(logits, i):
    step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
    return sample_tokens(logits, step_keys, temperature, top_k, top_p, min_p)

  def stops(token):
    return jnp.any(token[:, None] == stop_ids[None, :], axis=-1)

  _, logits, cache = decoding.apply_cached(config, variables, cache, prompt)
  token = choose(logits, 0)
  out = jnp.full((b, width), -1, jnp.int32)
  out = out.at[:, 0].set(jnp.where(active, token, -1))
  stopped = active & stops(token)
  done = ~active | stopped

  def cond(state):
    i, _, _, done, _, _ = state
    return (i < max_new) & ~jnp.all(done)

  def body(state):
    i, out, token, done, stopped, cache = state
    _, logits, cache = decoding.apply_cached(
        config, variables, cache, token[:, None]
    )
    drawn = choose(logits, i)
    out = jax.lax.dynamic_update_slice_in_dim(
        out, jnp.where(done, -1, drawn)[:, None], i, axis=1
    )
    new_stop = ~done & stops(drawn)
    token = jnp.where(done, token, drawn)  # a stopped row feeds its last
    return i + 1, out, token, done | new_stop, stopped | new_stop, cache

  state = (jnp.int32(1), out, token, done, stopped, cache)
  _, out, _, _, stopped, _ = jax.lax.while_loop(cond, body, state)
  return out, stopped


def _check_ids(name: str, ids, vocab_size: int) -> list[int]:
  """A sequence of token ids as ints in [0, vocab_size)."""
  if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
    raise TypeError(f"{name} must be a sequence of token ids; got {ids!r}.")
  arr = np.asarray(ids)
  if arr.size and (arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer)):
    raise TypeError(
        f"{name} must be a flat sequence of integer token ids; got dtype "
        f"{arr.dtype}, shape {arr.shape}."
    )
  bad = np.flatnonzero((arr < 0) | (arr >= vocab_size)) if arr.size else []
  if len(bad):
    raise ValueError(
        f"{name}[{bad[0]}]={arr[bad[0]]} is outside the vocabulary "
        f"[0, {vocab_size})."
    )
  return [int(t) for t in arr]


def _row_keys(seed, n: int) -> jax.Array:
  """Each prompt's key: fold_in(key(seed), i) for the i-th prompt of an
  int seed; key(seed[i]) folded with 0 for a sequence of seeds."""
  if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
    base = jax.random.key(int(seed))
    return jax.vmap(jax.random.fold_in, (None, 0))(base, jnp.arange(n))
  if isinstance(seed, (str, bytes)) or not hasattr(seed, "__len__"):
    raise TypeError(
        "seed must be an int or a sequence of ints, one per prompt; got "
        f"{seed!r}."
    )
  if len(seed) != n:
    raise ValueError(
        f"seed has {len(seed)} entries for {n} prompts; give one per prompt."
    )
  for i, s in enumerate(seed):
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
      raise TypeError(f"seed[{i}]={s!r} must be an int.")
  return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 0))(
      jnp.asarray([int(s) % 2**32 for s in seed], jnp.uint32)
  )


def sampling_of(sampling, old: Mapping, where: str) -> Sampling:
  """The one `Sampling` of a generation call: `sampling`, or one made of
  0.2's loose keywords (`old`, those not None), with a warning.

  Args:
    sampling: a `Sampling`, or None (greedy).
    old: {"temperature", "top_k", "top_p", "min_p"}: the old keywords.
    where: the function, for the messages (e.g. "decoding.generate").

  Returns:
    The `Sampling`.

  Raises:
    TypeError: `sampling` is not a `Sampling`, or both forms are given.
  """
  given = {k: v for k, v in old.items() if v is not None}
  if given:
    if sampling is not None:
      raise TypeError(
          f"{where}: pass sampling=Sampling(...) alone, without "
          f"{', '.join(sorted(given))}."
      )
    deprecation.warn(
        f"{where}({', '.join(sorted(given))}=...)",
        "pass sampling=linen_moe.decoding.Sampling(...)",
    )
    return Sampling(**given)
  if sampling is None:
    return Sampling()
  if not isinstance(sampling, Sampling):
    raise TypeError(
        f"sampling={sampling!r} is invalid: expected a "
        "linen_moe.decoding.Sampling."
    )
  return sampling


def _checked(config, prompts, max_new_tokens, sampling, stop_ids):
  """`generate`'s arguments checked: (prompts as lists of ints,
  max_new_tokens, the `Sampling`, stop ids)."""
  if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
    raise TypeError(
        f"prompts must be a list of token-id lists; got {prompts!r}."
    )
  if not len(prompts):
    raise ValueError("prompts is empty: give at least one prompt.")
  rows = []
  for i, prompt in enumerate(prompts):
    ids = _check_ids(f"prompts[{i}]", prompt, config.vocab_size)
    if not ids:
      raise ValueError(f"prompts[{i}] is empty: a prompt needs >= 1 token.")
    rows.append(ids)
  max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
  stops = _check_ids("stop_ids", list(stop_ids), config.vocab_size)
  return rows, max_new_tokens, sampling, stops


def generate(
    config: ModelConfig,
    variables: Mapping,
    prompts,
    *,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_ids=(),
    seed=0,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> GenerationResult:
  """New tokens for prompts of any lengths, greedy or sampled.

  The prompts are left padded into one batch: each row keeps its own
  positions (0 at its first token) and its padding is never attended to,
  so every row's tokens are those it gets decoded alone. One program runs
  the prefill and a `lax.while_loop` of decode steps that ends when every
  row has drawn a stop id or `max_new_tokens` are drawn; a row that drew a
  stop id is padded from then on, never extended. One compiled program per
  (config, batch bucket, prompt-length bucket, cache size): the batch is
  padded to a power of two rows, the prompts to a power of two >=
  `MIN_PROMPT_BUCKET` columns (the longest prompt's), the cache to a power
  of two >= that plus `max_new_tokens` (`bucket`); the sampling settings,
  stop ids (up to a power of two >= `MIN_STOP_BUCKET` of them) and `max_new_tokens` within the
  cache are arguments, not constants.

  Sampling (temperature > 0): the logits in float32 are scaled by
  1 / temperature, filtered by top-k, top-p and min-p (`filter_logits`),
  and a token is drawn with the row's own key: with an int `seed`, the
  i-th prompt's key is fold_in(key(seed), i), so a prompt's tokens depend
  on the seed, its index in `prompts` and itself, not on the other
  prompts or the batch's padding; with a sequence of seeds, one per
  prompt, the i-th prompt's key is fold_in(key(seed[i]), 0), so a prompt
  decoded alone with `seed=[s]` draws what it draws in any batch with `s`
  as its seed. Step t of a row draws with fold_in(row key, t).

  Args:
    config: the decoder's config (a serving config for converted variables).
    variables: the decoder's variables; no `cache`.
    prompts: a non-empty sequence of prompts, each a non-empty sequence of
      token ids in [0, vocab_size).
    max_new_tokens: the most new tokens per prompt, >= 1.
    sampling: how a token is drawn (`Sampling`: temperature, top-k,
      top-p, min-p); None: greedy (equal to `greedy_generate`).
    stop_ids: token ids that end a row (included in its tokens).
    seed: an int, or a sequence of ints, one per prompt (see above).
    temperature: deprecated: `sampling=Sampling(temperature=...)`.
    top_k: deprecated, as `temperature`.
    top_p: deprecated, as `temperature`.
    min_p: deprecated, as `temperature`.

  Returns:
    A `GenerationResult`, each prompt's new tokens (up to and including its
    first stop id) and finish reason ("stop" or "length").

  Raises:
    TypeError: a prompt, stop id or seed that is not integers; a
      `sampling` that is not a `Sampling`.
    ValueError: before any work, naming the argument: no prompts, an empty
      prompt, an id outside [0, vocab_size), `max_new_tokens` < 1, or
      `variables` holding a cache (a bad setting is `Sampling`'s error).
  """
  sampling = sampling_of(
      sampling,
      dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
      "decoding.generate",
  )
  rows, max_new_tokens, sampling, stops = _checked(
      config, prompts, max_new_tokens, sampling, stop_ids
  )
  temperature, top_k, top_p, min_p = dataclasses.astuple(sampling)
  keys = _row_keys(seed, len(rows))
  variables = sharding.unbox(dict(variables))
  if CACHE in variables:
    raise ValueError("variables must not hold a cache; it is made here.")

  n = len(rows)
  b = bucket(n)
  p = bucket(max(len(r) for r in rows), MIN_PROMPT_BUCKET)
  cache_len = bucket(p + max_new_tokens)
  prompt = np.zeros((b, p), np.int32)
  pad = np.full((b,), p - 1, np.int32)  # filler rows: one token
  for i, r in enumerate(rows):
    prompt[i, p - len(r) :] = r
    pad[i] = p - len(r)
  active = np.arange(b) < n
  stop_arr = np.full((bucket(len(stops), MIN_STOP_BUCKET),), -1, np.int32)
  stop_arr[: len(stops)] = stops
  keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (b - n,))])
  variables = decoding.host_unrolled(config, variables) or variables
  out, stopped = _generate_rows(
      config,
      cache_len,
      variables,
      prompt,
      pad,
      active,
      stop_arr,
      keys,
      jnp.int32(max_new_tokens),
      jnp.float32(temperature if temperature > 0 else 0.0),
      jnp.int32(top_k),
      jnp.float32(top_p),
      jnp.float32(min_p),
  )
  out, stopped = np.asarray(out), np.asarray(stopped)
  tokens = tuple(tuple(int(t) for t in row if t >= 0) for row in out[:n])
  reasons = tuple(STOP if s else LENGTH for s in stopped[:n])
  return GenerationResult(tokens, reasons)


_sample_jit = jax.jit(sample_tokens)


def generate_stream(
    config: ModelConfig,
    variables: Mapping,
    prompt,
    *,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_ids=(),
    seed=0,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Iterator[int]:
  """One prompt's new tokens, each yielded as soon as it is drawn.

  A Python loop over two compiled programs, the prefill and one decode
  step (`prefill`, `decode_step`, with a cache of exactly the prompt plus
  `max_new_tokens`), and the sampler (`sample_tokens`): a dispatch and a
  token fetched to the host per step, what printing text as it comes needs.
  The draws are `generate`'s for the prompt alone (`seed` an int: the key
  fold_in(key(seed), 0); step t with fold_in(key, t)); it ends after a stop
  id (yielded) or `max_new_tokens`.

  Args:
    config: as for `generate`, and so are `variables`, `max_new_tokens`,
      `sampling` and `stop_ids`.
    variables: see `config`.
    prompt: a non-empty sequence of token ids.
    max_new_tokens: see `config`.
    sampling: see `config`.
    stop_ids: see `config`.
    seed: an int, or a one-element sequence of ints.
    temperature: deprecated: `sampling=Sampling(temperature=...)`.
    top_k: deprecated, as `temperature`.
    top_p: deprecated, as `temperature`.
    min_p: deprecated, as `temperature`.

  Yields:
    The new token ids, as ints.

  Raises:
    TypeError: as `generate`.
    ValueError: as `generate` (raised at the call, before any work).
  """
  sampling = sampling_of(
      sampling,
      dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
      "decoding.generate_stream",
  )
  rows, max_new_tokens, sampling, stops = _checked(
      config, [prompt], max_new_tokens, sampling, stop_ids
  )
  key = _row_keys(seed, 1)
  variables = sharding.unbox(dict(variables))
  if CACHE in variables:
    raise ValueError("variables must not hold a cache; it is made here.")
  return _stream(
      config, variables, rows[0], max_new_tokens, sampling, set(stops), key
  )


def _stream(config, variables, ids, max_new_tokens, sampling, stops, key):
  temperature, top_k, top_p, min_p = dataclasses.astuple(sampling)
  settings = (
      jnp.float32(temperature),
      jnp.int32(top_k),
      jnp.float32(top_p),
      jnp.float32(min_p),
  )
  variables = decoding.host_unrolled(config, variables) or variables
  cache = decoding.init_cache(config, 1, len(ids) + max_new_tokens)
  prompt = jnp.asarray([ids], jnp.int32)
  _, logits, cache = decoding.extend(config, variables, cache, prompt)
  for t in range(max_new_tokens):
    step_key = jax.vmap(jax.random.fold_in, (0, None))(key, t)
    token = _sample_jit(logits, step_key, *settings)
    value = int(token[0])
    yield value
    if value in stops or t + 1 == max_new_tokens:
      return
    _, logits, cache = decoding.extend(config, variables, cache, token[:, None])
