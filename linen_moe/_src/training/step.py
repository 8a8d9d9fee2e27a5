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
import numpy as np
import optax

from linen_moe._src.config.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.config.variables import UPDATED_BY_RULE
from linen_moe._src.config.variables import rng_dict
from linen_moe._src.lora import tree as lora_tree
from linen_moe._src.models.decoder import output_kernel
from linen_moe._src.models.decoder import routed_bias_rule
from linen_moe._src.models.segments import same_segment_targets
from linen_moe._src.parallel import sharding
from linen_moe._src.training import skip
from linen_moe._src.training.chunked_loss import chunked_cross_entropy

PyTree = Any


def overwrite_with_gradient(state: PyTree, grads: PyTree) -> PyTree:
  """New fp8 state: the "gradient" of each leaf *is* its new value.

  `state` and `grads` have the same structure; `state` is only used to check
  it, so a mismatch fails loudly instead of silently keeping old scales.

  Args:
    state: the current fp8 state (the `_overwrite_with_gradient` collection:
      scales and amax histories).
    grads: the "gradients" of `state` from `jax.grad`, the same tree.

  Returns:
    The new fp8 state, `grads` itself.

  Raises:
    ValueError: (from `jax.tree.map`) if `state` and `grads` differ in
      structure.
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

  Args:
    a: the fp8 "gradients" (new fp8 state) of one microbatch.
    b: those of another microbatch of the same step, the same tree.

  Returns:
    The element-wise maximum of `a` and `b`, the same tree.
  """
  return jax.tree.map(jnp.maximum, a, b)


def loss_weights(
    mask: jax.Array | None, segment_ids: jax.Array | None = None
) -> jax.Array:
  """<float32>[B, S - 1] next-token weights of a <bool>[B, S] token mask.

  The target at position t + 1 counts where the mask is True at t and at
  t + 1 (both ids real) and, with `segment_ids`, where t and t + 1 are in
  the same segment and not padding (the last token of a packed document
  does not predict the next document's first). The weights are scaled to
  average 1 over the batch, so that `cross_entropy`'s weighted mean is the
  mean over the real targets, also when gradient accumulation averages the
  means of microbatches that hold different numbers of them. All 0 when
  no target is real.

  Args:
    mask: <bool>[B, S] True at real ids (any dtype, cast to bool); None:
      every id is real (then `segment_ids` must be given).
    segment_ids: optional <int>[B, S] packed documents, 0 = padding
      (`linen_moe.models.same_segment_targets`).

  Returns:
    <float32>[B, S - 1], weight of the target at position t + 1 (the
    prediction of position t): 0 or `B * (S - 1) / (number of real targets)`.
  """
  if mask is None:
    mask = jnp.ones(jnp.shape(segment_ids), jnp.bool_)
  mask = jnp.asarray(mask, jnp.bool_)
  real = jnp.logical_and(mask[:, :-1], mask[:, 1:])
  if segment_ids is not None:
    real &= same_segment_targets(segment_ids)
  real = real.astype(jnp.float32)
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
  """Mean next-token cross-entropy (nats) of logits on tokens, in float32.

  Position s predicts token s + 1, over the B * (S - 1) positions that have
  a next token. With `weights` (`loss_weights` of a mask) it is the mean of
  the weighted terms: the mean over the real targets.

  The targets are shifted, not the logits, so the gradient is written whole
  (no slice of the logits to pad back in the backward pass), and it is
  computed in one pass from the logits and their log-sum-exp.

  Args:
    logits: [B, S, V] next-token logits (any float dtype; the gradient comes
      back in it).
    tokens: <int>[B, S] token ids; `tokens[:, 1:]` are the targets.
    weights: optional <float32>[B, S - 1] weight of each target (see
      `loss_weights`); None weighs every target 1.

  Returns:
    The float32 scalar `sum(weights * nll) / (B * (S - 1))`, in nats.

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
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The decoder's training loss and its metrics.

  Loss = next-token cross-entropy (weighted by `weights`, see
  `loss_weights`) + the summed load-balance and router z-losses (over every
  token: the router sees padding too). The metrics carry `expert_load`
  [L, E] for the routed-bias rule (averaged over microbatches like every
  metric).

  Args:
    logits: [B, S, V] the decoder's logits.
    aux: the decoder's auxiliary dict: scalars `load_balance_loss` and
      `router_z_loss` (already weighted, summed over layers),
      `dropped_fraction`, and `expert_load` <float32>[L, E].
    tokens: <int>[B, S] the input ids (also the shifted targets).
    weights: optional <float32>[B, S - 1] target weights (`loss_weights` of
      a mask); None weighs every target 1.
    segment_ids: optional <int>[B, S] packed documents (0 = padding): a
      target that crosses into the next segment, or lies in padding, never
      counts. Without `weights`, the weights are `loss_weights(None,
      segment_ids)` (the mean over the counted targets); with them, they
      are zeroed there and not rescaled (`loss_weights(mask, segment_ids)`
      has them zero already, scaled over the whole batch).

  Returns:
    `(loss, metrics)`, the float32 scalar loss and a dict of `loss`,
    `cross_entropy`, `load_balance_loss`, `router_z_loss`,
    `dropped_fraction` (scalars) and `expert_load` [L, E].

  Raises:
    ValueError: (from `cross_entropy`) for fewer than 2 tokens per row.
  """
  weights = _segment_weights(weights, segment_ids)
  return _with_aux(cross_entropy(logits, tokens, weights), aux)


