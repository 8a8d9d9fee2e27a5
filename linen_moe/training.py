"""Training the reference decoders: a whole run (`run`, `RunOptions`: what
`linen-moe train` does, from Python), the train step (with an optional
loss mask), the optimizer (AdamW, learning-rate schedules, the weight-decay
mask), the held-out loss, the sharded step, synthetic data and the
front-end protocol and the front ends by name (`frontend`; real data:
`linen_moe.data`), and stopping a loop on
SIGTERM or Ctrl-C after the same step on every process (`StopRequest`).

The layer itself does not depend on this module. Its names load on first
use: `RunOptions` is checked before jax loads.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.config.schedules": ("SCHEDULES",),
    "linen_moe._src.run.callbacks": ("Callback",),
    "linen_moe._src.run.host_memory": ("reuse_host_memory",),
    "linen_moe._src.run.loop": ("run",),
    "linen_moe._src.run.options": ("RunOptions", "RunStopped"),
    "linen_moe._src.run.result": ("RunResult",),
    "linen_moe._src.run.stop": ("StopRequest",),
    "linen_moe._src.training.chunked_loss": ("chunked_cross_entropy",),
    "linen_moe._src.training.evaluation": ("make_eval_step",),
    "linen_moe._src.training.frontend": ("LinenFrontend", "TrainingFrontend"),
    "linen_moe._src.training.markov_data": ("MarkovData",),
    "linen_moe._src.training.registry": (
        "FRONTENDS",
        "frontend",
        "register_frontend",
    ),
    "linen_moe._src.training.optimizer": (
        "default_optimizer",
        "learning_rate_schedule",
        "weight_decay_mask",
    ),
    "linen_moe._src.training.sharded": ("ShardedTraining",),
    "linen_moe._src.training.step": (
        "TrainState",
        "cross_entropy",
        "decoder_loss",
        "init_train_state",
        "make_train_step",
        "train_state_from_variables",
    ),
}

# 0.1's `linen_moe.training` was a package: its submodules' old paths
# (`import linen_moe.training.step`) still import, with a warning
# (`linen_moe._src.deprecation.MOVED_MODULES`), which needs a package path.
__path__ = []

_lazy_face(globals(), _EXPORTS)
