"""The two training front ends by name: the Linen decoder's
(`linen_moe.training.LinenFrontend`) and the NNX decoder's
(`nnx_adapter.NNXFrontend`), each with its sharded training.

The command line and the tests hold the same registry; benchmarks import
neither, so this is theirs until the library has a public one.
"""

from __future__ import annotations

from typing import Any

from linen_moe import training

FRONTENDS = ("linen", "nnx")


def frontend(name: str) -> Any:
  """The `linen_moe.training.TrainingFrontend` called `name`."""
  if name == "nnx":
    import nnx_adapter  # noqa: PLC0415 (imports flax.nnx)

    return nnx_adapter.NNXFrontend
  if name == "linen":
    return training.LinenFrontend
  raise ValueError(f"Unknown front end {name!r}; allowed: {FRONTENDS}.")


def sharded_training(name: str, cfg, optimizer, mesh) -> Any:
  """The sharded init and step of front end `name`'s decoder on `mesh`."""
  return frontend(name).sharded(cfg, optimizer, mesh)
