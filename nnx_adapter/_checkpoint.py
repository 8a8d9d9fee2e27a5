"""The NNX `TrainState` as a `linen_moe.checkpoint` tree, and back.

The model's variables go to `variables/<collection>/<path>`: the collection
is the Linen name of the variable's type (`nnx.Param` -> `params`,
`Fp8State` -> `_overwrite_with_gradient`) and the path is the Linen variable
path, which the NNX state path equals. The optimizer's `opt_state` and its
other fields (`step`) go to the top level, as the Linen `TrainState`'s
fields do; so does any other field of the `TrainState`. The mapping is leaf
by leaf over whatever the state holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from linen_moe import frontend
from nnx_adapter._train_state import TrainState

Path = tuple[str, ...]

MODEL, OPTIMIZER = 0, 1  # TrainState.state holds (model, optimizer)


def _path_fn(state: TrainState) -> Callable[[Path], Path]:
  """Checkpoint-tree path of each leaf of `state`, from its path in the
  state (the names of its jax key path's entries)."""
  model = nnx.to_flat_state(state.state[MODEL])
  collections = {
      tuple(map(str, path)): nnx.variable_name_from_type(type(variable))
      for path, variable in model
  }

  def path_of(names: Path) -> Path:
    raw = list(names)
    if raw[0] != "state":  # another TrainState field
      return tuple(raw)
    if raw[-1] == "value":  # a Variable's payload
      raw = raw[:-1]
    owner, *path = raw[1:]
    if owner == str(MODEL):
      return (frontend.VARIABLES, collections[tuple(path)], *path)
    return tuple(path)  # optimizer fields: step, opt_state/...

  return path_of


def tree_of(state: TrainState) -> dict:
  """The checkpoint tree of an NNX `TrainState` (arrays or abstract).

  Args:
    state: an `nnx_adapter.TrainState`, of arrays or ShapeDtypeStructs.

  Returns:
    The checkpoint tree a Linen state of that model gives too,
    ``{"variables": {collection: {path...}}, "step": ..., "opt_state": ...}``
    and any other field.
  """
  return frontend.tree_of(state, _path_fn(state))


def state_from(tree: Any, template: TrainState) -> TrainState:
  """`template` with every leaf from the checkpoint tree `tree`.

  Args:
    tree: a checkpoint tree (e.g. `Restored.tree`) in `template`'s layout.
    template: an `nnx_adapter.TrainState` giving the structure.

  Returns:
    A `TrainState` like `template` holding `tree`'s leaves.
  """
  return frontend.state_from(tree, template, _path_fn(template))
