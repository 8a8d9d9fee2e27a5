"""Random grouped-matmul operands and a forward + backward, shared by the
kernel tests (imports no flax: tests/kernels/test_tpu_kernels.py runs where only
jax is installed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def operands(m, k, n, sizes, dtype=jnp.float32, seed=0):
  """lhs [M, K], rhs [G, K, N], <int32>[G] sizes, a cotangent [M, N]."""
  keys = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(keys[0], (m, k), dtype)
  rhs = jax.random.normal(keys[1], (len(sizes), k, n), dtype)
  dout = jax.random.normal(keys[2], (m, n), dtype)
  return lhs, rhs, jnp.array(sizes, jnp.int32), dout


def fwd_bwd(matmul, lhs, rhs, group_sizes, dout):
  """(out, dlhs, drhs) of `matmul(lhs, rhs, group_sizes)` at `dout`."""
  out, vjp = jax.vjp(lambda x, w: matmul(x, w, group_sizes), lhs, rhs)
  return (out, *vjp(dout))
