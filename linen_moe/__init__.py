"""linen_moe: a routed Mixture-of-Experts layer for JAX, Linen all the way down.

The public API is what `__all__` lists; everything else is reached through
the documented submodules (`linen_moe.sharding`, `linen_moe.training`,
`linen_moe.hlo`, `linen_moe.distributed`, `linen_moe.serving`,
`linen_moe.decoding`, `linen_moe.routing`, `linen_moe.checkpoint`, imported
on its own so that orbax loads only when asked for) or is private.
"""

from linen_moe import decoding
from linen_moe import distributed
from linen_moe import hlo
from linen_moe import routing
from linen_moe import serving
from linen_moe import sharding
from linen_moe import training
from linen_moe.config import PATHS
from linen_moe.config import ModelConfig
from linen_moe.config import MoEConfig
from linen_moe.config import available_configs
from linen_moe.config import load_config
from linen_moe.config import load_model_config
from linen_moe.decoder import Decoder
from linen_moe.decoder import scanned_to_unrolled
from linen_moe.decoder import unrolled_to_scanned
from linen_moe.expert import SharedExpert
from linen_moe.moe import CALL_SITES
from linen_moe.moe import MoEAux
from linen_moe.moe import RoutedAndSharedMoE
from linen_moe.moe import RoutedMoE
from linen_moe.routing import RouterResult
from linen_moe.scan import scan_blocks
from linen_moe.training import MarkovData
from linen_moe.training import ShardedTraining
from linen_moe.training import TrainState
from linen_moe.training import default_optimizer
from linen_moe.training import init_train_state
from linen_moe.training import make_train_step
from linen_moe.variables import OVERWRITE_WITH_GRADIENT
from linen_moe.variables import RNG_STREAMS
from linen_moe.variables import ROUTER_JITTER_RNG_STREAM
from linen_moe.variables import STATE_COLLECTIONS
from linen_moe.variables import UPDATED_BY_RULE
from linen_moe.variables import rng_dict

__all__ = [
    "CALL_SITES",
    "OVERWRITE_WITH_GRADIENT",
    "PATHS",
    "RNG_STREAMS",
    "ROUTER_JITTER_RNG_STREAM",
    "STATE_COLLECTIONS",
    "UPDATED_BY_RULE",
    "Decoder",
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
    "available_configs",
    "decoding",
    "default_optimizer",
    "distributed",
    "hlo",
    "init_train_state",
    "load_config",
    "load_model_config",
    "make_train_step",
    "rng_dict",
    "routing",
    "scan_blocks",
    "scanned_to_unrolled",
    "serving",
    "sharding",
    "training",
    "unrolled_to_scanned",
]
