"""The activations of the gated experts, by config name.

Most are a function of the gate branch alone: the expert computes
act(x wi_0) * (x wi_1). "clamped_swiglu" (GPT-OSS) also shapes the linear
branch: gate g clamped to <= limit, up u to [-limit, limit], then
g * sigmoid(alpha * g) * (u + 1) (`ClampedSwiGLU`).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
  """GPT-OSS's gated activation (transformers' `GptOssExperts._apply_gate`).

  Called on the gate branch g it gives min(g, limit) * sigmoid(alpha *
  min(g, limit)); `linear` of the up branch u gives clip(u, -limit, limit)
  + 1; the expert multiplies the two. Hashable, so that it can be a static
  argument of a custom VJP.

  Attributes:
    alpha: the sigmoid's gain (GPT-OSS: 1.702).
    limit: the clamp (GPT-OSS: 7.0), > 0.
  """

  alpha: float = 1.702
  limit: float = 7.0

  def __call__(self, gate: jax.Array) -> jax.Array:
    gate = jnp.minimum(gate, self.limit)
    return gate * jax.nn.sigmoid(gate * self.alpha)

  def linear(self, up: jax.Array) -> jax.Array:
    return jnp.clip(up, -self.limit, self.limit) + 1


CLAMPED_SWIGLU = "clamped_swiglu"
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "linear": lambda x: x,
    CLAMPED_SWIGLU: ClampedSwiGLU(),
}


def activation(
    name: str, alpha: float = 1.0, limit: float = 0.0
) -> Callable[[jax.Array], jax.Array]:
  """The activation called `name` (a key of `ACTIVATIONS`); "clamped_swiglu"
  with its `alpha` and `limit` (`MoEConfig.swiglu_alpha`, `swiglu_limit`)."""
  if name not in ACTIVATIONS:
    raise ValueError(
        f"Unknown activation {name!r}; allowed: {tuple(ACTIVATIONS)}."
    )
  if name == CLAMPED_SWIGLU:
    return ClampedSwiGLU(float(alpha), float(limit))
  return ACTIVATIONS[name]


def linear_branch(act, up: jax.Array) -> jax.Array:
  """The up branch as the expert multiplies it: `act.linear(up)` for a
  `ClampedSwiGLU`, else `up`."""
  return act.linear(up) if isinstance(act, ClampedSwiGLU) else up
