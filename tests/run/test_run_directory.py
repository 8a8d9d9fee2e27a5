"""A run's directory (`training.run` with `RunOptions(checkpoint_dir=DIR)`)
under faults.

One writer: a second run on DIR stops at once naming the holder, and a
lock left by a killed run is taken over. No lost rows: after a torn
`metrics.jsonl`, a damaged checkpoint, an explicit `resume_step` or a
failed save, DIR/metrics.jsonl holds every step once, in order. A damaged
newest checkpoint is skipped (and set aside), a directory that cannot be
made or written is a one-line `ValueError` before any model is built, and
a save that fails mid-run (a full disk, a refused write) stops the run
(`RunStopped`) with the last good checkpoint restorable.

The runs are tiny (one layer, batch 2, 8 tokens) and share one compiled
step where they can; `FaultsTest` walks one directory through every fault
in turn. The lock alone: test_run_lock.py; the command's words, exit
statuses and a process group: tests/cli/test_cli_run_directory.py.
"""

from __future__ import annotations

import contextlib
import errno
import glob
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

from linen_moe import checkpoint
from linen_moe import training
from linen_moe._src.run import directory as run_directory
from linen_moe._src.run import setup as run_setup
from linen_moe._src.testing import helpers
from tests.run import test_run_lock

SHAPE = dict(
    config="tiny_mixtral",
    overrides={"num_layers": 1},
    batch_size=2,
    seq_len=8,
    save_every=3,
    progress=False,
)


def _options(directory: str, steps: int, **fields) -> training.RunOptions:
  return training.RunOptions(
      steps=steps, checkpoint_dir=directory, **SHAPE, **fields
  )


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
      cwd=test_run_lock.ROOT,
      stdout=subprocess.PIPE,
      text=True,
  )
  assert proc.stdout.readline().strip() == "locked"
  return proc


def below_a_file(test) -> tuple[str, str]:
  """(a regular file, a directory path below it) in a new directory."""
  afile = os.path.join(helpers.tempdir(test), "file")
  with open(afile, "w", encoding="utf-8") as f:
    f.write("x")
  return afile, os.path.join(afile, "run")


@contextlib.contextmanager
def _one_line(test, error: type[Exception], pattern: str):
  """`test.assertRaisesRegex(error, pattern)`, the message one line."""
  with test.assertRaisesRegex(error, pattern) as caught:
    yield caught
  test.assertNotIn("\n", str(caught.exception))


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

  def _check(self, directory, message):
    with (
        mock.patch.object(run_setup, "set_up") as set_up,
        _one_line(self, ValueError, "^" + message),
    ):
      training.run(_options(directory, 3), log=self.fail)
    set_up.assert_not_called()  # no model, no compile

  def test_below_a_regular_file(self):
    afile, below = below_a_file(self)
    self._check(
        below,
        rf"`checkpoint_dir` {below} cannot be a directory: {afile} is a file",
    )
    out = os.path.join(below, "x")
    with _one_line(
        self, ValueError, rf"^`out` {out} cannot be created: {afile} is a"
    ):
      checkpoint.check_new_directory(out, "`out`")

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
          run,
          rf"`checkpoint_dir` {run} cannot be created: Read-only file system",
      )
      with _one_line(self, ValueError, "Read-only file system"):
        checkpoint.check_new_directory(run, "`out`")


