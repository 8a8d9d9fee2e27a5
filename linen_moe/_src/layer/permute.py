"""Token rows into expert order and back, with gather-only gradients.

Shapes: T tokens, k choices per token, A = T * k assignments (token-major:
assignment a = t * k + j is choice j of token t), M the row width, E_l the
experts held here, R sorted rows.

The sparse path sorts assignments by expert, runs grouped matmuls on the
sorted rows, then weights and sums each token's results. Written with plain
indexing, autodiff turns both gathers into scatter-adds into zero buffers of
the gathered size ([R, M] for the combine), and the weighted sum materialises
an [A, M] product. Here both directions are gathers: sorting is a
permutation (each assignment has at most one sorted row), so the transpose of
"gather by `order`" is "gather by its inverse `position`", and the k choices
of a token are summed inside the gather's own fusion. Nothing of size [R, M]
is zero-initialised or scattered.

Where the layer runs kernels on a TPU (`grouped_matmul` "kernel" or "auto":
`SortPlan.row_gather` is "pallas"), the [R, M] row gathers (the dispatch,
and the combine's backward) move rows by DMA (`kernels/tpu/pallas_gather.py`):
XLA's TPU gather reaches ~0.3 of a v5e's HBM roofline there; the
combine's backward also weights the gathered rows and takes their dot
products with the expert outputs in the same kernel
(`pallas_gather.gather_scale_dot`), and each token's k rows of the
combine and of the dispatch's backward are gathered and summed in one
kernel (`pallas_gather.gather_sum`, where XLA runs k gathers of [T, M]).
Same numbers: a gather copies bits, and the products are the same float32
products (the k-row sums are float32 sums, where XLA sums in the rows'
dtype).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from linen_moe._src.kernels import accelerator
from linen_moe._src.layer import index_ops


@flax.struct.dataclass
class SortPlan:
  """Where each assignment goes in expert order.

  Attributes:
    whole_order: <int32>[A] the assignments sorted by local expert (the
      other experts' last); its first R are the sorted rows' (`order`).
    position: <int32>[A] the sorted row of each assignment (a permutation
      of 0 .. A - 1: the rows past R are the assignments no row holds, all
      of other experts); meaningful where `is_local`.
    is_local: <bool>[A] the assignment's expert is one held here.
    group_sizes: <int32>[E_l] rows per local expert, in expert order.
    choices: k (static).
    all_local: (static) every assignment is local, so every sorted row is
      valid and no row needs masking.
    row_gather: (static) "xla", or "pallas" for the DMA row gather
      (`accelerator.row_gather`).
    scalar_method: (static) how vectors of assignments are permuted
      (`index_ops`): "gather", or "sort" (on a TPU).
    rows: (static) R.
  """

  whole_order: jax.Array
  position: jax.Array
  is_local: jax.Array
  group_sizes: jax.Array
  rows: int = flax.struct.field(pytree_node=False)
  choices: int = flax.struct.field(pytree_node=False, default=1)
  all_local: bool = flax.struct.field(pytree_node=False, default=False)
  row_gather: str = flax.struct.field(pytree_node=False, default="xla")
  scalar_method: str = flax.struct.field(pytree_node=False, default="gather")

  @property
  def order(self) -> jax.Array:
    """<int32>[R] the assignment in each sorted row; rows at and past
    `sum(group_sizes)` hold other experts' assignments, and are masked."""
    return self.whole_order[: self.rows]

  @property
  def num_tokens(self) -> int:
    """T."""
    return self.position.shape[0] // self.choices

  def valid_rows(self) -> jax.Array:
    """<bool>[R]: sorted rows that hold a local assignment."""
    return jnp.arange(self.rows) < jnp.sum(self.group_sizes)

  def to_sorted(self, values: jax.Array) -> jax.Array:
    """[A] per assignment -> [R]: row r's assignment's value
    (`values[order]`)."""
    if self.scalar_method == "gather":
      return values[self.order]
    return index_ops.take_by_inverse(values, self.position)[: self.rows]

  def from_sorted(self, values: jax.Array) -> jax.Array:
    """[R] per sorted row -> [A]: each assignment's row's value (0 for the
    assignments no row holds)."""
    padded = jnp.pad(values, (0, self.position.shape[0] - self.rows))
    if self.scalar_method == "gather":
      return padded[self.position]
    return index_ops.take_by_inverse(padded, self.whole_order)


def sort_plan(
    indices: jax.Array,
    num_local: int,
    first_expert: jax.Array | int = 0,
    rows: int | None = None,
    all_local: bool = False,
    implementation: str | None = None,
    scalar_method: str | None = None,
) -> SortPlan:
  """Sorts the assignments `indices` <int>[T, k] by local expert.

  Experts [first_expert, first_expert + num_local) are local. `rows` (R,
  default T * min(k, num_local)) must hold every local assignment; it does
  when each token's k experts are distinct, as top-k guarantees.
  `all_local` says that the local experts are all the experts the indices
  pick from (then every one of the T * k sorted rows is valid).
  `implementation` is the layer's `grouped_matmul` setting: it decides how
  the rows are gathered (`accelerator.row_gather`); None for XLA's gather.
  `scalar_method` says how vectors of assignments are permuted and counted
  (`index_ops.METHODS`); None: the platform's (`index_ops.platform_method`).
  """
  if scalar_method is None:
    scalar_method = index_ops.platform_method()
  if scalar_method not in index_ops.METHODS:
    raise ValueError(
        f"scalar_method must be one of {index_ops.METHODS} or None; got"
        f" {scalar_method!r}."
    )
  t, k = indices.shape
  if rows is None:
    rows = t * min(k, num_local)
  flat = indices.reshape(-1) - first_expert  # [A] local expert ids
  is_local = (flat >= 0) & (flat < num_local)
  key = jnp.where(is_local, flat, num_local)
  whole = index_ops.argsort(key)  # [A]
  counts = index_ops.counts(key, num_local, scalar_method)
  return SortPlan(
      whole_order=whole,
      position=index_ops.invert(whole, scalar_method),
      is_local=is_local,
      group_sizes=counts,
      rows=rows,
      choices=k,
      all_local=all_local and rows == t * k,
      row_gather=(
          "xla"
          if implementation is None
          else accelerator.row_gather(implementation)
      ),
      scalar_method=scalar_method,
  )


def _gather_sum(
    rows: jax.Array, plan: SortPlan, weights: jax.Array | None
) -> jax.Array:
  """[R, M] -> [T, M]: out[t] = sum_j w[t, j] * rows[position[t * k + j]]
  over local choices (w = 1 when `weights` is None)."""
  t, k = plan.num_tokens, plan.choices
  position = plan.position.reshape(t, k)
  is_local = plan.is_local.reshape(t, k)
  if plan.row_gather == "pallas":  # the k gathered [T, M] never in HBM
    w = is_local.astype(jnp.float32)
    if weights is not None:
      w = w * weights.astype(rows.dtype).astype(jnp.float32)
    return accelerator.gather_sum(rows, position, w)
  out = None
  for j in range(k):  # k gathers of [T, M], summed in one fusion
    w = is_local[:, j].astype(rows.dtype)
    if weights is not None:
      w = w * weights[:, j].astype(rows.dtype)
    term = rows[position[:, j]] * w[:, None]
    out = term if out is None else out + term
  return out


def _gather_rows(x: jax.Array, plan: SortPlan) -> jax.Array:
  """[T, M] -> [R, M]: row r is x[token of order[r]], 0 where not valid."""
  if plan.row_gather == "pallas":
    valid = None if plan.all_local else jnp.sum(plan.group_sizes)
    return accelerator.gather_rows(x, plan.order // plan.choices, valid)
  rows = x[plan.order // plan.choices]
  if plan.all_local:  # a pass over [R, M] saved
    return rows
  return jnp.where(plan.valid_rows()[:, None], rows, 0)


@jax.custom_vjp
def dispatch_rows(x: jax.Array, plan: SortPlan) -> jax.Array:
  """[T, M] tokens -> [R, M] rows in expert order (0 past the local rows)."""
  return _gather_rows(x, plan)


def _dispatch_fwd(x, plan):
  return _gather_rows(x, plan), plan


def _dispatch_bwd(plan, g):
  # Each token's gradient sums the rows its local choices went to.
  return _gather_sum(g, plan, None), None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine_rows(
    rows: jax.Array, weights: jax.Array, plan: SortPlan
) -> jax.Array:
  """[R, M] expert outputs, <float>[T, k] weights -> [T, M].

  out[t] = sum over local choices j of weights[t, j] * rows[sorted row of
  (t, j)]; other experts' choices contribute 0.
  """
  return _gather_sum(rows, plan, weights)


def _combine_fwd(rows, weights, plan):
  return _gather_sum(rows, plan, weights), (rows, weights, plan)


def _combine_bwd(residuals, g):
  rows, weights, plan = residuals
  tokens = plan.order // plan.choices  # [R]: each row's token
  # drows[r] = w(a) * g[token(a)] for a = order[r]; rows holding no local
  # assignment (every row past sum(group_sizes): the sort puts the other
  # experts' assignments last) get w = 0.
  w = plan.to_sorted(jnp.where(plan.is_local, weights.reshape(-1), 0))
  w = w.astype(g.dtype)
  # dweights(a) = <g[token(a)], rows[position(a)]>, summed in sorted order.
  if plan.row_gather == "pallas":  # g's rows never land in HBM
    drows, per_row = accelerator.gather_scale_dot(g, tokens, w, rows)
  else:
    g_sorted = g[tokens]  # [R, M]: each row's token cotangent
    drows = g_sorted * w[:, None]
    per_row = jnp.sum(
        g_sorted.astype(jnp.float32) * rows.astype(jnp.float32), axis=1
    )  # [R]
  dweights = jnp.where(plan.is_local, plan.from_sorted(per_row), 0)
  return (
      drows.astype(rows.dtype),
      dweights.reshape(weights.shape).astype(weights.dtype),
      None,
  )


combine_rows.defvjp(_combine_fwd, _combine_bwd)


def _take_or_zero(src: jax.Array, index: jax.Array) -> jax.Array:
  rows = src[jnp.clip(index, 0, src.shape[0] - 1)]
  return jnp.where((index >= 0)[:, None], rows, 0)


@jax.custom_vjp
def take_injective(
    src: jax.Array, index: jax.Array, inverse: jax.Array
) -> jax.Array:
  """Rows of `src` [N, M] picked by `index` <int>[R] -> [R, M], 0 where -1.

  `index` picks each source row at most once, and `inverse` <int>[N] says
  which output row took source row a (-1 for none): the two index arrays of
  one partial permutation. The gradient is then a gather by `inverse`, not a
  scatter-add.
  """
  return _take_or_zero(src, index)


def _take_fwd(src, index, inverse):
  return _take_or_zero(src, index), inverse


def _take_bwd(inverse, g):
  return _take_or_zero(g, inverse), None, None


take_injective.defvjp(_take_fwd, _take_bwd)
