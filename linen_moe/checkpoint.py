"""Checkpoints of a training run through orbax: save, resume anywhere, export.

Imported on its own (not by `import linen_moe`), so that orbax loads only
when asked for."""

from linen_moe._src.checkpoint.export import export
from linen_moe._src.checkpoint.export import load_export
from linen_moe._src.checkpoint.export import read_variables
from linen_moe._src.checkpoint.manager import Checkpoints
from linen_moe._src.checkpoint.manager import DamagedCheckpointError
from linen_moe._src.checkpoint.manager import Restored
from linen_moe._src.checkpoint.meta import RUN_FIELDS
from linen_moe._src.checkpoint.meta import check_model_config
from linen_moe._src.checkpoint.meta import config_dict
from linen_moe._src.checkpoint.meta import config_from_dict
from linen_moe._src.checkpoint.meta import rng_from_json
from linen_moe._src.checkpoint.meta import rng_to_json
from linen_moe._src.checkpoint.tree import VARIABLES
from linen_moe._src.checkpoint.tree import abstract
from linen_moe._src.checkpoint.tree import linen_path
from linen_moe._src.checkpoint.tree import relayout
from linen_moe._src.checkpoint.tree import state_from
from linen_moe._src.checkpoint.tree import tree_of

__all__ = [
    "Checkpoints",
    "DamagedCheckpointError",
    "RUN_FIELDS",
    "Restored",
    "VARIABLES",
    "abstract",
    "check_model_config",
    "config_dict",
    "config_from_dict",
    "export",
    "linen_path",
    "load_export",
    "read_variables",
    "relayout",
    "rng_from_json",
    "rng_to_json",
    "state_from",
    "tree_of",
]
