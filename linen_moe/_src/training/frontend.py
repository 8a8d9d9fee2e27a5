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

from linen_moe._src import checkpoint_tree as ckpt_tree
from linen_moe._src.config import ModelConfig
from linen_moe._src.jit_init import jit_once
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.training import step as step_lib

PyTree = Any
# step(state, tokens <int32>[B, S], rng, mask <bool>[B, S] | None = None)
#   -> (state, metrics); the mask (True at real ids) weights the loss.
TrainStep = Callable[..., tuple[Any, dict]]


class TrainingFrontend(Protocol):
  """Builds, steps and reads the training state of one front end."""

  def init(
      self,
      model_config: ModelConfig,
      optimizer: optax.GradientTransformation,
      tokens: jax.Array,
      rng: jax.Array,
  ) -> Any:
    """The initial train state for `model_config`, sampled on `tokens`."""
    ...

  def make_step(
      self,
      model_config: ModelConfig,
      optimizer: optax.GradientTransformation,
      grad_accum: int = 1,
  ) -> TrainStep:
    """A pure, jittable train step over the state `init` returns:
    `step(state, tokens, rng, mask=None)`; a mask <bool>[B, S] makes the
    loss count only the targets it marks real (`step.loss_weights`)."""
    ...

  def params(self, state: Any) -> PyTree:
    """The parameters, in the Linen variable layout."""
    ...

  def fp8_state(self, state: Any) -> PyTree:
    """The `_overwrite_with_gradient` collection, in the Linen layout."""
    ...

  def rule_state(self, state: Any) -> PyTree:
    """The `updated_by_rule` collection (routed biases), in the Linen
    layout."""
    ...

  def checkpoint_tree(self, state: Any) -> dict:
    """The state (arrays or abstract) as a `linen_moe.checkpoint` tree."""
    ...

  def from_checkpoint_tree(self, tree: dict, template: Any) -> Any:
    """`template` (a state) with its leaves from a checkpoint tree."""
    ...


class LinenFrontend:
  """The Linen `Decoder` and `make_train_step` as a `TrainingFrontend`."""

  @staticmethod
  def init(model_config, optimizer, tokens, rng) -> step_lib.TrainState:
    model = Decoder(model_config)
    init = jit_once(
        lambda t, r: step_lib.init_train_state(model, optimizer, t, r)
    )
    return init(tokens, rng)

  @staticmethod
  def make_step(model_config, optimizer, grad_accum=1) -> TrainStep:
    return step_lib.make_train_step(
        Decoder(model_config), optimizer, grad_accum
    )

  @staticmethod
  def params(state: step_lib.TrainState) -> PyTree:
    return state.params

  @staticmethod
  def fp8_state(state: step_lib.TrainState) -> PyTree:
    return state.fp8_state

  @staticmethod
  def rule_state(state: step_lib.TrainState) -> PyTree:
    return state.rule_state

  checkpoint_tree = staticmethod(ckpt_tree.tree_of)
  from_checkpoint_tree = staticmethod(ckpt_tree.state_from)
