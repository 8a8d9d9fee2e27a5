"""`jax.lax.ragged_all_to_all`, and an exact emulation of it for XLA:CPU.

XLA:CPU does not implement the op (jax 0.12: "HLO opcode
`ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"; lowering
works, compiling fails). `ragged_all_to_all` here runs the real op on GPU
and TPU and, on a CPU, `emulated_ragged_all_to_all`: the op's definition
written with collectives XLA:CPU has, same operands, same result, so that the
programs the tests run on CPU devices are the device programs with one op
swapped.

The definition (`jax.lax.ragged_all_to_all`'s docstring): over an axis of D
devices, with K = len(input_offsets) = D * P slices (P per destination),
slice i of `operand`, rows [input_offsets[i], input_offsets[i] +
send_sizes[i]), goes to device i // P; there it is written into `output` at
rows [o, o + recv_sizes[j]), where o = all_to_all(output_offsets)[j] and j =
source * P + i % P indexes what that device receives. Rows of `output` that
nothing is written to keep their value.

The emulation sends, for each slice, the N rows from its offset (the
slice and what follows it), exchanges the [K, N, ...] buffer with one
`all_to_all`, and writes the first recv_sizes rows of each with one gather. It moves D times the operand per call, against the real op's
sum(send_sizes) rows: a CPU stand-in for tests, never a strategy (the
traffic model, `linen_moe._src.parallel.ep_traffic`, counts it so).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from linen_moe._src.kernels.platform import target_platform


def needs_emulation(backend: str | None = None) -> bool:
  """True where XLA does not implement `ragged_all_to_all` (the CPU)."""
  return (backend or target_platform()) == "cpu"


def emulated_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name,
) -> jax.Array:
  """`jax.lax.ragged_all_to_all`'s result, from `all_to_all` and gathers.

  Args:
    operand: [N, ...] the rows to send.
    output: [O, ...] what the result holds where nothing is received.
    input_offsets, send_sizes, output_offsets, recv_sizes: <int>[K], K a
      multiple of the axis size; see the module docstring.
    axis_name: the mapped axis (or tuple of axes).

  Returns:
    [O, ...], as the op defines it. Differentiable in `operand` and `output`.
  """
  n, o = operand.shape[0], output.shape[0]
  k = input_offsets.shape[0]
  rows = lax.iota(jnp.int32, n)
  # [K, N]: slice i's rows and what follows them. The receiver writes only
  # the first recv_sizes of them, which the op requires to be the sender's
  # send_sizes: nothing past a slice is ever written, so none is masked.
  del send_sizes
  source = input_offsets[:, None].astype(jnp.int32) + rows[None, :]
  packed = jnp.take(operand, jnp.clip(source, 0, n - 1), axis=0)
  # Chunk s of the result came from device s: slices s * P ... s * P + P - 1
  # of what it sent here, in the receiver's numbering j.
  received = lax.all_to_all(packed, axis_name, 0, 0, tiled=True)  # [K, N, ...]
  starts = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # [K]
  out_rows = lax.iota(jnp.int32, o)
  inside = (out_rows[None, :] >= starts[:, None]) & (
      out_rows[None, :] < (starts + recv_sizes)[:, None]
  )  # [K, O]
  # The op writes slices in order: where two overlap, the later one stays.
  last = (k - 1) - jnp.argmax(inside[::-1], axis=0)  # [O]
  within = jnp.clip(out_rows - starts[last], 0, n - 1)
  flat = received.reshape(k * n, *operand.shape[1:])
  values = jnp.take(flat, last * n + within, axis=0)  # [O, ...]
  written = jnp.any(inside, axis=0)
  return jnp.where(
      written.reshape(o, *(1,) * (operand.ndim - 1)), values, output
  )


def ragged_all_to_all(*args, axis_name, emulate: bool | None = None):
  """`jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
  output_offsets, recv_sizes, axis_name=...)`, emulated where XLA lacks it
  (`emulate=None`: on a CPU) or when `emulate` says so."""
  if emulate is None:
    emulate = needs_emulation()
  op = emulated_ragged_all_to_all if emulate else lax.ragged_all_to_all
  return op(*args, axis_name=axis_name)
