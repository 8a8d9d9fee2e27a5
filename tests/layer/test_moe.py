"""RoutedMoE against the NumPy oracle, both paths, dropping, aux losses."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import MATMUL_PATHS as ALL_PATHS
from linen_moe import RoutedAndSharedMoE
from linen_moe import RoutedMoE
from linen_moe import SharedExpert
from linen_moe import hlo
from linen_moe import load_moe_config
from linen_moe import routing
from linen_moe import testing
from linen_moe._src.layer import dense as dense_lib
from linen_moe._src.layer import routing as routing_lib
from linen_moe._src.testing import helpers
from linen_moe.quantization import MODES
from linen_moe.sharding import unbox
from tests import numpy_reference

CONFIGS = ("tiny_mixtral", "tiny_gemma4_26b")
MATMUL_PATHS = {
    p: ALL_PATHS[p] for p in ("sparse", "dense")
}  # the dropless ones
# bfloat16 keeps 8 significant bits: one rounding to nearest is off by at
# most u = 2^-8 of the value. A bfloat16 layer rounds about 10 times on the
# way from a float32 one: the three expert weights, the two input
# projections, the activation, the gated product, the output projection,
# the combine weights and the combined output. Independent roundings add in
# quadrature (the whole output within sqrt(10) u = 1.2%; measured 0.55-0.72%),
# a token's at worst in a line (within 10 u = 3.9%; measured up to 1.24%).
# A router in bfloat16 (the README rules it out) flips a near-tied choice of
# some token of 256 (measured: that token off by 46%).
BF16_U = 2.0**-8
BF16_ROUNDINGS = 10


_random_params = helpers.moe_params
_rel_err = helpers.rel_err


def _inputs(cfg, b=2, s=8, seed=3):
  return helpers.random_inputs(cfg.emb_dim, b, s, seed)


def _apply(cfg):
  """`RoutedMoE(cfg).apply`, jitted: one compile of the layer runs in a
  fraction of the time of its ops dispatched one by one."""
  return jax.jit(RoutedMoE(cfg).apply)


class MoEReferenceTest(parameterized.TestCase):

  def check_aux(self, aux, params, router_in, cfg):
    """`expert_fraction` is the count of each expert's assignments (before
    any dropping) over T * k, and the load-balance loss E * sum_e f_e * P_e
    of it, both from the oracle's choices and probabilities."""
    fraction, lb = numpy_reference.aux_reference(params, router_in, cfg)
    np.testing.assert_allclose(aux.expert_fraction, fraction, rtol=1e-7)
    self.assertGreater(cfg.load_balance_loss_weight, 0)
    np.testing.assert_allclose(
        aux.load_balance_loss, cfg.load_balance_loss_weight * lb, rtol=1e-5
    )

  @parameterized.product(config=CONFIGS, path=tuple(MATMUL_PATHS))
  def test_matches_numpy_reference(self, config, path):
    cfg = load_moe_config(config, **MATMUL_PATHS[path])
    params = _random_params(cfg)
    x = _inputs(cfg)
    gate_inputs = _inputs(cfg, seed=7) if config == "tiny_gemma4_26b" else None
    y, aux = jax.jit(RoutedMoE(cfg).apply)({"params": params}, x, gate_inputs)
    expected, _ = numpy_reference.moe_reference(
        params,
        np.asarray(x, np.float64),
        cfg,
        None if gate_inputs is None else np.asarray(gate_inputs, np.float64),
    )
    self.assertLess(_rel_err(y, expected), 1e-5)
    self.assertEqual(float(aux.dropped_fraction), 0.0)
    self.check_aux(aux, params, x if gate_inputs is None else gate_inputs, cfg)

  @parameterized.parameters(*CONFIGS)
  def test_dense_dropless_equals_sparse(self, config):
    params = _random_params(load_moe_config(config))
    x = _inputs(load_moe_config(config), b=3, s=16)
    ys = {
        path: _apply(load_moe_config(config, **kw))({"params": params}, x)[0]
        for path, kw in MATMUL_PATHS.items()
    }
    np.testing.assert_allclose(ys["dense"], ys["sparse"], rtol=1e-5, atol=1e-6)

  @parameterized.parameters(0.5, 1.0, 2.0)
  def test_dropping_matches_numpy_reference(self, capacity_factor):
    cfg = load_moe_config(
        "tiny_mixtral", sparse_matmul=False, capacity_factor=capacity_factor
    )
    params = _random_params(cfg)
    x = _inputs(cfg, b=2, s=16)
    y, aux = _apply(cfg)({"params": params}, x)
    capacity = dense_lib.expert_capacity(cfg, 16)
    self.assertEqual(capacity, min(16, math.ceil(capacity_factor * 16 * 2 / 8)))
    expected, dropped = numpy_reference.moe_reference(
        params, np.asarray(x, np.float64), cfg, capacity=capacity
    )
    self.assertLess(_rel_err(y, expected), 1e-5)
    self.assertAlmostEqual(
        float(aux.dropped_fraction), dropped / (2 * 16 * 2), places=6
    )
    self.check_aux(aux, params, x, cfg)  # counted before dropping

  def test_large_capacity_drops_nothing(self):
    cfg = load_moe_config(
        "tiny_mixtral", sparse_matmul=False, capacity_factor=4.0
    )
    params = _random_params(cfg)
    x = _inputs(cfg, b=2, s=16)
    y, aux = _apply(cfg)({"params": params}, x)
    y_dropless, _ = _apply(cfg.replace(capacity_factor=0.0))(
        {"params": params}, x
    )
    self.assertEqual(float(aux.dropped_fraction), 0.0)
    np.testing.assert_allclose(y, y_dropless, rtol=1e-5, atol=1e-6)


