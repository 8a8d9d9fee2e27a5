"""Expert parallelism for the sparse (grouped-matmul) path: the plan and the
`shard_map` lifting; the per-device computation is `layer/sparse.py`.

Shapes: B batch, S sequence, M emb_dim, H moe_mlp_dim, E experts, k experts
per token, D_e expert shards (the product of the mesh axes "exp" maps to),
E_l = E / D_e local experts, T_g tokens a device sees after the gather.

How tokens meet their experts. Under a mesh, the sparse path runs inside one
`jax.shard_map` over the whole mesh. Expert weights enter sharded on their
expert axis, so a device holds E_l experts and never another device's;
their FSDP shards (other dims split over batch axes, `kernel_shards`)
enter split too and are all-gathered inside the sparse path's
rematerialized regions, so that the backward gathers each again where it
needs it instead of keeping the forward's copies; other splits (tensor)
are gathered at the boundary, like any weight. Tokens enter sharded on
their batch axes. Then, per layer:

  1. all-gather the tokens and their routing (indices, weights) over the
     expert axes (the batch axes that experts are also sharded on; the
     "all_gather" strategy, see below for "ragged_all_to_all"),
  2. pick the assignments routed to the local experts, sort them by expert
     into a buffer of R = T_g * min(k, E_l) rows, and run the grouped
     matmuls (`layer/sparse.py`, through `RoutedMoE.grouped`, so every
     quantization works),
  3. weight and sum each token's local results, then reduce-scatter over the
     expert axes: each device gets the summed output of its own tokens.

Two strategies (`MoEConfig.expert_parallel`), one lifting. The all-gather
above is dropless by construction: top-k experts of a token are distinct, so
a token has at most min(k, E_l) assignments to one device's experts, and R
rows always suffice; and it needs no data-dependent sizes. But every device
receives every token of the D_e devices, D_e / k times the rows a token's k
assignments need. "ragged_all_to_all" (`linen_moe._src.layer.ragged_experts`)
sends each assignment only to the device that holds its expert, with
`jax.lax.ragged_all_to_all` and sizes and offsets computed from the routing,
and its result back the same way; its receive buffer is sized for the worst
case, so it is dropless too. A fixed-shape `all_to_all` would have to hold
every local assignment for every destination: k times the all-gather's
traffic, never chosen. XLA:CPU does not implement `ragged_all_to_all`, so
there it is emulated exactly (`linen_moe._src.kernels.ragged_collectives`), at more
bytes than the all-gather: "auto" takes the all-gather on a CPU, and on GPU
and TPU whichever `linen_moe._src.parallel.ep_traffic` models as cheaper (ragged
above about D_e = 1.25 k). Tokens are small next to the weights ([T, M]
against [E, M, H]), and the weights never move, in either strategy.

Quantization state under the shard_map. fp8 contractions keep scales and amax
histories in the `_overwrite_with_gradient` collection, whose "gradient" is
the new value. Passed in replicated, shard_map would *sum* those gradients
over devices. So each device gets its own copy (`_per_device_copies`), whose
backward takes the element-wise maximum over the copies: Flax's delayed
scaling derives the new scale from the old (replicated) history, so scales
agree on every device, and the new history differs only in its newest entry,
the local amax, whose maximum is the global amax. The new state is therefore
the single-device one, under either strategy (each device's experts see the
same rows whether they were gathered or sent). int8 scales are computed on the fly per row and per
(expert, output channel), which the local computation sees whole.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.core.lift as core_lift
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linen_moe._src.config import expert_weights
from linen_moe._src.kernels.ragged_collectives import needs_emulation
from linen_moe._src.layer import ragged_experts
from linen_moe._src.layer.routing import RouterResult
from linen_moe._src.layer.sparse import Experts
from linen_moe._src.layer.sparse import sparse_experts_remat
from linen_moe._src.parallel import ep_traffic
from linen_moe._src.parallel import sharding

# Variable collections lifted into the shard_map body: every one except the
# parameters (the expert weights enter as explicit, expert-sharded operands).
_LIFTED_COLLECTIONS = nn.DenyList(("params",))


@dataclasses.dataclass(frozen=True)
class ExpertParallelPlan:
  """How the sparse path is laid out on the current mesh.

  Attributes:
    mesh: the (abstract) mesh.
    batch_axes: mesh axes the token batch is sharded on.
    expert_axes: mesh axes the experts are sharded on.
    num_experts: E.
  """

  mesh: Any
  batch_axes: tuple[str, ...]
  expert_axes: tuple[str, ...]
  num_experts: int

  @property
  def gather_axes(self) -> tuple[str, ...]:
    """Expert axes that also shard the batch: tokens are gathered on them."""
    return tuple(a for a in self.expert_axes if a in self.batch_axes)

  @property
  def sum_axes(self) -> tuple[str, ...]:
    """Expert axes the tokens are replicated on: outputs are summed on them."""
    return tuple(a for a in self.expert_axes if a not in self.batch_axes)

  @property
  def vary_axes(self) -> tuple[str, ...]:
    """Axes the body's results vary over, in mesh order."""
    used = set(self.batch_axes) | set(self.expert_axes)
    return tuple(a for a in self.mesh.axis_names if a in used)

  def size(self, axes: tuple[str, ...]) -> int:
    return math.prod(self.mesh.shape[a] for a in axes)

  @property
  def experts_per_device(self) -> int:
    """E_l, the experts each device holds."""
    return self.num_experts // self.size(self.expert_axes)


