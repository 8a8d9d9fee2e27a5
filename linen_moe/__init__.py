"""linen_moe: a routed Mixture-of-Experts layer for JAX, Linen all the way down.

The public API is what `__all__` lists, plus the public modules
`linen_moe.routing`, `serving`, `sharding`, `decoding`, `distributed`,
`tokens`, `training`, `testing` and `checkpoint` (imported on its own, so that
orbax loads only when asked for). Everything under `linen_moe._src` is private
and may move between releases.
"""

import importlib as _importlib
from typing import Any as _Any
import warnings as _warnings

from linen_moe import decoding
from linen_moe import distributed
from linen_moe import routing
from linen_moe import serving
from linen_moe import sharding
from linen_moe import tokens
from linen_moe import training
from linen_moe._src.config import PATHS
from linen_moe._src.config import QUANTIZATIONS
from linen_moe._src.config import ModelConfig
from linen_moe._src.config import MoEConfig
from linen_moe._src.config import available_configs
from linen_moe._src.config import load_config as load_config  # deprecated
from linen_moe._src.config import load_model_config
from linen_moe._src.config import load_moe_config
from linen_moe._src.expert import SharedExpert
from linen_moe._src.grouped_kernels import KernelFallbackWarning
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.models.decoder import scanned_to_unrolled
from linen_moe._src.models.decoder import unrolled_to_scanned
from linen_moe._src.moe import CALL_SITES
from linen_moe._src.moe import MoEAux
from linen_moe._src.moe import RoutedAndSharedMoE
from linen_moe._src.moe import RoutedMoE
from linen_moe._src.routing import RouterResult
from linen_moe._src.scan import scan_blocks
from linen_moe._src.training.data import MarkovData
from linen_moe._src.training.sharded import ShardedTraining
from linen_moe._src.training.step import TrainState
from linen_moe._src.training.step import default_optimizer
from linen_moe._src.training.step import init_train_state
from linen_moe._src.training.step import make_train_step
from linen_moe._src.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.variables import RNG_STREAMS
from linen_moe._src.variables import ROUTER_JITTER_RNG_STREAM
from linen_moe._src.variables import STATE_COLLECTIONS
from linen_moe._src.variables import UPDATED_BY_RULE
from linen_moe._src.variables import rng_dict

__version__ = "0.2.0"

__all__ = [
    "CALL_SITES",
    "OVERWRITE_WITH_GRADIENT",
    "PATHS",
    "QUANTIZATIONS",
    "RNG_STREAMS",
    "ROUTER_JITTER_RNG_STREAM",
    "STATE_COLLECTIONS",
    "UPDATED_BY_RULE",
    "Decoder",
    "KernelFallbackWarning",
    "MarkovData",
    "MoEAux",
    "MoEConfig",
    "ModelConfig",
    "RoutedAndSharedMoE",
    "RoutedMoE",
    "RouterResult",
    "ShardedTraining",
    "SharedExpert",
    "TrainState",
    "__version__",
    "available_configs",
    "checkpoint",
    "decoding",
    "default_optimizer",
    "distributed",
    "init_train_state",
    "load_moe_config",
    "load_model_config",
    "make_train_step",
    "rng_dict",
    "routing",
    "scan_blocks",
    "scanned_to_unrolled",
    "serving",
    "sharding",
    "testing",
    "tokens",
    "training",
    "unrolled_to_scanned",
]

# Public modules loaded on first use rather than by `import linen_moe`.
_LAZY_MODULES = {
    "checkpoint": "linen_moe.checkpoint",
    "testing": "linen_moe.testing",
}

# Modules that were public in 0.1 and are private since 0.2: the old name
# still works for one release, with a DeprecationWarning naming the new home.
_MOVED_MODULES = {
    "activations": ("linen_moe._src.activations", None),
    "checkpoint_tree": (
        "linen_moe._src.checkpoint_tree",
        "linen_moe.checkpoint",
    ),
    "config": (
        "linen_moe._src.config",
        "linen_moe (MoEConfig, ModelConfig, ...)",
    ),
    "decoder": ("linen_moe._src.models.decoder", "linen_moe.Decoder"),
    "dense": ("linen_moe._src.dense", None),
    "expert": ("linen_moe._src.expert", "linen_moe.SharedExpert"),
    "expert_parallel": ("linen_moe._src.expert_parallel", None),
    "grouped_matmul": ("linen_moe._src.grouped_matmul", None),
    "hlo": ("linen_moe._src.hlo", "linen_moe.testing"),
    "int8_grouped": ("linen_moe._src.int8_grouped", None),
    "jit_init": ("linen_moe._src.jit_init", None),
    "moe": ("linen_moe._src.moe", "linen_moe (RoutedMoE, ...)"),
    "permute": ("linen_moe._src.permute", None),
    "quantization": ("linen_moe._src.quantization", None),
    "scan": ("linen_moe._src.scan", "linen_moe.scan_blocks"),
    "sparse": ("linen_moe._src.sparse", None),
    "stored_weights": ("linen_moe._src.stored_weights", "linen_moe.serving"),
    "variables": ("linen_moe._src.variables", "linen_moe (the constants)"),
}


def __getattr__(name: str) -> _Any:
  if name in _LAZY_MODULES:
    return _importlib.import_module(_LAZY_MODULES[name])
  if name in _MOVED_MODULES:
    module, instead = _MOVED_MODULES[name]
    advice = (
        f"use {instead}"
        if instead
        else f"it has no public replacement ({module} may change any time)"
    )
    _warnings.warn(
        f"linen_moe.{name} is private since linen_moe 0.2 and will be removed"
        f" in 0.3; {advice}.",
        DeprecationWarning,
        stacklevel=2,
    )
    return _importlib.import_module(module)
  raise AttributeError(f"module 'linen_moe' has no attribute {name!r}")
