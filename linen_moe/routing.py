"""Routing: which experts each token uses, with what weights, and the
balancing losses and rules around that choice."""

from linen_moe._src.routing import RouterResult
from linen_moe._src.routing import expert_assignment_fraction
from linen_moe._src.routing import group_limited_mask
from linen_moe._src.routing import jitter
from linen_moe._src.routing import load_balance_loss
from linen_moe._src.routing import route
from linen_moe._src.routing import routed_bias_update
from linen_moe._src.routing import router_z_loss
from linen_moe._src.routing import select_experts

__all__ = [
    "RouterResult",
    "expert_assignment_fraction",
    "group_limited_mask",
    "jitter",
    "load_balance_loss",
    "route",
    "routed_bias_update",
    "router_z_loss",
    "select_experts",
]
