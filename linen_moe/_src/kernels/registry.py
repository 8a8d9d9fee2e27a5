"""The registry of grouped-matmul kernels: every backend's, by name, with
their capabilities; the one seam between the grouped matmul (and the
sparse path's gathers) and the kernels of an accelerator.

Each backend's kernels live in a folder of their own (`tpu/`, `gpu/`) and
register there (`tpu.routes.ENTRIES`, `gpu.routes.ENTRIES`); what a backend
runs is a lookup here, not a branch on its name:

  `kernel_entry(backend)`  what `grouped_matmul="kernel"` runs there
                           (`KERNEL`; on a CPU, the kernel
                           `kernels_on_cpu(kind)` names, interpreted).
  `auto(backend, ...)`     what `"auto"` runs there: (implementation,
                           entry or None), from the backend's own choice
                           (`AUTO`: "blocked" on a CPU; the tile table on
                           a TPU; the route table on a GPU).

`find_decode(key, backend)` loads a kernel's decode expert matmul (the
few-token projection that reads each routed expert once, `Entry.decode`)
by key: an opt-in, no backend runs one by default (unmeasured).

`entries()` lists every registered kernel (the conformance test runs each
one); `get("gpu/tokamax_mosaic")` finds one by key.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
from typing import Any

import jax.numpy as jnp

from linen_moe._src.kernels.gpu import auto_table
from linen_moe._src.kernels.gpu import routes as gpu_routes
from linen_moe._src.kernels.kernel import Entry
from linen_moe._src.kernels.tpu import routes as tpu_routes

ENTRIES: tuple[Entry, ...] = (*tpu_routes.ENTRIES, *gpu_routes.ENTRIES)
_BY_KEY = {e.key: e for e in ENTRIES}

# What `grouped_matmul="kernel"` runs on each backend.
KERNEL = {"tpu": "tpu/pallas", "gpu": "gpu/tokamax"}
# What `kernels_on_cpu(kind)` runs on a CPU, interpreted or as XLA ops.
ON_CPU = {
    "pallas": "tpu/pallas",
    "megablox": "tpu/megablox",
    "tokamax": "gpu/tokamax_xla",
    "tokamax_pallas": "tpu/tokamax_mosaic_tpu",
}
ON_CPU_KINDS = tuple(ON_CPU)
_ON_CPU: list[str | None] = [None]


def entries(backend: str | None = None) -> tuple[Entry, ...]:
  """Every registered kernel, or `backend`'s ("tpu", "gpu")."""
  return tuple(e for e in ENTRIES if backend in (None, e.backend))


def get(key: str) -> Entry:
  """The kernel registered as `key` ("tpu/pallas", "gpu/tokamax_mosaic").

  Raises:
    ValueError: no kernel is registered as `key` (the message lists them).
  """
  if key not in _BY_KEY:
    raise ValueError(
        f"No grouped-matmul kernel is registered as {key!r}; registered: "
        f"{sorted(_BY_KEY)}."
    )
  return _BY_KEY[key]


def on_cpu_kind() -> str | None:
  """The `kernels_on_cpu` kind in force, or None."""
  return _ON_CPU[0]


def kernel_entry(backend: str) -> tuple[Entry | None, str | None]:
  """(the entry `"kernel"` runs on `backend`, None), or (None, why there
  is none)."""
  key = KERNEL.get(backend)
  if key is None and backend == "cpu" and _ON_CPU[0] is not None:
    key = ON_CPU[_ON_CPU[0]]
  if key is None:
    return None, f"no grouped-matmul kernel is known for backend {backend!r}"
  return _BY_KEY[key], None


def load(entry: Entry, backend: str):
  """(the `Kernel` of `entry` for a program traced for `backend`, None),
  or (None, why it does not load). Interpreted where `backend` is not the
  entry's own."""
  try:
    return entry.load(interpret=backend != entry.backend), None
  except ImportError as e:
    return None, str(e)


def find_kernel(backend: str):
  """(the loaded kernel `"kernel"` runs on `backend`, None), or (None, why
  there is none)."""
  entry, missing = kernel_entry(backend)
  if entry is None:
    return None, missing
  return load(entry, backend)


def find_decode(key: str, backend: str):
  """(the decode expert matmul of the kernel registered as `key`, for a
  program traced for `backend`, None), or (None, why it does not load).
  Interpreted where `backend` is not the entry's own.

  Raises:
    ValueError: no kernel is registered as `key`, or it has no decode
      matmul (the message lists those that do).
  """
  entry = get(key)
  if not entry.decode:
    with_decode = sorted(e.key for e in ENTRIES if e.decode)
    raise ValueError(
        f"{key!r} has no decode expert matmul; kernels with one: {with_decode}."
    )
  kernel, missing = load(entry, backend)
  return (None, missing) if kernel is None else (kernel.decode, None)


def _auto_cpu(shape, dtypes) -> tuple[str, Entry | None]:
  del shape, dtypes
  return "blocked", None


def _auto_tpu(shape, dtypes) -> tuple[str, Entry | None]:
  choice = tpu_routes.choose(shape, dtypes)
  return ("ragged_dot", None) if choice == "ragged_dot" else _kernel(choice)


def _auto_gpu(shape, dtypes) -> tuple[str, Entry | None]:
  usable = []
  for e in entries("gpu"):
    if e.auto_table and dtypes and e.takes(dtypes):
      if load(e, "gpu")[0] is not None:
        usable.append(e.name)
  dtype = jnp.result_type(*dtypes) if dtypes else None
  choice = auto_table.choose(shape, dtype, usable)
  return ("blocked", None) if choice == "blocked" else _kernel(choice, "gpu")


def _kernel(name: str, backend: str = "tpu") -> tuple[str, Entry]:
  return "kernel", _BY_KEY[f"{backend}/{name}"]


# What "auto" runs on each backend: (shape, dtypes) -> (implementation,
# entry or None).
AUTO: dict[str, Callable[..., tuple[str, Entry | None]]] = {
    "cpu": _auto_cpu,
    "tpu": _auto_tpu,
    "gpu": _auto_gpu,
}


def auto(
    backend: str,
    shape: tuple[int, int, int, int] | None,
    dtypes: tuple[Any, ...],
) -> tuple[str, Entry | None]:
  """What `grouped_matmul="auto"` runs on `backend` for lhs [M, K] x
  [G, K, N] (`shape` = (M, K, N, G), or None) of `dtypes`: ("kernel", the
  entry), or ("ragged_dot" / "blocked", None). A backend with no choice of
  its own runs "blocked"."""
  return AUTO.get(backend, _auto_cpu)(shape, dtypes)


@contextlib.contextmanager
def kernels_on_cpu(kind: str):
  """Inside, `grouped_matmul="kernel"` on the CPU backend runs `kind`'s
  kernel (`ON_CPU`); "auto" still resolves to "blocked" there.

  Resolution happens while a function is traced: trace (call a jitted
  function for the first time, or lower it) inside the context.

  Raises:
    ValueError: `kind` is not one of `ON_CPU_KINDS`.
  """
  if kind not in ON_CPU_KINDS:
    raise ValueError(f"kind must be one of {ON_CPU_KINDS}; got {kind!r}.")
  saved = _ON_CPU[0]
  _ON_CPU[0] = kind
  try:
    yield
  finally:
    _ON_CPU[0] = saved
