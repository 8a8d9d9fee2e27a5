"""The names the decoder's blocks give their tensors for rematerialization.

`jax.ad_checkpoint.checkpoint_name(x, name)` marks a tensor; a
`jax.checkpoint` policy (`linen_moe._src.models.remat`) then saves,
offloads or recomputes it by that name. A policy that names a tensor no
block marks saves nothing and fails nowhere, so every name lives here, and
the tests check that each one is found in a block's saved residuals.

Shapes: B batch, S sequence, M emb_dim, N / K query / key-value heads, D
head width, T tokens (B * S), E experts, F an MLP's hidden width.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

# A block's input, the residual stream [B, S, M] (what "full" keeps).
LAYER_INPUT = "layer_input"
# The attention's query [B, S, N, D], key and value [B, S, K, D], as the
# attention reads them (after their norms and the rotary embedding).
QUERY = "query"
KEY = "key"
VALUE = "value"
# The attention's output projection [B, S, M].
ATTENTION_OUT = "attention_out"
# The router's logits [T, E].
ROUTER_LOGITS = "router_logits"
# A gated MLP's contractions (routed experts, shared experts and the dense
# layers' MLP alike): x wi_0 and x wi_1 [..., F], and the down projection
# h wo [..., M].
EXPERT_GATE = "expert_gate"
EXPERT_UP = "expert_up"
EXPERT_DOWN = "expert_down"
# The block's MLP output (routed + shared, or the dense MLP's) [B, S, M].
MOE_OUTPUT = "moe_output"

CHECKPOINT_NAMES = (
    LAYER_INPUT,
    QUERY,
    KEY,
    VALUE,
    ATTENTION_OUT,
    ROUTER_LOGITS,
    EXPERT_GATE,
    EXPERT_UP,
    EXPERT_DOWN,
    MOE_OUTPUT,
)


def tag(x: jax.Array, name: str) -> jax.Array:
  """`x`, named `name` for the remat policies (an identity otherwise).

  Args:
    x: any array.
    name: one of `CHECKPOINT_NAMES`.

  Returns:
    `x`, marked with `jax.ad_checkpoint.checkpoint_name`.
  """
  return checkpoint_name(x, name)


def tag_qkv(q: jax.Array, k: jax.Array, v: jax.Array):
  """(q, k, v), each `tag`ged with its name (`QUERY`, `KEY`, `VALUE`)."""
  return tag(q, QUERY), tag(k, KEY), tag(v, VALUE)
