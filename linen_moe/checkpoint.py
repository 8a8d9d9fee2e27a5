"""Checkpoints of a training run through orbax: save, resume anywhere, export.

Its names load on first use, so that orbax loads only when asked for."""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.checkpoint.export": (
        "export",
        "load_export",
        "read_variables",
    ),
    "linen_moe._src.checkpoint.manager": (
        "Checkpoints",
        "DamagedCheckpointError",
    ),
    "linen_moe._src.checkpoint.meta": ("config_dict",),
    "linen_moe._src.checkpoint.tree": ("abstract",),
    "linen_moe._src.run.directory": ("check_new_directory",),
}

_lazy_face(globals(), _EXPORTS)
