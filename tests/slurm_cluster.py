"""A one-host Slurm cluster for the tests: `SlurmCluster.start()`.

munge (its own key and socket), slurmctld and slurmd (the host's cores and
two stand-in GPUs, `/dev/null` and `/dev/zero`, so that a recipe's
`--gpus-per-node` means what it means on a GPU cluster), every file under
one temporary directory, on free ports, started as this (root) process's
children in the foreground and stopped by their process ids (job ids from
a random first one: JAX's Slurm coordinator port is 61440 + the job id mod
4096, and two clusters on one host must not share it); `stop()`
cancels the jobs, stops the daemons and removes the directory, also after a
failed start. Debian's packages (`slurm-wlm`, `munge`) provide the programs;
`missing()` says why a cluster cannot start here (not root, a program
missing), for the tests' skip reason.

Commands reach the cluster through `env()` (`SLURM_CONF`, and the directory
of this Python's scripts first on `PATH`, so that `linen-moe` in a recipe is
the package under test).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol")
# Seconds Slurm waits between a job's SIGTERM and its SIGKILL (KillWait):
# enough for a stopped run to save its last step on a loaded 2-core machine.
KILL_WAIT_S = 30


def missing() -> str | None:
  """Why no cluster can start here (None: it can)."""
  if os.geteuid() != 0:
    return "Slurm's daemons run as root here; this process is not root"
  gone = [p for p in PROGRAMS if shutil.which(p) is None]
  if gone:
    return (
        f"{', '.join(gone)} not found: apt-get install slurm-wlm munge "
        "(.ci/run does)"
    )
  return None


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def _cpus() -> int:
  """The cores slurmd finds here (`slurmd -C`), which the node must not
  claim more of (a container may show the host's count elsewhere)."""
  got = subprocess.run(
      ["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=False
  )
  found = re.search(r"\bCPUs=(\d+)", got.stdout)
  return int(found.group(1)) if found else os.cpu_count() or 1


def _config(root: str, node: str, cpus: int) -> str:
  ports = _free_port(), _free_port()
  return f"""\
ClusterName=linenmoe
FirstJobId={random.randrange(1, 1 << 20)}
SlurmctldHost={node}
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# A requeued job is eligible after cred_expire + 1 s; start it then.
SchedulerParameters=sched_interval=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
KillWait={KILL_WAIT_S}
InactiveLimit=0
MinJobAge=600
GresTypes=gpu
NodeName={node} CPUs={cpus} Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
  """A running one-host cluster; `stop()` ends it."""

  def __init__(self, root: str):
    self.root = root
    self.conf = os.path.join(root, "slurm.conf")
    self.node = socket.gethostname().split(".")[0]
    self.daemons: list[subprocess.Popen] = []

  @classmethod
  def start(cls, timeout_s: float = 60) -> SlurmCluster:
    """Starts munge, slurmctld and slurmd under a new temporary directory
    and waits until the node is idle; on any failure stops what started
    and raises RuntimeError with the daemons' last log lines."""
    cluster = cls(tempfile.mkdtemp(prefix="linen_moe_slurm-"))
    try:
      cluster._start(timeout_s)
    except BaseException as e:
      logs = cluster.logs()
      cluster.stop()
      raise RuntimeError(f"the Slurm cluster did not start: {e}\n{logs}") from e
    return cluster

  def _start(self, timeout_s: float) -> None:
    root = self.root
    for sub in ("state", "spool"):
      os.mkdir(os.path.join(root, sub))
    key = os.path.join(root, "munge.key")
    with open(key, "wb") as f:
      f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    with open(os.path.join(root, "plugstack.conf"), "w") as f:
      f.write("")
    with open(os.path.join(root, "gres.conf"), "w") as f:
      f.write("Name=gpu File=/dev/null\nName=gpu File=/dev/zero\n")
    with open(self.conf, "w") as f:
      f.write(_config(root, self.node, _cpus()))
    munge = [
        "munged",
        "--foreground",
        "--force",
        f"--key-file={key}",
        f"--socket={root}/munge.socket",
        f"--pid-file={root}/munged.pid",
        f"--log-file={root}/munged.log",
        f"--seed-file={root}/munged.seed",
    ]
    self._daemon(munge)
    self._wait(lambda: os.path.exists(f"{root}/munge.socket"), 20, "munged")
    self._daemon(["slurmctld", "-D", "-f", self.conf])
    self._daemon(["slurmd", "-D", "-f", self.conf])
    self._wait(self._idle, timeout_s, "the node to be idle")

  def _daemon(self, command: list[str]) -> None:
    log = open(os.path.join(self.root, f"{command[0]}.out"), "wb")  # noqa: SIM115
    with log:
      self.daemons.append(
          subprocess.Popen(
              command,
              stdout=log,
              stderr=subprocess.STDOUT,
              stdin=subprocess.DEVNULL,
              env=self.env(),
          )
      )

  def _wait(self, ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
      for d in self.daemons:
        if d.poll() is not None:
          raise RuntimeError(f"{d.args[0]} exited ({d.returncode})")
      if time.monotonic() > deadline:
        raise RuntimeError(f"waited {timeout_s:g}s for {what}")
      time.sleep(0.2)

  def _idle(self) -> bool:
    got = self.run(["sinfo", "-h", "-o", "%T"], check=False, timeout=10)
    return got.returncode == 0 and got.stdout.strip() == "idle"

  def env(self, **extra: str) -> dict[str, str]:
    """This process's environment pointed at the cluster, with `extra`."""
    scripts = os.path.dirname(sys.executable)
    path = os.pathsep.join([scripts, os.environ.get("PATH", "")])
    return dict(os.environ, SLURM_CONF=self.conf, PATH=path, **extra)

  def run(
      self, command: list[str], *, check: bool = True, timeout: float = 60
  ) -> subprocess.CompletedProcess:
    """A Slurm client command (`squeue`, `scontrol`, ...), its output
    captured as text; `check`: a non-zero exit raises."""
    got = subprocess.run(
        command,
        env=self.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and got.returncode:
      raise RuntimeError(f"{' '.join(command)}: {got.stderr.strip()}")
    return got

  def job_state(self, job: str) -> str:
    """The job's state (`PENDING`, `RUNNING`, `COMPLETED`, `TIMEOUT`, ...)."""
    got = self.run(["scontrol", "show", "job", job])
    for field in got.stdout.split():
      if field.startswith("JobState="):
        return field.split("=", 1)[1]
    raise RuntimeError(f"no JobState for job {job}: {got.stdout}")

  def job_field(self, job: str, name: str) -> str:
    got = self.run(["scontrol", "show", "job", job])
    for field in got.stdout.split():
      if field.startswith(f"{name}="):
        return field.split("=", 1)[1]
    raise RuntimeError(f"no {name} for job {job}: {got.stdout}")

  def task_pids(self, job: str) -> dict[int, int]:
    """{global task id: pid} of the job's running tasks (`scontrol
    listpids`: the task's own process, not its children)."""
    got = self.run(["scontrol", "listpids", job])
    pids = {}
    for line in got.stdout.splitlines()[1:]:
      pid, _, _, _, task = line.split()
      if task != "-":
        pids[int(task)] = int(pid)
    return pids

  def logs(self, lines: int = 20) -> str:
    """The last lines of every daemon's log."""
    out = []
    for name in sorted(os.listdir(self.root)):
      if name.endswith((".log", ".out")):
        with open(os.path.join(self.root, name), errors="replace") as f:
          tail = f.read().splitlines()[-lines:]
        out.append(f"== {name}\n" + "\n".join(tail))
    return "\n".join(out)

  def stop(self) -> None:
    """Cancels every job (their tasks stopped by slurmd), stops the
    daemons (SIGTERM, then SIGKILL after 10 s) and removes the
    directory."""
    try:
      if len(self.daemons) == 3 and all(d.poll() is None for d in self.daemons):
        self.run(["scancel", "--user", "root"], check=False, timeout=30)
        deadline = time.monotonic() + 2 * KILL_WAIT_S
        while time.monotonic() < deadline:
          got = self.run(["squeue", "-h"], check=False, timeout=10)
          if got.returncode or not got.stdout.strip():
            break
          time.sleep(0.5)
    finally:
      for d in reversed(self.daemons):
        if d.poll() is None:
          d.terminate()
      for d in reversed(self.daemons):
        try:
          d.wait(timeout=10)
        except subprocess.TimeoutExpired:
          d.kill()
          d.wait()
      shutil.rmtree(self.root, ignore_errors=True)
