"""`linen_moe_cli.host_memory`: the restart with glibc malloc tunables that
let a compiled program reuse its temporary buffer from call to call."""

import os
import platform

from absl.testing import absltest

from linen_moe_cli import host_memory
from tests import workers

TUNED = ":".join(host_memory.TUNABLES)


class TunedEnvironTest(absltest.TestCase):

  def test_adds_the_tunables(self):
    env = host_memory.tuned_environ({"HOME": "/h"}, libc="glibc")
    self.assertEqual(env, {"HOME": "/h", host_memory.ENV: TUNED})

  def test_keeps_other_tunables(self):
    env = host_memory.tuned_environ(
        {host_memory.ENV: "glibc.pthread.rseq=0"}, libc="glibc"
    )
    self.assertEqual(env[host_memory.ENV], "glibc.pthread.rseq=0:" + TUNED)

  def test_runs_as_is(self):
    for environ, libc in (
        ({}, "musl"),
        ({}, ""),
        ({host_memory.OPT_OUT: "1"}, "glibc"),
        ({host_memory.ENV: "glibc.malloc.arena_max=4"}, "glibc"),
        ({host_memory.ENV: TUNED}, "glibc"),  # restarted already
    ):
      with self.subTest(environ=environ, libc=libc):
        self.assertIsNone(host_memory.tuned_environ(environ, libc=libc))


@absltest.skipUnless(
    platform.system() == "Linux" and platform.libc_ver()[0] == "glibc",
    "glibc malloc tunables",
)
@absltest.skipIf(
    "glibc.malloc." in os.environ.get(host_memory.ENV, ""),
    "this process's GLIBC_TUNABLES already sets malloc tunables",
)
class RestartTest(absltest.TestCase):

  def test_the_restarted_process_reuses_its_temporary_buffer(self):
    tuned = workers.run_json("tests.cli_host_memory_worker", "tuned")
    default = workers.run_json("tests.cli_host_memory_worker", "default")
    self.assertEqual(tuned["tunables"], TUNED)
    self.assertIsNone(default["tunables"])
    pages = tuned["temp_pages"]
    self.assertGreaterEqual(pages, 65536)  # the 256 MiB buffer
    # glibc's defaults map the buffer afresh and fault it in at every call.
    # After the restart the heap grows over the first calls (a buffer freed
    # after the next call's was allocated leaves a hole) and then holds
    # every call's: the last 8 of 24 calls fault in less than one buffer.
    self.assertGreater(min(default["faults"]), pages // 2, default)
    self.assertLess(sum(tuned["faults"][-8:]), pages, tuned)


if __name__ == "__main__":
  absltest.main()
