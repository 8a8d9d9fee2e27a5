"""Training the reference decoders: the train step (with an optional loss
mask), the held-out loss, the sharded step, synthetic data and the
front-end protocol (real data: `linen_moe.data`).

The layer itself does not depend on this module.
"""

import importlib as _importlib
from typing import Any as _Any
import warnings as _warnings

from linen_moe._src.training.evaluation import make_eval_step
from linen_moe._src.training.evaluation import variables_of
from linen_moe._src.training.frontend import LinenFrontend
from linen_moe._src.training.frontend import TrainingFrontend
from linen_moe._src.training.markov_data import MarkovData
from linen_moe._src.training.sharded import ShardedRun
from linen_moe._src.training.sharded import ShardedTraining
from linen_moe._src.training.step import TrainState
from linen_moe._src.training.step import accumulate_gradients
from linen_moe._src.training.step import combine_overwrite_microbatches
from linen_moe._src.training.step import cross_entropy
from linen_moe._src.training.step import decoder_loss
from linen_moe._src.training.step import default_optimizer
from linen_moe._src.training.step import init_train_state
from linen_moe._src.training.step import loss_weights
from linen_moe._src.training.step import make_train_step
from linen_moe._src.training.step import overwrite_with_gradient
from linen_moe._src.training.step import train_state_from_variables

__all__ = [
    "LinenFrontend",
    "MarkovData",
    "ShardedRun",
    "ShardedTraining",
    "TrainState",
    "TrainingFrontend",
    "accumulate_gradients",
    "combine_overwrite_microbatches",
    "cross_entropy",
    "decoder_loss",
    "default_optimizer",
    "init_train_state",
    "loss_weights",
    "make_eval_step",
    "make_train_step",
    "overwrite_with_gradient",
    "train_state_from_variables",
    "variables_of",
]

# The submodules of 0.1's `linen_moe.training` package, private since 0.2.
_MOVED_MODULES = ("data", "frontend", "sharded", "skip", "step")


def __getattr__(name: str) -> _Any:
  if name in _MOVED_MODULES:
    _warnings.warn(
        f"linen_moe.training.{name} is private since linen_moe 0.2 and will be"
        " removed in 0.3; use the names linen_moe.training exports.",
        DeprecationWarning,
        stacklevel=2,
    )
    module = "markov_data" if name == "data" else name
    return _importlib.import_module(f"linen_moe._src.training.{module}")
  raise AttributeError(f"module 'linen_moe.training' has no attribute {name!r}")
