"""Many processes, one mesh: joining `jax.distributed` and feeding it data.

JAX runs past one host as one process per host (multi-controller): every
process runs the same program, `jax.devices()` lists the devices of all of
them, and a mesh over those devices is global. A process can only touch its
own (addressable) devices, so host data enters as a global `jax.Array` built
from the pieces each process holds (`global_array`), and a value is read back
on the host only when it is replicated (metrics) or gathered.

`initialize` joins the processes. With explicit arguments (the command line's
`--coordinator HOST:PORT --num-processes N --process-id I`) it starts the
coordination service on process 0 and connects every process to it. Without
them it joins only when a cluster launcher that JAX detects on its own
started more than one process (`cluster_launcher`: Slurm's `srun`, Open
MPI's `mpirun`, a Cloud TPU pod slice), and otherwise stays a single process.

Failure is bounded. Every process sends heartbeats to the coordination
service; a process that stops (killed, crashed) is declared dead after
`heartbeat_timeout_s`, and JAX then terminates every other process with an
error that says so. A process whose coordinator never answers gives up after
`init_timeout_s`. CPU processes exchange collectives through gloo.
"""

from __future__ import annotations

from collections.abc import Callable
import errno
import os
import socket
from typing import Any

import jax
import numpy as np

from linen_moe._src.parallel.timeouts import DEFAULT_HEARTBEAT_TIMEOUT_S
from linen_moe._src.parallel.timeouts import DEFAULT_INIT_TIMEOUT_S

# Environment variables through which a cluster launcher tells each process
# how many processes it started (JAX's own detection reads the rest).
_LAUNCHER_PROCESS_COUNTS = {
    "slurm": "SLURM_NTASKS",
    "openmpi": "OMPI_COMM_WORLD_SIZE",
}
_TPU_WORKERS = "TPU_WORKER_HOSTNAMES"


def parse_coordinator(address: str) -> tuple[str, int]:
  """ "10.0.0.1:1234" -> ("10.0.0.1", 1234); "[::1]:1234" -> ("::1", 1234).

  Args:
    address: "HOST:PORT"; an IPv6 host may be bracketed.

  Returns:
    (host, port), the host without brackets.

  Raises:
    ValueError: if the host is empty or the port is not an integer in
      1..65535.
  """
  host, sep, port = str(address).rpartition(":")
  host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(
        f"coordinator={address!r} must be HOST:PORT with a port in "
        "1..65535, e.g. 10.0.0.1:1234 (the host of process 0)."
    )
  return host, int(port)


def check_port_free(port: int) -> None:
  """Raises `ValueError` if `port` is taken on this host.

  Process 0 binds the coordination service to every interface on the
  coordinator's port, so the check binds the same way.

  Args:
    port: a TCP port number.

  Raises:
    ValueError: if binding fails because the port is in use (any other
      `OSError` propagates unchanged).
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind(("", port))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        raise
      raise ValueError(
          f"coordinator port {port} is already in use on this host, where "
          "process 0 starts the coordination service; choose a free port."
      ) from None


def free_port() -> int:
  """A TCP port that is free on this host now.

  Returns:
    The port number the OS picked; another program may take it later.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def cluster_launcher(environ: dict[str, str] | None = None) -> str | None:
  """The cluster launcher that started this process as one of several.

  When one is found, `jax.distributed.initialize()` finds the coordinator,
  the process count and this process's id on its own.

  Args:
    environ: the environment to read; default `os.environ`.

  Returns:
    "slurm" (`SLURM_NTASKS` > 1), "openmpi" (`OMPI_COMM_WORLD_SIZE` > 1) or
    "tpu" (several `TPU_WORKER_HOSTNAMES`), else None.
  """
  environ = os.environ if environ is None else environ
  for name, variable in _LAUNCHER_PROCESS_COUNTS.items():
    count = environ.get(variable, "")
    if count.isdigit() and int(count) > 1:
      return name
  if len(environ.get(_TPU_WORKERS, "").split(",")) > 1:
    return "tpu"
  return None


