"""Accelerator grouped-matmul kernels behind one seam: this project's Pallas
kernels on TPU (`pallas_grouped`), Tokamax `ragged_dot` on GPU; jax's
megablox `gmm` stays reachable on a CPU and for benchmarks. Knows nothing of
MoE or quantization.

Each kernel computes the contract of `linen_moe._src.kernels.grouped_matmul` (lhs
[M, K] sorted by group, rhs [G, K, N], group_sizes <int32>[G] -> [M, N], rows
past sum(group_sizes) zero, and so are their input gradients), with the
kernel's own VJP (the Pallas kernels and megablox: `gmm` with the
transposed rhs for dlhs, `tgmm` for drhs).

Operands. The Pallas kernels and megablox take float32 and bfloat16
operands (`megablox.common.assert_is_supported_dtype`); the Tokamax wrapper is given
float16, bfloat16 and float32 (its kernels take other types only as qwix
`QArray`s). Other operands (the int8 forward and input gradient of the
"int8" mode, the int8 / fp8 kernels of a serving layer) do not reach a
kernel as plain operands: `grouped_matmul="kernel"` runs those
contractions with `jax.lax.ragged_dot` and says so with a
`KernelFallbackWarning`
(`grouped_matmul.resolve_implementation`). The weight gradient of the int8
mode is float, and does use the kernel. On a TPU (and under
`kernels_on_cpu("pallas")`) the int8 mode's forward and input gradient do
reach a kernel: `int8_kernel` gives `int8_grouped` the Pallas int8 grouped
matmul, int8 operands with int32 accumulation and the scales applied in
its epilogue (`pallas_int8`). Which operands each mode's grouped
matmul gets is `quantization_modes.QuantizationMode.grouped_operand_dtype`.

Known bugs guarded here:
  - openxla/tokamax#887: Tokamax's weight gradient gave non-zero gradients to
    empty groups. The wrapper's VJP zeroes the weight gradient of every empty
    group, the input gradient of every row past sum(group_sizes), and those
    rows of the output.
  - jax-ml/jax#34168: `ragged_dot`'s `group_offset` is unimplemented on GPU.
    Nothing here passes one: under expert parallelism each device is given
    only its own experts' weights, never a group offset into all of them.

On a TPU, `grouped_matmul="auto"` runs the Pallas kernels where the tile
table (`gmm_tiling`) measured them fastest for the nearest shape, else
`ragged_dot` (`auto_on_tpu`).

On a CPU. `kernels_on_cpu(kind)` (`linen_moe.testing.kernels_on_cpu`) makes
`grouped_matmul="kernel"` resolve on the CPU backend, inside the context, to:
  "pallas"          this project's Pallas kernels in interpret mode, with
                    the tiles the rule picks for a TPU v5e.
  "megablox"        megablox `gmm` in Pallas interpret mode: the TPU
                    kernel's own program, interpreted (slow: tiny shapes).
  "tokamax"         `tokamax.ragged_dot` with its XLA implementation, the one
                    Tokamax runs on a CPU (its Pallas GPU kernels need a GPU).
  "tokamax_pallas"  Tokamax's Pallas Mosaic TPU kernel in interpret mode,
                    forward and VJP. Tokamax requires every non-group
                    dimension >= 128, and reads the TPU generation from the
                    abstract mesh: trace under `jax.sharding.use_abstract_mesh`
                    of an `AbstractMesh` whose `abstract_device` is a TPU.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from linen_moe._src.kernels.platform import target_platform

ON_CPU_KINDS = ("pallas", "megablox", "tokamax", "tokamax_pallas")
_ON_CPU: list[str | None] = [None]


class KernelFallbackWarning(UserWarning):
  """`grouped_matmul="kernel"` ran a contraction with `jax.lax.ragged_dot`
  because the kernel does not take its operand types, or cannot run where
  it was called (megablox inside a `shard_map`)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A grouped-matmul kernel usable on this backend.

  Attributes:
    name: what it is, for messages ("megablox gmm", "tokamax ragged_dot").
    fn: (lhs, rhs, group_sizes, preferred_element_type) -> [M, N].
    operand_dtypes: the dtypes it takes for lhs and rhs.
    in_shard_map: whether it runs inside a `shard_map` that checks
      manual-axis types (`check_vma`, the expert-parallel path's): jax's
      megablox does not (its `pallas_call` outputs carry none).
    int8_scaled: the int8 grouped matmul with in-kernel scales, where the
      kernel has one (`pallas_int8.int8_grouped_matmul_scaled`'s
      signature), else None.
    paired: the gate and up projections, their backward in one call each
      way, where the kernel has it (`pallas_gate_up.paired_grouped_matmul`'s
      signature), else None.
  """

  name: str
  fn: Callable[..., jax.Array]
  operand_dtypes: tuple[Any, ...]
  in_shard_map: bool = True
  int8_scaled: Callable[..., jax.Array] | None = None
  paired: Callable[..., tuple[jax.Array, jax.Array]] | None = None

  def takes(self, dtypes: tuple[Any, ...]) -> bool:
    allowed = {jnp.dtype(d) for d in self.operand_dtypes}
    return all(jnp.dtype(d) in allowed for d in dtypes)

  def describe_dtypes(self) -> str:
    return "/".join(jnp.dtype(d).name for d in self.operand_dtypes)


def _rows_valid(m: int, group_sizes: jax.Array) -> jax.Array:
  """<bool>[M]: rows inside some group."""
  return lax.iota(jnp.int32, m) < jnp.sum(group_sizes)


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
  valid = _rows_valid(m, group_sizes)
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


def _tokamax_call(lhs, rhs, group_sizes, preferred_element_type, impl):
  import tokamax

  return tokamax.ragged_dot(
      lhs,
      rhs,
      group_sizes,
      preferred_element_type=preferred_element_type,
      implementation=impl,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tokamax_masked(lhs, rhs, group_sizes, preferred_element_type, impl):
  out = _tokamax_call(lhs, rhs, group_sizes, preferred_element_type, impl)
  valid = _rows_valid(lhs.shape[0], group_sizes)
  return jnp.where(valid[:, None], out, 0)


def _tokamax_fwd(lhs, rhs, group_sizes, preferred_element_type, impl):
  out, vjp = jax.vjp(
      lambda a, b: _tokamax_call(
          a, b, group_sizes, preferred_element_type, impl
      ),
      lhs,
      rhs,
  )
  valid = _rows_valid(lhs.shape[0], group_sizes)
  return jnp.where(valid[:, None], out, 0), (vjp, group_sizes, valid)


def _tokamax_bwd(preferred_element_type, impl, residuals, g):
  del preferred_element_type, impl
  vjp, group_sizes, valid = residuals
  g = jnp.where(valid[:, None], g, 0)
  dlhs, drhs = vjp(g)
  dlhs = jnp.where(valid[:, None], dlhs, 0)
  # openxla/tokamax#887: an empty group contributed nothing, so its weight
  # gradient is exactly zero, whatever the kernel wrote.
  drhs = jnp.where((group_sizes > 0)[:, None, None], drhs, 0)
  return dlhs, drhs, None


_tokamax_masked.defvjp(_tokamax_fwd, _tokamax_bwd)


def tokamax_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
    implementation: Any = None,
) -> jax.Array:
  """`tokamax.ragged_dot` (Pallas Mosaic GPU / Triton kernels on a GPU; it
  falls back to XLA itself where its kernels do not support the case), with
  the masks of the module docstring.

  Args:
    lhs, rhs, group_sizes, preferred_element_type: as `jax.lax.ragged_dot`.
    implementation: Tokamax's `implementation` argument (hashable: a name,
      a tuple of names or an op object); None for its default order.
  """
  return _tokamax_masked(
      lhs,
      rhs,
      group_sizes.astype(jnp.int32),
      preferred_element_type,
      implementation,
  )


def _tokamax_pallas_interpreted():
  """Tokamax's Pallas Mosaic TPU ragged dot in interpret mode, forward and
  VJP (the dlhs and drhs ragged dots are the same kernel). Its default
  tiles come from the TPU generation, which a CPU lacks, so they are given,
  and its device check is bypassed, in the VJP's ops too (Tokamax builds
  those without the bypass: "NotImplementedError: Not supported on cpu")."""
  from tokamax._src.ops.ragged_dot import base
  from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as pmt

  config = pmt.Config(tile_m=128, tile_k=128, tile_n=128)
  inner = pmt.PallasMosaicTpuRaggedDot(
      interpret=True, config=config, bypass_device_check=True
  )
  vjp = functools.partial(
      base.vjp, dlhs_ragged_dot=inner, drhs_ragged_dot=inner
  )
  return (
      pmt.PallasMosaicTpuRaggedDot(
          interpret=True, config=config, bypass_device_check=True, vjp=vjp
      ),
  )


_FLOATS = (jnp.float32, jnp.bfloat16)


def _pallas(interpret: bool) -> tuple[Kernel | None, str | None]:
  try:
    from linen_moe._src.kernels.tpu import pallas_gate_up
    from linen_moe._src.kernels.tpu import pallas_grouped
    from linen_moe._src.kernels.tpu import pallas_int8
  except ImportError as e:  # a jax without Pallas TPU
    return None, f"jax.experimental.pallas.tpu: {e}"
  fn = functools.partial(
      pallas_grouped.pallas_grouped_matmul, interpret=interpret
  )
  int8 = functools.partial(
      pallas_int8.int8_grouped_matmul_scaled, interpret=interpret
  )
  paired = functools.partial(
      pallas_gate_up.paired_grouped_matmul, interpret=interpret
  )
  return Kernel("pallas gmm", fn, _FLOATS, False, int8, paired), None


# The fewest rows at which `int8_kernel` gives "auto" the Pallas int8
# kernel on a TPU: the fewest it was measured faster at (a Mixtral-8x7B
# layer's 2 x 4096 tokens, top-2). Fewer (decoding a served int8 layer)
# keep XLA's int8 `ragged_dot`, never measured slower there.
AUTO_INT8_MIN_ROWS = 16384


def int8_kernel(
    implementation: str, rows: int | None = None
) -> Callable[..., jax.Array] | None:
  """The int8 grouped matmul with in-kernel scales that `implementation`
  runs where it is traced: the Pallas one for "kernel" or "auto" on a TPU
  (and for "kernel" on a CPU inside `kernels_on_cpu("pallas")`), outside a
  `shard_map`; else None (the caller runs its int8 contraction through
  `grouped_matmul`, which falls back to `ragged_dot` visibly).

  "auto" takes it on a TPU for `rows` of at least `AUTO_INT8_MIN_ROWS`
  (None: any), where it was measured faster than XLA's int8 `ragged_dot`
  (whose int32 results go to HBM to be scaled by separate passes): on a
  v5e the int8 train step of a Mixtral-8x7B layer ran 1.12x faster on it,
  and of a Qwen3-30B-A3B layer 1.12x, with less memory
  (benchmarks/device/README.md).

  Args:
    implementation: the layer's `grouped_matmul` setting.
    rows: M, the rows of the contraction's lhs.
  """
  platform = target_platform()
  enough = rows is None or rows >= AUTO_INT8_MIN_ROWS
  if implementation == "auto" and platform == "tpu" and enough:
    implementation = "kernel"
  if implementation != "kernel":
    return None
  kernel, _ = find_kernel(platform)
  if kernel is None or kernel.int8_scaled is None:
    return None
  if not kernel.in_shard_map and jax.sharding.get_abstract_mesh().manual_axes:
    return None
  return kernel.int8_scaled


def row_gather(implementation: str) -> str:
  """How the sparse path's row gathers run where they are traced, for the
  layer's `grouped_matmul` setting: "pallas" (`pallas_gather`, rows moved
  by DMA) for "kernel" or "auto" on a TPU, and for "kernel" on a CPU inside
  `kernels_on_cpu("pallas")` (interpreted); "xla" (XLA's gather)
  elsewhere, and inside a `shard_map` (the kernel's output carries no
  manual-axis type, as `Kernel.in_shard_map` says of ours)."""
  platform = target_platform()
  on_tpu = platform == "tpu" and implementation in ("kernel", "auto")
  on_cpu = platform == "cpu" and implementation == "kernel"
  if not (on_tpu or (on_cpu and _ON_CPU[0] == "pallas")):
    return "xla"
  if jax.sharding.get_abstract_mesh().manual_axes:
    return "xla"
  return "pallas"


def gather_rows(table, index, valid=None) -> jax.Array:
  """`pallas_gather.gather_rows` for where it is traced (interpreted on a
  CPU)."""
  from linen_moe._src.kernels.tpu import pallas_gather

  interpret = target_platform() == "cpu"
  return pallas_gather.gather_rows(table, index, valid, interpret=interpret)


def gather_sum(table, index, weights) -> jax.Array:
  """`pallas_gather.gather_sum` for where it is traced (interpreted on a
  CPU)."""
  from linen_moe._src.kernels.tpu import pallas_gather

  interpret = target_platform() == "cpu"
  return pallas_gather.gather_sum(table, index, weights, interpret=interpret)


def gather_scale_dot(table, index, scale, other) -> tuple[jax.Array, jax.Array]:
  """`pallas_gather.gather_scale_dot` for where it is traced (interpreted
  on a CPU)."""
  from linen_moe._src.kernels.tpu import pallas_gather

  interpret = target_platform() == "cpu"
  return pallas_gather.gather_scale_dot(
      table, index, scale, other, interpret=interpret
  )


def auto_on_tpu(shape: tuple[int, ...] | None, dtypes: tuple[Any, ...]) -> str:
  """What `grouped_matmul="auto"` runs on a TPU for lhs [M, K] x [G, K, N]
  (`shape` = (M, K, N, G), or None when unknown): "kernel" where the tile
  table measured the Pallas kernels fastest for the nearest shape on this
  chip, else "ragged_dot" (also for operands the kernels do not take)."""
  kernel, _ = _pallas(interpret=False)
  if shape is None or kernel is None or not (dtypes and kernel.takes(dtypes)):
    return "ragged_dot"
  from linen_moe._src.kernels.tpu import gmm_tiling
  from linen_moe._src.kernels.tpu import pallas_gmm

  m, k, n, g = shape
  dtype = pallas_gmm.compute_dtype(*dtypes)
  chip = gmm_tiling.current_chip()
  fastest = gmm_tiling.fastest_implementation(m, k, n, g, dtype, chip)
  return "kernel" if fastest == "kernel" else "ragged_dot"


def _megablox(interpret: bool) -> tuple[Kernel | None, str | None]:
  try:
    from jax.experimental.pallas.ops.tpu import megablox  # noqa: F401
  except ImportError as e:
    return None, f"jax.experimental.pallas.ops.tpu.megablox: {e}"
  fn = functools.partial(megablox_gmm, interpret=interpret)
  return Kernel("megablox gmm", fn, _FLOATS, in_shard_map=False), None


def _tokamax(implementation) -> tuple[Kernel | None, str | None]:
  try:
    import tokamax  # noqa: F401
  except ImportError as e:
    return None, f"tokamax (pip install 'linen_moe[kernels]'): {e}"
  if callable(implementation):  # built only once tokamax is importable
    implementation = implementation()
  fn = functools.partial(tokamax_ragged_dot, implementation=implementation)
  return Kernel("tokamax ragged_dot", fn, (*_FLOATS, jnp.float16)), None


def find_kernel(backend: str) -> tuple[Kernel | None, str | None]:
  """(the kernel for `backend`, None), or (None, why there is none)."""
  if backend == "tpu":
    return _pallas(interpret=False)
  if backend == "gpu":
    return _tokamax(None)
  on_cpu = _ON_CPU[0]
  if backend == "cpu" and on_cpu == "pallas":
    return _pallas(interpret=True)
  if backend == "cpu" and on_cpu == "megablox":
    return _megablox(interpret=True)
  if backend == "cpu" and on_cpu == "tokamax":
    return _tokamax(("xla",))
  if backend == "cpu" and on_cpu == "tokamax_pallas":
    return _tokamax(_tokamax_pallas_interpreted)
  return None, f"no grouped-matmul kernel is known for backend {backend!r}"


# On by default: on a TPU v5e the paired backward (`pallas_gate_up`, its
# forward two calls) takes the gate and up projections' backward from 7.66
# to 4.45 ms at 128 experts of 2048 x 768 (131,072 rows), 8.53 to 7.28 at 8
# of 2048 x 5632 and 46.42 to 22.17 at 8 of 4096 x 14336 (32,768 rows)
# (benchmarks/device/bench_gate_up.py, benchmarks/device/README.md).
_PAIR_GATE_UP = [True]


def pairs_gate_up() -> bool:
  """Whether a kernel's paired gate and up projections may run (by
  default; `paired_gate_up(False)` turns them off)."""
  return _PAIR_GATE_UP[0]


@contextlib.contextmanager
def paired_gate_up(on: bool = True):
  """Inside, the sparse path's gate and up projections run paired where
  the kernel has it (`Kernel.paired`): their backward one call each way,
  the rows read once for both weight gradients and the input gradients
  summed in the kernel. On by default; `paired_gate_up(False)` runs them
  as two calls (for measuring them side by side). Resolution happens while
  a function is traced, as for `kernels_on_cpu`.

  Raises:
    TypeError: if `on` is not a bool.
  """
  if not isinstance(on, bool):
    raise TypeError(f"paired_gate_up takes on=True or False; got {on!r}.")
  saved = _PAIR_GATE_UP[0]
  _PAIR_GATE_UP[0] = on
  try:
    yield
  finally:
    _PAIR_GATE_UP[0] = saved


@contextlib.contextmanager
def kernels_on_cpu(kind: str):
  """Inside, `grouped_matmul="kernel"` on the CPU backend runs `kind` (see
  the module docstring); "auto" still resolves to "blocked" there.

  Resolution happens while a function is traced: trace (call a jitted
  function for the first time, or lower it) inside the context.

  Raises:
    ValueError: `kind` is not one of `ON_CPU_KINDS`.
  """
  if kind not in ON_CPU_KINDS:
    raise ValueError(f"kind must be one of {ON_CPU_KINDS}; got {kind!r}.")
  saved = _ON_CPU[0]
  _ON_CPU[0] = kind
  try:
    yield
  finally:
    _ON_CPU[0] = saved
