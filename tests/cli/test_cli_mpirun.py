"""`linen-moe train` under Open MPI's `mpirun` (Debian's `openmpi-bin` 4.1),
through the scaling guide's recipe (`docs/recipes/train_mpirun.sh`): the
ranks join one `jax.distributed` group through JAX's own Open MPI detection
(`OMPI_MCA_orte_hnp_uri`, `OMPI_COMM_WORLD_SIZE` and `_RANK`) and train to
the losses of `linen-moe launch` with as many processes, every metrics
value equal (the step times aside).

Heavy (two groups of 2 jax processes), and skipped where `mpirun` is not
installed (`.ci/run` installs it).
"""

from __future__ import annotations

import os
import shutil
import sys

from absl.testing import absltest
import numpy as np

from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from tests import launcher_runs

RECIPE = os.path.join(launcher_runs.ROOT, "docs", "recipes", "train_mpirun.sh")
TRAIN = [*launcher_runs.TRAIN, "--steps", "10"]


@heavy
class MpirunTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if shutil.which("mpirun") is None:
      self.skipTest("mpirun not found: apt-get install openmpi-bin (.ci/run)")
    self.tmp = launcher_runs.mkdtemp()
    self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

  def test_two_ranks_train_as_launch_with_two(self):
    launched = os.path.join(self.tmp, "launch")
    got = launcher_runs.run(
        [sys.executable, "-m", "linen_moe_cli.main", "launch"]
        + ["--local-processes", "2", "--devices-per-process", "1", "--"]
        + ["train", *TRAIN, "--checkpoint-dir", launched],
        launcher_runs.task_env({}),
    )
    self.assertEqual(got.returncode, 0, got.stderr[-3000:])

    ranks = os.path.join(self.tmp, "mpirun")
    # As root (CI): mpirun -np 2 --allow-run-as-root --oversubscribe ...
    options = "--oversubscribe"
    if os.geteuid() == 0:
      options += " --allow-run-as-root"
    env = launcher_runs.task_env({}, NP="2", RUN_DIR=ranks, MPIRUN_OPTS=options)
    env["PATH"] = os.pathsep.join(
        [os.path.dirname(sys.executable), env["PATH"]]
    )
    got = launcher_runs.run(["bash", RECIPE, *TRAIN], env)
    self.assertEqual(got.returncode, 0, got.stderr[-3000:])
    self.assertIn("devices: 2 cpu, mesh data=2", got.stdout)
    self.assertEqual(got.stdout.count("final loss"), 1)  # rank 0 reports

    rows, expected = helpers.run_metrics(
        ranks, recipe_steps=False
    ), helpers.run_metrics(launched, recipe_steps=False)
    self.assertEqual([r["step"] for r in rows], list(range(1, 11)))
    np.testing.assert_allclose(
        rows[-1]["cross_entropy"], expected[-1]["cross_entropy"], rtol=1e-6
    )
    self.assertEqual(rows, expected)


if __name__ == "__main__":
  absltest.main()
