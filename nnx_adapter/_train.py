"""The NNX train step: optax on `nnx.Param`, fp8 state overwritten, routed
biases moved by their rule.

The rule for fp8 state is `linen_moe.training`'s, shared with the Linen train
step: differentiate with respect to `Fp8State` too, write its "gradient" back
as the new value (`overwrite_with_gradient`), and combine microbatches with
`combine_overwrite_microbatches` (inside `accumulate_gradients`). `RuleState`
(the routed biases) follows `linen_moe.training.routed_bias_rule` after the
optimizer update, from the step's expert loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from linen_moe import ModelConfig
from linen_moe import frontend
from linen_moe.frontend import jit_once
from nnx_adapter._adapter import Fp8State
from nnx_adapter._adapter import RuleState
from nnx_adapter._decoder import init_decoder
from nnx_adapter._train_state import TrainState

PyTree = Any


def _is_adapter(path, _value) -> bool:
  return frontend.is_adapter(tuple(str(k) for k in path))


def trained(config: ModelConfig | None) -> Any:
  """The `nnx` filter of the variables the optimizer trains: every
  `nnx.Param`, or with LoRA (`config.moe.lora`) the adapters alone (the
  base is frozen and never differentiated, as in the Linen step). A model
  without a `config` (a user's own decoder) trains every `nnx.Param`."""
  if config is None or config.moe.lora is None:
    return nnx.Param
  return nnx.All(nnx.Param, _is_adapter)


def accumulate_gradients(
    model: nnx.Module,
    loss_fn: Callable,
    batch: jax.Array,
    rng: jax.Array,
    grad_accum: int = 1,
):
  """Gradients of `loss_fn` for `nnx.Param` and `Fp8State`, over microbatches.

  As `linen_moe.training.accumulate_gradients`: parameter gradients and
  metrics averaged over the `grad_accum` microbatches, fp8 "gradients"
  combined by their element-wise maximum. `model` is left untouched: each
  microbatch differentiates a fresh copy of it.

  Args:
    model: the NNX module (a `Decoder`) whose `nnx.Param` and `Fp8State`
      variables are differentiated.
    loss_fn: `loss_fn(model, microbatch, rng) -> (loss, metrics)`, e.g.
      `decoder_loss`; loss a float32 scalar.
    batch: a [B, ...] array or a tree of them (e.g. tokens <int32>[B, S]
      and their loss weights), split along B.
    rng: a PRNG key, split into one key per microbatch.
    grad_accum: the number of microbatches, >= 1 and dividing B.

  Returns:
    `((param_grads, fp8_grads), metrics)`, the gradients as `nnx.State`
    trees of the `nnx.Param` and `Fp8State` variables, the metrics their
    mean over the microbatches.

  Raises:
    ValueError: if `grad_accum` is < 1 or does not divide B.
  """
  graphdef, params, fp8_state, rest = nnx.split(
      model, trained(getattr(model, "config", None)), Fp8State, ...
  )

  def grad_fn(microbatch, rng):
    def loss(params, fp8_state):
      # Fresh copies of the other variables (routed biases), at this trace's
      # level: `nnx.scan` refuses variables made outside it.
      merged = nnx.merge(graphdef, params, fp8_state, rest, copy=True)
      return loss_fn(merged, microbatch, rng)

    return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, fp8_state)

  return frontend.accumulate_gradients(grad_fn, batch, grad_accum, rng)


def apply_gradients(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    param_grads: nnx.State,
    fp8_grads: nnx.State,
) -> None:
  """Optimizer update of the params; fp8 state overwritten by its gradient.

  Both in place, on `model` and `optimizer`.

  Args:
    model: the NNX module the gradients belong to.
    optimizer: its `nnx.Optimizer` (over `nnx.Param`); `optimizer.step`
      advances by 1.
    param_grads: the `nnx.Param` gradients, an `nnx.State` like
      `nnx.state(model, nnx.Param)`.
    fp8_grads: the `Fp8State` "gradients", the new fp8 state, an
      `nnx.State` like `nnx.state(model, Fp8State)`.

  Raises:
    ValueError: if `fp8_grads` does not have the structure of the model's
      `Fp8State`.
  """
  optimizer.update(model, param_grads)
  fp8_state = nnx.state(model, Fp8State)
  nnx.update(model, frontend.overwrite_with_gradient(fp8_state, fp8_grads))


