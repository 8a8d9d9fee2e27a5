"""LoRA adapters on the named contractions: declared beside their kernel,
added to the contraction's output. Knows nothing of MoE routing.

A kernel W [*lead, *K, *N] (lead: the expert axis E of routed experts, or
none; K: the axes the input contracts; N: the output axes) gets two params
beside it in the same module:

  `{name}_lora_a`  [*lead, *K, r]  initialised variance-scaling over K
  `{name}_lora_b`  [*lead, r, *N]  initialised to 0

and the contraction becomes x W + (alpha / r) (x A) B. The delta is its own
pair of float contractions, never a merged W + A B: a frozen kernel (float,
or a serving layer's stored int8 / fp8) is then only read, its contraction
keeps its quantization, and the step computes no gradient of it (the
weight-gradient contraction of W does not exist in the program; the
gradient of x does, through the quantized backward, for the adapters of
the layers below). With B = 0 the delta is exactly 0, so the output is the
base contraction's, bit for bit.

A routed layer's kernels travel to its paths as `AdaptedKernel`s (the base
plus its A and B): the dense einsum hook, the grouped-matmul hook and the
expert-parallel `shard_map` all handle them as pytrees, so the adapter rows
are split, gathered and sharded with their experts (A and B keep the
kernel's expert axis name, `exp`).
"""

from __future__ import annotations

import string
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from linen_moe._src.config.lora import LoRAConfig
from linen_moe._src.kernels import grouped_matmul as gmm_lib

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
# The dropout of the adapter's input draws from this stream (the one a
# train step always passes); without it (evaluation) there is no dropout.
DROPOUT_RNG_STREAM = "params"


@flax.struct.dataclass
class AdaptedKernel:
  """A kernel and its adapter, as one operand of a contraction hook.

  Attributes:
    base: the kernel ``[*lead, K, N]``: an array, or a serving layer's
      `StoredKernel`.
    a: ``[*lead, K, r]``, the adapter's down-projection.
    b: ``[*lead, r, N]``, its up-projection.
    scale: alpha / r.
    dropout: the dropout rate of the adapter's input.
  """

  base: Any
  a: jax.Array
  b: jax.Array
  scale: float = flax.struct.field(pytree_node=False, default=1.0)
  dropout: float = flax.struct.field(pytree_node=False, default=0.0)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.base.shape

  @property
  def dtype(self):
    return self.base.dtype


