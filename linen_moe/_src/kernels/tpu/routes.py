"""The TPU's grouped-matmul kernels, as registry entries (`kernel.Entry`,
backend "tpu"), and what `"auto"` runs on a TPU:

  pallas              this project's Pallas `gmm` / `tgmm` (`pallas_grouped`):
                      tiles from the measured table (`gmm_tiling`), the
                      gate and up projections paired (`pallas_gate_up`), the
                      int8 grouped matmul with in-kernel scales
                      (`pallas_int8`), the row gathers by DMA
                      (`pallas_gather`). What `"kernel"` runs on a TPU.
  megablox            jax's megablox `gmm` (`megablox`).
  tokamax_mosaic_tpu  Tokamax's Pallas Mosaic TPU kernel (every non-group
                      dimension >= 128).

All take float32 and bfloat16 operands and run on a CPU in Pallas
interpret mode (the kernel's own program, interpreted); none inside a
`shard_map` that checks manual-axis types (a `pallas_call`'s outputs carry
none), except Tokamax's, which takes the manual axes itself.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp

from linen_moe._src.kernels.kernel import Entry
from linen_moe._src.kernels.kernel import Parts

FLOATS = (jnp.float32, jnp.bfloat16)
AUTO_TABLE = "tpu/gmm_tiles.json"
# The fewest rows at which "auto" gives the int8 mode the Pallas int8
# kernel on a TPU: the fewest it was measured faster at (a Mixtral-8x7B
# layer's 2 x 4096 tokens, top-2). Fewer (decoding a served int8 layer)
# keep XLA's int8 `ragged_dot`, never measured slower there.
AUTO_INT8_MIN_ROWS = 16384


def _pallas(interpret: bool) -> Parts:
  try:
    from linen_moe._src.kernels.tpu import pallas_gate_up
    from linen_moe._src.kernels.tpu import pallas_grouped
    from linen_moe._src.kernels.tpu import pallas_int8
  except ImportError as e:  # a jax without Pallas TPU
    raise ImportError(f"jax.experimental.pallas.tpu: {e}") from e
  return Parts(
      fn=functools.partial(
          pallas_grouped.pallas_grouped_matmul, interpret=interpret
      ),
      int8_scaled=functools.partial(
          pallas_int8.int8_grouped_matmul_scaled, interpret=interpret
      ),
      paired=functools.partial(
          pallas_gate_up.paired_grouped_matmul, interpret=interpret
      ),
  )


def _megablox(interpret: bool) -> Parts:
  try:
    from jax.experimental.pallas.ops.tpu import megablox  # noqa: F401
  except ImportError as e:
    raise ImportError(f"jax.experimental.pallas.ops.tpu.megablox: {e}") from e
  from linen_moe._src.kernels.tpu.megablox import megablox_gmm

  return Parts(functools.partial(megablox_gmm, interpret=interpret))


def _tokamax_mosaic_tpu(interpret: bool) -> Parts:
  from linen_moe._src.kernels import tokamax_ragged_dot as tokamax

  return Parts(tokamax.load("mosaic_tpu", interpret))


ENTRIES = (
    Entry(
        name="pallas",
        backend="tpu",
        title="pallas gmm",
        operand_dtypes=FLOATS,
        loader=_pallas,
        paired_gate_up=True,
        gathers=True,
        in_shard_map=False,
        int8_scaled=True,
        auto_table=AUTO_TABLE,
        on_cpu="interpret",
        auto_int8_min_rows=AUTO_INT8_MIN_ROWS,
    ),
    Entry(
        name="megablox",
        backend="tpu",
        title="megablox gmm",
        operand_dtypes=FLOATS,
        loader=_megablox,
        in_shard_map=False,
        on_cpu="interpret",
    ),
    Entry(
        name="tokamax_mosaic_tpu",
        backend="tpu",
        title="tokamax Mosaic TPU ragged_dot",
        operand_dtypes=FLOATS,
        loader=_tokamax_mosaic_tpu,
        on_cpu="interpret",
        min_dim=128,
    ),
)


def choose(shape: tuple[int, ...] | None, dtypes: tuple[Any, ...]) -> str:
  """What `"auto"` runs on a TPU for lhs [M, K] x [G, K, N] (`shape` =
  (M, K, N, G), or None when unknown): "pallas" where the tile table
  measured the Pallas kernels fastest for the nearest shape on this chip,
  else "ragged_dot" (also for operands they do not take, or a jax without
  Pallas TPU)."""
  pallas = ENTRIES[0]
  if shape is None or not (dtypes and pallas.takes(dtypes)):
    return "ragged_dot"
  try:
    from linen_moe._src.kernels.tpu import gmm_tiling
    from linen_moe._src.kernels.tpu import pallas_gmm
  except ImportError:
    return "ragged_dot"
  m, k, n, g = shape
  dtype = pallas_gmm.compute_dtype(*dtypes)
  chip = gmm_tiling.current_chip()
  fastest = gmm_tiling.fastest_implementation(m, k, n, g, dtype, chip)
  return "pallas" if fastest == "kernel" else "ragged_dot"
