"""The routed MoE layer (Linen `nn.compact`), its shared expert, and both paths.

Shapes: B batch, S sequence, M emb_dim, H moe_mlp_dim, E num_experts,
k num_experts_per_tok, C expert capacity, T = B * S tokens.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from linen_moe import expert_parallel
from linen_moe import routing
from linen_moe import sharding
from linen_moe import stored_weights
from linen_moe.config import MoEConfig
from linen_moe.quantization import Einsum
from linen_moe.quantization import contraction_modules

# Every contraction that touches an expert weight or a dispatch/combine mask
# goes through `RoutedMoE.contract` under one of these names.
CALL_SITES = ("wi_0", "wi_1", "wo", "dispatch", "combine")
# The call sites that contract an expert weight: a serving layer feeds them
# its stored kernels; the others (masks, routing weights) stay float.
WEIGHT_SITES = ("wi_0", "wi_1", "wo")

# Logical axis names of the dense paths' intermediates (see `sharding`): the
# expert axis on "activation_exp", the batch beside it on the other axes.
BSEH = (
    "activation_batch_no_exp",
    "activation_length",
    "activation_exp",
    "activation_mlp",
)
BSEM = BSEH[:3] + ("activation_embed",)
EBCH = ("activation_exp", "activation_batch_no_exp", None, "activation_mlp")
EBCM = EBCH[:3] + ("activation_embed",)

_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "linear": lambda x: x,
}


def activation(name: str):
  return _ACTIVATIONS[name]


@flax.struct.dataclass
class MoEAux:
  """Auxiliary outputs of `RoutedMoE`.

  Attributes:
    load_balance_loss: scalar, already multiplied by its config weight (0 when
      the weight is 0).
    expert_fraction: <float32>[E] share of routed assignments per expert.
    dropped_fraction: scalar share of the T*k assignments dropped by capacity
      (always 0 on dropless paths).
  """

  load_balance_loss: jax.Array
  expert_fraction: jax.Array
  dropped_fraction: jax.Array


def expert_capacity(config: MoEConfig, seq_len: int) -> int:
  """C, the per-sequence capacity of one expert on the dropping dense path."""
  c = math.ceil(
      config.capacity_factor
      * seq_len
      * config.num_experts_per_tok
      / config.num_experts
  )
  return max(1, min(seq_len, c))


def dispatch_mask(
    indices: jax.Array, num_experts: int, capacity: int
) -> jax.Array:
  """<float32>[B, S, k, E, C] one-hot slot of every kept assignment.

  `indices` is <int32>[B, S, k]. Within one sequence, assignments claim expert
  slots in this priority order: all first choices in token order, then all
  second choices in token order, and so on. Assignments past an expert's
  capacity C get an all-zero row (dropped).
  """
  b, s, k = indices.shape
  onehot = jax.nn.one_hot(indices, num_experts, dtype=jnp.int32)  # [B,S,k,E]
  by_priority = jnp.swapaxes(onehot, 1, 2).reshape(b, k * s, num_experts)
  position = jnp.cumsum(by_priority, axis=1) * by_priority - 1  # -1 = absent
  position = jnp.swapaxes(position.reshape(b, k, s, num_experts), 1, 2)
  # one_hot of -1 or >= capacity is all zeros: absent or dropped.
  return jax.nn.one_hot(position, capacity, dtype=jnp.float32)


class SharedExpert(nn.Module):
  """A plain gated MLP every token goes through: act(x wi_0) * (x wi_1) wo.

  Parameters: `wi_0` [M, F], `wi_1` [M, F], `wo` [F, M], with
  F = shared_experts * shared_mlp_dim.
  """

  config: MoEConfig

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    cfg = self.config
    width = cfg.shared_experts * cfg.shared_mlp_dim
    m, dt = cfg.emb_dim, cfg.compute_dtype
    x = inputs.astype(dt)
    act = activation(cfg.mlp_activations[0])
    names_in, names_out = ("embed", "mlp"), ("mlp", "embed")
    if cfg.serving:
      stored = functools.partial(stored_weights.stored_kernel, self, config=cfg)
      wi_0 = stored("wi_0", (m, width), names_in)
      wi_1 = stored("wi_1", (m, width), names_in)
      wo = stored("wo", (width, m), names_out)
      dot = lambda site, eqn, a, w: stored_weights.StoredEinsum(  # noqa: E731
          name=f"{site}_dot"
      )(eqn, a, w)
      hidden = act(dot("wi_0", "BSM,MF->BSF", x, wi_0))
      hidden = hidden * dot("wi_1", "BSM,MF->BSF", x, wi_1)
      return dot("wo", "BSF,FM->BSM", hidden, wo)
    init = nn.initializers.lecun_normal()
    w_in = nn.with_logical_partitioning(init, names_in)
    w_out = nn.with_logical_partitioning(init, names_out)
    wi_0 = self.param("wi_0", w_in, (m, width), cfg.param_dtype)
    wi_1 = self.param("wi_1", w_in, (m, width), cfg.param_dtype)
    wo = self.param("wo", w_out, (width, m), cfg.param_dtype)
    hidden = act(x @ wi_0.astype(dt))  # [B, S, F]
    hidden = hidden * (x @ wi_1.astype(dt))
    return hidden @ wo.astype(dt)  # [B, S, M]


class RoutedMoE(nn.Module):
  """Routed mixture of experts: top-k routing, gated experts, two paths.

  Example usage:
    cfg = load_config("tiny_mixtral")
    moe = RoutedMoE(cfg)
    variables = moe.init(jax.random.key(0), x)     # x: [B, S, emb_dim]
    y, aux = moe.apply(variables, x)

  Parameters (the public layout):
    gate/kernel [M, E], wi_0 [E, M, H] (activated branch), wi_1 [E, M, H]
    (linear branch), wo [E, H, M], per_expert_scale [E] (when enabled).

  Attributes:
    config: the `MoEConfig`.
  """

  config: MoEConfig

  def contract(
      self, site: str, *operands: Any, eqn: str | None = None
  ) -> jax.Array:
    """The one contraction hook, for every expert weight and mask.

    Creates the contraction submodule `{site}_dot` for this config's
    quantization; an einsum (`eqn` given) or a grouped matmul
    (`operands = (lhs, rhs, group_sizes)`).
    """
    if site not in CALL_SITES:
      raise ValueError(
          f"Unknown contraction call site {site!r}; registered call sites are "
          f"{CALL_SITES}."
      )
    cfg = self.config
    if cfg.serving:
      return self._serving_contract(site, *operands, eqn=eqn)
    modules = contraction_modules(
        cfg.quantization,
        implementation=cfg.grouped_matmul,
        amax_history_length=cfg.fp8_amax_history_length,
    )
    if eqn is not None:
      module = modules.einsum(name=f"{site}_dot", **modules.einsum_kwargs)
      return module(eqn, *operands)
    module = modules.grouped_matmul(
        name=f"{site}_dot", **modules.grouped_kwargs
    )
    return module(*operands)

  def _serving_contract(self, site, *operands, eqn=None):
    """Weight sites read the stored kernels; masks and routing weights stay
    float (plain einsums), so every path computes the same expert math."""
    if site not in WEIGHT_SITES:
      return Einsum(name=f"{site}_dot")(eqn, *operands)
    if eqn is not None:
      return stored_weights.StoredEinsum(name=f"{site}_dot")(eqn, *operands)
    module = stored_weights.StoredGroupedMatmul(
        self.config.grouped_matmul, name=f"{site}_dot"
    )
    return module(*operands)

  @nn.compact
  def __call__(
      self, inputs: jax.Array, gate_inputs: jax.Array | None = None
  ) -> tuple[jax.Array, MoEAux]:
    """[B, S, M] -> ([B, S, M], MoEAux). The router reads `gate_inputs`
    ([B, S, M]) when given, else `inputs`."""
    cfg = self.config
    if inputs.ndim != 3 or inputs.shape[-1] != cfg.emb_dim:
      raise ValueError(
          f"RoutedMoE expects inputs [batch, seq, emb_dim={cfg.emb_dim}]; got "
          f"shape {inputs.shape}."
      )
    if gate_inputs is not None and gate_inputs.shape != inputs.shape:
      raise ValueError(
          f"gate_inputs must have the shape of inputs {inputs.shape}; got "
          f"{gate_inputs.shape}."
      )
    b, s, m = inputs.shape
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    dt, pdt = cfg.compute_dtype, cfg.param_dtype
    init = nn.initializers.lecun_normal()

    # The router stays unquantized and in float32.
    gate = nn.Dense(
        e,
        use_bias=False,
        dtype=jnp.float32,
        param_dtype=pdt,
        kernel_init=nn.with_logical_partitioning(init, ("embed", "router")),
        name="gate",
    )
    router_in = inputs if gate_inputs is None else gate_inputs
    logits = gate(router_in.astype(jnp.float32).reshape(b * s, m))  # [T, E]
    scale = None
    if cfg.per_expert_scale:
      scale = self.param(
          "per_expert_scale",
          nn.with_logical_partitioning(nn.initializers.ones, ("exp",)),
          (e,),
          pdt,
      )
    router = routing.route(logits, k, cfg.routing, cfg.norm_topk_prob, scale)

    wi_0, wi_1, wo = self._expert_kernels(init)
    x = sharding.constrain(inputs.astype(dt), sharding.BSM)
    act = activation(cfg.mlp_activations[0])

    if cfg.sparse_matmul:
      out = self._sparse(x, router, wi_0, wi_1, wo, act)
      dropped = jnp.zeros((), jnp.float32)
    elif cfg.dropping:
      out, dropped = self._dense_dropping(x, router, wi_0, wi_1, wo, act)
    else:
      out = self._dense(x, router, wi_0, wi_1, wo, act)
      dropped = jnp.zeros((), jnp.float32)

    fraction = routing.expert_assignment_fraction(router.indices, e)
    if cfg.load_balance_loss_weight > 0:
      lb = cfg.load_balance_loss_weight * routing.load_balance_loss(router, e)
    else:
      lb = jnp.zeros((), jnp.float32)
    out = sharding.constrain(out.astype(dt), sharding.BSM)
    return out, MoEAux(
        load_balance_loss=lb, expert_fraction=fraction, dropped_fraction=dropped
    )

  def _expert_kernels(self, init):
    """(wi_0, wi_1, wo): float params in the compute dtype, or, serving, the
    stored kernels (`stored_weights.StoredKernel`)."""
    cfg = self.config
    e, m, h = cfg.num_experts, cfg.emb_dim, cfg.moe_mlp_dim
    names_in, names_out = ("exp", "embed", "mlp"), ("exp", "mlp", "embed")
    if cfg.serving:
      stored = functools.partial(stored_weights.stored_kernel, self, config=cfg)
      return (
          stored("wi_0", (e, m, h), names_in),
          stored("wi_1", (e, m, h), names_in),
          stored("wo", (e, h, m), names_out),
      )
    w_in = nn.with_logical_partitioning(init, names_in)
    w_out = nn.with_logical_partitioning(init, names_out)
    dt, pdt = cfg.compute_dtype, cfg.param_dtype
    return (
        self.param("wi_0", w_in, (e, m, h), pdt).astype(dt),
        self.param("wi_1", w_in, (e, m, h), pdt).astype(dt),
        self.param("wo", w_out, (e, h, m), pdt).astype(dt),
    )

  def _sparse(self, x, router, wi_0, wi_1, wo, act):
    """Dropless: sort assignments by expert, grouped matmuls, unsort.

    Under a mesh, expert-parallel (see `linen_moe.expert_parallel`).
    """
    b, s, m = x.shape
    routes, experts = (router.indices, router.weights), (wi_0, wi_1, wo)
    if not self.is_initializing():
      ep = expert_parallel.plan(self.config.num_experts, b)
      if ep is not None:
        return expert_parallel.sparse_moe(self, ep, x, routes, experts, act)
    out = expert_parallel.local_experts(
        self.contract, x.reshape(b * s, m), routes, experts, act
    )
    return out.reshape(b, s, m)

  def _dense(self, x, router, wi_0, wi_1, wo, act):
    """Dropless einsums over every expert for every token."""
    b, s, _ = x.shape
    e = self.config.num_experts
    c = sharding.constrain
    hidden = act(c(self.contract("wi_0", x, wi_0, eqn="BSM,EMH->BSEH"), BSEH))
    hidden = hidden * c(
        self.contract("wi_1", x, wi_1, eqn="BSM,EMH->BSEH"), BSEH
    )
    expert_out = c(self.contract("wo", hidden, wo, eqn="BSEH,EHM->BSEM"), BSEM)
    dense_weights = jnp.zeros((b * s, e), jnp.float32)
    rows = jnp.arange(b * s)[:, None]
    dense_weights = dense_weights.at[rows, router.indices].add(router.weights)
    dense_weights = dense_weights.reshape(b, s, e).astype(x.dtype)  # [B,S,E]
    return self.contract(
        "combine", expert_out, dense_weights, eqn="BSEM,BSE->BSM"
    )

  def _dense_dropping(self, x, router, wi_0, wi_1, wo, act):
    """Einsums over per-expert capacity slots; overflow tokens are dropped."""
    b, s, _ = x.shape
    k, e = self.config.num_experts_per_tok, self.config.num_experts
    capacity = expert_capacity(self.config, s)
    slots = dispatch_mask(router.indices.reshape(b, s, k), e, capacity)
    dispatch = jnp.sum(slots, axis=2)  # [B, S, E, C]
    weights = router.weights.reshape(b, s, k, 1, 1)
    combine = jnp.sum(slots * weights, axis=2)  # [B, S, E, C]
    dropped = 1.0 - jnp.sum(slots) / (b * s * k)
    c = sharding.constrain
    expert_in = c(
        self.contract(
            "dispatch", x, dispatch.astype(x.dtype), eqn="BSM,BSEC->EBCM"
        ),
        EBCM,
    )
    hidden = act(
        c(self.contract("wi_0", expert_in, wi_0, eqn="EBCM,EMH->EBCH"), EBCH)
    )
    hidden = hidden * c(
        self.contract("wi_1", expert_in, wi_1, eqn="EBCM,EMH->EBCH"), EBCH
    )
    expert_out = c(self.contract("wo", hidden, wo, eqn="EBCH,EHM->EBCM"), EBCM)
    out = self.contract(
        "combine", expert_out, combine.astype(x.dtype), eqn="EBCM,BSEC->BSM"
    )
    return out, dropped


class RoutedAndSharedMoE(nn.Module):
  """Routed experts plus shared experts, simply added (DeepSeek / Qwen style).

  Parameters: the `RoutedMoE` layout under `routed_experts/` and the
  `SharedExpert` layout under `shared_experts/` (when `shared_experts > 0`).
  Returns the same `(outputs, MoEAux)` as `RoutedMoE`.
  """

  config: MoEConfig

  @nn.compact
  def __call__(self, inputs, gate_inputs=None):
    out, aux = RoutedMoE(self.config, name="routed_experts")(
        inputs, gate_inputs
    )
    if self.config.shared_experts > 0:
      out = out + SharedExpert(self.config, name="shared_experts")(inputs)
    return out, aux
