"""The gate and up projections as one Pallas call each way
(`pallas_gate_up`), run in Pallas interpret mode on this CPU: both
outputs, the summed input gradient and both weight gradients against the
NumPy row loop, and against two calls of `pallas_grouped`.

Imports only jax, NumPy and absl, as tests/kernels/test_tpu_kernels.py does: on a
TPU (`python -m pytest tests/kernels/test_pallas_gate_up.py -k on_tpu`),
`test_on_tpu` runs the same problems compiled by Mosaic.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.kernels.tpu import gmm_tiling
from linen_moe._src.kernels.tpu import pallas_gate_up
from linen_moe._src.kernels.tpu import pallas_gmm
from linen_moe._src.kernels.tpu import pallas_grouped
from linen_moe._src.kernels.tpu.gmm_tiling import GmmTiling
from tests import numpy_reference
from tests.kernels.test_tpu_kernels import ON_TPU
from tests.kernels.test_tpu_kernels import PROBLEMS
from tests.kernels.test_tpu_kernels import TOLERANCE


def _operands(name, dtype, seed=0):
  m, k, n, sizes, tiling = PROBLEMS[name]
  keys = jax.random.split(jax.random.key(seed), 5)
  lhs = jax.random.normal(keys[0], (m, k), dtype)
  w0, w1 = (
      jax.random.normal(key, (len(sizes), k, n), dtype) for key in keys[1:3]
  )
  d0, d1 = (jax.random.normal(key, (m, n), dtype) for key in keys[3:])
  return (lhs, w0, w1, jnp.array(sizes, jnp.int32), d0, d1), tiling


def _fwd_bwd(matmul, lhs, w0, w1, sizes, d0, d1):
  """(out0, out1, dlhs, dw0, dw1) of `matmul(lhs, w0, w1, sizes)`."""
  outs, vjp = jax.vjp(lambda x, a, b: matmul(x, a, b, sizes), lhs, w0, w1)
  return (*outs, *vjp((d0, d1)))


def _paired(tiling, interpret=True):
  def matmul(lhs, w0, w1, sizes):
    return pallas_gate_up.paired_grouped_matmul(
        lhs, w0, w1, sizes, tiling=tiling, interpret=interpret
    )

  return matmul


def _two_calls(tiling, interpret=True):
  def matmul(lhs, w0, w1, sizes):
    return tuple(
        pallas_grouped.pallas_grouped_matmul(
            lhs, w, sizes, tiling=tiling, interpret=interpret
        )
        for w in (w0, w1)
    )

  return matmul


def _oracle(lhs, w0, w1, sizes, d0, d1):
  out0, dlhs0, dw0 = numpy_reference.grouped_matmul(lhs, w0, sizes, d0)
  out1, dlhs1, dw1 = numpy_reference.grouped_matmul(lhs, w1, sizes, d1)
  return out0, out1, dlhs0 + dlhs1, dw0, dw1


class PairedGroupedMatmulTest(parameterized.TestCase):

  def check(self, problem, dtype, interpret=True):
    operands, tiling = _operands(problem, dtype)
    got = jax.jit(lambda *a: _fwd_bwd(_paired(tiling, interpret), *a))(
        *operands
    )
    calls = jax.jit(lambda *a: _fwd_bwd(_two_calls(tiling, interpret), *a))(
        *operands
    )
    oracle = _oracle(*operands)
    lhs, w0, w1, sizes, _, _ = operands
    total = int(np.sum(sizes))
    # The summed input gradient: two rounded sums where two calls round
    # each (bf16), then add.
    tol = TOLERANCE[dtype]
    for what, g, c, o, like in zip(
        ("out0", "out1", "dlhs", "dw0", "dw1"),
        got,
        calls,
        oracle,
        (lhs, lhs, lhs, w0, w1),
        strict=True,
    ):
      self.assertEqual(g.dtype, like.dtype, what)
      g64 = np.asarray(g, np.float64)
      self.assertTrue(np.all(np.isfinite(g64)), what)
      np.testing.assert_allclose(g64, o, err_msg=what, **tol)
      np.testing.assert_allclose(
          g64, np.asarray(c, np.float64), err_msg=f"{what} (two calls)", **tol
      )
      if what in ("out0", "out1", "dlhs"):
        np.testing.assert_array_equal(g64[total:], 0, f"{what}: past the total")
    empty = np.asarray(sizes) == 0
    for what, dw in (("dw0", got[3]), ("dw1", got[4])):
      np.testing.assert_array_equal(np.asarray(dw)[empty], 0, what)

  @parameterized.parameters(
      ("ragged", jnp.float32),
      ("split", jnp.float32),
      ("skewed", jnp.bfloat16),
  )
  def test_equals_numpy_and_two_calls(self, problem, dtype):
    self.check(problem, dtype)

  @absltest.skipUnless(ON_TPU, "compiles the kernels for the TPU it runs on")
  @parameterized.product(
      problem=tuple(PROBLEMS), dtype=(jnp.float32, jnp.bfloat16)
  )
  def test_on_tpu(self, problem, dtype):
    self.check(problem, dtype, interpret=False)

  def test_default_tiles_and_empty_dimensions(self):
    (lhs, w0, w1, sizes, _, _), _ = _operands("whole", jnp.float32)
    got = pallas_gate_up.paired_grouped_matmul(
        lhs, w0, w1, sizes, interpret=True
    )
    for out, w in zip(got, (w0, w1), strict=True):
      want = numpy_reference.grouped_matmul(lhs, w, sizes, np.zeros(out.shape))[
          0
      ]
      np.testing.assert_allclose(out, want, **TOLERANCE[jnp.float32])
    empty = pallas_gate_up.paired_grouped_matmul(
        jnp.zeros((0, 8)),
        jnp.zeros((2, 8, 4)),
        jnp.zeros((2, 8, 4)),
        jnp.array([0, 0]),
    )
    self.assertEqual([e.shape for e in empty], [(0, 4), (0, 4)])

  @parameterized.named_parameters(
      ("shapes", dict(w1=(2, 24, 48)), ValueError, "one shape"),
      ("dtypes", dict(w1_dtype=jnp.bfloat16), TypeError, "one dtype"),
      ("lhs", dict(lhs=(40, 16)), ValueError, "lhs"),
      ("sizes", dict(sizes=[30, 20]), ValueError, "past the 40 rows"),
  )
  def test_bad_input(self, change, error, message):
    shapes = dict(lhs=(40, 24), w0=(2, 24, 40), w1=(2, 24, 40))
    shapes.update({k: v for k, v in change.items() if k in shapes})
    w1 = jnp.ones(shapes["w1"], change.get("w1_dtype", jnp.float32))
    sizes = jnp.array(change.get("sizes", [10, 20]), jnp.int32)
    with self.assertRaisesRegex(error, message):
      pallas_gate_up.paired_grouped_matmul(
          jnp.ones(shapes["lhs"]), jnp.ones(shapes["w0"]), w1, sizes
      )


class PairedTilingTest(absltest.TestCase):

  def test_vmem_counts_both_weights(self):
    tiling = GmmTiling(
        gmm=(512, 2048, 768), gmm_t=(512, 768, 2048), tgmm=(512, 2048, 768)
    )
    # The forward (one call a weight): the lhs [512, 2048], a weight
    # [2048, 768] and an output [512, 768] (bf16, double-buffered), and a
    # float32 product and accumulator (512-row tiles are split in 128-row
    # blocks).
    tm, tc, to = tiling.gmm
    forward = 2 * 2 * (tm * tc + tc * to + tm * to)
    forward += 2 * tm * to * 4
    # The input gradient: two of each operand [512, 768] and [2048, 768],
    # one output [512, 2048], its float32 product and accumulator.
    tm, tc, to = tiling.gmm_t
    gradient = 2 * 2 * (2 * tm * tc + 2 * tc * to + tm * to)
    gradient += 2 * tm * to * 4
    bf16 = [jnp.bfloat16] * 3
    self.assertEqual(pallas_gmm.gmm_vmem_bytes(tiling.gmm, *bf16, 1), forward)
    self.assertEqual(
        pallas_gmm.gmm_vmem_bytes(tiling.gmm_t, *bf16, 1, pairs=(2, 2)),
        gradient,
    )
    # The weight gradients, the largest: the lhs [512, 2048] (and its
    # transpose), two cotangents [512, 768] and two outputs [2048, 768]
    # (bf16, double-buffered), per output a float32 product and accumulator.
    tm, tk, tn = tiling.tgmm
    weights = 2 * 2 * (tm * tk + 2 * tm * tn + 2 * tk * tn) + 2 * tm * tk
    weights += 2 * 2 * tk * tn * 4
    self.assertEqual(
        pallas_gmm.tgmm_vmem_bytes(tiling.tgmm, *bf16, outputs=2), weights
    )
    self.assertGreater(weights, max(forward, gradient))
    self.assertEqual(
        pallas_gate_up.paired_vmem_bytes(tiling, 2048, 768, jnp.bfloat16),
        weights,
    )

  def test_smaller_tile(self):
    self.assertEqual(pallas_gate_up.smaller_tile(1024, 2048), 512)
    self.assertEqual(pallas_gate_up.smaller_tile(2048, 2048), 1024)
    self.assertEqual(pallas_gate_up.smaller_tile(1408, 5632), 512)
    self.assertIsNone(pallas_gate_up.smaller_tile(128, 2048))

  def test_the_backward_takes_k_tiles_one_step_smaller(self):
    bf16 = jnp.bfloat16
    for m, k, n, g in (
        (131072, 2048, 768, 128),
        (32768, 2048, 5632, 8),
        (32768, 4096, 14336, 8),
        (64, 128, 256, 4),  # K tiles of 128: none smaller, kept
    ):
      single = gmm_tiling.choose_tiling(m, k, n, g, bf16, "v5e")
      paired = pallas_gate_up.paired_tiling(m, k, n, g, bf16, "v5e")
      (bm, bn, bk), (cm, ck, cn) = single.gmm_t, single.tgmm
      below = [t for t in range(128, bk, 128) if k % t == 0]
      self.assertEqual(paired.gmm, single.gmm)  # the forward: two calls
      self.assertEqual(paired.gmm_t, (bm, bn, max(below, default=bk)))
      below = [t for t in range(128, ck, 128) if k % t == 0]
      self.assertEqual(paired.tgmm, (cm, max(below, default=ck), cn))
      self.assertEqual(
          paired.vmem_limit_bytes,
          single.vmem_limit_bytes
          or gmm_tiling.vmem_limit(
              pallas_gate_up.paired_vmem_bytes(paired, k, n, bf16), "v5e"
          ),
      )


if __name__ == "__main__":
  absltest.main()
