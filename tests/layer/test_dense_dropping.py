"""The index-form dropping path against the one-hot einsum form it replaces,
whose slots come from NumPy, written from the documented priority rule
(`numpy_reference.slots`), not from the code under test."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import routing
from linen_moe._src.layer import dense as dense_lib
from tests import numpy_reference

B, S, M, H, E, K = 2, 12, 6, 5, 4, 2


def _plain_einsum(site, eqn, lhs, rhs):
  del site
  return jnp.einsum(eqn, lhs, rhs)


def _reference_slots(router, b, s, capacity, policy) -> np.ndarray:
  """<float32>[B, S, k, E, C] one-hot slot of every kept assignment."""
  ids = np.asarray(router.indices).reshape(b, s, K)
  weights = np.asarray(router.weights).reshape(b, s, K)
  out = np.zeros((b, s, K, E, capacity), np.float32)
  for bi in range(b):
    slot = numpy_reference.slots(ids[bi], weights[bi], E, capacity, policy)
    for si, c in zip(*np.nonzero(slot >= 0), strict=True):
      out[bi, si, c, ids[bi, si, c], slot[si, c]] = 1
  return out


def _one_hot_dropping(x, router, experts, act, slots):
  """The dense dropping path as one-hot dispatch/combine einsums over the
  given slots [B, S, k, E, C]."""
  b, s, _ = x.shape
  dispatch = jnp.sum(slots, axis=2)
  combine = jnp.sum(slots * router.weights.reshape(b, s, K, 1, 1), axis=2)
  wi_0, wi_1, wo = experts
  expert_in = jnp.einsum("BSM,BSEC->EBCM", x, dispatch)
  hidden = act(jnp.einsum("EBCM,EMH->EBCH", expert_in, wi_0))
  hidden = hidden * jnp.einsum("EBCM,EMH->EBCH", expert_in, wi_1)
  expert_out = jnp.einsum("EBCH,EHM->EBCM", hidden, wo)
  return jnp.einsum("EBCM,BSEC->BSM", expert_out, combine)


class IndexFormTest(parameterized.TestCase):

  # Capacities 1, 3 and 6 drop, 12 keeps all.
  @parameterized.parameters(
      (1, "position"),
      (3, "position"),
      (3, "probability"),
      (6, "probability"),
      (12, "position"),
  )
  def test_output_and_gradients_match_one_hot_form(self, capacity, policy):
    keys = jax.random.split(jax.random.key(capacity), 6)
    x = jax.random.normal(keys[0], (B, S, M))
    logits = jax.random.normal(keys[1], (B * S, E))
    experts = (
        jax.random.normal(keys[2], (E, M, H)),
        jax.random.normal(keys[3], (E, M, H)),
        jax.random.normal(keys[4], (E, H, M)),
    )
    cotangent = jax.random.normal(keys[5], (B, S, M))

    def run(fn, x, logits, experts):
      router = routing.route(logits, K, "softmax_then_topk", True)
      return fn(x, router, experts)

    by_probability = policy == "probability"
    router = routing.route(logits, K, "softmax_then_topk", True)
    slots = _reference_slots(router, B, S, capacity, policy)

    def ours_with_dropped(x, router, experts):
      return dense_lib.dense_dropping(
          _plain_einsum,
          x,
          router,
          experts,
          jax.nn.silu,
          capacity,
          by_probability=by_probability,
      )

    def ours(x, router, experts):
      return ours_with_dropped(x, router, experts)[0]

    def reference(x, router, experts):
      return _one_hot_dropping(x, router, experts, jax.nn.silu, slots)

    @functools.partial(jax.jit, static_argnums=0)  # one program each
    def out_and_grads(fn, x, logits, experts):
      out, vjp = jax.vjp(lambda x, lg, w: run(fn, x, lg, w), x, logits, experts)
      return (out, *vjp(cotangent))

    results = [
        out_and_grads(fn, x, logits, experts) for fn in (ours, reference)
    ]
    for name, got, want in zip(
        ("out", "dx", "dlogits", "dexperts"), *results, strict=True
    ):
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
    _, dropped = jax.jit(ours_with_dropped)(x, router, experts)
    self.assertAlmostEqual(
        float(dropped), 1 - slots.sum() / (B * S * K), places=6
    )
    if capacity == 1:  # 24 choices per sequence, 4 slots: most dropped
      self.assertGreater(float(dropped), 0.5)
    if capacity == S:  # room for every token in every expert
      self.assertEqual(float(dropped), 0.0)


if __name__ == "__main__":
  absltest.main()
