"""Compiles the Pallas grouped matmul, forward + backward, for one chip of
a TPU target through libtpu's topology (no TPU needed): the problems of
tests/kernels/test_tpu_kernels.py with their tiles (float32 and bfloat16), and
`SHAPE` with the tiles the package chooses, and there the int8 kernel with
its scales (forward and transposed). Prints as JSON each program's
`cost_analysis()` FLOPs and its useful ones (3 x 2 M K N forward +
backward, 2 M K N an int8 call). Run by
tests/kernels/test_gmm_tiling.py in a process of its own (the target is set before
jax starts).

  python -m tests.gmm_tpu_worker TARGET
"""

from __future__ import annotations

import json
import sys

from linen_moe import planning

# The Mixtral-like expert matmul: 8192 rows, 8 experts of 2048 x 5632.
SHAPE = (8192, 2048, 5632, 8)


def main(target_name: str) -> None:
  target = planning.parse_target(target_name)
  planning.prepare_process(target)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from linen_moe._src.kernels.tpu import pallas_grouped  # noqa: PLC0415
  from linen_moe._src.kernels.tpu import pallas_int8  # noqa: PLC0415
  from linen_moe._src.kernels.tpu import tpu_chips  # noqa: PLC0415
  from tests import gmm_cases  # noqa: PLC0415
  from tests.kernels import test_tpu_kernels  # noqa: PLC0415

  device = planning.target_devices(target)[0]
  chip = tpu_chips.tpu_chip_name(device.device_kind)
  whole = jax.sharding.NamedSharding(
      jax.sharding.Mesh([device], ("x",)), jax.sharding.PartitionSpec()
  )

  def flops(m, k, n, g, dtype, tiling):
    def step(lhs, rhs, sizes, dout):
      return gmm_cases.fwd_bwd(
          lambda a, b, s: pallas_grouped.pallas_grouped_matmul(
              a, b, s, tiling=tiling, chip=chip
          ),
          lhs,
          rhs,
          sizes,
          dout,
      )

    args = [
        jax.ShapeDtypeStruct(shape, t, sharding=whole)
        for shape, t in (
            ((m, k), dtype),
            ((g, k, n), dtype),
            ((g,), jnp.int32),
            ((m, n), dtype),
        )
    ]
    cost = jax.jit(step).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops": cost["flops"], "useful": 3 * 2 * m * k * n}

  out = {}
  for name, (m, k, n, sizes, tiling) in test_tpu_kernels.PROBLEMS.items():
    for dtype in (jnp.float32, jnp.bfloat16):
      key = f"{name}_{jnp.dtype(dtype).name}"
      out[key] = flops(m, k, n, len(sizes), dtype, tiling)
  out["issue_shape"] = flops(*SHAPE, jnp.bfloat16, None)

  def int8_flops(m, k, n, g, transpose_rhs):
    def step(q_lhs, lhs_scale, q_rhs, rhs_scale, sizes):
      return pallas_int8.int8_grouped_matmul_scaled(
          q_lhs,
          lhs_scale,
          q_rhs,
          rhs_scale,
          sizes,
          transpose_rhs=transpose_rhs,
          chip=chip,
      )

    c, o = (n, k) if transpose_rhs else (k, n)
    args = [
        jax.ShapeDtypeStruct(shape, t, sharding=whole)
        for shape, t in (
            ((m, c), jnp.int8),
            ((m, 1), jnp.float32),
            ((g, k, n), jnp.int8),
            ((g, 1, o), jnp.float32),
            ((g,), jnp.int32),
        )
    ]
    cost = jax.jit(step).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops": cost["flops"], "useful": 2 * m * k * n}

  out["int8_issue_shape"] = int8_flops(*SHAPE, False)
  out["int8_issue_shape_t"] = int8_flops(*SHAPE, True)
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