class DispatchMaskTest(absltest.TestCase):

  def test_hand_checked_priority_order(self):
    # One sequence of 3 tokens, k=2, 2 experts, capacity 2.
    # Choices: t0 -> (0, 1), t1 -> (0, 1), t2 -> (0, 1).
    # Expert 0 slots go to first choices in token order: t0 slot 0, t1 slot 1,
    # t2 dropped. Expert 1 gets only second choices: t0 slot 0, t1 slot 1,
    # t2 dropped.
    indices = jnp.array([[[0, 1], [0, 1], [0, 1]]])
    mask = dense_lib.dispatch_mask(indices, num_experts=2, capacity=2)
    expected = np.zeros((1, 3, 2, 2, 2))
    expected[0, 0, 0, 0, 0] = 1  # t0 choice0 -> expert0 slot0
    expected[0, 1, 0, 0, 1] = 1  # t1 choice0 -> expert0 slot1
    expected[0, 0, 1, 1, 0] = 1  # t0 choice1 -> expert1 slot0
    expected[0, 1, 1, 1, 1] = 1  # t1 choice1 -> expert1 slot1
    np.testing.assert_array_equal(mask, expected)

  def test_first_choices_win_over_earlier_second_choices(self):
    # t0 -> (1, 0), t1 -> (0, 1); capacity 1. Expert 0: t1's first choice
    # beats t0's second choice although t0 comes first.
    indices = jnp.array([[[1, 0], [0, 1]]])
    mask = dense_lib.dispatch_mask(indices, num_experts=2, capacity=1)
    self.assertEqual(float(mask[0, 1, 0, 0, 0]), 1.0)  # t1 choice0 kept
    self.assertEqual(float(mask[0, 0, 1].sum()), 0.0)  # t0 choice1 dropped
    self.assertEqual(float(mask[0, 0, 0, 1, 0]), 1.0)  # t0 choice0 kept

  def test_each_slot_used_at_most_once(self):
    idx = jax.random.randint(jax.random.key(0), (4, 32, 1), 0, 8)
    mask = dense_lib.dispatch_mask(idx, num_experts=8, capacity=3)
    per_slot = mask.sum(axis=(1, 2))  # [B, E, C]
    self.assertLessEqual(float(per_slot.max()), 1.0)
    # Kept per expert = min(count, capacity).
    counts = jax.nn.one_hot(idx[..., 0], 8).sum(axis=1)
    np.testing.assert_array_equal(
        mask.sum(axis=(1, 2, 4)), np.minimum(counts, 3)
    )


