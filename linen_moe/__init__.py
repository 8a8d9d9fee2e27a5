"""linen_moe: a routed Mixture-of-Experts layer for JAX, Linen all the way down.

The public API is what `__all__` lists (the layer: `RoutedMoE`, ...; its
configs; the reference `Decoder`) and the public modules: `quantization`,
`routing`, `variables`, `sharding`, `models`, `training`, `decoding`,
`checkpoint`, `data`, `distributed`, `hf`, `hlo`, `lora`, `planning`,
`tokens`, `testing`, and `frontend` (the contract of a second front end,
`nnx_adapter`). Each name and module loads on first use: `import linen_moe`
alone imports no jax. Everything under `linen_moe._src` is private and may
move between releases; names that moved answer for one release with a
`DeprecationWarning` naming their new home (`linen_moe._src.deprecation`).
"""

from linen_moe._src import deprecation as _deprecation
from linen_moe._src.faces import lazy_face as _lazy_face

__version__ = "0.2.0"

_EXPORTS = {
    "linen_moe._src.config.files": (
        "available_configs",
        "load_model_config",
        "load_moe_config",
    ),
    "linen_moe._src.config.model_config": ("ModelConfig",),
    "linen_moe._src.config.moe_config": ("MATMUL_PATHS", "MoEConfig"),
    # accelerator imports jax, so it loads only when the name is asked for.
    "linen_moe._src.kernels.accelerator": ("KernelFallbackWarning",),
    "linen_moe._src.layer.expert": ("SharedExpert",),
    "linen_moe._src.layer.moe": ("MoEAux", "RoutedAndSharedMoE", "RoutedMoE"),
    "linen_moe._src.models.decoder": ("Decoder",),
}

_lazy_face(
    globals(),
    _EXPORTS,
    defined_here=("__version__",),
    submodules=(
        "checkpoint",
        "data",
        "decoding",
        "distributed",
        "frontend",
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
    ),
)
_deprecation.install()
