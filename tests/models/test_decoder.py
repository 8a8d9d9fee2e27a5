"""The reference Linen decoder and its train step.

The default run holds each config, layer layout, `scan_unroll` value and
front end once; `_slow` methods beside a test hold the rest of its cases.
Variables of a config are initialized once per module (`_variables`).
"""

import functools
import re

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from linen_moe import Decoder
from linen_moe import RoutedMoE
from linen_moe import frontend
from linen_moe import load_model_config
from linen_moe import testing
from linen_moe import training
from linen_moe._src.models.scan import AUTO_UNROLL_MAX_LENGTH
from linen_moe._src.testing import helpers
from linen_moe._src.training import step as train_lib
from linen_moe.frontend import resolved_unroll
from linen_moe.models import scanned_to_unrolled
from linen_moe.models import unrolled_to_scanned
from linen_moe.sharding import unbox
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
import nnx_adapter


def _tokens(cfg, batch=4, seq=16, seed=1):
  return helpers.markov_tokens(cfg.vocab_size, batch, seq, seed)


@functools.cache
def _variables(cfg):
  """The decoder's variables at `cfg` on `_tokens(cfg)`, key 0 (shared)."""
  return unbox(Decoder(cfg).init(jax.random.key(0), _tokens(cfg)))


class DecoderTest(parameterized.TestCase):

  # tiny_gemma4_26b by default; tiny_mixtral's scanned and unrolled
  # layouts (loss and gradients) are `ScanUnrollTest`'s.
  def test_scanned_equals_unrolled(self):
    self.check_scanned_equals_unrolled("tiny_gemma4_26b")

  @testing.slow
  def test_scanned_equals_unrolled_slow(self):
    self.check_scanned_equals_unrolled("tiny_mixtral")

  def check_scanned_equals_unrolled(self, config):
    cfg = load_model_config(config)
    tokens = _tokens(cfg)
    scanned = Decoder(cfg)
    unrolled = Decoder(cfg.replace(scan_layers=False))
    variables = _variables(cfg)
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
        jax.tree.structure(
            unbox(jax.eval_shape(unrolled.init, jax.random.key(0), tokens))
        ),
    )
    (l1, a1), (l2, a2) = (
        jax.jit(scanned.apply)(variables, tokens),
        jax.jit(unrolled.apply)(as_unrolled, tokens),
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
    variables = _variables(cfg)
    block = variables["params"]["layers"]
    self.assertIn("router_input_scale", block)
    self.assertIn("post_routed_norm", block)
    self.assertIn("post_shared_norm", block)
    self.assertIn("shared_experts", block)
    # The router reads its own input: scaling layer 0's router input scale
    # scales exactly the router's input and changes its routing (so the
    # output), while the experts' input is unchanged.
    unrolled = Decoder(cfg.replace(scan_layers=False))
    variables = scanned_to_unrolled(variables, cfg.num_layers)
    changed = jax.tree.map(lambda x: x, variables)
    layer_0 = changed["params"]["layers_0"]
    layer_0["router_input_scale"] = layer_0["router_input_scale"] * -3.0

    @jax.jit  # one compile for both variables
    def moe_calls(variables):
      """(logits, [(experts' input, router input, output)] per layer)."""
      calls = []

      def record(call, args, kwargs, context):
        out = call(*args, **kwargs)
        if (
            isinstance(context.module, RoutedMoE)
            and context.method_name == "__call__"
        ):
          calls.append((*args, out[0]))
        return out

      with nn.intercept_methods(record):
        logits, _ = unrolled.apply(variables, tokens)
      return logits, calls

    (l1, calls), (l2, changed_calls) = moe_calls(variables), moe_calls(changed)
    self.assertLen(calls, cfg.num_layers)
    (x1, gate1, y1), (x2, gate2, y2) = calls[0], changed_calls[0]
    np.testing.assert_array_equal(x2, x1)  # the experts' input
    np.testing.assert_allclose(gate2, -3.0 * gate1, rtol=1e-6)
    self.assertGreater(float(jnp.abs(y2 - y1).max()), 1e-4)  # routed anew
    self.assertGreater(float(jnp.abs(l1 - l2).max()), 1e-4)

  def test_bad_tokens(self):
    cfg = load_model_config("tiny_mixtral")
    with self.assertRaisesRegex(TypeError, "integer token ids"):
      Decoder(cfg).init(jax.random.key(0), jnp.zeros((2, 4), jnp.float32))


# Steps of `test_training_approaches_the_optimum`, and how far above the
# optimum log(branching) = log(4) = 1.386 nats the mean of the last 5 steps'
# losses may still be (measured after 60 steps: tiny_mixtral 2.18, i.e. 0.80
# above; after 30, 4.22: its embeddings are unscaled, as Mixtral's, and
# start 8x smaller than scaled ones; tiny_gemma4_26b 2.12 after 30, 0.73
# above; both start at 6-7 nats).
TRAIN_STEPS = 60
MARGIN = 1.6


def _stack_loop_trips(hlo_text: str) -> list[int]:
  """Trip counts of the compiled loops over the decoder's layer stack.

  The stack's loops sit at the top of the traced function: their source
  path (`op_name`) is the jit, at most one transform of the decoder, then
  `while`; the loops inside a layer (searchsorted's) sit deeper.
  """
  top = re.compile(r' while\(.*op_name="[^"/]+(?:/[^"/]+)?/while"')
  trip = re.compile(r'known_trip_count":\{"n":"(\d+)"')
  return sorted(
      int(trip.search(line)[1])
      for line in hlo_text.splitlines()
      if top.search(line)
  )


class ScanUnrollTest(parameterized.TestCase):
  """`scan_unroll` changes the compiled loop, never the numbers or layout."""

  def test_resolved_unroll(self):
    self.assertIs(resolved_unroll(0, AUTO_UNROLL_MAX_LENGTH), True)
    self.assertEqual(resolved_unroll(0, AUTO_UNROLL_MAX_LENGTH + 1), 1)
    self.assertEqual(resolved_unroll(2, 6), 2)
    self.assertIs(resolved_unroll(6, 6), True)
    self.assertIs(resolved_unroll(9, 6), True)

  @parameterized.parameters(-1, True, 1.5, "2")
  def test_bad_scan_unroll(self, value):
    with self.assertRaisesRegex(ValueError, "scan_unroll"):
      load_model_config("tiny_mixtral").replace(scan_unroll=value)

  # Each unroll once in the default run: 2 in the Linen decoder's gradients,
  # the automatic one (in line, every other scanned test's) and 1 in the NNX
  # decoder's forward (cheaper to compile); the rest are `_slow`.
  def test_loss_and_grads_equal_the_unrolled_layout(self):
    self.check_loss_and_grads((2,), {2: [2, 2]})

  @testing.slow
  def test_loss_and_grads_equal_the_unrolled_layout_slow(self):
    self.check_loss_and_grads((0, 1), {0: [], 1: [4, 4]})

  def check_loss_and_grads(self, unrolls, want_loops):
    """4 layers: each of `unrolls` (0: the automatic unroll, in line; 1: a
    loop of 4 iterations; 2: a loop of 2 iterations of 2 layers) against the
    unrolled layout, which builds every layer as its own module; the stack's
    forward and backward loops exist only when asked for, with a trip per
    layer, or per two (`want_loops`)."""
    cfg = load_model_config("tiny_mixtral").replace(num_layers=4)
    tokens = _tokens(cfg)
    variables = _variables(cfg)

    def loss_and_grads(config, variables):
      """((loss, grads of the params), compiled HLO text): one compile."""

      def loss(p):
        logits, aux = Decoder(config).apply({**variables, "params": p}, tokens)
        return training.decoder_loss(logits, aux, tokens)[0]

      params = variables["params"]
      compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
      return compiled(params), compiled.as_text()

    as_unrolled = scanned_to_unrolled(variables, cfg.num_layers)
    (want_loss, want_grads), _ = loss_and_grads(
        cfg.replace(scan_layers=False), as_unrolled
    )
    loops = {}
    for unroll in unrolls:
      (got_loss, got_grads), hlo = loss_and_grads(
          cfg.replace(scan_unroll=unroll), variables
      )
      loops[unroll] = _stack_loop_trips(hlo)
      np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
      got_grads = scanned_to_unrolled({"params": got_grads}, cfg.num_layers)
      jax.tree.map(
          lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
          got_grads["params"],
          want_grads,
      )
    self.assertEqual(loops, want_loops)

  def test_nnx_decoder_unrolls_alike(self):
    self.check_nnx_unrolls((0, 1), {0: [], 1: [4]})

  @testing.slow
  def test_nnx_decoder_unrolls_alike_slow(self):
    self.check_nnx_unrolls((2,), {2: [2]})

  def check_nnx_unrolls(self, unrolls, want_loops):
    """The NNX decoder's forward at each of `unrolls`: the Linen logits,
    and the stack's loop only when asked for (`want_loops`)."""
    cfg = load_model_config("tiny_mixtral").replace(num_layers=4)
    tokens = _tokens(cfg)
    variables = _variables(cfg)
    want, _ = jax.jit(Decoder(cfg.replace(scan_unroll=1)).apply)(
        variables, tokens
    )
    loops = {}
    for unroll in unrolls:
      model = nnx_adapter.Decoder(
          cfg.replace(scan_unroll=unroll), rngs=nnx.Rngs(0)
      )
      nnx_adapter.linen_to_nnx(variables, model)
      forward = nnx.jit(lambda m: m(tokens)[0])
      np.testing.assert_allclose(forward(model), want, rtol=1e-5, atol=1e-6)
      loops[unroll] = _stack_loop_trips(
          forward.lower(model).compile().as_text()
      )
    self.assertEqual(loops, want_loops)


class TrainStepTest(parameterized.TestCase):

  # Each config once (tiny_gemma4_26b's scanned and unrolled layouts are
  # DecoderTest.test_scanned_equals_unrolled); tiny_gemma4_26b unrolled is
  # `_slow`.
  def test_training_approaches_the_optimum(self):
    self.check_approaches_the_optimum("tiny_mixtral", scan=True)

  @testing.slow
  def test_training_approaches_the_optimum_slow(self):
    self.check_approaches_the_optimum("tiny_gemma4_26b", scan=False)

  def check_approaches_the_optimum(self, config, scan):
    """The Markov data's best loss is known: every next token is one of 4
    equally likely successors, so a model that learned the table scores
    exactly log(4) on every batch; one below it (beyond noise) sees the
    future."""
    cfg = load_model_config(config, scan_layers=scan)
    data = MarkovData(cfg.vocab_size)
    batches = data.batches(16, 32, seed=2)
    model = Decoder(cfg)
    opt = default_optimizer(1e-2)
    tokens = jnp.asarray(next(batches))
    state = training.init_train_state(model, opt, tokens, jax.random.key(0))
    step = jax.jit(training.make_train_step(model, opt))
    losses = []
    for i in range(TRAIN_STEPS):
      state, metrics = step(
          state, jnp.asarray(next(batches)), jax.random.key(i)
      )
      losses.append(float(metrics["cross_entropy"]))
    self.assertTrue(np.all(np.isfinite(losses)))
    self.assertEqual(data.best_loss, np.log(4))
    self.assertGreater(losses[0], data.best_loss + 4)  # starts untrained
    self.assertBetween(
        np.mean(losses[-5:]), data.best_loss - 0.05, data.best_loss + MARGIN
    )

  def _full_and_accumulated(self, load_balance_loss_weight):
    """(state, metrics) of one full-batch step and of one of 4 microbatches,
    tiny_mixtral at `load_balance_loss_weight`, from the same state."""
    cfg = load_model_config("tiny_mixtral").replace(
        load_balance_loss_weight=load_balance_loss_weight
    )
    model = Decoder(cfg)
    opt = optax.sgd(0.1)
    tokens = _tokens(cfg, batch=8)
    state = training.init_train_state(model, opt, tokens, jax.random.key(0))
    return tuple(
        jax.jit(training.make_train_step(model, opt, grad_accum=n))(
            state, tokens, jax.random.key(1)
        )
        for n in (1, 4)
    )

  def test_grad_accum_equals_full_batch(self):
    # The load-balance loss is nonlinear in the batch composition, so the
    # params are compared with it off; the cross entropy is compared with it
    # on in `_slow`.
    (full, m_full), (acc, m_acc) = self._full_and_accumulated(0.0)
    np.testing.assert_allclose(
        m_full["cross_entropy"], m_acc["cross_entropy"], rtol=1e-5
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6),
        full.params,
        acc.params,
    )

  @testing.slow
  def test_grad_accum_equals_full_batch_slow(self):
    weight = load_model_config("tiny_mixtral").moe.load_balance_loss_weight
    self.assertGreater(weight, 0.0)
    (_, m_full), (_, m_acc) = self._full_and_accumulated(weight)
    np.testing.assert_allclose(
        m_full["cross_entropy"], m_acc["cross_entropy"], rtol=1e-5
    )

  def test_accumulate_gradients_from_the_formula(self):
    """Means of the gradients and metrics over the microbatches, maximum of
    the fp8 "gradients", also when all are negative (in a dtype without
    infinities too), for NumPy's loop over the same microbatches."""
    x = np.arange(24, dtype=np.float32).reshape(6, 4) / 7.0 - 2.0

    def grad_fn(xs, rng):
      del rng
      fp8 = {
          "f32": xs.min() - 10.0,
          "e4m3": (-3.0 - xs.max()).astype("float8_e4m3fn"),
      }
      return (xs.sum(0), fp8), {"loss": (xs**2).mean()}

    for grad_accum in (1, 3):
      (p, o), m = jax.jit(
          lambda x, g=grad_accum: frontend.accumulate_gradients(
              grad_fn, x, g, jax.random.key(0)
          )
      )(x)
      micro = np.split(x, grad_accum)
      np.testing.assert_allclose(
          p, np.mean([b.sum(0) for b in micro], 0), rtol=1e-6
      )
      np.testing.assert_allclose(
          m["loss"], np.mean([(b**2).mean() for b in micro]), rtol=1e-6
      )
      self.assertEqual(float(o["f32"]), max(b.min() - 10.0 for b in micro))
      self.assertEqual(o["e4m3"].dtype, jnp.float8_e4m3fn)
      want = max(
          float(jnp.asarray(-3.0 - b.max(), jnp.float8_e4m3fn)) for b in micro
      )
      self.assertEqual(float(o["e4m3"]), want)

  def test_microbatches_share_one_copy_of_the_model(self):
    """The step's program holds the forward and backward once, whatever
    `grad_accum` (a microbatch outside the scan would double it)."""
    cfg = load_model_config("tiny_mixtral", num_layers=1)
    model = Decoder(cfg)
    opt = optax.sgd(0.1)
    tokens = jnp.zeros((4, 8), jnp.int32)
    state = jax.eval_shape(
        lambda: training.init_train_state(model, opt, tokens, jax.random.key(0))
    )

    def dots(grad_accum):
      step = training.make_train_step(model, opt, grad_accum)
      jaxpr = jax.make_jaxpr(step)(state, tokens, jax.random.key(0))
      return sum(
          eqn.primitive.name == "dot_general"
          for eqn in helpers.jaxpr_equations(jaxpr)
      )

    self.assertGreater(dots(1), 0)
    self.assertEqual(dots(2), dots(1))

  def test_grad_accum_must_divide_batch(self):
    with self.assertRaisesRegex(ValueError, "grad_accum=3"):
      train_lib.split_microbatches(jnp.zeros((8, 4), jnp.int32), 3)


class OverwriteRuleTest(absltest.TestCase):

  def test_overwrite_takes_new_value(self):
    state = {"a": {"input_scale": jnp.ones((1,))}}
    grads = {"a": {"input_scale": jnp.full((1,), 0.25)}}
    new = frontend.overwrite_with_gradient(state, grads)
    np.testing.assert_array_equal(new["a"]["input_scale"], [0.25])
    with self.assertRaises(ValueError):
      frontend.overwrite_with_gradient(state, {"b": grads["a"]})

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
