"""A run's directory under faults (`linen-moe train --checkpoint-dir DIR`).

One writer: a second run on DIR stops at once naming the holder, a lock left
by a killed run is taken over, and in a process group process 0 decides for
all. No lost rows: after a torn `metrics.jsonl`, a damaged checkpoint, an
explicit `--resume-step` or a failed save, DIR/metrics.jsonl holds every
step once, in order. A damaged newest checkpoint is skipped (and set aside),
a directory that cannot be written is a one-line error before any compile,
and a save that fails mid-run (a full disk, a refused write) stops the run
with the last good checkpoint restorable.

The runs are tiny (one layer, batch 2, 8 tokens) and share one compiled step
where they can; `FaultsTest` walks one directory through every fault in
turn.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

from absl.testing import absltest
import pytest

from linen_moe import testing
from linen_moe._src.parallel import launcher as launch
from linen_moe._src.run import directory as run_directory
from linen_moe._src.run import setup as run_setup
from linen_moe._src.testing import helpers
from tests import cli_helpers

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
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


def _steps(directory: str) -> list[int]:
  return [r["step"] for r in helpers.run_metrics(directory)]


def _checkpoints(directory: str) -> list[int]:
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _damage(directory: str, step: int) -> None:
  """Truncates every data file of checkpoint `step` to half its size."""
  pattern = os.path.join(directory, str(step), "state", "**", "d", "*")
  data = [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
  assert data, pattern
  for f in data:
    with open(f, "r+b") as handle:
      handle.truncate(os.path.getsize(f) // 2)


def _holder(directory: str) -> subprocess.Popen:
  """Another process that takes the lock of `directory` and keeps it."""
  script = (
      "import sys, time\n"
      "from linen_moe._src.run import directory as run_directory\n"
      "run_directory.RunLock.acquire(sys.argv[1], log=print)\n"
      "print('locked', flush=True)\n"
      "time.sleep(600)\n"
  )
  proc = subprocess.Popen(
      [sys.executable, "-c", script, directory],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      text=True,
  )
  assert proc.stdout.readline().strip() == "locked"
  return proc


def _lock_file(directory: str, **holder) -> str:
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
      _lock_file(tmp, **holder)
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
    path = _lock_file(tmp, host="elsewhere", pid=1)
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
    _lock_file(tmp, pid=1)
    lock.release()
    self.assertTrue(os.path.exists(lock.path))


def _mount_tmpfs(test: absltest.TestCase, size: str, *options: str):
  """A fresh tmpfs of `size`, or None where mounting is refused (not root,
  no CAP_SYS_ADMIN): the test then injects the fault at the file layer."""
  where = helpers.tempdir(test)
  opts = ",".join((f"size={size}", *options))
  try:
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", where],
        capture_output=True,
        check=False,
    )
  except OSError:
    return None
  if done.returncode:
    return None
  test.addCleanup(subprocess.run, ["umount", "-l", where], check=False)
  return where


def _failing_commit(step: int, code: int):
  """orbax's commit of checkpoint `step` (the rename of its finished
  temporary directory) failing with OSError `code`."""
  from orbax.checkpoint._src.path import atomicity  # noqa: PLC0415

  rename = atomicity.async_path.rename

  async def failing(src, dst, *args, **kwargs):
    if os.path.basename(os.fspath(dst)) == str(step):
      raise OSError(code, os.strerror(code), os.fspath(dst))
    return await rename(src, dst, *args, **kwargs)

  return mock.patch.object(atomicity.async_path, "rename", failing)


class DirectoryCheckTest(absltest.TestCase):
  """A directory that cannot be made or written: one line, before work."""

  def _check(self, argv, message):
    with mock.patch.object(run_setup, "set_up") as set_up:
      code, _, err = _cli(*argv)
    set_up.assert_not_called()  # no model, no compile
    self.assertEqual((code, err.count("\n")), (2, 1), err)
    self.assertRegex(err, "^linen-moe: error: " + message)

  def test_below_a_regular_file(self):
    tmp = helpers.tempdir(self)
    afile = os.path.join(tmp, "file")
    with open(afile, "w", encoding="utf-8") as f:
      f.write("x")
    below = os.path.join(afile, "run")
    self._check(
        [*TRAIN, "--checkpoint-dir", below],
        rf"--checkpoint-dir {below} cannot be a directory: {afile} is a file",
    )
    code, _, err = _cli(
        "export", "--checkpoint-dir", tmp, "--out", os.path.join(below, "x")
    )
    self.assertEqual((code, err.count("\n")), (2, 1), err)
    self.assertRegex(err, rf"--out {below}/x cannot be created: {afile} is a")

  def test_read_only_file_system(self):
    ro = _mount_tmpfs(self, "1m", "ro")
    faults = contextlib.ExitStack()
    if ro is None:  # a read-only file system, injected below `ro`
      ro = helpers.tempdir(self)
      makedirs, access = os.makedirs, os.access

      def refused_makedirs(path, *args, **kwargs):
        if os.fspath(path).startswith(ro):
          raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return makedirs(path, *args, **kwargs)

      def refused_access(path, mode, *args, **kwargs):
        if os.fspath(path).startswith(ro) and mode & os.W_OK:
          return False
        return access(path, mode, *args, **kwargs)

      for name, fake in (
          ("makedirs", refused_makedirs),
          ("access", refused_access),
      ):
        faults.enter_context(mock.patch.object(os, name, fake))
      faults.enter_context(
          mock.patch.object(run_directory, "_read_only", return_value=True)
      )
    run = os.path.join(ro, "run")
    with faults:
      self._check(
          [*TRAIN, "--checkpoint-dir", run],
          rf"--checkpoint-dir {run} cannot be created: Read-only file system",
      )
      code, _, err = _cli("export", "--checkpoint-dir", ro, "--out", run)
    self.assertEqual((code, err.count("\n")), (2, 1), err)
    self.assertIn("Read-only file system", err)


class ProcessGroupLockTest(absltest.TestCase):
  """In a group of 2 processes (4 CPU devices each, gloo), process 0 takes
  the lock; when it cannot, both stop before any step and nothing else is
  written."""

  def test_group_stops_when_process_0_cannot_lock(self):
    tmp = helpers.tempdir(self)
    _lock_file(tmp)  # held by this (live) test process
    out, err = io.StringIO(), io.StringIO()
    env = dict(launch.child_env(4), PYTHONPATH=ROOT)
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


class FaultsTest(absltest.TestCase):
  """One run directory through every fault, in order; after each, the
  metrics hold steps 1..N once each and equal what earlier runs wrote."""

  def _train(self, directory, steps, *extra, code=0):
    got, out, err = _cli(
        *TRAIN, "--steps", str(steps), "--checkpoint-dir", directory, *extra
    )
    self.assertEqual(got, code, err)
    return out, err

  def _same_rows(self, directory, steps, before):
    rows = helpers.run_metrics(directory)
    self.assertEqual([r["step"] for r in rows], list(range(1, steps + 1)))
    self.assertEqual(rows[: len(before)], before[:steps])
    return rows

  # After a failed read or save, a tensorstore callback reaches orbax's
  # closed event loop ("Event loop is closed", ignored by Python).
  @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
  def test_one_directory_through_every_fault(self):
    run = os.path.join(helpers.tempdir(self), "run")
    os.makedirs(run)

    # Two writers: a second run stops at once, naming the first.
    holder = _holder(run)
    start = time.monotonic()
    code, out, err = _cli(*TRAIN, "--steps", "6", "--checkpoint-dir", run)
    self.assertEqual((code, err.count("\n")), (2, 1), err)
    self.assertRegex(
        err,
        rf"^linen-moe: error: {run} is in use by another run: process "
        rf"{holder.pid} on {socket.gethostname()}, started ",
    )
    self.assertLess(time.monotonic() - start, 10)
    self.assertEqual(os.listdir(run), [run_directory.LOCK_FILE])
    # The holder is killed: its lock is taken over, with a message.
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    out, _ = self._train(run, 6)
    self.assertIn(f"took over the lock of {run} from process {holder.pid}", out)
    self.assertFalse(os.path.exists(os.path.join(run, run_directory.LOCK_FILE)))
    rows = self._same_rows(run, 6, [])
    self.assertEqual(_checkpoints(run), [3, 6])

    # metrics.jsonl cut in the middle of the resumed step's line.
    path = os.path.join(run, "metrics.jsonl")
    with open(path, "rb") as f:
      data = f.read()
    with open(path, "wb") as f:
      f.write(data[: data.rindex(b"\n", 0, -1) + 40])
    self.assertEqual(_steps_torn(path), [1, 2, 3, 4, 5])
    out, _ = self._train(run, 7)
    self.assertIn("resumed from step 6", out)
    rows = self._same_rows(run, 7, rows)

    # The newest checkpoint damaged: skipped, set aside, resumed before it.
    _damage(run, 7)
    out, _ = self._train(run, 9)
    self.assertRegex(
        out,
        rf"skipped checkpoint 7: Checkpoint {run}/7 cannot be read; it is "
        r"truncated or damaged \(",
    )
    self.assertIn(f"set checkpoint 7 aside as {run}/7.damaged", out)
    self.assertIn("resumed from step 6", out)
    rows = self._same_rows(run, 9, rows)
    self.assertEqual(_checkpoints(run), [3, 6, 9])

    # An explicit older checkpoint: the newer ones are set aside.
    out, _ = self._train(run, 9, "--resume-step", "3")
    self.assertIn("resumed from step 3", out)
    self.assertIn(f"set checkpoint 9 aside as {run}/9.superseded", out)
    rows = self._same_rows(run, 9, rows)
    _, err = self._train(run, 9, "--resume-step", "5", code=2)
    self.assertRegex(err, rf"--resume-step 5: {run} holds no checkpoint of")

    # A save that fails mid-run (the commit of checkpoint 12 refused, at
    # the file layer): the run stops; checkpoint 9 stays the latest, whole.
    with _failing_commit(12, errno.EACCES):
      _, err = self._train(run, 18, code=1)
    self.assertEqual(err.count("\n"), 1, err)
    self.assertRegex(
        err,
        rf"^linen-moe: error: saving checkpoint 12 in {run} failed "
        r"\(Permission denied\); the run stopped after step 1[2-5]\. The "
        r"last complete checkpoint is step 9",
    )
    self.assertEqual(_checkpoints(run)[-1], 9)
    out, _ = self._train(run, 12)
    self.assertIn("resumed from step 9", out)
    rows = self._same_rows(run, 12, rows)

    # A reader takes no lock: export works while a run holds the directory.
    lock = _lock_file(run)
    exported = os.path.join(os.path.dirname(run), "exported")
    code, out, err = _cli("export", "--checkpoint-dir", run, "--out", exported)
    self.assertEqual(code, 0, err)
    self.assertIn("exported step 12", out)
    os.remove(lock)

    # No checkpoint reads: the run stops, naming each.
    for step in _checkpoints(run):
      _damage(run, step)
    _, err = self._train(run, 15, code=2)
    self.assertEqual(err.count("\n"), 1, err)
    self.assertRegex(
        err, rf"no checkpoint in {run} can be read: 12 \(.*\), 9 \(.*\), 6 \("
    )
    # What was set aside is kept.
    for kept in ("7.damaged", "6.superseded", "9.superseded"):
      self.assertTrue(os.path.isdir(os.path.join(run, kept)), kept)


def _steps_torn(path: str) -> list[int]:
  """The steps of the complete lines of a metrics file."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line)["step"] for line in f if line.endswith("\n")]


