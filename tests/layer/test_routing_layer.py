"""The new routing fields inside `RoutedMoE`, on every path.

DeepSeek-V3 (sigmoid, groups, selection bias, scaling) and Qwen3 routing
against the NumPy oracle on the sparse and dense paths, the "probability"
drop policy by hand and against the oracle, the z-loss in `aux`, jitter, the
`routed_bias` variable, and every quantization mode with all options on.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import Decoder
from linen_moe import RoutedAndSharedMoE
from linen_moe import RoutedMoE
from linen_moe import load_model_config
from linen_moe import load_moe_config
from linen_moe import quantization
from linen_moe import testing
from linen_moe._src.config import variables as variables_lib
from linen_moe._src.layer import dense as dense_lib
from linen_moe._src.layer import routing as routing_lib
from linen_moe._src.testing import helpers
from linen_moe.quantization import MODES
from linen_moe.sharding import unbox
from linen_moe.variables import UPDATED_BY_RULE as RULE
from tests import numpy_reference

JITTER = variables_lib.ROUTER_JITTER_RNG_STREAM
# Each config with a selection bias on the scale of its selection scores
# (sigmoids ~ 0.5, softmax over 32 experts ~ 1/32).
CASES = {
    "tiny_deepseek_v3": ({}, 0.1),
    "tiny_qwen3_moe": (dict(routed_bias=True), 0.01),
}
# Every routing option on: the layer must train in every mode and path.
ALL_OPTIONS = dict(
    router_z_loss_weight=1e-3, router_jitter=0.1, drop_policy="probability"
)


def _variables(cfg, bias_scale=0.0, seed=0):
  """Initialised variables with a random routed bias (when kept)."""
  return helpers.moe_variables(cfg, seed, bias_scale)


def _inputs(cfg, b=2, s=8):
  """x [B, S, M], standard normal."""
  return helpers.random_inputs(cfg.emb_dim, b, s)


def _reference(variables, x, cfg, capacity=None):
  bias = variables.get(RULE, {}).get("routed_bias")
  return numpy_reference.moe_reference(
      variables["params"],
      np.asarray(x, np.float64),
      cfg,
      capacity=capacity,
      routed_bias=None if bias is None else np.asarray(bias),
  )


class RoutingLayerReferenceTest(parameterized.TestCase):

  @parameterized.product(config=tuple(CASES), path=("sparse", "dense"))
  def test_matches_numpy_reference(self, config, path):
    overrides, bias_scale = CASES[config]
    cfg = load_moe_config(config, **overrides, **MATMUL_PATHS[path])
    variables = _variables(cfg, bias_scale)
    x = _inputs(cfg)
    y, aux = jax.jit(RoutedMoE(cfg).apply)(variables, x)
    expected, _ = _reference(variables, x, cfg)
    self.assertLess(helpers.rel_err(y, expected), 1e-5)
    self.assertEqual(float(aux.router_z_loss), 0.0)  # weight 0

  def test_probability_drop_policy_matches_numpy_reference(self):
    cfg = load_moe_config(
        "tiny_deepseek_v3",
        **MATMUL_PATHS["dense_dropping"],
        drop_policy="probability",
    )
    variables = _variables(cfg, 0.1)
    x = _inputs(cfg, b=2, s=16)
    y, aux = jax.jit(RoutedMoE(cfg).apply)(variables, x)
    capacity = dense_lib.expert_capacity(cfg, 16)
    expected, dropped = _reference(variables, x, cfg, capacity)
    self.assertLess(helpers.rel_err(y, expected), 1e-5)
    self.assertGreater(dropped, 0)
    self.assertAlmostEqual(
        float(aux.dropped_fraction), dropped / (2 * 16 * 4), places=6
    )
    # The two policies keep different assignments here, so the test above
    # tells them apart.
    by_position, _ = _reference(
        variables, x, cfg.replace(drop_policy="position"), capacity
    )
    self.assertGreater(helpers.rel_err(by_position, expected), 1e-3)


class ProbabilityDispatchMaskTest(absltest.TestCase):

  def test_highest_weight_keeps_the_slot(self):
    # One sequence of 3 tokens, k=1, 1 expert, capacity 2, weights
    # (0.2, 0.9, 0.5): t1 claims slot 0, t2 slot 1, t0 (first in position
    # order) is dropped.
    indices = jnp.zeros((1, 3, 1), jnp.int32)
    weights = jnp.array([[[0.2], [0.9], [0.5]]])
    mask = dense_lib.dispatch_mask(indices, 1, 2, weights)
    expected = np.zeros((1, 3, 1, 1, 2))
    expected[0, 1, 0, 0, 0] = 1
    expected[0, 2, 0, 0, 1] = 1
    np.testing.assert_array_equal(mask, expected)
    # By position, t0 and t1 keep slots 0 and 1.
    position = dense_lib.dispatch_mask(indices, 1, 2)
    np.testing.assert_array_equal(
        position[0, :, 0, 0], [[1, 0], [0, 1], [0, 0]]
    )

  def test_second_choice_with_high_weight_beats_first_choice(self):
    # t0 -> (1, 0) with weights (0.6, 0.4); t1 -> (0, 1) with (0.3, 0.7);
    # capacity 1. Expert 0: t0's second choice (0.4) beats t1's first (0.3);
    # expert 1: t1's second choice (0.7) beats t0's first (0.6).
    indices = jnp.array([[[1, 0], [0, 1]]])
    weights = jnp.array([[[0.6, 0.4], [0.3, 0.7]]])
    mask = dense_lib.dispatch_mask(indices, 2, 1, weights)
    kept = np.asarray(mask.sum(axis=(3, 4)))[0]  # [S, k]
    np.testing.assert_array_equal(kept, [[0, 1], [0, 1]])

  def test_equal_weights_fall_back_to_position_order(self):
    indices = jax.random.randint(jax.random.key(0), (2, 16, 2), 0, 4)
    weights = jnp.full((2, 16, 2), 0.5)
    np.testing.assert_array_equal(
        dense_lib.dispatch_mask(indices, 4, 3, weights),
        dense_lib.dispatch_mask(indices, 4, 3),
    )


class ZLossJitterBiasLayerTest(absltest.TestCase):

  def test_z_loss_in_aux_matches_numpy(self):
    cfg = load_moe_config("tiny_qwen3_moe", router_z_loss_weight=0.01)
    variables = _variables(cfg)
    x = _inputs(cfg)
    _, aux = jax.jit(RoutedMoE(cfg).apply)(variables, x)
    logits = np.asarray(x, np.float64).reshape(-1, cfg.emb_dim) @ np.asarray(
        variables["params"]["gate"]["kernel"], np.float64
    )
    expected = 0.01 * numpy_reference.z_loss(logits)
    self.assertAlmostEqual(
        float(aux.router_z_loss), expected, delta=1e-5 * expected
    )

    def z(params):
      return RoutedMoE(cfg).apply({"params": params}, x)[1].router_z_loss

    grads = jax.jit(jax.grad(z))(variables["params"])
    self.assertGreater(float(jnp.abs(grads["gate"]["kernel"]).max()), 0.0)
    self.assertEqual(float(jnp.abs(grads["wi_0"]).max()), 0.0)

  def test_jitter_only_with_its_rng_stream(self):
    cfg = load_moe_config("tiny_deepseek_v3", router_jitter=0.5)
    variables = _variables(cfg)
    x = _inputs(cfg)
    moe, plain = RoutedMoE(cfg), RoutedMoE(cfg.replace(router_jitter=0.0))
    y0, _ = plain.apply(variables, x)
    no_rng, _ = moe.apply(variables, x)
    np.testing.assert_array_equal(no_rng, y0)  # deterministic without it
    other_stream, _ = moe.apply(
        variables, x, rngs={"params": jax.random.key(1)}
    )
    np.testing.assert_array_equal(other_stream, y0)
    y1, _ = moe.apply(variables, x, rngs={JITTER: jax.random.key(1)})
    y1_again, _ = moe.apply(variables, x, rngs={JITTER: jax.random.key(1)})
    y2, _ = moe.apply(variables, x, rngs={JITTER: jax.random.key(2)})
    np.testing.assert_array_equal(y1, y1_again)
    self.assertGreater(helpers.rel_err(y1, y0), 1e-3)
    self.assertGreater(helpers.rel_err(y2, y1), 1e-3)
    zero, _ = plain.apply(variables, x, rngs={JITTER: jax.random.key(1)})
    np.testing.assert_array_equal(zero, y0)  # eps 0 never draws

  def test_jitter_multiplies_exactly_the_router_input(self):
    """The router reads x times the noise drawn from its stream, element by
    element; the experts read x: the output is the unjittered layer's with
    the jittered input as its router input."""
    cfg = load_moe_config("tiny_deepseek_v3", router_jitter=0.5)
    variables = _variables(cfg)
    x = _inputs(cfg)
    drawn = []
    jitter = routing_lib.jitter

    def recording_jitter(router_in, eps, rng):
      out = jitter(router_in, eps, rng)
      drawn.append((router_in, eps, rng, out))
      return out

    with mock.patch.object(routing_lib, "jitter", recording_jitter):
      y, _ = RoutedMoE(cfg).apply(
          variables, x, rngs={JITTER: jax.random.key(1)}
      )
    ((router_in, eps, rng, jittered),) = drawn
    self.assertEqual(eps, 0.5)
    np.testing.assert_array_equal(router_in, x.reshape(-1, cfg.emb_dim))
    noise = jax.random.uniform(rng, router_in.shape, jnp.float32, 0.5, 1.5)
    np.testing.assert_array_equal(jittered, router_in * noise)
    self.assertGreater(float(jnp.std(noise)), 0.2)  # per element: 1/sqrt(12)
    plain = RoutedMoE(cfg.replace(router_jitter=0.0))
    y_plain, _ = plain.apply(variables, x, jittered.reshape(x.shape))
    np.testing.assert_allclose(y, y_plain, rtol=1e-6, atol=1e-7)

  def test_routed_bias_variable_layout(self):
    cfg = load_moe_config("tiny_deepseek_v3")
    x = _inputs(cfg)
    variables = unbox(
        jax.jit(RoutedAndSharedMoE(cfg).init)(jax.random.key(0), x)
    )
    self.assertEqual(set(variables), {"params", RULE})
    self.assertEqual(
        set(variables["params"]), {"routed_experts", "shared_experts"}
    )
    bias = variables[RULE]["routed_experts"]["routed_bias"]
    np.testing.assert_array_equal(bias, np.zeros(16, np.float32))
    self.assertEqual(bias.dtype, jnp.float32)
    self.assertNotIn("routed_bias", variables["params"]["routed_experts"])
    off = cfg.replace(routed_bias=False, routed_bias_update_rate=0.0)
    self.assertNotIn(
        RULE, jax.eval_shape(RoutedMoE(off).init, jax.random.key(0), x)
    )


class DeepSeekDecoderServingTest(absltest.TestCase):

  # Slow: the default run converts the same layout (routed and shared
  # experts under `moe/`, a routed bias) in test_hf's
  # `NewerFamiliesTest.test_int8_serving_within_its_bound` (GLM-4.5 MoE,
  # against its direct int8 load and transformers' logits).
  @testing.slow
  def test_quantize_weights_finds_the_routed_and_shared_experts(self):
    """The DeepSeek-style block keeps its experts under `moe/routed_experts/`
    and `moe/shared_experts/`; serving conversion finds both, keeps the
    routed biases, and the served decoder stays within int8's error."""
    cfg = load_model_config("tiny_deepseek_v3", quantization="int8")
    self.assertTrue(cfg.shared_in_moe)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    variables = unbox(jax.jit(Decoder(cfg).init)(jax.random.key(0), tokens))
    variables[RULE] = jax.tree.map(lambda b: b + 0.05, variables[RULE])
    serve_cfg, served = quantization.quantize_weights(cfg, variables)
    moe = served["params"]["layers"]["moe"]
    for module in ("routed_experts", "shared_experts"):
      self.assertEqual(moe[module]["wi_0"].dtype, jnp.int8, module)
    jax.tree.map(np.testing.assert_array_equal, served[RULE], variables[RULE])
    logits, _ = jax.jit(Decoder(cfg).apply)(variables, tokens)
    served_logits, _ = jax.jit(Decoder(serve_cfg).apply)(served, tokens)
    # Measured 0.010; the int8 layer bound of tests/layer/test_serving.py.
    self.assertLess(helpers.rel_err(served_logits, logits), 0.04)


