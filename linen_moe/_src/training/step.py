"""Training the reference Linen decoder, and the fp8 overwrite-with-gradient rule.

fp8 state (scales and amax histories) lives in the `_overwrite_with_gradient`
collection. Flax's fp8 ops return its *new value* as its "gradient": a train
step differentiates with respect to it and writes that value back; the
optimizer never sees it. `overwrite_with_gradient` and
`combine_overwrite_microbatches` are the one implementation of that rule, used
by the Linen train step here and by the NNX train step in `nnx_adapter`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
import dataclasses
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from linen_moe._src import sharding
from linen_moe._src.models.decoder import routed_bias_rule
from linen_moe._src.training import skip
from linen_moe._src.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.variables import UPDATED_BY_RULE
from linen_moe._src.variables import rng_dict

PyTree = Any


def overwrite_with_gradient(state: PyTree, grads: PyTree) -> PyTree:
  """New fp8 state: the "gradient" of each leaf *is* its new value.

  `state` and `grads` have the same structure; `state` is only used to check
  it, so a mismatch fails loudly instead of silently keeping old scales.
  """
  jax.tree.map(lambda s, g: None, state, grads)  # raises on a mismatch
  return grads


def combine_overwrite_microbatches(a: PyTree, b: PyTree) -> PyTree:
  """Combines fp8 "gradients" of two microbatches of one step.

  Each microbatch starts from the same fp8 state, so their new amax histories
  share the rolled-over past and differ only in the newest entry. The
  element-wise maximum keeps that past and the largest new amax, never a sum
  and never just the last microbatch's value (which would clip the larger
  activations of earlier microbatches). Scales, computed from the shared past,
  are equal, and the maximum keeps them.
  """
  return jax.tree.map(jnp.maximum, a, b)


def loss_weights(mask: jax.Array) -> jax.Array:
  """<float32>[B, S - 1] next-token weights of a <bool>[B, S] token mask.

  The target at position t + 1 counts where the mask is True at t and at
  t + 1 (both ids real), and the weights are scaled to average 1 over the
  batch, so that `cross_entropy`'s weighted mean is the mean over the real
  targets, also when gradient accumulation averages the means of
  microbatches that hold different numbers of them. All 0 when no target
  is real.
  """
  mask = jnp.asarray(mask, jnp.bool_)
  real = jnp.logical_and(mask[:, :-1], mask[:, 1:]).astype(jnp.float32)
  return real * (real.size / jnp.maximum(jnp.sum(real), 1.0))


@jax.custom_vjp
def _weighted_nll(
    logits: jax.Array, targets: jax.Array, weights: jax.Array
) -> jax.Array:
  """sum(weights * -log softmax(logits)[targets]): logits [B, S, V] (any
  float dtype, computed in float32), targets <int>[B, S], weights
  <float32>[B, S]; a float32 scalar."""
  nll, _ = _nll_fwd(logits, targets, weights)
  return nll


def _nll_fwd(logits, targets, weights):
  x = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(x, axis=-1)  # [B, S]
  picked = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(weights * (lse - picked)), (logits, lse, targets, weights)


def _nll_bwd(residuals, g):
  # d/dlogits = (softmax - one_hot(targets)) * weight, in one pass over the
  # logits: no log-softmax kept from the forward, no scatter of the one-hot.
  logits, lse, targets, weights = residuals
  probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
  vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, 2)
  one_hot = (vocab == targets[..., None]).astype(jnp.float32)
  dlogits = (probs - one_hot) * (g * weights)[..., None]
  return dlogits.astype(logits.dtype), None, None


_weighted_nll.defvjp(_nll_fwd, _nll_bwd)


def cross_entropy(
    logits: jax.Array, tokens: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
  """Mean next-token cross-entropy (nats) of logits [B, S, V] on tokens
  <int>[B, S]: position s predicts token s + 1, over the B * (S - 1)
  positions that have a next token, computed in float32. With `weights`
  <float32>[B, S - 1] (`loss_weights` of a mask) it is the mean of the
  weighted terms: the mean over the real targets.

  The targets are shifted, not the logits, so the gradient is written whole
  (no slice of the logits to pad back in the backward pass), and it is
  computed in one pass from the logits and their log-sum-exp.

  Raises:
    ValueError: for fewer than 2 tokens per row (no position has a next
      token).
  """
  b, s = tokens.shape
  if s < 2:
    raise ValueError(
        "cross_entropy needs at least 2 tokens per row; got tokens of shape "
        f"{tokens.shape}."
    )
  targets = jnp.concatenate(
      [tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1
  )  # [B, S]; the last position's target is a placeholder of weight 0
  if weights is None:
    has_next = jnp.arange(s) < s - 1
    weights = jnp.broadcast_to(has_next / (b * (s - 1)), (b, s))
  else:  # [B, S - 1] -> [B, S], the last position's placeholder weighs 0
    weights = jnp.concatenate(
        [weights / (b * (s - 1)), jnp.zeros((b, 1), weights.dtype)], axis=1
    )
  return _weighted_nll(logits, targets, weights.astype(jnp.float32))


def decoder_loss(
    logits: jax.Array,
    aux: dict[str, jax.Array],
    tokens: jax.Array,
    weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Training loss = next-token cross-entropy (weighted by `weights`, see
  `loss_weights`) + the summed load-balance and router z-losses (over every
  token: the router sees padding too). The metrics carry `expert_load`
  [L, E] for the routed-bias rule (averaged over microbatches like every
  metric)."""
  ce = cross_entropy(logits, tokens, weights)
  loss = ce + aux["load_balance_loss"] + aux["router_z_loss"]
  return loss, {
      "loss": loss,
      "cross_entropy": ce,
      "load_balance_loss": aux["load_balance_loss"],
      "router_z_loss": aux["router_z_loss"],
      "dropped_fraction": aux["dropped_fraction"],
      "expert_load": aux["expert_load"],
  }


