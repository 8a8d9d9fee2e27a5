"""A decoder's layer stack moved between its scanned and unrolled forms.

The names and the `StackPlan` that say where each layer sits are
`linen_moe._src.config.stack_plan`; here, whole trees move from one plan's
layout to another's (`convert`, `to_unrolled`, `to_scanned`), and a tree's
plan is read off its paths (`plan_of_tree`), so code that converts trees
needs no decoder. This module knows no decoder and no collection: it moves
subtrees by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from linen_moe._src.config.stack_plan import STACK
from linen_moe._src.config.stack_plan import Path
from linen_moe._src.config.stack_plan import StackPlan
from linen_moe._src.config.stack_plan import layer_index
from linen_moe._src.config.stack_plan import layer_name
from linen_moe._src.config.stack_plan import member_index
from linen_moe._src.config.stack_plan import member_name


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
