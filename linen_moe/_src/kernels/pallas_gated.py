"""A gated MLP's down projection with its gated product inside the Pallas
kernels: product(gate, up) [M, H] x rhs [G, H, N] -> [M, N].

  forward  `gmm((gate, up), rhs, prologue=product)`                [M, N]
  d_gate, d_up  `gmm(dout, rhs, transpose_rhs=True, epilogue=the
                product's VJP, row_operands=(gate, up), outputs=2)`  [M, H] x 2
  drhs     `tgmm((gate, up), dout, prologue=product)`              [G, H, N]

`product` is elementwise (the expert's act(gate) * up): each kernel
computes it, or its VJP, on tiles already in VMEM, so the hidden
activation [M, H] and its gradient are never written to HBM, and no pass
of their own reads gate and up (on a v5e, 4.3 of the 51.8 ms of a Mixtral-
sized layer's forward and backward: benchmarks/device/README.md). The
product and its VJP run in float32; the hidden tile is cast to the
operands' dtype before the MXU, as an unfused hidden activation is stored.

The contract and the checks are `pallas_grouped`'s (rows sorted by group,
rows past sum(group_sizes) zero in the output and in both input
gradients), gate and up of one shape and dtype. Tiles are those of the
unfused problem (`gmm_tiling.choose_tiling` for [M, H] x [G, H, N]), the
VMEM limit raised for the fused operands' blocks where they need it.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools

import jax
import jax.numpy as jnp

from linen_moe._src.kernels import gmm_tiling
from linen_moe._src.kernels import pallas_gmm
from linen_moe._src.kernels import pallas_grouped
from linen_moe._src.kernels.gmm_tiling import GmmTiling

Product = Callable[[jax.Array, jax.Array], jax.Array]


def fused_vmem_bytes(tiling: GmmTiling, h: int, n: int, dtype) -> int:
  """VMEM of the three fused kernels' blocks with `tiling` (of [M, H] x
  [G, H, N] in `dtype`), the largest of them."""
  gmm = pallas_gmm.gmm_vmem_bytes(
      tiling.gmm, dtype, dtype, dtype, h // tiling.gmm[1], lhs_operands=2
  )
  gmm_t = pallas_gmm.gmm_vmem_bytes(
      tiling.gmm_t,
      dtype,
      dtype,
      dtype,
      n // tiling.gmm_t[1],
      row_operands=2,
      outputs=2,
  )
  tgmm = pallas_gmm.tgmm_vmem_bytes(
      tiling.tgmm, dtype, dtype, dtype, lhs_operands=2
  )
  return max(gmm, gmm_t, tgmm)


def fused_tiling(
    m: int, h: int, n: int, g: int, dtype, chip: str | None
) -> GmmTiling:
  """The unfused problem's tiles, with the VMEM limit its fused blocks
  need (`gmm_tiling.vmem_limit`)."""
  tiling = gmm_tiling.choose_tiling(m, h, n, g, dtype, chip)
  need = fused_vmem_bytes(tiling, h, n, dtype)
  return dataclasses.replace(
      tiling, vmem_limit_bytes=gmm_tiling.vmem_limit(need, chip)
  )


# Cached: one epilogue per product, so that the kernel (a jit with the
# epilogue static) is traced once per product, not once per call.
@functools.cache
def _product_vjp(product: Product):
  """`epilogue(dh, gate, up) -> (d_gate, d_up)`: the VJP of `product`."""

  def epilogue(dh, gate, up):
    return jax.vjp(product, gate, up)[1](dh)

  return epilogue


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _gated(gate, up, rhs, group_sizes, product, out_dtype, tiling, interpret):
  options = dict(tiling=tiling.gmm, out_dtype=out_dtype, prologue=product)
  return pallas_gmm.gmm(
      (gate, up), rhs, group_sizes, **options, **_run(tiling, interpret)
  )


def _run(tiling: GmmTiling, interpret: bool) -> dict:
  return dict(interpret=interpret, vmem_limit_bytes=tiling.vmem_limit_bytes)


def _gated_fwd(gate, up, rhs, group_sizes, product, out_dtype, tiling, interp):
  out = _gated(gate, up, rhs, group_sizes, product, out_dtype, tiling, interp)
  return out, (gate, up, rhs, group_sizes)


def _gated_bwd(product, out_dtype, tiling, interpret, residuals, dout):
  del out_dtype
  gate, up, rhs, group_sizes = residuals
  run = _run(tiling, interpret)
  d_gate, d_up = pallas_gmm.gmm(
      dout,
      rhs,
      group_sizes,
      tiling=tiling.gmm_t,
      out_dtype=gate.dtype,
      transpose_rhs=True,
      epilogue=_product_vjp(product),
      row_operands=(gate, up),
      outputs=2,
      **run,
  )
  drhs = pallas_gmm.tgmm(
      (gate, up),
      dout,
      group_sizes,
      tiling=tiling.tgmm,
      out_dtype=rhs.dtype,
      prologue=product,
      **run,
  )
  return d_gate, d_up, drhs, None


_gated.defvjp(_gated_fwd, _gated_bwd)


def gated_grouped_matmul(
    gate: jax.Array,
    up: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    product: Product,
    preferred_element_type=None,
    *,
    tiling: GmmTiling | None = None,
    interpret: bool = False,
    chip: str | None = None,
) -> jax.Array:
  """product(gate, up) [M, H] x rhs [G, H, N] -> [M, N], with its VJP.

  `pallas_grouped.pallas_grouped_matmul(product(gate, up), rhs,
  group_sizes, preferred_element_type, tiling=, interpret=, chip=)` with
  the product inside the kernels: the same arguments (the default tiles
  `fused_tiling`'s), lhs given as `gate` and `up` ([M, H] each, one dtype)
  and the elementwise `product` (hashable: a static argument of the
  kernels, traced in float32 inside them). Returns the same [M, N]; the
  gradients of gate and up are [M, H] in their dtype (zeros past
  sum(group_sizes)), rhs's [G, H, N] in its dtype.

  Raises:
    ValueError: shapes that do not fit (`pallas_grouped`'s checks), or
      gate and up of different shapes.
    TypeError: a dtype the kernels do not take, or gate and up of
      different dtypes.
  """
  if gate.shape != up.shape:
    raise ValueError(
        f"gate and up must have one shape; got {gate.shape} and {up.shape}."
    )
  if gate.dtype != up.dtype:
    raise TypeError(
        f"gate and up must have one dtype; got {gate.dtype} and {up.dtype}."
    )
  out_dtype = pallas_grouped.check_operands(
      gate, rhs, group_sizes, preferred_element_type
  )
  (m, h), (g, _, n) = gate.shape, rhs.shape
  pallas_grouped.check_group_sizes(group_sizes, m)
  if min(m, h, n, g) == 0:
    return jnp.zeros((m, n), out_dtype)
  if tiling is None:
    dtype = pallas_gmm.compute_dtype(gate.dtype, rhs.dtype)
    chip = chip or gmm_tiling.current_chip()
    tiling = fused_tiling(m, h, n, g, dtype, chip)
  pallas_grouped.check_tiling(tiling, h, n)
  sizes = group_sizes.astype(jnp.int32)
  return _gated(gate, up, rhs, sizes, product, out_dtype, tiling, interpret)