def adapter_shapes(
    shape: tuple[int, ...], lead: int, n_in: int, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(A shape, B shape) of a kernel `shape` = [*lead, *K, *N], with `lead`
  leading shared axes and `n_in` contracted axes K."""
  k_end = lead + n_in
  return (*shape[:k_end], rank), (*shape[:lead], rank, *shape[k_end:])


def declare(
    module: nn.Module,
    name: str,
    shape: tuple[int, ...],
    axis_names: tuple[str | None, ...],
    lora: LoRAConfig,
    param_dtype: Any,
    lead: int = 0,
    n_in: int = 1,
) -> tuple[jax.Array, jax.Array]:
  """Declares (or reads) `{name}_lora_a` and `{name}_lora_b` of `module`.

  Args:
    module: the Linen module that holds the kernel `name`.
    name: the kernel's name.
    shape: the kernel's shape [*lead, *K, *N].
    axis_names: the kernel's logical axis names; A and B keep those of the
      axes they share with it (the expert axis shards with its experts),
      the rank axis is unsharded.
    lora: the adapter's config.
    param_dtype: the adapters' dtype.
    lead: how many leading axes A and B share with the kernel (1: routed
      experts' E).
    n_in: how many axes after them the input contracts.

  Returns:
    (A, B) as declared: [*lead, *K, r] and [*lead, r, *N].
  """
  a_shape, b_shape = adapter_shapes(shape, lead, n_in, lora.rank)
  k_end = lead + n_in
  a_names = (*axis_names[:k_end], None)
  b_names = (*axis_names[:lead], None, *axis_names[k_end:])
  a_init = nn.initializers.variance_scaling(
      1.0,
      "fan_in",
      "truncated_normal",
      in_axis=tuple(range(lead, k_end)),
      out_axis=-1,
      batch_axis=tuple(range(lead)),
  )
  a = module.param(
      name + SUFFIX_A,
      nn.with_logical_partitioning(a_init, a_names),
      a_shape,
      param_dtype,
  )
  b = module.param(
      name + SUFFIX_B,
      nn.with_logical_partitioning(nn.initializers.zeros, b_names),
      b_shape,
      param_dtype,
  )
  return a, b


def adapted(
    module: nn.Module,
    name: str,
    base: Any,
    shape: tuple[int, ...],
    axis_names: tuple[str | None, ...],
    lora: LoRAConfig,
    param_dtype: Any,
    dtype: Any,
    lead: int = 0,
) -> AdaptedKernel:
  """`base` (a kernel [*lead, K, N] of `module` named `name`) with its
  adapter declared beside it, in the compute `dtype`."""
  a, b = declare(module, name, shape, axis_names, lora, param_dtype, lead)
  return AdaptedKernel(
      base, a.astype(dtype), b.astype(dtype), lora.scale, lora.dropout
  )


def _adapter_input(module: nn.Module, x: jax.Array, rate: float) -> jax.Array:
  """The adapter's own copy of its input: behind an optimization barrier
  (XLA would otherwise merge x A with the base's x W into one wider dot,
  whose different blocking changes the base's rounding: with B = 0 the
  output would not be the base's bit for bit), with inverted dropout when a
  rate is set and the module has the `DROPOUT_RNG_STREAM` stream
  (training)."""
  x = jax.lax.optimization_barrier(x)
  if rate <= 0 or not module.has_rng(DROPOUT_RNG_STREAM):
    return x
  keep = jax.random.bernoulli(
      module.make_rng(DROPOUT_RNG_STREAM), 1.0 - rate, x.shape
  )
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def add_delta(out: jax.Array, delta: jax.Array) -> jax.Array:
  """out + delta, materialised behind an optimization barrier: the
  consumers then fuse over one input, as they do over the base's output
  alone (fused with the add, XLA may compute them in another order), so
  with B = 0 everything after stays the base's bit for bit."""
  return jax.lax.optimization_barrier(out + delta)


def dequantized(kernel: Any, dtype: Any) -> jax.Array:
  """A stored kernel's float value in `dtype` (values times scale), or a
  float kernel as it is."""
  values = getattr(kernel, "values", None)
  if values is None:
    return kernel.astype(dtype)
  return (values.astype(jnp.float32) * kernel.scale).astype(dtype)


def frozen_input_gradient(
    out: jax.Array, lhs: jax.Array, float_contract
) -> jax.Array:
  """`out`, a frozen stored kernel's contraction of `lhs`, whose gradient
  with respect to `lhs` is the float contraction's with the dequantized
  kernel (`float_contract(x)`, linear in x).

  The stored contractions' own backward is not the one to train adapters
  through: int8's grouped matmul has none (its rounding has a zero
  derivative) and AQT poisons a served weight's. This is QLoRA's rule: the
  forward reads the stored kernel, the input's gradient the dequantized one.
  `float_contract(lhs - stop_gradient(lhs))` is exactly 0 in value (a
  product of zeros) and carries that gradient."""
  zero = float_contract(lhs - jax.lax.stop_gradient(lhs))
  return jax.lax.stop_gradient(out) + zero.astype(out.dtype)


def _fresh_letter(used: str) -> str:
  return next(c for c in string.ascii_letters if c not in used)


def einsum_delta(
    module: nn.Module,
    eqn: str,
    lhs: jax.Array,
    a: jax.Array,
    b: jax.Array,
    scale: float,
    dropout: float = 0.0,
    lead: int = 0,
) -> jax.Array:
  """scale * (lhs A) B for the einsum `eqn` = "lhs,W->out" of a kernel W
  [*lead, *K, *N] (A [*lead, *K, r], B [*lead, r, *N]).

  E.g. "BSM,EMH->BSEH", lead 1: "BSM,EMr->BSEr" then "BSEr,ErH->BSEH".
  """
  ins, out = eqn.replace(" ", "").split("->")
  x_str, w_str = ins.split(",")
  n_in = a.ndim - lead - 1
  r = _fresh_letter(eqn)
  a_str = w_str[: lead + n_in] + r
  outs = w_str[lead + n_in :]
  b_str = w_str[:lead] + r + outs
  mid = "".join(c for c in out if c not in outs) + r
  x = _adapter_input(module, lhs, dropout)
  low = jnp.einsum(f"{x_str},{a_str}->{mid}", x, a.astype(x.dtype))
  delta = jnp.einsum(f"{mid},{b_str}->{out}", low, b.astype(x.dtype))
  return (delta * scale).astype(lhs.dtype)


def grouped_delta(
    module: nn.Module,
    lhs: jax.Array,
    kernel: AdaptedKernel,
    group_sizes: jax.Array,
    implementation: str = "auto",
    max_group_size: int | None = None,
) -> jax.Array:
  """scale * (lhs A_g) B_g per row group g: lhs [R, K], A [G, K, r], B [G, r,
  N] -> [R, N] (rows past sum(group_sizes) are 0), two float grouped
  matmuls."""
  x = _adapter_input(module, lhs, kernel.dropout)

  def gmm(x, w):
    return gmm_lib.grouped_matmul(
        x,
        w.astype(x.dtype),
        group_sizes,
        implementation=implementation,
        max_group_size=max_group_size,
    )

  delta = gmm(gmm(x, kernel.a), kernel.b)
  return (delta * kernel.scale).astype(lhs.dtype)


def merged_kernel(
    kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float
) -> jax.Array:
  """W + scale * A B of a kernel [*stack, *lead, *K, *N] and its adapter
  [*stack, *lead, *K, r], [*stack, *lead, r, *N] (any stacked layer axes
  in front), in float32, cast to the kernel's dtype."""
  shared = a.ndim + b.ndim - 2 - kernel.ndim  # stacked + lead axes
  k_dims, n_dims = a.shape[shared:-1], b.shape[shared + 1 :]
  lead = a.shape[:shared]
  a2 = a.reshape(*lead, -1, a.shape[-1]).astype(jnp.float32)
  b2 = b.reshape(*lead, b.shape[shared], -1).astype(jnp.float32)
  delta = jnp.matmul(a2, b2).reshape(*lead, *k_dims, *n_dims)
  return (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)
