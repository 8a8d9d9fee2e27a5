"""The routed MoE layer (Linen `nn.compact`): router, weights, the contraction
hook, and the choice of path (`dense`, `sparse`, `expert_parallel`).

Shapes: B batch, S sequence, M emb_dim, H moe_mlp_dim, E num_experts,
k num_experts_per_tok, T = B * S tokens.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from linen_moe._src.config import expert_weights
from linen_moe._src.config import variables
from linen_moe._src.config.activations import activation
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.kernels import grouped_matmul as gmm_lib
from linen_moe._src.layer import checkpoint_names
from linen_moe._src.layer import dense
from linen_moe._src.layer import expert_bias
from linen_moe._src.layer import expert_parallel
from linen_moe._src.layer import routing
from linen_moe._src.layer import sparse
from linen_moe._src.layer.expert import SharedExpert
from linen_moe._src.layer.jit_init import JitInit
from linen_moe._src.lora import adapters as lora_adapters
from linen_moe._src.parallel import sharding
from linen_moe._src.quantization import stored_weights
from linen_moe._src.quantization.contractions import Einsum
from linen_moe._src.quantization.contractions import contraction_modules

# Every contraction that touches an expert weight or a dispatch/combine mask
# goes through `RoutedMoE.einsum` or `RoutedMoE.grouped` under one of these
# names, and owns the submodule `{site}_dot`.
CALL_SITES = ("wi_0", "wi_1", "wo", "dispatch", "combine")
# The call sites that contract an expert weight. A serving layer
# (`config.serving`) feeds them its stored kernels; the others (the dispatch
# mask, the combine weights) then stay float, so that every path computes
# the same expert math.
WEIGHT_SITES = expert_weights.KERNELS


def check_remat_rows(remat_rows) -> None:
  """Raises TypeError unless `remat_rows` (`RoutedMoE.remat_rows`) is a
  bool."""
  if not isinstance(remat_rows, bool):
    raise TypeError(
        "RoutedMoE.remat_rows must be a bool (True or False); got"
        f" {remat_rows!r}."
    )


@flax.struct.dataclass
class MoEAux:
  """Auxiliary outputs of `RoutedMoE`.

  Attributes:
    load_balance_loss: scalar, already multiplied by its config weight (0 when
      the weight is 0).
    expert_fraction: <float32>[E] share of routed assignments per expert (the
      expert load the routed-bias rule reads; before any dropping).
    dropped_fraction: scalar share of the T*k assignments dropped by capacity
      (always 0 on dropless paths).
    router_z_loss: scalar, the router z-loss times its config weight (0 when
      the weight is 0).
  """

  load_balance_loss: jax.Array
  expert_fraction: jax.Array
  dropped_fraction: jax.Array
  router_z_loss: jax.Array


class RoutedMoE(JitInit, nn.Module):
  """Routed mixture of experts: top-k routing, gated experts, two paths.

  Example usage:
    cfg = load_moe_config("tiny_mixtral")
    moe = RoutedMoE(cfg)
    variables = moe.init(jax.random.key(0), x)     # x: [B, S, emb_dim]
    y, aux = moe.apply(variables, x)

  Parameters (the public layout): `gate/kernel` [M, E] (and `gate/bias`
  [E] with `router_bias`), `wi_0` [E, M, H] (activated branch), `wi_1`
  [E, M, H] (linear branch), `wo` [E, H, M], with `expert_bias` their
  biases `wi_0_bias`, `wi_1_bias` [E, H] and `wo_bias` [E, M]
  (`expert_bias.py`), `per_expert_scale` [E] (when enabled). Other state: `routed_bias`
  <float32>[E] in the `updated_by_rule` collection (when `routed_bias`), the
  selection-only bias; a train step moves it. RNG streams: `router_jitter`
  (read only when `router_jitter > 0`).

  Attributes:
    config: the `MoEConfig`.
    remat_rows: the sparse path's backward gathers the sorted rows [T * k,
      M] again rather than keep them (`sparse.sparse_experts_remat`).
      False keeps them: for a caller that recomputes the whole layer in
      its backward anyway (a decoder block under `ModelConfig.remat` other
      than "none"), where the layer's own recompute would be a third
      gather. The numbers are the same.
  """

  config: MoEConfig
  remat_rows: bool = True

  def _contractions(self):
    """The mode's einsum and grouped-matmul modules (built once per mode)."""
    cfg = self.config
    return contraction_modules(
        cfg.quantization,
        implementation=cfg.grouped_matmul,
        amax_history_length=cfg.fp8_amax_history_length,
    )

  def _submodule_name(self, site: str) -> str:
    if site not in CALL_SITES:
      raise ValueError(
          f"Unknown contraction call site {site!r}; registered call sites are "
          f"{CALL_SITES}."
      )
    return f"{site}_dot"

  def einsum(
      self, site: str, eqn: str, lhs: jax.Array, rhs: jax.Array
  ) -> jax.Array:
    """The named einsum hook of the dense paths: `einsum(eqn, lhs, rhs)`.

    Computed by the submodule `{site}_dot` in this config's quantization
    (float, int8 or fp8); a serving layer (`config.serving`) contracts its
    stored kernels at the weight sites (`wi_0`, `wi_1`, `wo`) and keeps the
    dispatch and combine contractions float.

    Args:
      site: the call site, one of `CALL_SITES` (`wi_0`, `wi_1`, `wo`,
        `dispatch`, `combine`); names the submodule and its quantization state.
      eqn: the `jnp.einsum` equation, e.g. `"EBCM,EMH->EBCH"`.
      lhs: the left operand (activations or a dispatch/combine mask).
      rhs: the right operand (an expert weight, or activations).

    Returns:
      The contraction of `lhs` and `rhs` by `eqn`, shaped as `eqn` says.

    Raises:
      ValueError: if `site` is not in `CALL_SITES`.
    """
    rhs, bias = expert_bias.split(rhs)
    if bias is not None:  # the expert's bias, after the contraction
      out = self.einsum(site, eqn, lhs, rhs)
      return out + expert_bias.einsum_bias(eqn, bias).astype(out.dtype)
    name = self._submodule_name(site)
    adapter = rhs if isinstance(rhs, lora_adapters.AdaptedKernel) else None
    if adapter is not None:
      rhs = adapter.base
    if self.config.serving:
      stored = site in WEIGHT_SITES
      module = stored_weights.StoredEinsum if stored else Einsum
      out = module(name=name)(eqn, lhs, rhs)
      if adapter is not None and stored:  # QLoRA: train through it
        w = lora_adapters.dequantized(rhs, lhs.dtype)
        out = lora_adapters.frozen_input_gradient(
            out, lhs, lambda x: jnp.einsum(eqn, x, w)
        )
    else:
      modules = self._contractions()
      out = modules.einsum(name=name, **modules.einsum_kwargs)(eqn, lhs, rhs)
    if adapter is None:
      return out
    delta = lora_adapters.einsum_delta(
        self, eqn, lhs, adapter.a, adapter.b, adapter.scale, adapter.dropout, 1
    )
    return lora_adapters.add_delta(out, delta)

  def grouped(
      self,
      site: str,
      lhs: jax.Array,
      rhs: jax.Array,
      group_sizes: jax.Array,
      max_group_size: int | None = None,
  ) -> jax.Array:
    """The named grouped-matmul hook of the sparse path.

    Row block `g` of `lhs` (the `group_sizes[g]` rows after the rows of the
    groups before it) is multiplied by `rhs[g]`. Computed by the submodule
    `{site}_dot` in this config's quantization; a serving layer
    (`config.serving`) multiplies by its stored kernels.

    Args:
      site: the call site, one of `CALL_SITES` (`wi_0`, `wi_1`, `wo` on the
        sparse path); names the submodule and its quantization state.
      lhs: [R, K] rows sorted by group (R routed assignments).
      rhs: [G, K, N] one weight per group (G experts).
      group_sizes: <int32>[G] rows per group; rows past
        `sum(group_sizes)` come out 0.
      max_group_size: static bound on every group size (the layer's T tokens:
        a token picks an expert at most once), which lets the grouped matmul
        skip its overflow loop at small sizes; it never changes the result.
        None: no bound.

    Returns:
      [R, N], row r the product of `lhs[r]` and its group's weight.

    Raises:
      ValueError: if `site` is not in `CALL_SITES`.
    """
    rhs, bias = expert_bias.split(rhs)
    if bias is not None:  # the expert's bias, after the contraction
      out = self.grouped(site, lhs, rhs, group_sizes, max_group_size)
      rows = expert_bias.rows_bias(bias, group_sizes, lhs.shape[0])
      return out + rows.astype(out.dtype)
    name = self._submodule_name(site)
    adapter = rhs if isinstance(rhs, lora_adapters.AdaptedKernel) else None
    if adapter is not None:
      rhs = adapter.base
    if self.config.serving:
      module = stored_weights.StoredGroupedMatmul(
          self.config.grouped_matmul, max_group_size, name=name
      )
    else:
      modules = self._contractions()
      module = modules.grouped_matmul(
          name=name, max_group_size=max_group_size, **modules.grouped_kwargs
      )
    out = module(lhs, rhs, group_sizes)
    if adapter is None:
      return out
    if self.config.serving:  # QLoRA: train through the stored kernel
      w = lora_adapters.dequantized(rhs, lhs.dtype)
      out = lora_adapters.frozen_input_gradient(
          out,
          lhs,
          lambda x: gmm_lib.grouped_matmul(
              x,
              w,
              group_sizes,
              implementation=self.config.grouped_matmul,
              max_group_size=max_group_size,
          ),
      )
    delta = lora_adapters.grouped_delta(
        self,
        lhs,
        adapter,
        group_sizes,
        self.config.grouped_matmul,
        max_group_size,
    )
    return lora_adapters.add_delta(out, delta)

  @nn.compact
  def __call__(
      self, inputs: jax.Array, gate_inputs: jax.Array | None = None
  ) -> tuple[jax.Array, MoEAux]:
    """Routes each token to its top-k experts and combines their outputs.

    The path follows the config: `sparse_matmul` (dropless grouped matmuls,
    expert-parallel under a mesh), else `dropping` (dense with a capacity per
    expert), else dense over every expert.

    Args:
      inputs: [B, S, M] activations (M = `config.emb_dim`), cast to
        `config.dtype`.
      gate_inputs: optional [B, S, M] the router reads instead of `inputs`
        (in float32); None: the router reads `inputs`.

    Returns:
      `(outputs, aux)`, outputs [B, S, M] in `config.dtype` and aux the
      `MoEAux` (weighted auxiliary losses, expert load, dropped share).

    Raises:
      ValueError: if `inputs` is not [B, S, `config.emb_dim`], or
        `gate_inputs` does not have the shape of `inputs`.
      TypeError: if `remat_rows` is not a bool.
    """
    cfg = self.config
    check_remat_rows(self.remat_rows)
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
    dt, pdt = cfg.dtype, cfg.param_dtype
    init = nn.initializers.lecun_normal()

    # The router stays unquantized and in float32.
    gate = nn.Dense(
        e,
        use_bias=cfg.router_bias,
        dtype=jnp.float32,
        param_dtype=pdt,
        kernel_init=nn.with_logical_partitioning(init, ("embed", "router")),
        bias_init=nn.with_logical_partitioning(
            nn.initializers.zeros, ("router",)
        ),
        name=expert_weights.ROUTER,
    )
    router_in = inputs if gate_inputs is None else gate_inputs
    router_in = router_in.astype(jnp.float32).reshape(b * s, m)
    stream = variables.ROUTER_JITTER_RNG_STREAM
    if cfg.router_jitter > 0 and self.has_rng(stream):
      router_in = routing.jitter(
          router_in, cfg.router_jitter, self.make_rng(stream)
      )
    logits = checkpoint_names.tag(
        gate(router_in), checkpoint_names.ROUTER_LOGITS
    )  # [T, E]
    scale = None
    if cfg.per_expert_scale:
      scale = self.param(
          "per_expert_scale",
          nn.with_logical_partitioning(nn.initializers.ones, ("exp",)),
          (e,),
          pdt,
      )
    bias = None
    if cfg.routed_bias:  # replicated: no logical axis names
      bias = self.variable(
          variables.UPDATED_BY_RULE,
          "routed_bias",
          jnp.zeros,
          (e,),
          jnp.float32,
      ).value
    router = routing.route(
        logits,
        k,
        cfg.routing,
        cfg.norm_topk_prob,
        scale,
        selection_bias=bias,
        n_groups=cfg.num_routing_groups,
        topk_groups=cfg.topk_routing_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )

    experts = self._expert_kernels(init)
    x = sharding.constrain(inputs.astype(dt), sharding.BSM)
    if cfg.weights_on_input:  # Llama-4: expert(w x), one expert a token
      x = x * router.weights.reshape(b, s, 1).astype(dt)
      router = router.replace(weights=jnp.ones_like(router.weights))
    act = activation(cfg.mlp_activations[0], cfg.swiglu_alpha, cfg.swiglu_limit)

    dropped = jnp.zeros((), jnp.float32)
    if cfg.sparse_matmul:
      out = self._sparse(x, router, experts, act)
    elif cfg.dropping:
      capacity = dense.expert_capacity(cfg, s)
      out, dropped = dense.dense_dropping(
          self.einsum,
          x,
          router,
          experts,
          act,
          capacity,
          by_probability=cfg.drop_policy == "probability",
      )
    else:
      out = dense.dense(self.einsum, x, router, experts, act)

    fraction = routing.expert_assignment_fraction(router.indices, e)
    lb = z = jnp.zeros((), jnp.float32)
    if cfg.load_balance_loss_weight > 0:
      lb = cfg.load_balance_loss_weight * routing.load_balance_loss(router, e)
    if cfg.router_z_loss_weight > 0:
      z = cfg.router_z_loss_weight * routing.router_z_loss(logits)
    out = sharding.constrain(out.astype(dt), sharding.BSM)
    return out, MoEAux(
        load_balance_loss=lb,
        expert_fraction=fraction,
        dropped_fraction=dropped,
        router_z_loss=z,
    )

  def _expert_kernels(self, init):
    """(wi_0, wi_1, wo): float params in the compute dtype or, serving, the
    stored kernels (`stored_weights.StoredKernel`), same names and shapes."""
    cfg = self.config
    shapes = expert_weights.kernel_shapes(
        cfg.emb_dim, cfg.moe_mlp_dim, cfg.num_experts
    )
    names = expert_weights.kernel_axes(routed=True)
    if cfg.serving:
      kernels = tuple(
          stored_weights.stored_kernel(self, w, shapes[w], names[w], cfg)
          for w in WEIGHT_SITES
      )
    else:
      kernels = tuple(
          self.param(
              w,
              nn.with_logical_partitioning(init, names[w]),
              shapes[w],
              cfg.param_dtype,
          ).astype(cfg.dtype)
          for w in WEIGHT_SITES
      )
    lora = cfg.lora_on("experts")
    if lora is not None:
      kernels = tuple(
          lora_adapters.adapted(
              self,
              w,
              k,
              shapes[w],
              names[w],
              lora,
              cfg.param_dtype,
              cfg.dtype,
              1,
          )
          for w, k in zip(WEIGHT_SITES, kernels, strict=True)
      )
    if not cfg.expert_bias:
      return kernels
    return tuple(
        expert_bias.BiasedKernel(
            k,
            self.param(
                f"{w}_bias",
                nn.with_logical_partitioning(
                    nn.initializers.zeros, (names[w][0], names[w][-1])
                ),
                (shapes[w][0], shapes[w][-1]),
                cfg.param_dtype,
            ).astype(cfg.dtype),
        )
        for w, k in zip(WEIGHT_SITES, kernels, strict=True)
    )

  def _sparse(self, x, router, experts, act):
    """Dropless: sort assignments by expert, grouped matmuls, unsort; at
    decode sizes every expert on every token (`sparse.uses_every_expert`),
    or in float with fewer choices than experts the chosen experts' weights
    gathered (`sparse.uses_chosen_experts`).

    Under a mesh, expert-parallel (see `layer/expert_parallel.py`).
    """
    b, s, m = x.shape
    cfg = self.config
    if not self.is_initializing():
      ep = expert_parallel.plan(cfg.num_experts, b)
      if ep is not None:
        return expert_parallel.sparse_moe(self, ep, x, router, experts, act)
    tokens = (x.reshape(b * s, m), router.indices, router.weights)
    if sparse.uses_every_expert(
        b * s, cfg.num_experts, cfg.num_experts_per_tok
    ):
      out = sparse.every_expert(self.grouped, *tokens, experts, act)
    elif sparse.uses_chosen_experts(
        b * s,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.quantization != "none" or cfg.serving,
    ):
      grouped = functools.partial(self.grouped, max_group_size=1)
      out = sparse.chosen_experts(grouped, *tokens, experts, act)
    else:
      out = sparse.sparse_experts_remat(
          self,
          *tokens,
          experts,
          act,
          all_experts=True,
          max_group_size=b * s,
          remat=self.remat_rows,
      )
    return out.reshape(b, s, m)


