"""Routing: which experts each token uses, with what weights, and the
balancing losses and rules around that choice."""

from linen_moe._src.layer.routing import RouterResult
from linen_moe._src.layer.routing import expert_assignment_fraction
from linen_moe._src.layer.routing import group_limited_mask
from linen_moe._src.layer.routing import jitter
from linen_moe._src.layer.routing import load_balance_loss
from linen_moe._src.layer.routing import route
from linen_moe._src.layer.routing import routed_bias_update
from linen_moe._src.layer.routing import router_z_loss
from linen_moe._src.layer.routing import select_experts

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
