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

import flax.linen as nn
import jax

from linen_moe.activations import activation
from linen_moe.config import MoEConfig

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
  """act(x wi_0) * (x wi_1) wo, each contraction `project(site, ...)` with
  `site` in ("wi_0", "wi_1", "wo")."""
  hidden = act(project("wi_0", x, wi_0)) * project("wi_1", x, wi_1)
  return project("wo", hidden, wo)


def _matmul(site: str, x: jax.Array, w: jax.Array) -> jax.Array:
  del site  # the shared expert is never quantized
  return x @ w.astype(x.dtype)


class SharedExpert(nn.Module):
  """A plain gated MLP every token goes through: act(x wi_0) * (x wi_1) wo.

  Parameters: `wi_0` [M, F], `wi_1` [M, F], `wo` [F, M], with
  F = shared_experts * shared_mlp_dim.

  Attributes:
    config: the `MoEConfig` (`shared_experts`, `shared_mlp_dim`, activations).
  """

  config: MoEConfig

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """[B, S, M] -> [B, S, M]."""
    cfg = self.config
    width = cfg.shared_experts * cfg.shared_mlp_dim
    init = nn.initializers.lecun_normal()
    w_in = nn.with_logical_partitioning(init, ("embed", "mlp"))
    w_out = nn.with_logical_partitioning(init, ("mlp", "embed"))
    wi_0 = self.param("wi_0", w_in, (cfg.emb_dim, width), cfg.param_dtype)
    wi_1 = self.param("wi_1", w_in, (cfg.emb_dim, width), cfg.param_dtype)
    wo = self.param("wo", w_out, (width, cfg.emb_dim), cfg.param_dtype)
    x = inputs.astype(cfg.compute_dtype)
    act = activation(cfg.mlp_activations[0])
    return gated_mlp(_matmul, act, x, wi_0, wi_1, wo)  # [B, S, M]
