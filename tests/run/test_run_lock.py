"""The one-writer rule of a run's directory (`DIR/run.lock`): a held lock
names its holder, the lock of an ended process is taken over, another
host's or an unreadable lock is not, and a run that holds it keeps it from
a second run until it is killed.

The lock file alone (the lock module, no training), then two runs: one a
Python process training, the other in this process. A second run stopping
in the faults of a directory: test_run_directory.py; in a process group,
and the command's words: tests/cli/test_cli_run_directory.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

from absl.testing import absltest

from linen_moe import testing
from linen_moe import training
from linen_moe._src.run import directory as run_directory
from linen_moe._src.testing import helpers

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


def lock_file(directory: str, **holder) -> str:
  """Writes `directory`/run.lock as a run of this (live) process would,
  with the fields of `holder` in its place; returns its path."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, run_directory.LOCK_FILE)
  info = {
      "host": socket.gethostname(),
      "pid": os.getpid(),
      "started": "2026-01-01T00:00:00+00:00",
      "process_start": run_directory._process_start(os.getpid()),  # noqa: SLF001
      **holder,
  }
  with open(path, "w", encoding="utf-8") as f:
    json.dump(info, f)
  return path


class RunLockTest(absltest.TestCase):
  """The lock file alone (no training)."""

  def test_held_lock_names_its_holder(self):
    tmp = os.path.join(helpers.tempdir(self), "run")
    lock = run_directory.RunLock.acquire(tmp, log=self.fail)
    with open(lock.path, encoding="utf-8") as f:
      self.assertEqual(json.load(f)["pid"], os.getpid())
    with self.assertRaisesRegex(
        ValueError,
        rf"^{tmp} is in use by another run: process {os.getpid()} on "
        rf"{socket.gethostname()}, started \S+\. Wait",
    ):
      run_directory.RunLock.acquire(tmp)
    lock.release()
    self.assertFalse(os.path.exists(lock.path))
    run_directory.RunLock.acquire(tmp).release()

  def test_lock_of_an_ended_process_is_taken_over(self):
    tmp = helpers.tempdir(self)
    gone = subprocess.Popen(["true"])
    gone.wait()
    for holder in (
        dict(pid=gone.pid, process_start=None),  # no such process
        dict(process_start="1"),  # our pid, reused: another start time
    ):
      lock_file(tmp, **holder)
      said = []
      lock = run_directory.RunLock.acquire(tmp, log=said.append)
      self.assertLen(said, 1)
      self.assertRegex(
          said[0],
          rf"^took over the lock of {tmp} from process \d+ on .*"
          r"which has ended\.$",
      )
      self.assertEqual(lock.holder["pid"], os.getpid())
      lock.release()

  def test_other_hosts_and_unreadable_locks_are_not_taken(self):
    tmp = helpers.tempdir(self)
    path = lock_file(tmp, host="elsewhere", pid=1)
    with self.assertRaisesRegex(ValueError, "on elsewhere.*another host"):
      run_directory.RunLock.acquire(tmp)
    with open(path, "w", encoding="utf-8") as f:
      f.write('{"host": ')
    with self.assertRaisesRegex(ValueError, "lock file that cannot be read"):
      run_directory.RunLock.acquire(tmp)

  def test_release_leaves_another_runs_lock(self):
    tmp = helpers.tempdir(self)
    lock = run_directory.RunLock.acquire(tmp)
    os.remove(lock.path)
    lock_file(tmp, pid=1)
    lock.release()
    self.assertTrue(os.path.exists(lock.path))


SHAPE = dict(
    config="tiny_mixtral",
    overrides={"num_layers": 1},
    batch_size=2,
    seq_len=8,
    progress=False,
)


@testing.slow
class TwoRunsTest(absltest.TestCase):
  """Two runs on one directory, the first a training process of its own:
  the second (in this process) stops at once naming the first; once the
  first is killed, the next run takes its lock over."""

  def test_second_run_stops_then_takes_over(self):
    run = os.path.join(helpers.tempdir(self), "run")
    script = textwrap.dedent(f"""
        from linen_moe import training
        training.run(training.RunOptions(
            steps=100000, save_every=100000, checkpoint_dir={run!r},
            **{SHAPE!r}))
        """)
    first = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    self.addCleanup(first.kill)
    lock = os.path.join(run, run_directory.LOCK_FILE)
    while not os.path.exists(os.path.join(run, "metrics.jsonl")):
      self.assertIsNone(first.poll())
      time.sleep(0.1)
    opts = training.RunOptions(
        steps=3, save_every=3, checkpoint_dir=run, **SHAPE
    )
    with self.assertRaisesRegex(
        ValueError,
        rf"^{run} is in use by another run: process {first.pid} on "
        rf"{socket.gethostname()}",
    ):
      training.run(opts, log=self.fail)
    self.assertIsNone(first.poll())  # the first runs on, undisturbed
    first.send_signal(signal.SIGKILL)
    first.wait()
    self.assertTrue(os.path.exists(lock))
    said = []
    training.run(opts, log=said.append)
    self.assertIn(f"from process {first.pid}", "\n".join(said))
    self.assertEqual([r["step"] for r in helpers.run_metrics(run)], [1, 2, 3])
    self.assertFalse(os.path.exists(lock))


if __name__ == "__main__":
  absltest.main()
