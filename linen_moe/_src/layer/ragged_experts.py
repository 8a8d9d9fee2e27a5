"""The sparse path's ragged all-to-all strategy, on one device of the
`shard_map` (`linen_moe._src.layer.expert_parallel` lifts it and chooses it).

Shapes: T tokens on this device, k choices per token, M emb_dim, D devices
over the exchange axes (the expert axes that also split the batch), me this
device's index on them, E_l experts per device, R = T * k sorted rows sent,
Q = D * T * min(k, E_l) rows received (every source may send its T tokens'
assignments to this device's experts, at most min(k, E_l) per token: the
buffer is provably dropless, like the all-gather's).

  1. Sort this device's assignments by destination and expert (`permute.
     sort_plan` over the D * E_l experts reachable here; where the experts
     also split over axes the tokens are replicated on, only the ones in
     this device's slice are), count C[d, j] rows for expert j of device d,
     and all-gather the counts: every device then knows the whole [D, D,
     E_l] matrix, and from it every size and offset of both exchanges.
  2. `ragged_all_to_all` the rows: device d's slice goes to d, written at
     the offset where d keeps this device's rows (d arranges what it
     receives by source, then by expert).
  3. Permute the received rows into expert order (a partial permutation
     and its inverse, `permute.take_injective`: gathers both ways), run the
     grouped matmuls on the E_l local experts (`RoutedMoE.grouped`, so every
     quantization works), and permute back.
  4. `ragged_all_to_all` the results back (sizes and offsets mirrored), and
     weight and sum each token's results (`permute.combine_rows`).

The backward is the transpose: `ragged_all_to_all`'s transpose is the
reverse exchange, the permutations' are gathers by the inverse.
"""

from __future__ import annotations

from collections.abc import Callable
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.kernels.ragged_collectives import ragged_all_to_all
from linen_moe._src.layer import permute
from linen_moe._src.layer.expert import gated_mlp
from linen_moe._src.layer.sparse import Experts
from linen_moe._src.layer.sparse import Grouped


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def destination_experts(
    expert_axes: tuple[str, ...],
    exchange_axes: tuple[str, ...],
    axis_sizes: dict[str, int],
    experts_per_device: int,
) -> jax.Array:
  """<int32>[D, E_l]: the global ids of the experts of the device at index
  d of `exchange_axes` (the other expert axes at this device's own index).

  A device's expert shard is its index over `expert_axes`, row-major in that
  order (as `lax.axis_index(expert_axes)` numbers it); `exchange_axes` is a
  subsequence of `expert_axes`, numbered the same way by the collectives.
  """
  strides = {
      a: math.prod(axis_sizes[b] for b in expert_axes[i + 1 :])
      for i, a in enumerate(expert_axes)
  }
  sizes = [axis_sizes[a] for a in exchange_axes]
  coords = np.unravel_index(np.arange(math.prod(sizes)), sizes)  # static
  shard = sum(
      jnp.asarray(c * strides[a], jnp.int32)
      for a, c in zip(exchange_axes, coords, strict=True)
  )
  for a in expert_axes:
    if a not in exchange_axes:  # tokens are replicated here: stay in slice
      shard = shard + lax.axis_index(a) * strides[a]
  local = lax.iota(jnp.int32, experts_per_device)
  return shard[:, None] * experts_per_device + local[None, :]