def split_microbatches(tokens: PyTree, grad_accum: int) -> PyTree:
  """[B, ...] -> [grad_accum, B / grad_accum, ...], for an array or for
  each leaf of a tree of them (tokens and their loss weights)."""
  batch = jax.tree.leaves(tokens)[0].shape[0]
  if grad_accum < 1 or batch % grad_accum:
    raise ValueError(
        f"grad_accum={grad_accum} must be >= 1 and divide the batch size "
        f"{batch}."
    )
  return jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), tokens)


def accumulate_gradients(
    grad_fn: Callable, tokens: PyTree, grad_accum: int, rng: jax.Array
):
  """Runs `grad_fn(tokens, rng) -> ((param_grads, fp8_grads), metrics)` over
  microbatches: parameter gradients and metrics are averaged, fp8 "gradients"
  combined by `combine_overwrite_microbatches`. `tokens` is a [B, ...] array
  or a tree of them (e.g. tokens and `loss_weights`), split along B.
  """
  if grad_accum == 1:
    return grad_fn(tokens, rng)
  micro = split_microbatches(tokens, grad_accum)
  rngs = jax.random.split(rng, grad_accum)
  first = jax.tree.map(lambda x: x[0], micro)
  rest = jax.tree.map(lambda x: x[1:], micro)
  (p0, o0), m0 = grad_fn(first, rngs[0])

  def body(carry, xs):
    (p, o), m = carry
    (pi, oi), mi = grad_fn(*xs)
    return (
        (jax.tree.map(jnp.add, p, pi), combine_overwrite_microbatches(o, oi)),
        jax.tree.map(jnp.add, m, mi),
    ), None

  ((p, o), m), _ = jax.lax.scan(body, ((p0, o0), m0), (rest, rngs[1:]))
  scale = lambda t: jax.tree.map(lambda x: x / grad_accum, t)  # noqa: E731
  return (scale(p), o), scale(m)


def _zero_count() -> jax.Array:
  return jnp.zeros((), jnp.int32)


@flax.struct.dataclass
class TrainState:
  """Linen training state: params via optax, fp8 state by overwriting, routed
  biases by their rule after the step.

  Attributes:
    step: <int32>[] steps taken, skipped ones included.
    params: the decoder's `params` collection.
    fp8_state: its `_overwrite_with_gradient` collection (may be empty).
    opt_state: the optimizer's state.
    skipped_steps: <int32>[] steps skipped for a non-finite loss or gradient
      (`linen_moe.training.skip`).
    rule_state: its `updated_by_rule` collection, the routed biases (may be
      empty).
  """

  step: jax.Array
  params: PyTree
  fp8_state: PyTree
  opt_state: PyTree
  skipped_steps: jax.Array = dataclasses.field(default_factory=_zero_count)
  rule_state: PyTree = dataclasses.field(default_factory=dict)


