"""The tiles of our Pallas-Triton grouped matmul (`triton_gmm`): per pass
(forward `gmm`, input gradient `gmm_t`, weight gradient `tgmm`) the block
sides and Triton's launch parameters, and the table the next GPU session
autotunes (`TUNED`, `choose_tiling`).

UNMEASURED: no GPU has run these kernels yet. The defaults are the usual
starting points for a Hopper GPU (the Triton matmul tutorial's and
tokamax's H100 configurations are of this kind): 128 x 128 output blocks,
64-deep K steps in 16-bit types (a stage holds (128 + 128) x 64 x 2 B =
32 KiB of shared memory; 4 stages of the H200's 228 KiB), 32-deep in
float32, 4 warps; the weight gradient's 128 x 128 blocks of [K, N] take
64 rows a step (32 KiB a stage, 3 stages), float32's 64 x 64 blocks 32
rows. `TUNED` ships empty; a measured entry (the autotuning
hook `benchmarks/gpu/bench_triton_gmm.py --sweep` prints them) reads:

  {"device_kind": "NVIDIA H200", "dtype": "bfloat16",
   "m": 32768, "k": 2048, "n": 5632, "groups": 8,
   "gmm": (128, 128, 64, 4, 4, 8), "gmm_t": (...), "tgmm": (...)}

each pass's tuple being `Tiles`'s fields in order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

PASSES = ("gmm", "gmm_t", "tgmm")


def _power_of_two(v) -> bool:
  return (
      isinstance(v, int)
      and not isinstance(v, bool)
      and v > 0
      and (v & (v - 1) == 0)
  )


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One pass's blocks and launch parameters.

  Attributes:
    block_m: rows per program (`gmm`) or per loop step (`tgmm`).
    block_n: output columns per program (N; K for `gmm_t`).
    block_k: the contraction's step (`gmm`, `gmm_t`) or the K rows of a
      `tgmm` output block.
    num_warps: Triton warps per program.
    num_stages: Triton's software-pipelining stages.
    group_m: `gmm`'s work items per window of its program order (L2 reuse).
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 4
  group_m: int = 8

  def check(self, where: str) -> None:
    """Raises a `ValueError` naming `where` and the field that does not
    fit: blocks and warps powers of two (blocks >= 16, Triton's least
    dot), stages and group_m positive ints."""
    for name in ("block_m", "block_n", "block_k", "num_warps"):
      value = getattr(self, name)
      least = 16 if name.startswith("block") else 1
      if not _power_of_two(value) or value < least:
        raise ValueError(
            f"{where}.{name} must be a power of two >= {least}; got {value!r}."
        )
    for name in ("num_stages", "group_m"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{where}.{name} must be a positive int; got {value!r}."
        )


@dataclasses.dataclass(frozen=True)
class Tiling:
  """The tiles of the three passes."""

  gmm: Tiles = Tiles()
  gmm_t: Tiles = Tiles()
  tgmm: Tiles = Tiles(block_m=64, block_k=128, num_stages=3)

  def check(self) -> None:
    """Raises a `ValueError` naming the pass and field that does not fit."""
    for name in PASSES:
      tiles = getattr(self, name)
      if not isinstance(tiles, Tiles):
        raise ValueError(f"tiling.{name} must be a Tiles; got {tiles!r}.")
      tiles.check(f"tiling.{name}")


_F32_TILES = Tiles(block_k=32, num_stages=3)
DEFAULT = Tiling()
DEFAULT_F32 = Tiling(
    gmm=_F32_TILES,
    gmm_t=_F32_TILES,
    tgmm=Tiles(block_m=32, block_k=64, block_n=64, num_stages=3),
)

# Measured entries (see the module docstring). Empty: unmeasured.
TUNED: tuple[dict[str, Any], ...] = ()


def default_tiling(dtype) -> Tiling:
  """The unmeasured defaults for operands computed in `dtype`."""
  return DEFAULT_F32 if jnp.dtype(dtype) == jnp.float32 else DEFAULT


def choose_tiling(
    m: int,
    k: int,
    n: int,
    groups: int,
    dtype,
    device_kind: str | None,
    table: tuple[dict[str, Any], ...] = TUNED,
) -> Tiling:
  """The tiling for lhs [M, K] x [G, K, N] computed in `dtype` on
  `device_kind`: the table's entry of that device, dtype, K, N and G with
  the M nearest in ratio, else `default_tiling(dtype)`."""
  name = jnp.dtype(dtype).name
  same = [
      e
      for e in table
      if (e["device_kind"], e["dtype"], e["k"], e["n"], e["groups"])
      == (device_kind, name, k, n, groups)
  ]
  if not same:
    return default_tiling(dtype)
  entry = min(same, key=lambda e: abs(math.log(e["m"] / max(m, 1))))
  return Tiling(**{p: Tiles(*entry[p]) for p in PASSES})
