"""index_ops: both methods against NumPy loops written from the definitions."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.layer import index_ops


class IndexOpsTest(parameterized.TestCase):

  @parameterized.parameters(*index_ops.METHODS)
  def test_counts(self, method):
    rng = np.random.default_rng(0)
    values = rng.integers(-2, 9, size=(37, 3))  # some outside [0, 7)
    want = np.zeros(7, np.int64)
    for v in values.reshape(-1):
      if 0 <= v < 7:
        want[v] += 1
    got = jax.jit(lambda v: index_ops.counts(v, 7, method))(jnp.asarray(values))
    self.assertEqual(got.dtype, jnp.int32)
    np.testing.assert_array_equal(got, want)

  @parameterized.parameters(*index_ops.METHODS)
  def test_pick_and_its_gradient(self, method):
    rng = np.random.default_rng(1)
    table = rng.normal(size=(5, 6)).astype(np.float32)
    indices = np.stack([rng.choice(6, 3, replace=False) for _ in range(5)])
    cot = rng.normal(size=(5, 3)).astype(np.float32)
    want = np.array(
        [[table[t, e] for e in row] for t, row in enumerate(indices)]
    )
    want_grad = np.zeros_like(table)
    for t in range(5):
      for j in range(3):
        want_grad[t, indices[t, j]] += cot[t, j]
    fn = lambda x: index_ops.pick(x, jnp.asarray(indices), method)  # noqa: E731
    got, vjp = jax.vjp(fn, jnp.asarray(table))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(vjp(jnp.asarray(cot))[0], want_grad)

  @parameterized.parameters(*index_ops.METHODS)
  def test_invert_and_take_by_inverse(self, method):
    perm = np.random.default_rng(2).permutation(50)
    inverse = np.asarray(index_ops.invert(jnp.asarray(perm), method))
    for i, p in enumerate(perm):
      self.assertEqual(inverse[p], i)
    values = np.arange(50.0) * 3 + 1
    got = index_ops.take_by_inverse(jnp.asarray(values), jnp.asarray(inverse))
    np.testing.assert_array_equal(got, [values[p] for p in perm])

  def test_argsort_is_stable(self):
    keys = jnp.array([2, 0, 2, 1, 0, 2], jnp.int32)
    np.testing.assert_array_equal(index_ops.argsort(keys), [1, 4, 3, 0, 2, 5])

  def test_platform_method_and_bad_method(self):
    self.assertEqual(index_ops.platform_method(), "gather")  # a CPU here
    with self.assertRaisesRegex(ValueError, "method.*'scan'"):
      index_ops.counts(jnp.zeros(3, jnp.int32), 2, "scan")


if __name__ == "__main__":
  absltest.main()
