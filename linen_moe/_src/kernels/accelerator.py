"""The accelerator kernels as the layer sees them: which kernel runs the
int8 mode's grouped matmul, the gate and up projections paired and the
sparse path's row gathers where a program is traced; running kernels on a
CPU (`kernels_on_cpu`). Every answer is a lookup in the registry
(`registry`: each backend's kernels in its own folder, `tpu/` and `gpu/`,
with their capabilities). Knows nothing of MoE or quantization.

Operands. The Pallas kernels and megablox take float32 and bfloat16
operands; the GPU routes float16, bfloat16 and float32 (Tokamax's kernels
take other types only as qwix `QArray`s). Other operands (the int8 forward
and input gradient of the "int8" mode, the int8 / fp8 kernels of a serving
layer) do not reach a kernel as plain operands: `grouped_matmul="kernel"`
runs those contractions with `jax.lax.ragged_dot` and says so with a
`KernelFallbackWarning` (`grouped_matmul.resolve_implementation`); a kernel
called directly with them raises a `TypeError` (`kernel.Entry.check`). The
weight gradient of the int8 mode is float, and does use the kernel. Where
the kernel has an int8 grouped matmul with in-kernel scales (the Pallas
one, `tpu/pallas_int8`), `int8_kernel` gives it to `int8_grouped`. Which
operands each mode's grouped matmul gets is
`quantization_modes.QuantizationMode.grouped_operand_dtype`.

On a CPU. `kernels_on_cpu(kind)` (`linen_moe.testing.kernels_on_cpu`) makes
`grouped_matmul="kernel"` resolve on the CPU backend, inside the context, to
(`registry.ON_CPU`):
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
from typing import Any

import jax

from linen_moe._src.kernels import registry
from linen_moe._src.kernels.kernel import Entry
from linen_moe._src.kernels.kernel import Kernel  # noqa: F401
from linen_moe._src.kernels.kernel import KernelFallbackWarning  # noqa: F401
from linen_moe._src.kernels.platform import target_platform
from linen_moe._src.kernels.registry import ON_CPU_KINDS  # noqa: F401
from linen_moe._src.kernels.registry import find_kernel  # noqa: F401
from linen_moe._src.kernels.registry import kernels_on_cpu  # noqa: F401
from linen_moe._src.kernels.tokamax_ragged_dot import tokamax_ragged_dot  # noqa: F401
from linen_moe._src.kernels.tpu.megablox import MEGABLOX_ROW_TILE  # noqa: F401
from linen_moe._src.kernels.tpu.megablox import MEGABLOX_TILES  # noqa: F401
from linen_moe._src.kernels.tpu.megablox import megablox_gmm  # noqa: F401
from linen_moe._src.kernels.tpu.megablox import megablox_tiling  # noqa: F401
from linen_moe._src.kernels.tpu.routes import AUTO_INT8_MIN_ROWS  # noqa: F401

# On by default: on a TPU v5e the paired backward (`pallas_gate_up`, its
# forward two calls) takes the gate and up projections' backward from 7.66
# to 4.45 ms at 128 experts of 2048 x 768 (131,072 rows), 8.53 to 7.28 at 8
# of 2048 x 5632 and 46.42 to 22.17 at 8 of 4096 x 14336 (32,768 rows)
# (benchmarks/device/bench_gate_up.py, benchmarks/device/README.md).
_PAIR_GATE_UP = [True]


def _outside_shard_map(entry: Entry) -> bool:
  """Whether `entry` may run here: outside a `shard_map`, or one it takes."""
  return entry.in_shard_map or not jax.sharding.get_abstract_mesh().manual_axes


def _entry_for(implementation: str, platform: str) -> Entry | None:
  """The registered kernel whose side jobs (int8, gathers) `implementation`
  gets where it is traced, with no shape known: the backend's `"kernel"`
  for "kernel"; for "auto" the same off a CPU ("auto" never runs a kernel
  on a CPU)."""
  if implementation == "kernel" or (
      implementation == "auto" and platform != "cpu"
  ):
    return registry.kernel_entry(platform)[0]
  return None


def int8_kernel(
    implementation: str, rows: int | None = None
) -> Callable[..., jax.Array] | None:
  """The int8 grouped matmul with in-kernel scales that `implementation`
  runs where it is traced: the kernel's (`Entry.int8_scaled`) for "kernel";
  for "auto" where the kernel says "auto" takes it (`auto_int8_min_rows`:
  the Pallas one on a TPU for `rows` of at least `AUTO_INT8_MIN_ROWS`, or
  None: any), outside a `shard_map`; else None (the caller runs its int8
  contraction through `grouped_matmul`, which falls back to `ragged_dot`
  visibly).

  "auto" takes it where it was measured faster than XLA's int8
  `ragged_dot` (whose int32 results go to HBM to be scaled by separate
  passes): on a v5e the int8 train step of a Mixtral-8x7B layer ran 1.12x
  faster on it, and of a Qwen3-30B-A3B layer 1.12x, with less memory
  (benchmarks/device/README.md).

  Args:
    implementation: the layer's `grouped_matmul` setting.
    rows: M, the rows of the contraction's lhs.
  """
  platform = target_platform()
  entry = _entry_for(implementation, platform)
  if entry is None or not entry.int8_scaled:
    return None
  if implementation == "auto":
    least = entry.auto_int8_min_rows
    if least is None or (rows is not None and rows < least):
      return None
  if not _outside_shard_map(entry):
    return None
  kernel, _ = registry.load(entry, platform)
  return None if kernel is None else kernel.int8_scaled


def row_gather(implementation: str) -> str:
  """How the sparse path's row gathers run where they are traced, for the
  layer's `grouped_matmul` setting: "pallas" (`pallas_gather`, rows moved
  by DMA) where the kernel `implementation` runs there gathers
  (`Entry.gathers`: "kernel" or "auto" on a TPU, and "kernel" on a CPU
  inside `kernels_on_cpu("pallas")`, interpreted); "xla" (XLA's gather)
  elsewhere, and inside a `shard_map` (the kernel's output carries no
  manual-axis type, as `Entry.in_shard_map` says of ours)."""
  entry = _entry_for(implementation, target_platform())
  if entry is None or not entry.gathers:
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
  """What `grouped_matmul="auto"` runs on a TPU (`tpu.routes.choose`), as
  an implementation name: "kernel" or "ragged_dot"."""
  return registry.auto("tpu", shape, dtypes)[0]


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
