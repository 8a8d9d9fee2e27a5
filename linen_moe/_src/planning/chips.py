"""The accelerators a plan knows: peak bf16 FLOP/s, memory and its bandwidth
per device (a JAX device: one chip of each kind here).

Figures from the vendors' pages (`Chip.source`), dense (no sparsity)
bf16 matmul peaks; memory in the decimal units the vendors quote. What a
plan compares its peak with is `Chip.usable_bytes`: for a TPU, the most
libtpu lets one program hold on a chip (more than the vendor's decimal
figure: a v5p's "95 GB" is 95.73 GiB to libtpu). Imports no jax.
"""

from __future__ import annotations

import dataclasses

from linen_moe._src.kernels.tpu.tpu_chips import TPU_DEVICE_KINDS

GB = 10**9
TB = 10**12


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's roofline figures, per JAX device.

  Attributes:
    name: the short name (`CHIPS` key), e.g. "v5p".
    description: what it is, e.g. "Cloud TPU v5p".
    peak_flops: dense bf16 matmul peak, FLOP/s.
    memory_bytes: device (HBM) memory as the vendor quotes it, bytes.
    memory_bandwidth: device memory bandwidth, bytes/s.
    source: where the figures come from.
    usable_bytes: the most one program may hold on the device (arguments,
      outputs and temporaries), bytes, where known: for a TPU, libtpu's
      limit (the largest program libtpu 0.0.50.1 compiles for one chip,
      found by bisection to 8 KiB; a v5e's runtime reports 16,909,336,064
      as its `bytes_limit`). None: `memory_bytes` (the GPUs: JAX
      preallocates 75 % of a GPU unless `XLA_PYTHON_CLIENT_MEM_FRACTION`
      says otherwise).
  """

  name: str
  description: str
  peak_flops: float
  memory_bytes: int
  memory_bandwidth: float
  source: str
  usable_bytes: int | None = None


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
            16_909_221_888,
        ),
        Chip(
            "v5p",
            "Cloud TPU v5p",
            459e12,
            95 * GB,
            2765 * GB,
            "https://cloud.google.com/tpu/docs/v5p",
            102_786_531_328,
        ),
        Chip(
            "v6e",
            "Cloud TPU v6e (Trillium)",
            918e12,
            32 * GB,
            1638 * GB,
            "https://cloud.google.com/tpu/docs/v6e",
            33_545_953_280,
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
    *TPU_DEVICE_KINDS,
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
      return CHIPS.get(name)
  return None
