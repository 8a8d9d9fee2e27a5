"""A run's directory: checked before any work, written by one run at a time.

`writable_directory` and `check_new_directory` turn a directory that cannot
be made or written (below a regular file, on a read-only file system, ...) into a
one-line `ValueError` naming the option, before anything is computed.

`RunLock` is the one-writer rule of a run's `checkpoint_dir` DIR:
the run creates `DIR/run.lock` atomically (`O_CREAT | O_EXCL`), naming its
host, process id and start time, before it writes anything, and removes it
when it ends. A second run on DIR finds the file and stops at once, naming
the holder; a lock whose holder is gone (same host, process not running)
is taken over, with a message. Readers (`linen-moe export`) take no lock.
In a group of processes only process 0 takes it (`loop.run`).

Imports no jax.
"""

from __future__ import annotations

from collections.abc import Callable
import datetime
import errno
import json
import os
import socket
import sys
import uuid

LOCK_FILE = "run.lock"


def _reason(error: OSError) -> str:
  return error.strerror or type(error).__name__


def _not_a_directory(path: str) -> str | None:
  """The first existing ancestor-or-self of `path` that is not a directory."""
  probe = path
  while probe and not os.path.exists(probe):
    parent = os.path.dirname(probe)
    if parent == probe:
      return None
    probe = parent
  return None if os.path.isdir(probe) else probe


def writable_directory(path: str | os.PathLike, name: str) -> str:
  """Makes directory `path` (and its parents) if needed and checks that a
  file can be created in it; returns its absolute path.

  Raises:
    ValueError: naming `name` (how the error calls the path) and the
      reason, when `path` cannot be created or written.
  """
  path = os.path.abspath(os.fspath(path))
  blocker = _not_a_directory(path)
  if blocker is not None:
    kind = "it is" if blocker == path else f"{blocker} is"
    raise ValueError(
        f"{name} {path} cannot be a directory: {kind} a file, not a directory."
    )
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"{name} {path} cannot be created: {_reason(e)}.") from e
  probe = os.path.join(path, f".write-test-{os.getpid()}-{uuid.uuid4().hex}")
  try:
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"{name} {path} is not writable: {_reason(e)}.") from e
  return path


def check_new_directory(path: str | os.PathLike, name: str) -> str:
  """Checks, before any work, that directory `path` does not exist and can
  be created (its nearest existing ancestor is a writable directory).
  Creates nothing.

  Args:
    path: the directory an export or a run will create.
    name: how the error calls it (e.g. "`out`").

  Returns:
    `path`, absolute.

  Raises:
    ValueError: naming `name`, when `path` exists or cannot be created.
  """
  path = os.path.abspath(os.fspath(path))
  if os.path.lexists(path):
    raise ValueError(f"{name} {path} exists; it must be a new directory.")
  blocker = _not_a_directory(path)
  if blocker is not None:
    raise ValueError(
        f"{name} {path} cannot be created: {blocker} is a file, not a "
        "directory."
    )
  ancestor = os.path.dirname(path)
  while not os.path.exists(ancestor):
    ancestor = os.path.dirname(ancestor)
  if not os.access(ancestor, os.W_OK | os.X_OK):
    reason = os.strerror(errno.EROFS if _read_only(ancestor) else errno.EACCES)
    raise ValueError(
        f"{name} {path} cannot be created: {ancestor} is not writable "
        f"({reason})."
    )
  return path


def _read_only(path: str) -> bool:
  try:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
  except OSError:
    return False


def _process_start(pid: int) -> str | None:
  """When process `pid` started (clock ticks since boot, from /proc), or
  None where /proc does not say: tells a live holder from a new process
  that reuses its id."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      stat = f.read()
  except OSError:
    return None
  fields = stat[stat.rindex(")") + 2 :].split()
  return fields[19]  # field 22 of proc(5), counted after the name


def _running(pid: int, start: str | None) -> bool:
  """Whether process `pid` (started at `start`, if known) still runs on
  this host; a zombie (killed, not yet reaped) does not."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # another user's process: alive
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      stat = f.read()
  except OSError:
    return True
  state = stat[stat.rindex(")") + 2 :].split()[0]
  if state in ("Z", "X"):
    return False
  return start is None or _process_start(pid) in (None, start)


class RunLock:
  """The exclusive lock of one run on its directory (`DIR/run.lock`).

  Example usage:
    lock = RunLock.acquire(directory, log=print)
    try:
      ...  # the only run writing in `directory`
    finally:
      lock.release()

  Attributes:
    path: the lock file.
    holder: what the file says: host, pid, start time, command.
  """

  def __init__(self, path: str, holder: dict):
    self.path, self.holder = path, holder

  @classmethod
  def acquire(
      cls,
      directory: str | os.PathLike,
      *,
      name: str = "`checkpoint_dir`",
      log: Callable[[str], None] = print,
  ) -> RunLock:
    """Makes `directory` if needed and locks it for this process.

    Raises:
      ValueError: one line: the directory cannot be created or written
        (naming `name`), or another run holds the lock (naming its host,
        process id and start time).
    """
    directory = writable_directory(directory, name)
    path = os.path.join(directory, LOCK_FILE)
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "started": (
            datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        ),
        "command": " ".join(sys.argv),
        "token": uuid.uuid4().hex,
    }
    for _ in range(3):  # a stale lock taken over, then ours created
      try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        cls._take_over_if_stale(directory, path, log)
        continue
      except OSError as e:
        raise ValueError(
            f"{name} {directory} is not writable: {_reason(e)}."
        ) from e
      try:
        os.write(fd, (json.dumps(holder) + "\n").encode())
        os.fsync(fd)
      finally:
        os.close(fd)
      return cls(path, holder)
    raise ValueError(
        f"{directory} is being locked by other runs at the same time; "
        "start one run per directory."
    )

  @staticmethod
  def _take_over_if_stale(directory: str, path: str, log) -> None:
    """Removes the lock at `path` if its holder is gone; else raises."""
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except FileNotFoundError:
      return  # released meanwhile: try again
    try:
      other = json.loads(text)
      who = (
          f"process {int(other['pid'])} on {other['host']}, started "
          f"{other['started']}"
      )
    except (ValueError, KeyError, TypeError):
      raise ValueError(
          f"{directory} holds a lock file that cannot be read ({path}): a "
          "run is taking it right now, or one died while taking it; delete "
          "it if no run uses the directory."
      ) from None
    here = socket.gethostname()
    if other["host"] == here and not _running(
        int(other["pid"]), other.get("process_start")
    ):
      stale = f"{path}.stale-{os.getpid()}"
      try:
        os.rename(path, stale)
      except FileNotFoundError:
        return  # another run took it over first
      with open(stale, encoding="utf-8") as f:
        moved = f.read()
      if moved != text:  # not the stale lock we judged: put it back
        try:
          os.link(stale, path)
        except FileExistsError:
          pass
        os.remove(stale)
        raise ValueError(
            f"{directory} is locked by another run that started just now; "
            "start one run per directory."
        )
      os.remove(stale)
      log(f"took over the lock of {directory} from {who}, which has ended.")
      return
    where = (
        ""
        if other["host"] == here
        else f" (another host: if that run has ended, delete {path})"
    )
    raise ValueError(
        f"{directory} is in use by another run: {who}{where}. Wait for it to "
        "end, or give this run another `checkpoint_dir`."
    )

  def release(self) -> None:
    """Removes the lock file if it is still this run's."""
    try:
      with open(self.path, encoding="utf-8") as f:
        if json.loads(f.read()).get("token") != self.holder["token"]:
          return
      os.remove(self.path)
    except (OSError, ValueError):
      pass