def _check_trains(test, quantization, path):
  cfg = load_moe_config(
      "tiny_deepseek_v3",
      quantization=quantization,
      **MATMUL_PATHS[path],
      **ALL_OPTIONS,
  )
  variables = _variables(cfg, 0.1)
  x = _inputs(cfg)
  moe = RoutedMoE(cfg)
  rngs = {"params": jax.random.key(5), JITTER: jax.random.key(6)}

  @jax.jit
  def loss(params):
    y, aux = moe.apply({**variables, "params": params}, x, rngs=rngs)
    return jnp.mean(y**2) + aux.router_z_loss

  value, grads = jax.value_and_grad(loss)(variables["params"])
  test.assertTrue(np.isfinite(float(value)))
  for name, g in jax.tree_util.tree_leaves_with_path(grads):
    test.assertTrue(np.all(np.isfinite(g)), name)
    test.assertGreater(float(jnp.abs(g).max()), 0.0, name)


class AllOptionsEveryModeTest(parameterized.TestCase):
  """Each path once, each in another quantization mode; the full product is
  slow."""

  @parameterized.parameters(
      ("int8", "sparse"), ("fp8", "dense"), ("nanoo_fp8", "dense_dropping")
  )
  def test_gradients_finite_and_nonzero(self, quantization, path):
    _check_trains(self, quantization, path)

  @testing.slow
  @parameterized.product(quantization=tuple(MODES), path=tuple(MATMUL_PATHS))
  def test_full_product(self, quantization, path):
    _check_trains(self, quantization, path)


if __name__ == "__main__":
  absltest.main()
