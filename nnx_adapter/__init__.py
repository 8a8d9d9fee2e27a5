"""The NNX adapter: the one place Linen meets NNX.

`Decoder` is the NNX twin of `linen_moe.Decoder` (the same blocks, so the
same math and the same variable paths), trained by `train_step` /
`make_train_step` on a `TrainState` (or in a loop of your own, with
`value_and_grad` in place of `nnx.value_and_grad` so that fp8 scales
update), sharded by `NNXFrontend.sharded`, and decoded by
`greedy_generate`. `EagerToNNX` wraps any Linen module with all
of its state built at construction. `frontend` builds a training front
end by name, from the library's one
registry, `linen_moe.training.frontend`, where this package registers
"nnx" when imported).

Built on `linen_moe`'s public API only. Each name loads on first use:
`import nnx_adapter` alone imports no jax (the command line's `--help`
reads `linen_moe.training.FRONTENDS`).
"""

import importlib as _importlib
from typing import Any as _Any
import warnings as _warnings

from linen_moe import training as _training

_EXPORTS = {
    "nnx_adapter._adapter": ("EagerToNNX", "Fp8State", "RuleState"),
    "nnx_adapter._decoder": ("Decoder", "linen_to_nnx", "nnx_to_linen"),
    "nnx_adapter._decoding": ("generate", "greedy_generate"),
    "nnx_adapter._fp8_loop": ("value_and_grad",),
    "nnx_adapter._frontend": ("NNXFrontend", "frontend"),
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

# Names public until 0.3, private since: they answer until 0.4 with a warning.
_PRIVATE_NOW = {
    "Cache": ("nnx_adapter._adapter", "the KV cache's variable type"),
    "ShardedNNXTraining": (
        "nnx_adapter._sharding",
        "use NNXFrontend.sharded(config, optimizer, mesh, grad_accum)",
    ),
    "decoding_model": ("nnx_adapter._decoding", "use generate"),
    "init_decoder": ("nnx_adapter._decoder", "use Decoder(config, rngs=...)"),
    "sharded_training": (
        "nnx_adapter._frontend",
        "use frontend(name).sharded(config, optimizer, mesh, grad_accum)",
    ),
}


def _nnx_frontend() -> _Any:
  return __getattr__("NNXFrontend")


# This front end, in the library's one registry (no jax imported here).
_training.register_frontend(
    "nnx", _nnx_frontend, "the NNX decoder (nnx_adapter.Decoder)"
)

__all__ = [
    "Decoder",
    "EagerToNNX",
    "Fp8State",
    "NNXFrontend",
    "RuleState",
    "TrainState",
    "accumulate_gradients",
    "apply_gradients",
    "decoder_loss",
    "frontend",
    "generate",
    "greedy_generate",
    "init_train_state",
    "linen_to_nnx",
    "make_train_step",
    "nnx_to_linen",
    "train_step",
    "value_and_grad",
]


def __getattr__(name: str) -> _Any:
  if name in ("FRONTENDS", "FRONTEND_DESCRIPTIONS"):  # the one registry's
    _warnings.warn(
        f"nnx_adapter.{name} is deprecated and will be removed in 0.4; use"
        " linen_moe.training.FRONTENDS.",
        DeprecationWarning,
        stacklevel=2,
    )
    names = _training.FRONTENDS
    return tuple(names) if name == "FRONTENDS" else dict(names)
  if name in _HOME:
    value = getattr(_importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
  if name in _PRIVATE_NOW:
    module, advice = _PRIVATE_NOW[name]
    _warnings.warn(
        f"nnx_adapter.{name} is deprecated and will be removed in 0.4;"
        f" {advice}.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_importlib.import_module(module), name)
  raise AttributeError(f"module 'nnx_adapter' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
