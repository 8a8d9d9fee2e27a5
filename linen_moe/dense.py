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

from linen_moe import sharding
from linen_moe.config import MoEConfig
from linen_moe.expert import gated_mlp
from linen_moe.routing import RouterResult

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


def dispatch_mask(
    indices: jax.Array, num_experts: int, capacity: int
) -> jax.Array:
  """<float32>[B, S, k, E, C] one-hot slot of every kept assignment.

  `indices` is <int32>[B, S, k]. Within one sequence, assignments claim expert
  slots in this priority order: all first choices in token order, then all
  second choices in token order, and so on. Assignments past an expert's
  capacity C get an all-zero row (dropped).
  """
  b, s, k = indices.shape
  onehot = jax.nn.one_hot(indices, num_experts, dtype=jnp.int32)  # [B,S,k,E]
  by_priority = jnp.swapaxes(onehot, 1, 2).reshape(b, k * s, num_experts)
  position = jnp.cumsum(by_priority, axis=1) * by_priority - 1  # -1 = absent
  position = jnp.swapaxes(position.reshape(b, k, s, num_experts), 1, 2)
  # one_hot of -1 or >= capacity is all zeros: absent or dropped.
  return jax.nn.one_hot(position, capacity, dtype=jnp.float32)


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
) -> tuple[jax.Array, jax.Array]:
  """Per-expert capacity slots; assignments past `capacity` are dropped.

  x [B, S, M]; router over the B*S tokens -> ([B, S, M], dropped fraction).
  """
  b, s, _ = x.shape
  k, e = router.indices.shape[-1], experts[0].shape[0]
  slots = dispatch_mask(router.indices.reshape(b, s, k), e, capacity)
  dispatch = jnp.sum(slots, axis=2)  # [B, S, E, C]
  weights = router.weights.reshape(b, s, k, 1, 1)
  combine = jnp.sum(slots * weights, axis=2)  # [B, S, E, C]
  dropped = 1.0 - jnp.sum(slots) / (b * s * k)
  expert_in = sharding.constrain(
      einsum("dispatch", "BSM,BSEC->EBCM", x, dispatch.astype(x.dtype)), EBCM
  )
  expert_out = _experts(einsum, _SLOTS, expert_in, experts, act)  # [E,B,C,M]
  out = einsum("combine", "EBCM,BSEC->BSM", expert_out, combine.astype(x.dtype))
  return out, dropped
