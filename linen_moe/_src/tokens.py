"""Token ids in [0, vocab_size): checked before the work, or inside `jit`.

Three places see token ids, and each handles an id outside [0, V):

  `validate_tokens(tokens, vocab_size)`  the validating entry point. On
      concrete arrays (NumPy, or a JAX array outside a trace) it raises a
      `TypeError` (not integer, not [batch, seq]) or a `ValueError` naming
      the first bad id, its position and the allowed range, before any
      computation. `linen-moe train` runs it on every batch.
  Inside `jit`  a traced function cannot raise on a value. The decoders'
      embedding (`TokenEmbed`) maps every id outside [0, V) to a row of NaN
      (a plain `nn.Embed` would silently wrap ids in [-V, -1] to V + id), so
      the loss is NaN and the train steps skip the step, counting it.
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

  Raises:
    TypeError: not an integer array of rank 2, or traced (use `checked`).
    ValueError: an id outside [0, vocab_size); names the first one.
  """
  if isinstance(tokens, jax.core.Tracer):
    raise TypeError(
        f"validate_tokens({name}) needs concrete ids, got a traced value; "
        "inside jit, run the function under linen_moe.tokens.checked."
    )
  array = np.asarray(tokens)
  if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
    raise TypeError(
        f"{name} must be integer token ids [batch, seq]; got "
        f"{array.dtype}{list(array.shape)}."
    )
  bad = (array < 0) | (array >= vocab_size)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{name}[{where[0]}, {where[1]}]={int(array[where])} is invalid: "
        f"token ids must be in [0, vocab_size={vocab_size}) "
        f"({int(bad.sum())} of {array.size} ids are outside it)."
    )
  return tokens


def check_tokens(tokens: jax.Array, vocab_size: int) -> jax.Array:
  """In a trace: a `checkify` check of the ids (active under `checked`) and
  the mask <bool>[B, S] of the valid ones."""
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
    valid = check_tokens(inputs, self.num_embeddings)
    out = super().__call__(inputs)
    return jnp.where(valid[..., None], out, jnp.nan)


def checked(fn: Callable) -> Callable:
  """`fn` run under `checkify`: its token checks raise a `ValueError`.

  The error is raised after `fn` ran (a device computation cannot stop
  half-way), and its outputs are dropped; with donated arguments, the inputs
  are gone too, so use it where a bad id should end the run.
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
