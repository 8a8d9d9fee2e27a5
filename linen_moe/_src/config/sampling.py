"""How a token is drawn from a decoder's logits: `Sampling`, checked once.

`linen_moe.decoding.generate` and `generate_stream` take these four
settings under the same names and check them by building one;
`linen-moe generate` builds one from its flags (`--top-k` is `top_k`), so a
bad value is the same error, naming the field and its flag, before any
work. Imports no jax.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any


def _real(value: Any) -> bool:
  """A number that is not a bool (NumPy scalars too)."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """The sampler's settings, applied in this order, as transformers' are.

  Example usage:

    sampling = Sampling(temperature=0.7, top_p=0.9)
    result = decoding.generate(config, variables, prompts,
                               max_new_tokens=32, sampling=sampling)

  Attributes:
    temperature: the logits are divided by it, >= 0; 0 is greedy (argmax,
      the filters unused).
    top_k: keep the k likeliest tokens (ties with the k-th kept), >= 0;
      0 keeps all.
    top_p: keep the likeliest tokens until their probabilities reach top_p
      (at least one token), in (0, 1]; 1 keeps all.
    min_p: drop the tokens less likely than min_p times the likeliest, in
      [0, 1]; 0 drops none.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
    if not (_real(t) and math.isfinite(t) and t >= 0):
      _fail("temperature", t, "expected a finite number >= 0")
    if not (isinstance(k, numbers.Integral) and _real(k) and k >= 0):
      _fail("top_k", k, "expected an integer >= 0")
    if not (_real(p) and 0 < p <= 1):
      _fail("top_p", p, "expected a number in (0, 1]")
    if not (_real(m) and 0 <= m <= 1):
      _fail("min_p", m, "expected a number in [0, 1]")
    for name, cast in (("temperature", float), ("top_k", int)):
      object.__setattr__(self, name, cast(getattr(self, name)))
    for name in ("top_p", "min_p"):
      object.__setattr__(self, name, float(getattr(self, name)))

  def kwargs(self) -> dict[str, float | int]:
    """The settings as keyword arguments.

    Returns:
      {"temperature", "top_k", "top_p", "min_p"}, as `generate` takes them.
    """
    return dataclasses.asdict(self)


def _fail(name: str, value: Any, allowed: str) -> None:
  flag = "--" + name.replace("_", "-")
  raise ValueError(f"{name}={value!r} ({flag}) is invalid: {allowed}.")
