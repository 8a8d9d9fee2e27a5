"""Top-k routing, its auxiliary losses and the routed-bias rule. Knows nothing
of quantization.

Shapes: T tokens, E experts, k experts per token, G routing groups.

Every routing is the same three steps, written once in `route`:
  1. selection scores [T, E]: the logits ("topk_then_softmax"), their softmax
     ("softmax_then_topk") or their sigmoid ("sigmoid_then_topk");
  2. the choice: top-k of the selection scores plus an optional selection-only
     bias, restricted to the best groups when the experts are grouped;
  3. the weights, from the *unbiased* scores of the chosen experts: a softmax
     over the chosen logits, or the chosen probabilities / sigmoids
     (renormalised when asked), times `routed_scaling_factor` and an optional
     learned per-expert scale.
Ties go to the lower expert (and group) index, as in `jax.lax.top_k`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from linen_moe._src.layer import index_ops


@flax.struct.dataclass
class RouterResult:
  """What the router decided for T tokens.

  Attributes:
    weights: <float32>[T, k] combine weight of each chosen expert (after
      renormalisation, `routed_scaling_factor` and the per-expert scale).
    indices: <int32>[T, k] chosen experts, in decreasing selection score;
      ties go to the lower expert index (`jax.lax.top_k`).
    probs: <float32>[T, E] each token's distribution over all experts (the
      load-balance loss input): the softmax of the logits, or for
      "sigmoid_then_topk" the sigmoids normalised to sum to 1 (DeepSeek-V3's
      balance-loss affinities).
  """

  weights: jax.Array
  indices: jax.Array
  probs: jax.Array


def group_limited_mask(
    scores: jax.Array, n_groups: int, topk_groups: int
) -> jax.Array:
  """<bool>[T, E]: the experts in each token's `topk_groups` best groups.

  The E experts form `n_groups` contiguous groups; a group's score is the sum
  of its two highest `scores` <float>[T, E]. Ties go to the lower group.

  Args:
    scores: <float>[T, E] selection scores (biased, if a selection bias is in
      use).
    n_groups: number of contiguous expert groups G; must divide E, and each
      group must hold at least 2 experts.
    topk_groups: how many groups each token may choose from, 1 <= it <= G.

  Returns:
    <bool>[T, E], True for the experts of each token's best groups.
  """
  t, e = scores.shape
  grouped = scores.reshape(t, n_groups, e // n_groups)  # [T, G, E/G]
  group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
  _, best = jax.lax.top_k(group_scores, topk_groups)  # [T, topk_groups]
  allowed = jnp.any(jax.nn.one_hot(best, n_groups, dtype=bool), axis=1)
  return jnp.repeat(allowed, e // n_groups, axis=1)  # [T, E]


def select_experts(
    scores: jax.Array, k: int, n_groups: int = 1, topk_groups: int = 1
) -> jax.Array:
  """<int32>[T, k]: top-k of `scores`, within the best groups when grouped.

  Args:
    scores: <float>[T, E] selection scores.
    k: experts per token, 1 <= k <= E.
    n_groups: expert groups G; above 1 the choice is limited to each token's
      `topk_groups` best groups (see `group_limited_mask`).
    topk_groups: groups each token may choose from (used when `n_groups > 1`).

  Returns:
    <int32>[T, k] chosen expert indices, in decreasing score; ties go to the
    lower index.
  """
  if n_groups > 1:
    allowed = group_limited_mask(scores, n_groups, topk_groups)
    scores = jnp.where(allowed, scores, -jnp.inf)
  return jax.lax.top_k(scores, k)[1].astype(jnp.int32)


def route(
    logits: jax.Array,
    k: int,
    routing: str,
    norm_topk_prob: bool,
    per_expert_scale: jax.Array | None = None,
    *,
    selection_bias: jax.Array | None = None,
    n_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling_factor: float = 1.0,
) -> RouterResult:
  """Chooses k experts per token from `logits` <float>[T, E].

  "topk_then_softmax" (Mixtral): top-k of the logits, softmax over the k.
  "softmax_then_topk": softmax over all E, top-k, optionally renormalised.
  "sigmoid_then_topk" (DeepSeek-V3): sigmoid of each logit, top-k, optionally
  renormalised. "topk_then_sigmoid" (Llama-4): top-k of the logits, the
  sigmoid of each chosen one, optionally renormalised.
  `selection_bias` <float>[E] is added to the selection scores (logits,
  softmax or sigmoid) only to choose; `n_groups` / `topk_groups` limit the
  choice to the best groups. The weights, computed from the unbiased scores,
  are multiplied by `routed_scaling_factor` and `per_expert_scale` <float>[E].

  Args:
    logits: <float>[T, E] router logits (computed in float32 here).
    k: experts per token, 1 <= k <= E.
    routing: one of `MoEConfig`'s routings (`ROUTINGS`).
    norm_topk_prob: renormalise the k chosen probabilities / sigmoids to sum
      to 1 (ignored by "topk_then_softmax", whose softmax already does).
    per_expert_scale: optional <float>[E] learned scale of each expert's
      weight.
    selection_bias: optional <float>[E] added to the selection scores to
      choose, never to the weights.
    n_groups: contiguous expert groups G (1: no grouping); must divide E.
    topk_groups: groups each token may choose from when `n_groups > 1`.
    routed_scaling_factor: multiplies every combine weight.

  Returns:
    A `RouterResult` with `weights` <float32>[T, k], `indices`
    <int32>[T, k] and `probs` <float32>[T, E].

  Raises:
    ValueError: if `routing` is not one of the names above.
  """
  logits = logits.astype(jnp.float32)
  if routing in ("sigmoid_then_topk", "topk_then_sigmoid"):
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    if routing == "topk_then_sigmoid":  # choose by the logits
      scores = logits
  elif routing in ("topk_then_softmax", "softmax_then_topk"):
    probs = jax.nn.softmax(logits, axis=-1)
    scores = logits if routing == "topk_then_softmax" else probs
  else:
    raise ValueError(f"Unknown routing {routing!r}.")
  biased = scores
  if selection_bias is not None:
    biased = scores + selection_bias.astype(jnp.float32)
  indices = select_experts(biased, k, n_groups, topk_groups)
  # [T, k], unbiased
  chosen = index_ops.pick(scores, indices, index_ops.platform_method())
  if routing == "topk_then_softmax":
    weights = jax.nn.softmax(chosen, axis=-1)
  elif routing == "topk_then_sigmoid":
    weights = jax.nn.sigmoid(chosen)
    if norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  elif norm_topk_prob:
    weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
  else:
    weights = chosen
  weights = weights * routed_scaling_factor
  if per_expert_scale is not None:
    weights = weights * per_expert_scale.astype(jnp.float32)[indices]
  return RouterResult(weights=weights, indices=indices, probs=probs)


def jitter(x: jax.Array, eps: float, rng: jax.Array) -> jax.Array:
  """x times uniform noise in [1 - eps, 1 + eps] (Switch router jitter).

  Args:
    x: array of any shape (the router input, [T, M]).
    eps: half-width of the noise interval, >= 0.
    rng: a PRNG key.

  Returns:
    An array of `x`'s shape and dtype.
  """
  noise = jax.random.uniform(
      rng, x.shape, jnp.float32, minval=1.0 - eps, maxval=1.0 + eps
  )
  return x * noise.astype(x.dtype)


def expert_assignment_fraction(
    indices: jax.Array, num_experts: int
) -> jax.Array:
  """<float32>[E]: share of the T*k routed assignments each expert received.

  Args:
    indices: <int>[T, k] chosen experts (any shape; every entry counts once).
    num_experts: E.

  Returns:
    <float32>[E], summing to 1.
  """
  method = index_ops.platform_method()
  counts = index_ops.counts(indices, num_experts, method)
  return counts.astype(jnp.float32) / indices.size


def load_balance_loss(router: RouterResult, num_experts: int) -> jax.Array:
  """Switch-Transformer auxiliary loss, E * sum_e f_e * P_e (unweighted).

  f_e is the fraction of routed assignments to expert e, P_e its mean router
  probability. It is 1 when routing is perfectly uniform and E when every token
  goes to one expert with probability 1. The gradient flows through P only.

  Args:
    router: the `RouterResult` of T tokens (`indices` and `probs` are read).
    num_experts: E.

  Returns:
    <float32>[] the loss.
  """
  fraction = expert_assignment_fraction(router.indices, num_experts)
  mean_prob = jnp.mean(router.probs, axis=0)
  return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)


def router_z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE router z-loss (unweighted): mean of `logsumexp(logits) ** 2`.

  It keeps the logits small, where the router's softmax / sigmoid is
  numerically stable.

  Args:
    logits: <float>[T, E] router logits.

  Returns:
    <float32>[] the mean over the T tokens.
  """
  z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return jnp.mean(jnp.square(z))


def routed_bias_update(
    bias: jax.Array, load: jax.Array, rate: float
) -> jax.Array:
  """Aux-loss-free balancing: `bias + rate * sign(mean(load) - load)`.

  `bias` and `load` are <float32>[..., E] (the leading axes, e.g. stacked
  layers, are independent); `load` is each expert's share of the step's
  routed assignments. An overloaded expert's bias falls, an underloaded one's
  rises, each by `rate`.

  Args:
    bias: <float32>[..., E] the selection bias.
    load: <float>[..., E] each expert's share of the routed assignments.
    rate: step size (bias units per update), >= 0.

  Returns:
    The new bias, of `bias`'s shape and dtype.
  """
  load = load.astype(jnp.float32)
  mean = jnp.mean(load, axis=-1, keepdims=True)
  return bias + rate * jnp.sign(mean - load).astype(bias.dtype)
