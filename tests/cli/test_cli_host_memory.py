"""`linen_moe.training.reuse_host_memory`: the restart with glibc malloc tunables that
let a compiled program reuse its temporary buffer from call to call, and
the pause after each step that keeps the heap from growing."""

import os
import platform
import subprocess
import sys
from unittest import mock

from absl.testing import absltest

from linen_moe import testing
from linen_moe._src.run import host_memory
from linen_moe_cli import main as cli
from tests import workers

TUNED = ":".join(host_memory.TUNABLES)
ASK = host_memory.OPT_IN


class TunedEnvironTest(absltest.TestCase):

  def test_adds_the_tunables(self):
    env = host_memory.tuned_environ({"HOME": "/h", ASK: "1"}, libc="glibc")
    self.assertEqual(env, {"HOME": "/h", ASK: "1", host_memory.ENV: TUNED})

  def test_keeps_other_tunables(self):
    env = host_memory.tuned_environ(
        {host_memory.ENV: "glibc.pthread.rseq=0", ASK: "1"}, libc="glibc"
    )
    self.assertEqual(env[host_memory.ENV], "glibc.pthread.rseq=0:" + TUNED)

  def test_runs_as_is(self):
    for environ, libc in (
        ({}, "glibc"),  # not asked for
        ({ASK: "0"}, "glibc"),
        ({ASK: "1"}, "musl"),
        ({ASK: "1"}, ""),
        ({ASK: "1", host_memory.ENV: "glibc.malloc.arena_max=4"}, "glibc"),
        ({ASK: "1", host_memory.ENV: TUNED}, "glibc"),  # restarted already
    ):
      with self.subTest(environ=environ, libc=libc):
        self.assertIsNone(host_memory.tuned_environ(environ, libc=libc))


class SettleTest(absltest.TestCase):

  def test_reusing_needs_every_tunable(self):
    env = host_memory.ENV
    self.assertTrue(host_memory.reusing({env: TUNED}))
    self.assertTrue(host_memory.reusing({env: "glibc.pthread.rseq=0:" + TUNED}))
    self.assertFalse(host_memory.reusing({}))
    self.assertFalse(host_memory.reusing({env: host_memory.TUNABLES[0]}))

  def test_waits_only_when_reusing(self):
    for tunables, waits in ((TUNED, True), ("glibc.malloc.arena_max=4", False)):
      with (
          mock.patch.dict(os.environ, {host_memory.ENV: tunables}),
          mock.patch.object(host_memory.time, "sleep") as sleep,
      ):
        host_memory.settle()
      with self.subTest(tunables=tunables):
        if waits:
          sleep.assert_called_once_with(host_memory.SETTLE_S)
        else:
          sleep.assert_not_called()

  def test_the_train_loop_settles_after_every_step(self):
    with mock.patch.object(host_memory, "settle") as settle:
      status, _, err = testing.run_capturing(
          cli.main,
          ["train", "--steps=3", "--batch-size=2", "--seq-len=8"]
          + ["--no-progress"],
      )
    self.assertEqual(status, 0, err)
    self.assertEqual(settle.call_count, 3)


@absltest.skipUnless(
    platform.system() == "Linux" and platform.libc_ver()[0] == "glibc",
    "glibc malloc tunables",
)
@absltest.skipIf(
    "glibc.malloc." in os.environ.get(host_memory.ENV, ""),
    "this process's GLIBC_TUNABLES already sets malloc tunables",
)
class RestartTest(absltest.TestCase):

  def test_only_the_step_bound_commands_restart(self):
    # `-X importtime` lists each process's imports: a restarted command
    # imports its subcommand's module twice, once in each process.
    for argv, processes, asked in (
        (["train", "--steps=0"], 2, "1"),
        (["generate", "--help"], 2, "1"),
        (["train", "--steps=0"], 1, "0"),
        (["matrix", "--help"], 1, "1"),
        (["--help"], 1, "1"),
    ):
      env = dict(workers.env(), **{ASK: asked})
      with self.subTest(argv=argv, asked=asked):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "linen_moe_cli.main"]
            + argv,
            capture_output=True,
            text=True,
            env=env,
            cwd=workers.ROOT,
            timeout=120,
            check=False,
        )
        imports = done.stderr.count(" linen_moe_cli.commands.train\n")
        self.assertEqual(imports, processes, done.stderr[-2000:])

  @testing.slow  # two jax workers; the restart itself is the test above
  def test_the_restarted_process_reuses_its_temporary_buffer(self):
    tuned = workers.run_json("tests.cli_host_memory_worker", "tuned")
    default = workers.run_json("tests.cli_host_memory_worker", "default")
    self.assertEqual(tuned["tunables"], TUNED)
    self.assertIsNone(default["tunables"])
    pages = tuned["temp_pages"]
    self.assertGreaterEqual(pages, 65536)  # the 256 MiB buffer
    # glibc's defaults map the buffer afresh and fault it in at every call.
    # After the restart the heap grows over the first calls (a buffer freed
    # after the next call's was allocated leaves a hole the heap grows past;
    # 2-6 of 23 calls here) and then holds every call's buffer.
    self.assertGreater(min(default["faults"]), pages // 2, default)
    self.assertLess(
        sum(tuned["faults"][1:]), sum(default["faults"][1:]) // 2, tuned
    )


if __name__ == "__main__":
  absltest.main()
