"""Scalar index operations of the routing and the sort, written the way each
platform runs them fast.

On a TPU, XLA runs a gather or scatter of ~10^5 scalars slowly: at a
Qwen3-30B-A3B layer's 262,144 assignments (8 x 4096 tokens, top-8 of 128)
a v5e took 2.3 ms for the expert counts' scatter-add, 2.6 ms for the
chosen scores' `take_along_axis`, 1.2 ms for the sort's inverse
permutation (a scatter) and 2.1-2.5 ms for each permutation of a vector in
the combine's backward (benchmarks/device/README.md's profile), where the
whole argsort of those assignments took 0.22 ms. So on a TPU ("sort"):
counts are a fused compare-and-sum, a pick from a short last axis a
one-hot select-and-sum (whose gradient is dense, not a scatter-add), and a
permutation or its inverse one more sort. On a CPU ("gather") plain
indexing is the fast way (the compare-and-sum over [262144, 129] took
200 ms there, bincount 0.3 ms), and stays. Both compute the same values.

`method` is "sort" or "gather"; `platform_method()` says which the
platform being traced for takes.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from linen_moe._src.kernels.platform import target_platform

METHODS = ("gather", "sort")


def platform_method() -> str:
  """ "sort" where the program is traced for a TPU, else "gather"."""
  return "sort" if target_platform() == "tpu" else "gather"


def _check(method: str) -> None:
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}; got {method!r}.")


def counts(values: jax.Array, length: int, method: str) -> jax.Array:
  """<int32>[length]: how many of `values` (<int>, any shape) equal each of
  0 .. length - 1 (others are not counted)."""
  _check(method)
  flat = values.reshape(-1)
  if method == "gather":
    inside = (flat >= 0) & (flat < length)
    return jnp.bincount(jnp.where(inside, flat, length), length=length + 1)[
        :length
    ].astype(jnp.int32)
  ids = jnp.arange(length, dtype=flat.dtype)
  return jnp.sum(flat[:, None] == ids, axis=0, dtype=jnp.int32)


def pick(table: jax.Array, indices: jax.Array, method: str) -> jax.Array:
  """[T, k]: `table` [T, E] at `indices` <int>[T, k] along its last axis
  (`jnp.take_along_axis(table, indices, axis=-1)`; indices in [0, E))."""
  _check(method)
  if method == "gather":
    return jnp.take_along_axis(table, indices, axis=-1)
  ids = jnp.arange(table.shape[-1], dtype=indices.dtype)
  hit = indices[..., None] == ids  # [T, k, E]
  return jnp.sum(jnp.where(hit, table[..., None, :], 0), axis=-1)


def argsort(keys: jax.Array) -> jax.Array:
  """<int32>[N]: the stable argsort of `keys` <int>[N]."""
  iota = lax.iota(jnp.int32, keys.shape[0])
  return lax.sort((keys, iota), num_keys=1, is_stable=True)[1]


def invert(perm: jax.Array, method: str) -> jax.Array:
  """<int32>[N]: the inverse of the permutation `perm` <int>[N] of
  0 .. N - 1 (out[perm[i]] = i)."""
  _check(method)
  n = perm.shape[0]
  iota = lax.iota(jnp.int32, n)
  if method == "gather":
    return jnp.zeros(n, jnp.int32).at[perm].set(iota, unique_indices=True)
  return argsort(perm.astype(jnp.int32))


def take_by_inverse(values: jax.Array, inverse: jax.Array) -> jax.Array:
  """[N]: `values[perm]` for the permutation `perm` of 0 .. N - 1 whose
  inverse is `inverse` <int>[N], by one sort (`values` sorted by
  `inverse`): the "sort" method's gather. The "gather" method indexes
  `values[perm]` itself."""
  return lax.sort((inverse.astype(jnp.int32), values), num_keys=1)[1]
