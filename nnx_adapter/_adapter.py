"""`EagerToNNX`: a Linen module of this library as an `nnx.Module`."""

from __future__ import annotations

from typing import Any
import warnings

from flax import nnx
import flax.linen as nn
from flax.nnx.bridge import variables as bridge_variables
import jax

from linen_moe.frontend import compiled_init
from linen_moe.variables import CACHE
from linen_moe.variables import OVERWRITE_WITH_GRADIENT
from linen_moe.variables import UPDATED_BY_RULE


class Fp8State(nnx.Variable):
  """fp8 scales and amax histories: the Linen `_overwrite_with_gradient`
  collection. Differentiate with respect to it and write the "gradient" back
  as the new value (`linen_moe.training.overwrite_with_gradient`); never give it
  to an optimizer."""


class RuleState(nnx.Variable):
  """State a rule moves after each optimizer step (the selection-only
  `routed_bias`): the Linen `updated_by_rule` collection. Neither
  differentiated nor given to an optimizer."""


class Cache(nnx.Variable):
  """A decoding decoder's KV cache and its token count: the Linen `cache`
  collection. Written by every decoding call; never trained or saved."""


GUIDE = "docs/guides/quantization.md"
WARNING = (
    "nnx_adapter: this step differentiates the parameters but not the fp8 "
    "state (Fp8State: the fp8 scales and amax histories), so the scales never "
    "update. Differentiate with nnx_adapter.value_and_grad(loss_fn), a "
    "drop-in for nnx.value_and_grad that also writes the new fp8 state into "
    f"the model, or train with nnx_adapter.train_step; see {GUIDE}."
)


def _tracer_types(module: nnx.Module, variable_type: Any) -> set[type]:
  leaves = jax.tree.leaves(nnx.state(module, variable_type))
  return {type(x) for x in leaves if isinstance(x, jax.core.Tracer)}


def warn_if_fp8_frozen(module: nnx.Module) -> None:
  """Warns (`WARNING`) when `module` holds fp8 state and is being
  differentiated with respect to its parameters but not its fp8 state:
  some `nnx.Param` is a tracer of a kind no `Fp8State` leaf is (jax.grad
  traces what it differentiates with its own tracers). Called when a
  module is traced, so a jitted step warns once, on its first call."""
  fp8 = jax.tree.leaves(nnx.state(module, Fp8State))
  if not fp8:
    return
  fp8_types = {type(x) for x in fp8}
  if _tracer_types(module, nnx.Param) - fp8_types:
    warnings.warn(WARNING, UserWarning, stacklevel=3)


# The bridge maps Linen collections to NNX variable types through this
# registry, in both directions (ToNNX on the way in, on the way out).
nnx.register_variable_name(OVERWRITE_WITH_GRADIENT, Fp8State, overwrite=True)
nnx.register_variable_name(UPDATED_BY_RULE, RuleState, overwrite=True)
nnx.register_variable_name(CACHE, Cache, overwrite=True)


class EagerToNNX(nnx.bridge.ToNNX):
  """`nnx.bridge.ToNNX` that creates all of its state at construction.

  Plain `ToNNX` holds no variables until `nnx.bridge.lazy_init` has run it
  once. Done lazily, on first use, that may be inside `nnx.scan`, `nnx.vmap`,
  `jax.jit` or any other trace, and the module graph then grows under the
  trace: variables are born as tracers, per iteration instead of stacked, or
  not at all outside the trace. So this wrapper runs `lazy_init` here,
  eagerly, on sample inputs: params, fp8 scales and amax histories
  (`Fp8State`), and anything else the Linen module keeps all exist before the
  module is first used. Construct it outside the layer
  loop, or inside an `nnx.vmap`-ed constructor (with `nnx.split_rngs`) to get
  a stacked layer for `nnx.scan`.

  Calls never create variables: they apply the Linen module with nothing
  mutable, so a call that would need a new variable (another input width, say)
  fails in Linen instead of changing the graph.

  Randomness at apply time (AQT int8 stochastic rounding reads the `params`
  stream) comes from each call's `rngs=` (a key, which feeds `params`, or an
  `nnx.Rngs` with one stream per Linen RNG name). The `rngs` given here are
  used for initialisation only and not kept.

  Example usage:
    cfg = load_moe_config("tiny_mixtral", quantization="fp8")
    x = jnp.zeros((1, 8, cfg.emb_dim))                   # [B, S, M] sample
    moe = EagerToNNX(RoutedMoE(cfg), x, rngs=nnx.Rngs(0))
    y, aux = moe(x, rngs=jax.random.key(1))              # y: [B, S, M]
    fp8_state = nnx.state(moe, Fp8State)

  Args:
    module: the Linen module to wrap (e.g. a `RoutedMoE`).
    *sample_args: sample inputs it is initialised with, e.g. [B, S, M];
      only their shapes and dtypes matter.
    rngs: the initialisation keys: an `nnx.Rngs` (its `default` stream feeds
      `params`) or a key (which feeds `params`).
    **sample_kwargs: sample keyword inputs.
  """

  def __init__(
      self,
      module: nn.Module,
      *sample_args: Any,
      rngs: nnx.Rngs | jax.Array,
      **sample_kwargs: Any,
  ):
    # Linen's logical axis names become each Variable's `out_sharding`. They
    # are not applied at creation (that needs a mesh and rules in context);
    # sharded training places the state with them (`ShardedNNXTraining`).
    with nnx.use_eager_sharding(False):
      super().__init__(module, rngs=rngs)
      # What `nnx.bridge.lazy_init` does, with Linen's init compiled once
      # (`compiled_init`) instead of run op by op.
      variables = compiled_init(
          module, _linen_rngs(self.to_nnx__rngs), *sample_args, **sample_kwargs
      )
      for name, value in bridge_variables.linen_vars_to_nnx_attrs(
          variables
      ).items():
        setattr(self, name, nnx.data(value))
    self.to_nnx__rngs = None

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Applies the Linen module, as `nnx.bridge.ToNNX` does.

    Args:
      *args: its inputs.
      **kwargs: its keyword inputs, and `ToNNX`'s (`rngs`, `method`,
        `mutable`).

    Returns:
      What the Linen module returns.

    Warns (`UserWarning`, once per traced step) when the parameters are
    differentiated and the fp8 state is not: a training loop of one's own
    that never updates the fp8 scales (`nnx_adapter.value_and_grad`).
    """
    warn_if_fp8_frozen(self)
    return super().__call__(*args, **kwargs)


def _linen_rngs(rngs: nnx.Rngs | None) -> dict[str, jax.Array]:
  """One key per stream, as `nnx.bridge.ToNNX` gives Linen (the `default`
  stream feeds `params`)."""
  if rngs is None:
    return {}
  keys = {name: stream() for name, stream in rngs.items()}
  if "params" not in keys and "default" in keys:
    keys["params"] = keys.pop("default")
  return keys