def plan(num_experts: int, batch: int) -> ExpertParallelPlan | None:
  """The plan for the current mesh and rules, or None without a mesh.

  Raises `ValueError` when the experts or the batch do not divide evenly
  over the mesh axes they are sharded on.
  """
  mesh = sharding.current_mesh()
  if mesh is None or mesh.size == 1:
    return None

  def split_axes(name):  # size-1 axes would only add no-op collectives
    return tuple(a for a in sharding.mesh_axes(name, mesh) if mesh.shape[a] > 1)

  batch_axes, expert_axes = split_axes("activation_batch"), split_axes("exp")
  if not (batch_axes or expert_axes):
    return None  # nothing is split: the plain path, replicated
  result = ExpertParallelPlan(
      mesh=mesh,
      batch_axes=batch_axes,
      expert_axes=expert_axes,
      num_experts=num_experts,
  )
  for what, n, axes in (
      ("num_experts", num_experts, expert_axes),
      ("batch size", batch, batch_axes),
  ):
    if n % result.size(axes):
      raise ValueError(
          f"The sparse MoE path shards {what}={n} over mesh axes {axes} of "
          f"total size {result.size(axes)}, which must divide it."
      )
  return result


def strategy(
    requested: str,
    ep: ExpertParallelPlan,
    tokens_per_device: int,
    emb: int,
    k: int,
    act_bytes: int,
    backend: str | None = None,
) -> str:
  """The strategy the sparse path runs: `requested` (`MoEConfig.
  expert_parallel`), "auto" resolved by `ep_traffic.choose` for this plan
  (emulated, hence "all_gather", on a CPU). "all_gather" wherever no expert
  axis splits the batch: there is nothing to exchange, and that body only
  sums the outputs over the expert axes."""
  exchange = ep.size(ep.gather_axes)
  if exchange <= 1:
    return "all_gather"
  if requested != "auto":
    return requested
  problem = ep_traffic.Problem(
      tokens=tokens_per_device,
      emb=emb,
      k=k,
      ep=exchange,
      act_bytes=act_bytes,
      experts_per_device=ep.experts_per_device,
  )
  return ep_traffic.choose(problem, emulated=needs_emulation(backend))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _per_device_copies(n: int, value: jax.Array) -> jax.Array:
  """[...] -> [n, ...] copies; the backward takes their element-wise max."""
  return jnp.broadcast_to(value[None], (n, *value.shape))


def _copies_fwd(n, value):
  return _per_device_copies(n, value), None


def _copies_bwd(n, _, g):
  del n
  return (jnp.max(g, axis=0),)


_per_device_copies.defvjp(_copies_fwd, _copies_bwd)


def _copies(n: int, value: jax.Array) -> jax.Array:
  if jnp.issubdtype(value.dtype, jnp.floating):
    return _per_device_copies(n, value)
  return jnp.broadcast_to(value[None], (n, *value.shape))


