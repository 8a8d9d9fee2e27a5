"""The gated expert MLP, written once: act(x wi_0) * (x wi_1) wo.

Every path computes its experts with `gated_mlp`; what differs between them
is only how one weight is contracted (a plain matmul for the shared expert,
a named einsum on the dense paths, a named grouped matmul on the sparse
path), which the caller passes as `project`. A new activation or a bias is
one edit here.

Shapes: M emb_dim, F the hidden width (H for a routed expert).
"""

from __future__ import annotations

from collections.abc import Callable
import functools

import flax.linen as nn
import jax

from linen_moe._src.config.activations import activation
from linen_moe._src.config.activations import linear_branch
from linen_moe._src.config.expert_weights import kernel_axes
from linen_moe._src.config.expert_weights import kernel_shapes
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.layer import checkpoint_names as names
from linen_moe._src.lora import adapters as lora_adapters
from linen_moe._src.quantization import stored_weights

# project(site, operand, weight) -> the operand contracted with the weight.
Project = Callable[[str, jax.Array, jax.Array], jax.Array]


def gated_mlp(
    project: Project,
    act: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
) -> jax.Array:
  """act(x wi_0) * (x wi_1) wo, each contraction made by `project`.

  Args:
    project: `project(site, operand, weight)` with `site` in ("wi_0", "wi_1",
      "wo"): the operand contracted with that weight.
    act: the activation of the gate.
    x: the input, [..., M] (or whatever `project` contracts).
    wi_0: the gate weight, e.g. [M, F].
    wi_1: the up-projection weight, e.g. [M, F].
    wo: the down-projection weight, e.g. [F, M].

  Returns:
    `project("wo", hidden, wo)`, e.g. [..., M].
  """
  gate = names.tag(project("wi_0", x, wi_0), names.EXPERT_GATE)
  up = names.tag(project("wi_1", x, wi_1), names.EXPERT_UP)
  return gated_down(project, act, gate, up, wo)


def gated_down(
    project: Project,
    act: Callable[[jax.Array], jax.Array],
    gate: jax.Array,
    up: jax.Array,
    wo: jax.Array,
) -> jax.Array:
  """The second half of `gated_mlp`: act(gate) * up, contracted with `wo` by
  `project("wo", ...)` and named `EXPERT_DOWN`; gate and up [..., F]."""
  hidden = gated_product(act, gate, up)
  return names.tag(project("wo", hidden, wo), names.EXPERT_DOWN)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_product(
    act: Callable[[jax.Array], jax.Array], gate: jax.Array, up: jax.Array
) -> jax.Array:
  """act(gate) * up, whose backward keeps `gate` and `up` alone.

  Differentiated as written, it would also keep act's intermediates and
  act(gate) (silu: sigmoid(gate) and gate * sigmoid(gate)), each of the
  shape of `gate`: at Qwen3-30B-A3B's routed shape, S = 8192, bf16, 0.1 GB
  each a layer. The backward recomputes them from `gate` (the same
  operations, so the same numbers).
  """
  return _product(act, gate, up)


def _product(act, gate, up):
  return act(gate) * linear_branch(act, up)


def _gated_product_fwd(act, gate, up):
  return _product(act, gate, up), (gate, up)


def _gated_product_bwd(act, residuals, g):
  # The barrier keeps XLA from merging this recompute with the forward's.
  gate, up = jax.lax.optimization_barrier(residuals)
  return jax.vjp(functools.partial(_product, act), gate, up)[1](g)


gated_product.defvjp(_gated_product_fwd, _gated_product_bwd)


def _matmul(site: str, x: jax.Array, w: jax.Array) -> jax.Array:
  del site  # in training, the shared expert is never quantized
  return x @ w.astype(x.dtype)


class SharedExpert(nn.Module):
  """A plain gated MLP every token goes through: act(x wi_0) * (x wi_1) wo.

  The shared experts, and the MLP of a decoder's dense layers (`mlp_dim`).
  Parameters: `wi_0` [M, F], `wi_1` [M, F], `wo` [F, M], with F = `mlp_dim`
  or shared_experts * shared_mlp_dim. Serving (`config.serving`), they are
  stored kernels (`quantization/stored_weights.py`) under the same names, each
  contracted by its own `{name}_dot` submodule.

  Example usage:
    cfg = load_moe_config("tiny_deepseek_v3")      # shared_experts: 1
    shared = SharedExpert(cfg)
    variables = shared.init(jax.random.key(0), x)  # x: [B, S, emb_dim]
    y = shared.apply(variables, x)                 # [B, S, emb_dim]

  Attributes:
    config: the `MoEConfig` (`shared_experts`, `shared_mlp_dim`, activations).
    mlp_dim: F, the hidden width (0 = shared_experts * shared_mlp_dim).
  """

  config: MoEConfig
  mlp_dim: int = 0

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Applies the shared expert.

    Args:
      inputs: [B, S, M], cast to `config.dtype`.

    Returns:
      [B, S, M] in `config.dtype`.
    """
    cfg = self.config
    width = self.mlp_dim or cfg.shared_experts * cfg.shared_mlp_dim
    shapes = kernel_shapes(cfg.emb_dim, width)
    names = kernel_axes(routed=False)
    x = inputs.astype(cfg.dtype)
    act = activation(cfg.mlp_activations[0], cfg.swiglu_alpha, cfg.swiglu_limit)
    if cfg.serving:
      kernels = [
          stored_weights.stored_kernel(self, w, shapes[w], names[w], cfg)
          for w in shapes
      ]
      project = self._stored_matmul
    else:
      init = nn.initializers.lecun_normal()
      kernels = [
          self.param(
              w,
              nn.with_logical_partitioning(init, names[w]),
              shapes[w],
              cfg.param_dtype,
          )
          for w in shapes
      ]
      project = _matmul
    lora = cfg.lora_on("mlp" if self.mlp_dim else "shared")
    if lora is not None:
      kernels = [
          lora_adapters.adapted(
              self, w, k, shapes[w], names[w], lora, cfg.param_dtype, cfg.dtype
          )
          for w, k in zip(shapes, kernels, strict=True)
      ]
      project = functools.partial(self._adapted, project)
    return gated_mlp(project, act, x, *kernels)  # [B, S, M]

  def _adapted(self, project: Project, site: str, x: jax.Array, w):
    """`project` of the base kernel plus the adapter's delta."""
    out = project(site, x, w.base)
    if self.config.serving:  # QLoRA: train through the stored kernel
      kernel = lora_adapters.dequantized(w.base, x.dtype)
      out = lora_adapters.frozen_input_gradient(out, x, lambda v: v @ kernel)
    delta = lora_adapters.einsum_delta(
        self, "...K,KN->...N", x, w.a, w.b, w.scale, w.dropout
    )
    return lora_adapters.add_delta(out, delta)

  def _stored_matmul(self, site: str, x: jax.Array, w) -> jax.Array:
    """x [..., K] @ stored kernel [K, N] -> [..., N]."""
    flat = x.reshape(-1, x.shape[-1])  # [T, K]
    out = stored_weights.StoredEinsum(name=f"{site}_dot")("TK,KN->TN", flat, w)
    return out.reshape(*x.shape[:-1], out.shape[-1])