def _segment_weights(weights, segment_ids):
  if segment_ids is None:
    return weights
  if weights is None:
    return loss_weights(None, segment_ids)
  return weights * same_segment_targets(segment_ids)


def hidden_decoder_loss(
    hidden: jax.Array,
    kernel: jax.Array,
    aux: dict[str, jax.Array],
    tokens: jax.Array,
    weights: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    softcap: float = 0.0,
    chunk_size: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`decoder_loss` from the final hidden state: the head applied chunk by
  chunk (`chunked_cross_entropy`), so no [B, S, V] logits are held.

  The numbers and gradients are `decoder_loss`'s of the logits
  `hidden @ kernel` (soft-capped) to float rounding.

  Args:
    hidden: [B, S, M] the decoder's final normalized hidden state
      (`Decoder(..., hidden_only=True)`).
    kernel: [M, V] its output head (`output_kernel(config, params)`).
    aux: the decoder's auxiliary dict (see `decoder_loss`).
    tokens: <int>[B, S] the input ids (also the shifted targets).
    weights: optional <float32>[B, S - 1] target weights.
    segment_ids: optional <int>[B, S] packed documents (see
      `decoder_loss`).
    softcap: `ModelConfig.final_logit_softcap` (0: none).
    chunk_size: vocabulary entries per block (None: about 128 MiB of
      float32 logits a block).

  Returns:
    `(loss, metrics)` as `decoder_loss`.

  Raises:
    ValueError: for fewer than 2 tokens per row.
  """
  weights = _segment_weights(weights, segment_ids)
  ce = chunked_cross_entropy(
      hidden, kernel, tokens, weights, softcap=softcap, chunk_size=chunk_size
  )
  return _with_aux(ce, aux)


def _with_aux(ce, aux):
  loss = ce + aux["load_balance_loss"] + aux["router_z_loss"]
  return loss, {
      "loss": loss,
      "cross_entropy": ce,
      "load_balance_loss": aux["load_balance_loss"],
      "router_z_loss": aux["router_z_loss"],
      "dropped_fraction": aux["dropped_fraction"],
      "expert_load": aux["expert_load"],
  }


def train_batch(
    tokens: jax.Array,
    mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """What a train step's microbatches are split from: a dict of `tokens`,
  and `weights` (`loss_weights(mask, segment_ids)`, scaled over the whole
  batch), `segment_ids` and `positions` where given.

  Args:
    tokens: <int32>[B, S] ids.
    mask: optional <bool>[B, S], True at real ids.
    segment_ids: optional <int32>[B, S] packed documents (0 = padding).
    positions: optional <int32>[B, S] positions.

  Returns:
    The dict; each value has B rows.
  """
  batch = {"tokens": tokens}
  if mask is not None or segment_ids is not None:
    batch["weights"] = loss_weights(mask, segment_ids)
  if segment_ids is not None:
    batch["segment_ids"] = segment_ids
  if positions is not None:
    batch["positions"] = positions
  return batch


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
  """Runs `grad_fn` over microbatches and combines what it returns.

  Parameter gradients and metrics are averaged, fp8 "gradients" combined by
  `combine_overwrite_microbatches`. Every microbatch runs in one `lax.scan`
  (one copy of `grad_fn` in the program; it is also traced abstractly, for
  the shapes of the sums); `grad_accum=1` calls `grad_fn` once, as is.

  Args:
    grad_fn: `grad_fn(tokens, rng) -> ((param_grads, fp8_grads), metrics)`
      for one microbatch.
    tokens: a [B, ...] array or a tree of them (e.g. tokens and
      `loss_weights`), split along B into `grad_accum` microbatches of
      B / grad_accum rows.
    grad_accum: the number of microbatches, >= 1 and dividing B.
    rng: a PRNG key, split into one key per microbatch (passed whole when
      `grad_accum` is 1).

  Returns:
    `((param_grads, fp8_grads), metrics)` as `grad_fn` returns them, with
    param_grads and metrics the mean over the microbatches and fp8_grads
    their element-wise maximum.

  Raises:
    ValueError: (from `split_microbatches`) if `grad_accum` is < 1 or does
      not divide B.
  """
  if grad_accum == 1:
    return grad_fn(tokens, rng)
  micro = split_microbatches(tokens, grad_accum)
  rngs = jax.random.split(rng, grad_accum)
  # The sums start at their identities (0; the lowest value for the fp8
  # maximum), so every microbatch runs in the scan: the program holds one
  # copy of the model's forward and backward, not two (a first microbatch
  # peeled off the scan made tiny_mixtral's fp8 step with two microbatches
  # 18,237 lines of optimised HLO, not 11,154: bench_cell_compile.py).
  # 0 + x and max(lowest, x) are x; the sums equal the peeled ones to float
  # rounding.
  (p_shape, o_shape), m_shape = jax.eval_shape(
      grad_fn, jax.tree.map(lambda x: x[0], micro), rngs[0]
  )
  zeros = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
  init = ((zeros(p_shape), jax.tree.map(_lowest, o_shape)), zeros(m_shape))

  def body(carry, xs):
    (p, o), m = carry
    (pi, oi), mi = grad_fn(*xs)
    return (
        (jax.tree.map(jnp.add, p, pi), combine_overwrite_microbatches(o, oi)),
        jax.tree.map(jnp.add, m, mi),
    ), None

  ((p, o), m), _ = jax.lax.scan(body, init, (micro, rngs))
  scale = lambda t: jax.tree.map(lambda x: x / grad_accum, t)  # noqa: E731
  return (scale(p), o), scale(m)


def _lowest(shape: jax.ShapeDtypeStruct) -> jax.Array:
  """The identity of `jnp.maximum` over `shape`'s dtype: -inf, or the lowest
  finite value where the dtype has no infinity (e.g. float8_e4m3fn)."""
  dtype = np.dtype(shape.dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    value = np.array(-np.inf).astype(dtype)
    if not np.isneginf(value):
      value = np.array(jnp.finfo(dtype).min, dtype)
  elif jnp.issubdtype(dtype, jnp.integer):
    value = np.array(jnp.iinfo(dtype).min, dtype)
  else:
    value = np.zeros((), dtype)  # bool: False
  return jnp.full(shape.shape, value, dtype)


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


def trainable_params(params: PyTree) -> PyTree:
  """The part of `params` the optimizer trains: the adapters alone when
  there are any (LoRA: `linen_moe.lora`; the base is frozen), else all."""
  if lora_tree.has_adapters(params):
    return lora_tree.split(params)[0]
  return params


def boxed_train_state(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    tokens: jax.Array,
    rng: jax.Array,
) -> TrainState:
  """The initial state with parameters (and their optimizer moments) still in
  their `nn.LogicallyPartitioned` boxes, for computing shardings."""
  return _state_at_step_0(model.init(rng, tokens), optimizer)


def train_state_from_variables(
    variables: Mapping, optimizer: optax.GradientTransformation
) -> TrainState:
  """The initial state of a run that starts from given variables.

  For example `linen_moe.hf.load_checkpoint`'s: their params, fp8 state and
  routed biases, fresh optimizer moments, step 0.

  Args:
    variables: the decoder's variables: a `params` collection, optionally
      `_overwrite_with_gradient` and `updated_by_rule`; boxed
      (`nn.LogicallyPartitioned`) or not.
    optimizer: the optax optimizer whose state is initialized from the
      params.

  Returns:
    An unboxed `TrainState` at step 0 with no skipped steps.

  Raises:
    KeyError: if `variables` has no `params` collection.
  """
  return _state_at_step_0(sharding.unbox(dict(variables)), optimizer)


def _state_at_step_0(
    variables: Mapping, optimizer: optax.GradientTransformation
) -> TrainState:
  params = variables["params"]
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      fp8_state=variables.get(OVERWRITE_WITH_GRADIENT, {}),
      opt_state=optimizer.init(trainable_params(params)),
      rule_state=variables.get(UPDATED_BY_RULE, {}),
  )


def init_train_state(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    tokens: jax.Array,
    rng: jax.Array,
) -> TrainState:
  """Initializes `model` and the optimizer: the state at step 0.

  Args:
    model: the decoder (a `Decoder`), initialized with `model.init(rng,
      tokens)`.
    optimizer: the optax optimizer, initialized from the params.
    tokens: <int32>[B, S] example ids; only their shape and dtype matter.
    rng: the PRNG key of the parameter initialization.

  Returns:
    A `TrainState` at step 0 with no skipped steps, its params, fp8 state
    and routed biases unboxed (plain arrays, no `nn.LogicallyPartitioned`).
  """
  return sharding.unbox(boxed_train_state(model, optimizer, tokens, rng))


def make_train_step(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    grad_accum: int = 1,
):
  """A jittable train step for `model` (a `Decoder`).

  The step, `step(state, tokens, rng, mask=None, segment_ids=None,
  positions=None) -> (state, metrics)`: optimizer update of params, fp8
  state overwritten, routed biases moved by their rule from the step's
  expert loads (`decoder.routed_bias_rule`). `tokens` are <int32>[B, S]
  ids; with `mask` (<bool>[B, S], True at real ids) the cross-entropy
  counts only real targets (`loss_weights`); without it, every position
  counts. `segment_ids` and `positions` (<int32>[B, S], packed documents)
  go to the decoder, and the loss skips the targets that cross from one
  segment into the next (`loss_weights(mask, segment_ids)`, over the whole
  batch). `rng` feeds the model's RNG streams.

  A step whose loss or any gradient is non-finite leaves the state as it was
  but for `step` (advanced) and `skipped_steps` (counted); see
  `linen_moe.training.skip`. `metrics` holds the loss terms, `expert_load`,
  `skipped` (0 or 1) and `skipped_steps`.

  Args:
    model: the decoder; its `config.moe.routed_bias_update_rate` (0: no
      rule) and `config.stack_plan` drive the routed-bias rule.
    optimizer: the optax optimizer the state was initialized with.
    grad_accum: microbatches per step (`accumulate_gradients`); must divide
      the batch size B, which the step checks when traced.

  Returns:
    The step function (not jitted; wrap it in `jax.jit`).
  """
  rate = model.config.moe.routed_bias_update_rate
  hidden_model = model.clone(hidden_only=True)  # the loss owns the head
  # LoRA: only the adapters are differentiated and optimised; the frozen
  # base enters the loss as a constant, so the step has no weight-gradient
  # contraction of a base kernel (and a serving base's int8 / fp8 kernels
  # are never asked for a gradient).
  lora = model.config.moe.lora is not None

  def grad_fn(batch, rng, params, fp8_state, rule_state):
    frozen = None
    if lora:
      params, frozen = lora_tree.split(params)

    def loss_fn(params, fp8_state):
      if frozen is not None:
        params = lora_tree.join(params, frozen)
      variables = {"params": params}
      if fp8_state:
        variables[OVERWRITE_WITH_GRADIENT] = fp8_state
      if rule_state:
        variables[UPDATED_BY_RULE] = rule_state
      hidden, aux = hidden_model.apply(
          variables,
          batch["tokens"],
          batch.get("segment_ids"),
          batch.get("positions"),
          rngs=rng_dict(rng),
      )
      return hidden_decoder_loss(
          hidden,
          output_kernel(model.config, params),
          aux,
          batch["tokens"],
          batch.get("weights"),
          softcap=model.config.final_logit_softcap,
      )

    grads, metrics = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)(
        params, fp8_state
    )
    return grads, metrics

  def step(
      state: TrainState,
      tokens: jax.Array,
      rng: jax.Array,
      mask: jax.Array | None = None,
      segment_ids: jax.Array | None = None,
      positions: jax.Array | None = None,
  ):
    fn = lambda t, r: grad_fn(  # noqa: E731
        t, r, state.params, state.fp8_state, state.rule_state
    )
    batch = train_batch(tokens, mask, segment_ids, positions)
    (param_grads, fp8_grads), metrics = accumulate_gradients(
        fn, batch, grad_accum, rng
    )

    def update(state: TrainState) -> TrainState:
      trained, frozen = state.params, None
      if lora:
        trained, frozen = lora_tree.split(state.params)
      updates, opt_state = optimizer.update(
          param_grads, state.opt_state, trained
      )
      params = optax.apply_updates(trained, updates)
      if frozen is not None:
        params = lora_tree.join(params, frozen)
      rule_state = state.rule_state
      if rate > 0:
        rule_state = routed_bias_rule(
            rule_state, metrics["expert_load"], rate, model.config.stack_plan
        )
      return state.replace(
          params=params,
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
