"""The activations of the gated experts, by config name.

Most are a function of the gate branch alone: the expert computes
act(x wi_0) * (x wi_1). "clamped_swiglu" (GPT-OSS) also shapes the linear
branch: gate g clamped to <= limit, up u to [-limit, limit], then
g * sigmoid(alpha * g) * (u + 1) (`ClampedSwiGLU`).

`NAMES` imports no jax (a config validates its activation names without
it); `ACTIVATIONS`, `activation` and `ClampedSwiGLU`'s calls load jax on
first use.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
  import jax

CLAMPED_SWIGLU = "clamped_swiglu"
NAMES = ("silu", "gelu", "gelu_exact", "relu", "linear", CLAMPED_SWIGLU)


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
    import jax  # noqa: PLC0415 (no jax at import)

    gate = jax.numpy.minimum(gate, self.limit)
    return gate * jax.nn.sigmoid(gate * self.alpha)

  def linear(self, up: jax.Array) -> jax.Array:
    import jax  # noqa: PLC0415 (no jax at import)

    return jax.numpy.clip(up, -self.limit, self.limit) + 1


def _table() -> dict[str, Callable[[Any], Any]]:
  import jax  # noqa: PLC0415 (no jax at import)

  return {
      "silu": jax.nn.silu,
      "gelu": lambda x: jax.nn.gelu(x, approximate=True),
      "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
      "relu": jax.nn.relu,
      "linear": lambda x: x,
      CLAMPED_SWIGLU: ClampedSwiGLU(),
  }


_ACTIVATIONS: dict[str, Callable[[Any], Any]] = {}


def __getattr__(name: str) -> Any:
  if name == "ACTIVATIONS":  # {name: jax function}, built on first use
    if not _ACTIVATIONS:
      _ACTIVATIONS.update(_table())
    return _ACTIVATIONS
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def activation(
    name: str, alpha: float = 1.0, limit: float = 0.0
) -> Callable[[Any], Any]:
  """The activation called `name` (one of `NAMES`); "clamped_swiglu" with
  its `alpha` and `limit` (`MoEConfig.swiglu_alpha`, `swiglu_limit`)."""
  if name not in NAMES:
    raise ValueError(f"Unknown activation {name!r}; allowed: {NAMES}.")
  if name == CLAMPED_SWIGLU:
    return ClampedSwiGLU(float(alpha), float(limit))
  return __getattr__("ACTIVATIONS")[name]


def linear_branch(act: Callable[[Any], Any], up: jax.Array) -> jax.Array:
  """The up branch as the expert multiplies it: `act.linear(up)` for a
  `ClampedSwiGLU`, else `up`."""
  return act.linear(up) if isinstance(act, ClampedSwiGLU) else up
