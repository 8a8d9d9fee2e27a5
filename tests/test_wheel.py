"""The wheel ships the library, the adapter and the command line, and no
benchmark or peer code: no `bench*`, `peer_*` or `profile_*` file, and no
module that imports torch.

Installed from a wheel (as `.ci/run` tests it), the files are the installed
distribution's record; from a checkout (an editable install), the wheel is
built here, `pip wheel` of the source tree (a few seconds).
"""

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

from absl.testing import absltest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_TORCH = re.compile(r"^\s*(import torch\b|from torch\b)", re.M)
_BENCH = re.compile(r"^(bench|peer_|profile_)")
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
)


def _from_source_tree() -> bool:
  """Whether the suite imports the package from this checkout (an editable
  install, or a checkout on the path), not from an installed wheel."""
  import linen_moe  # noqa: PLC0415

  return pathlib.Path(linen_moe.__file__).resolve().is_relative_to(ROOT)


def wheel_files() -> dict[str, str]:
  """{path in the wheel: its text} of every .py file the wheel ships (the
  other files: their paths, with no text)."""
  if not _from_source_tree():
    dist = importlib.metadata.distribution("linen_moe")
    return {
        str(f): f.read_text() if f.suffix == ".py" else ""
        for f in dist.files or ()
        if not str(f).startswith("../")  # the console script
    }
  if not (ROOT / "setup.py").exists():
    raise absltest.SkipTest("an editable install without its source tree")
  with tempfile.TemporaryDirectory() as tmp:
    # A copy of the tree: building in place would leave build/ and an
    # .egg-info there (which importlib.metadata would then find).
    source, out = pathlib.Path(tmp, "source"), pathlib.Path(tmp, "dist")
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w"]
        + [str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("linen_moe-*.whl")
    with zipfile.ZipFile(wheel) as z:
      return {
          name: z.read(name).decode() if name.endswith(".py") else ""
          for name in z.namelist()
      }


class WheelTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.files = wheel_files()

  def test_ships_the_packages(self):
    for module in (
        "linen_moe/__init__.py",
        "nnx_adapter/__init__.py",
        "linen_moe_cli/main.py",
        "linen_moe/configs/tiny_mixtral.yml",
    ):
      self.assertIn(module, self.files)

  def test_no_benchmark_or_peer_code(self):
    shipped = [
        name for name in self.files if _BENCH.match(os.path.basename(name))
    ]
    self.assertEqual(shipped, [])
    self.assertFalse(any(n.startswith("benchmarks/") for n in self.files))

  def test_no_module_imports_torch(self):
    importing = [
        name for name, text in self.files.items() if _TORCH.search(text)
    ]
    self.assertEqual(importing, [])


if __name__ == "__main__":
  absltest.main()
