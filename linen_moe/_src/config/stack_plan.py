"""Where a decoder's layers sit in a variable tree: the names of its layer
stack and the `StackPlan` that says which layers are scanned.

Unrolled, the layer `i` is the subtree `layers_{i}`. Scanned, a run of
identical layers is one subtree `layers` whose leaves are stacked on a
leading axis; a stack that mixes kinds of layers (a dense layer among MoE
layers, say) scans as a repeated group of `period` consecutive layers whose
members are `layers/block_{j}`, and the layers outside the repeated part stay
unrolled:

  every layer MoE, scanned          layers/...                 [L, ...]
  dense layer 0, then MoE, scanned  layers_0/..., layers/...   [L - 1, ...]
  dense and MoE alternating         layers/block_0/..., layers/block_1/...
  unrolled (any kinds)              layers_0/..., layers_1/..., ...

A `StackPlan` says which is which. The decoders choose theirs from the kind
of each layer (`StackPlan.for_kinds`, through `ModelConfig.stack_plan`);
moving trees between layouts is `linen_moe._src.models.layer_stack`. A fact
table below the configs: imports no jax.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence
import dataclasses

STACK = "layers"
_LAYER_PREFIX = "layers_"
_MEMBER_PREFIX = "block_"

Path = tuple[str, ...]


def layer_name(i: int) -> str:
  """The subtree name of unrolled layer `i`.

  Args:
    i: the layer's index.

  Returns:
    `layers_{i}`.
  """
  return f"{_LAYER_PREFIX}{i}"


def member_name(j: int) -> str:
  """The subtree of member `j` of a scanned group: `block_{j}`."""
  return f"{_MEMBER_PREFIX}{j}"


def layer_index(part: str) -> int | None:
  """i for a path component `layers_{i}`, else None."""
  if part.startswith(_LAYER_PREFIX) and part[len(_LAYER_PREFIX) :].isdigit():
    return int(part[len(_LAYER_PREFIX) :])
  return None


def member_index(part: str) -> int | None:
  """j for a path component `block_{j}`, else None."""
  if part.startswith(_MEMBER_PREFIX) and part[len(_MEMBER_PREFIX) :].isdigit():
    return int(part[len(_MEMBER_PREFIX) :])
  return None


@dataclasses.dataclass(frozen=True)
class StackPlan:
  """Which layers of `num_layers` are scanned, and how.

  Layers `start .. start + period * repeats - 1` are scanned: layer
  `start + r * period + j` is row `r` of the stack (`layers`), member `j`
  of its group (`layers/block_{j}`, or `layers` itself when `period` is
  1). Every other layer is unrolled (`layers_{i}`). `repeats == 0`: all
  unrolled.

  Attributes:
    num_layers: the decoder's layers, L >= 0.
    start: the first scanned layer.
    period: layers per repeated group (1: one block per row).
    repeats: rows of the stack (0: nothing scanned).
  """

  num_layers: int
  start: int = 0
  period: int = 1
  repeats: int = 0

  def __post_init__(self):
    for name in ("num_layers", "start", "period", "repeats"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"StackPlan.{name}={value!r} must be an int >= 0.")
    if self.period < 1 or self.start + self.period * self.repeats > (
        self.num_layers
    ):
      raise ValueError(
          f"{self} does not fit {self.num_layers} layers (period >= 1, "
          "start + period * repeats <= num_layers)."
      )

  @classmethod
  def unrolled(cls, num_layers: int) -> StackPlan:
    """Every layer unrolled (`layers_{i}`), nothing scanned.

    Args:
      num_layers: L.

    Returns:
      The plan.
    """
    return cls(num_layers)

  @classmethod
  def uniform(cls, num_layers: int) -> StackPlan:
    """Every layer of one kind, all scanned: `layers` [num_layers, ...].

    Args:
      num_layers: L.

    Returns:
      The plan.
    """
    return cls(num_layers, 0, 1, num_layers)

  @classmethod
  def for_kinds(cls, kinds: Sequence[Hashable], scan: bool) -> StackPlan:
    """The plan of a stack whose layer `i` is of kind `kinds[i]`.

    Unrolled unless `scan`. Scanned, the repeated group is the one that
    leaves the fewest distinct blocks to compile (the group's members plus
    the unrolled layers); ties go to the one that scans the most layers,
    then to the shorter period, then to the earlier start. One kind
    throughout gives `uniform`.

    Args:
      kinds: each layer's kind (anything hashable, e.g. "moe" / "dense").
      scan: whether to scan at all.

    Returns:
      The plan.
    """
    kinds = tuple(kinds)
    n = len(kinds)
    if not scan or n == 0:
      return cls.unrolled(n)
    best, best_key = None, None
    for start in range(n):
      for period in range(1, n - start + 1):
        repeats = 1
        while start + period * (repeats + 1) <= n and all(
            kinds[start + repeats * period + j] == kinds[start + j]
            for j in range(period)
        ):
          repeats += 1
        covered = period * repeats
        key = (n - covered + period, -covered, period, start)
        if best_key is None or key < best_key:
          best, best_key = cls(n, start, period, repeats), key
    return best

  @property
  def scanned(self) -> bool:
    return self.repeats > 0

  def layer(self, r: int, j: int = 0) -> int:
    """The layer index of row `r`, member `j` of the stack.

    Args:
      r: the row, in [0, repeats).
      j: the member of the group, in [0, period).

    Returns:
      The layer's index in [0, num_layers).
    """
    return self.start + r * self.period + j

  def slot(self, i: int) -> tuple[int, int] | None:
    """Where layer `i` sits in the stack.

    Args:
      i: a layer index.

    Returns:
      `(row, member)`, or None when the layer is unrolled.
    """
    offset = i - self.start
    if self.repeats and 0 <= offset < self.period * self.repeats:
      return divmod(offset, self.period)
    return None

  @property
  def before(self) -> tuple[int, ...]:
    """The unrolled layers applied before the stack."""
    return tuple(range(self.start if self.repeats else self.num_layers))

  @property
  def after(self) -> tuple[int, ...]:
    """The unrolled layers applied after the stack."""
    if not self.repeats:
      return ()
    return tuple(range(self.layer(self.repeats), self.num_layers))

  def member_path(self, j: int) -> Path:
    """The path of member `j` of the group in a variable tree.

    Args:
      j: the member, in [0, period).

    Returns:
      (`layers`,) when `period` is 1, else (`layers`, `block_{j}`).
    """
    return (STACK,) if self.period == 1 else (STACK, member_name(j))
