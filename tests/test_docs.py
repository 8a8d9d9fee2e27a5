"""The documentation is true: its examples run, its API pages and module map
match the package."""

import glob
import importlib
import importlib.util
import os
import re
import shutil
import tempfile
import types

from absl.testing import absltest
from absl.testing import parameterized

from linen_moe._src.testing.marks import heavy

# CI runs the suite from a copy of tests/ with README.md and docs/ beside it.
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
_PAGES = ["README.md"] + sorted(
    os.path.relpath(p, _ROOT)
    for p in glob.glob(
        os.path.join(_ROOT, "docs", "**", "*.md"), recursive=True
    )
)
_FACES = (
    "quantization",
    "routing",
    "variables",
    "sharding",
    "models",
    "training",
    "decoding",
    "checkpoint",
    "data",
    "distributed",
    "hf",
    "hlo",
    "lora",
    "planning",
    "tokens",
    "frontend",
    "testing",
)


def _read(page: str) -> str:
  with open(os.path.join(_ROOT, page), encoding="utf-8") as f:
    return f.read()


def _python_blocks(page: str) -> list[str]:
  return re.findall(r"```python\n(.*?)```", _read(page), flags=re.S)


class ExamplesTest(parameterized.TestCase):

  def test_pages_have_examples(self):
    self.assertGreaterEqual(len(_python_blocks("README.md")), 2)
    self.assertGreater(len(_PAGES), 10)

  @heavy
  def test_readme_examples_run(self):
    self.check_examples_run("README.md")

  # The guides' examples (each compiles its own models: ~100 s of the
  # default run's time on 2 cores) are heavy: .ci/run runs them on the
  # installed wheel, right after the default run.
  @heavy
  @parameterized.parameters(*_PAGES[1:])
  def test_guide_examples_run(self, page):
    self.check_examples_run(page)

  def check_examples_run(self, page):
    for i, block in enumerate(_python_blocks(page)):
      with self.subTest(block=i):
        exec(compile(block, f"{page}[python block {i}]", "exec"), {})  # noqa: S102


def _docs_conf():
  """docs/conf.py as a module (it writes the API pages at build time)."""
  spec = importlib.util.spec_from_file_location(
      "docs_conf", os.path.join(_ROOT, "docs", "conf.py")
  )
  conf = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(conf)
  return conf


class ApiReferenceTest(parameterized.TestCase):
  """Each public face gets a page, written from the docstrings when the
  site is built (docs/conf.py; none is kept in the source tree), that
  documents its `__all__` (autodoc reads `__all__`); the top-level page
  names what it leaves to other pages."""

  @parameterized.parameters(*_FACES)
  def test_face_page(self, face):
    page = _docs_conf().api_pages()[f"{face}.md"]
    self.assertIn(f".. automodule:: linen_moe.{face}\n", page)
    module = importlib.import_module(f"linen_moe.{face}")
    self.assertNotEmpty(module.__all__)
    for name in module.__all__:
      self.assertTrue(hasattr(module, name), f"{face}.{name}")

  def test_top_level_page(self):
    import linen_moe  # noqa: PLC0415

    pages = _docs_conf().api_pages()
    page = pages["linen_moe.md"]
    for face in _FACES:
      self.assertIn(face, dir(linen_moe))  # a module, not in __all__
      self.assertIn(f"`{face}`", page)
    self.assertIn(".. automodule:: nnx_adapter", pages["nnx_adapter.md"])
    # A page for each face of the index's table of contents, the faces
    # tested here among them.
    self.assertEqual(
        sorted(pages), sorted(f"{f}.md" for f in (*_FACES, "linen_moe",
                                                   "nnx_adapter"))
    )  # fmt: skip
    self.assertIn("when the site is built", _read("docs/api/index.md"))

  def test_pages_are_written_at_build(self):
    conf = _docs_conf()
    hooks = {}
    conf.setup(
        types.SimpleNamespace(
            connect=lambda event, fn, **_: hooks.setdefault(event, fn)
        )
    )
    # Before Sphinx reads the sources, into its source tree's api/.
    src = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, src)
    os.mkdir(os.path.join(src, "api"))
    hooks["builder-inited"](types.SimpleNamespace(srcdir=src))
    pages = conf.api_pages()
    self.assertCountEqual(os.listdir(os.path.join(src, "api")), pages)
    for name, text in pages.items():
      with open(os.path.join(src, "api", name), encoding="utf-8") as f:
        self.assertEqual(f.read(), text)
    self.assertEqual(conf.write_api_pages(os.path.join(src, "api")), [])


class ModuleMapTest(absltest.TestCase):
  """docs/module_map.md names every module of the tree and nothing else."""

  def test_map_matches_tree(self):
    page = _read("docs/module_map.md")
    entries = set(re.findall(r"^\| `([\w/.]+)` \|", page, flags=re.M))
    import linen_moe  # noqa: PLC0415
    import linen_moe_cli  # noqa: PLC0415, TID251 (its files, for the map)
    import nnx_adapter  # noqa: PLC0415

    modules = set()
    for package in (linen_moe, nnx_adapter, linen_moe_cli):
      root = os.path.dirname(package.__file__)
      base = os.path.dirname(root)
      for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, base)
        if os.path.basename(rel) != "__init__.py" or rel.count("/") == 1:
          modules.add(rel)
    covered = {
        m
        for m in modules
        if m in entries
        or any(e.endswith("/") and m.startswith(e) for e in entries)
    }
    self.assertEqual(
        sorted(modules - covered), [], "modules missing from the map"
    )
    stale = sorted(
        e
        for e in entries
        if e != "configs/"
        and not any(
            m == e or (e.endswith("/") and m.startswith(e)) for m in modules
        )
    )
    self.assertEqual(stale, [], "map entries with no module")


if __name__ == "__main__":
  absltest.main()
