"""Training the NNX decoder on a device mesh, through NNX sharding metadata.

The Linen layers' logical axis names arrive as each `nnx.Variable`'s
`out_sharding` (the bridge converts Flax partitioning boxes), with "layers"
in front for the stacked blocks (`nnx.vmap`/`nnx.scan` `transform_metadata`).
Under the rule table, `nnx.get_partition_spec` maps them to mesh axes; the
init is jitted with those `out_shardings` (optimizer moments included), and
the step runs with the same shardings under the mesh and the rules, like the
Linen `ShardedTraining` (the shared machinery is `ShardedRun`).
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import optax

from linen_moe import ModelConfig
from linen_moe.frontend import ShardedRun
from nnx_adapter._train import init_train_state
from nnx_adapter._train import make_train_step


@dataclasses.dataclass(frozen=True)
class ShardedNNXTraining(ShardedRun):
  """Sharded init and train step of the NNX `Decoder` on `mesh`.

  Example usage:
    run = ShardedNNXTraining(cfg, optimizer, sharding.make_mesh("expert=8"))
    state = run.init(tokens, jax.random.key(0))    # an nnx_adapter.TrainState
    state, metrics = run.step(state, tokens, jax.random.key(1))

  Attributes:
    config: the decoder's `ModelConfig`.
    optimizer: the optax optimizer.
    mesh: a mesh over `sharding.MESH_AXES` (see `sharding.make_mesh`).
    rules: logical-name -> mesh-axes rule table (keyword-only).
    grad_accum: microbatches per step (keyword-only).
  """

  config: ModelConfig
  optimizer: optax.GradientTransformation
  mesh: Mesh

  def _initial_state(self, tokens, rng):
    return init_train_state(self.config, self.optimizer, tokens, rng)

  def _shardings_of(self, abstract_state):
    specs = nnx.get_partition_spec(abstract_state)  # mapped by the rules
    return jax.tree.map(
        lambda spec: NamedSharding(self.mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )

  def _train_step(self):
    return make_train_step(self.grad_accum)
