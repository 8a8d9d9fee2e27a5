"""Stopping on a signal (`training.StopRequest`) and a hang ended by the step
timeout (the run's watchdog), without training: signals sent to this
process, or to a small Python child that imports no jax. A whole run
stopped, hung or killed: test_cli_stop.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from absl.testing import absltest
from absl.testing import parameterized

from linen_moe import training
from linen_moe._src.run import stop as stop_lib
from linen_moe._src.run import watchdog

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


def _child(code: str) -> subprocess.Popen:
  """`python -c code` from the checkout, its output captured as text."""
  return subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(code)],
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )


def assert_stacks(test, err: str, path: str, head: str) -> str:
  """`head`, then every thread's stack (the watchdog's own thread's among
  them), on stderr (`err`) and in the file `path`; returns the file's
  text."""
  with open(path, encoding="utf-8") as f:
    written = f.read()
  for stacks in (err, written):
    test.assertIn(head, stacks)
    test.assertIn("Current thread", stacks)
  return written


class StopRequestTest(parameterized.TestCase):
  """Signals sent to this process inside a `StopRequest`."""

  @parameterized.parameters(
      (signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")
  )
  def test_a_signal_is_a_request(self, signum, code, name):
    before = signal.getsignal(signum)
    with training.StopRequest() as stop:
      self.assertFalse(stop.should_stop())
      self.assertEqual(stop.exit_code, 0)
      os.kill(os.getpid(), signum)  # no KeyboardInterrupt, no exit
      self.assertEqual(stop.received, signum)
      self.assertTrue(stop.should_stop())
      self.assertTrue(stop.should_stop())  # once True, True
    self.assertEqual((stop.signal, stop.exit_code), (signum, code))
    self.assertIs(signal.getsignal(signum), before)  # restored
    stopped = stop_lib.RunInterrupted(signum, 7, 12, "/runs/a/7")
    self.assertIsInstance(stopped, training.RunStopped)
    self.assertEqual((stopped.signal, stopped.exit_code), (signum, code))
    self.assertEqual(
        (training.RunStopped("x").signal, training.RunStopped("x").exit_code),
        (None, 1),
    )
    self.assertEqual(
        str(stopped),
        f"stopped by {name} after step 7 of 12; its checkpoint is /runs/a/7.",
    )

  def test_other_signals_and_nesting(self):
    with training.StopRequest([signal.SIGUSR1]) as outer:
      with training.StopRequest() as inner:  # hears SIGTERM until left
        os.kill(os.getpid(), signal.SIGTERM)
      self.assertTrue(inner.should_stop())
      self.assertFalse(outer.should_stop())
      os.kill(os.getpid(), signal.SIGUSR1)
      self.assertEqual(outer.should_stop(), True)
    self.assertEqual(outer.exit_code, 128 + signal.SIGUSR1)

  @parameterized.parameters(
      ([], ValueError, r"signals=\[\] is invalid: expected a non-empty"),
      ("SIGTERM", TypeError, r"signals='SIGTERM' is invalid: expected"),
      ([15, "2"], TypeError, r"signals=\[15, '2'\] is invalid: '2' is not a"),
      ([signal.SIGKILL], ValueError, r".*: 9 \(SIGKILL\) cannot be handled"),
      ([0], ValueError, r"signals=\[0\] is invalid: 0 \(signal 0\) cannot"),
  )
  def test_bad_signals(self, signals, error, message):
    with self.assertRaisesRegex(error, "^StopRequest: " + message):
      training.StopRequest(signals)

  def test_bad_on_exit(self):
    with self.assertRaisesRegex(
        TypeError, r"^StopRequest: on_exit='exit' is invalid: expected a "
    ):
      training.StopRequest(on_exit="exit")

  def test_second_signal_exits_at_once(self):
    """The main thread sleeps; the first SIGTERM asks, the second ends the
    process at once with 143, after `on_exit`."""
    marker = os.path.join(tempfile.mkdtemp(), "released")
    child = _child(f"""
        import time
        from linen_moe import training
        def on_exit():
          open({marker!r}, "w").close()
        with training.StopRequest(on_exit=on_exit) as stop:
          print("ready", flush=True)
          time.sleep(60)
        print("not reached", flush=True)
        """)
    self.assertEqual(child.stdout.readline(), "ready\n")
    child.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    self.assertIsNone(child.poll())  # a request, not an exit
    start = time.monotonic()
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    self.assertLess(time.monotonic() - start, 5)
    self.assertEqual(child.returncode, 143, err)
    self.assertNotIn("not reached", out)
    self.assertIn("a second SIGTERM: exiting at once", err)
    self.assertTrue(os.path.exists(marker))

  def test_a_repeated_signal_is_one_request(self):
    """Two SIGTERMs at once (a Slurm time limit sends two, 5 ms apart) ask
    once: the process stays, and a third, later, ends it."""
    child = _child("""
        import time
        from linen_moe import training
        with training.StopRequest() as stop:
          print("ready", flush=True)
          time.sleep(60)
        """)
    self.assertEqual(child.stdout.readline(), "ready\n")
    child.send_signal(signal.SIGTERM)
    time.sleep(0.05)  # delivered apart (pending ones would merge)
    child.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    self.assertIsNone(child.poll())  # one request, not an exit
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    self.assertEqual(child.returncode, 143, err)
    self.assertIn("a second SIGTERM: exiting at once", err)


class WatchdogTest(absltest.TestCase):

  def test_a_hung_phase_dumps_every_stack_and_exits(self):
    """The first train step (it compiles) takes longer than the limit
    unwatched; step 2 hangs: the stacks of every thread go to stderr and
    to the directory, and the process exits with STEP_TIMEOUT_EXIT."""
    directory = tempfile.mkdtemp()
    child = _child(f"""
        import threading, time
        from linen_moe._src.run import watchdog
        threading.Thread(target=time.sleep, args=(60,), name="helper",
                         daemon=True).start()
        with watchdog.Watchdog(
            0.5, platform="cpu", directory={directory!r}, process=(1, 2)
        ) as watch:
          with watch.phase("step", 1):
            time.sleep(1.0)
          with watch.phase("data", 2):
            pass
          print("hanging", flush=True)
          with watch.phase("step", 2):
            time.sleep(60)
        """)
    self.assertEqual(child.stdout.readline(), "hanging\n")
    start = time.monotonic()
    _, err = child.communicate(timeout=60)
    self.assertLess(time.monotonic() - start, 5)
    self.assertEqual(child.returncode, watchdog.STEP_TIMEOUT_EXIT, err)
    path = os.path.join(directory, "stacks.process_1.txt")
    head = (
        "linen-moe: step 2: step ran past step_timeout 0.5s on process 1 "
        f"of 2; every thread's stack follows (also in {path}). Exit status 75."
    )
    written = assert_stacks(self, err, path, head)
    for stacks in (err, written):
      self.assertRegex(stacks, r"line \d+ in <module>")  # the main thread
      self.assertGreaterEqual(stacks.count("Thread 0x"), 2)  # and the helper

  def test_the_default_rule(self):
    off = watchdog.Watchdog(None, platform="cpu")
    self.assertIsNone(off._thread)  # noqa: SLF001
    with watchdog.Watchdog(0, platform="tpu") as zero:
      self.assertIsNone(zero._thread)  # noqa: SLF001
    with watchdog.Watchdog(None, platform="tpu") as auto:
      for step in range(1, watchdog.AUTO_STEPS + 1):
        with auto.phase("step", step):
          pass
        self.assertIsNone(auto.limit, step)
      with auto.phase("step", watchdog.AUTO_STEPS + 1):
        pass
      self.assertEqual(auto.limit, watchdog.AUTO_MIN_S)  # fast steps
      self.assertEqual(auto._limit_of("data"), watchdog.AUTO_MIN_S)  # noqa: SLF001
      self.assertIsNone(auto._limit_of("save"))  # noqa: SLF001
      self.assertIn("20 x the median step", auto.describe())
    self.assertEqual(watchdog.auto_limit([30.0, 20.0, 25.0, 60.0, 21.0]), 500)
    self.assertEqual(watchdog.auto_limit([1.0] * 5), 300)
    with watchdog.Watchdog(10, platform="cpu") as fixed:
      self.assertIsNone(fixed._limit_of("step"))  # noqa: SLF001 (compiles)
      self.assertEqual(fixed._limit_of("save"), 10)  # noqa: SLF001
      with self.assertRaisesRegex(ValueError, "phase='load' is invalid"):
        with fixed.phase("load", 1):
          pass


class StepTimeoutOptionTest(parameterized.TestCase):

  @parameterized.parameters(-1, float("nan"), float("inf"), True, "5")
  def test_bad_step_timeout(self, value):
    with self.assertRaisesRegex(
        ValueError,
        r"^step_timeout=.* is invalid: expected seconds >= 0 \(0: off\)\.$",
    ):
      training.RunOptions(step_timeout=value)

  def test_good_step_timeout(self):
    for value in (None, 0, 0.5, 600):
      self.assertEqual(
          training.RunOptions(step_timeout=value).step_timeout, value
      )


if __name__ == "__main__":
  absltest.main()
