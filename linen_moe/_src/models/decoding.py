"""Batched greedy decoding of the reference decoder with a KV cache.

    tokens = greedy_generate(config, variables, prompt, num_tokens)

`prefill` runs the prompt [B, P] through `Decoder(config, decode=True)`,
filling every layer's KV cache, and returns the first greedy token; each
`decode_step` feeds one token per row [B, 1] and returns the next. Both are
jitted (one program each, for a given batch, prompt length and cache size)
and work on every path, float or serving (`linen_moe.quantization`) configs
alike. The rows of a batch share their positions (prompts of one length).
`greedy_generate` is one program: the prefill and a loop of decode steps
(`jax.lax.fori_loop`), with no dispatch per token.

Decoding runs the layers unrolled, whether or not the config scans them: a
scanned stack would slice every layer's weights out of the stack at every
step, a copy of all the weights per token (on a CPU three quarters of a
scanned decode step). On one CPU device the stacked variables are handed
to the unrolled decoder as per-layer views without a copy
(`host_unrolled`); traced or elsewhere, they are sliced inside the program
(once per `greedy_generate` call). The cache (`init_cache`) is laid out
per layer too; a cache in the scanned layout is accepted and returned as
it came.

Greedy decoding with the cache produces the tokens that running the full
forward on the growing sequence produces (tested) on the dropless paths. On
the dense path with token dropping it need not: the capacity of an expert
depends on the length of the sequence it is computed over.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from collections.abc import Mapping
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.config import stack_plan
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.variables import CACHE
from linen_moe._src.models import layer_stack
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.models.kv_cache import POSITION
from linen_moe._src.models.sampling import sample_tokens
from linen_moe._src.models.tokens import validate_tokens_if_concrete
from linen_moe._src.parallel import sharding

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
    The `cache` collection, laid out per layer (`layers_{i}/...`) whether
    or not `config` scans its layers, as decoding runs them
    (`unrolled_config`): every attention's `cached_key` and `cached_value`
    [B, K, C, D] (MLA: `cached_latent` [B, C, R], `cached_rope_key`
    [B, 1, C, Dr]) and
    `cached_position` <int32>[B, C], C = max_len, or min(W, max_len) for
    a sliding-window layer (a ring buffer, `kv_cache.py`); the decoder's
    `index` <int32>[] and `pad` <int32>[B]. `cache_bytes_per_token`
    reads these shapes.

  Raises:
    ValueError: if `batch` or `max_len` is < 1.
  """
  if batch < 1 or max_len < 1:
    raise ValueError(
        f"batch={batch} and max_len={max_len} must both be positive."
    )
  sample = jax.ShapeDtypeStruct((batch, max_len), jnp.int32)
  shapes = jax.eval_shape(
      lambda t: Decoder(unrolled_config(config), decode=True).init(
          jax.random.key(0), t
      ),
      sample,
  )[CACHE]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def unrolled_config(config: ModelConfig) -> ModelConfig:
  """The config decoding runs: `config` with its layers unrolled.

  A scanned stack slices every layer's weights out of the stack on each
  step (a copy of the weights per token); unrolled, each layer reads its
  own. The variables and the cache are the same, laid out per layer
  (`layer_stack.to_unrolled`).
  """
  return config.replace(scan_layers=False) if config.scan_layers else config


def _apply(config: ModelConfig, variables, cache, tokens):
  """Appends tokens [B, S] to an unrolled cache through the unrolled
  decoder: (greedy next token [B], logits of the last position [B, V], new
  cache). `config` is already unrolled."""
  decoder = Decoder(config, decode=True, last_logits_only=True)
  (logits, _), mutated = decoder.apply(
      {**variables, CACHE: cache}, tokens, mutable=[CACHE]
  )
  last = logits[:, -1]
  return jnp.argmax(last, axis=-1).astype(jnp.int32), last, mutated[CACHE]


def _cpu_device(leaves) -> jax.Device | None:
  """The one CPU device every leaf lives on (concrete arrays), else None."""
  devices = set()
  for leaf in leaves:
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
      return None
    devices |= leaf.devices()
  if len(devices) != 1:
    return None
  (device,) = devices
  return device if device.platform == "cpu" else None


