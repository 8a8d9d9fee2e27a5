"""The sparse, dropless path on one device: sort, grouped matmuls, unsort.

Shapes: T tokens, M emb_dim, H moe_mlp_dim, k experts per token, E_l the
experts held here, R = T * min(k, E_l) rows of the sorted buffer.

Every weight is contracted through the layer's named grouped-matmul hook,
`grouped(site, lhs, rhs, group_sizes)` (`RoutedMoE.grouped`), so each one is
quantized by the layer's mode and owns its state. Under a mesh,
`layer/expert_parallel.py` runs this same function on each device's experts.

The layer calls it through `sparse_experts_remat`, whose backward gathers
the sorted rows [R, M] from x [T, M] again (x is kept anyway, k times
smaller) instead of keeping them from the forward: at Qwen3-30B-A3B's
routed shape, S = 8192, bf16, 0.27 GB a layer. Inside a block that is
rematerialized as a whole (a decoder's `remat` other than "none") that
recompute is a third gather of the rows (the forward, the block's
recompute, its own; JAX already leaves out the gate and up matmuls, whose
outputs the backward does not read). `RoutedMoE.remat_rows=False`
(`ModelConfig.remat_moe_rows=False` in a decoder) turns it off: one
[R, M] gather fewer a layer, for the rows of the layer in its backward
held (1 GiB at 8 x 4096 tokens of Qwen3-30B-A3B's).

Where the Pallas kernels run a float layer's plain `wi_0` and `wi_1`, the
gate and up projections' backward is one call each way
(`kernels/tpu/pallas_gate_up.py`): the rows read once for both weight
gradients, and the two input gradients summed in the kernel rather than by
XLA (on a TPU v5e the backward 1.7x as fast as two calls at 128 experts
of 2048 x 768, 2.1x at 8 of 4096 x 14336);
`accelerator.paired_gate_up(False)` turns it off.

At decode sizes (a handful of tokens, `uses_every_expert`) the layer runs
`every_expert` instead: each expert on every token, through the same hook,
with the weights of the unchosen pairs 0. Each weight is still read once,
no assignment is sorted and no row is gathered. With fewer choices than
experts (`uses_chosen_experts`: one token of top-2 among 8) a float layer
runs `chosen_experts`: each (token, choice) pair is a group of one row with
its expert's weights gathered, so only the chosen experts' weights are
read (a quarter of them at batch 1 of top-2 of 8).
"""

from __future__ import annotations

from collections.abc import Callable
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src.kernels import grouped_matmul as gmm_lib
from linen_moe._src.layer import checkpoint_names as names
from linen_moe._src.layer import permute
from linen_moe._src.layer.expert import gated_down
from linen_moe._src.layer.expert import gated_mlp

Grouped = Callable[[str, jax.Array, jax.Array, jax.Array], jax.Array]
Experts = tuple[jax.Array, jax.Array, jax.Array]  # (wi_0, wi_1, wo)


def sparse_experts(
    grouped: Grouped,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    experts: Experts,
    act: Callable[[jax.Array], jax.Array],
    first_expert: jax.Array | int = 0,
    all_experts: bool = False,
) -> jax.Array:
  """The experts [first, first + E_l) that `experts` hold, on their tokens.

  x [T, M]; indices <int32>[T, k] and weights [T, k], the routing; experts =
  (wi_0, wi_1, wo) with wi_0/wi_1 [E_l, M, H], wo [E_l, H, M]. Returns
  [T, M]: each token's weighted sum over its choices among these experts (0
  for the others). With all E experts it is the whole, dropless sparse path;
  `all_experts` says so (then no sorted row needs masking).
  """
  plan = permute.sort_plan(
      indices, experts[0].shape[0], first_expert, all_local=all_experts
  )
  rows = permute.dispatch_rows(x, plan)  # [R, M] sorted by expert

  def project(site, operand, weight):
    return grouped(site, operand, weight, plan.group_sizes)

  expert_out = gated_mlp(project, act, rows, *experts)  # [R, M]
  return permute.combine_rows(expert_out, weights.astype(x.dtype), plan)


