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
from collections.abc import Mapping
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
  # The cache is the attention's alone: the MoE layers are traced on their
  # dense path, the same cache in half the tracing time (the sparse path's
  # sort and custom gradients; DeepSeek-V3's 61 layers 6.1 s -> 3.6 s).
  shape_config = unrolled_config(config)
  if shape_config.moe.sparse_matmul:
    shape_config = shape_config.replace(sparse_matmul=False)
  shapes = jax.eval_shape(
      lambda t: Decoder(shape_config, decode=True).init(jax.random.key(0), t),
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


def apply_cached(config: ModelConfig, variables, cache, tokens):
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
def extend(config: ModelConfig, variables, cache, tokens):
  """Appends tokens [B, S] to the cache: (greedy next token [B], logits of
  the last position [B, V], new cache). The decoder runs unrolled; a cache
  in the scanned layout (`Decoder(config, decode=True).init`'s) is split
  per layer and stacked back."""
  plan = config.stack_plan
  variables = layer_stack.to_unrolled(variables, plan)  # no-op if unrolled
  stacked = _stacked_cache(cache)
  if stacked:
    cache = layer_stack.to_unrolled(cache, plan)
  token, last, cache = apply_cached(
      unrolled_config(config), variables, cache, tokens
  )
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
  token, _, cache = apply_cached(
      config, variables, init_cache(config, b, max_len), prompt
  )
  out = jnp.zeros((b, num_tokens), jnp.int32).at[:, 0].set(token)

  def step(i, carry):
    out, cache = carry
    previous = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)  # [B, 1]
    token, _, cache = apply_cached(config, variables, cache, previous)
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
  return extend(config, variables, cache, prompt)


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
  return extend(config, variables, cache, token[:, None])


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
