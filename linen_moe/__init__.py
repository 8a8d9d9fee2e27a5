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
from linen_moe.quantization import AQT_RNG_STREAM
from linen_moe.quantization import OVERWRITE_WITH_GRADIENT
from linen_moe.quantization import contraction_modules
from linen_moe.routing import RouterResult

__all__ = [
    "AQT_RNG_STREAM",
    "OVERWRITE_WITH_GRADIENT",
    "contraction_modules",
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
