"""The decoder's blocks: attention then an MLP, each a pre-norm residual.

A block's MLP is the MoE layer (kind "moe") or a dense gated MLP (kind
"dense", `ModelConfig.dense_layers`). A `BlockGroup` is a run of blocks of
given kinds, the body a mixed stack scans (`linen_moe._src.models.layer_stack`).
Every block returns `(x, aux)`, `aux` the dict of `AUX_FIELDS` for it.

Shapes: B batch, S sequence, M emb_dim, E num_experts.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src.config import stack_plan
from linen_moe._src.config import variables
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.layer import checkpoint_names
from linen_moe._src.layer.expert import SharedExpert
from linen_moe._src.layer.moe import RoutedAndSharedMoE
from linen_moe._src.layer.moe import RoutedMoE
from linen_moe._src.models.attention import CausalSelfAttention
from linen_moe._src.models.mla import MultiHeadLatentAttention
from linen_moe._src.models.norms import RMSNorm
from linen_moe._src.models.norms import rms_normalize
from linen_moe._src.models.remat import layer_remats_rows
from linen_moe._src.models.remat import remat_block
from linen_moe._src.parallel import sharding

AUX_FIELDS = (
    "load_balance_loss",
    "router_z_loss",
    "dropped_fraction",
    "expert_load",
)
MOE, DENSE = "moe", "dense"


def dense_aux(num_experts: int) -> dict[str, jax.Array]:
  """The aux of a block without routing: zeros (`expert_load` [E])."""
  zero = jnp.zeros((), jnp.float32)
  return {
      "load_balance_loss": zero,
      "router_z_loss": zero,
      "dropped_fraction": zero,
      "expert_load": jnp.zeros((num_experts,), jnp.float32),
  }


class DecoderBlock(nn.Module):
  """One block; returns `(x, aux)`, `aux` the dict of `AUX_FIELDS` for this
  block (`expert_load` <float32>[E]; zeros for a dense block).

  A "dense" block's MLP is a gated MLP of width `dense_mlp_dim` (`mlp/`,
  the `SharedExpert` layout), after `pre_mlp_norm`. A "moe" block: Gemma-4
  style options (`router_input_norm`, `post_moe_norms`, `shared_pre_norm`)
  are config fields. Shared experts without post-MoE norms are added
  DeepSeek / Qwen style by `RoutedAndSharedMoE` (variables under
  `moe/routed_experts/` and `moe/shared_experts/`); with `post_moe_norms`
  the block normalises the routed and the shared output (`moe/`,
  `shared_experts/`) before adding. The attention is multi-head latent
  attention when `kv_lora_rank > 0` (`mla.py`), else `CausalSelfAttention`
  (of the full-attention geometry when `full`). Gemma-4's sandwich norms
  (`post_attention_norm`, `post_mlp_norm`) normalise a branch's output
  before its residual, and `layer_scalar` scales the block's output.
  With `config.remat_moe_rows` False under a `config.remat` other than
  "none" the MoE layer leaves the recompute of its sorted rows to the
  block's (`RoutedMoE.remat_rows`, `remat.layer_remats_rows`): such a
  block is meant to run wrapped by `remat_block`, as the decoders run it.
  The signature fits `nn.scan` (carry, broadcast positions and segment
  ids).
  `decode` keeps a KV cache in the attention.

  Attributes:
    config: the `ModelConfig`.
    decode: keep and extend a KV cache.
    kind: "moe" or "dense".
    full: a full-attention layer (`ModelConfig.full_attention_layers`).
  """

  config: ModelConfig
  decode: bool = False
  kind: str = MOE
  full: bool = False

  def _attention(
      self,
      x: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array | None,
  ) -> jax.Array:
    cfg = self.config
    if cfg.kv_lora_rank:
      attention = MultiHeadLatentAttention(cfg, self.decode, name="attention")
    else:
      attention = CausalSelfAttention(
          cfg, self.decode, self.full, name="attention"
      )
    h = RMSNorm(cfg.norm_eps, name="pre_attention_norm")(x)
    out = checkpoint_names.tag(
        attention(h, positions, segment_ids), checkpoint_names.ATTENTION_OUT
    )
    if cfg.post_attention_norm:
      out = RMSNorm(cfg.norm_eps, name="post_attention_norm")(out)
    return x + out

  def _residual(self, x: jax.Array, mlp_out: jax.Array) -> jax.Array:
    """x + the MLP's output (normed with `post_mlp_norm`), times the
    layer's scalar."""
    cfg = self.config
    mlp_out = checkpoint_names.tag(mlp_out, checkpoint_names.MOE_OUTPUT)
    if cfg.post_mlp_norm:
      mlp_out = RMSNorm(cfg.norm_eps, name="post_mlp_norm")(mlp_out)
    x = x + mlp_out.astype(x.dtype)
    if cfg.layer_scalar:  # a saved constant (transformers' buffer)
      scalar = self.variable(
          variables.UPDATED_BY_RULE, "layer_scalar", jnp.ones, (1,), jnp.float32
      ).value
      x = x * scalar.astype(x.dtype)
    return sharding.constrain(x, sharding.BSM)

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array | None = None,
  ):
    """One layer: attention, then the MoE (or dense) MLP, each residual.

    Args:
      x: [B, S, M] the residual stream.
      positions: <int32>[B, S] each token's position (rotary, masks, cache).
      segment_ids: optional <int32>[B, S] packed documents (0 = padding): a
        query attends only to keys of its own segment.

    Returns:
      The new residual stream [B, S, M] and the layer's aux
      (`load_balance_loss`, `router_z_loss`, `dropped_fraction`,
      `expert_load` [E]; zeros for a dense layer).

    Raises:
      ValueError: the block's `kind` is neither "moe" nor "dense".
    """
    cfg, moe_cfg = self.config, self.config.moe
    if self.kind not in (MOE, DENSE):
      raise ValueError(f"kind={self.kind!r}; expected {(MOE, DENSE)}.")
    x = checkpoint_names.tag(x, checkpoint_names.LAYER_INPUT)
    x = self._attention(x, positions, segment_ids)
    if self.kind == DENSE:
      h = RMSNorm(cfg.norm_eps, name="pre_mlp_norm")(x)
      mlp = SharedExpert(moe_cfg, mlp_dim=cfg.dense_mlp_dim, name="mlp")
      return self._residual(x, mlp(h)), dense_aux(moe_cfg.num_experts)
    h = RMSNorm(cfg.norm_eps, name="pre_moe_norm")(x)
    gate_inputs = None
    if cfg.router_input_norm:
      router_scale = self.param(
          "router_input_scale",
          nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
          (moe_cfg.emb_dim,),
      )
      gate_inputs = (
          rms_normalize(x, cfg.norm_eps) * router_scale * moe_cfg.emb_dim**-0.5
      )
    remat_rows = layer_remats_rows(cfg)
    if cfg.shared_in_moe:
      mlp_out, aux = RoutedAndSharedMoE(moe_cfg, remat_rows, name="moe")(
          h, gate_inputs
      )
    else:
      routed, aux = RoutedMoE(moe_cfg, remat_rows, name="moe")(h, gate_inputs)
      if cfg.post_moe_norms:
        routed = RMSNorm(cfg.norm_eps, name="post_routed_norm")(routed)
      mlp_out = routed
      if moe_cfg.shared_experts > 0:
        shared_in = h
        if cfg.shared_pre_norm:
          shared_in = RMSNorm(cfg.norm_eps, name="pre_shared_norm")(x)
        shared = SharedExpert(moe_cfg, name="shared_experts")(shared_in)
        if cfg.post_moe_norms:
          shared = RMSNorm(cfg.norm_eps, name="post_shared_norm")(shared)
        mlp_out = routed + shared
    return self._residual(x, mlp_out), {
        "load_balance_loss": aux.load_balance_loss,
        "router_z_loss": aux.router_z_loss,
        "dropped_fraction": aux.dropped_fraction,
        "expert_load": aux.expert_fraction,
    }