def sparse_experts_remat(
    module: nn.Module,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    experts: Experts,
    act: Callable[[jax.Array], jax.Array],
    first_expert: jax.Array | int = 0,
    all_experts: bool = False,
    max_group_size: int | None = None,
    gather: Callable[[str, jax.Array], jax.Array] | None = None,
    remat: bool = True,
) -> jax.Array:
  """`sparse_experts` through `module.grouped`, whose backward gathers the
  sorted rows again instead of keeping them (with `remat`).

  The gather of the rows and the gate and up projections are one
  `nn.checkpoint` that keeps nothing of its own (its arguments, x and the
  plan, are kept anyway); the rest is `expert.gated_mlp`'s. Gate and up
  are named outside it, so that a decoder's remat policy sees the names
  (`checkpoint_names`); inside a decoder's remat, its policy decides for
  this part too. The same numbers: the recomputed gather is the forward's
  on the forward's values. The sort runs once, outside.

  Args:
    module: the layer whose `grouped(site, lhs, rhs, group_sizes,
      max_group_size)` hook contracts the weights (`RoutedMoE`), bound
      (inside `apply`).
    x: [T, M].
    indices: <int32>[T, k], the routing.
    weights: [T, k], the routing weights.
    experts: (wi_0, wi_1, wo) of the experts [first, first + E_l).
    act: the activation of the gate.
    first_expert: the first expert held here.
    all_experts: the experts are all E (no sorted row is masked).
    max_group_size: a static bound on every group's size, or None.
    gather: `gather(site, weight)` -> the whole weight, for weights that
      arrive as shards (expert parallelism under FSDP,
      `expert_parallel.kernel_shards`): called inside the rematerialized
      regions (wi_0 and wi_1 in the gate and up one, wo in its own), so
      that a backward gathers each weight again where it needs it rather
      than keeping the forward's gathered copy.
    remat: rematerialize as above. False: no checkpoint of its own (the
      backward keeps the rows, and the gathered weights), for a caller
      that recomputes the whole layer in its backward anyway (a decoder
      block's remat); the same numbers.

  Returns:
    [T, M], as `sparse_experts`.

  Raises:
    TypeError: if `remat` is not a bool.
  """
  if not isinstance(remat, bool):
    raise TypeError(f"remat must be a bool; got {remat!r}.")
  checkpoint = nn.checkpoint if remat else lambda fn: fn
  plan = permute.sort_plan(
      indices,
      experts[0].shape[0],
      first_expert,
      all_local=all_experts,
      implementation=module.config.grouped_matmul,
  )
  wi_0, wi_1, wo = experts

  def project(mdl, plan, site, operand, weight):
    return mdl.grouped(site, operand, weight, plan.group_sizes, max_group_size)

  def whole(site, weight):
    return weight if gather is None else gather(site, weight)

  def gate_and_up(mdl, x, plan, wi_0, wi_1):
    rows = permute.dispatch_rows(x, plan)  # [R, M] sorted by expert
    wi_0, wi_1 = whole("wi_0", wi_0), whole("wi_1", wi_1)
    paired = _paired_gate_up(mdl, rows, wi_0, wi_1)
    if paired is not None:
      return paired(rows, wi_0, wi_1, plan.group_sizes)
    return (
        project(mdl, plan, "wi_0", rows, wi_0),
        project(mdl, plan, "wi_1", rows, wi_1),
    )  # [R, H] each

  gate, up = checkpoint(gate_and_up)(module, x, plan, wi_0, wi_1)
  gate = names.tag(gate, names.EXPERT_GATE)
  up = names.tag(up, names.EXPERT_UP)
  if gather is not None:
    gather_wo = functools.partial(gather, "wo")
    wo = (jax.checkpoint(gather_wo) if remat else gather_wo)(wo)
  down = functools.partial(project, module, plan)
  expert_out = gated_down(down, act, gate, up, wo)  # [R, M]
  return permute.combine_rows(expert_out, weights.astype(x.dtype), plan)


def _paired_gate_up(module: nn.Module, rows: jax.Array, wi_0, wi_1):
  """The kernel that runs the gate and up projections as one call each way
  (`grouped_matmul.paired_kernel`), where `module`'s `wi_0` and `wi_1`
  contractions are plain float grouped matmuls (no quantization, serving
  kernel, adapter or bias) that the kernel runs; else None."""
  cfg = module.config
  plain = all(isinstance(w, jax.Array) for w in (wi_0, wi_1))
  if cfg.serving or cfg.quantization != "none" or not plain:
    return None
  if wi_0.shape != wi_1.shape or wi_0.dtype != wi_1.dtype:
    return None
  (r, m), (g, _, h) = rows.shape, wi_0.shape
  return gmm_lib.paired_kernel(
      cfg.grouped_matmul, (rows.dtype, wi_0.dtype), (r, m, h, g)
  )


