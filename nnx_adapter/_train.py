"""The NNX train step: optax on `nnx.Param`, fp8 state overwritten, routed
biases moved by their rule.

The rule for fp8 state is `linen_moe.training.step`'s, shared with the Linen train
step: differentiate with respect to `Fp8State` too, write its "gradient" back
as the new value (`overwrite_with_gradient`), and combine microbatches with
`combine_overwrite_microbatches` (inside `accumulate_gradients`). `RuleState`
(the routed biases) follows `linen_moe.decoder.routed_bias_rule` after the
optimizer update, from the step's expert loads.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

from flax import nnx
import flax.struct
import jax
import jax.numpy as jnp
import optax

from linen_moe._src.jit_init import jit_once
from linen_moe._src.model_config import ModelConfig
from linen_moe._src.models.decoder import routed_bias_rule
from linen_moe._src.training import skip
from linen_moe._src.training import step as linen_train
from linen_moe._src.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.variables import UPDATED_BY_RULE
from nnx_adapter import _checkpoint
from nnx_adapter._adapter import Fp8State
from nnx_adapter._adapter import RuleState
from nnx_adapter._decoder import Decoder
from nnx_adapter._decoder import init_decoder
from nnx_adapter._decoder import nnx_to_linen

PyTree = Any


def accumulate_gradients(
    model: nnx.Module,
    loss_fn: Callable,
    batch: jax.Array,
    rng: jax.Array,
    grad_accum: int = 1,
):
  """Gradients of `loss_fn(model, microbatch, rng) -> (loss, metrics)` with
  respect to `nnx.Param` and `Fp8State`, over `grad_accum` microbatches
  (`linen_moe.training.accumulate_gradients`: parameter gradients and metrics
  averaged, fp8 "gradients" combined by their element-wise maximum).

  Returns `((param_grads, fp8_grads), metrics)`; `model` is left untouched.
  """
  graphdef, params, fp8_state, rest = nnx.split(model, nnx.Param, Fp8State, ...)

  def grad_fn(microbatch, rng):
    def loss(params, fp8_state):
      # Fresh copies of the other variables (routed biases), at this trace's
      # level: `nnx.scan` refuses variables made outside it.
      merged = nnx.merge(graphdef, params, fp8_state, rest, copy=True)
      return loss_fn(merged, microbatch, rng)

    return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, fp8_state)

  return linen_train.accumulate_gradients(grad_fn, batch, grad_accum, rng)


def apply_gradients(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    param_grads: nnx.State,
    fp8_grads: nnx.State,
) -> None:
  """Optimizer update of the params; fp8 state overwritten by its gradient."""
  optimizer.update(model, param_grads)
  fp8_state = nnx.state(model, Fp8State)
  nnx.update(model, linen_train.overwrite_with_gradient(fp8_state, fp8_grads))


def apply_routed_bias_rule(
    model: nnx.Module, expert_load: jax.Array, rate: float
) -> None:
  """Moves every `routed_bias` of `model` (a `Decoder`) in place by the rule,
  from the step's expert loads <float32>[L, E]."""
  rule_state = nnx.state(model, RuleState)
  new = routed_bias_rule(
      nnx.to_pure_dict(rule_state), expert_load, rate, model.config.stack_plan
  )
  nnx.replace_by_pure_dict(rule_state, new)
  nnx.update(model, rule_state)


def decoder_loss(model: nnx.Module, batch, rng: jax.Array):
  """`linen_moe.training.decoder_loss` of the NNX decoder on `batch`: the
  tokens, or (tokens, `linen_moe.training.loss_weights`)."""
  tokens, weights = batch if isinstance(batch, tuple) else (batch, None)
  logits, aux = model(tokens, rng=rng)
  return linen_train.decoder_loss(logits, aux, tokens, weights)


