"""The training front-end protocol, and its Linen implementation.

A front end is the decoder + train step of one framework: this package's
Linen `Decoder` (`LinenFrontend`) or the NNX one (`nnx_adapter.NNXFrontend`).
`linen-moe train` and `linen-moe matrix` drive either through this protocol,
so a cell or a run is written once for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import Protocol

import jax
import optax

from linen_moe._src.checkpoint import tree as ckpt_tree
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.layer.jit_init import jit_once
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.training import step as step_lib
from linen_moe._src.training.sharded import ShardedTraining

PyTree = Any
# step(state, tokens <int32>[B, S], rng, mask <bool>[B, S] | None = None,
#   segment_ids <int32>[B, S] | None = None, positions ... = None)
#   -> (state, metrics); the mask (True at real ids) weights the loss, the
#   segment ids and positions describe packed rows.
TrainStep = Callable[..., tuple[Any, dict]]


class TrainingFrontend(Protocol):
  """Builds, steps and reads the training state of one front end.

  Attributes:
    name: what a run records as its front end ("linen", "nnx").
  """

  name: str

  def init(
      self,
      model_config: ModelConfig,
      optimizer: optax.GradientTransformation,
      tokens: jax.Array,
      rng: jax.Array,
  ) -> Any:
    """The initial train state of a freshly initialised model.

    Args:
      model_config: the decoder's config.
      optimizer: the optax transformation whose state the train state holds.
      tokens: <int32>[B, S] a sample batch (its shape is what matters).
      rng: the PRNG key of the parameter init.

    Returns:
      The front end's train state, at step 0.
    """
    ...

  def make_step(
      self,
      model_config: ModelConfig,
      optimizer: optax.GradientTransformation,
      grad_accum: int = 1,
  ) -> TrainStep:
    """A pure, jittable train step over the state `init` returns.

    Args:
      model_config: the decoder's config.
      optimizer: the optax transformation.
      grad_accum: microbatches per step (they must divide B).

    Returns:
      The function `step(state, tokens, rng, mask=None, segment_ids=None,
      positions=None) -> (state, metrics)`, tokens <int32>[B, S]; a mask
      <bool>[B, S] makes the loss count only the targets it marks real
      (`loss_weights`); segment ids and positions <int32>[B, S] are those
      of packed rows (`Decoder`'s).
    """
    ...

  def sharded(
      self,
      model_config: ModelConfig,
      optimizer: optax.GradientTransformation,
      mesh: jax.sharding.Mesh,
      grad_accum: int = 1,
  ) -> Any:
    """The sharded init and step of this front end's decoder on `mesh`.

    Args:
      model_config: the decoder's config.
      optimizer: the optax transformation.
      mesh: a mesh over `linen_moe.sharding.MESH_AXES`.
      grad_accum: microbatches per step.

    Returns:
      A `ShardedRun` (`init`, `step`, `place`, `abstract_state`,
      `token_sharding`, `context`, `mesh`).
    """
    ...

  def params(self, state: Any) -> PyTree:
    """The parameters, in the Linen variable layout.

    Args:
      state: a train state of this front end.

    Returns:
      The `params` collection, as `Decoder.apply` takes it.
    """
    ...

  def fp8_state(self, state: Any) -> PyTree:
    """The fp8 state, in the Linen layout.

    Args:
      state: a train state of this front end.

    Returns:
      The `_overwrite_with_gradient` collection (empty without fp8).
    """
    ...

  def rule_state(self, state: Any) -> PyTree:
    """The routed biases, in the Linen layout.

    Args:
      state: a train state of this front end.

    Returns:
      The `updated_by_rule` collection (empty without routed biases).
    """
    ...

  def checkpoint_tree(self, state: Any) -> dict:
    """The state as a `linen_moe.checkpoint` tree.

    Args:
      state: a train state of this front end (arrays or abstract ones).

    Returns:
      The checkpoint tree (the same for every front end).
    """
    ...

  def from_checkpoint_tree(self, tree: dict, template: Any) -> Any:
    """A state with its leaves from a checkpoint tree.

    Args:
      tree: a checkpoint tree (of any front end).
      template: a train state of this front end, giving the structure.

    Returns:
      `template` with the leaves of `tree`.
    """
    ...


class LinenFrontend:
  """The Linen `Decoder` and `make_train_step` as a `TrainingFrontend`.

  Its methods are those of `TrainingFrontend`, on a `TrainState`.
  """

  name = "linen"

  @staticmethod
  def init(model_config, optimizer, tokens, rng) -> step_lib.TrainState:
    """The initial `TrainState` (see `TrainingFrontend.init`).

    Compiled once per config, optimizer and shape.

    Args:
      model_config: the decoder's config.
      optimizer: the optax transformation.
      tokens: <int32>[B, S] a sample batch.
      rng: the PRNG key of the parameter init.

    Returns:
      The `TrainState` at step 0.
    """
    model = Decoder(model_config)
    init = jit_once(
        lambda t, r: step_lib.init_train_state(model, optimizer, t, r),
        placed=True,
    )
    return init(tokens, rng)

  @staticmethod
  def make_step(model_config, optimizer, grad_accum=1) -> TrainStep:
    """`make_train_step` of the config's `Decoder`.

    Args:
      model_config: the decoder's config.
      optimizer: the optax transformation.
      grad_accum: microbatches per step.

    Returns:
      The step (see `TrainingFrontend.make_step`).
    """
    return step_lib.make_train_step(
        Decoder(model_config), optimizer, grad_accum
    )

  @staticmethod
  def sharded(model_config, optimizer, mesh, grad_accum=1) -> ShardedTraining:
    """`ShardedTraining` of the config's `Decoder` on `mesh`.

    Args:
      model_config: the decoder's config.
      optimizer: the optax transformation.
      mesh: a mesh over `linen_moe.sharding.MESH_AXES`.
      grad_accum: microbatches per step.

    Returns:
      The sharded init and step (see `TrainingFrontend.sharded`).
    """
    return ShardedTraining(
        Decoder(model_config), optimizer, mesh, grad_accum=grad_accum
    )

  @staticmethod
  def params(state: step_lib.TrainState) -> PyTree:
    """See `TrainingFrontend.params`.

    Args:
      state: a `TrainState`.

    Returns:
      The `params` collection.
    """
    return state.params

  @staticmethod
  def fp8_state(state: step_lib.TrainState) -> PyTree:
    """See `TrainingFrontend.fp8_state`.

    Args:
      state: a `TrainState`.

    Returns:
      The `_overwrite_with_gradient` collection.
    """
    return state.fp8_state

  @staticmethod
  def rule_state(state: step_lib.TrainState) -> PyTree:
    """See `TrainingFrontend.rule_state`.

    Args:
      state: a `TrainState`.

    Returns:
      The `updated_by_rule` collection.
    """
    return state.rule_state

  checkpoint_tree = staticmethod(ckpt_tree.tree_of)
  from_checkpoint_tree = staticmethod(ckpt_tree.state_from)
