"""Several processes as one JAX program: joining them, cluster launchers,
a local launcher (`launch`: N processes on one machine, watched as a
group), global arrays from process-local data."""

from linen_moe._src.parallel.distributed import DEFAULT_HEARTBEAT_TIMEOUT_S
from linen_moe._src.parallel.distributed import DEFAULT_INIT_TIMEOUT_S
from linen_moe._src.parallel.distributed import check_port_free
from linen_moe._src.parallel.distributed import cluster_launcher
from linen_moe._src.parallel.distributed import free_port
from linen_moe._src.parallel.distributed import global_array
from linen_moe._src.parallel.distributed import initialize
from linen_moe._src.parallel.distributed import is_main_process
from linen_moe._src.parallel.distributed import parse_coordinator
from linen_moe._src.parallel.launcher import GroupResult
from linen_moe._src.parallel.launcher import launch

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_INIT_TIMEOUT_S",
    "GroupResult",
    "check_port_free",
    "cluster_launcher",
    "free_port",
    "global_array",
    "initialize",
    "is_main_process",
    "launch",
    "parse_coordinator",
]
