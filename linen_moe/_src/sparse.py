"""The sparse, dropless path on one device: sort, grouped matmuls, unsort.

Shapes: T tokens, M emb_dim, H moe_mlp_dim, k experts per token, E_l the
experts held here, R = T * min(k, E_l) rows of the sorted buffer.

Every weight is contracted through the layer's named grouped-matmul hook,
`grouped(site, lhs, rhs, group_sizes)` (`RoutedMoE.grouped`), so each one is
quantized by the layer's mode and owns its state. Under a mesh,
`linen_moe.expert_parallel` runs this same function on each device's experts.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from linen_moe._src import permute
from linen_moe._src.expert import gated_mlp

Grouped = Callable[[str, jax.Array, jax.Array, jax.Array], jax.Array]
Experts = tuple[jax.Array, jax.Array, jax.Array]  # (wi_0, wi_1, wo)


def sparse_experts(
    grouped: Grouped,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    experts: Experts,
    act: Callable[[jax.Array], jax.Array],
    first_expert: jax.Array | int = 0,
    all_experts: bool = False,
) -> jax.Array:
  """The experts [first, first + E_l) that `experts` hold, on their tokens.

  x [T, M]; indices <int32>[T, k] and weights [T, k], the routing; experts =
  (wi_0, wi_1, wo) with wi_0/wi_1 [E_l, M, H], wo [E_l, H, M]. Returns
  [T, M]: each token's weighted sum over its choices among these experts (0
  for the others). With all E experts it is the whole, dropless sparse path;
  `all_experts` says so (then no sorted row needs masking).
  """
  plan = permute.sort_plan(
      indices, experts[0].shape[0], first_expert, all_local=all_experts
  )
  rows = permute.dispatch_rows(x, plan)  # [R, M] sorted by expert

  def project(site, operand, weight):
    return grouped(site, operand, weight, plan.group_sizes)

  expert_out = gated_mlp(project, act, rows, *experts)  # [R, M]
  return permute.combine_rows(expert_out, weights.astype(x.dtype), plan)
