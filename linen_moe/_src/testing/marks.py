"""The `slow` and `heavy` marks of the test suite. Imports no jax (the test
session's conftest reads them before jax may load)."""

from __future__ import annotations

import inspect
from typing import Any

# The attribute `slow` sets; the test suite's conftest.py turns it into the
# pytest marker "slow" (excluded from the default run).
SLOW_ATTRIBUTE = "__linen_moe_slow__"
# The attribute `heavy` sets; conftest.py turns it into the marker "heavy".
HEAVY_ATTRIBUTE = "__linen_moe_heavy__"


def _mark(test: Any, attribute: str, name: str) -> Any:
  """Sets `attribute` on a test class or method (`slow`'s docstring)."""
  # absl's parameterized wrapper: mark the method it will generate cases
  # from (each case is a functools.wraps copy of it, attributes included).
  target = getattr(test, "_test_method", test)
  if not (inspect.isclass(target) or inspect.isfunction(target)):
    raise TypeError(
        f"{name} marks a test class or method; got {type(test).__name__}."
    )
  setattr(target, attribute, True)
  return test


def slow(test: Any) -> Any:
  """Marks a test class or method as slow: out of the default run, in
  `pytest -m slow`.

  Works where a pytest mark does not: on absltest `parameterized` methods,
  on either side of the `@parameterized...` decorator (each generated case
  is marked), and on `hypothesis` tests.

  Args:
    test: a test class, a test function, or what `parameterized.parameters`
      / `product` / `named_parameters` returned.

  Returns:
    `test`, marked.

  Raises:
    TypeError: `test` is none of those.
  """
  return _mark(test, SLOW_ATTRIBUTE, "slow")


def heavy(test: Any) -> Any:
  """Marks a test class or method as heavy: the only check of its claim,
  too long for the default run, so out of it and in `pytest -m heavy`,
  which `.ci/run` runs right after the default run (tests/README.md). Used
  as `slow` is.

  Raises:
    TypeError: `test` is not a test class or method.
  """
  return _mark(test, HEAVY_ATTRIBUTE, "heavy")


def is_slow(test: Any) -> bool:
  """Whether `slow` marked a test.

  Args:
    test: a class, function or bound method (anything: False without the
      mark).

  Returns:
    True when `slow` marked it (or the method it was generated from).
  """
  return bool(getattr(test, SLOW_ATTRIBUTE, False))


def is_heavy(test: Any) -> bool:
  """Whether `heavy` marked a test (as `is_slow`)."""
  return bool(getattr(test, HEAVY_ATTRIBUTE, False))
