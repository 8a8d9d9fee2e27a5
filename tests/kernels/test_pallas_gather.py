"""The DMA row gather (`kernels/tpu/pallas_gather.py`), interpreted on this CPU,
against `jnp.take` bit for bit; and the sparse layer's permutation with it
(`permute` under `kernels_on_cpu("pallas")`) against XLA's gathers."""

from __future__ import annotations

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import testing
from linen_moe._src.kernels import accelerator
from linen_moe._src.kernels.tpu import pallas_gather
from linen_moe._src.layer import permute
from tests.kernels import test_kernels


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]))


_UINT = {2: jnp.uint16, 4: jnp.uint32}


class GatherRowsTest(parameterized.TestCase):

  # (dtype, table rows, width, gathered rows, valid, block rows): repeated
  # indices (more rows than the table), a partial last block, a block
  # straddling `valid`, blocks wholly past it, one block shorter than a
  # tile, nothing valid.
  @parameterized.parameters(
      (jnp.float32, 50, 128, 100, None, 32),
      (jnp.bfloat16, 50, 256, 100, None, 32),
      (jnp.float32, 40, 128, 200, 70, 64),
      (jnp.bfloat16, 40, 64, 200, 70, 64),
      (jnp.bfloat16, 9, 128, 5, None, 32),
      (jnp.float32, 9, 128, 40, 0, 32),
  )
  def test_equals_take_bit_for_bit(self, dtype, n, m, r, valid, block):
    rng = np.random.default_rng(r)
    # Bits of every kind: NaNs, infinities, signed zeros, subnormals.
    bits = rng.integers(0, 2 ** (8 * jnp.dtype(dtype).itemsize), (n, m))
    table = jax.lax.bitcast_convert_type(
        jnp.asarray(bits, _UINT[jnp.dtype(dtype).itemsize]), dtype
    )
    index = jnp.asarray(rng.integers(0, n, r), jnp.int32)
    got = pallas_gather.gather_rows(
        table, index, valid, block_rows=block, interpret=True
    )
    want = jnp.take(table, index, axis=0)
    if valid is not None:
      want = jnp.where((jnp.arange(r) < valid)[:, None], want, 0)
    self.assertEqual(got.dtype, table.dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want))

  def test_hbm_form_equals_take(self):
    table = jax.random.normal(jax.random.key(0), (30, 128))
    index = jnp.asarray(np.random.default_rng(1).integers(0, 30, 77))
    got = pallas_gather.gather_rows(
        table, index, 50, block_rows=32, via="hbm", interpret=True
    )
    want = jnp.where((jnp.arange(77) < 50)[:, None], table[index], 0)
    np.testing.assert_array_equal(got, want)

  def test_bad_arguments_name_themselves(self):
    table = jnp.zeros((8, 128))
    index = jnp.zeros((4,), jnp.int32)
    for kwargs, word in (
        (dict(block_rows=48), "block_rows"),
        (dict(via="smem"), "via"),
    ):
      with self.assertRaisesRegex(ValueError, word):
        pallas_gather.gather_rows(table, index, **kwargs)
    with self.assertRaisesRegex(ValueError, "hbm"):
      pallas_gather.gather_rows(table.astype(jnp.bfloat16), index, via="hbm")
    with self.assertRaisesRegex(ValueError, "int8"):
      pallas_gather.gather_rows(table.astype(jnp.int8), index)


class GatherScaleDotTest(parameterized.TestCase):

  # (dtype, table rows, width, gathered rows, block rows): a partial last
  # block, repeated indices, one block.
  @parameterized.parameters(
      (jnp.float32, 30, 128, 100, 32),
      (jnp.bfloat16, 30, 256, 70, 64),
      (jnp.bfloat16, 5, 128, 8, 32),
  )
  def test_equals_the_numpy_loop(self, dtype, n, m, r, block):
    rng = np.random.default_rng(n + r)
    table = jnp.asarray(rng.normal(size=(n, m)), dtype)
    other = jnp.asarray(rng.normal(size=(r, m)), dtype)
    scale = jnp.asarray(rng.uniform(-1, 1, r), dtype)
    index = rng.integers(0, n, r)
    scaled, dot = pallas_gather.gather_scale_dot(
        table,
        jnp.asarray(index, jnp.int32),
        scale,
        other,
        block_rows=block,
        interpret=True,
    )
    t, o, s = (np.asarray(a, np.float64) for a in (table, other, scale))
    want_scaled = np.stack([t[index[i]] * s[i] for i in range(r)])
    want_dot = np.array([t[index[i]] @ o[i] for i in range(r)])
    self.assertEqual((scaled.dtype, dot.dtype), (table.dtype, jnp.float32))
    # Products of the rounded inputs, in float32 (then rounded to bf16).
    tol = 1e-6 if dtype == jnp.float32 else 8e-3
    np.testing.assert_allclose(
        np.asarray(scaled, np.float64), want_scaled, rtol=tol, atol=tol
    )
    np.testing.assert_allclose(dot, want_dot, rtol=1e-5, atol=1e-4)

  def test_bad_shapes_name_themselves(self):
    table, index = jnp.zeros((4, 128)), jnp.zeros(8, jnp.int32)
    with self.assertRaisesRegex(ValueError, r"scale \[8\] and other"):
      pallas_gather.gather_scale_dot(
          table, index, jnp.zeros(7), jnp.zeros((8, 128)), interpret=True
      )


