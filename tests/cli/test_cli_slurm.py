"""`linen-moe train` and `training.run` under Slurm, for real: a one-host
cluster (`tests/slurm_cluster.py`: munge, slurmctld, slurmd with this host's
cores and two stand-in GPUs) shared by the module's tests, and the recipes
of the scaling guide (`docs/recipes/`) run through it.

The processes of a job are Slurm's tasks (`srun -n N`, 1 CPU device each,
collectives over gloo), joined by `jax.distributed`'s own Slurm detection.
The reference is one uninterrupted run of `linen-moe launch` with 2
processes (`_whole`): a 2-task run, stopped and resumed or not, writes the
same metrics rows (every value, the step times aside), to the bit; resumed
on 1 or 4 tasks, the losses agree to float rounding (a data-parallel mesh of
another size sums in another order: 1e-6 relative, as across meshes in
test_cli_stop's ProcessCountTest).

Stops from outside: `scancel --signal=TERM`, a time limit that runs out
(Slurm sends SIGTERM twice, 5 ms apart, then SIGKILL after KillWait), a
requeue (`scontrol requeue`, as a preemption does) of the sbatch recipe,
and a SIGKILL to one task. Bad input (a task count the batch cannot be
split over, tasks started with other options, a coordinator port in use, a
batch script without srun) is one clear error before any step.

Heavy (each test starts several jax processes, each compiling its
programs: a group's processes share no compilation cache, see
`launcher.child_env`), and skipped where Slurm is not installed or this
process is not root (`.ci/run` installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import time

from absl.testing import absltest
import numpy as np

from linen_moe import checkpoint
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from tests import launcher_runs
from tests import slurm_cluster

ROOT = launcher_runs.ROOT
RECIPES = os.path.join(ROOT, "docs", "recipes")
STEPS = 100  # the reference's; every stop lands well before it
TRAIN = launcher_runs.TRAIN
HEARTBEAT_S = 5
# A loaded 2-core machine can take this long beyond the heartbeat timeout
# to notice and report a dead peer (as in test_cli_launch).
DETECTION_MARGIN_S = 45

# The module's cluster and reference run directory, made once.
_shared: dict = {}


def setUpModule():  # noqa: N802 (unittest's name)
  reason = slurm_cluster.missing()
  if reason:
    raise absltest.SkipTest(f"no Slurm cluster: {reason}")
  _shared["cluster"] = slurm_cluster.SlurmCluster.start()


def tearDownModule():  # noqa: N802
  if "whole" in _shared:
    shutil.rmtree(os.path.dirname(_shared.pop("whole")), ignore_errors=True)
  if "cluster" in _shared:
    _shared.pop("cluster").stop()


def _cluster() -> slurm_cluster.SlurmCluster:
  return _shared["cluster"]


def _whole() -> list[dict]:
  """The reference rows: `linen-moe launch --local-processes 2` for STEPS
  steps, run once for the module."""
  if "whole" not in _shared:
    directory = os.path.join(launcher_runs.mkdtemp(), "whole")
    got = launcher_runs.run(
        [sys.executable, "-m", "linen_moe_cli.main", "launch"]
        + ["--local-processes", "2", "--devices-per-process", "1", "--"]
        + ["train", *TRAIN, "--steps", str(STEPS)]
        + ["--checkpoint-dir", directory],
        launcher_runs.task_env(_cluster().env()),
    )
    if got.returncode:
      raise AssertionError(f"the reference failed: {got.stderr[-3000:]}")
    _shared["whole"] = directory
  return helpers.run_metrics(_shared["whole"], recipe_steps=False)


def _committed(directory: str) -> list[int]:
  with checkpoint.Checkpoints(directory, create=False) as ckpts:
    return ckpts.all_steps()


class _SlurmTest(absltest.TestCase):
  """Runs commands on the module's cluster."""

  def setUp(self):
    super().setUp()
    self.tmp = launcher_runs.mkdtemp()
    self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

  def env(self, **extra: str) -> dict[str, str]:
    return launcher_runs.task_env(_cluster().env(), **extra)

  def srun(self, tasks: int, command: list[str], *options: str, **env):
    """`srun -n TASKS OPTIONS COMMAND` to its end: (status, stdout,
    stderr)."""
    argv = ["srun", "-n", str(tasks), "--overcommit", *options, *command]
    got = launcher_runs.run(argv, self.env(**env))
    return got.returncode, got.stdout, got.stderr

  def start(self, name: str, tasks: int, command: list[str], *options: str):
    """`srun` started as job `name`: (its process, the job id)."""
    argv = ["srun", "-n", str(tasks), "--overcommit", f"--job-name={name}"]
    proc = launcher_runs.start([*argv, *options, *command], self.env())
    self.addCleanup(proc.kill)
    return proc, self.job_id(name, proc)

  def job_id(self, name: str, proc=None) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      got = _cluster().run(["squeue", "-h", "-n", name, "-o", "%i"])
      if got.stdout.strip():
        return got.stdout.split()[0]
      if proc is not None and proc.poll() is not None:
        self.fail(f"srun ended: {proc.communicate()}")
      time.sleep(0.2)
    self.fail(f"no job {name}")

  def wait_rows(self, directory: str, rows: int, proc=None, job=None):
    """Until DIR/metrics.jsonl holds `rows` rows (the run is past its
    compiles)."""
    metrics = os.path.join(directory, "metrics.jsonl")
    deadline = time.monotonic() + 600
    while launcher_runs.lines(metrics) < rows:
      self.assertLess(time.monotonic(), deadline, "no rows")
      if proc is not None and proc.poll() is not None:
        self.fail(f"ended too soon: {proc.communicate()}")
      if job is not None and _cluster().job_state(job) not in (
          "PENDING",
          "RUNNING",
      ):
        self.fail(f"job {job}: {_cluster().job_state(job)}")
      time.sleep(0.1)

  def train(self, tasks: int, directory: str, steps: int, *options: str):
    """`srun -n TASKS linen-moe train` into `directory`, which must
    succeed; its stdout."""
    command = ["linen-moe", "train", *TRAIN, "--steps", str(steps)]
    code, out, err = self.srun(
        tasks, [*command, "--checkpoint-dir", directory], *options
    )
    self.assertEqual(code, 0, err[-3000:])
    return out

  def check_stopped(self, directory: str, err: str, steps: int) -> int:
    """Both tasks exited 143, after saving the step they stopped after:
    its checkpoint committed and the latest, rows 1..step once each, the
    directory unlocked. Returns that step."""
    # srun: "tasks 0-1: Exited with exit code 143", or a line a task.
    exits = re.findall(r"tasks? ([\d,-]+): Exited with exit code (\d+)", err)
    self.assertEqual({code for _, code in exits}, {"143"}, err[-3000:])
    self.assertIn(sorted(t for t, _ in exits), (["0-1"], ["0", "1"]), err)
    found = re.search(r"stopped by SIGTERM after step (\d+) of (\d+)", err)
    self.assertIsNotNone(found, err[-3000:])
    stop = int(found.group(1))
    self.assertEqual(int(found.group(2)), steps)
    self.assertLess(stop, steps - 2)
    self.assertEqual(_committed(directory)[-1], stop)
    rows = helpers.run_metrics(directory, recipe_steps=False)
    self.assertEqual([r["step"] for r in rows], list(range(1, stop + 1)))
    self.assertFalse(os.path.exists(os.path.join(directory, "run.lock")))
    return stop