def host_unrolled(config: ModelConfig, variables: Mapping) -> Mapping | None:
  """`variables` of a scanned `config` laid out per layer, without a copy.

  On one CPU device each layer's leaves are views into the stacked buffers:
  NumPy slices handed back to jax, which XLA:CPU shares without copying
  where they are aligned (slicing in a program copies them, at a few GB/s).

  Args:
    config: the decoder's config.
    variables: its variables, in `config`'s layout.

  Returns:
    The variables with every layer under `layers_{i}/`; `variables` itself
    when `config` does not scan; None when they are traced or not all on
    one CPU device (slice them in the program, `layer_stack.to_unrolled`).
  """
  plan = config.stack_plan
  if not plan.scanned:
    return variables
  device = _cpu_device(jax.tree.leaves(variables))
  if device is None:
    return None
  host = jax.tree.map(np.asarray, dict(variables))
  return jax.device_put(layer_stack.to_unrolled(host, plan), device)


def _stacked_cache(cache) -> bool:
  return isinstance(cache, Mapping) and stack_plan.STACK in cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _extend(config: ModelConfig, variables, cache, tokens):
  """Appends tokens [B, S] to the cache: (greedy next token [B], logits of
  the last position [B, V], new cache). The decoder runs unrolled; a cache
  in the scanned layout (`Decoder(config, decode=True).init`'s) is split
  per layer and stacked back."""
  plan = config.stack_plan
  variables = layer_stack.to_unrolled(variables, plan)  # no-op if unrolled
  stacked = _stacked_cache(cache)
  if stacked:
    cache = layer_stack.to_unrolled(cache, plan)
  token, last, cache = _apply(unrolled_config(config), variables, cache, tokens)
  if stacked:
    cache = layer_stack.to_scanned(cache, plan)
  return token, last, cache


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _generate(config: ModelConfig, variables, prompt, num_tokens, max_len):
  """`greedy_generate` as one program: the prefill, then a loop of
  `num_tokens - 1` decode steps (no dispatch per token), the layers
  unrolled (`variables` per layer already, or stacked and sliced here,
  once). Returns the generated tokens <int32>[B, num_tokens]."""
  variables = layer_stack.to_unrolled(variables, config.stack_plan)
  config = unrolled_config(config)
  b = prompt.shape[0]
  token, _, cache = _apply(
      config, variables, init_cache(config, b, max_len), prompt
  )
  out = jnp.zeros((b, num_tokens), jnp.int32).at[:, 0].set(token)

  def step(i, carry):
    out, cache = carry
    previous = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)  # [B, 1]
    token, _, cache = _apply(config, variables, cache, previous)
    return jax.lax.dynamic_update_slice_in_dim(out, token[:, None], i, 1), cache

  out, _ = jax.lax.fori_loop(1, num_tokens, step, (out, cache))
  return out


def cache_capacity(config: ModelConfig, max_len: int) -> int | None:
  """Tokens a cache made by `init_cache(config, B, max_len)` holds.

  Args:
    config: the decoder's config.
    max_len: the longest layer's cache length.

  Returns:
    `max_len`, or None (no bound) when every attention layer slides a
    window W <= max_len: each layer's ring buffer then holds its window
    whatever the length of the sequence.
  """
  w = config.sliding_window
  if w > 0 and not config.full_attention_layers and w <= max_len:
    return None
  return max_len


def check_room(
    cache: PyTree, new_tokens: int, config: ModelConfig | None = None
) -> None:
  """Raises when a concrete `cache` has no room for `new_tokens` more.

  A traced cache is not checked (inside jit a full layer's write past the
  end is dropped, the documented contract).

  Args:
    cache: a `cache` collection (`init_cache`, or one a step returned).
    new_tokens: how many tokens the next call appends.
    config: the decoder's config: a cache whose every layer is a sliding
      window's ring buffer never fills (`cache_capacity`); without it, the
      longest layer's length bounds the tokens.

  Raises:
    ValueError: if the tokens held plus `new_tokens` exceed the cache length.
  """
  index = cache.get("index") if isinstance(cache, Mapping) else None
  if index is None or isinstance(index, jax.core.Tracer):
    return
  lengths = {
      leaf.shape[-1]
      for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
      if getattr(path[-1], "key", None) == f"cached_{POSITION}"
  }
  if not lengths:
    return
  held, max_len = int(index), max(lengths)
  room = max_len if config is None else cache_capacity(config, max_len)
  if room is not None and held + new_tokens > room:
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
  check_room(cache, prompt.shape[1], config)
  variables = host_unrolled(config, variables) or variables
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
  check_room(cache, 1, config)
  variables = host_unrolled(config, variables) or variables
  return _extend(config, variables, cache, token[:, None])


