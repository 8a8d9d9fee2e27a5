"""linen_moe: a routed Mixture-of-Experts layer for JAX, Linen all the way down.

The public API is what `__all__` lists, plus the public modules
`linen_moe.routing`, `serving`, `sharding`, `decoding`, `distributed`,
`tokens`, `training`, `data`, `testing`, `checkpoint` and `hf`. Each name
and module loads on first use: `import linen_moe` alone imports no jax.
Everything under `linen_moe._src` is private and may move between releases.
"""

import importlib as _importlib
from typing import Any as _Any
import warnings as _warnings

# Where each public name is defined. Names load on first use (PEP 562), so
# that `import linen_moe` alone imports no jax: the command line's --help
# and a test session's setup (which sets jax's flags) run before jax loads.
_EXPORTS = {
    "linen_moe._src.config.moe_config": ("PATHS", "QUANTIZATIONS", "MoEConfig"),
    "linen_moe._src.config.files": (
        "available_configs",
        "load_config",  # deprecated: load_moe_config
        "load_model_config",
        "load_moe_config",
    ),
    "linen_moe._src.layer.expert": ("SharedExpert",),
    # grouped_kernels imports jax, so it loads only when the name is asked for.
    "linen_moe._src.kernels.accelerator": ("KernelFallbackWarning",),
    "linen_moe._src.config.model_config": ("ModelConfig",),
    "linen_moe._src.models.decoder": (
        "Decoder",
        "scanned_to_unrolled",
        "unrolled_to_scanned",
    ),
    "linen_moe._src.layer.moe": (
        "CALL_SITES",
        "MoEAux",
        "RoutedAndSharedMoE",
        "RoutedMoE",
    ),
    "linen_moe._src.layer.routing": ("RouterResult",),
    "linen_moe._src.models.scan": ("scan_blocks",),
    "linen_moe._src.training.markov_data": ("MarkovData",),
    "linen_moe._src.training.sharded": ("ShardedTraining",),
    "linen_moe._src.training.step": (
        "TrainState",
        "default_optimizer",
        "init_train_state",
        "make_train_step",
    ),
    "linen_moe._src.layer.variables": (
        "OVERWRITE_WITH_GRADIENT",
        "RNG_STREAMS",
        "ROUTER_JITTER_RNG_STREAM",
        "STATE_COLLECTIONS",
        "UPDATED_BY_RULE",
        "rng_dict",
    ),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

# The public modules, loaded on first use like the names above.
_PUBLIC_MODULES = (
    "checkpoint",
    "data",
    "decoding",
    "distributed",
    "hf",
    "routing",
    "serving",
    "sharding",
    "testing",
    "tokens",
    "training",
)

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
    "data",
    "decoding",
    "default_optimizer",
    "distributed",
    "hf",
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

# Modules that were public in 0.1 and are private since 0.2: the old name
# still works for one release, with a DeprecationWarning naming the new home.
_MOVED_MODULES = {
    "activations": ("linen_moe._src.layer.activations", None),
    "checkpoint_tree": (
        "linen_moe._src.checkpoint.tree",
        "linen_moe.checkpoint",
    ),
    "config": (
        "linen_moe._src.config.moe_config",
        "linen_moe (MoEConfig, ModelConfig, ...)",
    ),
    "decoder": ("linen_moe._src.models.decoder", "linen_moe.Decoder"),
    "dense": ("linen_moe._src.layer.dense", None),
    "expert": ("linen_moe._src.layer.expert", "linen_moe.SharedExpert"),
    "expert_parallel": ("linen_moe._src.layer.expert_parallel", None),
    "grouped_matmul": ("linen_moe._src.kernels.grouped_matmul", None),
    "hlo": ("linen_moe._src.hlo.reading", "linen_moe.testing"),
    "int8_grouped": ("linen_moe._src.kernels.int8_grouped", None),
    "jit_init": ("linen_moe._src.layer.jit_init", None),
    "moe": ("linen_moe._src.layer.moe", "linen_moe (RoutedMoE, ...)"),
    "permute": ("linen_moe._src.layer.permute", None),
    "quantization": ("linen_moe._src.quantization.contractions", None),
    "scan": ("linen_moe._src.models.scan", "linen_moe.scan_blocks"),
    "sparse": ("linen_moe._src.layer.sparse", None),
    "stored_weights": (
        "linen_moe._src.quantization.stored_weights",
        "linen_moe.serving",
    ),
    "variables": (
        "linen_moe._src.layer.variables",
        "linen_moe (the constants)",
    ),
}


def __getattr__(name: str) -> _Any:
  if name in _HOME:
    value = getattr(_importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # found directly from now on
    return value
  if name in _PUBLIC_MODULES:
    return _importlib.import_module(f"linen_moe.{name}")
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


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
