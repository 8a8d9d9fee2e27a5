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


# Where `LINEN_MOE_COMMAND_LOG` names a file, every command line a test
# runs is appended to it too: `.ci/run` prints it after the heavy checks,
# since pytest shows a passing test's output nowhere.
COMMAND_LOG_ENV = "LINEN_MOE_COMMAND_LOG"


def log_command(argv: list[str]) -> None:
  """Prints `$ argv` (the test's log), and appends it to the command log."""
  line = "$ " + " ".join(argv)
  print(line, flush=True)
  if path := os.environ.get(COMMAND_LOG_ENV):
    with open(path, "a", encoding="utf-8") as f:
      f.write(line + "\n")


def mkdtemp() -> str:
  return tempfile.mkdtemp(prefix="linen_moe_launcher-")


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
  """`argv` to its end, output captured as text; the command line is
  logged (`log_command`)."""
  log_command(argv)
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
  """`argv` started, output captured as text; the command line logged
  (`log_command`)."""
  log_command(argv)
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
