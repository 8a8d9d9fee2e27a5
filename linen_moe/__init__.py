"""linen_moe: a routed Mixture-of-Experts layer for JAX, Linen all the way down."""

from linen_moe.config import ModelConfig
from linen_moe.config import MoEConfig
from linen_moe.config import available_configs
from linen_moe.config import load_config
from linen_moe.config import load_model_config
from linen_moe.moe import CALL_SITES
from linen_moe.moe import MoEAux
from linen_moe.moe import RoutedAndSharedMoE
from linen_moe.moe import RoutedMoE
from linen_moe.moe import SharedExpert
from linen_moe.routing import RouterResult

__all__ = [
    "CALL_SITES",
    "MoEAux",
    "MoEConfig",
    "ModelConfig",
    "RoutedAndSharedMoE",
    "RoutedMoE",
    "RouterResult",
    "SharedExpert",
    "available_configs",
    "load_config",
    "load_model_config",
]
