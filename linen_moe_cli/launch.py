"""`linen-moe launch`: N local processes of one job, watched as a group.

    linen-moe launch --local-processes 2 --devices-per-process 4 -- \\
        train --mesh data=2,expert=4 --steps 3

starts `linen-moe train ... --coordinator localhost:PORT --num-processes 2
--process-id I` for I = 0, 1 on a free port, each on D simulated CPU
devices, streams process 0's output (the others are quiet), and exits
non-zero, with the failing process's last lines, when any process fails or
the group runs past `--timeout`. It stands in for a cluster launcher
(`srun`, `mpirun`) on one machine: for tests, and for trying multi-process
training without a cluster.

The group is all or nothing: after the first failure the others get
`GRACE_S` seconds to stop on their own (JAX's heartbeats end them too), and
are then killed.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from linen_moe.distributed import free_port

GRACE_S = 5.0
TAIL_LINES = 20
PROCESS_FLAGS = ("--coordinator", "--num-processes", "--process-id")
# Lines of output a user never needs: gloo's connection notices (stdout) and
# the native stack frames of JAX's fatal-error report.
_NOISE = re.compile(r"^\[Gloo\] |^\s*@\s+0x[0-9a-f]+\s")


def child_commands(argv: list[str], num_processes: int) -> list[list[str]]:
  """One `linen-moe` command line per process, joined on a free port.

  Args:
    argv: the command after `--`, e.g. ["train", "--steps", "3"].
    num_processes: N >= 1; with 1, the command runs as a plain single
      process.
  """
  if isinstance(num_processes, bool) or not isinstance(num_processes, int):
    raise TypeError(f"local_processes={num_processes!r} must be an int.")
  if num_processes < 1:
    raise ValueError(f"local_processes={num_processes} must be >= 1.")
  if not argv or argv[0] != "train":
    raise ValueError(
        f"launch runs `train` (the one command that joins processes); got "
        f"{' '.join(argv) or 'nothing'} after `--`."
    )
  given = [f for f in PROCESS_FLAGS if any(a.split("=")[0] == f for a in argv)]
  if given:
    raise ValueError(
        f"launch sets {', '.join(given)} itself; remove them from the command."
    )
  base = [sys.executable, "-m", "linen_moe_cli.main", *argv]
  if num_processes == 1:
    return [base]
  coordinator = f"localhost:{free_port()}"
  return [
      base
      + ["--coordinator", coordinator]
      + ["--num-processes", str(num_processes), "--process-id", str(i)]
      for i in range(num_processes)
  ]


def child_env(devices_per_process: int | None) -> dict[str, str]:
  """This environment, unbuffered; with D, each process on D CPU devices."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if devices_per_process is None:
    return env
  if devices_per_process < 1:
    raise ValueError(
        f"devices_per_process={devices_per_process} must be >= 1."
    )
  flags = re.sub(
      r"--xla_force_host_platform_device_count=\S*",
      "",
      env.get("XLA_FLAGS", ""),
  ).split()
  flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
  env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  return env


@dataclasses.dataclass
class _Child:
  """One running process, its output readers and its last lines."""

  index: int
  popen: subprocess.Popen
  tail: collections.deque = dataclasses.field(
      default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
  )
  threads: list[threading.Thread] = dataclasses.field(default_factory=list)

  def kill(self) -> None:
    if self.popen.poll() is None:
      try:
        os.killpg(self.popen.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass

  def last_lines(self) -> str:
    return "\n".join(f"  | {line}" for line in self.tail) or "  | (no output)"


def _pump(source: IO[bytes], child: _Child, sink: IO[str] | None) -> None:
  """Copies `source` line by line into the child's tail and, for process 0,
  into `sink`. A carriage return ends a line too, so progress bars pass."""
  pending = b""
  while chunk := source.read1(4096):
    pending += chunk
    *lines, pending = re.split(rb"(?<=[\r\n])", pending)
    for raw in lines:
      line = raw.decode(errors="replace")
      if _NOISE.search(line):
        continue
      if line.strip():
        child.tail.append(line.rstrip("\r\n"))
      if sink is not None:
        sink.write(line)
        sink.flush()
  if pending:
    child.tail.append(pending.decode(errors="replace"))
    if sink is not None:
      sink.write(pending.decode(errors="replace"))
      sink.flush()


def _start(index, command, env, out, err) -> _Child:
  popen = subprocess.Popen(
      command,
      env=env,
      stdin=subprocess.DEVNULL,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      start_new_session=True,  # its own process group, killed as one
  )
  child = _Child(index, popen)
  for source, sink in ((popen.stdout, out), (popen.stderr, err)):
    thread = threading.Thread(
        target=_pump,
        args=(source, child, sink if index == 0 else None),
        daemon=True,
    )
    thread.start()
    child.threads.append(thread)
  return child


def _describe(code: int) -> str:
  if code < 0:
    return f"killed by {signal.Signals(-code).name}"
  return f"exit code {code}"


def run_group(
    commands: list[list[str]],
    env: dict[str, str],
    *,
    timeout_s: float,
    grace_s: float = GRACE_S,
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
) -> int:
  """Runs `commands` as one group; returns 0 when all of them succeed.

  Process 0's stdout and stderr go to `out` and `err` as they come. The
  first process to fail (or every process, past `timeout_s` seconds) is
  reported on `err` with its last lines; the others get `grace_s` seconds
  and are killed. Returns the first failure's exit code (1 for a signal),
  or 124 on a timeout.
  """
  if timeout_s <= 0:
    raise ValueError(f"timeout={timeout_s} must be > 0 seconds.")
  children = [
      _start(i, command, env, out, err) for i, command in enumerate(commands)
  ]
  deadline = time.monotonic() + timeout_s
  failed = None
  try:
    while failed is None and time.monotonic() < deadline:
      codes = [c.popen.poll() for c in children]
      if all(code == 0 for code in codes):
        break
      failed = next(
          (c for c, code in zip(children, codes) if code not in (None, 0)),
          None,
      )
      time.sleep(0.1)
    if failed is not None:
      end = time.monotonic() + grace_s
      while time.monotonic() < end and any(
          c.popen.poll() is None for c in children
      ):
        time.sleep(0.1)
  finally:
    for c in children:
      c.kill()
    for c in children:
      c.popen.wait()
      for thread in c.threads:
        thread.join(timeout=5)
  n = len(children)
  if failed is not None:
    code = failed.popen.returncode
    err.write(
        f"linen-moe launch: process {failed.index} of {n} failed "
        f"({_describe(code)}); its last lines:\n{failed.last_lines()}\n"
    )
    return code if code > 0 else 1
  if any(c.popen.returncode != 0 for c in children):
    lines = "\n".join(
        f"process {c.index}:\n{c.last_lines()}" for c in children
    )
    err.write(
        f"linen-moe launch: timed out after {timeout_s:g}s; stopped all "
        f"{n} processes. Their last lines:\n{lines}\n"
    )
    return 124
  return 0


def launch(
    argv: list[str],
    local_processes: int,
    devices_per_process: int | None = None,
    timeout_s: float = 3600.0,
) -> int:
  """`linen-moe launch`: `argv` on `local_processes` processes."""
  commands = child_commands(argv, local_processes)
  env = child_env(devices_per_process)
  return run_group(commands, env, timeout_s=timeout_s)
