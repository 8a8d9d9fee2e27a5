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
Either way process 0 first checks that the coordinator's port is free (under
Slurm and Open MPI the port JAX derives from the job, `launcher_coordinator`),
so a port in use is one clear error, not a wait for the init timeout.
`check_same` then makes every process stop with one clear error when they
were started with different options, before any of them trains.

Failure is bounded. Every process sends heartbeats to the coordination
service; a process that stops (killed, crashed) is declared dead after
`heartbeat_timeout_s`, and JAX then terminates every other process with an
error that says so. A process whose coordinator never answers gives up after
`init_timeout_s`. CPU processes exchange collectives through gloo.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
import errno
import json
import math
import os
import socket
from typing import Any
import zlib

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


def check_port_free(port: int, hint: str = "choose a free port") -> None:
  """Raises `ValueError` if `port` is taken on this host.

  Process 0 binds the coordination service to every interface on the
  coordinator's port, so the check binds the same way, with `SO_REUSEADDR`
  as gRPC does: a port that only the closed connections of an earlier
  group still hold (a requeued job's, in TIME_WAIT) counts as free.

  Args:
    port: a TCP port number.
    hint: what the message tells the user to do.

  Raises:
    ValueError: if binding fails because the port is in use (any other
      `OSError` propagates unchanged).
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("", port))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        raise
      raise ValueError(
          f"coordinator port {port} is already in use on this host, where "
          f"process 0 starts the coordination service; {hint}."
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


def launcher_coordinator(
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S,
) -> tuple[str, int, int] | None:
  """What `jax.distributed.initialize()` finds on its own under Slurm or
  Open MPI: (coordinator "HOST:PORT", process count, this process's id).

  JAX derives the port from the job (Slurm: the job id; Open MPI 4: the
  job id in `OMPI_MCA_orte_hnp_uri`) unless `JAX_COORDINATOR_PORT` sets
  it. The answer is JAX's own cluster detection, read through its private
  module; where that cannot be read (another jax), None, and
  `initialize` leaves the check to JAX.

  Args:
    init_timeout_s: how long a detection that talks to other processes
      (Open MPI 5, through mpi4py) may wait.

  Returns:
    (coordinator, N, id), or None where no Slurm or Open MPI environment
    of JAX's is found.
  """
  if cluster_launcher() not in _LAUNCHER_PROCESS_COUNTS:
    return None
  try:
    from jax._src import clusters  # noqa: PLC0415

    found = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, init_timeout_s
    )
  except (ImportError, AttributeError, TypeError, KeyError, RuntimeError):
    return None
  address, count, index = found[:3]
  if address is None or count is None or index is None:
    return None
  return str(address), int(count), int(index)


def _check_launcher(init_timeout_s: int) -> None:
  """Under Slurm or Open MPI: process 0's coordinator port is free, and
  JAX finds the job (not only its process count, which a batch script
  that calls the command without `srun` also has)."""
  launcher = cluster_launcher()
  if launcher not in _LAUNCHER_PROCESS_COUNTS:
    return
  found = launcher_coordinator(init_timeout_s)
  variable = _LAUNCHER_PROCESS_COUNTS[launcher]
  if found is None:
    if launcher == "slurm" and "SLURM_STEP_ID" not in os.environ:
      raise ValueError(
          f"{variable}={os.environ[variable]} says this is one of several "
          "Slurm tasks, but this process is not a task of a job step (no "
          "SLURM_STEP_ID): start the command with srun (in an sbatch "
          "script too), which starts one process per task."
      )
    return
  address, _, index = found
  if index == 0:
    check_port_free(
        parse_coordinator(address)[1],
        hint=(
            f"JAX chose it from the {launcher} job's environment; set "
            "JAX_COORDINATOR_PORT to a free port for every process"
        ),
    )


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
      an int >= 1, process 0's port already in use (also the port JAX
      derives under Slurm and Open MPI), a Slurm task count outside a job
      step (a batch script that forgot `srun`), or a failure to connect.
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
  if coordinator is None:
    _check_launcher(init_timeout_s)
  elif process_id == 0 and num_processes > 1:
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


def check_same(
    values: Mapping[str, Any], what: str = "options", ignore: tuple = ()
) -> None:
  """Every process holds the same `values`, or every process raises.

  Processes started with different options (say, `srun --multi-prog` with
  another `--seq-len` on one task) would build different programs and wait
  for each other forever in their first collective. Each process
  all-gathers a CRC32 of each value (`process_allgather`, one small
  program), so all of them see the same differences and stop together,
  each naming its own values. Nothing happens in a single process.

  Args:
    values: name -> a JSON-serialisable value (others compared by `repr`).
    what: what the values are, for the message.
    ignore: names that may differ between processes (e.g. what only
      process 0 prints).

  Raises:
    ValueError: on every process, when some process holds another value of
      some name: naming those names, the processes that differ from
      process 0 and this process's values.
  """
  if jax.process_count() == 1:
    return
  names = sorted(k for k in values if k not in ignore)
  digests = [
      zlib.crc32(json.dumps(values[k], sort_keys=True, default=repr).encode())
      for k in names
  ]
  digests.append(zlib.crc32(json.dumps(names).encode()))
  from jax.experimental import multihost_utils  # noqa: PLC0415

  gathered = np.asarray(
      multihost_utils.process_allgather(np.asarray(digests, np.uint32))
  )  # [processes, names + 1]
  other = (gathered != gathered[:1]).any(axis=0)
  if not other.any():
    return
  if other[-1]:
    raise ValueError(
        f"the processes hold different sets of {what} (another version of "
        "linen_moe on some host?); install the same version everywhere."
    )
  differ = [k for k, o in zip(names, other[:-1], strict=True) if o]
  who = [int(p) for p in np.nonzero((gathered != gathered[:1]).any(1))[0]]
  here = ", ".join(f"{k}={values[k]!r}" for k in differ)
  raise ValueError(
      f"the {len(gathered)} processes were started with different {what}: "
      f"{', '.join(differ)} differ between process 0 and process"
      f"{'es' if len(who) > 1 else ''} {', '.join(map(str, who))}; this is "
      f"process {jax.process_index()}, with {here}. Start every process "
      "with the same command."
  )


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
    ValueError: if `data` is an array whose shape is not `shape`, or a
      dimension is not a multiple of the devices it is split over (say, a
      batch of 4 over the 3 processes of `srun -n 3`).
  """
  _check_divides(tuple(shape), sharding)
  if isinstance(data, np.ndarray):
    if data.shape != tuple(shape):
      raise ValueError(
          f"data shape {data.shape} != the global shape {tuple(shape)}."
      )
    array = data
    data = lambda index: array[index]  # noqa: E731
  return jax.make_array_from_callback(tuple(shape), sharding, data)


def _check_divides(shape: tuple[int, ...], sharding: Any) -> None:
  """Each dimension a `NamedSharding` splits is a multiple of the devices it
  is split over; the message names the mesh axes and the processes."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return
  sizes = dict(sharding.mesh.shape)
  for axis, (size, entry) in enumerate(zip(shape, sharding.spec, strict=False)):
    if entry is None:
      continue
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    ways = math.prod(sizes[n] for n in names)
    if size % ways:
      split = ",".join(f"{n}={sizes[n]}" for n in names if sizes[n] > 1)
      raise ValueError(
          f"axis {axis} of the global shape {shape} (size {size}) is split "
          f"over {ways} devices (mesh axes {split}: "
          f"{jax.process_count()} processes x {jax.local_device_count()} "
          "devices), which must divide it. For the batch: a batch size "
          f"that is a multiple of {ways}, or a number of processes (tasks) "
          "and devices that divides the batch size."
      )