class BlockGroup(nn.Module):
  """Consecutive blocks of `kinds`, members `block_{j}`: the body of a
  mixed stack's scan. Returns `(x, aux)` with each aux field stacked over
  the members [P, ...].

  Each member is wrapped by `remat_block` itself (and `remat_block` leaves
  the group alone), so that a backward pass recomputes and holds one
  member at a time, as in a stack of one kind, not the whole period's
  activations and gathered weights at once.

  Attributes:
    config: the `ModelConfig`.
    decode: keep and extend a KV cache.
    kinds: the members' (kind, full attention) (`ModelConfig.block_kinds`),
      in order.
  """

  config: ModelConfig
  decode: bool = False
  kinds: tuple[tuple[str, bool], ...] = ()

  rematerializes_members = True

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array | None = None,
  ):
    outs = []
    member = remat_block(DecoderBlock, self.config, self.decode)
    for j, (kind, full) in enumerate(self.kinds):
      block = member(
          self.config, self.decode, kind, full, name=stack_plan.member_name(j)
      )
      x, aux = block(x, positions, segment_ids)
      outs.append(aux)
    return x, jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def stack_body(config: ModelConfig, decode: bool = False):
  """What a scanned decoder scans (`config.stack_plan`): one block when the
  stack repeats one kind, else a group of one period of blocks.

  Args:
    config: the decoder's config (its stack plan scans something).
    decode: build the blocks with a KV cache.

  Returns:
    The module class (`DecoderBlock` or the group's) and the keyword
    arguments that build one row of the stack, as a pair.
  """
  plan, kinds = config.stack_plan, config.block_kinds
  fields = {"config": config, "decode": decode}
  if plan.period == 1:
    kind, full = kinds[plan.start]
    return DecoderBlock, {**fields, "kind": kind, "full": full}
  group = kinds[plan.start : plan.start + plan.period]
  return BlockGroup, {**fields, "kinds": group}


def per_layer_aux(config: ModelConfig, before, stacked, after) -> dict:
  """Each aux field of the blocks stacked over the layers, in layer order.

  Args:
    config: the decoder's config (its `stack_plan`).
    before: the aux dicts of the unrolled blocks before the stack, in order.
    stacked: the stack's aux, each field [R, ...] (or [R, P, ...] for a
      group of P members), or None without a stack.
    after: the aux dicts of the unrolled blocks after the stack.

  Returns:
    The aux fields, each [L, ...].
  """
  plan = config.stack_plan
  parts = [jax.tree.map(lambda x: x[None], a) for a in before]
  if stacked is not None:
    rows, skip = plan.repeats * plan.period, 1 if plan.period == 1 else 2
    parts.append(
        jax.tree.map(lambda x: x.reshape(rows, *x.shape[skip:]), stacked)
    )
  parts += [jax.tree.map(lambda x: x[None], a) for a in after]
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
