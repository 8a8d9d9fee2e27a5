"""Public faces whose names load on first use (PEP 562).

A face lists where each of its names is defined; `lazy_face` gives it its
`__all__`, and the module `__getattr__` and `__dir__` that import a name's
module when the name is first asked for, so that importing the face imports no jax (the
command line's `--help` and a test session's setup run before jax loads).
Names the face does not define go to `deprecation.moved_name` (old names
that moved answer with a warning), and old submodule paths of the face
(`deprecation.MOVED_MODULES`) import, with a warning.

Imports no jax.
"""

from __future__ import annotations

from collections.abc import Mapping
import importlib
from typing import Any

from linen_moe._src import deprecation


def lazy_face(
    face_globals: dict[str, Any],
    exports: Mapping[str, tuple[str, ...]],
    defined_here: tuple[str, ...] = (),
    submodules: tuple[str, ...] = (),
) -> None:
  """Makes a face's names load on first use.

  Sets the face's `__all__` (every exported name, sorted), `__getattr__`
  and `__dir__`.

  Args:
    face_globals: the face's `globals()` (loaded names are cached there).
    exports: {defining module: (names it gives the face, ...)}.
    defined_here: public names the face defines itself.
    submodules: public modules of a package face (`linen_moe.training`
      for `linen_moe`), imported when first asked for as attributes; they
      are modules, not names, so `__all__` does not list them.
  """
  home = {name: module for module, names in exports.items() for name in names}
  face = face_globals["__name__"]
  face_globals["__all__"] = sorted([*home, *defined_here])

  def __getattr__(name: str) -> Any:  # noqa: N807
    if name in home:
      value = getattr(importlib.import_module(home[name]), name)
      face_globals[name] = value  # found directly from now on
      return value
    if name in submodules:
      return importlib.import_module(f"{face}.{name}")
    if f"{face}.{name}" in deprecation.MOVED_MODULES:
      return importlib.import_module(f"{face}.{name}")  # warns
    return deprecation.moved_name(face, name)

  def __dir__() -> list[str]:  # noqa: N807
    listed = set(face_globals.get("__all__", ())) | set(submodules)
    return sorted(set(face_globals) | listed)

  face_globals["__getattr__"] = __getattr__
  face_globals["__dir__"] = __dir__