class FaultsTest(absltest.TestCase):
  """One run directory through every fault, in order; after each, the
  metrics hold steps 1..N once each and equal what earlier runs wrote."""

  def _train(self, directory, steps, **fields) -> str:
    """Runs to `steps`; what it logged, one line a message."""
    said = []
    training.run(_options(directory, steps, **fields), log=said.append)
    return "\n".join(said)

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
    with _one_line(
        self,
        ValueError,
        rf"^{run} is in use by another run: process {holder.pid} on "
        rf"{socket.gethostname()}, started ",
    ):
      self._train(run, 6)
    self.assertLess(time.monotonic() - start, 10)
    self.assertEqual(os.listdir(run), [run_directory.LOCK_FILE])
    # The holder is killed: its lock is taken over, with a message.
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    said = self._train(run, 6)
    self.assertIn(
        f"took over the lock of {run} from process {holder.pid}", said
    )
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
    said = self._train(run, 7)
    self.assertIn("resumed from step 6", said)
    rows = self._same_rows(run, 7, rows)

    # The newest checkpoint damaged: skipped, set aside, resumed before it.
    _damage(run, 7)
    said = self._train(run, 9)
    self.assertRegex(
        said,
        rf"skipped checkpoint 7: Checkpoint {run}/7 cannot be read; it is "
        r"truncated or damaged \(",
    )
    self.assertIn(f"set checkpoint 7 aside as {run}/7.damaged", said)
    self.assertIn("resumed from step 6", said)
    rows = self._same_rows(run, 9, rows)
    self.assertEqual(_checkpoints(run), [3, 6, 9])

    # An explicit older checkpoint: the newer ones are set aside.
    said = self._train(run, 9, resume_step=3)
    self.assertIn("resumed from step 3", said)
    self.assertIn(f"set checkpoint 9 aside as {run}/9.superseded", said)
    rows = self._same_rows(run, 9, rows)
    with self.assertRaisesRegex(
        ValueError, rf"^`resume_step` 5: {run} holds no checkpoint of"
    ):
      self._train(run, 9, resume_step=5)

    # A save that fails mid-run (the commit of checkpoint 12 refused, at
    # the file layer): the run stops; checkpoint 9 stays the latest, whole.
    with (
        _failing_commit(12, errno.EACCES),
        _one_line(
            self,
            training.RunStopped,
            rf"^saving checkpoint 12 in {run} failed \(Permission denied\); "
            r"the run stopped after step 1[2-5]\. The last complete "
            r"checkpoint is step 9",
        ) as caught,
    ):
      self._train(run, 18)
    self.assertIsNone(caught.exception.signal)  # not a stop on a signal
    self.assertEqual(_checkpoints(run)[-1], 9)
    said = self._train(run, 12)
    self.assertIn("resumed from step 9", said)
    rows = self._same_rows(run, 12, rows)

    # A reader takes no lock: an export works while a run holds the
    # directory.
    lock = test_run_lock.lock_file(run)
    exported = os.path.join(os.path.dirname(run), "exported")
    self.assertEqual(checkpoint.export(run, exported), 12)
    os.remove(lock)

    # No checkpoint reads: the run stops, naming each.
    for step in _checkpoints(run):
      _damage(run, step)
    with _one_line(
        self,
        ValueError,
        rf"^no checkpoint in {run} can be read: 12 \(.*\), 9 \(.*\), 6 \(",
    ):
      self._train(run, 15)
    # What was set aside is kept.
    for kept in ("7.damaged", "6.superseded", "9.superseded"):
      self.assertTrue(os.path.isdir(os.path.join(run, kept)), kept)


def _steps_torn(path: str) -> list[int]:
  """The steps of the complete lines of a metrics file."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line)["step"] for line in f if line.endswith("\n")]


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
    with (
        faults,
        _one_line(
            self,
            training.RunStopped,
            r"^saving checkpoint 6 in .* failed \(No space left on device\); "
            r"the run stopped after step [6-9]\. The last complete "
            r"checkpoint is step 3",
        ) as caught,
    ):
      training.run(_options(run, 12), log=lambda _: None)
    self.assertIsNone(caught.exception.signal)  # not a stop on a signal
    with checkpoint.Checkpoints(run, create=False) as ckpts:
      self.assertEqual(ckpts.all_steps(), [3])
      leaves = ckpts.saved_leaves(3)
      tree = ckpts.read(3, checkpoint.abstract(leaves))
    self.assertEqual(int(tree["step"]), 3)


if __name__ == "__main__":
  absltest.main()
