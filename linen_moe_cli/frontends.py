"""The command line's front ends by name: "linen" or "nnx"."""

from __future__ import annotations

from linen_moe.training import LinenFrontend
from linen_moe.training import TrainingFrontend

FRONTENDS = ("linen", "nnx")


def frontend(name: str) -> TrainingFrontend:
  """The `TrainingFrontend` called `name` (NNX imported only when asked)."""
  if name == "linen":
    return LinenFrontend
  if name == "nnx":
    import nnx_adapter  # noqa: PLC0415 (optional front end)

    return nnx_adapter.NNXFrontend
  raise ValueError(f"Unknown front end {name!r}; allowed: {FRONTENDS}.")
