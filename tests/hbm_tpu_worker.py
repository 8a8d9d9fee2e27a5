"""Compiles, through libtpu's topology (no TPU needed), a program for one
chip of the slice that holds `usable_bytes` of the target's chip less a
margin, and one that holds the same plus the margin; prints as JSON
whether each compiled (`CompileTimeHbmOom` is not compiling). Run by
tests/planning/test_cli_plan.py in a process of its own (the target is set before
jax starts).

  python -m tests.hbm_tpu_worker TARGET MARGIN_BYTES
"""

from __future__ import annotations

import json
import sys

from linen_moe import planning


def main(target_name: str, margin: int) -> None:
  target = planning.parse_target(target_name)
  planning.prepare_process(target)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  device = planning.target_devices(target)[0]
  mesh = jax.sharding.Mesh([device], ("x",))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  double = jax.jit(lambda x: x * 2, in_shardings=whole, out_shardings=whole)

  def compiles(total: int) -> bool:
    # An argument and an output of total / 2 bytes each, no temporaries.
    x = jax.ShapeDtypeStruct((total // 8,), jnp.float32, sharding=whole)
    try:
      double.lower(x).compile()
    except jax.errors.JaxRuntimeError as e:
      if "CompileTimeHbmOom" not in str(e):
        raise
      return False
    return True

  usable = target.device_memory_bytes
  print(
      json.dumps({
          "below": compiles(usable - margin),
          "above": compiles(usable + margin),
      })
  )


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
