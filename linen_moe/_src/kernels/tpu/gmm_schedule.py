"""The visit schedule of the Pallas grouped matmuls: which row tile each grid
step works on, for which group. Pure jnp (no flax: the kernels
run where only jax is installed); knows nothing of Pallas.

Rows [0, M) are cut into row tiles of `tm` rows; group g owns the rows
[starts[g], ends[g]). A *visit* is one (group, row tile) pair whose rows
meet: a tile that straddles two groups is visited once per group (each visit
keeps only its group's rows), so no group is padded to whole tiles of work.
Visits are ordered by tile, so the visits of one tile are consecutive (an
output tile stays in VMEM across them). Tiles past sum(group_sizes) are not
visited by any group; the forward (`fill_tail`) visits each of them once to
write zeros there, with no matmul. The weight gradient (`visit_empty`)
visits each empty group once to write its zero gradient, again with no
matmul.

The schedule is built for a static upper bound of visits,
`max_visits(m, tm, g) = cdiv(M, tm) + G - 1`; the kernels run only the
first `num_visits` (a dynamic grid dimension). Bad sizes under `jit` cannot
reach memory they should not: negative sizes count as 0 and the rows past
M are dropped (as `jax.lax.ragged_dot` drops them), so every tile index is
in [0, cdiv(M, tm)).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def cdiv(a: int, b: int) -> int:
  """ceil(a / b) for positive ints."""
  return -(-a // b)


def max_visits(m: int, tm: int, num_groups: int) -> int:
  """The most visits M rows in tiles of `tm` and G groups can need: every
  tile once, plus one more for each group but the first that starts inside
  a tile (or, empty, is visited for its zero gradient)."""
  return cdiv(m, tm) + num_groups - 1


class Schedule(NamedTuple):
  """The visits of one grouped matmul (the kernels' scalar-prefetch inputs).

  Attributes:
    group: <int32>[V] the group of each visit; G for a tail visit (a tile
      past sum(group_sizes): zeros, no matmul). Padding repeats the last.
    tile: <int32>[V] the row tile each visit writes (forward) or reads.
    compute: <int32>[V] 1 where the visit runs a matmul (a non-empty group),
      else 0.
    read_group, read_tile: <int32>[V] the group and tile whose blocks a
      visit reads: its own where `compute`, else the last computing
      visit's, so that a visit without a matmul fetches nothing new.
    starts, ends: <int32>[G + 1] the first and the end row of each group
      (entry G: the empty range [0, 0) of the tail visits).
    num_visits: <int32>[] the visits to run.
  """

  group: jax.Array
  tile: jax.Array
  compute: jax.Array
  read_group: jax.Array
  read_tile: jax.Array
  starts: jax.Array
  ends: jax.Array
  num_visits: jax.Array

  def prefetch(self) -> tuple[jax.Array, ...]:
    """The arrays a kernel takes as scalar prefetch, in its order."""
    return (
        self.group,
        self.tile,
        self.compute,
        self.read_group,
        self.read_tile,
        self.starts,
        self.ends,
    )


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """(starts, ends) <int32>[G]: each group's rows, negative sizes as 0,
  ends cut at M."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends


def _last_where(flag: jax.Array) -> jax.Array:
  """<int32>[V]: for each i, the last j <= i with flag[j] (0 if none)."""
  index = jnp.where(flag, jnp.arange(flag.shape[0], dtype=jnp.int32), -1)
  return jnp.maximum(jax.lax.cummax(index), 0)


def build(
    group_sizes: jax.Array,
    m: int,
    tm: int,
    *,
    fill_tail: bool,
    visit_empty: bool,
) -> Schedule:
  """The `Schedule` of M rows in row tiles of `tm`.

  Args:
    group_sizes: <int>[G] rows per group, in order.
    m: rows of the operand (M >= 1).
    tm: rows per tile.
    fill_tail: visit each tile past sum(group_sizes) once (the forward and
      the input gradient: those rows' outputs are zeros).
    visit_empty: visit each empty group once (the weight gradient: its
      block of the output is zeros).

  Returns:
    The `Schedule`, padded to `max_visits(m, tm, G)` visits.
  """
  num_groups = group_sizes.shape[0]
  tiles_m = cdiv(m, tm)
  starts, ends = group_bounds(group_sizes, m)
  nonempty = ends > starts
  first_tile = jnp.minimum(starts // tm, tiles_m - 1)
  last_tile = jnp.maximum(ends - 1, 0) // tm
  counts = jnp.where(nonempty, last_tile - first_tile + 1, int(visit_empty))
  used_tiles = (ends[-1] + tm - 1) // tm
  tail = tiles_m - used_tiles if fill_tail else jnp.zeros((), jnp.int32)
  counts = jnp.concatenate([counts, tail[None]]).astype(jnp.int32)  # [G + 1]
  first_tile = jnp.concatenate([first_tile, used_tiles[None]])

  total = max_visits(m, tm, num_groups)
  group = jnp.repeat(
      jnp.arange(num_groups + 1, dtype=jnp.int32),
      counts,
      total_repeat_length=total,
  )
  first_visit = jnp.cumsum(counts) - counts
  offset = jnp.arange(total, dtype=jnp.int32) - first_visit[group]
  tile = jnp.clip(first_tile[group] + offset, 0, tiles_m - 1)
  computes = jnp.concatenate([nonempty, jnp.zeros((1,), bool)])[group]
  source = _last_where(computes)
  nothing = jnp.zeros((1,), jnp.int32)
  return Schedule(
      group=group,
      tile=tile,
      compute=computes.astype(jnp.int32),
      read_group=jnp.minimum(group[source], num_groups - 1),
      read_tile=tile[source],
      starts=jnp.concatenate([starts, nothing]),
      ends=jnp.concatenate([ends, nothing]),
      num_visits=jnp.sum(counts),
  )
