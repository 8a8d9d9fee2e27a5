"""`linen-moe launch` and `train` on several processes joined by
`jax.distributed`, on this one machine (`linen_moe.distributed` on its own:
test_distributed.py).

Groups of local processes (each on simulated CPU devices, collectives over
gloo) run through `linen_moe.distributed.launch`'s `run_group`, the machinery of
`linen-moe launch`. The reference for "the same run" is one process with as
many devices as the group has in all: a multi-process step is one SPMD
program over the same global mesh, so the printed losses must agree to the
printed precision (4 decimals). A wrong shard of the batch, a process that
initialises differently or a missing cross-process reduction moves them in
the first or second decimal.

The default run holds the launcher's own checks, one two-process `train`
(Linen, sparse path) beside its one-process reference, and one two-process
group in which a process kills itself. Slow (each starts several jax
processes): a checkpoint handed from 2 processes to 1 and back, the ragged
all-to-all layer across the process boundary (every mode), the front end x
path product, expert parallelism across the process boundary (also through
a checkpoint) and the compiled collectives.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from unittest import mock

from absl.testing import absltest
import numpy as np

from linen_moe import testing
from linen_moe._src.parallel import launcher as launch
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from linen_moe_cli import main as cli_main
from linen_moe_cli.commands import launch as launch_command
from tests import cli_helpers

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
TRAIN = ["--steps", "3", "--batch-size", "8", "--seq-len", "8"]
LOSSES = re.compile(r"first loss: \S+\s+final loss: \S+")
HEARTBEAT_S = 5
# A loaded 2-core machine can take this long beyond the heartbeat timeout
# to notice and report a dead peer.
DETECTION_MARGIN_S = 45


def _env(devices: int) -> dict[str, str]:
  return dict(launch.child_env(devices), PYTHONPATH=ROOT)


def run_train(argv: list[str], processes: int, devices: int):
  """`linen-moe train <argv>` on `processes` x `devices`: (result, stdout,
  stderr) of the group, process 0's output captured."""
  out, err = io.StringIO(), io.StringIO()
  result = launch.run_group(
      cli_helpers.train_commands(["train", *argv], processes),
      _env(devices),
      timeout_s=900,
      out=out,
      err=err,
  )
  return result, out.getvalue(), err.getvalue()


def run_worker(jobs: list[dict], processes: int, devices: int, **kwargs):
  """`tests.cli_multihost_worker` jobs on a group: (result, {job: output})."""
  extra = ["--heartbeat-timeout", str(HEARTBEAT_S)]
  commands = [
      [sys.executable, "-m", "tests.cli_multihost_worker", json.dumps(jobs)]
      + extra
      + flags
      for flags in launch.process_flags(processes)
  ]
  out, err = io.StringIO(), io.StringIO()
  kwargs.setdefault("timeout_s", 900)
  result = launch.run_group(commands, _env(devices), out=out, err=err, **kwargs)
  outputs = {}
  for line in out.getvalue().splitlines():
    if line.startswith('{"job"'):
      record = json.loads(line)
      outputs[record["job"]] = record["result"]
  return result, outputs, err.getvalue()


