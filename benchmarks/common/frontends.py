"""The two training front ends by name: the Linen decoder's
(`linen_moe.training.LinenFrontend`) and the NNX decoder's
(`nnx_adapter.NNXFrontend`), each with its sharded training, from the
library's one registry (`linen_moe.training.frontend`).
"""

from __future__ import annotations

from typing import Any

from linen_moe import training
import nnx_adapter  # noqa: F401 (registers the "nnx" front end)

FRONTENDS = tuple(training.FRONTENDS)
frontend = training.frontend


def sharded_training(name: str, cfg, optimizer, mesh) -> Any:
  """The sharded init and step of front end `name`'s decoder on `mesh`."""
  return frontend(name).sharded(cfg, optimizer, mesh)
