"""The platform a program is traced for.

`jax.default_backend()` is the platform this process runs on; a program
traced under a mesh of a TPU topology or of compile-only GPUs (a plan,
`linen_moe.planning`, compiled on a CPU host) is for that mesh's devices.
Every choice made by platform while tracing (the grouped matmul's
implementation and accumulation, the attention kernel, the emulated
collectives) asks `target_platform`, so a plan compiles what a run on the
target would.
"""

from __future__ import annotations

import jax


def target_platform() -> str:
  """ "cpu", "gpu" or "tpu": the current mesh's devices' platform (the mesh
  of `jax.set_mesh` / `sharding.mesh_context`, or the abstract mesh
  being traced under), else `jax.default_backend()`."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  platform = getattr(device, "platform", None)
  if platform in {"cuda", "rocm"}:
    return "gpu"
  return platform or jax.default_backend()