def boxed_train_state(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    tokens: jax.Array,
    rng: jax.Array,
) -> TrainState:
  """The initial state with parameters (and their optimizer moments) still in
  their `nn.LogicallyPartitioned` boxes, for computing shardings."""
  variables = model.init(rng, tokens)
  params = variables["params"]
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      fp8_state=variables.get(OVERWRITE_WITH_GRADIENT, {}),
      opt_state=optimizer.init(params),
      rule_state=variables.get(UPDATED_BY_RULE, {}),
  )


def train_state_from_variables(
    variables: Mapping, optimizer: optax.GradientTransformation
) -> TrainState:
  """The initial state of a run that starts from given variables (e.g.
  `linen_moe.hf.load_checkpoint`'s): their params, fp8 state and routed
  biases, fresh optimizer moments, step 0."""
  variables = sharding.unbox(dict(variables))
  params = variables["params"]
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      fp8_state=variables.get(OVERWRITE_WITH_GRADIENT, {}),
      opt_state=optimizer.init(params),
      rule_state=variables.get(UPDATED_BY_RULE, {}),
  )


def init_train_state(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    tokens: jax.Array,
    rng: jax.Array,
) -> TrainState:
  return sharding.unbox(boxed_train_state(model, optimizer, tokens, rng))


def make_train_step(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    grad_accum: int = 1,
):
  """A jittable `step(state, tokens, rng, mask=None) -> (state, metrics)`
  for `model` (a `Decoder`): optimizer update of params, fp8 state
  overwritten, routed biases moved by their rule from the step's expert
  loads (`decoder.routed_bias_rule`). With `mask` (<bool>[B, S], True at
  real ids) the cross-entropy counts only real targets (`loss_weights`);
  without it, every position counts.

  A step whose loss or any gradient is non-finite leaves the state as it was
  but for `step` (advanced) and `skipped_steps` (counted); see
  `linen_moe.training.skip`. `metrics` holds the loss terms, `expert_load`,
  `skipped` (0 or 1) and `skipped_steps`.
  """
  rate = model.config.moe.routed_bias_update_rate

  def grad_fn(batch, rng, params, fp8_state, rule_state):
    tokens, weights = batch if isinstance(batch, tuple) else (batch, None)

    def loss_fn(params, fp8_state):
      variables = {"params": params}
      if fp8_state:
        variables[OVERWRITE_WITH_GRADIENT] = fp8_state
      if rule_state:
        variables[UPDATED_BY_RULE] = rule_state
      logits, aux = model.apply(variables, tokens, rngs=rng_dict(rng))
      return decoder_loss(logits, aux, tokens, weights)

    grads, metrics = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)(
        params, fp8_state
    )
    return grads, metrics

  def step(
      state: TrainState,
      tokens: jax.Array,
      rng: jax.Array,
      mask: jax.Array | None = None,
  ):
    fn = lambda t, r: grad_fn(  # noqa: E731
        t, r, state.params, state.fp8_state, state.rule_state
    )
    batch = tokens if mask is None else (tokens, loss_weights(mask))
    (param_grads, fp8_grads), metrics = accumulate_gradients(
        fn, batch, grad_accum, rng
    )

    def update(state: TrainState) -> TrainState:
      updates, opt_state = optimizer.update(
          param_grads, state.opt_state, state.params
      )
      rule_state = state.rule_state
      if rate > 0:
        rule_state = routed_bias_rule(
            rule_state, metrics["expert_load"], rate, model.config.stack_plan
        )
      return state.replace(
          params=optax.apply_updates(state.params, updates),
          fp8_state=overwrite_with_gradient(state.fp8_state, fp8_grads),
          opt_state=opt_state,
          rule_state=rule_state,
      )

    ok = skip.all_finite((metrics["loss"], param_grads, fp8_grads))
    skipped_steps, skip_metrics = skip.skip_metrics(ok, state.skipped_steps)
    new = skip.apply_if_finite(ok, update, state).replace(
        step=state.step + 1, skipped_steps=skipped_steps
    )
    return new, {**metrics, **skip_metrics}

  return step


def default_optimizer(
    learning_rate: float = 1e-2,
) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(learning_rate, weight_decay=0.0),
  )
