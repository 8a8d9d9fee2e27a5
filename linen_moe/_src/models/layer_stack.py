"""The names of a decoder's layer stack, and its scanned <-> unrolled forms.

One home for where a decoder's layers sit in a variable tree. Unrolled, the
layer `i` is the subtree `layers_{i}`. Scanned, a run of identical layers
is one subtree `layers` whose leaves are stacked on a leading axis; a stack
that mixes kinds of layers (a dense layer among MoE layers, say) scans as
a repeated group of `period` consecutive layers whose members are
`layers/block_{j}`, and the layers outside the repeated part stay unrolled:

  every layer MoE, scanned          layers/...                 [L, ...]
  dense layer 0, then MoE, scanned  layers_0/..., layers/...   [L - 1, ...]
  dense and MoE alternating         layers/block_0/..., layers/block_1/...
  unrolled (any kinds)              layers_0/..., layers_1/..., ...

A `StackPlan` says which is which. The decoders choose theirs from the
kind of each layer (`StackPlan.for_kinds`); a checkpoint reads it off a
tree (`plan_of_tree`), so code that converts trees needs no decoder. This
module knows no decoder and no collection: it moves subtrees by name.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Mapping
from collections.abc import Sequence
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

STACK = "layers"
_LAYER_PREFIX = "layers_"
_MEMBER_PREFIX = "block_"

PyTree = Any
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


def _split(node: Mapping, plan: StackPlan, where: str) -> dict:
  """`node` with its stack split into `layers_{i}` subtrees."""
  tree = dict(node)
  stacked = tree.pop(STACK, None)
  if stacked is None:
    return tree
  if not plan.repeats:
    raise ValueError(f"{where} has a stack `{STACK}`, but the plan has none.")
  for j in range(plan.period):
    member = stacked if plan.period == 1 else stacked.get(member_name(j))
    if member is None:
      continue
    rows = {
        jnp.shape(x)[0] if jnp.ndim(x) else None
        for x in jax.tree.leaves(member)
    }
    if rows - {plan.repeats}:
      raise ValueError(
          f"{where}/{STACK} stacks {sorted(rows, key=str)} layers on axis 0, "
          f"but the plan scans {plan.repeats} ({plan}); pass the plan the "
          "stack was built with."
      )
    for r in range(plan.repeats):
      tree[layer_name(plan.layer(r, j))] = jax.tree.map(
          lambda x, r=r: x[r], member
      )
  return tree


def _stack(node: Mapping, plan: StackPlan, where: str) -> dict:
  """`node` with the plan's scanned layers stacked into `layers`."""
  tree = dict(node)
  if not plan.repeats:
    return tree
  members = {}
  for j in range(plan.period):
    names = [layer_name(plan.layer(r, j)) for r in range(plan.repeats)]
    layers = [tree.pop(name) for name in names if name in tree]
    if not layers:
      continue
    if len(layers) != plan.repeats:
      raise ValueError(
          f"{where} has {len(layers)} of the {plan.repeats} layers "
          f"{names} that stack into member {j}."
      )
    members[j] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  if members:
    if plan.period == 1:
      tree[STACK] = members[0]
    else:
      tree[STACK] = {member_name(j): m for j, m in members.items()}
  return tree


def _holds_layers(node: Mapping) -> bool:
  return STACK in node or any(layer_index(k) is not None for k in node)


def convert(tree: Mapping, source: StackPlan, target: StackPlan) -> dict:
  """`tree` with every layer stack in it, wherever it sits (each variable
  collection, optimizer moments), moved from the layout of `source` to
  that of `target` (which plan the same number of layers)."""
  if source.num_layers != target.num_layers:
    raise ValueError(
        f"Cannot convert a stack of {source.num_layers} layers to one of "
        f"{target.num_layers}."
    )

  def walk(node, where):
    if not isinstance(node, Mapping):
      return node
    if _holds_layers(node):
      return _stack(_split(node, source, where), target, where)
    return {k: walk(v, f"{where}/{k}") for k, v in node.items()}

  return walk(tree, "tree")


def to_unrolled(tree: Mapping, plan: StackPlan) -> dict:
  """`convert` from `plan`'s layout to the unrolled one."""
  return convert(tree, plan, StackPlan.unrolled(plan.num_layers))


def to_scanned(tree: Mapping, plan: StackPlan) -> dict:
  """`convert` from the unrolled layout to `plan`'s."""
  return convert(tree, StackPlan.unrolled(plan.num_layers), plan)


def layer_rows(path: Path, plan: StackPlan) -> tuple[int, ...] | None:
  """The layers a leaf at `path` belongs to: (i,) under `layers_{i}`, the
  stacked layers in row order under the stack (its member's), None for a
  leaf outside the layers."""
  for k, part in enumerate(path):
    i = layer_index(part)
    if i is not None:
      return (i,)
    if part == STACK:
      j = 0
      if plan.period > 1 and k + 1 < len(path):
        j = member_index(path[k + 1]) or 0
      return tuple(plan.layer(r, j) for r in range(plan.repeats))
  return None


def plan_of_tree(flat: Mapping[Path, Any]) -> StackPlan | None:
  """The plan a tree is laid out in, read off its paths (flat, `path ->
  leaf` with a `.shape`): None when no path holds a layer. The layers
  outside the stack must be every layer but the stack's."""
  unrolled, repeats, members = set(), None, set()
  for path, leaf in flat.items():
    for k, part in enumerate(path):
      i = layer_index(part)
      if i is not None:
        unrolled.add(i)
        break
      if part == STACK:
        repeats = leaf.shape[0]
        if k + 1 < len(path) and member_index(path[k + 1]) is not None:
          members.add(member_index(path[k + 1]))
        break
  if repeats is None and not unrolled:
    return None
  if repeats is None:
    n = max(unrolled) + 1
    plan = StackPlan.unrolled(n)
  else:
    period = max(members) + 1 if members else 1
    start = next(i for i in range(len(unrolled) + 1) if i not in unrolled)
    n = len(unrolled) + period * repeats
    plan = StackPlan(n, start, period, repeats)
  expected = set(plan.before + plan.after)
  if unrolled != expected:
    raise ValueError(
        f"The tree's unrolled layers {sorted(unrolled)} do not fit a stack "
        f"of {n} layers ({plan}); expected {sorted(expected)}."
    )
  return plan
