"""Training the reference decoders: the train step (with an optional loss
mask), the optimizer (AdamW, learning-rate schedules, the weight-decay
mask), the held-out loss, the sharded step, synthetic data and the
front-end protocol (real data: `linen_moe.data`).

The layer itself does not depend on this module.
"""

import importlib as _importlib
from typing import Any as _Any

from linen_moe._src import deprecation as _deprecation
from linen_moe._src.models.decoder import routed_bias_rule
from linen_moe._src.training.chunked_loss import chunked_cross_entropy
from linen_moe._src.training.chunked_loss import vocab_chunk_size
from linen_moe._src.training.evaluation import make_eval_step
from linen_moe._src.training.evaluation import variables_of
from linen_moe._src.training.frontend import LinenFrontend
from linen_moe._src.training.frontend import TrainingFrontend
from linen_moe._src.training.markov_data import MarkovData
from linen_moe._src.training.optimizer import DEFAULT_FINAL_LR_RATIO
from linen_moe._src.training.optimizer import SCHEDULES
from linen_moe._src.training.optimizer import decays
from linen_moe._src.training.optimizer import default_optimizer
from linen_moe._src.training.optimizer import learning_rate_schedule
from linen_moe._src.training.optimizer import weight_decay_mask
from linen_moe._src.training.sharded import ShardedRun
from linen_moe._src.training.sharded import ShardedTraining
from linen_moe._src.training.skip import all_finite
from linen_moe._src.training.skip import keep_if_finite
from linen_moe._src.training.step import TrainState
from linen_moe._src.training.step import accumulate_gradients
from linen_moe._src.training.step import cross_entropy
from linen_moe._src.training.step import decoder_loss
from linen_moe._src.training.step import hidden_decoder_loss
from linen_moe._src.training.step import init_train_state
from linen_moe._src.training.step import loss_weights
from linen_moe._src.training.step import make_train_step
from linen_moe._src.training.step import overwrite_with_gradient
from linen_moe._src.training.step import train_batch
from linen_moe._src.training.step import train_state_from_variables

__all__ = [
    "DEFAULT_FINAL_LR_RATIO",
    "SCHEDULES",
    "LinenFrontend",
    "MarkovData",
    "ShardedRun",
    "ShardedTraining",
    "TrainState",
    "TrainingFrontend",
    "accumulate_gradients",
    "all_finite",
    "chunked_cross_entropy",
    "cross_entropy",
    "decays",
    "decoder_loss",
    "default_optimizer",
    "hidden_decoder_loss",
    "init_train_state",
    "keep_if_finite",
    "learning_rate_schedule",
    "loss_weights",
    "make_eval_step",
    "make_train_step",
    "overwrite_with_gradient",
    "routed_bias_rule",
    "train_batch",
    "train_state_from_variables",
    "variables_of",
    "vocab_chunk_size",
    "weight_decay_mask",
]

# 0.1's `linen_moe.training` was a package: its submodules' old paths
# (`import linen_moe.training.step`) still import, with a warning
# (`linen_moe._src.deprecation.MOVED_MODULES`), which needs a package path.
__path__ = []


def __getattr__(name: str) -> _Any:
  if f"{__name__}.{name}" in _deprecation.MOVED_MODULES:
    return _importlib.import_module(f"{__name__}.{name}")  # warns
  return _deprecation.moved_name(__name__, name)
