"""The NNX front end as a `linen_moe.training.TrainingFrontend`, and the
registry of both front ends by name."""

from __future__ import annotations

from typing import Any

from nnx_adapter import _checkpoint
from nnx_adapter._train import init_train_state
from nnx_adapter._train import make_train_step
from nnx_adapter._train_state import TrainState

PyTree = Any


class NNXFrontend:
  """The NNX `Decoder` and train step as a `TrainingFrontend`.

  It implements `linen_moe.training.TrainingFrontend` (used by
  `linen-moe train` and `linen-moe matrix --frontend nnx`) on the NNX
  `TrainState`.
  """

  name = "nnx"

  @staticmethod
  def init(model_config, optimizer, tokens, rng) -> TrainState:
    """The initial train state of a freshly initialized NNX decoder.

    Args:
      model_config: the decoder's `ModelConfig`.
      optimizer: the optax transformation whose state the train state holds.
      tokens: <int32>[B, S] a sample batch (its shape is what matters).
      rng: the PRNG key of the parameter init.

    Returns:
      The NNX `TrainState` at step 0 (`init_train_state`).
    """
    return init_train_state(model_config, optimizer, tokens, rng)

  @staticmethod
  def make_step(model_config, optimizer, grad_accum=1):
    """A pure, jittable train step over the state `init` returns.

    Args:
      model_config: unused: the model lives in the `TrainState`.
      optimizer: unused: the optimizer lives in the `TrainState`.
      grad_accum: microbatches per step (they must divide B).

    Returns:
      `make_train_step(grad_accum)`'s function `step(state, tokens, rng,
      mask=None) -> (state, metrics)`.
    """
    del model_config, optimizer  # both live in the TrainState
    return make_train_step(grad_accum)

  @staticmethod
  def sharded(model_config, optimizer, mesh, grad_accum=1):
    """`ShardedNNXTraining` of the config's NNX decoder on `mesh`.

    Args:
      model_config: the decoder's `ModelConfig`.
      optimizer: the optax transformation.
      mesh: a mesh over `linen_moe.sharding.MESH_AXES`.
      grad_accum: microbatches per step.

    Returns:
      The sharded init and step (`linen_moe.training.TrainingFrontend.sharded`).
    """
    from nnx_adapter._sharding import ShardedNNXTraining  # noqa: PLC0415

    return ShardedNNXTraining(
        model_config, optimizer, mesh, grad_accum=grad_accum
    )

  @staticmethod
  def params(state: TrainState) -> PyTree:
    """The parameters, in the Linen variable layout.

    Args:
      state: an NNX `TrainState`.

    Returns:
      The `params` collection, as `linen_moe.Decoder.apply` takes it.
    """
    return state.params

  @staticmethod
  def fp8_state(state: TrainState) -> PyTree:
    """The fp8 state, in the Linen layout.

    Args:
      state: an NNX `TrainState`.

    Returns:
      The `_overwrite_with_gradient` collection (empty without fp8).
    """
    return state.fp8_state

  @staticmethod
  def rule_state(state: TrainState) -> PyTree:
    """The routed biases, in the Linen layout.

    Args:
      state: an NNX `TrainState`.

    Returns:
      The `updated_by_rule` collection (empty without routed biases).
    """
    return state.rule_state

  checkpoint_tree = staticmethod(_checkpoint.tree_of)
  from_checkpoint_tree = staticmethod(_checkpoint.state_from)


def frontend(name: str) -> Any:
  """The `linen_moe.training.TrainingFrontend` called `name`: the one
  registry's (`linen_moe.training.frontend`), where this package
  registers "nnx".

  Args:
    name: one of `nnx_adapter.FRONTENDS` ("linen", "nnx").

  Returns:
    `linen_moe.training.LinenFrontend` or `NNXFrontend`.

  Raises:
    ValueError: `name` is not a registered front end.
  """
  from linen_moe import training  # noqa: PLC0415

  return training.frontend(name)


def sharded_training(
    name: str, model_config, optimizer, mesh, grad_accum: int = 1
) -> Any:
  """The sharded init and step of front end `name`'s decoder on `mesh`.

  Args:
    name: one of `nnx_adapter.FRONTENDS`.
    model_config: the decoder's `ModelConfig`.
    optimizer: the optax transformation.
    mesh: a mesh over `linen_moe.sharding.MESH_AXES`.
    grad_accum: microbatches per step.

  Returns:
    `linen_moe.training.ShardedTraining` or `ShardedNNXTraining`.

  Raises:
    ValueError: `name` is not a registered front end.
  """
  return frontend(name).sharded(model_config, optimizer, mesh, grad_accum)
