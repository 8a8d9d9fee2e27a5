"""Compiles splash attention's forward and backward for a TPU slice
through libtpu's topology (no TPU needed), with the head widths given, and
prints the compiled temp bytes as JSON. Run by tests/models/test_attention.py in
a process of its own (the target is set before jax starts).

  python -m tests.splash_tpu_worker TARGET SEQ DK DV
"""

from __future__ import annotations

import json
import sys

from linen_moe import planning


def main(target_name: str, seq: int, dk: int, dv: int) -> None:
  target = planning.parse_target(target_name)
  planning.prepare_process(target)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe._src.models import attention  # noqa: PLC0415

  devices = planning.target_devices(target)
  n, heads = len(devices), 4
  mesh = linen_moe.sharding.make_mesh(f"data={n}", devices)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

  def loss(q, k, v):
    pos = jnp.broadcast_to(jnp.arange(seq), (n, seq))
    out = attention.attend(
        q,
        k,
        v,
        positions=pos,
        key_positions=pos,
        window=0,
        scale=dk**-0.5,
        dtype=jnp.bfloat16,
        implementation="splash",
        self_attention=True,
    )
    return jnp.sum(out.astype(jnp.float32))

  shapes = [(n, seq, heads, d) for d in (dk, dk, dv)]
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rows) for s in shapes]
  with linen_moe.sharding.mesh_context(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  print(
      json.dumps({"temp_bytes": compiled.memory_analysis().temp_size_in_bytes})
  )


if __name__ == "__main__":
  main(sys.argv[1], *(int(x) for x in sys.argv[2:5]))
