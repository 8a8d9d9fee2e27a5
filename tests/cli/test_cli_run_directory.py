"""`linen-moe train --checkpoint-dir DIR`: the command's words for a run
directory's faults, and one directory locked for a process group.

A directory that cannot be made is one line naming the flag (`--checkpoint-dir`,
export's `--out`), exit status 2, before any compile; a run stopped on
purpose (a failed save) is one line, exit status 1. In a group of
processes, process 0 takes the lock; when it cannot, every process stops
before any step, each exiting with status 2.

What the run does with its directory (the lock, torn metrics, damaged
checkpoints, `resume_step`, failed saves, a full disk) is tested through
`training.run`: tests/run/test_run_directory.py and test_run_lock.py.
"""

from __future__ import annotations

import io
import os
import time
from unittest import mock

from absl.testing import absltest

from linen_moe import training
from linen_moe._src.parallel import launcher as launch
from linen_moe._src.run import directory as run_directory
from linen_moe._src.run import setup as run_setup
from linen_moe._src.testing import helpers
from tests import cli_helpers
from tests.run import test_run_directory
from tests.run import test_run_lock

TRAIN = (
    "train",
    "--config",
    "tiny_mixtral",
    "--set",
    "num_layers=1",
    "--batch-size",
    "2",
    "--seq-len",
    "8",
    "--save-every",
    "3",
    "--no-progress",
)


_cli = cli_helpers.cli


class CommandTest(absltest.TestCase):
  """The command's line and exit status for a run directory's faults."""

  def test_directory_errors_name_the_flags(self):
    afile, below = test_run_directory.below_a_file(self)
    with mock.patch.object(run_setup, "set_up") as set_up:
      code, _, err = _cli(*TRAIN, "--checkpoint-dir", below)
    set_up.assert_not_called()  # no model, no compile
    self.assertEqual((code, err.count("\n")), (2, 1), err)
    self.assertRegex(
        err,
        rf"^linen-moe: error: --checkpoint-dir {below} cannot be a "
        rf"directory: {afile} is a file",
    )
    tmp = os.path.dirname(afile)
    code, _, err = _cli(
        "export", "--checkpoint-dir", tmp, "--out", os.path.join(below, "x")
    )
    self.assertEqual((code, err.count("\n")), (2, 1), err)
    self.assertRegex(
        err, rf"^linen-moe: error: --out {below}/x cannot be created: {afile}"
    )

  def test_a_run_stopped_on_purpose_is_status_1(self):
    tmp = helpers.tempdir(self)
    message = (
        f"saving checkpoint 12 in {tmp} failed (Permission denied); the run "
        "stopped after step 12. The last complete checkpoint is step 9: a "
        "resume starts there."
    )
    stopped = training.RunStopped(message)
    with mock.patch.object(training, "run", side_effect=stopped) as run:
      code, _, err = _cli(*TRAIN, "--checkpoint-dir", tmp)
    run.assert_called_once()
    self.assertEqual((code, err), (1, f"linen-moe: error: {message}\n"))


class ProcessGroupLockTest(absltest.TestCase):
  """In a group of 2 processes (4 CPU devices each, gloo), process 0 takes
  the lock; when it cannot, both stop before any step and nothing else is
  written."""

  def test_group_stops_when_process_0_cannot_lock(self):
    tmp = helpers.tempdir(self)
    test_run_lock.lock_file(tmp)  # held by this (live) test process
    out, err = io.StringIO(), io.StringIO()
    env = dict(launch.child_env(4), PYTHONPATH=test_run_lock.ROOT)
    start = time.monotonic()
    result = launch.run_group(
        cli_helpers.train_commands(
            [*TRAIN, "--batch-size", "8", "--steps", "3"]
            + ["--checkpoint-dir", tmp],
            2,
        ),
        env,
        timeout_s=300,
        grace_s=60,
        out=out,
        err=err,
    )
    self.assertEqual(result.returncodes, (2, 2), err.getvalue())
    self.assertLess(time.monotonic() - start, 120)
    self.assertRegex(
        err.getvalue(),
        rf"linen-moe: error: {tmp} is in use by another run: process "
        rf"{os.getpid()} on ",
    )
    self.assertRegex(
        "\n".join(result.tails[1]),
        rf"linen-moe: error: process 0 could not lock {tmp}",
    )
    self.assertEqual(os.listdir(tmp), [run_directory.LOCK_FILE])


if __name__ == "__main__":
  absltest.main()
