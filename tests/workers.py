"""Running a test worker module in its own process (e.g. to simulate devices,
which must be set before jax is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command(module: str, *argv: str) -> dict[str, Any]:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return {
      "args": [sys.executable, "-m", module, *argv],
      "cwd": ROOT,
      "env": env,
  }


def start(module: str, *argv: str, stdout=subprocess.DEVNULL):
  """Starts `python -m module *argv` (see `run_json`); its stdout is text."""
  return subprocess.Popen(
      **_command(module, *argv),
      stdout=stdout,
      stderr=subprocess.DEVNULL,
      text=True,
  )


def run_json(module: str, *argv: str, timeout: int = 900) -> Any:
  """Runs `python -m module *argv` from the repository root on CPU devices
  and returns the JSON of its last line of output."""
  proc = subprocess.run(
      **_command(module, *argv),
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
  )
  if proc.returncode:
    raise AssertionError(f"worker failed:\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])