class RoutingTest(parameterized.TestCase):

  def test_mixtral_routing_hand_checked(self):
    logits = jnp.array([[1.0, 3.0, 2.0, 0.0]])
    r = routing.route(logits, 2, "topk_then_softmax", False)
    np.testing.assert_array_equal(r.indices, [[1, 2]])
    e = math.exp(1.0)
    np.testing.assert_allclose(
        r.weights, [[e / (e + 1), 1 / (e + 1)]], rtol=1e-6
    )

  def test_softmax_then_topk_with_scale(self):
    logits = jnp.log(jnp.array([[0.1, 0.5, 0.3, 0.1]]))
    scale = jnp.array([1.0, 2.0, 3.0, 4.0])
    r = routing.route(logits, 2, "softmax_then_topk", False)
    np.testing.assert_allclose(r.weights, [[0.5, 0.3]], rtol=1e-6)
    r = routing.route(logits, 2, "softmax_then_topk", True, scale)
    np.testing.assert_allclose(r.weights, [[0.625 * 2, 0.375 * 3]], rtol=1e-6)

  def test_load_balance_loss_hand_checked(self):
    # E = 4 experts, T = 4 tokens, k = 2. Chosen: t0 (0, 1), t1 (0, 2),
    # t2 (1, 0), t3 (2, 1): counts 3, 3, 2, 0 of T * k = 8 assignments, so
    # f = (0.375, 0.375, 0.25, 0). P, the mean of the rows of `probs`:
    # ((.7 + .4 + .1 + .2) / 4, (.1 + .3 + .6 + .2) / 4, (.1 + .2 + .2 + .5)
    # / 4, .1) = (0.35, 0.30, 0.25, 0.10). E * sum f * P = 4 * (0.13125 +
    # 0.1125 + 0.0625) = 1.225, where E * sum P * P = 1.14, E * sum f * f =
    # 1.375, and f counted over T instead of T * k gives 2.45.
    probs = jnp.array([
        [0.7, 0.1, 0.1, 0.1],
        [0.4, 0.3, 0.2, 0.1],
        [0.1, 0.6, 0.2, 0.1],
        [0.2, 0.2, 0.5, 0.1],
    ])
    router = routing.RouterResult(
        weights=jnp.full((4, 2), 0.5),
        indices=jnp.array([[0, 1], [0, 2], [1, 0], [2, 1]], jnp.int32),
        probs=probs,
    )
    np.testing.assert_allclose(
        routing_lib.expert_assignment_fraction(router.indices, 4),
        [0.375, 0.375, 0.25, 0.0],
    )
    self.assertAlmostEqual(
        float(routing.load_balance_loss(router, 4)), 1.225, places=6
    )
    # The gradient flows through P only: d/dprobs[t, e] = E * f_e / T = f_e.
    grad = jax.grad(
        lambda p: routing.load_balance_loss(router.replace(probs=p), 4)
    )(probs)
    np.testing.assert_allclose(
        grad, np.tile([0.375, 0.375, 0.25, 0.0], (4, 1)), rtol=1e-6
    )

  def test_load_balance_loss_bounds(self):
    e = 4
    uniform = routing.RouterResult(
        weights=jnp.ones((8, 1)),
        indices=jnp.arange(8)[:, None] % e,
        probs=jnp.full((8, e), 1 / e),
    )
    self.assertAlmostEqual(
        float(routing.load_balance_loss(uniform, e)), 1.0, places=6
    )
    collapsed = routing.RouterResult(
        weights=jnp.ones((8, 1)),
        indices=jnp.zeros((8, 1), jnp.int32),
        probs=jax.nn.one_hot(jnp.zeros(8, jnp.int32), e),
    )
    self.assertAlmostEqual(
        float(routing.load_balance_loss(collapsed, e)), float(e), places=6
    )

  def test_layer_aux_without_weight(self):
    # With the weight (every path): MoEReferenceTest.check_aux.
    cfg = load_moe_config("tiny_mixtral", load_balance_loss_weight=0.0)
    _, aux0 = _apply(cfg)({"params": _random_params(cfg)}, _inputs(cfg))
    self.assertEqual(float(aux0.load_balance_loss), 0.0)

  def test_load_balance_gradient_pushes_towards_balance(self):
    cfg = load_moe_config("tiny_mixtral", load_balance_loss_weight=1.0)
    params = _random_params(cfg)
    x = _inputs(cfg, b=4, s=16)
    moe = RoutedMoE(cfg)

    @jax.jit
    def lb(p):
      return moe.apply({"params": p}, x)[1].load_balance_loss

    grads = jax.jit(jax.grad(lb))(params)
    self.assertGreater(float(jnp.abs(grads["gate"]["kernel"]).sum()), 0.0)
    stepped = jax.tree.map(lambda p, g: p - 1.0 * g, params, grads)
    self.assertLess(float(lb(stepped)), float(lb(params)))


