"""Tiles of the Pallas grouped matmul per shape: the measured table, and a
rule for the shapes it lacks.

A problem is (rows M, K, N, groups G, dtype, chip): lhs [M, K] x rhs
[G, K, N]. Its forward (`gmm`, contraction K), input gradient (`gmm_t`,
contraction N) and weight gradient (`tgmm`) each get their own tiles
(`GmmTiling`). Where they come from, first match wins:

1. `gmm_tiles.json` beside this module (package data), written by the tile
   sweep of `benchmarks/device/bench_gmm.py` on a chip: an entry for this
   chip, dtype, K, N and G, the one of the nearest M (rows per group
   matter little once a tile is full); an entry of N x K serves K x N too,
   its ops' tiles exchanged (`_transposed`). An entry also names the
   implementation measured fastest for its shape, forward and backward
   (`fastest_implementation`: what `grouped_matmul="auto"` runs on a TPU).
2. The rule (`rule_tiling`): of the candidate tiles (`candidates`: tk, tn
   multiples of 128 dividing K, N or the whole dimension; tm a power of two
   from 128 up to M) whose blocks fit the chip's VMEM, the one a per-grid-
   step roofline (`model_seconds`: the larger of the step's MXU time and
   its copies, plus a fixed cost per step) says is fastest. The sweep also
   uses it to pick which candidates to time.

Knows nothing of MoE.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
from typing import Any

import jax
import jax.numpy as jnp

from linen_moe._src.kernels.tpu import pallas_gmm
from linen_moe._src.kernels.tpu.gmm_schedule import cdiv
from linen_moe._src.kernels.tpu.tpu_chips import TPU_CHIPS
from linen_moe._src.kernels.tpu.tpu_chips import tpu_chip_name

TABLE_FILE = "gmm_tiles.json"
OPS = ("gmm", "gmm_t", "tgmm")


CHIPS = TPU_CHIPS
# The chip assumed where none is known (interpret mode on a CPU).
DEFAULT_CHIP = "v5e"
# Blocks may use this share of VMEM; Mosaic's own scratch takes some of the
# rest. The scoped limit asked of Mosaic is `_VMEM_LIMIT_SHARE` of it.
_VMEM_BLOCK_SHARE = 0.6
_VMEM_LIMIT_SHARE = 0.85
# Mosaic's default scoped VMEM limit on the smallest (v4 / v5e: 16 MiB):
# below it, no limit is asked for.
_DEFAULT_SCOPED_VMEM = 16 << 20
# Fixed cost of one grid step: megablox's 128 x 128 x 128 tiles took 18.5 ms
# for the 50 k steps of an [8192, 2048] x 8 x [2048, 5632] forward on a v5e
# (benchmarks/device/README.md), ~0.35 us a step.
_STEP_SECONDS = 0.35e-6
# Rows a weight tile latched in the MXU serves before the next is latched:
# the product of a tm-row tile is assumed to take (1 + _MXU_LATCH_ROWS / tm)
# times its FLOPs at peak (an assumption the tile sweep checks).
_MXU_LATCH_ROWS = 64
_ROW_TILES = (128, 256, 512, 1024, 2048)
_MAX_COLUMN_TILE = 16384


@dataclasses.dataclass(frozen=True)
class GmmTiling:
  """The tiles of one grouped matmul, forward and backward.

  Attributes:
    gmm: (tm, tk, tn) of the forward: rows, K (contraction), N (output).
    gmm_t: (tm, tn, tk) of the input gradient: rows, N (contraction), K
      (output).
    tgmm: (tm, tk, tn) of the weight gradient.
    vmem_limit_bytes: the scoped VMEM limit to ask of Mosaic (None: its
      default).
    source: where they come from: "table", "rule" or "given".
  """

  gmm: tuple[int, int, int]
  gmm_t: tuple[int, int, int]
  tgmm: tuple[int, int, int]
  vmem_limit_bytes: int | None = None
  source: str = "given"


def current_chip() -> str | None:
  """The TPU being traced for: the current mesh's abstract device (a plan's
  target), else this process's first device; None if not a TPU."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  if device is None:
    device = jax.devices()[0]
  return tpu_chip_name(getattr(device, "device_kind", None))


def _dims(op: str, m: int, k: int, n: int) -> tuple[int, int, int]:
  """(rows, contraction, output) of `op`; for tgmm (rows, K, N)."""
  return (m, n, k) if op == "gmm_t" else (m, k, n)


def _column_tiles(d: int) -> list[int]:
  """Tiles of a dimension d: the multiples of 128 dividing it, or d itself
  when it is no multiple of 128 (a block is either, for Mosaic)."""
  if d % 128:
    return [d]
  return [
      t for t in range(128, min(d, _MAX_COLUMN_TILE) + 1, 128) if d % t == 0
  ]


