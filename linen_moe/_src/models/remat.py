"""Rematerialization of the decoder's blocks: `ModelConfig.remat`.

Each block is wrapped in `nn.remat` (`jax.checkpoint`) with a policy that
says which of its tensors the backward pass keeps; the rest of the block is
recomputed from them. The tensors are named in the blocks
(`linen_moe._src.layer.checkpoint_names`):

  "none"   no remat: every activation the backward pass reads is kept.
  "full"   nothing inside the block: only its input (the residual stream,
           [B, S, M] per layer) is kept, and the whole block runs again in
           the backward pass.

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

from linen_moe._src.config.model_config import REMAT_POLICIES
from linen_moe._src.config.model_config import ModelConfig

# The names each policy saves on the device (None: no remat).
SAVED_NAMES: dict[str, tuple[str, ...] | None] = {
    "none": None,
    "full": (),
}
assert set(SAVED_NAMES) == set(REMAT_POLICIES)


def policy(remat: str) -> Callable | None:
  """The `jax.checkpoint` policy of a `ModelConfig.remat` value.

  Args:
    remat: one of `REMAT_POLICIES`.

  Returns:
    The policy, or None for "none" (no remat) and "full" (save nothing).

  Raises:
    ValueError: if `remat` is not one of `REMAT_POLICIES`.
  """
  if remat not in SAVED_NAMES:
    raise ValueError(f"remat={remat!r} is invalid: allowed {REMAT_POLICIES}.")
  return None


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
    `block` itself for "none" or `decode`, else its `nn.remat` class.
  """
  if decode or config.remat == "none":
    return block
  return _rematted(block, config.remat)


@functools.cache
def _rematted(block: type[nn.Module], remat: str) -> type[nn.Module]:
  """One `nn.remat` class per (block, policy), so that each trace of a
  decoder builds the same classes."""
  return nn.remat(block, policy=policy(remat), prevent_cse=True)
