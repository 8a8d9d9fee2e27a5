"""The dense paths: einsums over every expert, with or without token dropping.

Shapes: B batch, S sequence, M emb_dim, H moe_mlp_dim, E num_experts,
k num_experts_per_tok, C expert capacity.

Every contraction goes through the layer's named einsum hook,
`einsum(site, eqn, lhs, rhs)` (`RoutedMoE.einsum`), so each one is quantized
by the layer's mode and owns its state.
"""

from __future__ import annotations

from collections.abc import Callable
import math

import jax
import jax.numpy as jnp

from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.layer import permute
from linen_moe._src.layer.expert import gated_mlp
from linen_moe._src.layer.routing import RouterResult
from linen_moe._src.parallel import sharding

Einsum = Callable[[str, str, jax.Array, jax.Array], jax.Array]
Experts = tuple[jax.Array, jax.Array, jax.Array]  # (wi_0, wi_1, wo)

# Logical axis names of the intermediates (see `sharding`): the expert axis on
# "activation_exp", the batch beside it on the other axes.
BSEH = (
    "activation_batch_no_exp",
    "activation_length",
    "activation_exp",
    "activation_mlp",
)
BSEM = BSEH[:3] + ("activation_embed",)
EBCH = ("activation_exp", "activation_batch_no_exp", None, "activation_mlp")
EBCM = EBCH[:3] + ("activation_embed",)

# Per layout of the expert input: the einsum of each expert weight and the
# logical names of its output.
_DROPLESS = {
    "wi_0": ("BSM,EMH->BSEH", BSEH),
    "wi_1": ("BSM,EMH->BSEH", BSEH),
    "wo": ("BSEH,EHM->BSEM", BSEM),
}
_SLOTS = {
    "wi_0": ("EBCM,EMH->EBCH", EBCH),
    "wi_1": ("EBCM,EMH->EBCH", EBCH),
    "wo": ("EBCH,EHM->EBCM", EBCM),
}


def _experts(einsum: Einsum, layout, x, experts: Experts, act) -> jax.Array:
  """The gated experts on `x` through the named einsums of `layout`."""

  def project(site, operand, weight):
    eqn, names = layout[site]
    return sharding.constrain(einsum(site, eqn, operand, weight), names)

  return gated_mlp(project, act, x, *experts)


def expert_capacity(config: MoEConfig, seq_len: int) -> int:
  """C, the per-sequence capacity of one expert on the dropping dense path."""
  c = math.ceil(
      config.capacity_factor
      * seq_len
      * config.num_experts_per_tok
      / config.num_experts
  )
  return max(1, min(seq_len, c))


def slot_positions(
    indices: jax.Array,
    num_experts: int,
    capacity: int,
    priority: jax.Array | None = None,
) -> jax.Array:
  """<int32>[B, S, k]: the capacity slot of every assignment, -1 if dropped.

  `indices` is <int32>[B, S, k]. Within one sequence, assignments claim expert
  slots in this order (the "position" drop policy): all first choices in
  token order, then all second choices in token order, and so on. With
  `priority` <float>[B, S, k] (the routing weights: the "probability" drop
  policy, batch prioritized routing), the highest priority claims first,
  equal priorities in the position order. Assignments past an expert's
  capacity C are dropped.
  """
  b, s, k = indices.shape
  onehot = jax.nn.one_hot(indices, num_experts, dtype=jnp.int32)  # [B,S,k,E]
  by_priority = jnp.swapaxes(onehot, 1, 2).reshape(b, k * s, num_experts)
  if priority is not None:  # claim in priority order, then put back
    flat = jnp.swapaxes(priority, 1, 2).reshape(b, k * s, 1)
    order = jnp.argsort(-flat, axis=1, stable=True)  # [B, k*S, 1]
    by_priority = jnp.take_along_axis(by_priority, order, axis=1)
  rank = jnp.cumsum(by_priority, axis=1)  # [B, k*S, E]: 1-based
  if priority is not None:
    rank = jnp.take_along_axis(rank, jnp.argsort(order, axis=1), axis=1)
  rank = jnp.swapaxes(rank.reshape(b, k, s, num_experts), 1, 2)  # [B,S,k,E]
  position = jnp.take_along_axis(rank, indices[..., None], axis=-1)[..., 0] - 1
  return jnp.where(position < capacity, position, -1)


def dispatch_mask(
    indices: jax.Array,
    num_experts: int,
    capacity: int,
    priority: jax.Array | None = None,
) -> jax.Array:
  """<float32>[B, S, k, E, C] one-hot slot of every kept assignment (the
  dense form of `slot_positions`; dropped assignments get all-zero rows)."""
  slot = jax.nn.one_hot(
      slot_positions(indices, num_experts, capacity, priority), capacity
  )  # [B, S, k, C]; one_hot(-1) is all zeros
  expert = jax.nn.one_hot(indices, num_experts)  # [B, S, k, E]
  return expert[..., None] * slot[..., None, :]


