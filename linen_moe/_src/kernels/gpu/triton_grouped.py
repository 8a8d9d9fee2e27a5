"""Our Pallas-Triton grouped matmul with its gradients, for NVIDIA GPUs:
lhs [M, K] x rhs [G, K, N] -> [M, N], the contract of `grouped_matmul`
(rows sorted by group, rows past sum(group_sizes) zero, and so are their
input gradients; an empty group's weight gradient zero).

  forward  `triton_gmm.gmm(lhs, rhs)`                       [M, N]
  dlhs     `triton_gmm.gmm(dout, rhs, transpose_rhs=True)`  [M, K]
  drhs     `triton_gmm.tgmm(lhs, dout)`                     [G, K, N]

Every check runs before any work, at trace time, and each raises one error
naming the argument, its value and what is allowed: ranks and shapes
(`ValueError`), operand and output dtypes (float16, bfloat16, float32: a
`TypeError`), the tiles (`triton_tiles.Tiling.check`), and, when they are
concrete (not traced), group sizes that are negative or sum past M. Traced
sizes cannot be checked: negative ones count as 0 and rows past M are
dropped, as `jax.lax.ragged_dot` does.

On a GPU the kernels compile through Pallas' Triton backend (jax 0.11.2
and 0.12 both lower them; jax 0.12 warns that this backend is deprecated
in favour of Mosaic GPU); anywhere, `interpret=True` runs the same kernel
programs in Pallas interpret mode (how this CPU host tests them). Tiles
default to `triton_tiles.choose_tiling` (its table ships empty: the
defaults are unmeasured).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linen_moe._src.kernels import kernel_vjp
from linen_moe._src.kernels.gpu import triton_gmm
from linen_moe._src.kernels.gpu import triton_tiles
from linen_moe._src.kernels.gpu.triton_tiles import Tiling
from linen_moe._src.kernels.operand_shapes import check_dtypes
from linen_moe._src.kernels.operand_shapes import check_group_sizes
from linen_moe._src.kernels.operand_shapes import check_shapes

OPERAND_DTYPES = tuple(
    jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32)
)
TITLE = "the Pallas-Triton grouped matmul"


def check_operands(lhs, rhs, group_sizes, preferred_element_type) -> jnp.dtype:
  """Checks ranks, shapes, dtypes and concrete group sizes; returns the
  output dtype.

  Raises:
    ValueError: a rank or shape that does not fit; group sizes negative or
      summing past M.
    TypeError: a dtype the kernel does not take.
  """
  check_shapes(lhs, rhs, group_sizes)
  out = check_dtypes(
      lhs, rhs, group_sizes, preferred_element_type, OPERAND_DTYPES, TITLE
  )
  check_group_sizes(group_sizes, lhs.shape[0])
  return out


def _device_kind() -> str | None:
  """This process's GPU ("NVIDIA H200"), or None off a GPU (a program
  traced here for another device takes the default tiles)."""
  device = jax.devices()[0]
  return device.device_kind if device.platform == "gpu" else None


def _run_pass(op, a, b, group_sizes, tiling, out_dtype, interpret):
  """One pass of `kernel_vjp.with_vjp` with its tiles of `tiling`."""
  if op == "tgmm":
    return triton_gmm.tgmm(
        a,
        b,
        group_sizes,
        tiles=tiling.tgmm,
        out_dtype=out_dtype,
        interpret=interpret,
    )
  return triton_gmm.gmm(
      a,
      b,
      group_sizes,
      tiles=getattr(tiling, op),
      out_dtype=out_dtype,
      transpose_rhs=op == "gmm_t",
      interpret=interpret,
  )


_gmm = kernel_vjp.with_vjp(_run_pass)


def triton_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
    *,
    tiling: Tiling | None = None,
    interpret: bool = False,
    device_kind: str | None = None,
) -> jax.Array:
  """[M, K] x [G, K, N] -> [M, N] with our Pallas-Triton kernels and their
  VJP (both gradients run the kernels).

  Args:
    lhs: [M, K] float16, bfloat16 or float32, rows sorted by group.
    rhs: [G, K, N] float16, bfloat16 or float32.
    group_sizes: <int>[G], rows per group (sum <= M).
    preferred_element_type: the output dtype (one of the operand dtypes);
      default the operands' result type. Accumulation is float32
      regardless.
    tiling: the tiles of the three passes; default
      `triton_tiles.choose_tiling` for `device_kind` (unmeasured defaults
      where its table has no entry).
    interpret: run the kernels in Pallas interpret mode (any backend).
    device_kind: the GPU whose tiles to use ("NVIDIA H200"); default this
      process's first device's.

  Returns:
    [M, N]; rows past sum(group_sizes) are zeros. Gradients: dlhs [M, K] in
    lhs's dtype (zeros past sum(group_sizes)), drhs [G, K, N] in rhs's
    dtype (zeros for empty groups).

  Raises:
    ValueError, TypeError: see the module docstring.
  """
  out_dtype = check_operands(lhs, rhs, group_sizes, preferred_element_type)
  (m, k), (g, _, n) = lhs.shape, rhs.shape
  if tiling is None:
    dtype = triton_gmm.compute_dtype(lhs.dtype, rhs.dtype)
    kind = device_kind or _device_kind()
    tiling = triton_tiles.choose_tiling(m, k, n, g, dtype, kind)
  if not isinstance(tiling, Tiling):
    raise ValueError(f"tiling must be a Tiling or None; got {tiling!r}.")
  tiling.check()
  if min(m, k, n, g) == 0:
    return jnp.zeros((m, n), out_dtype)
  return _gmm(
      lhs, rhs, group_sizes.astype(jnp.int32), out_dtype, tiling, interpret
  )
