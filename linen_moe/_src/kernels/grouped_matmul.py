"""Grouped matmul: rows of `lhs`, sorted by group, times their group's matrix.

  out[i] = lhs[i] @ rhs[g(i)]   for rows i of group g(i), i < sum(group_sizes)
  out[i] = 0                    for the rows past sum(group_sizes)

Shapes: lhs [M, K], rhs [G, K, N], group_sizes <int32>[G] -> [M, N].
Group g holds rows [sum(group_sizes[:g]), sum(group_sizes[:g+1])), cut at M:
a total above M drops the rows past M, as `jax.lax.ragged_dot` does. Group
sizes are traced values under `jit`, so neither check can happen at trace
time; negative sizes give unspecified results. Knows nothing of MoE or
quantization.

Implementations:
  "ragged_dot"  `jax.lax.ragged_dot`. On CPU it lowers to a masked dense matmul
                over every group: G times the useful work.
  "blocked"     Pure JAX, any backend: each group's first C rows (C a little
                above the mean group size) in one batched matmul, the rows of
                overloaded groups past C in row tiles, the weight indexed
                from `rhs`, never gathered per row; a custom VJP keeps the
                backward grouped too. A small problem gives every group M
                slots (`default_slot_rows`): one batched matmul, no loop
                (`blocked`).
  "kernel"      The backend's accelerator kernel, looked up in the
                registry (`registry.KERNEL`): this project's Pallas `gmm` /
                `tgmm` on TPU (`tpu/pallas_grouped`), Tokamax's Mosaic GPU
                and Triton kernels on GPU (`gpu/routes`).
                Operands a kernel does not take (int8, fp8) run "ragged_dot"
                with a `KernelFallbackWarning`; so does megablox inside a
                `shard_map` (the expert-parallel path under a mesh): a
                `pallas_call` gives its outputs no manual-axis type, which a
                `shard_map` checking them (`check_vma`) requires.
  "auto"        The backend's own choice (`registry.auto`): "blocked" on
                CPU; on TPU the Pallas kernels where the tile table
                measured them fastest for the nearest shape on the chip
                (`tpu/gmm_tiling`), else "ragged_dot"; on GPU the route
                the route table measured fastest for the nearest shape
                and not dense (`gpu/auto_table`), else "blocked" (the
                table ships unmeasured; XLA:GPU pads a ragged_dot's groups
                to dense where it does not reach cuDNN's grouped matmul).
                The platform is the one traced for
                (`platform.target_platform`: a plan's target mesh).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
import warnings

import jax
import jax.numpy as jnp

from linen_moe._src.kernels import accelerator as grouped_kernels
from linen_moe._src.kernels import blocked
from linen_moe._src.kernels import registry
from linen_moe._src.kernels.implementations import IMPLEMENTATIONS
from linen_moe._src.kernels.kernel import Kernel
from linen_moe._src.kernels.kernel import KernelFallbackWarning
from linen_moe._src.kernels.operand_shapes import check_shapes
from linen_moe._src.kernels.platform import target_platform


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
) -> jax.Array:
  """XLA's `jax.lax.ragged_dot`: the reference implementation."""
  return jax.lax.ragged_dot(
      lhs,
      rhs,
      group_sizes.astype(jnp.int32),
      preferred_element_type=preferred_element_type,
  )