def _vary(xs, varying: tuple[str, ...], ep: ExpertParallelPlan):
  """Casts arrays that vary over `varying` to vary over all `ep.vary_axes`."""
  missing = tuple(a for a in ep.vary_axes if a not in varying)
  return jax.lax.pcast(xs, missing, to="varying") if missing else xs


def _spec(axes: tuple[str, ...], ndim: int) -> P:
  return P(axes or None, *([None] * (ndim - 1)))


# A kernel's FSDP-style shards: ((dim, mesh axes), ...) over its non-expert
# dims, on axes the body's values vary over anyway (the batch axes).
Shards = tuple[tuple[int, tuple[str, ...]], ...]


def kernel_shards(
    ep: ExpertParallelPlan, experts: Experts
) -> dict[str, Shards]:
  """{site: shards} of the kernels the body gathers itself.

  A kernel [E, ., .] whose other dims are split over batch axes (FSDP:
  "embed" on "fsdp") enters the `shard_map` split so, and the sparse path
  all-gathers it inside its rematerialized regions: the backward then
  holds a layer's gathered kernel only around its own matmuls, and
  gathers it again where it needs it, where XLA would otherwise keep the
  forward's gathered copies of wi_0 and wi_1 across the backward's peak
  (Mixtral-8x7B on a v5p-16 at 16 sequences of 4096 a chip: 3.5 GiB of
  temporaries a chip fewer). Kernels of other types (LoRA adapters, a
  stored kernel and its scales) and splits over other axes (tensor) are
  gathered at the boundary by XLA, as any weight.
  """
  axes_of = expert_weights.kernel_axes(routed=True)
  shards = {}
  for site, weight in zip(expert_weights.KERNELS, experts, strict=True):
    if not isinstance(weight, jax.Array) or weight.ndim != 3:
      continue
    found = []
    for dim, name in enumerate(axes_of[site][1:], start=1):
      axes = tuple(
          a for a in sharding.mesh_axes(name, ep.mesh) if ep.mesh.shape[a] > 1
      )
      usable = all(a in ep.batch_axes and a not in ep.expert_axes for a in axes)
      if axes and usable and weight.shape[dim] % ep.size(axes) == 0:
        found.append((dim, axes))
    if found:
      shards[site] = tuple(found)
  return shards


def _split_axes(shards: Shards) -> tuple[str, ...]:
  return tuple(a for _, axes in shards for a in axes)


def _gather_kernel(weight: jax.Array, shards: Shards) -> jax.Array:
  for dim, axes in shards:
    weight = jax.lax.all_gather(weight, axes, axis=dim, tiled=True)
  return weight


def _lifted_shard_map(fn, *, ep: ExpertParallelPlan, in_specs, out_specs):
  """`jax.shard_map` lifted over a Linen scope (non-parameter collections).

  Lifted variables enter as per-device copies sharded over `ep.vary_axes`
  (see `_per_device_copies`); RNGs enter replicated. Variables written
  inside come back from the first device.
  """
  n = ep.size(ep.vary_axes)
  copies_spec = P(ep.vary_axes)

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    copies = jax.tree.map(functools.partial(_copies, n), variable_groups)

    def body(copies, rng_groups, args):
      local = jax.tree.map(lambda v: v[0], copies)
      scope = scope_fn(local, rng_groups)
      y = fn(scope, *args)
      out_vars = jax.tree.map(lambda v: v[None], repack_fn(scope))
      return y, out_vars

    y, out_vars = jax.shard_map(
        body,
        mesh=ep.mesh,
        in_specs=(copies_spec, P(), in_specs),
        out_specs=(out_specs, copies_spec),
    )(copies, rng_groups, args)
    return y, jax.tree.map(lambda v: v[0], out_vars)

  return core_lift.pack(
      inner,
      (_LIFTED_COLLECTIONS,),
      (_LIFTED_COLLECTIONS,),
      (True,),
      name="expert_parallel",
  )


