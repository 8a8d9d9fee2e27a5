"""What `grouped_matmul="auto"` runs on a GPU: the route measured fastest
for the nearest shape on this device, from a table, as the TPU tile table
(`tpu/gmm_tiling`) does on a TPU; never a route that pads to dense.

The table, `gpu_routes.json` beside this module (package data):

  {"format": 1, "about": "...", "entries": [
    {"device_kind": "NVIDIA H200", "dtype": "bfloat16",
     "m": 65536, "k": 2048, "n": 768, "groups": 128,
     "stack": {"jax": "0.11.2", "cuda": "13.0", "cudnn": "9.22.0"},
     "routes": {
       "tokamax_mosaic": {"seconds": 0.0041, "dense": false,
                          "custom_calls": ["mosaic_gpu"]},
       "xla_ragged_dot": {"seconds": 0.0120, "dense": true,
                          "custom_calls": []},
       "blocked": {"seconds": 0.0065, "dense": false}}}]}

`seconds` is forward + backward of lhs [M, K] x [G, K, N] at the entry's
dtype; `dense` whether the route's compiled program held a dot over all
groups (the padding XLA:GPU does to a ragged_dot it does not send to a
grouped kernel); `custom_calls` the custom-call targets it compiled to.
A route is a GPU entry of the registry (`gpu.routes`) or "blocked".

The choice (`choose`): the entry of this device kind, dtype, K, N and G
with the M nearest in ratio; of its routes not `dense`, available here and
taking the operands, the fastest. Where the table has no such entry, the
choice is conservative: "blocked" (pure JAX, grouped: a batched matmul of
each group's first rows and row tiles for the rest; never dense, runs on
every GPU).

What was and was not measured (nothing on a GPU yet; the table ships
empty): compiled on a CPU host for an H200 with jax[cuda13] 0.11.2,
XLA's `ragged_dot` became one dense dot over all groups (8x the FLOPs at 8
experts, 128x at 128); upstream XLA sends it to cuDNN's grouped matmul
when the runtime's cuDNN is >= 9.22 (its weight gradient needs >= 9.24),
which a compile without a GPU cannot see. So "xla_ragged_dot" is chosen
only from a measured entry that found it not dense on that device and
stack; Tokamax's kernels and jax's Pallas-Triton lowering only from a
measured entry too (they were never run here).
"""

from __future__ import annotations

from collections.abc import Collection
import functools
import importlib.resources
import json
import math
from typing import Any

import jax
import jax.numpy as jnp

TABLE_FILE = "gpu_routes.json"
FORMAT = 1
CONSERVATIVE = "blocked"
_ENTRY_INTS = ("m", "k", "n", "groups")


def current_device_kind() -> str | None:
  """The GPU being traced for: the current mesh's abstract device (a
  plan's target), else this process's first device; None if not a GPU."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  if device is None:
    device = jax.devices()[0]
  if getattr(device, "platform", None) not in ("gpu", "cuda", "rocm"):
    return None
  return getattr(device, "device_kind", None)


def check_table(table: Any, routes: Collection[str]) -> tuple[dict, ...]:
  """The entries of a parsed table, checked; `routes` are the route names
  allowed (besides "blocked").

  Raises:
    ValueError: naming the entry and the key that does not fit.
  """
  if not isinstance(table, dict) or table.get("format") != FORMAT:
    raise ValueError(
        f"{TABLE_FILE}: format must be {FORMAT}; got "
        f"{table.get('format') if isinstance(table, dict) else table!r}."
    )
  entries = table.get("entries")
  if not isinstance(entries, list):
    raise ValueError(f"{TABLE_FILE}: entries must be a list; got {entries!r}.")
  allowed = {*routes, CONSERVATIVE}
  for i, e in enumerate(entries):
    where = f"{TABLE_FILE} entry {i}"
    for key in ("device_kind", "dtype"):
      if not isinstance(e.get(key), str):
        raise ValueError(
            f"{where}: {key} must be a string; got {e.get(key)!r}."
        )
    for key in _ENTRY_INTS:
      value = e.get(key)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{where}: {key} must be a positive int; got {value!r}."
        )
    if not isinstance(e.get("routes"), dict) or not e["routes"]:
      raise ValueError(f"{where}: routes must be a non-empty object.")
    for name, r in e["routes"].items():
      if name not in allowed:
        raise ValueError(
            f"{where}: route {name!r} unknown; allowed: {sorted(allowed)}."
        )
      seconds = r.get("seconds") if isinstance(r, dict) else None
      if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"{where}: {name}.seconds must be a number.")
      if not seconds > 0 or not isinstance(r.get("dense"), bool):
        raise ValueError(
            f"{where}: {name} needs seconds > 0 and dense true/false; got "
            f"{r!r}."
        )
  return tuple(entries)


@functools.cache
def load_table() -> tuple[dict[str, Any], ...]:
  """The checked entries of `gpu_routes.json` (package data)."""
  from linen_moe._src.kernels.gpu.routes import ENTRIES

  text = (
      importlib.resources.files("linen_moe._src.kernels.gpu")
      .joinpath(TABLE_FILE)
      .read_text(encoding="utf-8")
  )
  return check_table(json.loads(text), [e.name for e in ENTRIES])


def lookup(
    entries: tuple[dict[str, Any], ...],
    shape: tuple[int, int, int, int],
    dtype,
    device_kind: str | None,
) -> dict[str, Any] | None:
  """The entry of `device_kind`, `dtype`, K, N and G with the M nearest in
  ratio to shape = (M, K, N, G), or None."""
  m, k, n, g = shape
  name = jnp.dtype(dtype).name
  same = [
      e
      for e in entries
      if (e["device_kind"], e["dtype"], e["k"], e["n"], e["groups"])
      == (device_kind, name, k, n, g)
  ]
  if not same:
    return None
  return min(same, key=lambda e: abs(math.log(e["m"] / max(m, 1))))


def choose(
    shape: tuple[int, int, int, int] | None,
    dtype,
    usable: Collection[str],
    device_kind: str | None = None,
    entries: tuple[dict[str, Any], ...] | None = None,
) -> str:
  """The route "auto" runs: a name of `usable` (GPU routes that load here
  and take the operands) or "blocked".

  Args:
    shape: (M, K, N, G) of lhs [M, K] x rhs [G, K, N]; None when unknown.
    dtype: the operands' dtype; None when unknown.
    usable: the routes that may run.
    device_kind: the GPU ("NVIDIA H200"); default `current_device_kind()`.
    entries: the table; default `load_table()`.

  Returns:
    The fastest measured route that is not dense, else "blocked".
  """
  if shape is None or dtype is None:
    return CONSERVATIVE
  if entries is None:
    entries = load_table()
  if device_kind is None:
    device_kind = current_device_kind()
  entry = lookup(entries, shape, dtype, device_kind)
  if entry is None:
    return CONSERVATIVE
  ok = {
      name: r["seconds"]
      for name, r in entry["routes"].items()
      if not r["dense"] and (name in usable or name == CONSERVATIVE)
  }
  return min(ok, key=ok.get) if ok else CONSERVATIVE
