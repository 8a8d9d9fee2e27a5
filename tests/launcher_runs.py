"""What the tests of cluster launchers share (test_cli_slurm.py,
test_cli_mpirun.py): the tasks' environment, the training flags, running a
command; a run directory's rows to compare are
`helpers.run_metrics(directory, recipe_steps=False)`."""

from __future__ import annotations

import os
import subprocess
import tempfile

from tests import workers

ROOT = workers.ROOT
# A one-layer tiny_mixtral, 4 rows (one a task on 4 tasks) of 8 tokens.
TRAIN = ["--set", "num_layers=1", "--batch-size", "4", "--seq-len", "8"]
TRAIN += ["--no-progress"]
COMMAND_TIMEOUT_S = 900


def task_env(base: dict[str, str], **extra: str) -> dict[str, str]:
  """`base` for the processes a launcher starts: one CPU device each, no
  persistent compilation cache (a group's processes must not share one,
  see `launcher.child_env`), `tests` importable, unbuffered."""
  env = workers.env(devices=1)
  env.update(base)
  env["XLA_FLAGS"] = workers.env(devices=1)["XLA_FLAGS"]
  env.update(
      PYTHONPATH=ROOT,
      JAX_PLATFORMS="cpu",
      JAX_ENABLE_COMPILATION_CACHE="false",
      PYTHONUNBUFFERED="1",
      **extra,
  )
  return env


def mkdtemp() -> str:
  return tempfile.mkdtemp(prefix="linen_moe_launcher-")


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
  """`argv` to its end, output captured as text; the command line is
  printed (the test's log)."""
  print("$", " ".join(argv), flush=True)
  return subprocess.run(
      argv,
      env=env,
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=COMMAND_TIMEOUT_S,
      check=False,
  )


def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
  """`argv` started, output captured as text; the command line printed."""
  print("$", " ".join(argv), flush=True)
  return subprocess.Popen(
      argv,
      env=env,
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )


def lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    return f.read().count("\n")