def sparse_moe(
    module: nn.Module,
    ep: ExpertParallelPlan,
    x: jax.Array,
    router: RouterResult,
    experts: Experts,
    act,
) -> jax.Array:
  """The expert-parallel sparse path of `module` (a bound `RoutedMoE`).

  x [B, S, M], router over the B*S tokens, experts = (wi_0, wi_1, wo), each
  [E, ...] -> [B, S, M]. See the module docstring for the collectives.
  """
  b, s, m = x.shape
  k = router.indices.shape[-1]
  token_spec = _spec(ep.batch_axes, 3)
  chosen = strategy(
      module.config.expert_parallel,
      ep,
      b * s // ep.size(ep.batch_axes),
      m,
      k,
      jnp.dtype(x.dtype).itemsize,
  )

  def expert_spec(weight):
    """Arrays with a leading expert axis (kernels, a stored kernel's int8
    scales) are split on it; per-tensor scales (fp8 serving) replicated."""
    return jax.tree.map(
        lambda a: _spec(ep.expert_axes, a.ndim)
        if a.ndim > 1 and a.shape[0] == ep.num_experts
        else P(),
        weight,
    )

  ragged = chosen == "ragged_all_to_all"
  gathered = bool(ep.gather_axes) and not ragged
  shards = {} if ragged else kernel_shards(ep, experts)

  def weight_spec(site, weight):
    if site not in shards:
      return expert_spec(weight)
    spec = list(_spec(ep.expert_axes, weight.ndim))
    for dim, axes in shards[site]:
      spec[dim] = axes
    return P(*spec)

  def gather_kernel(site, weight):
    if site not in shards:
      return weight
    return _gather_kernel(weight, shards[site])

  def body(mdl, x, indices, weights, wi_0, wi_1, wo):
    if gathered:
      gather = functools.partial(
          jax.lax.all_gather, axis_name=ep.gather_axes, axis=0, tiled=True
      )
      x, indices, weights = gather(x), gather(indices), gather(weights)
    # Every operand varies over all of `vary_axes`, so that custom VJPs
    # (quantized contractions) see one manual-axes type; the transpose of
    # this cast sums the weights' gradients over the batch axes (that of
    # a split kernel's all-gather, over the axes it was split on).
    x, indices, weights = _vary((x, indices, weights), ep.batch_axes, ep)
    wi_0, wi_1, wo = (
        _vary(w, ep.expert_axes + _split_axes(shards.get(site, ())), ep)
        for site, w in zip(
            expert_weights.KERNELS, (wi_0, wi_1, wo), strict=True
        )
    )
    tokens = (x.reshape(-1, m), indices.reshape(-1, k), weights.reshape(-1, k))
    if ragged:
      out = ragged_experts.ragged_experts(
          mdl.grouped,
          *tokens,
          (wi_0, wi_1, wo),
          act,
          destinations=ragged_experts.destination_experts(
              ep.expert_axes,
              ep.gather_axes,
              dict(ep.mesh.shape),
              ep.experts_per_device,
          ),
          num_experts=ep.num_experts,
          exchange_axes=ep.gather_axes,
          vary=lambda a: _vary(a, (), ep),
      )
    else:
      first = 0
      if ep.expert_axes:
        first = jax.lax.axis_index(ep.expert_axes) * ep.experts_per_device
      out = sparse_experts_remat(
          mdl,
          *tokens,
          (wi_0, wi_1, wo),
          act,
          first,
          all_experts=not ep.expert_axes,
          # A token picks an expert once: no group exceeds the tokens here.
          max_group_size=tokens[0].shape[0],
          gather=gather_kernel if shards else None,
          remat=mdl.remat_rows,
      )
    out = out.reshape(x.shape)
    if gathered:
      out = jax.lax.psum_scatter(
          out, ep.gather_axes, scatter_dimension=0, tiled=True
      )
    if ep.sum_axes:
      out = jax.lax.psum(out, ep.sum_axes)
    return out

  lifted = nn.transforms.lift_transform(
      _lifted_shard_map,
      body,
      ep=ep,
      in_specs=(token_spec,) * 3
      + tuple(
          weight_spec(site, w)
          for site, w in zip(expert_weights.KERNELS, experts, strict=True)
      ),
      out_specs=token_spec,
  )
  return lifted(
      module,
      x,
      router.indices.reshape(b, s, k),
      router.weights.reshape(b, s, k),
      *experts,
  )
