"""The NNX train state: the model and its optimizer as one pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
import flax.struct
import jax
import jax.numpy as jnp

from linen_moe.variables import OVERWRITE_WITH_GRADIENT
from linen_moe.variables import UPDATED_BY_RULE
from nnx_adapter._decoder import Decoder
from nnx_adapter._decoder import nnx_to_linen

PyTree = Any


@flax.struct.dataclass
class TrainState:
  """The NNX model and its optimizer as one pytree, for `jax.jit`.

  `params` and `fp8_state` read like the Linen `TrainState`'s: Linen-layout
  trees (`{"layers": {"moe": {"wi_0": ...}}}`), so one check serves both.
  So do the properties `step` (<int32>[], from the optimizer) and
  `rule_state` (the routed biases).

  Attributes:
    graphdef: the `nnx.GraphDef` of `(Decoder, nnx.Optimizer)`, static (not
      a pytree leaf).
    state: the `nnx.State` of `(Decoder, nnx.Optimizer)`: parameters, fp8
      state, routed biases, optimizer moments and step.
    skipped_steps: <int32>[] steps skipped for a non-finite loss or gradient.
  """

  graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
  state: nnx.State
  skipped_steps: jax.Array = dataclasses.field(
      default_factory=lambda: jnp.zeros((), jnp.int32)
  )

  def merge(self) -> tuple[Decoder, nnx.Optimizer]:
    """The live model and optimizer of this state.

    Returns:
      `(model, optimizer)`, a new `Decoder` and its `nnx.Optimizer` built
      from `graphdef` and `state`; changing them leaves this state as it is.
    """
    return nnx.merge(self.graphdef, self.state)

  @property
  def step(self) -> jax.Array:
    return self.merge()[1].step.get_value()

  @property
  def params(self) -> PyTree:
    return nnx_to_linen(self.merge()[0]).get("params", {})

  @property
  def fp8_state(self) -> PyTree:
    return nnx_to_linen(self.merge()[0]).get(OVERWRITE_WITH_GRADIENT, {})

  @property
  def rule_state(self) -> PyTree:
    return nnx_to_linen(self.merge()[0]).get(UPDATED_BY_RULE, {})
