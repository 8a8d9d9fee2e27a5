"""The NNX adapter: the one place Linen meets NNX.

`Decoder` is the NNX twin of `linen_moe.Decoder` (the same blocks, so the
same math and the same variable paths), trained by `train_step` /
`make_train_step` on a `TrainState`, sharded by `ShardedNNXTraining`, and
decoded by `greedy_generate`. `EagerToNNX` wraps any Linen module with all
of its state built at construction. `FRONTENDS` names the two training
front ends (`frontend`, `sharded_training` build them by name).

Built on `linen_moe`'s public API only. Each name loads on first use:
`import nnx_adapter` alone imports no jax (the command line's `--help`
reads `FRONTENDS` and `FRONTEND_DESCRIPTIONS`).
"""

import importlib as _importlib
from typing import Any as _Any

_EXPORTS = {
    "nnx_adapter._adapter": ("Cache", "EagerToNNX", "Fp8State", "RuleState"),
    "nnx_adapter._decoder": (
        "Decoder",
        "init_decoder",
        "linen_to_nnx",
        "nnx_to_linen",
    ),
    "nnx_adapter._decoding": ("decoding_model", "generate", "greedy_generate"),
    "nnx_adapter._frontend": (
        "NNXFrontend",
        "frontend",
        "sharded_training",
    ),
    "nnx_adapter._sharding": ("ShardedNNXTraining",),
    "nnx_adapter._train": (
        "accumulate_gradients",
        "apply_gradients",
        "decoder_loss",
        "init_train_state",
        "make_train_step",
        "train_step",
    ),
    "nnx_adapter._train_state": ("TrainState",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

# The training front ends by name, and a line on each for `--help`; known
# without importing jax (`frontend(name)` loads one).
FRONTEND_DESCRIPTIONS = {
    "linen": "the Linen decoder (linen_moe.Decoder)",
    "nnx": "the NNX decoder (nnx_adapter.Decoder)",
}
FRONTENDS = tuple(FRONTEND_DESCRIPTIONS)

__all__ = [
    "FRONTENDS",
    "FRONTEND_DESCRIPTIONS",
    "Cache",
    "Decoder",
    "EagerToNNX",
    "Fp8State",
    "NNXFrontend",
    "RuleState",
    "ShardedNNXTraining",
    "TrainState",
    "accumulate_gradients",
    "apply_gradients",
    "decoder_loss",
    "decoding_model",
    "frontend",
    "generate",
    "greedy_generate",
    "init_decoder",
    "init_train_state",
    "linen_to_nnx",
    "make_train_step",
    "nnx_to_linen",
    "sharded_training",
    "train_step",
]


def __getattr__(name: str) -> _Any:
  if name in _HOME:
    value = getattr(_importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'nnx_adapter' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
