"""The reference Linen decoder: embedding, N blocks, final norm, logits.

Each released family is a set of `ModelConfig` fields: grouped-query
attention, the head width, q/k norms, a sliding window and the RoPE base
(`attention.py`, `rotary.py`), dense layers among MoE layers (`blocks.py`),
embedding scaling and a tied or separate output head (here). The layer
stack, scanned or unrolled, is laid out as `config.stack_plan` says
(`linen_moe._src.models.layer_stack`).

Shapes: B batch, S sequence, M emb_dim, N heads, D head_dim, V vocab,
L num_layers.
"""

from __future__ import annotations

import functools

from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.config import stack_plan
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.variables import CACHE
from linen_moe._src.layer import routing
from linen_moe._src.layer.jit_init import JitInit
from linen_moe._src.models import layer_stack
from linen_moe._src.models.attention import CausalSelfAttention  # noqa: F401
from linen_moe._src.models.attention import Projection
from linen_moe._src.models.blocks import DecoderBlock
from linen_moe._src.models.blocks import per_layer_aux
from linen_moe._src.models.blocks import stack_body
from linen_moe._src.models.norms import RMSNorm
from linen_moe._src.models.norms import rms_normalize  # noqa: F401
from linen_moe._src.models.remat import remat_block
from linen_moe._src.models.rotary import apply_rope  # noqa: F401
from linen_moe._src.models.scan import resolved_unroll
from linen_moe._src.models.scan import scan_blocks
from linen_moe._src.models.segments import resolve_positions
from linen_moe._src.models.segments import validate_segments
from linen_moe._src.models.tokens import TokenEmbed
from linen_moe._src.models.tokens import validate_tokens_if_concrete
from linen_moe._src.parallel import sharding


def layer_aux(
    per_layer: dict[str, jax.Array], config: ModelConfig | None = None
) -> dict[str, jax.Array]:
  """The decoder's `aux` from its blocks' aux.

  Args:
    per_layer: the blocks' aux fields stacked on a leading layer axis [L, ...]
      (`per_layer_aux`).
    config: the decoder's config (which layers are MoE); None: all are.

  Returns:
    `load_balance_loss` and `router_z_loss` summed over layers (both join
    the training loss), `dropped_fraction` their mean over the MoE layers,
    and `expert_load` <float32>[L, E], each layer's share of routed
    assignments per expert (zeros for a dense layer).
  """
  dropped = per_layer["dropped_fraction"]
  if config is not None and config.dense_layers:
    moe = [k == "moe" for k in config.layer_kinds]
    dropped = dropped[jnp.asarray([i for i, m in enumerate(moe) if m])]
  return {
      "load_balance_loss": jnp.sum(per_layer["load_balance_loss"]),
      "router_z_loss": jnp.sum(per_layer["router_z_loss"]),
      "dropped_fraction": jnp.mean(dropped),
      "expert_load": per_layer["expert_load"],
  }


def routed_bias_rule(
    rule_state: dict,
    expert_load: jax.Array,
    rate: float,
    plan: stack_plan.StackPlan | None = None,
):
  """The `updated_by_rule` variables of a decoder after one step.

  Every layer's `routed_bias` moves by `routing.routed_bias_update` from its
  row of `expert_load` (stacked: `layers/.../routed_bias` [R, E], the rows
  of the stacked layers; unrolled: `layers_{i}/.../routed_bias` [E]).

  Args:
    rule_state: the decoder's `updated_by_rule` collection.
    expert_load: <float32>[L, E] the step's `aux["expert_load"]`.
    rate: the bias update rate.
    plan: the decoder's `config.stack_plan` (default: every layer in one
      stack, or unrolled).

  Returns:
    The new collection; leaves other than `routed_bias` are kept.
  """
  if plan is None:
    plan = stack_plan.StackPlan.uniform(expert_load.shape[0])
  flat = traverse_util.flatten_dict(rule_state)
  for path, value in flat.items():
    if path[-1] != "routed_bias":
      continue
    rows = layer_stack.layer_rows(path, plan)
    load = expert_load[jnp.asarray(rows)]
    if value.ndim == 1:
      load = load[0]
    flat[path] = routing.routed_bias_update(value, load, rate)
  return traverse_util.unflatten_dict(flat)


def embedding(cfg: ModelConfig, **kwargs) -> TokenEmbed:
  """The token embedding, `embedding` [V, M] named ("vocab", "embed").

  Rows of unit norm keep the tied logits O(1) at init; the decoders scale
  the input back up by sqrt(emb_dim) so the residual stream has unit RMS.
  An id outside [0, V) embeds as NaN (`linen_moe.tokens`).

  Args:
    cfg: the decoder's config.
    **kwargs: other fields of the Linen module (e.g. `name`).

  Returns:
    The (unbound) Linen embedding module.
  """
  return TokenEmbed(
      cfg.vocab_size,
      cfg.moe.emb_dim,
      embedding_init=_embedding_init(cfg.moe.emb_dim),
      param_dtype=cfg.moe.param_dtype,
      **kwargs,
  )


