"""Training the reference decoders: the train step, the sharded step,
synthetic data and the front-end protocol. The layer itself does not depend
on this package."""

from linen_moe.training.data import MarkovData
from linen_moe.training.frontend import LinenFrontend
from linen_moe.training.frontend import TrainingFrontend
from linen_moe.training.sharded import ShardedRun
from linen_moe.training.sharded import ShardedTraining
from linen_moe.training.step import TrainState
from linen_moe.training.step import accumulate_gradients
from linen_moe.training.step import combine_overwrite_microbatches
from linen_moe.training.step import cross_entropy
from linen_moe.training.step import decoder_loss
from linen_moe.training.step import default_optimizer
from linen_moe.training.step import init_train_state
from linen_moe.training.step import make_train_step
from linen_moe.training.step import overwrite_with_gradient

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
    "make_train_step",
    "overwrite_with_gradient",
]