def row_multiple(dtype) -> int:
  """Rows a row tile is a multiple of: what one (rows, 128) VMEM tile of
  `dtype` packs (16 for bfloat16, 32 for int8; 16 for float32 too, so that
  one tiling serves both float dtypes)."""
  return 32 if jnp.dtype(dtype).itemsize == 1 else 16


def _row_tiles(m: int, multiple: int = 16) -> list[int]:
  """Row tiles for M rows: powers of two from 128 below M, and M rounded up
  to `multiple` (at most the largest)."""
  small = -(-m // multiple) * multiple  # a few rows: one tile of them
  tiles = [t for t in _ROW_TILES if t < small]
  return [*tiles, min(small, _ROW_TILES[-1])]


def vmem_bytes(op: str, tiles, dtype, out_dtype, c: int) -> int:
  """VMEM of `op`'s blocks with `tiles` (contraction c, for `gmm`'s
  accumulator)."""
  if op == "tgmm":
    return pallas_gmm.tgmm_vmem_bytes(tiles, dtype, dtype, out_dtype)
  return pallas_gmm.gmm_vmem_bytes(
      tiles, dtype, dtype, out_dtype, c // tiles[1]
  )


def candidates(
    op: str, m: int, k: int, n: int, dtype, chip: str | None = None
) -> list[tuple[int, int, int]]:
  """The tiles `op` may take for lhs [M, K] x [G, K, N] on `chip`: each
  dimension's tiles (`_row_tiles`, `_column_tiles`) whose blocks fit the
  chip's VMEM."""
  spec = CHIPS[chip or DEFAULT_CHIP]
  rows, c, o = _dims(op, m, k, n)
  budget = _VMEM_BLOCK_SHARE * spec.vmem_bytes
  out = []
  for tm in _row_tiles(rows, row_multiple(dtype)):
    for tc in _column_tiles(c):
      for to in _column_tiles(o):
        if vmem_bytes(op, (tm, tc, to), dtype, dtype, c) <= budget:
          out.append((tm, tc, to))
  return out


def model_seconds(
    op: str, tiles, m: int, k: int, n: int, g: int, dtype, chip=None
) -> float:
  """A per-grid-step roofline of `op` with `tiles`, in seconds.

  Each step takes the larger of its MXU time (`_MXU_LATCH_ROWS`) and the
  copies it waits for, plus `_STEP_SECONDS`. Visits: every row tile plus one per group boundary
  (G - 1). `gmm` with the whole contraction in one tile reads each group's
  weight block once per output column tile (its block index stays while
  the group's visits run); otherwise each step copies both operands.
  """
  spec = CHIPS[chip or DEFAULT_CHIP]
  size = jnp.dtype(dtype).itemsize
  peak = spec.peak_flops * (1.0 if size <= 2 else 0.25)
  tm, tc, to = tiles
  rows, c, o = _dims(op, m, k, n)
  visits = cdiv(rows, tm) + g - 1
  steps = visits * (c // tc) * (o // to)
  compute = 2 * tm * tc * to / peak * (1 + _MXU_LATCH_ROWS / tm)
  if op == "tgmm":
    copies = tm * (tc + to) * size
    writes = g * c * o * size
  elif c == tc:
    copies = tm * tc * size + (g * tc * to * size) / max(visits, 1)
    writes = rows * o * size
  else:
    copies = (tm + to) * tc * size
    writes = rows * o * size
  step = max(compute, copies / spec.hbm_bandwidth) + _STEP_SECONDS
  return steps * step + writes / spec.hbm_bandwidth


# Tiles every sweep also times where they are candidates (rows,
# contraction, output): this project's former megablox choice and
# MaxText's default.
_REFERENCE_TILES = ((512, 512, 512), (512, 1024, 1024))


def sweep_candidates(
    op: str, m: int, k: int, n: int, g: int, dtype, chip=None, top: int = 8
) -> list[tuple[int, int, int]]:
  """The tiles a sweep times for `op`: the `top` best by `model_seconds`,
  then the `_REFERENCE_TILES` among the candidates, best modelled first."""
  allowed = candidates(op, m, k, n, dtype, chip)
  ranked = sorted(
      allowed, key=lambda t: model_seconds(op, t, m, k, n, g, dtype, chip)
  )
  rows = _row_tiles(m, row_multiple(dtype))[-1]
  extra = [(min(t[0], rows), *t[1:]) for t in _REFERENCE_TILES]
  return ranked[:top] + [
      t for t in extra if t in allowed and t not in ranked[:top]
  ]


def raised_vmem_limit(chip: str | None = None) -> int:
  """The scoped VMEM limit (bytes) asked of Mosaic for tiles whose blocks
  outgrow its default: `_VMEM_LIMIT_SHARE` of `chip`'s VMEM."""
  return int(_VMEM_LIMIT_SHARE * CHIPS[chip or DEFAULT_CHIP].vmem_bytes)


def vmem_limit(need: int, chip: str | None = None) -> int | None:
  """The scoped VMEM limit for blocks of `need` bytes: None (Mosaic's
  default) where they fit in half of the default, else `raised_vmem_limit`."""
  if need <= _DEFAULT_SCOPED_VMEM // 2:
    return None
  return raised_vmem_limit(chip)


def _limit(tiles: GmmTiling, m, k, n, dtype, chip) -> int | None:
  need = max(
      vmem_bytes(op, getattr(tiles, op), dtype, dtype, _dims(op, m, k, n)[1])
      for op in OPS
  )
  return vmem_limit(need, chip)


def rule_tiling(
    m: int, k: int, n: int, g: int, dtype, chip: str | None = None
) -> GmmTiling:
  """Each op's candidate with the least `model_seconds`."""
  best = {
      op: min(
          candidates(op, m, k, n, dtype, chip),
          key=lambda t, op=op: model_seconds(op, t, m, k, n, g, dtype, chip),
      )
      for op in OPS
  }
  tiling = GmmTiling(**best, source="rule")
  limit = _limit(tiling, m, k, n, dtype, chip)
  return dataclasses.replace(tiling, vmem_limit_bytes=limit)


@functools.cache
def load_table() -> tuple[dict[str, Any], ...]:
  """The entries of `gmm_tiles.json` (package data)."""
  text = (
      importlib.resources.files("linen_moe._src.kernels.tpu")
      .joinpath(TABLE_FILE)
      .read_text(encoding="utf-8")
  )
  return tuple(json.loads(text)["entries"])


def _transposed(entry: dict[str, Any]) -> dict[str, Any]:
  """`entry` (lhs [M, K] x [G, K, N]) as the entry of lhs [M, N] x [G, N, K]:
  the same three products, named the other way round. Its forward is the
  entry's input gradient and the other way round (both (rows, contraction,
  output)); its weight gradient is the entry's, its K and N tiles swapped.
  (A layer's down projection is the transpose of its up projection.)"""
  tm, tk, tn = entry["tgmm"]
  return {
      **entry,
      "k": entry["n"],
      "n": entry["k"],
      "gmm": entry["gmm_t"],
      "gmm_t": entry["gmm"],
      "tgmm": [tm, tn, tk],
  }


def lookup(
    m: int, k: int, n: int, g: int, dtype, chip: str | None
) -> dict[str, Any] | None:
  """The table's entry for this chip, dtype, K, N and G with the M nearest
  (in ratio) to `m`, or None. Where the table has no entry of K x N but one
  of N x K (the transposed problem), that one, turned (`_transposed`)."""
  name = jnp.dtype(dtype).name
  ours = [
      e
      for e in load_table()
      if (e["chip"], e["dtype"], e["groups"]) == (chip, name, g)
  ]
  for turn in (lambda e: e, _transposed):
    same = [t for t in map(turn, ours) if (t["k"], t["n"]) == (k, n)]
    if same:
      return min(same, key=lambda e: abs(math.log(e["m"] / max(m, 1))))
  return None


def choose_tiling(
    m: int, k: int, n: int, g: int, dtype, chip: str | None = None
) -> GmmTiling:
  """The tiles for lhs [M, K] x [G, K, N] of `dtype` on `chip`: the table's
  (their row tiles cut to M), else `rule_tiling`'s."""
  entry = lookup(m, k, n, g, dtype, chip)
  if entry is None:
    return rule_tiling(m, k, n, g, dtype, chip)
  rows = _row_tiles(m, row_multiple(dtype))[-1]
  fit = {op: (min(entry[op][0], rows), *entry[op][1:]) for op in OPS}
  tiling = GmmTiling(**fit, source="table")
  limit = _limit(tiling, m, k, n, dtype, chip)
  return dataclasses.replace(tiling, vmem_limit_bytes=limit)


def fastest_implementation(
    m: int, k: int, n: int, g: int, dtype, chip: str | None
) -> str | None:
  """The implementation the table measured fastest (forward + backward) for
  the nearest shape ("kernel" or "ragged_dot"), or None if it has none."""
  entry = lookup(m, k, n, g, dtype, chip)
  return None if entry is None else entry["fastest"]
