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

from linen_moe._src.layer.jit_init import jit_once
from linen_moe._src.parallel import sharding
from linen_moe._src.training import step as train_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedRun:
  """Sharded init and jitted step on `self.mesh`, for any front end.

  A subclass (a frozen dataclass) adds its positional fields, `mesh` among
  them, and the hooks `_initial_state` (the init, with partitioning
  metadata), `_shardings_of` (its NamedShardings, from an abstract state),
  `_plain` (metadata stripped) and `_train_step` (a pure
  `step(state, tokens, rng, mask=None)`).

  Attributes:
    rules: logical-name -> mesh-axes rule table (keyword-only).
    grad_accum: microbatches per step (keyword-only).
  """

  rules: sharding.Rules = sharding.DEFAULT_RULES
  grad_accum: int = 1
  _cache: dict = dataclasses.field(
      default_factory=dict, init=False, repr=False, compare=False
  )

  def _initial_state(self, tokens, rng):
    raise NotImplementedError

  def _shardings_of(self, abstract_state):
    raise NotImplementedError

  def _plain(self, state):
    return state

  def _train_step(self):
    raise NotImplementedError

  def context(self):
    """The mesh and rules of this run, made current (`sharding.mesh_context`).

    Returns:
      A context manager.
    """
    return sharding.mesh_context(self.mesh, self.rules)

  def token_sharding(self) -> jax.sharding.NamedSharding:
    """The sharding of <int32>[B, S] tokens: batch on the batch axes.

    Returns:
      The `NamedSharding` of ("activation_batch", "activation_length").
    """
    names = ("activation_batch", "activation_length")
    return sharding.named(self.mesh, names, self.rules)

  def _abstract(self, tokens, rng):
    with self.context():
      return jax.eval_shape(self._initial_state, tokens, rng)

  def state_shardings(self, tokens: Any, rng: jax.Array) -> Any:
    """NamedShardings of the train state, from an abstract (eval_shape) init.

    Args:
      tokens: <int32>[B, S] sample tokens (only their shape and dtype count).
      rng: a PRNG key (likewise).

    Returns:
      A `NamedSharding` per leaf, in the structure of the (unboxed) state.
    """
    abstract = self._abstract(tokens, rng)
    with self.context():
      return self._shardings_of(abstract)

  def abstract_state(self, tokens: Any, rng: jax.Array) -> Any:
    """The state as sharded ShapeDtypeStructs, with nothing allocated.

    It is the target a checkpoint restores into.

    Args:
      tokens: <int32>[B, S] sample tokens (only their shape and dtype count).
      rng: a PRNG key (likewise).

    Returns:
      The state's structure with a `ShapeDtypeStruct` (with `sharding`) per
      leaf.
    """
    abstract = self._abstract(tokens, rng)
    with self.context():
      shardings = jax.tree.leaves(self._shardings_of(abstract))
    plain = self._plain(abstract)
    leaves = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for x, s in zip(jax.tree.leaves(plain), shardings, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(plain), leaves)

  def init(self, tokens: Any, rng: jax.Array):
    """The initial state, created directly in its shardings.

    The jitted init returns the state's leaves (static parts of a state, such
    as an NNX graph definition, need not compare equal between two traces)
    and they are put back into the abstract state's structure.

    Args:
      tokens: <int32>[B, S] sample tokens the model is initialised with.
      rng: the PRNG key of the initialisers.

    Returns:
      The front end's train state, each leaf in its sharding.
    """
    abstract = self._abstract(tokens, rng)
    with self.context():
      shardings = jax.tree.leaves(self._shardings_of(abstract))
    init = jit_once(
        lambda t, r: jax.tree.leaves(self._plain(self._initial_state(t, r))),
        in_shardings=(self.token_sharding(), sharding.replicated(self.mesh)),
        out_shardings=shardings,
    )
    with self.context():
      leaves = init(tokens, rng)
    return jax.tree.unflatten(jax.tree.structure(self._plain(abstract)), leaves)

  def place(self, state, tokens: Any, rng: jax.Array):
    """An existing state (e.g. restored on the host) put into its shardings.

    Args:
      state: a train state of this run's structure (unboxed).
      tokens: <int32>[B, S] sample tokens (only their shape and dtype count).
      rng: a PRNG key (likewise).

    Returns:
      `state` with every leaf `jax.device_put` into its sharding.
    """
    shardings = jax.tree.leaves(self.state_shardings(tokens, rng))
    leaves = jax.tree.leaves(state)
    return jax.tree.unflatten(
        jax.tree.structure(state),
        [jax.device_put(x, s) for x, s in zip(leaves, shardings, strict=True)],
    )

  def _jitted_step(self, state, extras: int = 0):
    """The jitted step, built once with the shardings of the first state;
    `extras`: how many of (mask, segment_ids, positions) it takes (each a
    further argument sharded like the tokens; None where not given), 0 the
    step exactly without them."""
    key = ("step", extras)
    if key not in self._cache:
      shardings = jax.tree.map(lambda x: x.sharding, state)
      in_shardings = (
          shardings,
          self.token_sharding(),
          sharding.replicated(self.mesh),
      ) + (self.token_sharding(),) * extras
      self._cache[key] = jax.jit(
          self._train_step(),
          in_shardings=in_shardings,
          out_shardings=(shardings, sharding.replicated(self.mesh)),
          donate_argnums=0,
      )
    return self._cache[key]

  def _args(self, state, tokens, rng, *extras):
    extras = list(extras)
    while extras and extras[-1] is None:
      extras.pop()
    return (state, tokens, rng, *extras)

  def step(
      self, state, tokens, rng, mask=None, segment_ids=None, positions=None
  ):
    """One jitted step; the state keeps its shardings (and is donated).

    The step is compiled on the first call, for the first state's
    shardings (once for each set of the optional arguments given).

    Args:
      state: the train state, in the shardings of `init` / `place`; donated.
      tokens: <int32>[B, S] the batch (B divisible by `grad_accum`).
      rng: the step's PRNG key.
      mask: <bool>[B, S] True at real ids, in `token_sharding()`; the loss
        counts only real targets (None: every position counts).
      segment_ids: <int32>[B, S] packed documents (0 = padding), in
        `token_sharding()`, or None.
      positions: <int32>[B, S] positions, in `token_sharding()`, or None
        (restarting at 0 in each segment).

    Returns:
      A pair (new state, metrics); the metrics (loss terms, `expert_load`
      [L, E], `skipped`, `skipped_steps`) are replicated.
    """
    args = self._args(state, tokens, rng, mask, segment_ids, positions)
    with self.context():
      return self._jitted_step(state, len(args) - 3)(*args)

  def lower(
      self, state, tokens, rng, mask=None, segment_ids=None, positions=None
  ) -> jax.stages.Lowered:
    """The lowered step (`.compile().as_text()` for its HLO).

    Args:
      state: the train state (or sharded ShapeDtypeStructs of it).
      tokens: <int32>[B, S] the batch.
      rng: a PRNG key.
      mask: <bool>[B, S] a loss mask, or None (see `step`).
      segment_ids: <int32>[B, S] or None (see `step`).
      positions: <int32>[B, S] or None (see `step`).

    Returns:
      The `jax.stages.Lowered` step; its compiled form takes the same
      arguments.
    """
    args = self._args(state, tokens, rng, mask, segment_ids, positions)
    with self.context():
      return self._jitted_step(state, len(args) - 3).lower(*args)


@dataclasses.dataclass(frozen=True)
class ShardedTraining(ShardedRun):
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
    rules: logical-name -> mesh-axes rule table (keyword-only).
    grad_accum: microbatches per step (keyword-only).
  """

  model: nn.Module
  optimizer: optax.GradientTransformation
  mesh: Mesh

  def _initial_state(self, tokens, rng):
    return train_lib.boxed_train_state(self.model, self.optimizer, tokens, rng)

  def _shardings_of(self, abstract_state):
    return sharding.logical_shardings(abstract_state, self.mesh, self.rules)

  def _plain(self, state):
    return sharding.unbox(state)

  def _train_step(self):
    return train_lib.make_train_step(
        self.model, self.optimizer, self.grad_accum
    )
