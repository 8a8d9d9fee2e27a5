"""jax's Pallas TPU megablox `gmm` behind the grouped matmul's contract
(`kernel.Entry` "tpu/megablox"): what TPU users of jax get, reachable on a
CPU in interpret mode and for benchmarks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from linen_moe._src.kernels.kernel import rows_valid

# megablox tile sizes: rows (at most), and the K and N tiles tried largest
# first. Tiles of 128 x 128 made the 2.4 B Mixtral shape's decode step
# spend most of its time in grid steps (0.18 of the weight-read limit on a
# TPU v5e); 512-row tiles make a training step's gmm forward + backward
# 1.3-1.45x faster than 128-row ones there (8192 and 32768 rows).
# benchmarks/layer/bench_gmm_tiles.py measures the choice.
MEGABLOX_ROW_TILE = 512
MEGABLOX_TILES = (1024, 512, 256, 128)


def megablox_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
  """megablox `gmm`'s (rows, K, N) tiles for lhs [M, K] and rhs [G, K, N].

  One tile for K and N, the largest of `MEGABLOX_TILES` dividing both (128
  when none does: megablox masks a remainder): its backward runs `gmm` with
  K and N swapped under the same tiling, and a tile that is neither a
  multiple of 128 nor the dimension is a block Mosaic rejects (min(128, K)
  with K = 8, N = 32 was, on a TPU v5e). Rows: M rounded up to 8, at most
  `MEGABLOX_ROW_TILE`.
  """
  both = math.gcd(k, n)
  t = next((t for t in MEGABLOX_TILES if both % t == 0), 128)
  return min(MEGABLOX_ROW_TILE, -(-m // 8) * 8), t, t


def megablox_gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
    interpret: bool = False,
) -> jax.Array:
  """Pallas megablox `gmm` (its own grouped VJP; `tgmm` for drhs).

  megablox needs M to be a multiple of its row tile and leaves the rows past
  sum(group_sizes) unwritten, in the output and in the lhs gradient; the
  padding and the two row masks here make it match `ragged_dot`. The tiles
  are `megablox_tiling`'s.
  """
  from jax.experimental.pallas.ops.tpu import megablox

  m, k = lhs.shape
  tm, tk, tn = megablox_tiling(m, k, rhs.shape[2])
  padded_m = -(-m // tm) * tm
  valid = rows_valid(m, group_sizes)
  x = jnp.where(valid[:, None], lhs, 0)  # masks garbage out of dlhs
  x = jnp.pad(x, ((0, padded_m - m), (0, 0)))
  out = megablox.gmm(
      x,
      rhs,
      group_sizes.astype(jnp.int32),
      preferred_element_type or jnp.result_type(lhs, rhs),
      (tm, tk, tn),
      None,
      None,
      False,
      interpret,
  )
  return jnp.where(valid[:, None], out[:m], 0)
