"""The checks every config class shares: field names (and their old
spellings), choices, positive integers, and the one error they raise; and
the one check of an integer argument, `check_int`."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from linen_moe._src import deprecation
from linen_moe._src.deprecation import RENAMED_FIELDS


def new_names(cls: str, changes: dict[str, Any]) -> dict[str, Any]:
  """`changes` with the old spellings of renamed fields replaced, each with
  a warning (`deprecation.RENAMED_FIELDS`)."""
  return {
      (deprecation.renamed_field(cls, k) if k in RENAMED_FIELDS else k): v
      for k, v in changes.items()
  }


# A field made with `run_field(default)` says how the model is computed or trained,
# not what it is: a resumed run may change it (`run_fields()`). Every other
# field is the model itself (its shapes, routing and state) and must equal
# the checkpoint's, so a field added later counts as the model unless it says
# otherwise here.
def run_field(default: Any) -> Any:
  return dataclasses.field(default=default, metadata={"run": True})


def fail(cls: str, field: str, value: Any, allowed: str) -> None:
  hint = ""
  if isinstance(value, str) and "number" in allowed and _number_text(value):
    # PyYAML follows YAML 1.1, whose floats need a dot.
    hint = " (a YAML file reads 1e-3 as text: write 1.0e-3)"
  raise ValueError(f"{cls}.{field}={value!r} is invalid: {allowed}{hint}.")


def _number_text(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def check_int(name: str, value: Any, minimum: int) -> int:
  """The one check of an integer argument: an int (a NumPy integer too;
  not a bool) >= `minimum`.

  Args:
    name: what the error calls it (the argument's or field's name).
    value: the value.
    minimum: the least value allowed.

  Returns:
    `value` as a Python int.

  Raises:
    ValueError: "name=value is invalid: expected an integer >= minimum."
  """
  integer = isinstance(value, (int, np.integer)) and not isinstance(
      value, (bool, np.bool_)
  )
  if not integer or value < minimum:
    raise ValueError(
        f"{name}={value!r} is invalid: expected an integer >= {minimum}."
    )
  return int(value)


def check_positive_ints(obj: Any, names: tuple[str, ...]) -> None:
  for name in names:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      fail(type(obj).__name__, name, value, "expected a positive integer")


def check_choice(obj: Any, name: str, allowed: tuple[str, ...]) -> None:
  value = getattr(obj, name)
  if value not in allowed:
    fail(type(obj).__name__, name, value, f"allowed values are {allowed}")


def check_keys(cls: type, changes: dict[str, Any], extra=frozenset()) -> None:
  allowed = {f.name for f in dataclasses.fields(cls)} | set(extra)
  unknown = sorted(set(changes) - allowed)
  if unknown:
    raise ValueError(
        f"Unknown {cls.__name__} key(s) {unknown}; allowed keys are "
        f"{sorted(allowed)}."
    )
