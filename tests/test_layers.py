"""The package is a house of layers: no import climbs, and none goes round.

Read from the installed sources' imports (every `import` statement, those
inside functions and under `TYPE_CHECKING` too: each is a dependency):

- inside `linen_moe/_src`, a folder (or top-level module) imports only from
  the layers below its own (`LAYERS`, bottom first; the folders of one layer
  know nothing of each other), and every folder has its place in the list;
- no module of the package imports itself back through others (no cycle);
- `linen_moe/_src` imports no public face, no `nnx_adapter` and no
  `linen_moe_cli`; `nnx_adapter` imports no `linen_moe_cli`;
- docs/module_map.md states the same order.
"""

import ast
import os
import re

from absl.testing import absltest

import linen_moe
import linen_moe_cli  # noqa: TID251 (its files, for the graph)
import nnx_adapter

# Bottom first. A folder of `linen_moe/_src` (or a module directly in it) may
# import from the layers below its own, never from its own layer's others or
# from above.
LAYERS = (
    ("deprecation", "kernels", "parallel"),
    ("config",),
    ("data", "hlo", "quantization"),
    ("lora",),
    ("layer",),
    ("models",),
    ("checkpoint", "hf"),
    ("training",),
    ("planning", "testing"),
    ("run",),
    ("faces",),
)

_SRC = "linen_moe._src"


def _package_modules(package) -> dict[str, str]:
  """{dotted module name: source path} of an installed package."""
  root = os.path.dirname(package.__file__)
  base = os.path.dirname(root)
  modules = {}
  for folder, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, name), base)[: -len(".py")]
        dotted = rel.replace(os.sep, ".")
        modules[dotted.removesuffix(".__init__")] = os.path.join(folder, name)
  return modules


def _imports(name: str, path: str, is_package: bool) -> set[str]:
  """Every module name `path` imports (`from a import b` gives a and a.b)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  here = name if is_package else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        parts = here.split(".")[: len(here.split(".")) - node.level + 1]
        module = ".".join(parts + ([node.module] if node.module else []))
      else:
        module = node.module
      found.add(module)
      found.update(f"{module}.{alias.name}" for alias in node.names)
  return found


def _graph() -> dict[str, set[str]]:
  """{module: the package modules it imports}, over the three packages."""
  modules = {}
  for package in (linen_moe, nnx_adapter, linen_moe_cli):
    modules.update(_package_modules(package))
  graph = {}
  for name, path in modules.items():
    is_package = path.endswith("__init__.py")
    graph[name] = {
        m
        for m in _imports(name, path, is_package)
        if m in modules and m != name
    }
  return graph


def _room(module: str) -> str | None:
  """The `_src` folder or top-level module `module` belongs to."""
  parts = module.split(".")
  if parts[:2] != _SRC.split(".") or len(parts) < 3:
    return None
  return parts[2]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


class LayersTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.graph = _graph()

  def test_every_folder_has_a_layer(self):
    rooms = {_room(m) for m in self.graph} - {None, "__init__"}
    placed = {room for layer in LAYERS for room in layer}
    self.assertEqual(sorted(rooms - placed), [], "folders with no layer")
    self.assertEqual(sorted(placed - rooms), [], "layers with no folder")

  def test_no_import_climbs(self):
    level = {room: i for i, layer in enumerate(LAYERS) for room in layer}
    climbs = []
    for module, targets in sorted(self.graph.items()):
      room = _room(module)
      if room is None or room == "__init__":
        continue
      for target in sorted(targets):
        other = _room(target)
        if other is None or other in ("__init__", room):
          continue
        if level[other] >= level[room]:
          climbs.append(f"{module} -> {target}")
    self.assertEqual(climbs, [], "imports that do not run down the layers")

  def test_no_cycles(self):
    self.assertEqual(_cycles(self.graph), [])

  def test_cycles_are_found(self):
    self.assertEqual(
        _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}),
        [["a", "b", "c"]],
    )

  def test_private_code_imports_no_client(self):
    wrong = []
    for module, targets in sorted(self.graph.items()):
      for target in targets:
        face = target.startswith("linen_moe.") and not (
            target == _SRC or target.startswith(_SRC + ".")
        )
        client = target.split(".")[0] in ("nnx_adapter", "linen_moe_cli")
        if module.startswith(_SRC + ".") and (face or client):
          wrong.append(f"{module} -> {target}")
        if module.startswith("nnx_adapter") and target.startswith(
            "linen_moe_cli"
        ):
          wrong.append(f"{module} -> {target}")
    self.assertEqual(wrong, [])

  def test_module_map_states_the_layers(self):
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
    with open(
        os.path.join(root, "docs", "module_map.md"), encoding="utf-8"
    ) as f:
      page = f.read()
    block = re.search(r"## Layers\n.*?```text\n(.*?)```", page, flags=re.S)
    self.assertIsNotNone(block, "docs/module_map.md has no '## Layers' block")
    stated = [tuple(line.split()) for line in block.group(1).splitlines()]
    self.assertEqual(stated, [tuple(layer) for layer in reversed(LAYERS)])


if __name__ == "__main__":
  absltest.main()
