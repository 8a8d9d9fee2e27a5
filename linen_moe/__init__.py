"""linen_moe: a routed Mixture-of-Experts layer for JAX, Linen all the way down.

The public API is what `__all__` lists: the layer (`RoutedMoE`, ...), its
configs, the reference `Decoder`, and the public modules `quantization`,
`routing`, `variables`, `sharding`, `models`, `training`, `decoding`,
`checkpoint`, `data`, `distributed`, `hf`, `hlo`, `lora`, `planning`, `tokens`
and `testing`.
Each name and module loads on first use: `import linen_moe` alone imports no
jax. Everything under `linen_moe._src` is private and may move between
releases; names that moved answer for one release with a
`DeprecationWarning` naming their new home.
"""

import importlib as _importlib
from typing import Any as _Any

from linen_moe._src import deprecation as _deprecation

# Where each public name is defined. Names load on first use (PEP 562), so
# that `import linen_moe` alone imports no jax: the command line's --help
# and a test session's setup (which sets jax's flags) run before jax loads.
_EXPORTS = {
    "linen_moe._src.config.moe_config": ("MATMUL_PATHS", "MoEConfig"),
    "linen_moe._src.config.files": (
        "available_configs",
        "load_config",  # deprecated: load_moe_config
        "load_model_config",
        "load_moe_config",
    ),
    "linen_moe._src.layer.expert": ("SharedExpert",),
    # accelerator imports jax, so it loads only when the name is asked for.
    "linen_moe._src.kernels.accelerator": ("KernelFallbackWarning",),
    "linen_moe._src.config.model_config": ("ModelConfig",),
    "linen_moe._src.models.decoder": ("Decoder",),
    "linen_moe._src.layer.moe": ("MoEAux", "RoutedAndSharedMoE", "RoutedMoE"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

# The public modules, loaded on first use like the names above.
_PUBLIC_MODULES = (
    "checkpoint",
    "data",
    "decoding",
    "distributed",
    "hf",
    "hlo",
    "lora",
    "models",
    "planning",
    "quantization",
    "routing",
    "serving",
    "sharding",
    "testing",
    "tokens",
    "training",
    "variables",
)

__version__ = "0.2.0"

__all__ = [
    "MATMUL_PATHS",
    "Decoder",
    "KernelFallbackWarning",
    "MoEAux",
    "MoEConfig",
    "ModelConfig",
    "RoutedAndSharedMoE",
    "RoutedMoE",
    "SharedExpert",
    "__version__",
    "available_configs",
    "checkpoint",
    "data",
    "decoding",
    "distributed",
    "hf",
    "hlo",
    "load_model_config",
    "load_moe_config",
    "lora",
    "models",
    "planning",
    "quantization",
    "routing",
    "sharding",
    "testing",
    "tokens",
    "training",
    "variables",
]

# `import linen_moe.moe` and the other old module paths (see `_deprecation`).
_deprecation.install()


def __getattr__(name: str) -> _Any:
  if name in _HOME:
    value = getattr(_importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # found directly from now on
    return value
  if name in _PUBLIC_MODULES:
    return _importlib.import_module(f"linen_moe.{name}")
  if f"linen_moe.{name}" in _deprecation.MOVED_MODULES:
    return _importlib.import_module(f"linen_moe.{name}")  # warns
  return _deprecation.moved_name(__name__, name)


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
