"""N local processes of one job, joined as one JAX program and watched as a
group: `launch`.

    result = linen_moe.distributed.launch(
        [sys.executable, "train.py"], num_processes=2, devices_per_process=4
    )

runs the command once per process on a free local port, each with
`--coordinator localhost:PORT --num-processes N --process-id I` appended
(the three arguments of `linen_moe.distributed.initialize`, which the
command passes on), each on D simulated CPU devices when
`devices_per_process` is given; streams process 0's output (the others are
quiet), and ends the group, with the failing process's last lines, when any
process fails or the group runs past its timeout. It stands in for a cluster
launcher (`srun`, `mpirun`) on one machine: for tests, and for trying
multi-process training without a cluster (`linen-moe launch`).

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

from linen_moe._src.parallel.distributed import free_port

GRACE_S = 5.0
TAIL_LINES = 20
# Lines of output a user never needs: gloo's connection notices (stdout, from
# several threads, so interleaved) and the native stack frames of JAX's
# fatal-error report.
_NOISE = re.compile(
    r"\[Gloo\] |is connected to \d+ peer ranks|^\s*@\s+0x[0-9a-f]+\s"
)


def process_flags(num_processes: int) -> list[list[str]]:
  """`--coordinator localhost:PORT --num-processes N --process-id I` for
  each I, on a port free now; [[]] for a single process."""
  if isinstance(num_processes, bool) or not isinstance(num_processes, int):
    raise TypeError(f"local_processes={num_processes!r} must be an int.")
  if num_processes < 1:
    raise ValueError(f"local_processes={num_processes} must be >= 1.")
  if num_processes == 1:
    return [[]]
  coordinator = f"localhost:{free_port()}"
  return [
      ["--coordinator", coordinator, "--num-processes", str(num_processes)]
      + ["--process-id", str(i)]
      for i in range(num_processes)
  ]


def child_env(devices_per_process: int | None) -> dict[str, str]:
  """This environment, unbuffered; with D, each process on D CPU devices,
  without JAX's persistent compilation cache.

  The processes of a group on CPUs compile one program each under one
  cache key, not always to the same bytes: a two-process group that found
  an entry an earlier group wrote never ran its first all-reduce (jax 0.12,
  gloo; a fresh cache or none ran it at once).
  """
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if devices_per_process is None:
    return env
  if devices_per_process < 1:
    raise ValueError(f"devices_per_process={devices_per_process} must be >= 1.")
  flags = re.sub(
      r"--xla_force_host_platform_device_count=\S*",
      "",
      env.get("XLA_FLAGS", ""),
  ).split()
  flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
  env.update(
      XLA_FLAGS=" ".join(flags),
      JAX_PLATFORMS="cpu",
      JAX_ENABLE_COMPILATION_CACHE="false",
  )
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
  ended_s: float | None = None  # when the group first saw it exit

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


@dataclasses.dataclass(frozen=True)
class GroupResult:
  """How a group of processes ended.

  Attributes:
    code: 0 when every process succeeded; else the first failure's exit
      code (1 for a signal), or 124 on a timeout.
    returncodes: each process's return code (negative: killed by a signal).
    ended_s: seconds from the start until each process was seen to exit on
      its own (None: the group killed it).
    failed: the index of the first process to fail, or None.
    tails: each process's last lines of output (without gloo's notices).
  """

  code: int
  returncodes: tuple[int, ...]
  ended_s: tuple[float | None, ...]
  failed: int | None
  tails: tuple[tuple[str, ...], ...]


def run_group(
    commands: list[list[str]],
    env: dict[str, str],
    *,
    timeout_s: float,
    grace_s: float = GRACE_S,
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
) -> GroupResult:
  """Runs `commands` as one group of processes.

  Process 0's stdout and stderr go to `out` and `err` as they come. The
  first process to fail (or every process, past `timeout_s` seconds) is
  reported on `err` with its last lines; the others get `grace_s` seconds
  to end on their own and are then killed.
  """
  if timeout_s <= 0:
    raise ValueError(f"timeout={timeout_s} must be > 0 seconds.")
  start = time.monotonic()
  children = [
      _start(i, command, env, out, err) for i, command in enumerate(commands)
  ]
  failed = None

  def poll() -> None:
    nonlocal failed
    for c in children:
      if c.ended_s is None and c.popen.poll() is not None:
        c.ended_s = time.monotonic() - start
        if failed is None and c.popen.returncode != 0:
          failed = c

  def running() -> bool:
    return any(c.ended_s is None for c in children)

  try:
    while failed is None and running() and _left(start, timeout_s) > 0:
      time.sleep(0.1)
      poll()
    end = time.monotonic() + min(grace_s, _left(start, timeout_s))
    while failed is not None and running() and time.monotonic() < end:
      time.sleep(0.1)
      poll()
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
        f"launch: process {failed.index} of {n} failed "
        f"({_describe(code)}); its last lines:\n{failed.last_lines()}\n"
    )
    code = code if code > 0 else 1
  elif running():
    lines = "\n".join(f"process {c.index}:\n{c.last_lines()}" for c in children)
    err.write(
        f"launch: timed out after {timeout_s:g}s; stopped all "
        f"{n} processes. Their last lines:\n{lines}\n"
    )
    code = 124
  else:
    code = 0
  return GroupResult(
      code=code,
      returncodes=tuple(c.popen.returncode for c in children),
      ended_s=tuple(c.ended_s for c in children),
      failed=None if failed is None else failed.index,
      tails=tuple(tuple(c.tail) for c in children),
  )


def _left(start: float, timeout_s: float) -> float:
  return timeout_s - (time.monotonic() - start)


def launch(
    command: list[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    timeout_s: float = 3600.0,
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
) -> GroupResult:
  """Runs `command` as `num_processes` local processes of one JAX program.

  Args:
    command: the program and its arguments, e.g. `[sys.executable,
      "train.py"]`; each process gets `--coordinator localhost:PORT
      --num-processes N --process-id I` appended (none for one process).
    num_processes: N >= 1.
    devices_per_process: D simulated CPU devices per process (None: the
      environment's devices).
    timeout_s: stop every process after this many seconds.
    out: where process 0's stdout goes, as it comes.
    err: where process 0's stderr and the group's report go.

  Returns:
    How the group ended (`GroupResult`; `code` is 0 when every process
    succeeded, the first failure's exit code, or 124 on a timeout).

  Raises:
    ValueError: an empty command, N < 1, D < 1 or a timeout <= 0.
    TypeError: N is not an int.
  """
  if not command:
    raise ValueError("command is empty: give the program to run.")
  commands = [list(command) + flags for flags in process_flags(num_processes)]
  env = child_env(devices_per_process)
  return run_group(commands, env, timeout_s=timeout_s, out=out, err=err)
