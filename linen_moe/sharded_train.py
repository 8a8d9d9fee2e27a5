"""Training the Linen reference decoder on a device mesh.

The state is sharded *at* initialisation: the shardings come from the logical
axis names of `jax.eval_shape` of the boxed initial state (parameters and the
optimizer moments that mirror them), and the init itself is jitted with those
`out_shardings`, so no array is ever materialised whole on one device. fp8
state has no names and is replicated. The step is jitted with the same
shardings in and out, and traced under the mesh and the rules, so activation
constraints and the sparse path's expert parallelism apply.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh
import optax

from linen_moe import sharding
from linen_moe import train as train_lib


@dataclasses.dataclass(frozen=True)
class ShardedTraining:
  """Sharded init and train step of a Linen `Decoder` on `mesh`.

  Example usage:
    mesh = sharding.make_mesh("data=2,expert=4")
    run = ShardedTraining(Decoder(cfg), optimizer, mesh)
    state = run.init(tokens, jax.random.key(0))
    state, metrics = run.step(state, tokens, jax.random.key(1))

  Attributes:
    model: the Linen decoder.
    optimizer: the optax optimizer.
    mesh: a mesh over `sharding.MESH_AXES` (see `sharding.make_mesh`).
    rules: logical-name -> mesh-axes rule table.
    grad_accum: microbatches per step.
  """

  model: nn.Module
  optimizer: optax.GradientTransformation
  mesh: Mesh
  rules: sharding.Rules = sharding.DEFAULT_RULES
  grad_accum: int = 1
  _cache: dict = dataclasses.field(
      default_factory=dict, init=False, repr=False, compare=False
  )

  def context(self):
    return sharding.mesh_context(self.mesh, self.rules)

  def token_sharding(self) -> jax.sharding.NamedSharding:
    """<int32>[B, S] tokens: batch on the batch axes."""
    names = ("activation_batch", "activation_length")
    return sharding.named(self.mesh, names, self.rules)

  def state_shardings(self, tokens: Any, rng: jax.Array) -> Any:
    """NamedShardings of the `TrainState`, from an abstract (eval_shape) init."""
    with self.context():
      abstract = jax.eval_shape(self._boxed_init, tokens, rng)
    return sharding.logical_shardings(abstract, self.mesh, self.rules)

  def _boxed_init(self, tokens, rng):
    return train_lib.boxed_train_state(self.model, self.optimizer, tokens, rng)

  def init(self, tokens: Any, rng: jax.Array) -> train_lib.TrainState:
    """The initial state, created directly in its shardings."""
    shardings = self.state_shardings(tokens, rng)
    init = jax.jit(
        lambda t, r: sharding.unbox(self._boxed_init(t, r)),
        in_shardings=(self.token_sharding(), sharding.replicated(self.mesh)),
        out_shardings=shardings,
    )
    with self.context():
      return init(tokens, rng)

  def _jitted_step(self, state):
    """The jitted step, built once with the shardings of the first state."""
    if "step" not in self._cache:
      shardings = jax.tree.map(lambda x: x.sharding, state)
      step = train_lib.make_train_step(
          self.model, self.optimizer, self.grad_accum
      )
      self._cache["step"] = jax.jit(
          step,
          in_shardings=(
              shardings,
              self.token_sharding(),
              sharding.replicated(self.mesh),
          ),
          out_shardings=(shardings, sharding.replicated(self.mesh)),
          donate_argnums=0,
      )
    return self._cache["step"]

  def step(self, state, tokens, rng):
    """One jitted step; the state keeps its shardings (and is donated)."""
    with self.context():
      return self._jitted_step(state)(state, tokens, rng)

  def lower(self, state, tokens, rng) -> jax.stages.Lowered:
    """The lowered step (`.compile().as_text()` for its HLO)."""
    with self.context():
      return self._jitted_step(state).lower(state, tokens, rng)
