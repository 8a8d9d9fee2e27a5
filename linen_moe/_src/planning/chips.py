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