@heavy
class SlurmStopTest(_SlurmTest):
  """Stopped by Slurm's SIGTERM, saved, resumed exactly."""

  def test_scancel_then_resume_on_2_1_and_4_tasks(self):
    """The Python recipe (`training.run`) on 2 tasks, stopped by `scancel
    --signal=TERM`; resumed by `linen-moe train` on 2 tasks (the reference's
    rows, to the bit), on 1 and on 4 (its losses within 1e-6)."""
    run = os.path.join(self.tmp, "run")
    script = [sys.executable, os.path.join(RECIPES, "train.py")]
    script += ["--num-layers", "1", "--batch-size", "4", "--seq-len", "8"]
    script += ["--steps", str(STEPS), "--checkpoint-dir", run]
    proc, job = self.start("scancel", 2, script)
    self.wait_rows(run, 2, proc)
    _cluster().run(["scancel", "--signal=TERM", job])
    _, err = proc.communicate(timeout=300)
    self.assertEqual(proc.returncode, 143, err[-3000:])
    stop = self.check_stopped(run, err, STEPS)
    self.assertIn("Run the same command to resume.", err)
    copies = {n: os.path.join(self.tmp, f"on{n}") for n in (1, 4)}
    for copy in copies.values():
      shutil.copytree(run, copy)

    out = self.train(2, run, stop + 2)
    self.assertIn(f"resumed from step {stop}", out)
    whole = _whole()[: stop + 2]
    self.assertEqual(helpers.run_metrics(run, recipe_steps=False), whole)

    for tasks, copy in copies.items():
      with self.subTest(tasks=tasks):
        out = self.train(tasks, copy, stop + 2)
        self.assertIn(f"resumed from step {stop}", out)
        rows = helpers.run_metrics(copy, recipe_steps=False)
        self.assertEqual([r["step"] for r in rows], list(range(1, stop + 3)))
        np.testing.assert_allclose(
            [r["cross_entropy"] for r in rows],
            [r["cross_entropy"] for r in whole],
            rtol=1e-6,
        )

  def test_time_limit_then_resume(self):
    """A job whose time limit runs out: both tasks save the last step and
    exit 143 within KillWait; resumed, the reference's rows."""
    run = os.path.join(self.tmp, "run")
    # A second a step: the limit lands 60-90 s after the start, within 90.
    command = [sys.executable, "-m", "tests.cli_slurm_worker", "1.0"]
    command += ["train", *TRAIN, "--steps", str(STEPS)]
    proc, job = self.start("limit", 2, [*command, "--checkpoint-dir", run])
    self.wait_rows(run, 1, proc)
    # One minute from its start, which is over (Slurm's time limits are in
    # minutes; slurmctld enforces them every 30 s).
    _cluster().run(["scontrol", "update", f"JobId={job}", "TimeLimit=1"])
    _, err = proc.communicate(timeout=300)
    self.assertEqual(proc.returncode, 143, err[-3000:])
    self.assertIn("DUE TO TIME LIMIT", err)
    deadline = time.monotonic() + 120
    while (state := _cluster().job_state(job)) == "COMPLETING":
      self.assertLess(time.monotonic(), deadline, state)
      time.sleep(0.5)
    self.assertEqual(state, "TIMEOUT")
    stop = self.check_stopped(run, err, STEPS)

    out = self.train(2, run, stop + 2)
    self.assertIn(f"resumed from step {stop}", out)
    self.assertEqual(
        helpers.run_metrics(run, recipe_steps=False), _whole()[: stop + 2]
    )

  def test_requeued_job_ends_where_an_uninterrupted_run_ends(self):
    """`sbatch --requeue` of the recipe (docs/recipes/train.sbatch, on this
    node's 2 cores and 2 stand-in GPUs), requeued once mid-run as a
    preemption would: the job completes, its rows the reference's."""
    run = os.path.join(self.tmp, "run")
    log = os.path.join(self.tmp, "job.out")
    sbatch = ["sbatch", "--requeue", "--nodes=1", "--ntasks-per-node=2"]
    sbatch += ["--gpus-per-node=2", f"--output={log}"]
    sbatch += [os.path.join(RECIPES, "train.sbatch"), *TRAIN]
    sbatch += ["--steps", str(STEPS)]
    got = launcher_runs.run(sbatch, self.env(RUN_DIR=run))
    self.assertEqual(got.returncode, 0, got.stderr)
    job = got.stdout.split()[-1]
    self.wait_rows(run, 2, job=job)
    _cluster().run(["scontrol", "requeue", job])
    deadline = time.monotonic() + 600
    while (state := _cluster().job_state(job)) != "COMPLETED":
      self.assertNotIn(state, ("FAILED", "CANCELLED", "TIMEOUT"), log)
      self.assertLess(time.monotonic(), deadline, state)
      time.sleep(0.5)
    self.assertEqual(_cluster().job_field(job, "Restarts"), "1")
    with open(log, encoding="utf-8") as f:
      text = f.read()
    self.assertRegex(text, r"resumed from step \d+")
    self.assertEqual(helpers.run_metrics(run, recipe_steps=False), _whole())


