"""The gated down projection on the Pallas kernels (`pallas_gated`), run in
Pallas interpret mode on this CPU: product(gate, up) x rhs, its gate, up
and weight gradients against a NumPy loop written from the formulas, and
against the unfused path (the product in XLA, then `pallas_grouped`).

Imports only jax, NumPy and absl, as tests/test_tpu_kernels.py does: on a
TPU (`python -m tests.test_pallas_gated`), `test_on_tpu` runs the same
problems compiled by Mosaic.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.kernels import pallas_gated
from linen_moe._src.kernels import pallas_grouped
from linen_moe._src.kernels.gmm_tiling import GmmTiling
from tests import numpy_reference
from tests.test_tpu_kernels import ON_TPU
from tests.test_tpu_kernels import PROBLEMS
from tests.test_tpu_kernels import TOLERANCE

_LIMIT = 1.5  # the clamped product's limit, inside the operands' range


def silu_product(gate, up):
  return jax.nn.silu(gate) * up


def clamped_product(gate, up):
  """GPT-OSS's shape of product: both branches clamped (kinks inside the
  operands' range), alpha 1.702."""
  gate = jnp.minimum(gate, _LIMIT)
  return (
      gate * jax.nn.sigmoid(1.702 * gate) * (jnp.clip(up, -_LIMIT, _LIMIT) + 1)
  )


def _numpy_product(name, gate, up):
  """(h, dh/dgate, dh/dup) in float64, from the formulas."""
  if name == "silu":
    s = 1 / (1 + np.exp(-gate))
    act, dact = gate * s, s * (1 + gate * (1 - s))
    return act * up, dact * up, act
  g = np.minimum(gate, _LIMIT)
  s = 1 / (1 + np.exp(-1.702 * g))
  act = g * s
  dact = np.where(gate < _LIMIT, s + 1.702 * g * s * (1 - s), 0.0)
  lin = np.clip(up, -_LIMIT, _LIMIT) + 1
  dlin = np.where(np.abs(up) < _LIMIT, 1.0, 0.0)
  return act * lin, dact * lin, act * dlin


PRODUCTS = {"silu": silu_product, "clamped": clamped_product}


def _operands(name, dtype, seed=0):
  m, h, n, sizes, tiling = PROBLEMS[name]
  keys = jax.random.split(jax.random.key(seed), 4)
  gate = jax.random.normal(keys[0], (m, h), dtype)
  up = jax.random.normal(keys[1], (m, h), dtype)
  rhs = jax.random.normal(keys[2], (len(sizes), h, n), dtype)
  dout = jax.random.normal(keys[3], (m, n), dtype)
  return (gate, up, rhs, jnp.array(sizes, jnp.int32), dout), tiling


def _fwd_bwd(matmul, gate, up, rhs, sizes, dout):
  out, vjp = jax.vjp(lambda a, b, w: matmul(a, b, w, sizes), gate, up, rhs)
  return (out, *vjp(dout))


def _fused(product, tiling, interpret=True):
  def matmul(gate, up, rhs, sizes):
    return pallas_gated.gated_grouped_matmul(
        gate, up, rhs, sizes, product, tiling=tiling, interpret=interpret
    )

  return matmul


def _unfused(product, tiling, interpret=True):
  def matmul(gate, up, rhs, sizes):
    return pallas_grouped.pallas_grouped_matmul(
        product(gate, up), rhs, sizes, tiling=tiling, interpret=interpret
    )

  return matmul


def _oracle(name, gate, up, rhs, sizes, dout):
  gate, up = (np.asarray(x, np.float64) for x in (gate, up))
  hidden, dgate_dh, dup_dh = _numpy_product(name, gate, up)
  out, dh, drhs = numpy_reference.grouped_matmul(hidden, rhs, sizes, dout)
  return out, dh * dgate_dh, dh * dup_dh, drhs


