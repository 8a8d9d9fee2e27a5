"""What a compiled step costs, by the compiler's count and by a roofline:
the compiler's cost analysis read as one dict (empty where it gives none,
and why), and a step's roofline time and MFU bound from a chip's figures
(`chips.Chip`). Used by `plan`; imports no jax.
"""

from __future__ import annotations

from linen_moe._src.planning.chips import Chip
from linen_moe._src.planning.targets import Target


def compiled_cost(compiled) -> dict[str, float]:
  """The compiler's cost analysis of `compiled` as one dict: empty where
  it gives none (XLA:GPU compiled without a GPU returns None; a backend
  may raise instead).

  Args:
    compiled: a `jax.stages.Compiled`.

  Returns:
    {"flops": ..., "bytes accessed": ..., ...}, or {}.
  """
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 (a backend without cost analysis)
    return {}
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return dict(cost or {})


def roofline(
    flops_per_device: float, bytes_per_device: float, chip: Chip
) -> tuple[float, float, str]:
  """A step's roofline on one device of `chip`.

  Args:
    flops_per_device: the model FLOPs each device does.
    bytes_per_device: the bytes each device reads and writes.
    chip: a `chips.Chip` (its peak FLOP/s and memory bandwidth).

  Returns:
    (step seconds: the slower of the FLOPs at the peak and the bytes at
    the bandwidth, a lower bound; MFU in that time, an upper bound, 1.0
    when compute-bound; "compute" or "memory", whichever bounds it).
  """
  compute_s = flops_per_device / chip.peak_flops
  memory_s = bytes_per_device / chip.memory_bandwidth
  step_s = max(compute_s, memory_s)
  bound = "compute" if compute_s >= memory_s else "memory"
  return step_s, compute_s / step_s, bound


def no_compiler_flops(target: Target, compiled) -> str:
  """Why a plan has no compiler FLOP count.

  Args:
    target: what the step was compiled for.
    compiled: the compiled step, or None where it did not compile.

  Returns:
    The reason, e.g. "XLA:GPU gives no cost analysis without the GPU".
  """
  if compiled is None:
    return "the step did not compile"
  if target.platform == "gpu":
    return "XLA:GPU gives no cost analysis without the GPU"
  return "the compiler gave no cost analysis"
