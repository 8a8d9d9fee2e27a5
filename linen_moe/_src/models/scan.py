"""Scanning a decoder block that holds the MoE layer, with every collection.

A block built around `RoutedMoE` keeps more than `params`: fp8 scales and
amax histories (and any other state in `variables.STATE_COLLECTIONS`) must be
stacked per layer too, or `nn.scan` shares one copy across all layers; each
RNG stream the layer draws from must be split per layer; and the stacked
axis needs a partition name, or Flax cannot shard (or even initialise) the
logically partitioned parameters (`PartitioningUnspecifiedError`).
`scan_blocks` is `nn.scan` with all three filled in from one list.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from linen_moe._src.config import variables

LAYERS_AXIS = "layers"
# `resolved_unroll(0, length)` unrolls a stack of at most this many layers.
# Measured on a 2-core CPU (`benchmarks/model/bench_scan_unroll.py`: the
# tiny_mixtral train step), in line against the loop: compile 0.8x /
# 1.0-1.3x / 2.0x / 3.7-4.3x at 2 / 4 / 8 / 16 layers; and the 4-layer
# Mixtral-shaped train step (bench_model) runs 1.53 -> 1.45-1.52 s: a loop
# fills stacked buffers of every layer's residuals and gradients and slices
# each layer's weights out of the stack, straight-line code does neither.
AUTO_UNROLL_MAX_LENGTH = 4


def resolved_unroll(scan_unroll: int, length: int) -> int | bool:
  """`nn.scan`'s `unroll` for a stack of `length` layers.

  Args:
    scan_unroll: `ModelConfig.scan_unroll`: layers per loop iteration, or 0
      to decide by `length` (unrolled up to `AUTO_UNROLL_MAX_LENGTH`).
    length: the layers the stack scans over, >= 1.

  Returns:
    The layers per loop iteration, or True for no loop (every layer in
    line).
  """
  if scan_unroll == 0:
    scan_unroll = length if length <= AUTO_UNROLL_MAX_LENGTH else 1
  return True if scan_unroll >= length else scan_unroll


def scan_blocks(
    block: type[nn.Module],
    length: int,
    *,
    in_axes: Any = (),
    partition_name: str = LAYERS_AXIS,
    **scan_kwargs: Any,
) -> type[nn.Module]:
  """`nn.scan(block)` over `length` layers, with every collection stacked.

  Every variable collection of the layer (`params`, the state collections,
  the KV cache) is stacked on axis 0, its RNG streams are split per layer,
  and the stacked axis is named `partition_name`.

  Example usage:
    Stack = scan_blocks(MyBlock, length=4, in_axes=(nn.broadcast,))
    x, ys = Stack(cfg, name="layers")(x, positions)

  Args:
    block: a Linen module class called as `block(carry, *xs) -> (carry, ys)`.
    length: the number of layers L, an int >= 1.
    in_axes: how `xs` is scanned, as in `nn.scan` (e.g. `(nn.broadcast,)`
      for an input every layer sees whole).
    partition_name: the logical axis name of the stacked axis.
    **scan_kwargs: passed to `nn.scan` unchanged.

  Returns:
    The scanned module class; its variables have a leading [L] axis.

  Raises:
    ValueError: if `length` is not a positive int.
  """
  if isinstance(length, bool) or not isinstance(length, int) or length < 1:
    raise ValueError(f"length={length!r} must be a positive integer.")
  stacked = {variables.PARAMS: 0}
  stacked.update({c: 0 for c in variables.STATE_COLLECTIONS})
  stacked[variables.CACHE] = 0
  rngs = {variables.PARAMS: True}
  rngs.update({s: True for s in variables.RNG_STREAMS})
  return nn.scan(
      block,
      variable_axes=stacked,
      split_rngs=rngs,
      in_axes=in_axes,
      length=length,
      metadata_params={nn.PARTITION_NAME: partition_name},
      **scan_kwargs,
  )
