"""Which `linen_moe._src` imports of the tests a public face could replace.

Issue 64 (item 6): a test imports a public face (`from linen_moe import
training`, then `training.X`) wherever one exports the thing it uses, and
`linen_moe._src` only for what has no public name (a private module under
test, the testing helpers of `linen_moe._src.testing`). This lists every
`linen_moe._src` import under tests/ (each imported name once, also those
inside functions) with its kind:

  public      the imported object IS (`is`) a name of a public face
              (`linen_moe` or a `linen_moe.<module>`); the face is shown.
  uses public a module every attribute of which the file reads (`alias.X`)
              is a face's name, and the file never uses the module itself.
  testing     `linen_moe._src.testing...` (helpers, marks, compile options),
              without a public name.
  module      a private module (some or all of its uses have no face).
  private     another object without a public name.
  missing     the module or name does not import here (e.g. a GPU kernel).

A constant (a str, number, tuple, ...) counts as public only under the same
name: two equal small constants can be one object. A face's wrapper of a
private function is another object, so not `public`.

  python scripts/src_imports_in_tests.py [--exclude tests/cli tests/run] [-v]

Prints one line per imported name (-v adds the face name of each attribute
a module import is used for), then the count of each kind, and how many
attributes that the files read through a private module a face exports. Imports the
package and jax (no compiles).
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import importlib
import pathlib
import pkgutil
import sys
import types
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRIVATE = "linen_moe._src"
KINDS = ("public", "uses public", "testing", "module", "private", "missing")
_CONSTANTS = (str, bytes, int, float, complex, bool, tuple, frozenset)
_MISSING = object()


@dataclasses.dataclass
class Imported:
  """One name a test file imports from `linen_moe._src`.

  Attributes:
    path: the file, relative to the checkout.
    line: the import's line.
    module: the module it is imported from (or the module imported).
    name: the imported name ("" for `import linen_moe._src.x`).
    alias: the name it has in the file.
  """

  path: str
  line: int
  module: str
  name: str
  alias: str

  @property
  def dotted(self) -> str:
    return f"{self.module}.{self.name}" if self.name else self.module


def src_imports(path: pathlib.Path) -> list[Imported]:
  """Every `linen_moe._src` name that `path` imports, in order of lines."""
  tree = ast.parse(path.read_text(), str(path))
  rel = str(path.relative_to(ROOT))
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.level == 0:
      if (node.module or "").startswith(PRIVATE):
        for a in node.names:
          found.append(
              Imported(
                  rel, node.lineno, node.module, a.name, a.asname or a.name
              )
          )
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith(PRIVATE):
          # `import linen_moe._src.x` binds `linen_moe`: uses read the chain.
          found.append(Imported(rel, node.lineno, a.name, "", a.asname or ""))
  return sorted(found, key=lambda i: (i.line, i.dotted))


def face_index() -> dict[int, list[tuple[str, str, Any]]]:
  """{id(object): [(face, name, object), ...]} of every public name."""
  import linen_moe  # noqa: PLC0415

  faces = ["linen_moe"] + [
      f"linen_moe.{m.name}"
      for m in pkgutil.iter_modules(linen_moe.__path__)
      if not m.name.startswith("_")
  ]
  index = collections.defaultdict(list)
  for face in faces:
    module = importlib.import_module(face)
    for name in module.__all__:
      value = getattr(module, name)
      index[id(value)].append((face, name, value))
  return index


def public_names(index, value: Any, name: str) -> list[str]:
  """The faces' names of `value` (a constant only under its own `name`)."""
  names = []
  for face, face_name, face_value in index.get(id(value), ()):
    if face_value is not value:
      continue
    if isinstance(value, _CONSTANTS) and face_name != name:
      continue
    names.append(f"{face}.{face_name}")
  return names


def load(imported: Imported) -> Any:
  """The imported object, or _MISSING where it does not import here."""
  try:
    module = importlib.import_module(imported.module)
    if not imported.name:
      return module
    value = getattr(module, imported.name, _MISSING)
    if value is _MISSING:
      value = importlib.import_module(imported.dotted)
    return value
  except Exception:  # noqa: BLE001 - a GPU kernel's missing toolchain, ...
    return _MISSING


def attribute_uses(path: pathlib.Path, alias: str) -> tuple[set[str], int]:
  """The attributes read as `alias.X` in `path`, and the bare uses of alias."""
  tree = ast.parse(path.read_text(), str(path))
  attributes, inner = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      if node.value.id == alias:
        attributes.add(node.attr)
        inner.add(id(node.value))
  bare = sum(
      1
      for node in ast.walk(tree)
      if isinstance(node, ast.Name)
      and node.id == alias
      and id(node) not in inner
      and isinstance(node.ctx, ast.Load)
  )
  return attributes, bare


def classify(index, imported: Imported) -> tuple[str, str]:
  """The kind of one import, and what to show beside it."""
  value = load(imported)
  if value is _MISSING:
    return "missing", ""
  names = public_names(index, value, imported.name)
  if names:
    return "public", " ".join(names)
  if isinstance(value, types.ModuleType) and imported.alias:
    uses, bare = attribute_uses(ROOT / imported.path, imported.alias)
    faces = {}
    for attr in sorted(uses):
      attr_value = getattr(value, attr, _MISSING)
      if attr_value is not _MISSING:
        faces[attr] = public_names(index, attr_value, attr)
    public = sorted(a for a, n in faces.items() if n)
    detail = f"{len(public)}/{len(uses)} uses public" + (
        f", {bare} bare" if bare else ""
    )
    shown = " ".join(f"{a}={faces[a][0]}" for a in public)
    if uses and len(public) == len(uses) and not bare:
      return "uses public", f"{detail}: {shown}"
    if imported.dotted.startswith(f"{PRIVATE}.testing"):
      return "testing", f"{detail}: {shown}" if public else detail
    return "module", f"{detail}: {shown}" if public else detail
  if imported.dotted.startswith(f"{PRIVATE}.testing"):
    return "testing", ""
  return "private", ""


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
      "--exclude",
      nargs="*",
      default=[],
      help="folders under the checkout to leave out (e.g. tests/cli tests/run)",
  )
  parser.add_argument(
      "-v", "--verbose", action="store_true", help="show each use's face name"
  )
  args = parser.parse_args(argv)
  sys.path.insert(0, str(ROOT))
  excluded = [ROOT / e for e in args.exclude]
  files = [
      p
      for p in sorted((ROOT / "tests").rglob("*.py"))
      if not any(p.is_relative_to(e) for e in excluded)
  ]
  index = face_index()
  counts = collections.Counter()
  public_uses = 0
  for path in files:
    for imported in src_imports(path):
      kind, shown = classify(index, imported)
      counts[kind] += 1
      if kind in ("module", "testing") and "/" in shown:
        public_uses += int(shown.split("/")[0])
      if not args.verbose and kind in ("module", "testing"):
        shown = shown.split(":")[0]
      print(
          f"{imported.path}:{imported.line} {imported.dotted} [{kind}] {shown}"
      )
  total = sum(counts.values())
  print(f"\n{total} imported names from {PRIVATE} in {len(files)} files:")
  for kind in KINDS:
    print(f"  {kind:12s} {counts[kind]}")
  print(
      f"and {public_uses} attributes read through a 'module' or"
      " 'testing' import that a face exports"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
