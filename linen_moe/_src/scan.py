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

from linen_moe._src import variables

LAYERS_AXIS = "layers"


def scan_blocks(
    block: type[nn.Module],
    length: int,
    *,
    in_axes: Any = (),
    partition_name: str = LAYERS_AXIS,
    **scan_kwargs: Any,
) -> type[nn.Module]:
  """`nn.scan(block)` over `length` layers, stacking every variable collection
  of the layer on axis 0, splitting its RNG streams, and naming the stacked
  axis `partition_name` (the logical axis "layers" by default).

  The block's signature is `block(carry, *xs) -> (carry, ys)`; `in_axes`
  describes `xs` as in `nn.scan` (e.g. `(nn.broadcast,)` for an input every
  layer sees whole). Other keywords go to `nn.scan` unchanged.

  Example usage:
    Stack = scan_blocks(MyBlock, length=4, in_axes=(nn.broadcast,))
    x, ys = Stack(cfg, name="layers")(x, positions)
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
