"""The routers against NumPy written from the formulas, and by hand.

Covers the three routings, the selection-only bias, group-limited routing,
`routed_scaling_factor`, the router z-loss, jitter and the routed-bias rule.
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import MoEConfig
from linen_moe import routing
from linen_moe._src.layer import routing as routing_lib
from tests import numpy_reference

ROUTINGS = ("topk_then_softmax", "softmax_then_topk", "sigmoid_then_topk")
# Router options beyond the routing: none, groups, a bias, all with scaling.
OPTIONS = {
    "plain": {},
    "grouped": dict(num_routing_groups=4, topk_routing_group=2),
    "biased": dict(routed_bias=True),
    "all": dict(
        num_routing_groups=4,
        topk_routing_group=2,
        routed_bias=True,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
}


def _config(**kw):
  base = dict(num_experts=16, num_experts_per_tok=4, emb_dim=8, moe_mlp_dim=8)
  return MoEConfig(**{**base, **kw})


def _route(cfg, logits, bias=None, scale=None):
  return routing.route(
      jnp.asarray(logits, jnp.float32),
      cfg.num_experts_per_tok,
      cfg.routing,
      cfg.norm_topk_prob,
      scale,
      selection_bias=None if bias is None else jnp.asarray(bias, jnp.float32),
      n_groups=cfg.num_routing_groups,
      topk_groups=cfg.topk_routing_group,
      routed_scaling_factor=cfg.routed_scaling_factor,
  )


class RouteReferenceTest(parameterized.TestCase):

  @parameterized.product(routing_name=ROUTINGS, option=tuple(OPTIONS))
  def test_matches_numpy_reference(self, routing_name, option):
    cfg = _config(routing=routing_name, **OPTIONS[option])
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    bias = None
    if cfg.routed_bias:  # on the scale of the selection scores
      bias = (rng.normal(size=16) * 0.2).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, size=16).astype(np.float32)
    got = _route(cfg, logits, bias, jnp.asarray(scale))
    for t in range(64):
      ids, weights = numpy_reference.route_token(
          logits[t].astype(np.float64), cfg, scale, bias
      )
      np.testing.assert_array_equal(got.indices[t], ids, f"token {t}")
      np.testing.assert_allclose(got.weights[t], weights, rtol=1e-5)
    self.assertEqual(got.indices.dtype, jnp.int32)
    np.testing.assert_allclose(jnp.sum(got.probs, -1), 1.0, rtol=1e-6)

  def test_reference_groups_restrict_the_choice(self):
    # Guards the test above: with groups, some token's choice differs from
    # the ungrouped one (the grouped cases are not trivially ungrouped).
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    grouped = _route(_config(**OPTIONS["grouped"]), logits).indices
    plain = _route(_config(), logits).indices
    self.assertFalse(np.array_equal(grouped, plain))


class SigmoidRoutingTest(absltest.TestCase):

  def test_bias_chooses_but_does_not_weigh(self):
    # s = sigmoid(logits) = [0.8, 0.6, 0.5, 0.2]; the bias lifts expert 3
    # above expert 1 for the choice; the weights are the unbiased sigmoids.
    s = np.array([0.8, 0.6, 0.5, 0.2])
    logits = np.log(s / (1 - s))[None]
    cfg = _config(
        num_experts=4, num_experts_per_tok=2, routing="sigmoid_then_topk"
    )
    plain = _route(cfg, logits)
    np.testing.assert_array_equal(plain.indices, [[0, 1]])
    np.testing.assert_allclose(plain.weights, [[0.8, 0.6]], rtol=1e-6)
    biased = _route(cfg, logits, bias=[0.0, 0.0, 0.0, 0.5])
    np.testing.assert_array_equal(biased.indices, [[0, 3]])  # 0.8, 0.7
    np.testing.assert_allclose(biased.weights, [[0.8, 0.2]], rtol=1e-6)
    normed = _route(
        cfg.replace(norm_topk_prob=True, routed_scaling_factor=2.5),
        logits,
        bias=[0.0, 0.0, 0.0, 0.5],
    )
    np.testing.assert_allclose(
        normed.weights, [[2.5 * 0.8, 2.5 * 0.2]], rtol=1e-6
    )
    # Balance-loss probabilities: the sigmoids normalised to sum to 1.
    np.testing.assert_allclose(plain.probs, [s / s.sum()], rtol=1e-6)

  def test_scaling_factor_applies_to_every_routing(self):
    logits = np.array([[1.0, 3.0, 2.0, 0.0]])
    for name in ROUTINGS:
      cfg = _config(num_experts=4, num_experts_per_tok=2, routing=name)
      one = _route(cfg, logits).weights
      scaled = _route(cfg.replace(routed_scaling_factor=2.5), logits).weights
      np.testing.assert_allclose(scaled, 2.5 * one, rtol=1e-6, err_msg=name)


class GroupLimitedRoutingTest(absltest.TestCase):

  def test_hand_checked_groups(self):
    # 8 experts in 4 groups of 2, top-2 groups, top-2 experts. Group sums of
    # the two highest: g0 = 0.9 + 0.0, g1 = 0.5 + 0.5, g2 = 0.6 + 0.6,
    # g3 = 0.1 + 0.1: the best groups are g2 (1.2) and g1 (1.0), so the
    # single best expert (0, score 0.9, group 0) is not eligible.
    scores = jnp.array([[0.9, 0.0, 0.5, 0.5, 0.6, 0.6, 0.1, 0.1]])
    mask = routing_lib.group_limited_mask(scores, 4, 2)
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(
        routing_lib.select_experts(scores, 2, 4, 2), [[4, 5]]
    )
    np.testing.assert_array_equal(
        routing_lib.select_experts(scores, 2), [[0, 4]]
    )

  def test_ties_go_to_the_lower_index(self):
    # Equal group scores: the lower group wins; equal experts: the lower one.
    scores = jnp.array([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(
        routing_lib.group_limited_mask(scores, 3, 1), [[1, 1, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        routing_lib.select_experts(scores, 2, 3, 2), [[0, 1]]
    )
    np.testing.assert_array_equal(
        routing_lib.select_experts(scores, 3), [[0, 1, 2]]
    )

  def test_group_score_uses_the_biased_scores(self):
    # Without the bias group 0 (0.9 + 0.8) beats group 1 (0.7 + 0.6); a bias
    # of +0.3 on expert 3 makes group 1 score 0.7 + 0.9 = 1.6 < 1.7, and +0.5
    # makes it 1.8 > 1.7.
    s = np.array([0.9, 0.8, 0.7, 0.6])
    logits = np.log(s / (1 - s))[None]
    cfg = _config(
        num_experts=4,
        num_experts_per_tok=1,
        routing="sigmoid_then_topk",
        num_routing_groups=2,
        topk_routing_group=1,
    )
    self.assertEqual(int(_route(cfg, logits).indices[0, 0]), 0)
    self.assertEqual(
        int(_route(cfg, logits, bias=[0, 0, 0, 0.3]).indices[0, 0]), 0
    )
    got = _route(cfg, logits, bias=[0, 0, 0, 0.5])
    self.assertEqual(int(got.indices[0, 0]), 3)
    np.testing.assert_allclose(got.weights, [[0.6]], rtol=1e-6)


class ZLossJitterTest(absltest.TestCase):

  def test_z_loss_matches_numpy(self):
    logits = np.random.default_rng(1).normal(size=(32, 8)) * 3
    got = routing.router_z_loss(jnp.asarray(logits, jnp.float32))
    self.assertAlmostEqual(
        float(got), numpy_reference.z_loss(logits), delta=1e-5 * float(got)
    )
    # Hand-checked: E equal logits 0 -> logsumexp = log(E).
    self.assertAlmostEqual(
        float(routing.router_z_loss(jnp.zeros((3, 8)))),
        math.log(8) ** 2,
        places=5,
    )

  def test_z_loss_gradient_shrinks_the_logits(self):
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(8, 4)) + 2.0)
    grad = jax.grad(routing.router_z_loss)(logits)
    stepped = logits - 0.1 * grad
    self.assertLess(
        float(routing.router_z_loss(stepped)),
        float(routing.router_z_loss(logits)),
    )

  def test_jitter_range_and_determinism(self):
    x = jnp.ones((64, 16))
    key = jax.random.key(0)
    y = routing_lib.jitter(x, 0.1, key)
    self.assertBetween(float(y.min()), 0.9, 1.0)
    self.assertBetween(float(y.max()), 1.0, 1.1)
    self.assertGreater(float(jnp.std(y)), 0.04)  # uniform: 0.2 / sqrt(12)
    np.testing.assert_array_equal(y, routing_lib.jitter(x, 0.1, key))
    np.testing.assert_array_equal(routing_lib.jitter(x, 0.0, key), x)
    # Exactly x times the noise uniform in [1 - eps, 1 + eps] drawn from key.
    x = jax.random.normal(jax.random.key(1), (64, 16))
    noise = jax.random.uniform(key, x.shape, jnp.float32, 0.9, 1.1)
    np.testing.assert_array_equal(routing_lib.jitter(x, 0.1, key), x * noise)


class RoutedBiasRuleTest(absltest.TestCase):

  def test_hand_checked_update(self):
    load = jnp.array([0.5, 0.25, 0.25, 0.0])  # mean 0.25
    new = routing.routed_bias_update(jnp.zeros(4), load, 0.01)
    np.testing.assert_allclose(new, [-0.01, 0.0, 0.0, 0.01])
    stacked = routing.routed_bias_update(
        jnp.ones((2, 4)), jnp.stack([load, load[::-1]]), 0.5
    )
    np.testing.assert_allclose(stacked, [[0.5, 1, 1, 1.5], [1.5, 1, 1, 0.5]])

  def test_rule_evens_out_a_fixed_router(self):
    # A router that prefers expert 0 for every token; the rule alone (no
    # gradient) spreads the load evenly (measured: max/min load 8 -> 1.05).
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(256, 8)) * 0.5 + np.eye(8)[0] * 2)
    bias = jnp.zeros(8)
    fractions = []
    for _ in range(300):
      r = routing.route(
          logits, 2, "sigmoid_then_topk", True, selection_bias=bias
      )
      load = routing_lib.expert_assignment_fraction(r.indices, 8)
      fractions.append(np.asarray(load))
      bias = routing.routed_bias_update(bias, load, 0.005)
    self.assertGreater(fractions[0][0], 0.45)  # every token's first choice
    self.assertLess(float(bias[0]), 0.0)
    tail = np.mean(fractions[-50:], axis=0)
    self.assertLess(tail.max() / tail.min(), 1.5)


if __name__ == "__main__":
  absltest.main()