def _check_process_args(
    coordinator: str | None, num_processes: int | None, process_id: int | None
) -> None:
  given = {
      "coordinator": coordinator,
      "num_processes": num_processes,
      "process_id": process_id,
  }
  missing = [name for name, value in given.items() if value is None]
  if missing and len(missing) < len(given):
    raise ValueError(
        f"{', '.join(missing)} missing: coordinator, num_processes and "
        f"process_id go together (got {given})."
    )
  if missing:
    return
  parse_coordinator(coordinator)
  for name in ("num_processes", "process_id"):
    value = given[name]
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"{name}={value!r} must be an int.")
  if num_processes < 1:
    raise ValueError(f"num_processes={num_processes} must be >= 1.")
  if not 0 <= process_id < num_processes:
    raise ValueError(
        f"process_id={process_id} must be in [0, num_processes="
        f"{num_processes})."
    )


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> bool:
  """Joins this process to the others (before any JAX computation).

  Args:
    coordinator: "HOST:PORT" of process 0, where it serves the coordination
      service; the same on every process.
    num_processes: N, the number of processes.
    process_id: this process's index in [0, N).
    init_timeout_s: how long a process waits for all N to connect.
    heartbeat_timeout_s: how long a silent process counts as alive.

  Returns:
    Whether this is one of several processes. With none of the three
    arguments and no `cluster_launcher`, nothing happens (False).

  Raises:
    ValueError: some but not all of the three arguments, a malformed
      coordinator address, N < 1, an id outside [0, N), a timeout that is not
      an int >= 1, process 0's port already in use, or a failure to connect.
    TypeError: if `num_processes` or `process_id` is not an int.
  """
  _check_process_args(coordinator, num_processes, process_id)
  for name, value in (
      ("init_timeout_s", init_timeout_s),
      ("heartbeat_timeout_s", heartbeat_timeout_s),
  ):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be an int >= 1 (seconds).")
  if coordinator is None and cluster_launcher() is None:
    return False
  if process_id == 0 and num_processes > 1:
    check_port_free(parse_coordinator(coordinator)[1])
  # Collectives between CPU processes; ignored by GPU and TPU backends.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        initialization_timeout=init_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        # A process that exits early waits this long at the shutdown
        # barrier for the others.
        shutdown_timeout_seconds=heartbeat_timeout_s,
    )
  except jax.errors.JaxRuntimeError as e:
    where = coordinator or f"the {cluster_launcher()} launcher's coordinator"
    raise ValueError(
        f"could not join the processes through {where} within "
        f"{init_timeout_s}s: {str(e).splitlines()[0]}"
    ) from e
  return jax.process_count() > 1


def is_main_process() -> bool:
  """Process 0: the one that prints and reports.

  Returns:
    Whether `jax.process_index()` is 0 (True in a single process).
  """
  return jax.process_index() == 0


def global_array(
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    data: np.ndarray | Callable[[Any], np.ndarray],
) -> jax.Array:
  """A global `jax.Array` of `shape` from host data, shard by shard.

  Every process calls this with the same `shape` and `sharding`; each
  places only the shards of its own devices. `data` is either the global
  NumPy array (every process holds the same one, e.g. a batch generated
  from a shared seed) or a function from a shard's index (a tuple of
  slices into the global array) to that shard's data, for a loader that
  reads only what its process needs.

  Args:
    shape: the global shape.
    sharding: how the global array is laid out over the mesh.
    data: the global NumPy array of `shape`, or index -> shard data.

  Returns:
    A `jax.Array` of `shape` with `sharding`.

  Raises:
    ValueError: if `data` is an array whose shape is not `shape`.
  """
  if isinstance(data, np.ndarray):
    if data.shape != tuple(shape):
      raise ValueError(
          f"data shape {data.shape} != the global shape {tuple(shape)}."
      )
    array = data
    data = lambda index: array[index]  # noqa: E731
  return jax.make_array_from_callback(tuple(shape), sharding, data)