class LaunchTest(absltest.TestCase):
  """The process group: streaming, failure, timeout (plain Python children)."""

  def _group(self, *codes: str, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    commands = [[sys.executable, "-c", code] for code in codes]
    start = time.monotonic()
    result = launch.run_group(
        commands, launch.child_env(None), out=out, err=err, **kwargs
    )
    return result, out.getvalue(), err.getvalue(), time.monotonic() - start

  def test_success_streams_process_0_only(self):
    result, out, err, _ = self._group(
        "print('[Gloo] Rank 0 is connected'); print('zero')",
        "print('one')",
        timeout_s=60,
    )
    self.assertEqual(result.code, 0)
    self.assertEqual(out, "zero\n")
    self.assertEqual(err, "")
    self.assertEqual(result.tails, (("zero",), ("one",)))

  def test_failure_stops_the_group(self):
    result, _, err, seconds = self._group(
        "import time; time.sleep(120)",
        "import sys; print('loading'); sys.exit('bad shard 3')",
        timeout_s=120,
        grace_s=0.5,
    )
    self.assertEqual((result.code, result.failed), (1, 1))
    self.assertEqual(result.returncodes, (-9, 1))
    self.assertIsNone(result.ended_s[0])  # killed by the group
    self.assertIn("process 1 of 2 failed (exit code 1)", err)
    # Its stdout and stderr, each in order (the two pipes may interleave).
    self.assertIn("  | loading\n", err)
    self.assertIn("  | bad shard 3\n", err)
    self.assertLess(seconds, 60)

  def test_timeout(self):
    result, _, err, seconds = self._group(
        "import time; print('waiting', flush=True); time.sleep(120)",
        timeout_s=1.5,
    )
    self.assertEqual(result.code, 124)
    self.assertIn("timed out after 1.5s", err)
    self.assertIn("| waiting", err)
    self.assertLess(seconds, 60)

  def test_process_flags(self):
    self.assertEqual(launch.process_flags(1), [[]])
    flags = launch.process_flags(3)
    self.assertEqual([f[-1] for f in flags], ["0", "1", "2"])
    self.assertEqual(len({f[1] for f in flags}), 1)  # one coordinator
    self.assertEqual(flags[0][2:4], ["--num-processes", "3"])
    with self.assertRaisesRegex(ValueError, "local_processes=0"):
      launch.process_flags(0)

  def test_child_commands_reject(self):
    with self.assertRaisesRegex(ValueError, "launch runs `train`"):
      launch_command.train_command(["matrix"])
    with self.assertRaisesRegex(ValueError, "sets --process-id itself"):
      launch_command.train_command(["train", "--process-id=1"])

  def test_child_env(self):
    with mock.patch.dict(
        os.environ, XLA_FLAGS="--a --xla_force_host_platform_device_count=8"
    ):
      env = launch.child_env(4)
    self.assertEqual(
        env["XLA_FLAGS"], "--a --xla_force_host_platform_device_count=4"
    )
    self.assertEqual(env["JAX_PLATFORMS"], "cpu")
    # A group's processes do not share the persistent compilation cache.
    self.assertEqual(env["JAX_ENABLE_COMPILATION_CACHE"], "false")

  def test_cli_rejects_other_commands(self):
    code, _, err = testing.run_capturing(
        cli_main.main, ["launch", "--local-processes", "2", "--", "bench"]
    )
    self.assertEqual(code, 2)
    self.assertIn("launch runs `train`", err)


class ExitAfterShutdownTest(absltest.TestCase):
  """A process of a group that rejects its input leaves with its status
  once the shutdown barrier passes, fails, or takes longer than the wait:
  never held at it (a loaded machine once held one there past the
  launcher's grace, killed with -9)."""

  def _exit(self, shutdown: str) -> tuple[int, str, float]:
    code = (
        "import sys, time\n"
        "from linen_moe_cli.commands.train import exit_after_shutdown\n"
        "def shutdown():\n"
        f"  {shutdown}\n"
        "print('said before', flush=False)\n"
        "sys.stderr.write('error before\\n')\n"
        "exit_after_shutdown(2, 2.0, shutdown)\n"
        "print('never')\n"
    )
    start = time.monotonic()
    got = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    return got.returncode, got.stdout + got.stderr, time.monotonic() - start

  def test_leaves_after_the_barrier_or_the_wait(self):
    for shutdown, slowest in (
        ("time.sleep(600)", 2.0),  # the wait ends it
        ("return None", 0.0),
        ("raise RuntimeError('barrier failed')", 0.0),
    ):
      with self.subTest(shutdown=shutdown):
        status, out, took = self._exit(shutdown)
        self.assertEqual(status, 2, out)
        self.assertIn("said before", out)
        self.assertIn("error before", out)
        self.assertNotIn("never", out)
        self.assertGreaterEqual(took, slowest)
        self.assertLess(took, slowest + 60)


class TwoProcessTrainTest(absltest.TestCase):
  """`linen-moe train` on 2 processes x 4 devices = 1 process x 8 devices."""

  @heavy
  def test_linen_sparse(self):
    argv = [*TRAIN, "--mesh", "data=2,expert=4", "--frontend", "linen"]
    two, out, err = run_train(argv, processes=2, devices=4)
    self.assertEqual(two.code, 0, err)
    one, ref_out, ref_err = run_train(
        [*argv, "--no-progress"], processes=1, devices=8
    )
    self.assertEqual(one.code, 0, ref_err)
    self.assertEqual(LOSSES.findall(out), LOSSES.findall(ref_out))
    self.assertLen(LOSSES.findall(out), 1)
    self.assertIn("step 3/3: loss", out)  # process 0's line (no terminal)
    # Process 1 stays quiet: no progress bar, no result line.
    self.assertFalse([t for t in two.tails[1] if "loss" in t or "train" in t])


def _losses(directory: str) -> list[tuple[int, float]]:
  rows = helpers.read_jsonl(os.path.join(directory, "metrics.jsonl"))
  return [(r["step"], r["cross_entropy"]) for r in rows]


class _CheckpointAcrossProcesses(helpers.TempDirMixin, absltest.TestCase):
  """A run saved by one process group resumes in another: 2 x 4 devices and
  1 x 8 devices hand one checkpoint directory back and forth (every process
  writes its own shards through orbax; a restore reads them onto any
  layout), and the chain's per-step losses equal one uninterrupted run's."""

  def check_chain(self, argv: list[str], groups: list[tuple[int, int]]):
    argv = [*argv, "--batch-size", "8", "--seq-len", "8", "--no-progress"]
    chained = self.tempdir()
    written_by = set()
    for stop, (processes, devices) in enumerate(groups, start=1):
      steps = ["--steps", str(2 * stop), "--checkpoint-dir", chained]
      result, out, err = run_train([*argv, *steps], processes, devices)
      self.assertEqual(result.code, 0, err)
      if stop > 1:
        self.assertIn(f"resumed from step {2 * stop - 2}", out)
      state = os.path.join(chained, str(2 * stop), "state")
      written_by.update(n for n in os.listdir(state) if "process_" in n)
    # Both processes of a two-process group wrote their part.
    self.assertContainsSubset(
        {"ocdbt.process_0", "ocdbt.process_1"}, written_by
    )
    whole = self.tempdir()
    steps = ["--steps", str(2 * len(groups)), "--checkpoint-dir", whole]
    result, _, err = run_train([*argv, *steps], 1, 8)
    self.assertEqual(result.code, 0, err)
    expected = _losses(whole)
    self.assertEqual([s for s, _ in expected], list(range(1, 7)))
    got = _losses(chained)
    self.assertEqual([s for s, _ in got], [s for s, _ in expected])
    # Cross-process sums may add in another order: float32 rounding only.
    np.testing.assert_allclose(
        [x for _, x in got], [x for _, x in expected], rtol=1e-6
    )


@testing.slow  # 6 jax processes; TwoProcessTrainTest is the default's
class CheckpointAcrossProcessesTest(_CheckpointAcrossProcesses):

  def test_two_one_two(self):
    self.check_chain(
        ["--mesh", "data=2,expert=4", "--frontend", "linen"],
        [(2, 4), (1, 8), (2, 4)],
    )


@testing.slow
class CheckpointAcrossProcessesSlowTest(_CheckpointAcrossProcesses):

  def test_one_two_one_nnx_experts_across(self):
    self.check_chain(
        ["--mesh", "expert=8", "--frontend", "nnx", "--no-sparse-matmul"],
        [(1, 8), (2, 4), (1, 8)],
    )


class _ProcessDeath(absltest.TestCase):
  """A process that dies ends the others within the heartbeat timeout.

  The group's first job is a mesh of the wrong size: every process rejects
  it before any step. The second runs an all-reduce until one process
  SIGKILLs itself; the grace period is long, so the survivor has to end on
  its own (JAX's coordination service sees the missing heartbeats).
  """

  def check_death(self, victim: int):
    jobs = [
        {"check": "bad_mesh", "mesh": "data=3"},
        {"check": "spin", "victim": victim, "die_at": 3},
    ]
    result, outputs, err = run_worker(
        jobs,
        processes=2,
        devices=2,
        grace_s=2 * (HEARTBEAT_S + DETECTION_MARGIN_S),
    )
    self.assertRegex(
        outputs[0]["error"],
        r"Mesh 'data=3' has 3 devices .* but 4 are available over 2 processes",
    )
    survivor = 1 - victim
    self.assertEqual(result.failed, victim, err)
    self.assertEqual(result.returncodes[victim], -9)
    self.assertIsNotNone(result.ended_s[survivor], "the group killed it")
    self.assertNotEqual(result.returncodes[survivor], 0)
    self.assertLess(
        result.ended_s[survivor] - result.ended_s[victim],
        HEARTBEAT_S + DETECTION_MARGIN_S,
    )
    self.assertIn(f"process {victim} of 2 failed (killed by SIGKILL)", err)
    return err


class ProcessDeathTest(_ProcessDeath):

  def test_worker_dies(self):
    err = self.check_death(victim=1)
    self.assertIn("stopped sending heartbeats", err)


@testing.slow
class ProcessDeathSlowTest(_ProcessDeath):

  def test_coordinator_dies(self):
    self.check_death(victim=0)


class _RaggedAcrossProcesses(absltest.TestCase):
  """The sparse layer with `expert_parallel="ragged_all_to_all"` on
  `expert=8` over 2 processes x 4 devices, so the (emulated) exchange
  crosses the process boundary: loss and gradients equal the one-device
  layer's, computed in each process."""

  def check(self, modes):
    job = {
        "check": "layer",
        "mesh": "expert=8",
        "expert_parallel": "ragged_all_to_all",
        "quantizations": modes,
    }
    two, outputs, err = run_worker([job], 2, 4)
    self.assertEqual(two.code, 0, err)
    result = outputs[0]
    self.assertEqual(result["process_of"], [0] * 4 + [1] * 4)
    for mode in modes:
      with self.subTest(mode=mode):
        r = result[mode]
        self.assertLessEqual(r["loss_err"], 1e-6 * r["loss_scale"])
        for what, e, scale in zip(
            ("params", "fp8", "input"),
            r["grad_errs"],
            r["grad_scales"],
            strict=True,
        ):
          self.assertLessEqual(e, 1e-5 * scale, what)
        crossing = {(op, axes): c for op, axes, c, _ in r["collectives"]}
        self.assertTrue(crossing[("all-to-all", "expert")])
        self.assertNotIn(("reduce-scatter", "expert"), crossing)


@testing.slow  # a 2-process group; test_ragged_all_to_all.py in one process
class RaggedAcrossProcessesTest(_RaggedAcrossProcesses):

  def test_none_and_fp8(self):
    self.check(["none", "fp8"])


@testing.slow
class RaggedAcrossProcessesSlowTest(_RaggedAcrossProcesses):

  def test_int8_and_nanoo_fp8(self):
    self.check(["int8", "nanoo_fp8"])


@testing.slow
class MultiProcessMatrixTest(absltest.TestCase):
  """Both front ends x both matmul paths, and experts split across the
  process boundary, on 2 x 4 devices against 1 x 8; one group for all."""

  TRAIN_CASES = [
      ("data=2,expert=4", "linen", "--sparse-matmul"),
      ("data=2,expert=4", "linen", "--no-sparse-matmul"),
      ("data=2,expert=4", "nnx", "--sparse-matmul"),
      ("data=2,expert=4", "nnx", "--no-sparse-matmul"),
      ("expert=8", "linen", "--sparse-matmul"),
      ("expert=8", "nnx", "--no-sparse-matmul"),
  ]

  def test_matrix(self):
    jobs = [
        {
            "check": "train",
            "argv": (
                [*TRAIN, "--mesh", mesh, "--frontend", fe, path]
                + ["--no-progress"]
            ),
        }
        for mesh, fe, path in self.TRAIN_CASES
    ]
    collectives = [
        {"check": "collectives", "mesh": "data=2,expert=4"},
        {"check": "collectives", "mesh": "expert=8"},
    ]
    two, outputs, err = run_worker(jobs + collectives, 2, 4)
    self.assertEqual(two.code, 0, err)
    one, ref, ref_err = run_worker(jobs, 1, 8)
    self.assertEqual(one.code, 0, ref_err)
    for i, case in enumerate(self.TRAIN_CASES):
      with self.subTest(case=case):
        self.assertEqual(
            LOSSES.findall(outputs[i]["stdout"]),
            LOSSES.findall(ref[i]["stdout"]),
        )
        self.assertLen(LOSSES.findall(outputs[i]["stdout"]), 1)
    split, across = outputs[len(jobs)], outputs[len(jobs) + 1]
    self.assertEqual(split["process_of"], [0] * 4 + [1] * 4)
    crossing = {(op, axes): c for op, axes, c, _ in split["counts"]}
    # data=2,expert=4: processes lie along `data`, so expert parallelism
    # stays inside a process and only the data-parallel sums cross.
    self.assertTrue(crossing[("all-reduce", "data")])
    for (op, axes), crosses in crossing.items():
      if axes == "expert":
        self.assertFalse(crosses, op)
    # expert=8: the experts' all-gathers and reduce-scatters cross.
    crossing = {(op, axes): c for op, axes, c, _ in across["counts"]}
    self.assertTrue(crossing[("all-gather", "expert")])
    self.assertTrue(crossing[("reduce-scatter", "expert")])


if __name__ == "__main__":
  absltest.main()