def _resolve(
    implementation: str,
    backend: str | None,
    dtypes: tuple[Any, ...],
    shape: tuple[int, int, int, int] | None,
    stacklevel: int,
) -> tuple[str, Kernel | None]:
  """(the implementation, the loaded kernel where it is "kernel"): lookups
  in the registry (`registry.auto`, `registry.kernel_entry`)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"Unknown grouped matmul implementation {implementation!r}; allowed: "
        f"{IMPLEMENTATIONS}."
    )
  if implementation in ("ragged_dot", "blocked"):
    return implementation, None
  backend = backend or target_platform()
  if implementation == "auto":
    impl, entry = registry.auto(backend, shape, dtypes)
    if entry is None:
      return impl, None
    kernel, _ = registry.load(entry, backend)
    return ("kernel", kernel) if kernel is not None else ("ragged_dot", None)
  entry, missing = registry.kernel_entry(backend)
  kernel = None
  if entry is not None:
    kernel, missing = registry.load(entry, backend)
  if kernel is None:
    raise ValueError(
        f"Grouped matmul implementation 'kernel' is unavailable: {missing}. "
        "Available here: 'ragged_dot', 'blocked' (and 'auto')."
    )
  if kernel.takes(dtypes):
    return "kernel", kernel
  names = tuple(jnp.dtype(d).name for d in dtypes)
  warnings.warn(
      f"grouped_matmul='kernel': {kernel.name} takes "
      f"{kernel.describe_dtypes()} operands, not {names}; this grouped "
      "matmul runs jax.lax.ragged_dot instead.",
      KernelFallbackWarning,
      stacklevel=stacklevel + 1,
  )
  return "ragged_dot", None


def resolve_implementation(
    implementation: str,
    backend: str | None = None,
    dtypes: tuple[Any, ...] = (),
    shape: tuple[int, int, int, int] | None = None,
) -> str:
  """Maps "auto" to the fastest implementation available on `backend`.

  "kernel" where the backend's kernel does not take `dtypes` (int8, fp8)
  resolves to "ragged_dot" with a `KernelFallbackWarning` that names
  them (see `linen_moe._src.kernels.accelerator`).

  Args:
    implementation: one of `IMPLEMENTATIONS`.
    backend: "cpu", "gpu" or "tpu"; default `platform.target_platform()`.
    dtypes: operand dtypes, when known (kernels take only some).
    shape: (M, K, N, G) of lhs [M, K] x rhs [G, K, N], when known ("auto"
      on a TPU looks it up in the tile table, on a GPU in the route table).

  Raises:
    ValueError: for an unknown implementation, or "kernel" where the
      backend has no usable kernel at all (the message says what is
      missing).
  """
  return _resolve(implementation, backend, dtypes, shape, stacklevel=3)[0]


def paired_kernel(
    implementation: str,
    dtypes: tuple[Any, ...],
    shape: tuple[int, int, int, int],
) -> Callable[..., tuple[jax.Array, jax.Array]] | None:
  """The gate and up projections as one call (`Kernel.paired`: lhs [M, K]
  x two [G, K, N] weights, each way) where `implementation` runs an
  accelerator kernel that has it for `dtypes` and `shape` = (M, K, N, G),
  outside a `shard_map`, unless `accelerator.paired_gate_up(False)` turns
  the pairing off; else None (the caller makes two `grouped_matmul`
  calls)."""
  if not grouped_kernels.pairs_gate_up():
    return None
  impl, kernel = _resolve(implementation, None, dtypes, shape, stacklevel=3)
  if impl != "kernel" or jax.sharding.get_abstract_mesh().manual_axes:
    return None
  return kernel.paired


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: str = "auto",
    preferred_element_type=None,
    max_group_size: int | None = None,
) -> jax.Array:
  """[M, K] x [G, K, N] -> [M, N]; see the module docstring.

  `max_group_size`: a static bound on every group's size, when the caller
  knows one (see `blocked_grouped_matmul`); only "blocked" reads it.
  """
  check_shapes(lhs, rhs, group_sizes)
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(
        f"group_sizes must be integers; got dtype {group_sizes.dtype}."
    )
  shape = (*lhs.shape, rhs.shape[2], rhs.shape[0])
  impl, kernel = _resolve(
      implementation, None, (lhs.dtype, rhs.dtype), shape, stacklevel=2
  )
  if impl == "ragged_dot":
    return ragged_dot(lhs, rhs, group_sizes, preferred_element_type)
  if impl == "blocked":
    return blocked.blocked_grouped_matmul(
        lhs,
        rhs,
        group_sizes,
        preferred_element_type=preferred_element_type,
        max_group_size=max_group_size,
    )
  if not kernel.in_shard_map and jax.sharding.get_abstract_mesh().manual_axes:
    if implementation == "auto":
      return ragged_dot(lhs, rhs, group_sizes, preferred_element_type)
    warnings.warn(
        f"grouped_matmul='kernel': {kernel.name} cannot run inside a "
        "shard_map (its outputs carry no manual-axis type for check_vma); "
        "this grouped matmul runs jax.lax.ragged_dot instead.",
        KernelFallbackWarning,
        stacklevel=2,
    )
    return ragged_dot(lhs, rhs, group_sizes, preferred_element_type)
  return kernel.fn(lhs, rhs, group_sizes, preferred_element_type)
