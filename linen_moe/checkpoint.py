"""Checkpoints of a training run through orbax: save, resume anywhere, export.

Imported on its own (not by `import linen_moe`), so that orbax loads only
when asked for."""

from linen_moe._src.checkpoint import Checkpoints
from linen_moe._src.checkpoint import DamagedCheckpointError
from linen_moe._src.checkpoint import Restored
from linen_moe._src.checkpoint_export import export
from linen_moe._src.checkpoint_export import load_export
from linen_moe._src.checkpoint_export import read_variables
from linen_moe._src.checkpoint_meta import RUN_FIELDS
from linen_moe._src.checkpoint_meta import check_model_config
from linen_moe._src.checkpoint_meta import config_dict
from linen_moe._src.checkpoint_meta import config_from_dict
from linen_moe._src.checkpoint_meta import rng_from_json
from linen_moe._src.checkpoint_meta import rng_to_json
from linen_moe._src.checkpoint_tree import VARIABLES
from linen_moe._src.checkpoint_tree import abstract
from linen_moe._src.checkpoint_tree import linen_path
from linen_moe._src.checkpoint_tree import relayout
from linen_moe._src.checkpoint_tree import state_from
from linen_moe._src.checkpoint_tree import tree_of

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
