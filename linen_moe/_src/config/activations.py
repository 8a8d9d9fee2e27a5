"""The activations of the gated experts, by config name."""

from __future__ import annotations

from collections.abc import Callable

import jax

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "linear": lambda x: x,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
  """The activation called `name` (a key of `ACTIVATIONS`)."""
  if name not in ACTIVATIONS:
    raise ValueError(
        f"Unknown activation {name!r}; allowed: {tuple(ACTIVATIONS)}."
    )
  return ACTIVATIONS[name]