def apply_routed_bias_rule(
    model: nnx.Module, expert_load: jax.Array, rate: float
) -> None:
  """Moves every `routed_bias` of `model` (a `Decoder`) in place by the rule,
  from the step's expert loads <float32>[L, E]."""
  rule_state = nnx.state(model, RuleState)
  new = frontend.routed_bias_rule(
      nnx.to_pure_dict(rule_state), expert_load, rate, model.config.stack_plan
  )
  nnx.replace_by_pure_dict(rule_state, new)
  nnx.update(model, rule_state)


def decoder_loss(model: nnx.Module, batch, rng: jax.Array):
  """`linen_moe.training.decoder_loss` of the NNX decoder on `batch`.

  The head is applied chunk by chunk (`hidden_decoder_loss`): no [B, S, V]
  logits are held.

  Args:
    model: the NNX `Decoder`, called as `model(tokens, rng=rng,
      segment_ids=..., positions=...)`.
    batch: tokens <int32>[B, S]; `(tokens, weights)` with weights
      <float32>[B, S - 1] from `linen_moe.training.loss_weights`; or a dict
      of `linen_moe.training.train_batch` (`tokens`, optional `weights`,
      `segment_ids`, `positions`).
    rng: the PRNG key of the decoder's RNG streams (e.g. router jitter).

  Returns:
    `(loss, metrics)`, the float32 scalar loss (cross-entropy plus the
    auxiliary losses) and the metrics dict of
    `linen_moe.training.decoder_loss`.

  Raises:
    ValueError: (from `cross_entropy`) for fewer than 2 tokens per row.
  """
  if isinstance(batch, tuple):
    batch = dict(zip(("tokens", "weights"), batch, strict=True))
  elif not isinstance(batch, dict):
    batch = {"tokens": batch}
  tokens = batch["tokens"]
  hidden, aux = model(
      tokens,
      rng=rng,
      segment_ids=batch.get("segment_ids"),
      positions=batch.get("positions"),
      hidden_only=True,
  )
  return frontend.hidden_decoder_loss(
      hidden,
      model.output_kernel(),
      aux,
      tokens,
      batch.get("weights"),
      softcap=model.config.final_logit_softcap,
  )


def train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    tokens: jax.Array,
    rng: jax.Array,
    grad_accum: int = 1,
    mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """One training step of `model` (a `Decoder`) in place; returns metrics.

  Optimizer update of the params, fp8 state overwritten, routed biases
  moved by their rule (when `config.moe.routed_bias_update_rate > 0`).
  With `mask` the cross-entropy counts only real targets
  (`linen_moe.training.loss_weights`), as in the Linen step; with
  `segment_ids` (and `positions`) the rows are packed documents, as in the
  Linen step.

  A step whose loss or any gradient is non-finite leaves the model and the
  optimizer as they were, but for `optimizer.step` (advanced);
  `metrics["skipped"]` is then 1 (see `linen_moe.training.skip`).
  Use under `nnx.jit` with `grad_accum` static, e.g.
  `nnx.jit(train_step, static_argnames="grad_accum")`.

  Args:
    model: the NNX `Decoder`, updated in place.
    optimizer: its `nnx.Optimizer` (over `nnx.Param`), updated in place.
    tokens: <int32>[B, S] token ids.
    rng: the PRNG key of the decoder's RNG streams, split per microbatch.
    grad_accum: microbatches per step, >= 1 and dividing B.
    mask: optional <bool>[B, S], True at real ids; None: every target
      counts.
    segment_ids: optional <int32>[B, S] packed documents (0 = padding).
    positions: optional <int32>[B, S] positions (default: restarting at 0
      in each segment).

  Returns:
    The metrics of `linen_moe.training.decoder_loss` (averaged over the
    microbatches) plus `skipped`, <int32>[] 1 if the step was skipped.

  Raises:
    ValueError: if `grad_accum` is < 1 or does not divide B.
  """
  batch = frontend.train_batch(tokens, mask, segment_ids, positions)
  (param_grads, fp8_grads), metrics = accumulate_gradients(
      model, decoder_loss, batch, rng, grad_accum
  )
  ok = frontend.all_finite((metrics["loss"], param_grads, fp8_grads))
  rate = model.config.moe.routed_bias_update_rate
  graphdef, state = nnx.split((model, optimizer))

  def update(state: nnx.State) -> nnx.State:
    model, optimizer = nnx.merge(graphdef, state)
    apply_gradients(model, optimizer, param_grads, fp8_grads)
    if rate > 0:
      apply_routed_bias_rule(model, metrics["expert_load"], rate)
    return nnx.state((model, optimizer))

  # Skipped as the Linen step skips (`linen_moe.training.skip.
  # apply_if_finite`: the update inside a `lax.cond`), not by a select of
  # new against old: the same update in that other program rounds the
  # weights otherwise (an ulp after step 2 on XLA CPU), and fp8 scales
  # amplify it into a 6e-4 relative loss difference by step 12
  # (tests/training/test_nnx_fp8.py).
  steps = optimizer.step.get_value() + 1
  new = jax.lax.cond(ok, update, lambda s: s, state)
  nnx.update((model, optimizer), new)
  optimizer.step.set_value(steps)  # a skipped step counts too
  return {**metrics, "skipped": jnp.logical_not(ok).astype(jnp.int32)}


