"""RMSNorm (`models/norms.py`): its backward keeps the input, nothing in
float32.

Its numbers against a NumPy reference are the Hugging Face fixtures'
(tests/hf/test_hf.py); here what the backward saves.
"""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.models import norms


def _reference(x: np.ndarray, eps: float) -> np.ndarray:
  x = x.astype(np.float64)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


class RmsNormalizeTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.x = jax.random.normal(jax.random.key(0), (2, 8, 64), jnp.bfloat16)

  def test_backward_saves_only_the_bfloat16_input(self):
    _, vjp = jax.vjp(lambda x: norms.rms_normalize(x, 1e-6), self.x)
    saved = [(x.shape, x.dtype) for x in jax.tree.leaves(vjp)]
    self.assertEqual(saved, [((2, 8, 64), jnp.bfloat16)])

  def test_values_and_gradient(self):
    x = np.asarray(self.x, np.float32)
    w = np.linspace(-1, 1, 64, dtype=np.float32)
    got = norms.rms_normalize(jnp.asarray(x), 1e-6)
    np.testing.assert_allclose(got, _reference(x, 1e-6), rtol=1e-6)
    # d/dx sum(w * x / r): (w - y * mean(w * y)) / r, y = x / r.
    grad = jax.grad(lambda v: jnp.sum(norms.rms_normalize(v, 1e-6) * w))(x)
    y = _reference(x, 1e-6)
    r = np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6)
    want = (w - y * np.mean(w * y, axis=-1, keepdims=True)) / r
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
