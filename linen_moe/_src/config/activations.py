"""The activations of the gated experts, by config name.

`NAMES` imports no jax (a config validates its activation names without
it); `ACTIVATIONS` and `activation` load jax on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NAMES = ("silu", "gelu", "gelu_exact", "relu", "linear")


def _table() -> dict[str, Callable[[Any], Any]]:
  import jax  # noqa: PLC0415 (no jax at import)

  return {
      "silu": jax.nn.silu,
      "gelu": lambda x: jax.nn.gelu(x, approximate=True),
      "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
      "relu": jax.nn.relu,
      "linear": lambda x: x,
  }


_ACTIVATIONS: dict[str, Callable[[Any], Any]] = {}


def __getattr__(name: str) -> Any:
  if name == "ACTIVATIONS":  # {name: jax function}, built on first use
    if not _ACTIVATIONS:
      _ACTIVATIONS.update(_table())
    return _ACTIVATIONS
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def activation(name: str) -> Callable[[Any], Any]:
  """The activation called `name` (one of `NAMES`)."""
  if name not in NAMES:
    raise ValueError(f"Unknown activation {name!r}; allowed: {NAMES}.")
  return __getattr__("ACTIVATIONS")[name]