def init_train_state(
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    tokens: jax.Array,
    rng: jax.Array,
) -> TrainState:
  """A new NNX `Decoder(config)` (sampled on `tokens`' shape) and optimizer.

  The decoder starts at the Linen decoder's initial weights for `rng`
  (`init_decoder`), so both front ends train from the same point. The
  initialization is one compiled program.

  Args:
    config: the decoder's `ModelConfig`.
    optimizer: the optax transformation, wrapped in an `nnx.Optimizer` over
      `nnx.Param`.
    tokens: <int32>[B, S] a sample batch; only its shape matters.
    rng: the PRNG key of the (Linen) parameter init.

  Returns:
    A `TrainState` at step 0 with no skipped steps.
  """

  def build(rng):
    model = init_decoder(config, rng, sample_shape=tokens.shape)
    return model, nnx.Optimizer(model, optimizer, wrt=trained(config))

  graphdef, _ = nnx.split(nnx.eval_shape(lambda: build(rng)))
  # One compiled program, not an eager op per optimizer leaf; placed as a
  # restored state is, so a resumed step is the fresh step's program.
  state, skipped = jit_once(
      lambda r: (nnx.split(build(r))[1], jnp.zeros((), jnp.int32)),
      placed=True,
  )(rng)
  return TrainState(graphdef, state, skipped)


def make_train_step(grad_accum: int = 1):
  """A jittable train step on a `TrainState`: the pure form of `train_step`.

  The step, `step(state, tokens, rng, mask=None, segment_ids=None,
  positions=None) -> (state, metrics)`, takes tokens <int32>[B, S], an
  optional mask <bool>[B, S] and packed rows' segment ids and positions as
  `train_step` does, returns a new state (the given one is left as it is)
  and also counts skipped steps (`TrainState.skipped_steps`,
  `metrics["skipped_steps"]`).

  Args:
    grad_accum: microbatches per step, >= 1 and dividing the batch size;
      the step checks it when traced.

  Returns:
    The step function (not jitted; wrap it in `jax.jit`).
  """

  def step(
      state: TrainState,
      tokens: jax.Array,
      rng: jax.Array,
      mask: jax.Array | None = None,
      segment_ids: jax.Array | None = None,
      positions: jax.Array | None = None,
  ):
    model, optimizer = state.merge()
    metrics = train_step(
        model, optimizer, tokens, rng, grad_accum, mask, segment_ids, positions
    )
    skipped_steps = state.skipped_steps + metrics["skipped"]
    return (
        state.replace(
            state=nnx.state((model, optimizer)), skipped_steps=skipped_steps
        ),
        {**metrics, "skipped_steps": skipped_steps},
    )

  return step
