"""`linen_moe.distributed` on its own (no process group): bad arguments
before joining anything, cluster detection, global arrays; and
`linen_moe.testing.collectives`, which reads the device groups and process
crossings of compiled collectives. Process groups run in
test_cli_launch.py.
"""

import os
import socket
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from linen_moe import distributed
from linen_moe import hlo
from linen_moe._src.hlo import reading
from linen_moe._src.parallel import distributed as distributed_lib


class InitializeTest(parameterized.TestCase):
  """`distributed.initialize` rejects bad input before joining anything."""

  @parameterized.parameters(
      ("10.0.0.1:1234", ("10.0.0.1", 1234)),
      ("localhost:80", ("localhost", 80)),
      ("[::1]:5000", ("::1", 5000)),
  )
  def test_parse_coordinator(self, address, expected):
    self.assertEqual(distributed_lib.parse_coordinator(address), expected)

  @parameterized.parameters("localhost", ":1234", "host:", "host:0", "h:x")
  def test_bad_coordinator(self, address):
    with self.assertRaisesRegex(ValueError, "coordinator=.*HOST:PORT"):
      distributed.initialize(address, 2, 0)

  @parameterized.parameters(
      (dict(coordinator="localhost:1"), "num_processes, process_id missing"),
      (dict(num_processes=2, process_id=0), "coordinator missing"),
      (dict(coordinator="h:1", num_processes=2, process_id=2), r"\[0, num"),
      (dict(coordinator="h:1", num_processes=0, process_id=0), ">= 1"),
      (dict(init_timeout_s=0), "init_timeout_s=0"),
      (dict(heartbeat_timeout_s=-1), "heartbeat_timeout_s=-1"),
  )
  def test_bad_arguments(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      distributed.initialize(**kwargs)

  def test_process_id_type(self):
    with self.assertRaisesRegex(TypeError, "process_id='0'"):
      distributed.initialize("h:1", 2, "0")

  def test_port_in_use(self):
    with socket.socket() as taken:
      taken.bind(("", 0))
      taken.listen()
      port = taken.getsockname()[1]
      with self.assertRaisesRegex(ValueError, f"port {port} is already in use"):
        distributed.initialize(f"localhost:{port}", 2, 0)

  @parameterized.parameters(
      ({}, None),
      ({"SLURM_NTASKS": "1"}, None),
      ({"SLURM_NTASKS": "4"}, "slurm"),
      ({"OMPI_COMM_WORLD_SIZE": "2"}, "openmpi"),
      ({"TPU_WORKER_HOSTNAMES": "a"}, None),
      ({"TPU_WORKER_HOSTNAMES": "a,b"}, "tpu"),
  )
  def test_cluster_launcher(self, environ, expected):
    self.assertEqual(distributed_lib.cluster_launcher(environ), expected)

  def test_slurm_task_zero_checks_the_port_jax_derives(self):
    # JAX's Slurm port: 61440 + job id mod 4096; the first node of the step.
    task = {
        "SLURM_JOB_ID": "4097",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "node[3-4],other",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    with mock.patch.dict(os.environ, task):
      os.environ.pop("JAX_COORDINATOR_PORT", None)
      self.assertEqual(
          distributed_lib.launcher_coordinator(), ("node3:61441", 2, 0)
      )
    with socket.socket() as taken:
      taken.bind(("", 0))
      taken.listen()
      port = taken.getsockname()[1]
      with mock.patch.dict(os.environ, task, JAX_COORDINATOR_PORT=str(port)):
        with self.assertRaisesRegex(
            ValueError,
            f"port {port} is already in use .* JAX chose it from the slurm "
            "job's environment; set JAX_COORDINATOR_PORT",
        ):
          distributed.initialize()

  def test_slurm_tasks_outside_a_job_step(self):
    # An sbatch script that runs the command without srun.
    with mock.patch.dict(
        os.environ, {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}
    ):
      for name in ("SLURM_STEP_ID", "SLURM_STEP_NODELIST"):
        os.environ.pop(name, None)
      with self.assertRaisesRegex(
          ValueError, r"SLURM_NTASKS=2 says .* start the command with srun"
      ):
        distributed.initialize()

  def test_alone_without_arguments(self):
    cleared = {k: "" for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")}
    with mock.patch.dict(os.environ, cleared):
      self.assertFalse(distributed.initialize())

  def test_global_array(self):
    mesh = jax.make_mesh((1,), ("data",))
    data = np.arange(12, dtype=np.int32).reshape(4, 3)
    array = distributed.global_array(
        data.shape, NamedSharding(mesh, P("data")), data
    )
    np.testing.assert_array_equal(np.asarray(array), data)
    with self.assertRaisesRegex(ValueError, r"data shape \(4, 3\)"):
      distributed.global_array((8, 3), NamedSharding(mesh, P()), data)


class CollectivesTest(absltest.TestCase):
  """`hlo.collectives` reads each way HLO writes device groups."""

  def _one(self, text):
    (op,) = hlo.collectives(text)
    return op

  def test_mesh_axes(self):
    op = self._one(
        "  %ag = f32[4] all-gather(%x), channel_id=1, replica_groups="
        "mesh['data'=2,'fsdp'=1,'expert'=4] {'expert'}, dimensions={0}"
    )
    self.assertEqual(op.groups, ((0, 1, 2, 3), (4, 5, 6, 7)))
    self.assertEqual(op.axes, ("expert",))
    op = self._one(
        "  %ar = f32[] all-reduce(%x), replica_groups="
        "mesh['data'=2,'expert'=4] {'data'}, to_apply=%add"
    )
    self.assertEqual(op.groups, ((0, 4), (1, 5), (2, 6), (3, 7)))
    two_processes = [0] * 4 + [1] * 4
    self.assertTrue(reading.crosses_processes(op, two_processes))
    self.assertFalse(reading.crosses_processes(op, [0, 1, 2, 3] * 2))

  def test_iota_and_lists(self):
    op = self._one("  %r = f32[2] all-reduce(%x), replica_groups=[2,4]<=[8]")
    self.assertEqual(op.groups, ((0, 1, 2, 3), (4, 5, 6, 7)))
    op = self._one(
        "  %r = f32[2] all-reduce(%x), replica_groups=[2,4]<=[4,2]T(1,0)"
    )
    self.assertEqual(op.groups, ((0, 2, 4, 6), (1, 3, 5, 7)))
    op = self._one(
        "  %p = f32[2] collective-permute(%x),"
        " source_target_pairs={{0,1},{1,0}}"
    )
    self.assertEqual(op.groups, ((0, 1), (1, 0)))
    op = self._one("  %r = f32[2] all-reduce(%x), replica_groups={}")
    self.assertIsNone(op.groups)
    self.assertTrue(reading.crosses_processes(op, [0, 1]))


if __name__ == "__main__":
  absltest.main()
