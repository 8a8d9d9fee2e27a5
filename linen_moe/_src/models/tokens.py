"""Token ids in [0, vocab_size): checked before the work, or inside `jit`.

One function per job:

  `validate_tokens(tokens, vocab_size)`  concrete ids (NumPy, or a JAX
      array outside a trace): a `TypeError` (not integer, not [batch, seq],
      traced) or a `ValueError` naming the first bad id, its position and
      the allowed range, before any computation. `linen-moe train` runs it
      on every batch.
  `validate_tokens_if_concrete(tokens, vocab_size)`  what a model's entry
      point runs (`Decoder.__call__`, the NNX decoder,
      `decoding.greedy_generate`): the rank and dtype always, the ids with
      `validate_tokens` when they are concrete; traced ids are left to the
      embedding.
  `valid_token_mask(tokens, vocab_size)`  inside a trace, where nothing can
      raise on a value: the mask of valid ids, with which the decoders'
      embedding (`TokenEmbed`) maps every id outside [0, V) to a row of NaN
      (a plain `nn.Embed` would silently wrap ids in [-V, -1] to V + id), so
      the loss is NaN and the train steps skip the step, counting it. It
      also registers a `checkify` check of the ids.
  `checked(fn)`  the checked mode: `fn` (anything that runs a decoder, a
      train step, jitted or not) under `jax.experimental.checkify`; the
      embedding's check then reports the first bad id as a `ValueError` once
      `fn` has run. Without `checked` that check costs nothing: it is a
      `checkify.check(..., debug=True)`, dropped from uncheckified programs.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

import flax.linen as nn
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np


def validate_tokens(tokens: Any, vocab_size: int, name: str = "tokens"):
  """Returns `tokens` if they are integer ids [batch, seq] in [0, vocab_size).

  Args:
    tokens: <int>[B, S], concrete (NumPy or a JAX array outside a trace).
    vocab_size: V.
    name: what the error messages call `tokens`.

  Returns:
    `tokens`, unchanged.

  Raises:
    TypeError: not an integer array of rank 2, or traced (use `checked`).
    ValueError: an id outside [0, vocab_size); names the first one.
  """
  if isinstance(tokens, jax.core.Tracer):
    raise TypeError(
        f"validate_tokens({name}) needs concrete ids, got a traced value; "
        "inside jit, run the function under linen_moe.tokens.checked."
    )
  _check_rank_and_dtype(tokens, name)
  array = np.asarray(tokens)
  bad = (array < 0) | (array >= vocab_size)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{name}[{where[0]}, {where[1]}]={int(array[where])} is invalid: "
        f"token ids must be in [0, vocab_size={vocab_size}) "
        f"({int(bad.sum())} of {array.size} ids are outside it)."
    )
  return tokens


def _check_rank_and_dtype(tokens: Any, name: str) -> None:
  dtype = getattr(tokens, "dtype", None)
  if dtype is None:
    dtype = np.asarray(tokens).dtype
  shape = tuple(np.shape(tokens))
  if len(shape) != 2 or not np.issubdtype(dtype, np.integer):
    raise TypeError(
        f"{name} must be integer token ids [batch, seq]; got "
        f"{np.dtype(dtype)}{list(shape)}."
    )


def validate_tokens_if_concrete(
    tokens: Any, vocab_size: int, name: str = "tokens"
):
  """Returns `tokens` after the checks a model's entry point can make now.

  The rank and dtype are always checked. Concrete ids are checked with
  `validate_tokens`; traced ids (under `jit`) are not: their values are
  unknown until the program runs, where an id outside [0, vocab_size)
  embeds as NaN (see `valid_token_mask` and `checked`). Ids spread over
  several processes (a global array) are not read either.

  Args:
    tokens: <int>[B, S], concrete or traced.
    vocab_size: V.
    name: what the error messages call `tokens`.

  Returns:
    `tokens`, unchanged.

  Raises:
    TypeError: not an integer array of rank 2.
    ValueError: a concrete id outside [0, vocab_size); names the first one.
  """
  _check_rank_and_dtype(tokens, name)
  if isinstance(tokens, jax.core.Tracer):
    return tokens
  if isinstance(tokens, jax.Array) and not tokens.is_fully_addressable:
    return tokens
  return validate_tokens(tokens, vocab_size, name)


def valid_token_mask(tokens: jax.Array, vocab_size: int) -> jax.Array:
  """The mask <bool>[B, S] of the ids in [0, vocab_size), for use in a trace.

  Also registers a `checkify` check of the ids, active under `checked`
  (and free without it).

  Args:
    tokens: <int>[B, S].
    vocab_size: V.

  Returns:
    <bool>[B, S], True where the id is valid.
  """
  tokens = jnp.asarray(tokens)
  valid = (tokens >= 0) & (tokens < vocab_size)
  first = jnp.argmin(valid.reshape(-1))  # the first invalid id, if any
  checkify.check(
      jnp.all(valid),
      "tokens[{b}, {s}]={id} is invalid: token ids must be in "
      f"[0, vocab_size={vocab_size}).",
      b=first // tokens.shape[-1],
      s=first % tokens.shape[-1],
      id=tokens.reshape(-1)[first],
      debug=True,
  )
  return valid


class TokenEmbed(nn.Embed):
  """`nn.Embed` whose ids outside [0, num_embeddings) embed as NaN.

  Same variable (`embedding` [V, M]) and `attend` as `nn.Embed`; see the
  module docstring for why NaN and how `checked` reports such ids.
  """

  def __call__(self, inputs: jax.Array) -> jax.Array:
    valid = valid_token_mask(inputs, self.num_embeddings)
    out = super().__call__(inputs)
    return jnp.where(valid[..., None], out, jnp.nan)


def checked(fn: Callable) -> Callable:
  """`fn` run under `checkify`: its token checks raise a `ValueError`.

  The error is raised after `fn` ran (a device computation cannot stop
  half-way), and its outputs are dropped; with donated arguments, the inputs
  are gone too, so use it where a bad id should end the run.

  Args:
    fn: any function that runs a decoder or a train step, jitted or not.

  Returns:
    A function with `fn`'s signature and outputs that raises `ValueError`
    (the first failed `checkify` user check's message, e.g. the first bad
    token id) after `fn` ran, if a check failed.
  """
  checkified = checkify.checkify(fn, errors=checkify.user_checks)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    error, out = checkified(*args, **kwargs)
    message = error.get()
    if message:
      raise ValueError(message.split("\n")[0].split(" (`check` failed)")[0])
    return out

  return run
