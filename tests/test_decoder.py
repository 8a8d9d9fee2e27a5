"""The reference Linen decoder and its train step."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

from linen_moe import load_model_config
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.models.decoder import scanned_to_unrolled
from linen_moe._src.models.decoder import unrolled_to_scanned
from linen_moe._src.training import step as train_lib
from linen_moe.sharding import unbox
from linen_moe.training import MarkovData

CONFIGS = ("tiny_mixtral", "tiny_gemma4_26b")


def _tokens(cfg, batch=4, seq=16, seed=1):
  return jnp.asarray(next(MarkovData(cfg.vocab_size).batches(batch, seq, seed)))


class DecoderTest(parameterized.TestCase):

  @parameterized.parameters(*CONFIGS)
  def test_scanned_equals_unrolled(self, config):
    cfg = load_model_config(config)
    tokens = _tokens(cfg)
    scanned = Decoder(cfg)
    unrolled = Decoder(cfg.replace(scan_layers=False))
    variables = unbox(scanned.init(jax.random.key(0), tokens))
    self.assertEqual(
        variables["params"]["layers"]["moe"]["wi_0"].shape,
        (
            cfg.num_layers,
            cfg.moe.num_experts,
            cfg.moe.emb_dim,
            cfg.moe.moe_mlp_dim,
        ),
    )
    as_unrolled = scanned_to_unrolled(variables, cfg.num_layers)
    self.assertEqual(
        jax.tree.structure(as_unrolled),
        jax.tree.structure(unbox(unrolled.init(jax.random.key(0), tokens))),
    )
    (l1, a1), (l2, a2) = (
        scanned.apply(variables, tokens),
        unrolled.apply(as_unrolled, tokens),
    )
    np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        a1["load_balance_loss"], a2["load_balance_loss"], rtol=1e-5
    )
    back = unrolled_to_scanned(as_unrolled, cfg.num_layers)
    jax.tree.map(np.testing.assert_array_equal, back, variables)

  def test_gemma_block_uses_gate_inputs(self):
    cfg = load_model_config("tiny_gemma4_26b")
    tokens = _tokens(cfg)
    model = Decoder(cfg)
    variables = unbox(model.init(jax.random.key(0), tokens))
    block = variables["params"]["layers"]
    self.assertIn("router_input_scale", block)
    self.assertIn("post_routed_norm", block)
    self.assertIn("post_shared_norm", block)
    self.assertIn("shared_experts", block)
    # The router reads its own input: scaling the router input scale changes
    # routing (and so the output), while the experts' input is unchanged.
    changed = jax.tree.map(lambda x: x, variables)
    changed["params"]["layers"]["router_input_scale"] = (
        block["router_input_scale"] * -3.0
    )
    l1, _ = model.apply(variables, tokens)
    l2, _ = model.apply(changed, tokens)
    self.assertGreater(float(jnp.abs(l1 - l2).max()), 1e-4)

  def test_bad_tokens(self):
    cfg = load_model_config("tiny_mixtral")
    with self.assertRaisesRegex(TypeError, "integer token ids"):
      Decoder(cfg).init(jax.random.key(0), jnp.zeros((2, 4), jnp.float32))


class TrainStepTest(parameterized.TestCase):

  @parameterized.product(config=CONFIGS, scan=(True, False))
  def test_training_reduces_loss(self, config, scan):
    cfg = load_model_config(config, scan_layers=scan)
    data = MarkovData(cfg.vocab_size)
    batches = data.batches(16, 32, seed=2)
    model = Decoder(cfg)
    opt = train_lib.default_optimizer(1e-2)
    tokens = jnp.asarray(next(batches))
    state = train_lib.init_train_state(model, opt, tokens, jax.random.key(0))
    step = jax.jit(train_lib.make_train_step(model, opt))
    losses = []
    for i in range(40):
      state, metrics = step(
          state, jnp.asarray(next(batches)), jax.random.key(i)
      )
      losses.append(float(metrics["cross_entropy"]))
    self.assertTrue(np.all(np.isfinite(losses)))
    self.assertLess(np.mean(losses[-5:]), losses[0] - 1.5)
    self.assertGreater(np.mean(losses[-5:]), data.best_loss - 0.05)

  def test_grad_accum_equals_full_batch(self):
    cfg = load_model_config("tiny_mixtral")
    model = Decoder(cfg)
    opt = optax.sgd(0.1)
    tokens = _tokens(cfg, batch=8)
    state = train_lib.init_train_state(model, opt, tokens, jax.random.key(0))
    full, m_full = jax.jit(train_lib.make_train_step(model, opt))(
        state, tokens, jax.random.key(1)
    )
    acc, m_acc = jax.jit(train_lib.make_train_step(model, opt, grad_accum=4))(
        state, tokens, jax.random.key(1)
    )
    # The load-balance loss is nonlinear in the batch composition, so compare
    # with it off.
    np.testing.assert_allclose(
        m_full["cross_entropy"], m_acc["cross_entropy"], rtol=1e-5
    )
    cfg0 = cfg.replace(load_balance_loss_weight=0.0)
    model0 = Decoder(cfg0)
    full, _ = jax.jit(train_lib.make_train_step(model0, opt))(
        state, tokens, jax.random.key(1)
    )
    acc, _ = jax.jit(train_lib.make_train_step(model0, opt, grad_accum=4))(
        state, tokens, jax.random.key(1)
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6),
        full.params,
        acc.params,
    )

  def test_grad_accum_must_divide_batch(self):
    with self.assertRaisesRegex(ValueError, "grad_accum=3"):
      train_lib.split_microbatches(jnp.zeros((8, 4), jnp.int32), 3)


class OverwriteRuleTest(absltest.TestCase):

  def test_overwrite_takes_new_value(self):
    state = {"a": {"input_scale": jnp.ones((1,))}}
    grads = {"a": {"input_scale": jnp.full((1,), 0.25)}}
    new = train_lib.overwrite_with_gradient(state, grads)
    np.testing.assert_array_equal(new["a"]["input_scale"], [0.25])
    with self.assertRaises(ValueError):
      train_lib.overwrite_with_gradient(state, {"b": grads["a"]})

  def test_microbatch_amax_takes_maximum_not_last_or_sum(self):
    past = jnp.array([0.0, 3.0, 2.0])  # rolled history shared by both
    small = past.at[0].set(1.0)
    large = past.at[0].set(100.0)
    for first, second in ((large, small), (small, large)):
      combined = train_lib.combine_overwrite_microbatches(
          {"h": first}, {"h": second}
      )["h"]
      np.testing.assert_array_equal(combined, [100.0, 3.0, 2.0])


if __name__ == "__main__":
  absltest.main()