class GatherSumTest(parameterized.TestCase):

  # (dtype, table rows, width, tokens, choices, block rows): a partial last
  # block of tokens, k not a power of two, one block.
  @parameterized.parameters(
      (jnp.float32, 30, 128, 37, 3, 64),
      (jnp.bfloat16, 40, 256, 50, 8, 128),
      (jnp.bfloat16, 5, 128, 6, 2, 256),
  )
  def test_equals_the_numpy_loop(self, dtype, n, m, t, k, block):
    rng = np.random.default_rng(n + t)
    table = rng.normal(size=(n, m))
    index = rng.integers(0, n, (t, k))
    weights = rng.uniform(-1, 1, (t, k))
    # A zero weight adds nothing, even on a row of infs.
    weights[0, 0] = 0.0
    table[index[0, 0]] = np.inf
    chosen = (weights != 0)[..., None]
    table_in = jnp.asarray(table, dtype)
    got = pallas_gather.gather_sum(
        table_in,
        jnp.asarray(index, jnp.int32),
        jnp.asarray(weights, jnp.float32),
        block_rows=block,
        interpret=True,
    )
    rows = np.asarray(table_in, np.float64)[index]  # [T, k, M]
    with np.errstate(invalid="ignore"):  # inf * 0 and inf - inf: not compared
      want = np.where(chosen, rows * weights[..., None], 0).sum(axis=1)
    self.assertEqual(got.dtype, dtype)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    # Float32 sums of k products of the rounded inputs, rounded to dtype.
    tol = 1e-6 if dtype == jnp.float32 else 8e-3
    np.testing.assert_allclose(
        np.asarray(got, np.float64)[finite], want[finite], rtol=tol, atol=tol
    )

  def test_bad_shapes_name_themselves(self):
    table, index = jnp.zeros((4, 128)), jnp.zeros((8, 2), jnp.int32)
    with self.assertRaisesRegex(ValueError, r"index \[T, k\] and weights"):
      pallas_gather.gather_sum(table, index, jnp.zeros((8, 3)), interpret=True)
    with self.assertRaisesRegex(ValueError, "table"):
      pallas_gather.gather_sum(
          jnp.zeros((4, 3), jnp.bfloat16), index, jnp.zeros((8, 2))
      )


class PermuteWithKernelTest(parameterized.TestCase):
  """`dispatch_rows` / `combine_rows` forward and gradients: the same bits
  with the row gather on the kernel as with XLA's."""

  @parameterized.parameters((6, 0, True), (3, 2, False))
  def test_same_numbers(self, num_local, first, all_local):
    t, k, m = 24, 2, 128
    rng = np.random.default_rng(0)
    indices = jnp.asarray(
        np.stack([rng.choice(6, k, replace=False) for _ in range(t)]),
        jnp.int32,
    )
    weights = jnp.asarray(rng.uniform(0.1, 1, (t, k)), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (t, m))

    def loss(x, weights, implementation):
      plan = permute.sort_plan(
          indices,
          num_local,
          first,
          all_local=all_local,
          implementation=implementation,
      )
      self.assertEqual(
          plan.row_gather, "xla" if implementation is None else "pallas"
      )
      rows = permute.dispatch_rows(x, plan)
      out = permute.combine_rows(jnp.sin(rows), weights, plan)
      return jnp.sum(out * jnp.cos(x)), rows

    step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    want = step(x, weights, None)
    with testing.kernels_on_cpu("pallas"):
      got = step(x, weights, "kernel")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, b)

  def test_sparse_layer_reaches_the_kernel(self):
    # test_gmm_tiling's LayerWithPallasTest checks this layer's numbers.
    jax.clear_caches()  # every call traced here, none cached by another test
    with (
        mock.patch.object(
            pallas_gather, "gather_rows", wraps=pallas_gather.gather_rows
        ) as called,
        mock.patch.object(
            pallas_gather,
            "gather_scale_dot",
            wraps=pallas_gather.gather_scale_dot,
        ) as backward,
        mock.patch.object(
            pallas_gather, "gather_sum", wraps=pallas_gather.gather_sum
        ) as sums,
    ):
      test_kernels._layer_step("none", "kernel", "pallas")
    self.assertGreaterEqual(called.call_count, 1)  # the dispatch
    self.assertEqual(backward.call_count, 1)  # the combine's backward
    # The combine (init's forward, the step's) and the dispatch's backward.
    self.assertEqual(sums.call_count, 3)

  def test_xla_outside_the_kernels(self):
    self.assertEqual(accelerator.row_gather("kernel"), "xla")  # plain CPU
    with testing.kernels_on_cpu("pallas"):
      self.assertEqual(accelerator.row_gather("auto"), "xla")
      self.assertEqual(accelerator.row_gather("ragged_dot"), "xla")
      self.assertEqual(accelerator.row_gather("kernel"), "pallas")


if __name__ == "__main__":
  absltest.main()