class GatedGroupedMatmulTest(parameterized.TestCase):

  def check(self, product, problem, dtype, interpret=True):
    operands, tiling = _operands(problem, dtype)
    fn = PRODUCTS[product]
    got = jax.jit(lambda *a: _fwd_bwd(_fused(fn, tiling, interpret), *a))(
        *operands
    )
    unfused = jax.jit(lambda *a: _fwd_bwd(_unfused(fn, tiling, interpret), *a))(
        *operands
    )
    oracle = _oracle(product, *operands)
    gate, up, rhs, sizes, _ = operands
    total = int(np.sum(sizes))
    tol = TOLERANCE[dtype]
    for what, g, u, o, like in zip(
        ("out", "dgate", "dup", "drhs"),
        got,
        unfused,
        oracle,
        (gate, gate, up, rhs),
        strict=True,
    ):
      self.assertEqual(g.dtype, like.dtype, what)
      g64 = np.asarray(g, np.float64)
      self.assertTrue(np.all(np.isfinite(g64)), what)
      np.testing.assert_allclose(g64, o, err_msg=what, **tol)
      np.testing.assert_allclose(
          g64, np.asarray(u, np.float64), err_msg=f"{what} (unfused)", **tol
      )
      if what != "drhs":
        np.testing.assert_array_equal(g64[total:], 0, f"{what}: past the total")
    empty = np.asarray(sizes) == 0
    np.testing.assert_array_equal(np.asarray(got[3])[empty], 0, "empty groups")

  @parameterized.parameters(
      ("silu", "ragged", jnp.float32),
      ("clamped", "split", jnp.float32),
      ("silu", "skewed", jnp.bfloat16),
  )
  def test_equals_numpy_and_the_unfused_path(self, product, problem, dtype):
    self.check(product, problem, dtype)

  @absltest.skipUnless(ON_TPU, "compiles the kernels for the TPU it runs on")
  @parameterized.product(
      product=tuple(PRODUCTS),
      problem=tuple(PROBLEMS),
      dtype=(jnp.float32, jnp.bfloat16),
  )
  def test_on_tpu(self, product, problem, dtype):
    self.check(product, problem, dtype, interpret=False)

  def test_default_tiles_and_empty_groups(self):
    (gate, up, rhs, sizes, _), _ = _operands("whole", jnp.float32)
    got = pallas_gated.gated_grouped_matmul(
        gate, up, rhs, sizes, silu_product, interpret=True
    )
    want = numpy_reference.grouped_matmul(
        silu_product(gate, up), rhs, sizes, np.zeros((gate.shape[0], 40))
    )[0]
    np.testing.assert_allclose(got, want, **TOLERANCE[jnp.float32])
    empty = pallas_gated.gated_grouped_matmul(
        jnp.zeros((0, 8)),
        jnp.zeros((0, 8)),
        jnp.zeros((2, 8, 4)),
        jnp.array([0, 0]),
        silu_product,
    )
    self.assertEqual(empty.shape, (0, 4))

  @parameterized.named_parameters(
      ("shapes", dict(up=(40, 16)), ValueError, "one shape"),
      ("dtypes", dict(up_dtype=jnp.bfloat16), TypeError, "one dtype"),
      ("rhs", dict(rhs=(2, 8, 4)), ValueError, "rhs"),
      ("sizes", dict(sizes=[30, 20]), ValueError, "past the 40 rows"),
  )
  def test_bad_input(self, change, error, message):
    shapes = dict(gate=(40, 24), up=(40, 24), rhs=(2, 24, 40))
    shapes.update({k: v for k, v in change.items() if k in shapes})
    gate = jnp.ones(shapes["gate"])
    up = jnp.ones(shapes["up"], change.get("up_dtype", jnp.float32))
    sizes = jnp.array(change.get("sizes", [10, 20]), jnp.int32)
    with self.assertRaisesRegex(error, message):
      pallas_gated.gated_grouped_matmul(
          gate, up, jnp.ones(shapes["rhs"]), sizes, silu_product
      )


class FusedTilingTest(absltest.TestCase):

  def test_vmem_counts_the_fused_blocks(self):
    tiling = GmmTiling(
        gmm=(512, 1408, 2048), gmm_t=(512, 1024, 2816), tgmm=(512, 2816, 1024)
    )
    # The input gradient's blocks: dout [512, 1024] and rhs [2816, 1024]
    # double-buffered, gate, up and the two outputs [512, 2816] (bf16,
    # double-buffered), the float32 accumulator and product, and the float32
    # tiles of the epilogue's 4 operands and outputs, two each.
    tm, tc, to = tiling.gmm_t
    want = 2 * 2 * (tm * tc + tc * to + 4 * tm * to) + 2 * tm * to * 4
    want += 2 * 4 * tm * to * 4
    got = pallas_gated.fused_vmem_bytes(tiling, 5632, 2048, jnp.bfloat16)
    self.assertEqual(got, want)
    self.assertIsNotNone(
        pallas_gated.fused_tiling(
            32768, 5632, 2048, 8, jnp.bfloat16, "v5e"
        ).vmem_limit_bytes
    )


if __name__ == "__main__":
  absltest.main()
