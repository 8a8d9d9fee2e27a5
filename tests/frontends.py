"""The two training front ends by name, for tests that run both.

Here rather than in `linen_moe.testing`: the NNX front end lives in
`nnx_adapter`, which `linen_moe` never imports (dependencies run
nnx_adapter -> linen_moe).
"""

from __future__ import annotations

from linen_moe import Decoder
from linen_moe.training import LinenFrontend
from linen_moe.training import ShardedTraining
import nnx_adapter

FRONTENDS = {"linen": LinenFrontend, "nnx": nnx_adapter.NNXFrontend}


def sharded_training(frontend: str, cfg, optimizer, mesh, grad_accum: int = 1):
  """The sharded init and step of `frontend`'s decoder on `mesh`."""
  if frontend == "nnx":
    return nnx_adapter.ShardedNNXTraining(
        cfg, optimizer, mesh, grad_accum=grad_accum
    )
  return ShardedTraining(Decoder(cfg), optimizer, mesh, grad_accum=grad_accum)