def train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    tokens: jax.Array,
    rng: jax.Array,
    grad_accum: int = 1,
    mask: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """One training step of `model` (a `Decoder`) in place; returns metrics.

  With `mask` (<bool>[B, S], True at real ids) the cross-entropy counts
  only real targets (`linen_moe.training.loss_weights`), as in the Linen
  step.

  A step whose loss or any gradient is non-finite leaves the model and the
  optimizer as they were, but for `optimizer.step` (advanced);
  `metrics["skipped"]` is then 1 (see `linen_moe.training.skip`).
  Use under `nnx.jit` with `grad_accum` static, e.g.
  `nnx.jit(train_step, static_argnames="grad_accum")`.
  """
  # A copy of the values: `nnx.state` holds the live Variables.
  old = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))
  batch = tokens if mask is None else (tokens, linen_train.loss_weights(mask))
  (param_grads, fp8_grads), metrics = accumulate_gradients(
      model, decoder_loss, batch, rng, grad_accum
  )
  apply_gradients(model, optimizer, param_grads, fp8_grads)
  rate = model.config.moe.routed_bias_update_rate
  if rate > 0:
    apply_routed_bias_rule(model, metrics["expert_load"], rate)
  ok = skip.all_finite((metrics["loss"], param_grads, fp8_grads))
  steps = optimizer.step.get_value()
  new = nnx.state((model, optimizer))
  nnx.update((model, optimizer), skip.keep_if_finite(ok, new, old))
  optimizer.step.set_value(steps)
  return {**metrics, "skipped": jnp.logical_not(ok).astype(jnp.int32)}


@flax.struct.dataclass
class TrainState:
  """The NNX model and its optimizer as one pytree, for `jax.jit`.

  `params` and `fp8_state` read like the Linen `TrainState`'s: Linen-layout
  trees (`{"layers": {"moe": {"wi_0": ...}}}`), so one check serves both.
  """

  graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
  state: nnx.State
  # <int32>[] steps skipped for a non-finite loss or gradient.
  skipped_steps: jax.Array = dataclasses.field(
      default_factory=lambda: jnp.zeros((), jnp.int32)
  )

  def merge(self) -> tuple[Decoder, nnx.Optimizer]:
    return nnx.merge(self.graphdef, self.state)

  @property
  def step(self) -> jax.Array:
    return self.merge()[1].step.get_value()

  @property
  def params(self) -> PyTree:
    return nnx_to_linen(self.merge()[0]).get("params", {})

  @property
  def fp8_state(self) -> PyTree:
    return nnx_to_linen(self.merge()[0]).get(OVERWRITE_WITH_GRADIENT, {})

  @property
  def rule_state(self) -> PyTree:
    return nnx_to_linen(self.merge()[0]).get(UPDATED_BY_RULE, {})


def init_train_state(
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    tokens: jax.Array,
    rng: jax.Array,
) -> TrainState:
  """A new NNX `Decoder(config)` (sampled on `tokens`' shape) and optimizer.

  The decoder starts at the Linen decoder's initial weights for `rng`
  (`init_decoder`), so both front ends train from the same point.
  """

  def build(rng):
    model = init_decoder(config, rng, sample_shape=tokens.shape)
    return model, nnx.Optimizer(model, optimizer, wrt=nnx.Param)

  graphdef, _ = nnx.split(nnx.eval_shape(lambda: build(rng)))
  # One compiled program, not an eager op per optimizer leaf.
  state = jit_once(lambda r: nnx.split(build(r))[1])(rng)
  return TrainState(graphdef, state)


def make_train_step(grad_accum: int = 1):
  """A jittable `step(state, tokens, rng, mask=None) -> (state, metrics)` on
  a `TrainState`: the pure form of `train_step`, which also counts skipped
  steps (`TrainState.skipped_steps`, `metrics["skipped_steps"]`)."""

  def step(
      state: TrainState,
      tokens: jax.Array,
      rng: jax.Array,
      mask: jax.Array | None = None,
  ):
    model, optimizer = state.merge()
    metrics = train_step(model, optimizer, tokens, rng, grad_accum, mask)
    skipped_steps = state.skipped_steps + metrics["skipped"]
    return (
        state.replace(
            state=nnx.state((model, optimizer)), skipped_steps=skipped_steps
        ),
        {**metrics, "skipped_steps": skipped_steps},
    )

  return step


class NNXFrontend:
  """The NNX `Decoder` and train step as a
  `linen_moe.training.TrainingFrontend` (used by `linen-moe train` and
  `linen-moe matrix --frontend nnx`)."""

  @staticmethod
  def init(model_config, optimizer, tokens, rng) -> TrainState:
    return init_train_state(model_config, optimizer, tokens, rng)

  @staticmethod
  def make_step(model_config, optimizer, grad_accum=1):
    del model_config, optimizer  # both live in the TrainState
    return make_train_step(grad_accum)

  @staticmethod
  def params(state: TrainState) -> PyTree:
    return state.params

  @staticmethod
  def fp8_state(state: TrainState) -> PyTree:
    return state.fp8_state

  @staticmethod
  def rule_state(state: TrainState) -> PyTree:
    return state.rule_state

  checkpoint_tree = staticmethod(_checkpoint.tree_of)
  from_checkpoint_tree = staticmethod(_checkpoint.state_from)
