"""Logical axis names, rule tables and meshes."""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.parallel.sharding": (
        "DEFAULT_RULES",
        "MESH_AXES",
        "constrain",
        "logical_shardings",
        "make_mesh",
        "mesh_context",
        "unbox",
    ),
}

_lazy_face(globals(), _EXPORTS)