class RoutedAndSharedMoE(JitInit, nn.Module):
  """Routed experts plus shared experts, simply added (DeepSeek / Qwen style).

  Parameters: the `RoutedMoE` layout under `routed_experts/` and the
  `SharedExpert` layout under `shared_experts/` (when `shared_experts > 0`).
  Returns the same `(outputs, MoEAux)` as `RoutedMoE`.

  Attributes:
    config: the `MoEConfig`; `shared_experts` (and `shared_mlp_dim`) size the
      shared part.
    remat_rows: the routed experts' `RoutedMoE.remat_rows`.
  """

  config: MoEConfig
  remat_rows: bool = True

  @nn.compact
  def __call__(self, inputs, gate_inputs=None):
    """Applies the routed experts and adds the shared experts' output.

    Args:
      inputs: [B, S, M] activations (M = `config.emb_dim`).
      gate_inputs: optional [B, S, M] the router reads instead of `inputs`;
        the shared experts always read `inputs`.

    Returns:
      `(outputs, aux)`, outputs [B, S, M] in `config.dtype` (routed plus
      shared) and aux the routed experts' `MoEAux`.

    Raises:
      ValueError: from `RoutedMoE` if `inputs` is not [B, S, emb_dim] or
        `gate_inputs` has another shape.
      TypeError: from `RoutedMoE` if `remat_rows` is not a bool.
    """
    out, aux = RoutedMoE(
        self.config, remat_rows=self.remat_rows, name="routed_experts"
    )(inputs, gate_inputs)
    if self.config.shared_experts > 0:
      out = out + SharedExpert(self.config, name="shared_experts")(inputs)
    return out, aux