@heavy
class SlurmFailureTest(_SlurmTest):
  """A task killed, and bad input: each one clear error."""

  def test_sigkilled_task_ends_the_job_naming_it(self):
    run = os.path.join(self.tmp, "run")
    command = ["linen-moe", "train", *TRAIN, "--steps", "100000"]
    command += ["--heartbeat-timeout", str(HEARTBEAT_S)]
    proc, job = self.start("kill", 2, [*command, "--checkpoint-dir", run])
    self.wait_rows(run, 2, proc)
    os.kill(_cluster().task_pids(job)[1], signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=300)
    self.assertLess(time.monotonic() - killed, HEARTBEAT_S + DETECTION_MARGIN_S)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("task 1: Killed", err)  # srun names it
    # Task 0 fails too: its collective's connection to task 1 breaks (an
    # error exit, or JAX's coordination client aborts the process), or,
    # when none is open, JAX's heartbeats name task 1 as gone.
    self.assertRegex(
        err,
        r"task 0: (Exited with exit code [1-9]|Aborted)|Task 1 heartbeat "
        r"timeout|stopped sending heartbeats[^\n]*task:1\b",
    )

  def test_a_task_count_the_batch_cannot_be_split_over(self):
    run = os.path.join(self.tmp, "run")
    command = ["linen-moe", "train", *TRAIN, "--steps", "3"]
    code, out, err = self.srun(
        3, [*command, "--checkpoint-dir", run], "--time=3"
    )
    self.assertEqual(code, 2, err[-3000:])
    self.assertRegex(
        err,
        r"linen-moe: error: axis 0 of the global shape \(4, 8\) \(size 4\) "
        r"is split over 3 devices \(mesh axes data=3: 3 processes x 1 "
        r"devices\), which must divide it",
    )
    self.assertNotIn("step 1", out + err)

  def test_tasks_started_with_other_options(self):
    run = os.path.join(self.tmp, "run")
    conf = os.path.join(self.tmp, "tasks.conf")
    with open(conf, "w", encoding="utf-8") as f:
      for task, seq_len in ((0, 8), (1, 16)):
        argv = [a if a != "8" else str(seq_len) for a in TRAIN]
        f.write(f"{task} linen-moe train {' '.join(argv)} --steps 3 ")
        f.write(f"--checkpoint-dir {run}\n")
    # Without the check the tasks would wait for each other: the time limit.
    code, out, err = self.srun(2, [conf], "--multi-prog", "--time=3")
    self.assertEqual(code, 2, err[-3000:])
    for task, seq_len in ((0, 8), (1, 16)):
      self.assertIn(
          "linen-moe: error: the 2 processes were started with different "
          "options: seq_len differ between process 0 and process 1; this "
          f"is process {task}, with seq_len={seq_len}. Start every process "
          "with the same command.",
          err,
      )
    self.assertNotIn("step 1", out + err)

  def test_a_coordinator_port_in_use(self):
    run = os.path.join(self.tmp, "run")
    command = ["linen-moe", "train", *TRAIN, "--steps", "3"]
    with socket.socket() as taken:
      taken.bind(("", 0))
      taken.listen()
      port = taken.getsockname()[1]
      start = time.monotonic()
      code, _, err = self.srun(
          2,
          [*command, "--checkpoint-dir", run],
          "--kill-on-bad-exit=1",
          JAX_COORDINATOR_PORT=str(port),
      )
    self.assertNotEqual(code, 0)
    self.assertIn(
        f"linen-moe: error: coordinator port {port} is already in use on "
        "this host, where process 0 starts the coordination service; JAX "
        "chose it from the slurm job's environment; set "
        "JAX_COORDINATOR_PORT to a free port for every process.",
        err,
    )
    self.assertLess(time.monotonic() - start, 120)  # not the init timeout

  def test_a_batch_script_without_srun(self):
    log = os.path.join(self.tmp, "job.out")
    run = os.path.join(self.tmp, "run")
    command = f"linen-moe train --steps 3 --checkpoint-dir {run}"
    got = launcher_runs.run(
        ["sbatch", "-n", "2", "--wait", f"--output={log}", "--wrap", command],
        self.env(),
    )
    self.assertNotEqual(got.returncode, 0)
    with open(log, encoding="utf-8") as f:
      text = f.read()
    self.assertIn(
        "linen-moe: error: SLURM_NTASKS=2 says this is one of several Slurm "
        "tasks, but this process is not a task of a job step",
        text,
    )


if __name__ == "__main__":
  absltest.main()
