"""Per-expert biases (GPT-OSS), carried with their kernel through every path.

A routed layer with `MoEConfig.expert_bias` hands each path its kernels as
`BiasedKernel(kernel, bias)`: one pytree, so every path moves it as it
moves a kernel (sliced by expert under expert parallelism, gathered by
expert at decode sizes) and never needs to know. The layer's contraction
hooks (`RoutedMoE.einsum`, `RoutedMoE.grouped`) take the bias off, contract
the kernel (float, quantized, stored or adapted, as any kernel) and add the
bias to the result: on the dense paths broadcast along the output's expert
and feature axes (`einsum_bias`), on the grouped paths one row of it per
sorted row of its group (`rows_bias`). The down projection's bias is then
part of the expert's output, inside the routing weight's product, as
transformers computes it.

Shapes: E experts (the local ones), N a projection's output width, R
sorted rows.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class BiasedKernel:
  """A routed kernel and its bias, as one operand of a contraction hook.

  Attributes:
    base: the kernel [E, K, N] (an array, a stored kernel, an adapted
      kernel).
    bias: <float>[E, N].
  """

  base: Any
  bias: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return self.base.shape

  @property
  def dtype(self):
    return self.base.dtype


def split(rhs: Any) -> tuple[Any, jax.Array | None]:
  """(kernel, bias) of a hook's operand; bias None for a plain one."""
  if isinstance(rhs, BiasedKernel):
    return rhs.base, rhs.bias
  return rhs, None


def einsum_bias(eqn: str, bias: jax.Array) -> jax.Array:
  """`bias` [E, N] shaped to broadcast against the output of `eqn`, whose
  right operand is the kernel "E...N" (e.g. "BSM,EMH->BSEH": [1, 1, E, H];
  "EBCM,EMH->EBCH": [E, 1, 1, H])."""
  ins, out = eqn.replace(" ", "").split("->")
  kernel = ins.split(",")[1]
  e, n = kernel[0], kernel[-1]
  if out.index(e) > out.index(n):
    raise ValueError(f"{eqn!r}: the expert axis must come before {n!r}.")
  shape = [
      bias.shape[0] if c == e else bias.shape[1] if c == n else 1 for c in out
  ]
  return bias.reshape(shape)


def rows_bias(bias: jax.Array, group_sizes: jax.Array, rows: int) -> jax.Array:
  """[R, N]: row r the bias of its group's expert, for rows sorted by group
  (`group_sizes` <int>[E]); rows past the groups get the last expert's
  (they are masked by the caller)."""
  return jnp.repeat(bias, group_sizes, axis=0, total_repeat_length=rows)
