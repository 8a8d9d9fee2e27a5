"""The accelerators a plan knows: peak bf16 FLOP/s, memory and its bandwidth
per device (a JAX device: one chip of each kind here).

Figures from the vendors' pages (`Chip.source`), dense (no sparsity)
bf16 matmul peaks; memory in the decimal units the vendors quote. Imports
no jax.
"""

from __future__ import annotations

import dataclasses

GB = 10**9
TB = 10**12


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's roofline figures, per JAX device.

  Attributes:
    name: the short name (`CHIPS` key), e.g. "v5p".
    description: what it is, e.g. "Cloud TPU v5p".
    peak_flops: dense bf16 matmul peak, FLOP/s.
    memory_bytes: device (HBM) memory, bytes.
    memory_bandwidth: device memory bandwidth, bytes/s.
    source: where the figures come from.
  """

  name: str
  description: str
  peak_flops: float
  memory_bytes: int
  memory_bandwidth: float
  source: str


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip(
            "v5e",
            "Cloud TPU v5e",
            197e12,
            16 * GB,
            819 * GB,
            "https://cloud.google.com/tpu/docs/v5e",
        ),
        Chip(
            "v5p",
            "Cloud TPU v5p",
            459e12,
            95 * GB,
            2765 * GB,
            "https://cloud.google.com/tpu/docs/v5p",
        ),
        Chip(
            "v6e",
            "Cloud TPU v6e (Trillium)",
            918e12,
            32 * GB,
            1638 * GB,
            "https://cloud.google.com/tpu/docs/v6e",
        ),
        Chip(
            "h100",
            "NVIDIA H100 SXM",
            989e12,
            80 * GB,
            3.35 * TB,
            "https://www.nvidia.com/en-us/data-center/h100/",
        ),
        Chip(
            "h200",
            "NVIDIA H200 SXM",
            989e12,
            141 * GB,
            4.8 * TB,
            "https://www.nvidia.com/en-us/data-center/h200/",
        ),
    )
}


# `jax.Device.device_kind` -> chip name (the kinds JAX reports; a kind
# that starts with one of these, e.g. "NVIDIA H100 80GB HBM3").
_KINDS = (
    ("TPU v5 lite", "v5e"),
    ("TPU v5e", "v5e"),
    ("TPU v5p", "v5p"),
    ("TPU v5", "v5p"),
    ("TPU v6 lite", "v6e"),
    ("TPU v6e", "v6e"),
    ("NVIDIA H100", "h100"),
    ("NVIDIA H200", "h200"),
)


def chip_of(device_kind: str) -> Chip | None:
  """The chip of a JAX device kind, or None for one not in `CHIPS`.

  Args:
    device_kind: `jax.Device.device_kind`, e.g. "TPU v5 lite" or "NVIDIA
      H100 80GB HBM3" (a CPU's: None).

  Returns:
    The `Chip`, or None.
  """
  for prefix, name in _KINDS:
    if device_kind.startswith(prefix):
      return CHIPS[name]
  return None
