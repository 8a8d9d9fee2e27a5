"""Held-out loss of the reference Linen decoder: summed next-token
cross-entropy and the count of real targets, so that batches add up to the
exact per-token mean (a mean of batch means would weigh a batch of padding
like a full one)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from linen_moe._src.config.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.config.variables import UPDATED_BY_RULE
from linen_moe._src.models.decoder import output_kernel
from linen_moe._src.models.segments import same_segment_targets
from linen_moe._src.training.chunked_loss import chunked_cross_entropy


def variables_of(frontend: Any, state: Any) -> dict:
  """The Linen variables of a train state of any front end.

  Args:
    frontend: a `TrainingFrontend` (`LinenFrontend`, `nnx_adapter.NNXFrontend`).
    state: its train state (concrete or traced: works under `jit`).

  Returns:
    The dict of "params", and of the fp8 state and the routed biases when
    there are any (what `Decoder.apply` takes).
  """
  variables = {"params": frontend.params(state)}
  for collection, value in (
      (OVERWRITE_WITH_GRADIENT, frontend.fp8_state(state)),
      (UPDATED_BY_RULE, frontend.rule_state(state)),
  ):
    if value:
      variables[collection] = value
  return variables


def make_eval_step(model: nn.Module):
  """The held-out loss of `model`, as a jittable function.

  `eval_step(variables, tokens, mask=None, segment_ids=None,
  positions=None)` takes the decoder's variables (`variables_of` a train
  state), tokens <int32>[B, S] and a mask <bool>[B, S] True at real ids
  (None: all real; the target at t + 1 counts where t and t + 1 are both
  real), and for packed rows their segment ids and positions <int32>[B, S]
  (the decoder's; the target at t + 1 counts only where t and t + 1 are in
  one segment, not padding), and returns (<float32>[] the summed cross-entropy in
  nats of the counted targets, <float32>[] how many there are): the mean
  over many batches is the sum of the first over the sum of the second. It
  is deterministic (no router jitter). Like the train step's loss it
  applies the output head block by block of the vocabulary
  (`chunked_cross_entropy`), never holding [B, S, V] logits.

  Args:
    model: a `Decoder`.

  Returns:
    `eval_step`.
  """

  hidden_model = model.clone(hidden_only=True)  # the loss owns the head

  def eval_step(variables, tokens, mask=None, segment_ids=None, positions=None):
    hidden, _ = hidden_model.apply(variables, tokens, segment_ids, positions)
    b, s = tokens.shape
    weights = jnp.ones((b, s - 1), jnp.bool_)
    if mask is not None:
      mask = jnp.asarray(mask, jnp.bool_)
      weights = jnp.logical_and(mask[:, :-1], mask[:, 1:])
    if segment_ids is not None:
      weights &= same_segment_targets(segment_ids)
    weights = weights.astype(jnp.float32)
    # The head block by block of the vocabulary, as the train step's loss:
    # no [B, S, V] logits. It returns the mean over B * (S - 1) targets.
    mean = chunked_cross_entropy(
        hidden,
        output_kernel(model.config, variables["params"]),
        tokens,
        weights,
        softcap=model.config.final_logit_softcap,
    )
    return mean * (b * (s - 1)), jnp.sum(weights)  # [] and []

  return eval_step