def _receive_order(counts: jax.Array, rows: int):
  """Where each received row goes in expert order, and back.

  counts <int>[D, E_l]: rows this device receives from source s for its
  expert j; they arrive by source, then by expert. Returns (target
  <int32>[Q]: the expert-ordered row of each received row, -1 past the
  received total; index <int32>[Q]: its inverse, the received row in each
  expert-ordered row, -1 past the total; group_sizes <int32>[E_l]).
  """
  d, e_l = counts.shape
  per_source = jnp.sum(counts, axis=1)  # [D]
  source_start = _exclusive_cumsum(per_source)  # [D]
  r = lax.iota(jnp.int32, rows)
  valid = r < jnp.sum(per_source)
  source = jnp.clip(
      jnp.searchsorted(jnp.cumsum(per_source), r, side="right"), 0, d - 1
  )
  within = r - source_start[source]  # offset inside the source's block
  ends = jnp.cumsum(counts, axis=1)[source]  # [Q, E_l]
  expert = jnp.clip(jnp.sum(within[:, None] >= ends, axis=1), 0, e_l - 1)
  group_sizes = jnp.sum(counts, axis=0)  # [E_l]
  expert_start = _exclusive_cumsum(group_sizes)  # [E_l]
  before_source = _exclusive_cumsum(counts, axis=0)  # [D, E_l]
  within_expert = within - _exclusive_cumsum(counts, axis=1)[source, expert]
  target = expert_start[expert] + before_source[source, expert] + within_expert
  target = jnp.where(valid, target, -1).astype(jnp.int32)
  index = (
      jnp.full((rows,), -1, jnp.int32)
      .at[jnp.where(valid, target, rows)]
      .set(r, mode="drop")
  )
  return target, index, group_sizes.astype(jnp.int32)


def ragged_experts(
    grouped: Grouped,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    experts: Experts,
    act: Callable[[jax.Array], jax.Array],
    *,
    destinations: jax.Array,
    num_experts: int,
    exchange_axes: tuple[str, ...],
    vary: Callable[[jax.Array], jax.Array],
    emulate: bool | None = None,
) -> jax.Array:
  """This device's tokens through the experts of the D devices it exchanges
  with (see the module docstring): x [T, M], indices <int>[T, k] and weights
  [T, k], experts (wi_0, wi_1, wo) of the E_l local experts; `destinations`
  from `destination_experts`, of the `num_experts` experts; `vary` casts a fresh array to the manual axes
  of the body. Returns [T, M]: each token's weighted sum over its choices
  among those experts."""
  t, m = x.shape
  k = indices.shape[1]
  d, e_l = destinations.shape
  # Each reachable expert's slot d * E_l + j; -1 for the other experts.
  slot = (
      jnp.full((num_experts,), -1, jnp.int32)
      .at[destinations.reshape(-1)]
      .set(lax.iota(jnp.int32, d * e_l))
  )
  plan = permute.sort_plan(slot[indices], d * e_l)
  rows = permute.dispatch_rows(x, plan)  # [R, M] by destination, expert
  send_counts = plan.group_sizes.reshape(d, e_l)
  all_counts = lax.all_gather(send_counts, exchange_axes, axis=0)  # [D, D, E_l]
  me = lax.axis_index(exchange_axes)
  pair = jnp.sum(all_counts, axis=2)  # [source, destination]
  send_sizes = pair[me]  # [D]
  recv_sizes = pair[:, me]  # [D]
  input_offsets = _exclusive_cumsum(send_sizes)
  # Where a destination keeps this device's rows: after its earlier sources.
  output_offsets = _exclusive_cumsum(pair, axis=0)[me]
  received_rows = d * t * min(k, e_l)

  def exchange(operand, out_rows, *sizes_and_offsets):
    out = vary(jnp.zeros((out_rows, m), operand.dtype))
    return ragged_all_to_all(
        operand,
        out,
        *sizes_and_offsets,
        axis_name=exchange_axes,
        emulate=emulate,
    )

  received = exchange(
      rows, received_rows, input_offsets, send_sizes, output_offsets, recv_sizes
  )  # [Q, M] by source, expert
  target, index, group_sizes = _receive_order(all_counts[:, me], received_rows)
  ordered = permute.take_injective(received, index, target)  # [Q, M]

  def project(site, operand, weight):
    return grouped(site, operand, weight, group_sizes)

  expert_out = gated_mlp(project, act, ordered, *experts)  # [Q, M]
  back = permute.take_injective(expert_out, target, index)  # by source
  # The mirror: send what came from s back to s, where s keeps its rows.
  returned = exchange(
      back,
      rows.shape[0],
      _exclusive_cumsum(recv_sizes),
      recv_sizes,
      _exclusive_cumsum(pair, axis=1)[:, me],
      send_sizes,
  )  # [R, M] in this device's sorted order
  return permute.combine_rows(returned, weights.astype(x.dtype), plan)
