"""A training run's throughput, step by step: tokens per second, model
TFLOP/s and MFU (where the device's peak is known), the optional profiler
trace of a range of steps, and the optional TensorBoard scalars.

The model FLOPs of a step come from the config
(`linen_moe.planning.model_flops`); a step's time runs from fetching its
batch to its loss on the host (a step syncs there), so evaluation and
checkpoint saves between steps are not counted. The first step's time
includes its compile.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from linen_moe._src.training.metric_names import TIMING_METRICS

PROFILE_DIR = "profile"
__all__ = ["PROFILE_DIR", "TIMING_METRICS", "Throughput"]


class Throughput:
  """Times steps and turns each into its throughput metrics.

  Example usage:
    meter = Throughput(cfg, batch_size=16, seq_len=32, devices=devices)
    meter.start()
    ...  # the step, its loss fetched to the host
    metrics.update(meter.stop())
  """

  def __init__(self, cfg, batch_size: int, seq_len: int, devices: list):
    from linen_moe._src.planning import chips  # noqa: PLC0415
    from linen_moe._src.planning import flops  # noqa: PLC0415

    self.tokens = batch_size * seq_len
    self.flops = flops.model_flops(cfg, batch_size, seq_len)
    chip = chips.chip_of(devices[0].device_kind) if devices else None
    self.peak = None if chip is None else chip.peak_flops * len(devices)
    self._start = None

  def start(self) -> None:
    """Marks the start of a step."""
    self._start = time.perf_counter()

  def stop(self) -> dict[str, float]:
    """The throughput of the step since `start` (`of` its time)."""
    return self.of(time.perf_counter() - self._start)

  def of(self, seconds: float) -> dict[str, float]:
    """The throughput of a step that took `seconds`.

    Returns:
      `tokens_per_s` (the global batch's tokens), `model_tflops_per_s`
      and, where the device's peak is known, `mfu` (model FLOPs over the
      devices' peak).
    """
    seconds = max(seconds, 1e-9)
    out = {
        "tokens_per_s": self.tokens / seconds,
        "model_tflops_per_s": self.flops / seconds / 1e12,
    }
    if self.peak is not None:
      out["mfu"] = self.flops / seconds / self.peak
    return out


class Profiler:
  """Traces steps A to B (1-based, inclusive) with `jax.profiler` into
  `directory`; does nothing when `steps` is None."""

  def __init__(self, steps: tuple[int, int] | None, directory: str | None):
    self.steps = steps
    self.directory = directory
    self.active = False

  def before(self, step: int) -> None:
    """Called before step `step` (1-based) runs."""
    if self.steps is not None and step == self.steps[0] and not self.active:
      import jax  # noqa: PLC0415

      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after(self, step: int) -> None:
    """Called after step `step` (1-based) finished (its loss on the host)."""
    if self.active and step >= self.steps[1]:
      self.close()

  def close(self) -> None:
    """Stops a trace still running (a run that ended or failed inside the
    range)."""
    if self.active:
      import jax  # noqa: PLC0415

      self.active = False
      jax.profiler.stop_trace()


class TensorBoard:
  """Writes each step's scalar metrics as TensorBoard scalars (tensorboardX)
  into `directory`; does nothing when it is None."""

  def __init__(self, directory: str | None):
    self.writer = None
    if directory is not None:
      from tensorboardX import SummaryWriter  # noqa: PLC0415

      self.writer = SummaryWriter(directory)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """The finite scalars of `metrics` at `step`."""
    if self.writer is None:
      return
    for name, value in metrics.items():
      scalar = _scalar(value)
      if scalar is not None:
        self.writer.add_scalar(name, scalar, step)

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
      self.writer = None


def _scalar(value: Any) -> float | None:
  """A finite float of a Python or 0-d array number, else None."""
  if isinstance(value, bool):
    return None
  if getattr(value, "ndim", 0) != 0 or getattr(value, "size", 1) != 1:
    return None
  try:
    scalar = float(value)
  except (TypeError, ValueError):
    return None
  return scalar if math.isfinite(scalar) else None
