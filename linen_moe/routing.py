"""Top-k routing and the Switch load-balance loss. Knows nothing of quantization.

Shapes: T tokens, E experts, k experts per token.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class RouterResult:
  """What the router decided for T tokens.

  Attributes:
    weights: <float32>[T, k] combine weight of each chosen expert (after
      renormalisation and the per-expert scale, when enabled).
    indices: <int32>[T, k] chosen experts, in decreasing router score; ties go
      to the lower expert index (`jax.lax.top_k`).
    probs: <float32>[T, E] softmax over all experts (load-balance loss input).
  """

  weights: jax.Array
  indices: jax.Array
  probs: jax.Array


def route(
    logits: jax.Array,
    k: int,
    routing: str,
    norm_topk_prob: bool,
    per_expert_scale: jax.Array | None = None,
) -> RouterResult:
  """Chooses k experts per token from `logits` <float>[T, E].

  "topk_then_softmax" (Mixtral): top-k of the logits, softmax over the k.
  "softmax_then_topk": softmax over all E, top-k, optionally renormalised.
  `per_expert_scale` <float>[E] is then multiplied into the weights.
  """
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  if routing == "topk_then_softmax":
    top_logits, indices = jax.lax.top_k(logits, k)
    weights = jax.nn.softmax(top_logits, axis=-1)
  elif routing == "softmax_then_topk":
    weights, indices = jax.lax.top_k(probs, k)
    if norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  else:
    raise ValueError(f"Unknown routing {routing!r}.")
  if per_expert_scale is not None:
    weights = weights * per_expert_scale.astype(jnp.float32)[indices]
  return RouterResult(
      weights=weights, indices=indices.astype(jnp.int32), probs=probs
  )


def expert_assignment_fraction(
    indices: jax.Array, num_experts: int
) -> jax.Array:
  """<float32>[E]: share of the T*k routed assignments each expert received."""
  counts = jnp.zeros((num_experts,), jnp.float32).at[indices.reshape(-1)].add(1)
  return counts / indices.size


def load_balance_loss(router: RouterResult, num_experts: int) -> jax.Array:
  """Switch-Transformer auxiliary loss, E * sum_e f_e * P_e (unweighted).

  f_e is the fraction of routed assignments to expert e, P_e its mean router
  probability. It is 1 when routing is perfectly uniform and E when every token
  goes to one expert with probability 1. The gradient flows through P only.
  """
  fraction = expert_assignment_fraction(router.indices, num_experts)
  mean_prob = jnp.mean(router.probs, axis=0)
  return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)
