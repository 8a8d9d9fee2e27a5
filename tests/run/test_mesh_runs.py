"""A run on a mesh (`RunOptions(mesh=jax.sharding.Mesh(...))`) of 8
simulated devices, data 2 x expert 4, in both front ends: it trains, and the
train state lies on that mesh, split over its devices. The sharded step
itself, against one device: tests/layer/test_sharding.py."""

import json
import math

from absl.testing import absltest
from absl.testing import parameterized

from linen_moe import testing
from tests import workers


@testing.slow
class MeshRunTest(parameterized.TestCase):

  @parameterized.parameters("linen", "nnx")
  def test_run_on_a_mesh(self, frontend):
    proc = workers.run("tests.mesh_run_worker", frontend, devices=8)
    self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    self.assertEqual(out["devices"], 8)
    self.assertLen(out["losses"], 3)
    self.assertTrue(all(map(math.isfinite, out["losses"])), out["losses"])
    self.assertEqual([p["step"] for p in out["placement"]], [1, 2, 3])
    for placed in out["placement"]:
      self.assertEqual(placed["on_mesh"], placed["arrays"], placed)
      self.assertGreater(placed["split"], 0, placed)


if __name__ == "__main__":
  absltest.main()
