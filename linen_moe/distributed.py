"""Several processes as one JAX program: joining them, cluster launchers,
a local launcher (`launch`: N processes on one machine, watched as a
group), global arrays from process-local data."""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.parallel.distributed": (
        "global_array",
        "initialize",
        "is_main_process",
    ),
    "linen_moe._src.parallel.launcher": ("launch",),
    "linen_moe._src.parallel.timeouts": (
        "DEFAULT_HEARTBEAT_TIMEOUT_S",
        "DEFAULT_INIT_TIMEOUT_S",
    ),
}

_lazy_face(globals(), _EXPORTS)
