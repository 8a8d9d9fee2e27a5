"""Loading a Hugging Face checkpoint onto 8 simulated CPU devices, in a
subprocess (the device count must be set before jax is imported).

`python -m tests.hf_mesh_worker FIXTURE MESH_SPEC` loads the fixture onto
the mesh and on one device, and prints one JSON line: whether every
variable is placed in its logical sharding and equals the one-device load,
and the bytes the loader read against the bytes of every device's shards.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
)

import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

from flax import traverse_util  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe import hf  # noqa: E402
from linen_moe import sharding  # noqa: E402
from linen_moe._src.hf import load as load_lib  # noqa: E402
from linen_moe._src.hf.safetensors_io import Checkpoint  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"


def _placed_and_equal(config, variables, single, mesh) -> tuple[bool, bool]:
  """Whether each leaf of `variables` has the sharding the loader plans for
  it on `mesh`, and whether they equal `single` (the one-device load)."""
  want = load_lib._shardings(  # noqa: SLF001
      load_lib.abstract_variables(config), mesh, None
  )
  placed = all(
      leaf.sharding.is_equivalent_to(want[path], leaf.ndim)
      for path, leaf in traverse_util.flatten_dict(variables).items()
  )
  equal = all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(
          jax.tree.leaves(variables), jax.tree.leaves(single), strict=True
      )
  )
  return placed, equal


def main(name: str, spec: str) -> None:
  mesh = sharding.make_mesh(spec)
  read = {"bytes": 0}
  original = Checkpoint.read_rows

  def counting(self, tensor, lead, lo, hi, out=None):
    out = original(self, tensor, lead, lo, hi, out)
    read["bytes"] += out.nbytes
    return out

  Checkpoint.read_rows = counting
  config, variables = hf.load_checkpoint(FIXTURES / name, mesh=mesh)
  sharded_bytes = read["bytes"]
  Checkpoint.read_rows = original
  _, single = hf.load_checkpoint(FIXTURES / name)
  placed, equal = _placed_and_equal(config, variables, single, mesh)
  flat = traverse_util.flatten_dict(variables)
  shard_bytes = sum(
      math.prod(shard.data.shape) * leaf.dtype.itemsize
      for leaf in flat.values()
      for shard in leaf.addressable_shards
  )
  split = {path: str(leaf.sharding.spec) for path, leaf in flat.items()}
  # int8 serving weights, quantized as read, onto the same mesh.
  serve_config, served = hf.load_checkpoint(
      FIXTURES / name, mesh=mesh, quantization="int8", serving=True
  )
  _, served_single = hf.load_checkpoint(
      FIXTURES / name, quantization="int8", serving=True
  )
  served_placed, served_equal = _placed_and_equal(
      serve_config, served, served_single, mesh
  )
  print(
      json.dumps({
          "placed": placed,
          "equal": equal,
          "read_bytes": sharded_bytes,
          "shard_bytes": shard_bytes,
          "model_bytes": sum(x.nbytes for x in jax.tree.leaves(single)),
          "devices": len(mesh.devices.flat),
          "sharded_leaves": sum("'" in s for s in split.values()),
          "served_placed": served_placed,
          "served_equal": served_equal,
      })
  )


if __name__ == "__main__":
  main(*sys.argv[1:])