@functools.cache
def _embedding_init(emb_dim: int):
  # One initializer object per width: a module holding it compares equal to
  # another built from the same config (an NNX graph holds the module as a
  # static field, so a fresh closure each time would make every state's
  # tree another one, and every jitted step over it another program).
  return nn.with_logical_partitioning(
      nn.initializers.normal(emb_dim**-0.5), ("vocab", "embed")
  )


def scale_embeddings(x: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Embedded tokens as the first layer's input.

  Args:
    x: [B, S, M] the embedding's output.
    cfg: the decoder's config.

  Returns:
    `x` in the compute dtype, scaled by sqrt(emb_dim) when
    `cfg.scale_embeddings` (the unit-norm embedding rows then give the
    residual stream unit RMS).
  """
  if cfg.scale_embeddings:
    x = x * cfg.moe.emb_dim**0.5
  return x.astype(cfg.moe.dtype)


def output_head(cfg: ModelConfig, **kwargs) -> Projection:
  """The untied head: `logits/kernel` [M, V] ("embed", "vocab"), in
  float32 as the tied one (`TokenEmbed.attend`).

  Args:
    cfg: the decoder's config.
    **kwargs: other fields of the Linen module (e.g. `name`).

  Returns:
    The (unbound) Linen projection module.
  """
  return Projection(
      "BSM,MV->BSV",
      (cfg.moe.emb_dim, cfg.vocab_size),
      ("embed", "vocab"),
      (0,),
      jnp.float32,
      cfg.moe.param_dtype,
      **kwargs,
  )


def logits_of(cfg: ModelConfig, embed, head, x: jax.Array) -> jax.Array:
  """Logits of the final hidden state.

  Args:
    cfg: the decoder's config.
    embed: the (bound) embedding module; its `attend` when tied.
    head: the (bound) output head, or None when tied.
    x: [B, S, M] the final normalized hidden state.

  Returns:
    <float32>[B, S, V], soft-capped with `final_logit_softcap`.
  """
  x = x.astype(jnp.float32)
  logits = embed.attend(x) if cfg.tie_embeddings else head(x)
  if cfg.final_logit_softcap:  # Gemma-4: c * tanh(logits / c)
    cap = cfg.final_logit_softcap
    logits = jnp.tanh(logits / cap) * cap
  return sharding.constrain(logits, sharding.BSM[:2] + ("activation_vocab",))


def output_kernel(cfg: ModelConfig, params: dict) -> jax.Array:
  """The output head as one matrix [M, V], from a decoder's params.

  Args:
    cfg: the decoder's config.
    params: its `params` collection (unboxed).

  Returns:
    `embed/embedding` transposed when the head is tied, else
    `logits/kernel`: what `linen_moe.training.chunked_cross_entropy`
    multiplies the hidden state by (logits = hidden @ kernel, in float32).
  """
  if cfg.tie_embeddings:
    return params["embed"]["embedding"].T
  return params["logits"]["kernel"]


class Decoder(JitInit, nn.Module):
  """The reference decoder: tokens <int32>[B, S] -> (logits [B, S, V], aux).

  `aux` is the dict of `layer_aux`: `load_balance_loss` and `router_z_loss`
  (summed over layers), `dropped_fraction` (mean over the MoE layers) and
  `expert_load` [L, E]. With `config.scan_layers` the blocks' variables are
  stacked on a leading layer axis under `layers/`; unrolled, they live under
  `layers_0/`, `layers_1/`, ...

  With `decode`, each attention keeps a KV cache and the decoder the number
  of tokens already fed (`cache/index`) and each row's left padding
  (`cache/pad` <int32>[B], zeros unless set): each call appends its tokens
  at the next positions, index - pad onwards (prefill with the prompt, then
  one token at a time; see `linen_moe.decoding`); a negative position is
  padding, never attended to. `init` on a [B, max_len] sample sizes the
  cache.

  Example usage:
    cfg = load_model_config("tiny_mixtral")
    model = Decoder(cfg)
    variables = model.init(jax.random.key(0), tokens)
    logits, aux = model.apply(variables, tokens)

  Attributes:
    config: the `ModelConfig`.
    decode: keep and extend a KV cache (the `cache` collection).
    last_logits_only: logits of the last position only, [B, 1, V]: what
      decoding needs, so that a prompt of S tokens costs one row of the
      output head, not S (and no [B, S, V] buffer).
    hidden_only: return the final normalized hidden state [B, S, M] in
      place of the logits, and apply no head: the loss owns the head
      (`linen_moe.training.chunked_cross_entropy` with `output_kernel`),
      so no [B, S, V] logits are ever held.
  """

  config: ModelConfig
  decode: bool = False
  last_logits_only: bool = False
  hidden_only: bool = False

  def _start(self, tokens: jax.Array):
    """The first position of `tokens`: 0, or after the cached ones less
    each row's left padding ([B, 1] when decoding; negative: padding)."""
    start = 0
    if self.decode:
      initialized = self.has_variable(CACHE, "index")
      index = self.variable(CACHE, "index", jnp.zeros, (), jnp.int32)
      pad = self.variable(
          CACHE, "pad", jnp.zeros, (tokens.shape[0],), jnp.int32
      )
      if initialized:
        start = index.value - pad.value[:, None]
        index.value = index.value + tokens.shape[1]
    return start

  @nn.compact
  def __call__(
      self,
      tokens: jax.Array,
      segment_ids: jax.Array | None = None,
      positions: jax.Array | None = None,
  ):
    """Runs the decoder on a batch of token ids.

    Args:
      tokens: <int>[B, S] ids in [0, vocab_size); an id outside it embeds as
        NaN when traced (`linen_moe.tokens`).
      segment_ids: optional <int>[B, S] packed documents: 1, 2, ... the
        documents of a row (each a contiguous run), 0 padding. A token
        attends only to its own segment. None: one document per row.
      positions: optional <int>[B, S] positions >= 0 (rotary, causal
        mask). None: restarting at 0 in each segment
        (`linen_moe.models.segment_positions`), or 0 .. S - 1 without
        segments.

    Returns:
      A pair (logits <float32>[B, S, V], aux), `aux` as in the class
      docstring; logits [B, 1, V] with `last_logits_only`; with
      `hidden_only` (when not initializing) the final normalized hidden
      state [B, S, M] in place of the logits.

    Raises:
      TypeError: if `tokens` is not an integer array of rank 2.
      ValueError: if a concrete id is outside [0, vocab_size); if
        `segment_ids` or `positions` is not an integer array of the tokens'
        shape or holds a negative value, or is given with `decode`.
    """
    cfg = self.config
    tokens = validate_tokens_if_concrete(tokens, cfg.vocab_size)
    validate_segments(np.shape(tokens), segment_ids, positions, self.decode)
    tokens = jnp.asarray(tokens)
    embed = embedding(cfg, name="embed")
    x = scale_embeddings(embed(tokens), cfg)
    x = sharding.constrain(x, sharding.BSM)
    positions = resolve_positions(
        tokens.shape, segment_ids, positions, self._start(tokens)
    )
    plan, kinds = cfg.stack_plan, cfg.block_kinds
    block_class = remat_block(DecoderBlock, cfg, self.decode)

    def unrolled(x, layers):
      outs = []
      for i in layers:
        name = stack_plan.layer_name(i)
        block = block_class(cfg, self.decode, *kinds[i], name=name)
        x, out = block(x, positions, segment_ids)
        outs.append(out)
      return x, outs

    x, before = unrolled(x, plan.before)
    stacked = None
    if plan.scanned:
      body, fields = stack_body(cfg, self.decode)
      unroll = resolved_unroll(cfg.scan_unroll, plan.repeats)
      scanned = scan_blocks(
          remat_block(body, cfg, self.decode),
          plan.repeats,
          in_axes=(nn.broadcast, nn.broadcast),
          unroll=unroll,
      )
      x, stacked = scanned(**fields, name=stack_plan.STACK)(
          x, positions, segment_ids
      )
    x, after = unrolled(x, plan.after)
    per_layer = per_layer_aux(cfg, before, stacked, after)
    if self.last_logits_only:
      x = x[:, -1:]
    x = RMSNorm(cfg.norm_eps, name="final_norm")(x)
    if self.hidden_only and not self.is_initializing():
      return x, layer_aux(per_layer, cfg)
    head = None if cfg.tie_embeddings else output_head(cfg, name="logits")
    logits = logits_of(cfg, embed, head, x)  # [B, S, V]
    return logits, layer_aux(per_layer, cfg)


def scanned_to_unrolled(
    variables: dict, num_layers: int | stack_plan.StackPlan
) -> dict:
  """Converts scanned decoder variables to the unrolled layout.

  The stack (`layers/`, stacked on axis 0) becomes `layers_0/`,
  `layers_1/`, ..., in every collection.

  Args:
    variables: the variables (or any tree holding the layer stack).
    num_layers: a count L (one stack of every layer, [L, ...]) or the
      decoder's `config.stack_plan`: the plan the stack was built with.

  Returns:
    A new tree with every layer unrolled; other subtrees as they were.

  Raises:
    ValueError: if `num_layers` is not a count >= 0, the tree holds a
      stack the plan has none of, or a stack whose leading axis is not the
      plan's number of scanned layers.
  """
  return layer_stack.to_unrolled(variables, _plan(num_layers))


def unrolled_to_scanned(
    variables: dict, num_layers: int | stack_plan.StackPlan
) -> dict:
  """The inverse of `scanned_to_unrolled`.

  Args:
    variables: unrolled variables (`layers_{i}/` subtrees).
    num_layers: a count L (every layer into one stack [L, ...]) or the
      decoder's `config.stack_plan`.

  Returns:
    A new tree with the plan's layers stacked under `layers/`.

  Raises:
    ValueError: if `num_layers` is not a count >= 0, or only some of the
      layers a stack needs are present.
  """
  return layer_stack.to_scanned(variables, _plan(num_layers))


def _plan(num_layers: int | stack_plan.StackPlan) -> stack_plan.StackPlan:
  if isinstance(num_layers, stack_plan.StackPlan):
    return num_layers
  return stack_plan.StackPlan.uniform(num_layers)