def dense(
    einsum: Einsum, x: jax.Array, router: RouterResult, experts: Experts, act
) -> jax.Array:
  """Dropless: every expert for every token, combined by the routing weights.

  x [B, S, M]; router over the B*S tokens -> [B, S, M].
  """
  b, s, _ = x.shape
  e = experts[0].shape[0]
  expert_out = _experts(einsum, _DROPLESS, x, experts, act)  # [B, S, E, M]
  dense_weights = jnp.zeros((b * s, e), jnp.float32)
  rows = jnp.arange(b * s)[:, None]
  dense_weights = dense_weights.at[rows, router.indices].add(router.weights)
  dense_weights = dense_weights.reshape(b, s, e).astype(x.dtype)  # [B, S, E]
  return einsum("combine", "BSEM,BSE->BSM", expert_out, dense_weights)


def dense_dropping(
    einsum: Einsum,
    x: jax.Array,
    router: RouterResult,
    experts: Experts,
    act,
    capacity: int,
    by_probability: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Per-expert capacity slots; assignments past `capacity` are dropped, the
  lowest routing weights first when `by_probability`, else the latest in
  `dispatch_mask`'s position order.

  x [B, S, M]; router over the B*S tokens -> ([B, S, M], dropped fraction).

  Index form. The one-hot dispatch/combine masks [B, S, E, C] have one
  nonzero per kept assignment, so contracting them costs B*S*E*C*M
  multiply-adds for B*S*k*M of data movement (at 128 experts and capacity
  factor 1, more than the experts' own FLOPs). Here the two contractions
  keep only each token's own k choices, and the rows move by gathers:

    dispatch  'BSM,BSK->BSKM': x times its kept-choice mask (1 kept, 0
              dropped), the dispatch one-hot restricted to its nonzero
              block; then gathered into the slots [E, B, C, M].
    combine   'BSKM,BSK->BSM': each choice's expert output (gathered back
              from its slot, 0 if dropped) contracted with its weight.

  Both still go through the named hook, so every quantization applies to
  them. The gathers are partial permutations (`permute.take_injective`):
  their gradients are gathers too.
  """
  b, s, m = x.shape
  k, e = router.indices.shape[-1], experts[0].shape[0]
  indices = router.indices.reshape(b, s, k)
  priority = router.weights.reshape(b, s, k) if by_probability else None
  position = slot_positions(indices, e, capacity, priority)  # [B, S, k]
  kept = position >= 0
  # Counted in integers: 1 - kept / total in float32 (XLA multiplies by the
  # reciprocal) leaves a small negative fraction when nothing is dropped.
  total = b * s * k
  dropped = (total - jnp.sum(kept.astype(jnp.int32))) / total
  # Per sequence: the slot e * C + c of each choice, and the choice s * k + j
  # in each slot (-1: dropped / empty).
  slot_of_choice = jnp.where(kept, indices * capacity + position, -1)
  slot_of_choice = slot_of_choice.reshape(b, s * k)
  # Dropped choices write past the end, which mode="drop" discards (a -1
  # index would wrap around to the last slot).
  past_end = jnp.where(slot_of_choice >= 0, slot_of_choice, e * capacity)
  choice_of_slot = jax.vmap(
      lambda slots: jnp.full((e * capacity,), -1, jnp.int32)
      .at[slots]
      .set(jnp.arange(s * k, dtype=jnp.int32), mode="drop")
  )(
      past_end
  )  # [B, E*C]

  x_choices = einsum(
      "dispatch", "BSM,BSK->BSKM", x, kept.astype(x.dtype)
  )  # [B, S, k, M]
  expert_in = jax.vmap(
      lambda rows, index, inverse: permute.take_injective(
          rows, index, inverse
      ).reshape(e, capacity, m),
      out_axes=1,
  )(x_choices.reshape(b, s * k, m), choice_of_slot, slot_of_choice)
  expert_in = sharding.constrain(expert_in, EBCM)  # [E, B, C, M]
  expert_out = _experts(einsum, _SLOTS, expert_in, experts, act)  # [E,B,C,M]
  out_choices = jax.vmap(
      lambda rows, index, inverse: permute.take_injective(
          rows.reshape(e * capacity, m), index, inverse
      ),
      in_axes=(1, 0, 0),
  )(
      expert_out, slot_of_choice, choice_of_slot
  )  # [B, S*k, M]
  weights = jnp.where(kept, router.weights.reshape(b, s, k), 0)
  out = einsum(
      "combine",
      "BSKM,BSK->BSM",
      out_choices.reshape(b, s, k, m),
      weights.astype(x.dtype),
  )
  return out, dropped