# `every_expert` computes E * T rows where the sorted path needs T * k; at
# T <= 8 the grouped matmul gives each expert at least min(8, T) slots anyway
# ("blocked", `blocked.slot_rows`), so the extra rows cost (nearly)
# nothing, and the sort, its gathers and the expert-order bookkeeping go.
EVERY_EXPERT_MAX_TOKENS = 8


def uses_every_expert(num_tokens: int, num_experts: int, k: int) -> bool:
  """Whether the layer computes T tokens with `every_expert`: at most
  `EVERY_EXPERT_MAX_TOKENS` tokens whose T * k choices can reach every
  expert (with fewer, the sorted path reads fewer experts' rows)."""
  return num_tokens <= EVERY_EXPERT_MAX_TOKENS and num_tokens * k >= num_experts


def uses_chosen_experts(
    num_tokens: int, num_experts: int, k: int, quantized: bool
) -> bool:
  """Whether the layer computes T tokens with `chosen_experts`: at most
  `EVERY_EXPERT_MAX_TOKENS` tokens whose T * k choices are fewer than the
  experts, in float (a quantized contraction scales over all of an
  expert tensor, so a gathered subset would change its scales)."""
  return (
      not quantized
      and num_tokens <= EVERY_EXPERT_MAX_TOKENS
      and num_tokens * k < num_experts
  )


def chosen_experts(
    grouped: Grouped,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    experts: Experts,
    act: Callable[[jax.Array], jax.Array],
) -> jax.Array:
  """The dropless sparse path on the chosen experts' weights alone.

  Arguments and result as for `every_expert` (the routing over all E
  experts; [T, M] out, the result of `sparse_experts`). Row t * k + j is
  token t for its choice j, a group of one row whose weights are its
  expert's, gathered: [T * k, M, H] (the grouped matmuls then read T * k
  experts' weights, not E). Pass a hook whose `max_group_size` is 1.
  """
  t, k = indices.shape
  rows = jnp.repeat(x, k, axis=0)  # [T * k, M]
  chosen = indices.reshape(t * k)
  sizes = jnp.ones((t * k,), jnp.int32)

  def project(site, operand, weight):
    # A tree: a kernel with its adapter gathers its A and B rows too.
    gathered = jax.tree.map(lambda w: jnp.take(w, chosen, axis=0), weight)
    return grouped(site, operand, gathered, sizes)

  expert_out = gated_mlp(project, act, rows, *experts)  # [T * k, M]
  expert_out = expert_out.reshape(t, k, x.shape[-1])
  return jnp.einsum("TKM,TK->TM", expert_out, weights.astype(x.dtype))


def every_expert(
    grouped: Grouped,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    experts: Experts,
    act: Callable[[jax.Array], jax.Array],
) -> jax.Array:
  """The dropless sparse path as every expert on every token.

  x [T, M]; indices <int32>[T, k] and weights [T, k], the routing over all E
  experts; experts = (wi_0, wi_1, wo), wi_0/wi_1 [E, M, H], wo [E, H, M].
  Returns [T, M], each token's weighted sum over its k choices: the result
  of `sparse_experts(..., all_experts=True)`. The grouped matmuls see the
  tokens repeated per expert, [E * T, M] in groups of T rows each. The
  hidden rows of the (token, expert) pairs not chosen are zeroed before
  `wo`, and their combine weights are 0: every contraction then sees the
  values (and a quantized one the absolute maxima) the sorted path's see,
  plus zero rows.
  """
  t, m = x.shape
  e = experts[0].shape[0]
  rows = jnp.tile(x, (e, 1))  # [E * T, M], expert-major
  sizes = jnp.full((e,), t, jnp.int32)
  chosen = jax.nn.one_hot(indices, e, dtype=x.dtype)  # [T, k, E]
  pairs = jnp.sum(chosen, axis=1).T.reshape(e * t, 1)  # [E * T, 1]: 1, 0

  def project(site, operand, weight):
    if site == "wo":
      operand = operand * pairs.astype(operand.dtype)
    return grouped(site, operand, weight, sizes)

  expert_out = gated_mlp(project, act, rows, *experts).reshape(e, t, m)
  combine = jnp.einsum("TKE,TK->ET", chosen, weights.astype(x.dtype))
  return jnp.sum(expert_out * combine[:, :, None], axis=0)  # [T, M]
