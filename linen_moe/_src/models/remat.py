"""Rematerialization of the decoder's blocks: `ModelConfig.remat`.

Each block is wrapped in `nn.remat` (`jax.checkpoint`) with a policy that
says which of its tensors the backward pass keeps; the rest of the block is
recomputed from them. The tensors are named in the blocks
(`linen_moe._src.layer.checkpoint_names`); `SAVED_NAMES` lists each
policy's:

  "none"                    no remat: every activation the backward pass
                            reads is kept.
  "full"                    nothing inside the block: only its input (the
                            residual stream, [B, S, M] per layer) is kept,
                            and the whole block runs again in the backward
                            pass.
  "save_experts"            the router logits, the gated MLPs' three
                            contractions (x wi_0, x wi_1, h wo) and the
                            MLP output: the attention and the norms are
                            recomputed, no expert matmul is.
  "save_attention_experts"  those and the attention's q, k, v and output:
                            the projections are not recomputed either.
  "offload"                 as "full", with each layer's input moved to
                            host memory ("pinned_host") after the forward
                            pass and back for the backward pass.

A block's variables, its RNG streams and its numbers are the same under
every policy: Linen's lifted remat replays the same RNG keys in the
recompute (AQT int8's stochastic rounding draws the same values), and the
fp8 state's "gradient" (its new value) is computed once, in the backward
pass.
"""

from __future__ import annotations

from collections.abc import Callable
import functools

import flax.linen as nn
import jax

from linen_moe._src.config.model_config import REMAT_POLICIES
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.model_config import check_remat
from linen_moe._src.layer import checkpoint_names as names

_EXPERTS = (
    names.ROUTER_LOGITS,
    names.EXPERT_GATE,
    names.EXPERT_UP,
    names.EXPERT_DOWN,
    names.MOE_OUTPUT,
)
# The names each policy keeps on the device (None: no remat).
SAVED_NAMES: dict[str, tuple[str, ...] | None] = {
    "none": None,
    "full": (),
    "save_experts": _EXPERTS,
    "save_attention_experts": (
        names.QUERY,
        names.KEY,
        names.VALUE,
        names.ATTENTION_OUT,
        *_EXPERTS,
    ),
    "offload": (),
}
# The names each policy moves to host memory.
OFFLOADED_NAMES: dict[str, tuple[str, ...]] = {"offload": (names.LAYER_INPUT,)}
HOST_MEMORY = "pinned_host"
assert set(SAVED_NAMES) == set(REMAT_POLICIES)


def remat_policy(remat: str) -> Callable | None:
  """The `jax.checkpoint` policy of a `ModelConfig.remat` value.

  Args:
    remat: one of `REMAT_POLICIES`.

  Returns:
    The checkpoint policy, None for "none" (no remat at all) and for "full" (save
    nothing, `jax.checkpoint`'s default).

  Raises:
    ValueError: if `remat` is not one of `REMAT_POLICIES`.
  """
  check_remat(remat)
  saved, offloaded = SAVED_NAMES[remat], OFFLOADED_NAMES.get(remat, ())
  if offloaded:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved),
        names_which_can_be_offloaded=list(offloaded),
        offload_src="device",
        offload_dst=HOST_MEMORY,
    )
  if saved:
    return jax.checkpoint_policies.save_only_these_names(*saved)
  return None


def layer_remats_rows(config: ModelConfig) -> bool:
  """Whether a block's MoE layer rematerializes its sorted rows itself
  (`RoutedMoE.remat_rows`).

  Under a block remat (any policy but "none") that recompute is redundant:
  the block recomputes the layer in its backward, and no policy saves a
  name inside the layer's checkpoint (the rows have none; `EXPERT_GATE` /
  `EXPERT_UP` name its outputs), so it is a third gather of the rows.
  Skipping it holds one layer's rows in its backward instead, at any depth
  (compiled for a TPU v5e: +1.17 GiB at Qwen3-30B-A3B's 8 x 4096 tokens,
  +1.50 GiB at Mixtral-8x7B's 2 x 4096), so it is the config's choice,
  `remat_moe_rows=False`, off by default.

  Args:
    config: the decoder's config (its `remat`, `remat_moe_rows`).

  Returns:
    False only under a block remat with `remat_moe_rows` False.
  """
  return config.remat_moe_rows or SAVED_NAMES[config.remat] is None


def remat_block(
    block: type[nn.Module], config: ModelConfig, decode: bool = False
) -> type[nn.Module]:
  """`block` wrapped in `nn.remat` with the policy of `config.remat`.

  Its variables keep their names and shapes: scanned (`scan_blocks`) or
  unrolled, Linen or NNX (`EagerToNNX` of the wrapped class), the layout
  is the one without remat.

  Args:
    block: a block's module class (`DecoderBlock`, a `stack_body` group).
    config: the decoder's config (its `remat`).
    decode: a decoding block (no backward pass): never wrapped.

  Returns:
    `block` itself for "none", `decode` or a block whose members are
    rematerialized one by one (a `stack_body` group), else its `nn.remat`
    class.
  """
  if decode or config.remat == "none":
    return block
  if getattr(block, "rematerializes_members", False):
    return block
  return _rematted(block, config.remat)


@functools.cache
def _rematted(block: type[nn.Module], remat: str) -> type[nn.Module]:
  """One `nn.remat` class per (block, policy), so that each trace of a
  decoder builds the same classes."""
  return nn.remat(block, policy=remat_policy(remat), prevent_cse=True)