def greedy_generate(
    config: ModelConfig,
    variables: Mapping,
    prompt: jax.Array,
    num_tokens: int,
    max_len: int | None = None,
) -> jax.Array:
  """The prompt [B, P] followed by `num_tokens` greedy tokens: [B, P + n].

  One compiled program per (config, batch, prompt length, `num_tokens`,
  `max_len`): the prefill, then every decode step in a loop inside it
  (`generate_program`), the layers unrolled whether or not `config`
  scans them.

  Args:
    config: the decoder's config (a serving config for converted variables).
    variables: the decoder's variables (params, and the fp8 state of a
      training-mode fp8 config); no `cache`.
    prompt: <int>[B, P], P >= 1.
    num_tokens: tokens to generate, >= 1.
    max_len: cache length, at least P + num_tokens (the default).

  Returns:
    [B, P + num_tokens], the prompt then the generated tokens, <int32>.

  Raises:
    TypeError: the prompt's ids are not integers.
    ValueError: a prompt that is not [B, P >= 1], an id of a concrete
      prompt outside [0, vocab_size) (named), or `num_tokens` / `max_len`
      out of range, or `variables` holding a cache.
  """
  program, args = generate_program(
      config, variables, prompt, num_tokens, max_len
  )
  return jnp.concatenate([args[2], program(*args)], axis=1)


