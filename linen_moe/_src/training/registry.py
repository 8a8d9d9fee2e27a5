"""The training front ends by name, the one registry: `frontend(name)`.

The Linen decoder's front end is the library's own ("linen"); a second
front end registers itself (`register_frontend`): `nnx_adapter`, when it
is imported, registers "nnx". Imports no jax: the names and their
descriptions (`FRONTENDS`) serve a command line's `--help`.
"""

from __future__ import annotations

from collections.abc import Callable
import types
from typing import Any

_LOADERS: dict[str, Callable[[], Any]] = {}
_DESCRIPTIONS: dict[str, str] = {}
# name -> a line on it, for each registered front end (a live view).
FRONTENDS = types.MappingProxyType(_DESCRIPTIONS)


def register_frontend(
    name: str, load: Callable[[], Any], description: str
) -> None:
  """Makes a `TrainingFrontend` known by `name` (again: replaced).

  Args:
    name: what `frontend` and `linen-moe train --frontend` call it.
    load: () -> the front end (called on each `frontend(name)`; it may
      import its package then).
    description: one line on it, e.g. "the NNX decoder (nnx_adapter.Decoder)".

  Raises:
    TypeError: `name` or `description` is not a non-empty string, or
      `load` is not callable.
  """
  for arg, value in (("name", name), ("description", description)):
    if not isinstance(value, str) or not value:
      raise TypeError(f"{arg}={value!r} is invalid: expected a non-empty str.")
  if not callable(load):
    raise TypeError(f"load={load!r} is invalid: expected a callable.")
  _LOADERS[name] = load
  _DESCRIPTIONS[name] = description


def frontend(name: str) -> Any:
  """The `linen_moe.training.TrainingFrontend` called `name`.

  Args:
    name: a registered name (`FRONTENDS`): "linen", and "nnx" once
      `nnx_adapter` is imported.

  Returns:
    The front end (`LinenFrontend`, `nnx_adapter.NNXFrontend`, ...).

  Raises:
    ValueError: `name` is not registered.
  """
  if name not in _LOADERS:
    hint = "" if "nnx" in _LOADERS else " (import nnx_adapter for 'nnx')"
    raise ValueError(
        f"Unknown front end {name!r}; allowed: {tuple(_LOADERS)}{hint}."
    )
  return _LOADERS[name]()


def _linen() -> Any:
  from linen_moe._src.training.frontend import LinenFrontend  # noqa: PLC0415

  return LinenFrontend


register_frontend("linen", _linen, "the Linen decoder (linen_moe.Decoder)")