@testing.slow
class TwoTrainCommandsTest(absltest.TestCase):
  """Two `linen-moe train` processes started on one directory: the second
  stops at once naming the first; once the first is killed, the next run
  takes its lock over."""

  def test_second_command_stops_then_takes_over(self):
    run = os.path.join(helpers.tempdir(self), "run")
    argv = [sys.executable, "-m", "linen_moe_cli.main", *TRAIN]
    argv += ["--checkpoint-dir", run]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    first = subprocess.Popen(
        [*argv, "--steps", "100000", "--save-every", "100000"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    self.addCleanup(first.kill)
    lock = os.path.join(run, run_directory.LOCK_FILE)
    while not os.path.exists(os.path.join(run, "metrics.jsonl")):
      self.assertIsNone(first.poll())
      time.sleep(0.1)
    command = functools.partial(
        subprocess.run,
        [*argv, "--steps", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    second = command()
    self.assertEqual(second.returncode, 2, second.stderr)
    self.assertRegex(
        second.stderr,
        rf"^linen-moe: error: {run} is in use by another run: process "
        rf"{first.pid} on {socket.gethostname()}",
    )
    self.assertIsNone(first.poll())  # the first runs on, undisturbed
    first.send_signal(signal.SIGKILL)
    first.wait()
    self.assertTrue(os.path.exists(lock))
    third = command()
    self.assertEqual(third.returncode, 0, third.stderr)
    self.assertIn(f"from process {first.pid}", third.stdout)
    self.assertEqual(_steps(run), [1, 2, 3])
    self.assertFalse(os.path.exists(lock))


class DiskFullTest(absltest.TestCase):
  """A full disk: a 4 MB tmpfs holds checkpoint 3 (2.6 MB at one layer) but
  not 3 and 6; the save of 6 fails with ENOSPC and the run stops at once,
  with checkpoint 3 restorable. Where no tmpfs can be mounted, the commit
  of checkpoint 6 fails with ENOSPC at the file layer instead."""

  # After a failed read or save, a tensorstore callback reaches orbax's
  # closed event loop ("Event loop is closed", ignored by Python).
  @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
  def test_disk_full_mid_run(self):
    disk = _mount_tmpfs(self, "4m")
    faults = contextlib.ExitStack()
    if disk is None:
      disk = helpers.tempdir(self)
      faults.enter_context(_failing_commit(6, errno.ENOSPC))
    run = os.path.join(disk, "run")
    with faults:
      got, _, err = _cli(*TRAIN, "--steps", "12", "--checkpoint-dir", run)
    self.assertEqual((got, err.count("\n")), (1, 1), err)
    self.assertRegex(
        err,
        r"^linen-moe: error: saving checkpoint 6 in .* failed \(No space left "
        r"on device\); the run stopped after step [6-9]\. The last complete "
        r"checkpoint is step 3",
    )
    from linen_moe import checkpoint  # noqa: PLC0415

    with checkpoint.Checkpoints(run, create=False) as ckpts:
      self.assertEqual(ckpts.all_steps(), [3])
      leaves = ckpts.saved_leaves(3)
      tree = ckpts.read(3, checkpoint.abstract(leaves))
    self.assertEqual(int(tree["step"]), 3)


if __name__ == "__main__":
  absltest.main()
