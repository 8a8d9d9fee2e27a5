"""The next-token cross-entropy and its gradient against NumPy."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe.training import cross_entropy


def _numpy_loss_and_grad(logits, tokens):
  """Mean over the B * (S - 1) positions with a next token of
  -log softmax(logits[b, s])[tokens[b, s + 1]], and its gradient, float64."""
  x = np.asarray(logits, np.float64)
  b, s, _ = x.shape
  loss, grad = 0.0, np.zeros_like(x)
  for i in range(b):
    for j in range(s - 1):
      row = x[i, j] - x[i, j].max()
      p = np.exp(row) / np.exp(row).sum()
      target = int(tokens[i, j + 1])
      loss -= np.log(p[target])
      grad[i, j] = p
      grad[i, j, target] -= 1.0
  n = b * (s - 1)
  return loss / n, grad / n


class CrossEntropyTest(parameterized.TestCase):

  @parameterized.parameters(
      (jnp.float32, 1e-6, 1e-7), (jnp.bfloat16, 1e-6, 2e-4)
  )
  def test_matches_numpy(self, dtype, loss_rtol, grad_atol):
    keys = jax.random.split(jax.random.key(0), 2)
    logits = (3.0 * jax.random.normal(keys[0], (3, 7, 11))).astype(dtype)
    tokens = jax.random.randint(keys[1], (3, 7), 0, 11)
    loss, grad = jax.jit(jax.value_and_grad(cross_entropy))(logits, tokens)
    want_loss, want_grad = _numpy_loss_and_grad(logits, tokens)
    self.assertEqual(loss.dtype, jnp.float32)
    self.assertEqual(grad.dtype, dtype)
    np.testing.assert_allclose(loss, want_loss, rtol=loss_rtol)
    np.testing.assert_allclose(
        np.asarray(grad, np.float64), want_grad, atol=grad_atol
    )
    # The last position predicts nothing: no gradient reaches it.
    self.assertEqual(float(jnp.max(jnp.abs(grad[:, -1]))), 0.0)

  def test_needs_two_tokens(self):
    with self.assertRaisesRegex(ValueError, r"at least 2 tokens.*\(3, 1\)"):
      cross_entropy(jnp.zeros((3, 1, 5)), jnp.zeros((3, 1), jnp.int32))


if __name__ == "__main__":
  absltest.main()
