"""The experts' weight names, shapes and logical axes, in one home.

The routed layer (`RoutedMoE`), the shared expert and the dense MLP
(`linen_moe._src.layer.expert`), serving's conversion and the checkpoint
formats all read them here. A fact table below the configs: imports no jax.

Shapes: M emb_dim, F the hidden width, E experts.
"""

from __future__ import annotations

KERNELS = ("wi_0", "wi_1", "wo")
# The routed layer's router (`gate/kernel` [M, E]): a module holding it
# beside the kernels holds routed experts [E, ...]; without it, one MLP.
ROUTER = "gate"
# Axes of one kernel (before any stacked layer axes): routed and MLP.
ROUTED_RANK, MLP_RANK = 3, 2


def kernel_shapes(
    emb_dim: int, width: int, num_experts: int | None = None
) -> dict[str, tuple[int, ...]]:
  """{name: shape} of the kernels: wi_0, wi_1 [M, F], wo [F, M], each with
  a leading expert axis [E, ...] for routed experts (`num_experts`)."""
  lead = () if num_experts is None else (num_experts,)
  return {
      "wi_0": (*lead, emb_dim, width),
      "wi_1": (*lead, emb_dim, width),
      "wo": (*lead, width, emb_dim),
  }


def kernel_axes(routed: bool) -> dict[str, tuple[str, ...]]:
  """{name: logical axis names} of the kernels (`linen_moe.sharding`)."""
  lead = ("exp",) if routed else ()
  return {
      "wi_0": (*lead, "embed", "mlp"),
      "wi_1": (*lead, "embed", "mlp"),
      "wo": (*lead, "mlp", "embed"),
  }
