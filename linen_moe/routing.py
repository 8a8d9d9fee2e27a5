"""Routing: which experts each token uses, with what weights, and the
balancing losses and rules around that choice."""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.layer.routing": (
        "RouterResult",
        "load_balance_loss",
        "route",
        "routed_bias_update",
        "router_z_loss",
    ),
}

_lazy_face(globals(), _EXPORTS)