class LayerTest(parameterized.TestCase):

  def test_parameter_layout(self):
    cfg = load_moe_config("tiny_gemma4_26b")
    shapes = jax.tree.map(jnp.shape, _random_params(cfg))
    e, m, h = cfg.num_experts, cfg.emb_dim, cfg.moe_mlp_dim
    self.assertEqual(
        shapes,
        {
            "gate": {"kernel": (m, e)},
            "wi_0": (e, m, h),
            "wi_1": (e, m, h),
            "wo": (e, h, m),
            "per_expert_scale": (e,),
        },
    )

  def test_routed_and_shared(self):
    cfg = load_moe_config("tiny_gemma4_26b")
    x = _inputs(cfg)
    both = RoutedAndSharedMoE(cfg)
    variables = unbox(jax.jit(both.init)(jax.random.key(0), x))
    self.assertEqual(
        set(variables["params"]), {"routed_experts", "shared_experts"}
    )
    y, _ = jax.jit(both.apply)(variables, x)
    routed, _ = _apply(cfg)(
        {"params": variables["params"]["routed_experts"]}, x
    )
    shared = jax.jit(SharedExpert(cfg).apply)(
        {"params": variables["params"]["shared_experts"]}, x
    )
    np.testing.assert_allclose(y, routed + shared, rtol=1e-5, atol=1e-6)
    p = variables["params"]["shared_experts"]
    ref = (
        numpy_reference._act("gelu", np.asarray(x @ p["wi_0"]))
        * np.asarray(x @ p["wi_1"])
    ) @ np.asarray(p["wo"])
    np.testing.assert_allclose(shared, ref, rtol=1e-4, atol=1e-5)

  @parameterized.parameters(
      ("tiny_mixtral", "sparse"),
      ("tiny_gemma4_26b", "dense"),
      ("tiny_mixtral", "drop"),
  )
  def test_gradients_finite_and_nonzero(self, config, path):
    self.check_gradients(config, path)

  @testing.slow
  @parameterized.parameters(
      ("tiny_gemma4_26b", "sparse"),
      ("tiny_mixtral", "dense"),
      ("tiny_gemma4_26b", "drop"),
  )
  def test_gradients_finite_and_nonzero_slow(self, config, path):
    self.check_gradients(config, path)

  def check_gradients(self, config, path):
    kw = dict(
        MATMUL_PATHS.get(path, dict(sparse_matmul=False, capacity_factor=1.0))
    )
    cfg = load_moe_config(config, **kw)
    params = _random_params(cfg)
    x = _inputs(cfg)
    moe = RoutedMoE(cfg)

    @jax.jit
    def loss(p):
      y, aux = moe.apply({"params": p}, x)
      return jnp.sum(y**2) + aux.load_balance_loss

    grads = jax.grad(loss)(params)
    for name, g in jax.tree_util.tree_leaves_with_path(grads):
      self.assertTrue(np.all(np.isfinite(g)), name)
      self.assertGreater(float(jnp.abs(g).max()), 0.0, name)

  def test_bfloat16_within_its_rounding(self):
    self.check_bfloat16("sparse")

  @testing.slow
  def test_bfloat16_within_its_rounding_dense(self):
    self.check_bfloat16("dense")

  def check_bfloat16(self, path):
    cfg = load_moe_config(
        "tiny_gemma4_26b", dtype="bfloat16", **MATMUL_PATHS[path]
    )
    params = _random_params(cfg.replace(dtype="float32"))
    x = _inputs(cfg, b=4, s=64).astype(jnp.bfloat16)  # 256 tokens
    y, _ = jax.jit(RoutedMoE(cfg).apply)({"params": params}, x)
    self.assertEqual(y.dtype, jnp.bfloat16)
    ref, _ = jax.jit(RoutedMoE(cfg.replace(dtype="float32")).apply)(
        {"params": params}, x.astype(jnp.float32)
    )
    self.assertLess(_rel_err(y, ref), np.sqrt(BF16_ROUNDINGS) * BF16_U)
    got = np.asarray(y, np.float64).reshape(-1, cfg.emb_dim)
    want = np.asarray(ref, np.float64).reshape(-1, cfg.emb_dim)
    per_token = np.linalg.norm(got - want, axis=1) / np.linalg.norm(
        want, axis=1
    )
    self.assertLess(per_token.max(), BF16_ROUNDINGS * BF16_U)

  @parameterized.parameters(*tuple(MODES))
  def test_router_runs_in_float32(self, mode):
    """The bfloat16 layer's compiled router: the gate contraction takes and
    gives float32, and no quantized type feeds it, in every mode."""
    cfg = load_moe_config("tiny_mixtral", dtype="bfloat16", quantization=mode)
    x = _inputs(cfg).astype(jnp.bfloat16)
    variables = jax.eval_shape(RoutedMoE(cfg).init, jax.random.key(0), x)
    text = jax.jit(RoutedMoE(cfg).apply).lower(variables, x).compile().as_text()
    gate = [c for c in hlo.contractions(text) if "/gate/" in c.op_name]
    self.assertNotEmpty(gate)
    for c in gate:
      self.assertEqual(c.result_types, {"f32"}, c)
      self.assertEqual(set(c.operand_types), {frozenset({"f32"})}, c)
      self.assertEmpty(c.quantized_inputs, c)

  def test_bad_input_shapes(self):
    cfg = load_moe_config("tiny_mixtral")
    params = _random_params(cfg)
    with self.assertRaisesRegex(ValueError, "emb_dim=64"):
      RoutedMoE(cfg).apply({"params": params}, jnp.zeros((2, 4, 32)))
    with self.assertRaisesRegex(ValueError, "gate_inputs"):
      RoutedMoE(cfg).apply(
          {"params": params}, jnp.zeros((2, 4, 64)), jnp.zeros((2, 5, 64))
      )

  def test_unregistered_call_site(self):
    cfg = load_moe_config("tiny_mixtral")

    def call(module):
      return module.einsum(
          "wi_2", "ab,bc->ac", jnp.ones((2, 3)), jnp.ones((3, 4))
      )

    with self.assertRaisesRegex(ValueError, r"wi_2.*'wi_0', 'wi_1', 'wo'"):
      RoutedMoE(cfg).init(jax.random.key(0), method=call)


if __name__ == "__main__":
  absltest.main()
