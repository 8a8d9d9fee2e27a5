"""`linen-moe train` runs stopped by signals, hung or killed at chosen points:
one process of a group joined by `jax.distributed`, or alone.

`python -m tests.cli_stop_worker '<json list of runs>' [--coordinator
HOST:PORT --num-processes N --process-id I] [--heartbeat-timeout S]` runs
each run in order, in this process (every process of a group runs the same
runs), and prints one JSON line per run: {"run": i, "process": I, "code":
its exit status, "after_signal_s": seconds from the first signal it sent
itself to the run's end (None: none sent), "line": the run's last line on
stderr, "committed": the checkpoints in its directory after it, "rows":
the steps of its metrics.jsonl, "locked": whether run.lock is left}. A
run is {"argv": [train flags], "faults": [fault, ...]}, a fault
one of these, on the process `process` names (an index, or "all", the
default):

  {"signal": 15, "phase": "step", "step": 3}   the signal sent to itself as
      that phase of that step begins (the run's `Watchdog.phase` hook);
  {"second": 15} or {"second": 9}              a second SIGTERM, or a SIGKILL,
      while the stop's checkpoint is being committed (its commit held back
      30 s): the process ends there;
  {"hang": 300, "phase": "eval", "step": 4}    a sleep of that many seconds
      just before that phase of that step, outside any phase this process
      watches (it prints {"hang_started": unix time} first);
  {"slow_commit": 1.0, "step": 8}              the commit of that checkpoint
      takes that much longer (a save still in flight during the next step).

The faults are monkeypatches of this worker: the library reads nothing of
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import json
import os
import signal
import sys
import time
from unittest import mock

import jax
from orbax.checkpoint._src.path import atomicity

from linen_moe import checkpoint
from linen_moe._src.run import checkpoints as run_checkpoints
from linen_moe._src.run import watchdog
from linen_moe._src.testing import helpers
from linen_moe_cli import main as cli_main
from linen_moe_cli import options
from linen_moe_cli.commands import train as train_command
from tests import workers


def _mine(fault: dict) -> bool:
  where = fault.get("process", "all")
  return where == "all" or where == jax.process_index()


class _Faults:
  """The monkeypatches of one run."""

  def __init__(self, faults: list[dict]):
    self.faults = [f for f in faults if _mine(f)]
    self.signalled: float | None = None

  def phase(self, original):
    faults = self

    def phase(watch, name, step):
      for f in faults.faults:
        if "signal" in f and (f["phase"], f["step"]) == (name, step):
          faults.signalled = faults.signalled or time.monotonic()
          os.kill(os.getpid(), f["signal"])
        if "hang" in f and (f["phase"], f["step"]) == (name, step):
          print(json.dumps({"hang_started": time.time()}), file=sys.__stdout__)
          sys.__stdout__.flush()
          time.sleep(f["hang"])  # before the phase: unwatched here
      return original(watch, name, step)

    return phase

  def rename(self, original):
    """orbax's commit (the rename of a finished temporary directory)."""
    faults = self

    async def rename(src, dst, *args, **kwargs):
      step = os.path.basename(os.fspath(dst))
      for f in faults.faults:
        if "slow_commit" in f and str(f["step"]) == step:
          await asyncio.sleep(f["slow_commit"])
        if "second" in f and step == str(faults.stopping):
          await asyncio.sleep(30)  # the second signal lands meanwhile
      return await original(src, dst, *args, **kwargs)

    return rename

  stopping = None  # the step of the stop's save

  def after_step(self, original):
    """`RunCheckpoints.after_step`: `force` starts the stop's save."""
    faults = self

    def after_step(ckpts, done, *args, force=False, **kwargs):
      if force:
        faults.stopping = done
      return original(ckpts, done, *args, force=force, **kwargs)

    return after_step

  def wait(self, original):
    """`RunCheckpoints.wait`: the stop's save, in flight."""
    faults = self

    def wait(ckpts, done):
      for f in faults.faults:
        if "second" in f:
          time.sleep(0.5)  # the commit has begun, and waits
          os.kill(os.getpid(), f["second"])
      return original(ckpts, done)

    return wait


def run(spec: dict) -> dict:
  parsed = cli_main.build_parser().parse_args(["train", *spec["argv"]])
  faults = _Faults(spec.get("faults", []))
  err = io.StringIO()
  with contextlib.ExitStack() as stack:
    stack.enter_context(
        mock.patch.object(
            watchdog.Watchdog, "phase", faults.phase(watchdog.Watchdog.phase)
        )
    )
    stack.enter_context(
        mock.patch.object(
            atomicity.async_path,
            "rename",
            faults.rename(atomicity.async_path.rename),
        )
    )
    for name in ("after_step", "wait"):
      stack.enter_context(
          mock.patch.object(
              run_checkpoints.RunCheckpoints,
              name,
              getattr(faults, name)(
                  getattr(run_checkpoints.RunCheckpoints, name)
              ),
          )
      )
    stack.enter_context(contextlib.redirect_stderr(err))
    with contextlib.redirect_stdout(io.StringIO()):
      code = train_command.train_and_report(
          options.run_options(parsed), parsed.frontend, ["train", *spec["argv"]]
      )
  end = time.monotonic()
  lines = err.getvalue().strip().splitlines()
  directory = spec["argv"][spec["argv"].index("--checkpoint-dir") + 1]
  with checkpoint.Checkpoints(directory, create=False) as ckpts:
    committed = ckpts.all_steps()
  rows = helpers.read_jsonl(os.path.join(directory, "metrics.jsonl"))
  return {
      "code": code,
      "after_signal_s": faults.signalled and end - faults.signalled,
      "line": lines[-1] if lines else "",
      "committed": committed,
      "rows": [r["step"] for r in rows],
      "locked": os.path.exists(os.path.join(directory, "run.lock")),
  }


def main(argv: list[str]) -> None:
  faulthandler.register(signal.SIGUSR2, all_threads=True)  # to debug a test
  args = workers.join_group(argv, "runs")
  for i, spec in enumerate(json.loads(args.runs)):
    result = run(spec)
    record = {"run": i, "process": jax.process_index(), **result}
    print(json.dumps(record), flush=True)
  sys.stdout.flush()


if __name__ == "__main__":
  main(sys.argv[1:])
