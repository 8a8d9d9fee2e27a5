"""linen_moe.permute against plain indexing (autodiff) and a NumPy loop."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.layer import index_ops
from linen_moe._src.layer import permute

T, K, M = 12, 3, 5


def _routing(num_experts, seed=0):
  """<int32>[T, K] distinct experts per token, <float32>[T, K] weights."""
  rng = np.random.default_rng(seed)
  indices = np.stack(
      [rng.choice(num_experts, K, replace=False) for _ in range(T)]
  )
  weights = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
  return jnp.asarray(indices, jnp.int32), jnp.asarray(weights)


def _numpy_round_trip(x, indices, weights, first, num_local, row_fn):
  """Per assignment: weights * row_fn(local expert, x[token]), summed."""
  out = np.zeros_like(np.asarray(x, np.float64))
  for t in range(T):
    for j in range(K):
      e = int(indices[t, j]) - first
      if 0 <= e < num_local:
        out[t] += float(weights[t, j]) * row_fn(e, np.asarray(x[t]))
  return out


class PermuteTest(parameterized.TestCase):

  # (num_experts, num_local, first): all local; a shard of the experts, as
  # under expert parallelism (other experts' choices contribute nothing).
  @parameterized.product(
      (
          dict(num_experts=6, num_local=6, first=0),  # all local
          dict(num_experts=8, num_local=3, first=2),  # a shard
          dict(num_experts=8, num_local=1, first=7),  # one expert: R < A
      ),
      method=index_ops.METHODS,
  )
  def test_round_trip_matches_numpy(
      self, num_experts, num_local, first, method
  ):
    indices, weights = _routing(num_experts)
    x = jax.random.normal(jax.random.key(0), (T, M))
    scale = jnp.arange(1.0, num_local + 1.0)  # expert e's rows times e + 1

    def layer(x, weights):
      plan = permute.sort_plan(indices, num_local, first, scalar_method=method)
      rows = permute.dispatch_rows(x, plan)
      row_scale = jnp.repeat(
          scale, plan.group_sizes, total_repeat_length=rows.shape[0]
      )
      return permute.combine_rows(rows * row_scale[:, None], weights, plan)

    got = jax.jit(layer)(x, weights)
    want = _numpy_round_trip(
        x, indices, weights, first, num_local, lambda e, r: (e + 1) * r
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

  @parameterized.product(
      (
          dict(num_experts=6, num_local=6, first=0),
          dict(num_experts=8, num_local=3, first=2),
          dict(num_experts=8, num_local=4, first=0),
          dict(num_experts=8, num_local=2, first=6),  # R < A
      ),
      method=index_ops.METHODS,
  )
  def test_gradients_match_plain_indexing(
      self, num_experts, num_local, first, method
  ):
    """Both custom VJPs against autodiff of the same gathers written plainly."""
    indices, weights = _routing(num_experts, seed=1)
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (T, M))
    w_rows = jax.random.normal(keys[1], (T * K, M))  # a per-row nonlinearity
    cotangent = jax.random.normal(keys[2], (T, M))

    def ours(x, weights):
      plan = permute.sort_plan(indices, num_local, first, scalar_method=method)
      rows = permute.dispatch_rows(x, plan)
      rows = jnp.tanh(rows * w_rows[: rows.shape[0]])
      return permute.combine_rows(rows, weights, plan)

    def plain(x, weights):
      plan = permute.sort_plan(indices, num_local, first)
      valid = plan.valid_rows()[:, None]
      rows = jnp.where(valid, x[plan.order // K], 0)
      rows = jnp.tanh(rows * w_rows[: rows.shape[0]])
      # Assignments no row holds (other experts') sit past R: weight 0.
      held = jnp.minimum(plan.position, rows.shape[0] - 1)
      unsorted = rows[held]  # [T*K, M]
      w = jnp.where(plan.is_local, weights.reshape(-1), 0)
      return jnp.sum((unsorted * w[:, None]).reshape(T, K, M), axis=1)

    def fwd_bwd(fn):
      out, vjp = jax.vjp(fn, x, weights)
      return (out, *vjp(cotangent))

    got = jax.jit(lambda: fwd_bwd(ours))()
    want = jax.jit(lambda: fwd_bwd(plain))()
    for name, g, w in zip(("out", "dx", "dweights"), got, want, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
    # Not vacuous: every token and every local choice gets a gradient.
    plan = permute.sort_plan(indices, num_local, first)
    local = np.asarray(plan.is_local).reshape(T, K)
    self.assertTrue(np.all(np.asarray(got[2])[local] != 0))
    self.assertTrue(np.all(np.asarray(got[2])[~local] == 0))

  def test_bad_scalar_method_names_itself(self):
    indices, _ = _routing(6)
    with self.assertRaisesRegex(ValueError, "scalar_method.*'scan'"):
      permute.sort_plan(indices, 6, scalar_method="scan")

  def test_rows_past_local_are_zero(self):
    indices, _ = _routing(8)
    x = jax.random.normal(jax.random.key(2), (T, M)) + 10.0
    plan = permute.sort_plan(indices, 3, 2)
    rows = permute.dispatch_rows(x, plan)
    n = int(jnp.sum(plan.group_sizes))
    self.assertEqual(rows.shape, (T * K, M))
    self.assertLess(n, T * K)
    np.testing.assert_array_equal(rows[n:], 0)
    self.assertTrue(np.all(np.asarray(rows[:n]) != 0))

  def test_no_scatter_in_the_gradient(self):
    """The point of the module: the backward gathers, never scatters."""
    indices, weights = _routing(6)
    x = jnp.ones((T, M))

    def loss(x, weights):
      plan = permute.sort_plan(indices, 6)
      rows = permute.dispatch_rows(x, plan)
      return jnp.sum(permute.combine_rows(rows, weights, plan) ** 2)

    plan_scatters = str(
        jax.make_jaxpr(lambda: permute.sort_plan(indices, 6))()
    ).count("scatter")
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, weights))
    # The plan's own inverse permutation is the only scatter.
    self.assertEqual(jaxpr.count("scatter"), plan_scatters)


class TakeInjectiveTest(absltest.TestCase):

  def test_forward_and_gradient_match_plain_indexing(self):
    # Rows 0..5 of src; output row i takes src[index[i]], -1 takes nothing.
    index = jnp.array([4, -1, 0, 2, -1], jnp.int32)
    inverse = jnp.array([2, -1, 3, -1, 0, -1], jnp.int32)
    src = jax.random.normal(jax.random.key(0), (6, M))
    g = jax.random.normal(jax.random.key(1), (5, M))

    def plain(src):
      return jnp.where((index >= 0)[:, None], src[jnp.maximum(index, 0)], 0)

    out, vjp = jax.vjp(lambda a: permute.take_injective(a, index, inverse), src)
    want_out, want_vjp = jax.vjp(plain, src)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_allclose(vjp(g)[0], want_vjp(g)[0], rtol=1e-6)
    np.testing.assert_array_equal(
        vjp(g)[0][np.array([1, 3, 5])], 0
    )  # rows not taken


if __name__ == "__main__":
  absltest.main()
