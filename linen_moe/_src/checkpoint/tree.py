"""The checkpoint tree: a train state's arrays in the Linen variable layout.

`variables/<collection>/<path>` holds the Linen variables (what
`Decoder.apply` takes); every other field of a train state (`step`,
`opt_state`, ...) sits beside it under its own name. `tree_of`/`state_from`
map a state to the tree and back leaf by leaf, through a function from each
leaf's jax key path to its tree path (`linen_path` for the Linen
`TrainState`; `nnx_adapter` has the NNX one). `relayout` converts the layer
stacks of a tree between the scanned and the unrolled decoder; where each
layer sits is `linen_moe._src.models.layer_stack`'s knowledge (the decoders lay
their stacks out with it), read off the trees themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from linen_moe._src.config import stack_plan
from linen_moe._src.config.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.config.variables import PARAMS
from linen_moe._src.config.variables import STATE_COLLECTIONS
from linen_moe._src.config.variables import UPDATED_BY_RULE
from linen_moe._src.models import layer_stack

PyTree = Any
Path = tuple[str, ...]

VARIABLES = "variables"
FP8_PREFIX = (VARIABLES, OVERWRITE_WITH_GRADIENT)
# Linen TrainState fields holding a collection under another name. A field
# named after a collection (`params`, `variables.STATE_COLLECTIONS`) holds it.
LINEN_FIELD_ALIASES = {
    "fp8_state": OVERWRITE_WITH_GRADIENT,
    "rule_state": UPDATED_BY_RULE,
}


def key_name(key: Any) -> str:
  """The name of one entry of a jax key path.

  Args:
    key: a `jax.tree_util` key (`DictKey`, `GetAttrKey`, `SequenceKey`,
      `FlattenedIndexKey`) or anything else.

  Returns:
    Its key, attribute name or index as a string (`str(key)` otherwise).
  """
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _names(key_path: tuple) -> Path:
  return tuple(key_name(k) for k in key_path)


def linen_path(path: Path) -> Path:
  """Checkpoint-tree path of a leaf of a Linen `TrainState`.

  Fields holding a collection (`params`, `fp8_state`, `rule_state`) go under
  `variables/<collection>`; every other field keeps its name.

  Args:
    path: the leaf's path in the state, its keys' names (`key_name`).

  Returns:
    The path tuple of strings, e.g. ("variables", "params", "embed",
    "embedding") or ("opt_state", ...).
  """
  collection = LINEN_FIELD_ALIASES.get(path[0], path[0])
  if collection == PARAMS or collection in STATE_COLLECTIONS:
    return (VARIABLES, collection, *path[1:])
  return path


def _counter_dtype(leaf: Any) -> Any:
  """Scalar integer counters (a step) are int32 in the tree whatever each
  front end counts in (NNX's optimizer step is uint32)."""
  if len(leaf.shape) == 0 and jnp.issubdtype(leaf.dtype, jnp.integer):
    return jnp.dtype(jnp.int32)
  return leaf.dtype


def _as_dtype(leaf: Any, dtype: Any) -> Any:
  if leaf.dtype == dtype:
    return leaf
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
  return leaf.astype(dtype)


def tree_of(
    state: PyTree, path_of: Callable[[Path], Path] = linen_path
) -> dict:
  """The checkpoint tree of a train state (of arrays or ShapeDtypeStructs).

  Args:
    state: the train state.
    path_of: a leaf's path in the state (the names of its jax key path's
      entries, `key_name`) -> its tree path; default `linen_path`, for a
      Linen `TrainState`.

  Returns:
    The nested tree with every leaf at `path_of(its key path)`; scalar
    integer counters (a step) as int32.

  Raises:
    ValueError: if two leaves map to one path.
  """
  flat: dict[Path, Any] = {}
  for key_path, leaf in jax.tree_util.tree_leaves_with_path(state):
    path = path_of(_names(key_path))
    if path in flat:
      raise ValueError(f"Two leaves of the state map to {'/'.join(path)}.")
    flat[path] = _as_dtype(leaf, _counter_dtype(leaf))
  return traverse_util.unflatten_dict(flat)


def state_from(
    tree: Mapping,
    template: PyTree,
    path_of: Callable[[Path], Path] = linen_path,
) -> PyTree:
  """`template` with every leaf from the checkpoint tree (`tree_of`'s inverse).

  Args:
    tree: a checkpoint tree, e.g. `Restored.tree`.
    template: a train state giving the structure and dtypes.
    path_of: as in `tree_of`.

  Returns:
    A state like `template`, each leaf from `tree` cast to the template's
    dtype.

  Raises:
    ValueError: if a leaf of the template is not in `tree`, or `tree` holds
      a leaf the template has none of.
  """
  flat = traverse_util.flatten_dict(dict(tree))
  missing = []

  def leaf(key_path, old):
    path = path_of(_names(key_path))
    if path not in flat:
      missing.append("/".join(path))
      return old
    return _as_dtype(flat.pop(path), old.dtype)

  state = jax.tree_util.tree_map_with_path(leaf, template)
  if missing or flat:
    raise ValueError(
        f"Checkpoint tree does not fit the state: missing {missing[:5]}, "
        f"unused {['/'.join(p) for p in sorted(flat)][:5]}."
    )
  return state


def abstract(tree: PyTree) -> PyTree:
  """The `jax.ShapeDtypeStruct` (shape, dtype, sharding) of each leaf.

  Args:
    tree: a pytree of arrays or abstract values.

  Returns:
    The same structure of ShapeDtypeStructs; a leaf without a sharding gets
    the default device's.
  """
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def one(x):
    sharding = getattr(x, "sharding", None) or default
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(one, tree)


def layer_plan(flat: Mapping[Path, Any]) -> stack_plan.StackPlan | None:
  """The layer stack plan a flat tree (`path -> leaf with .shape`) is laid
  out in (`layer_stack.plan_of_tree`), None when it holds no layer."""
  return layer_stack.plan_of_tree(flat)


def relayout(
    tree: Mapping,
    scanned: bool,
    num_layers: int | stack_plan.StackPlan,
) -> dict:
  """`tree` with every decoder layer stack converted, wherever it sits.

  Variables and optimizer moments alike; the tree's own layout, read off
  it, may be either.

  Args:
    tree: a checkpoint tree, variables or any tree holding layers.
    scanned: stack the layers as the plan says, else unroll them.
    num_layers: the plan (`ModelConfig.stack_plan` of the scanned decoder)
      or a layer count, for one stack of every layer.

  Returns:
    A new tree in the target layout (`tree` copied when it holds no layer).

  Raises:
    ValueError: if `num_layers` is not a count >= 0, the tree's layers do
      not form a layout of a stack (`layer_stack.plan_of_tree`), or hold
      another number of layers than the plan.
  """
  plan = num_layers
  if not isinstance(plan, stack_plan.StackPlan):
    plan = stack_plan.StackPlan.uniform(num_layers)
  source = layer_plan(traverse_util.flatten_dict(dict(tree)))
  if source is None:
    return dict(tree)
  if scanned:
    return layer_stack.convert(dict(tree), source, plan)
  return layer_stack.convert(
      dict(tree), source, stack_plan.StackPlan(plan.num_layers)
  )


def _restacked_sharding(sharding: Any, stacked: bool) -> Any:
  """The sharding of a layer stack from a layer's (`stacked`), or back: the
  layer axis is never split."""
  if not isinstance(sharding, NamedSharding):
    return sharding
  spec = tuple(sharding.spec)
  spec = (None, *spec) if stacked else spec[1:]
  return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def relayout_abstract(
    flat: dict, source: stack_plan.StackPlan, target: stack_plan.StackPlan
) -> dict:
  """Flat `ShapeDtypeStruct`s (with shardings) laid out as `source`, moved
  to the layout of `target` (`layer_stack.convert`); a layer moved into or
  out of a stack keeps its sharding, the stacked axis unsplit."""
  shapes = jax.eval_shape(
      lambda t: layer_stack.convert(t, source, target),
      traverse_util.unflatten_dict(flat),
  )
  # Any layer's leaf at the same path within its layer gives the sharding.
  by_inner: dict[Path, Any] = {}
  for path, leaf in flat.items():
    inner = _inner(path)
    if inner is not None:
      by_inner.setdefault(inner[0], (leaf, inner[1]))
  out = {}
  for path, shape in traverse_util.flatten_dict(shapes).items():
    inner = _inner(path)
    sharding = flat[path].sharding if path in flat else None
    if sharding is None and inner is not None:
      leaf, was_stacked = by_inner[inner[0]]
      sharding = leaf.sharding
      if was_stacked != inner[1]:
        sharding = _restacked_sharding(sharding, stacked=inner[1])
    out[path] = jax.ShapeDtypeStruct(
        shape.shape, shape.dtype, sharding=sharding
    )
  return out


def _inner(path: Path) -> tuple[Path, bool] | None:
  """(the path with its layer component removed, whether it is stacked)
  for a path inside a layer; None outside."""
  for j, part in enumerate(path):
    if stack_plan.layer_index(part) is not None:
      return (*path[:j], "<layer>", *path[j + 1 :]), False
    if part == stack_plan.STACK:
      rest = path[j + 1 :]
      if rest and stack_plan.member_index(rest[0]) is not None:
        rest = rest[1:]
      return (*path[:j], "<layer>", *rest), True
  return None
