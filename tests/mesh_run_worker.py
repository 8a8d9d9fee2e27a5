"""A run on a mesh of 8 simulated CPU devices, in its own process (the
device count is set before jax is imported).

`python -m tests.mesh_run_worker FRONTEND` trains 3 steps of tiny_mixtral
with `linen_moe.training.run` on a `jax.sharding.Mesh` built here (data 2 x
expert 4) and prints one JSON line: the losses, and how the train state's
arrays lie after each step (on that mesh; split over its devices or not).
tests/run/test_mesh_runs.py asserts on it.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
)

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe import sharding  # noqa: E402
from linen_moe import training  # noqa: E402
import nnx_adapter  # noqa: E402, F401 (registers the "nnx" front end)


class _Placement(training.Callback):
  """After each step: how many of the state's arrays are on `mesh`, and how
  many of those are split (a shard smaller than the array)."""

  def __init__(self, mesh: jax.sharding.Mesh):
    self.mesh = mesh
    self.steps = []

  def after_step(self, run, step):
    del run
    arrays = [
        x for x in jax.tree.leaves(step.state) if isinstance(x, jax.Array)
    ]
    on_mesh = [
        x for x in arrays if getattr(x.sharding, "mesh", None) == self.mesh
    ]
    split = [x for x in on_mesh if x.sharding.shard_shape(x.shape) != x.shape]
    self.steps.append({
        "step": step.step,
        "arrays": len(arrays),
        "on_mesh": len(on_mesh),
        "split": len(split),
    })


def main(frontend: str) -> dict:
  devices = np.asarray(jax.devices()).reshape(2, 1, 4, 1)
  mesh = jax.sharding.Mesh(devices, sharding.MESH_AXES)
  placement = _Placement(mesh)
  result = training.run(
      training.RunOptions(
          mesh=mesh, steps=3, batch_size=8, seq_len=8, progress=False
      ),
      training.frontend(frontend),
      log=lambda _: None,
      callbacks=[placement],
  )
  return {
      "devices": jax.device_count(),
      "losses": result.losses,
      "placement": placement.steps,
  }


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1])))
