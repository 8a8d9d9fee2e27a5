"""Running a test worker module in its own process (e.g. to simulate devices,
which must be set before jax is imported).

The process runs from the directory that holds `tests/` (the checkout, or
CI's copy of `tests/` beside the installed wheel), with that directory on
`PYTHONPATH`, so `python -m tests.<worker>` works from either.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def env(devices: int | None = None) -> dict[str, str]:
  """This process's environment for a worker on CPU devices: `devices`
  simulated ones when given (XLA_FLAGS), `tests` importable."""
  out = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  if devices is not None:
    flags = [
        f
        for f in out.get("XLA_FLAGS", "").split()
        if not f.startswith(DEVICE_COUNT_FLAG)
    ]
    out["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={devices}"])
  return out


def _command(module: str, *argv: str, devices: int | None) -> dict[str, Any]:
  return {
      "args": [sys.executable, "-m", module, *argv],
      "cwd": ROOT,
      "env": env(devices),
  }


def start(module: str, *argv: str, stdout=subprocess.DEVNULL):
  """Starts `python -m module *argv` (see `run_json`); its stdout is text."""
  return subprocess.Popen(
      **_command(module, *argv, devices=None),
      stdout=stdout,
      stderr=subprocess.DEVNULL,
      text=True,
  )


def run(
    module: str, *argv: str, devices: int | None = None, timeout: int = 900
) -> subprocess.CompletedProcess:
  """Runs `python -m module *argv` on `devices` simulated CPU devices (the
  default: as this process's XLA_FLAGS say); its output captured as text."""
  return subprocess.run(
      **_command(module, *argv, devices=devices),
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
  )


def sharding_jobs(*jobs: dict) -> list:
  """Runs jobs in `tests.sharding_worker` on 8 simulated devices."""
  return run_json("tests.sharding_worker", json.dumps(jobs))


def run_json(module: str, *argv: str, timeout: int = 900) -> Any:
  """Runs `python -m module *argv` from the repository root on CPU devices
  and returns the JSON of its last line of output."""
  proc = run(module, *argv, timeout=timeout)
  if proc.returncode:
    raise AssertionError(f"worker failed:\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def join_group(argv: list[str], jobs: str) -> argparse.Namespace:
  """A process-group worker's command line: a JSON list named `jobs`, then
  the process flags (`--coordinator`, `--num-processes`, `--process-id`,
  `--heartbeat-timeout`); joins the group (`linen_moe.distributed
  .initialize`; alone without them).

  Returns:
    The parsed arguments.
  """
  parser = argparse.ArgumentParser()
  parser.add_argument(jobs)
  parser.add_argument("--coordinator")
  parser.add_argument("--num-processes", type=int)
  parser.add_argument("--process-id", type=int)
  parser.add_argument("--heartbeat-timeout", type=int, default=30)
  args = parser.parse_args(argv)
  from linen_moe import distributed  # noqa: PLC0415 (imports jax)

  distributed.initialize(
      args.coordinator,
      args.num_processes,
      args.process_id,
      heartbeat_timeout_s=args.heartbeat_timeout,
  )
  return args