def generate_program(
    config: ModelConfig,
    variables: Mapping,
    prompt: jax.Array,
    num_tokens: int,
    max_len: int | None = None,
):
  """The jitted program `greedy_generate` runs, and its arguments.

  `program(*args)` returns the generated tokens <int32>[B, num_tokens];
  `program.lower(*args)` traces it (the config and the two lengths are
  static), for timing its compile.

  Args:
    config: as for `greedy_generate`, and so are `variables`, `prompt`,
      `num_tokens` and `max_len`.
    variables: see `config`.
    prompt: see `config`.
    num_tokens: see `config`.
    max_len: see `config`.

  Returns:
    (program, args), args holding the variables laid out per layer.

  Raises:
    TypeError: as `greedy_generate`.
    ValueError: as `greedy_generate`.
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
  prompt = prompt.astype(jnp.int32)
  variables = host_unrolled(config, variables) or variables
  return _generate, (config, variables, prompt, num_tokens, max_len)


def cache_bytes_per_token(
    config: ModelConfig, max_len: int
) -> dict[str, dict[str, int]]:
  """Each attention layer's cache, from `init_cache`'s shapes.

  Args:
    config: the decoder's config.
    max_len: the cache length `init_cache` is given.

  Returns:
    A dict per layer, by its name in the cache (`layers_{i}`), of its
    "slots" C (max_len, or the window of a sliding layer's ring buffer) and
    its "bytes_per_token" n, the bytes one token keeps in it (its keys and
    values, or MLA's latent and rotary key, and its stored position).
    A layer's cache is C * n bytes per row.
  """
  shapes = jax.eval_shape(lambda: init_cache(config, 1, max_len))
  cached = collections.defaultdict(list)  # layer -> [(name, leaf)]
  for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
    keys = [getattr(k, "key", str(k)) for k in path]
    if len(keys) >= 2 and keys[-1].startswith("cached_"):
      cached[keys[0]].append((keys[-1], leaf))
  out = {}
  for layer, leaves in cached.items():
    # The slots are the positions' [1, C]; the keys and values are stored
    # heads-major ([1, K, C, D]), so each leaf's bytes per slot is its size
    # over C.
    slots = dict(leaves)[f"cached_{POSITION}"].shape[1]
    per = sum(leaf.size * leaf.dtype.itemsize for _, leaf in leaves)
    out[layer] = {"slots": slots, "bytes_per_token": per // slots}
  return out


# --- Generation: sampling, prompts of any lengths, stop ids. ---

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
  config = unrolled_config(config)
  b, p = prompt.shape
  width = cache_len - p
  cache = init_cache(config, b, cache_len)
  cache["pad"] = pad

  def choose(logits, i):
    step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
    return sample_tokens(logits, step_keys, temperature, top_k, top_p, min_p)

  def stops(token):
    return jnp.any(token[:, None] == stop_ids[None, :], axis=-1)

  _, logits, cache = _apply(config, variables, cache, prompt)
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
    _, logits, cache = _apply(config, variables, cache, token[:, None])
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


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int; got {value!r}.")
  if value < minimum:
    raise ValueError(f"{name}={value} must be >= {minimum}.")
  return int(value)


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


def _checked(
    config, prompts, max_new_tokens, temperature, top_k, top_p, min_p, stop_ids
):
  """`generate`'s arguments checked: (prompts as lists of ints,
  max_new_tokens, (temperature, top_k, top_p, min_p), stop ids)."""
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
  top_k = _check_int("top_k", top_k, 0)
  temperature, top_p, min_p = float(temperature), float(top_p), float(min_p)
  if not (np.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"temperature={temperature} must be finite and >= 0.")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p} must be in (0, 1].")
  if not 0 <= min_p <= 1:
    raise ValueError(f"min_p={min_p} must be in [0, 1].")
  stops = _check_ids("stop_ids", list(stop_ids), config.vocab_size)
  return rows, max_new_tokens, (temperature, top_k, top_p, min_p), stops


def generate(
    config: ModelConfig,
    variables: Mapping,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    stop_ids=(),
    seed=0,
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
    temperature: >= 0; 0 is greedy (equal to `greedy_generate`).
    top_k: keep the k most likely tokens, >= 0 (0: all).
    top_p: nucleus mass in (0, 1] (1: all).
    min_p: in [0, 1]: keep tokens of at least min_p times the largest
      probability (0: all).
    stop_ids: token ids that end a row (included in its tokens).
    seed: an int, or a sequence of ints, one per prompt (see above).

  Returns:
    A `GenerationResult`, each prompt's new tokens (up to and including its
    first stop id) and finish reason ("stop" or "length").

  Raises:
    TypeError: a prompt, stop id, seed or count that is not integers.
    ValueError: before any work, naming the argument: no prompts, an empty
      prompt, an id outside [0, vocab_size), `max_new_tokens` < 1, a
      negative or non-finite temperature, `top_k` < 0, `top_p` outside
      (0, 1], `min_p` outside [0, 1], or `variables` holding a cache.
  """
  rows, max_new_tokens, sampling, stops = _checked(
      config,
      prompts,
      max_new_tokens,
      temperature,
      top_k,
      top_p,
      min_p,
      stop_ids,
  )
  temperature, top_k, top_p, min_p = sampling
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
  variables = host_unrolled(config, variables) or variables
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
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    stop_ids=(),
    seed=0,
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
      the sampling settings and `stop_ids`.
    variables: see `config`.
    prompt: a non-empty sequence of token ids.
    max_new_tokens: see `config`.
    temperature: see `config`.
    top_k: see `config`.
    top_p: see `config`.
    min_p: see `config`.
    stop_ids: see `config`.
    seed: an int, or a one-element sequence of ints.

  Yields:
    The new token ids, as ints.

  Raises:
    TypeError: as `generate`.
    ValueError: as `generate` (raised at the call, before any work).
  """
  rows, max_new_tokens, sampling, stops = _checked(
      config,
      [prompt],
      max_new_tokens,
      temperature,
      top_k,
      top_p,
      min_p,
      stop_ids,
  )
  key = _row_keys(seed, 1)
  variables = sharding.unbox(dict(variables))
  if CACHE in variables:
    raise ValueError("variables must not hold a cache; it is made here.")
  return _stream(
      config, variables, rows[0], max_new_tokens, sampling, set(stops), key
  )


def _stream(config, variables, ids, max_new_tokens, sampling, stops, key):
  temperature, top_k, top_p, min_p = sampling
  settings = (
      jnp.float32(temperature),
      jnp.int32(top_k),
      jnp.float32(top_p),
      jnp.float32(min_p),
  )
  variables = host_unrolled(config, variables) or variables
  cache = init_cache(config, 1, len(ids) + max_new_tokens)
  prompt = jnp.asarray([ids], jnp.int32)
  _, logits, cache = _extend(config, variables, cache, prompt)
  for t in range(max_new_tokens):
    step_key = jax.vmap(jax.random.fold_in, (0, None))(key, t)
    token = _sample_jit(logits, step_key, *settings)
    value = int(token[0])
    yield value
    if value in stops or t + 1 == max_new_tokens:
      return
    _, logits, cache = _extend(config, variables, cache, token[:, None])
