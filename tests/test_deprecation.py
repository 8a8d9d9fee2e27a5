"""Every public name or module that moved still answers, with a warning.

For one release each old name answers at its old home with a
`DeprecationWarning` that names the new home, and gives the very object
the new home gives; each old module path works in all three import forms:
the attribute (`linen_moe.moe`), `import linen_moe.moe`, and
`from linen_moe.moe import RoutedMoE`.
"""

import importlib
import sys
import warnings

from absl.testing import absltest
from absl.testing import parameterized

import linen_moe
from linen_moe._src import deprecation

_NAMES = [
    (face, name, new_face, new_name)
    for face, names in deprecation.MOVED_NAMES.items()
    for name, (new_face, new_name) in names.items()
]


def _forget(module_name: str) -> None:
  """Removes an old module path from the import caches, so that importing it
  again goes through the finder (and warns) again."""
  sys.modules.pop(module_name, None)
  parent, _, child = module_name.rpartition(".")
  vars(sys.modules[parent]).pop(child, None)


def _one_public_name(private: str) -> str:
  """A name the private module defines (for `from OLD import NAME`)."""
  module = importlib.import_module(private)
  return next(
      n
      for n in sorted(vars(module))
      if not n.startswith("_") and getattr(module, n) is not None
  )


class MovedNamesTest(parameterized.TestCase):

  @parameterized.parameters(*_NAMES)
  def test_old_name_warns_and_is_the_new_object(
      self, face, name, new_face, new_name
  ):
    with warnings.catch_warnings():  # an old module's own warning
      warnings.simplefilter("ignore", DeprecationWarning)
      module = importlib.import_module(face)
    with self.assertWarnsRegex(DeprecationWarning, f"{face}.{name}") as w:
      old = getattr(module, name)
    if new_face is None:
      self.assertIn("no public replacement", str(w.warning))
      home, _, attr = new_name.partition(":")
      expected = getattr(importlib.import_module(home), attr or name)
    else:
      self.assertIn(f"use {new_face}.{new_name}", str(w.warning))
      expected = getattr(importlib.import_module(new_face), new_name)
      self.assertIn(new_name, importlib.import_module(new_face).__all__)
    self.assertIs(old, expected)
    self.assertNotIn(name, getattr(module, "__all__", ()))

  @parameterized.parameters(*_NAMES)
  def test_from_import_form(self, face, name, new_face, new_name):
    del new_face, new_name
    with self.assertWarns(DeprecationWarning):
      exec(f"from {face} import {name}", {})  # noqa: S102

  def test_warning_points_at_the_callers_line(self):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      linen_moe.QUANTIZATIONS  # noqa: B018
    self.assertEqual(caught[0].filename, __file__)

  def test_the_old_config_modules_load_config_works(self):
    with self.assertWarnsRegex(DeprecationWarning, "load_config"):
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("linen_moe.config")
      moe = old.load_config("tiny_mixtral")
    self.assertEqual(moe, linen_moe.load_moe_config("tiny_mixtral"))

  def test_unknown_name_is_an_attribute_error(self):
    with self.assertRaisesRegex(AttributeError, "no attribute 'nothing'"):
      linen_moe.quantization.nothing  # noqa: B018


class MovedModulesTest(parameterized.TestCase):

  @parameterized.parameters(*sorted(deprecation.MOVED_MODULES))
  def test_three_import_forms(self, old):
    private = deprecation.MOVED_MODULES[old][0]
    target = importlib.import_module(private)
    parent, _, child = old.rpartition(".")
    name = _one_public_name(private)

    _forget(old)
    face = importlib.import_module(parent)
    if child in getattr(face, "__all__", ()):  # a public name there now
      self.assertTrue(callable(getattr(face, child)))  # training.frontend
    else:
      with self.assertWarnsRegex(DeprecationWarning, old):
        module = getattr(face, child)
      self.assertIs(getattr(module, name), getattr(target, name))

    _forget(old)
    with self.assertWarnsRegex(DeprecationWarning, old):
      exec(f"import {old}", {})  # noqa: S102

    _forget(old)
    with self.assertWarnsRegex(DeprecationWarning, old):
      scope = {}
      exec(f"from {old} import {name}", scope)  # noqa: S102
    self.assertIs(scope[name], getattr(target, name))

  def test_an_old_module_path_that_is_a_function_now(self):
    _forget("linen_moe.training.frontend")
    with self.assertWarns(DeprecationWarning):
      exec("import linen_moe.training.frontend", {})  # noqa: S102
    import linen_moe.training  # noqa: PLC0415

    # The old module sits at the function's name: it answers as both.
    self.assertIs(
        linen_moe.training.frontend("linen"), linen_moe.training.LinenFrontend
    )
    self.assertIs(
        linen_moe.training.frontend.LinenFrontend,
        linen_moe.training.LinenFrontend,
    )
    _forget("linen_moe.training.frontend")


if __name__ == "__main__":
  absltest.main()
