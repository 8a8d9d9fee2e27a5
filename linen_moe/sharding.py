"""Logical axis names, rule tables and meshes."""

from linen_moe._src.parallel.sharding import DEFAULT_RULES
from linen_moe._src.parallel.sharding import MESH_AXES
from linen_moe._src.parallel.sharding import constrain
from linen_moe._src.parallel.sharding import current_mesh
from linen_moe._src.parallel.sharding import current_rules
from linen_moe._src.parallel.sharding import logical_shardings
from linen_moe._src.parallel.sharding import make_mesh
from linen_moe._src.parallel.sharding import mesh_axes
from linen_moe._src.parallel.sharding import mesh_context
from linen_moe._src.parallel.sharding import named
from linen_moe._src.parallel.sharding import parse_mesh_spec
from linen_moe._src.parallel.sharding import replicated
from linen_moe._src.parallel.sharding import unbox

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "constrain",
    "current_mesh",
    "current_rules",
    "logical_shardings",
    "make_mesh",
    "mesh_axes",
    "mesh_context",
    "named",
    "parse_mesh_spec",
    "replicated",
    "unbox",
]
