"""TPU generations as the kernels see them: which JAX device kinds are
which chip, and each one's VMEM and roofline figures (one JAX device).
Imports no jax (the planner's chip table reads the device kinds here).
"""

from __future__ import annotations

import dataclasses

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TpuChip:
  """What the kernels' tile rule knows of a TPU generation.

  Attributes:
    name: "v5e", ... (the tile table's `chip`).
    vmem_bytes: VMEM of one TensorCore.
    peak_flops: bf16 matmul FLOP/s of one JAX device.
    hbm_bandwidth: bytes/s of one JAX device.
  """

  name: str
  vmem_bytes: int
  peak_flops: float
  hbm_bandwidth: float


TPU_CHIPS = {
    c.name: c
    for c in (
        TpuChip("v4", 32 * MiB, 275e12, 1228e9),
        TpuChip("v5e", 128 * MiB, 197e12, 819e9),
        TpuChip("v5p", 64 * MiB, 459e12, 2765e9),
        TpuChip("v6e", 128 * MiB, 918e12, 1640e9),
        TpuChip("v7x", 64 * MiB, 2307e12, 7380e9),
    )
}

# `jax.Device.device_kind` prefix -> chip name, the more specific first
# ("TPU v5 lite" before "TPU v5").
TPU_DEVICE_KINDS = (
    ("TPU v5 lite", "v5e"),
    ("TPU v5e", "v5e"),
    ("TPU v5p", "v5p"),
    ("TPU v5", "v5p"),
    ("TPU v6 lite", "v6e"),
    ("TPU v6e", "v6e"),
    ("TPU7x", "v7x"),
    ("TPU v4", "v4"),
)


def tpu_chip_name(device_kind: str | None) -> str | None:
  """The chip name of a JAX device kind ("TPU v5 lite" -> "v5e"), or None
  for one that is no TPU known here."""
  for prefix, name in TPU_DEVICE_KINDS:
    if device_kind and device_kind.startswith(prefix):
      return name
  return None
