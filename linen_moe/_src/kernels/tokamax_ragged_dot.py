"""`tokamax.ragged_dot` behind the grouped matmul's contract: the Tokamax
routes of the registry (on a GPU its Pallas Mosaic GPU and Triton kernels,
on a TPU its Mosaic TPU kernel, anywhere its XLA implementation).

Known bugs guarded here:
  - openxla/tokamax#887: Tokamax's weight gradient gave non-zero gradients to
    empty groups. The wrapper's VJP zeroes the weight gradient of every empty
    group, the input gradient of every row past sum(group_sizes), and those
    rows of the output.
  - jax-ml/jax#34168: `ragged_dot`'s `group_offset` is unimplemented on GPU.
    Nothing here passes one: under expert parallelism each device is given
    only its own experts' weights, never a group offset into all of them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from linen_moe._src.kernels.kernel import rows_valid


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
  valid = rows_valid(lhs.shape[0], group_sizes)
  return jnp.where(valid[:, None], out, 0)


def _tokamax_fwd(lhs, rhs, group_sizes, preferred_element_type, impl):
  out, vjp = jax.vjp(
      lambda a, b: _tokamax_call(
          a, b, group_sizes, preferred_element_type, impl
      ),
      lhs,
      rhs,
  )
  valid = rows_valid(lhs.shape[0], group_sizes)
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


def pallas_tpu_interpreted():
  """Tokamax's Pallas Mosaic TPU ragged dot in interpret mode, forward and
  VJP (the dlhs and drhs ragged dots are the same kernel). Its default
  tiles come from the TPU generation, which a CPU lacks, so they are given,
  and its device check is bypassed, in the VJP's ops too (Tokamax builds
  those without the bypass: "NotImplementedError: Not supported on cpu").
  Tokamax requires every non-group dimension >= 128, and reads the TPU
  generation from the abstract mesh: trace under
  `jax.sharding.use_abstract_mesh` of an `AbstractMesh` whose
  `abstract_device` is a TPU."""
  from tokamax._src.ops.ragged_dot import base
  from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as pmt

  config = pmt.Config(tile_m=128, tile_k=128, tile_n=128)
  inner = pmt.PallasMosaicTpuRaggedDot(
      interpret=True, config=config, bypass_device_check=True
  )
  vjp = functools.partial(
      base.vjp, dlhs_ragged_dot=inner, drhs_ragged_dot=inner
  )
  return pmt.PallasMosaicTpuRaggedDot(
      interpret=True, config=config, bypass_device_check=True, vjp=vjp
  )


def load(implementation: Any = None, interpret: bool = False):
  """`tokamax_ragged_dot` with `implementation` fixed (an interpreted
  Mosaic TPU op where `interpret` and the implementation is "mosaic_tpu").

  Raises:
    ImportError: tokamax is not importable.
  """
  try:
    import tokamax  # noqa: F401
  except ImportError as e:
    raise ImportError(f"tokamax (pip install 'linen_moe[kernels]'): {e}") from e
  if implementation == "mosaic_tpu":
    implementation = (pallas_tpu_interpreted(),) if interpret else ("mosaic",)
  return functools.partial(tokamax_ragged_dot, implementation=implementation)
