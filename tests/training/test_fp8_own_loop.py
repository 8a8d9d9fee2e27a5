"""fp8 in a training loop of your own, never silent.

NNX: a loop written as the Flax docs write one (`nnx.value_and_grad` over
`nnx.Param`, `optimizer.update`) never updates the fp8 scales; it warns
once, when its step is traced, naming `nnx_adapter.value_and_grad`, the
drop-in that updates them, whose step equals `nnx_adapter.train_step`'s.
Linen: applying an fp8 model without its `_overwrite_with_gradient`
collection is an error naming the collection and the guide.
"""

import functools
import warnings

from absl.testing import absltest
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from linen_moe import Decoder
from linen_moe import RoutedMoE
from linen_moe import load_model_config
from linen_moe import load_moe_config
from linen_moe import testing
from linen_moe._src.testing import helpers
import nnx_adapter

WARNED = r"differentiates the parameters but not the fp8 state"


def _model(quantization="fp8", **overrides) -> nnx_adapter.Decoder:
  cfg = load_model_config(
      "tiny_mixtral", quantization=quantization, num_layers=1, **overrides
  )
  return nnx_adapter.Decoder(cfg, rngs=nnx.Rngs(0))


def _tokens(cfg, step: int) -> jax.Array:
  return helpers.markov_tokens(cfg.vocab_size, 4, 8, seed=step)


# SGD: a step's update is linear in the gradient, so two ways of computing
# one step agree to float rounding (Adam's first step, lr * g / |g|, turns
# a rounding of a near-zero gradient into a whole step).
OPTIMIZER = optax.sgd(0.1)


def _docs_loop(model, steps: int, grad=nnx.value_and_grad) -> list[str]:
  """`steps` steps of the Flax docs' loop (with `grad` for
  `nnx.value_and_grad`); returns the warnings' messages."""
  optimizer = nnx.Optimizer(model, OPTIMIZER, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens, rng):
    def loss_fn(model):
      return nnx_adapter.decoder_loss(model, tokens, rng)

    (loss, _), grads = grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(steps):
      step(model, optimizer, _tokens(model.config, i), jax.random.key(i))
  return [str(w.message) for w in caught if "fp8" in str(w.message)]


def _leaves(model, kind) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, kind))]


class NNXOwnLoopTest(absltest.TestCase):

  def test_the_docs_loop_warns_once(self):
    self.check_warns_once(scan=True)

  @testing.slow
  def test_the_docs_loop_warns_once_unrolled(self):
    self.check_warns_once(scan=False)

  def check_warns_once(self, scan):
    model = _model(scan_layers=scan)
    fp8_before = _leaves(model, nnx_adapter.Fp8State)
    params_before = _leaves(model, nnx.Param)
    messages = _docs_loop(model, 3)
    self.assertLen(set(messages), 1)
    self.assertRegex(messages[0], WARNED)
    self.assertIn("nnx_adapter.value_and_grad", messages[0])
    self.assertIn("docs/guides/quantization.md", messages[0])
    # What it warns of: the parameters moved, the fp8 state did not.
    for a, b in zip(
        fp8_before, _leaves(model, nnx_adapter.Fp8State), strict=True
    ):
      np.testing.assert_array_equal(a, b)
    self.assertTrue(
        any(
            not np.array_equal(a, b)
            for a, b in zip(
                params_before, _leaves(model, nnx.Param), strict=True
            )
        )
    )

  def test_value_and_grad_updates_the_fp8_state_as_train_step(self):
    ours, reference = _model(), _model()
    fp8_before = _leaves(ours, nnx_adapter.Fp8State)
    self.assertEqual(_docs_loop(ours, 1, nnx_adapter.value_and_grad), [])
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(
            fp8_before, _leaves(ours, nnx_adapter.Fp8State), strict=True
        )
    ]
    self.assertTrue(any(moved))
    # One step of the library's NNX train step, same optimizer and batch
    # (compiled, as the loop's: one program, not one per op).
    optimizer = nnx.Optimizer(reference, OPTIMIZER, wrt=nnx.Param)
    nnx.jit(nnx_adapter.train_step)(
        reference, optimizer, _tokens(reference.config, 0), jax.random.key(0)
    )
    for kind in (nnx.Param, nnx_adapter.Fp8State):
      for a, b in zip(
          _leaves(ours, kind), _leaves(reference, kind), strict=True
      ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

  def test_no_warning_without_fp8_or_when_evaluating(self):
    self.assertEqual(_docs_loop(_model("none"), 1), [])
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      nnx.jit(lambda m, t: m(t)[0])(model, _tokens(model.config, 0))
    self.assertEqual([w for w in caught if "fp8" in str(w.message)], [])

  def test_bad_input(self):
    with self.assertRaisesRegex(
        TypeError, r"value_and_grad: fn=3 is not callable"
    ):
      nnx_adapter.value_and_grad(3)


class LinenWithoutFp8StateTest(absltest.TestCase):

  def test_applying_without_the_collection_names_it_and_the_guide(self):
    # The check is made while tracing: shapes alone show it, nothing runs.
    cfg = load_model_config("tiny_mixtral", quantization="fp8", num_layers=1)
    tokens = jnp.zeros((1, 4), jnp.int32)
    key = jax.random.key(0)
    variables = jax.eval_shape(Decoder(cfg).init, key, tokens)
    apply = functools.partial(jax.eval_shape, Decoder(cfg).apply)
    message = (
        r"The fp8 contraction layers/moe/wi_0_dot has no 'input_scale': the "
        r"variables applied hold no '_overwrite_with_gradient' collection"
        r".*see docs/guides/quantization\.md\.$"
    )
    with self.assertRaisesRegex(ValueError, message):
      apply({"params": variables["params"]}, tokens)
    apply(variables, tokens)  # every collection: fine
    # The layer alone, and a mutable collection that init would make.
    moe_cfg = load_moe_config("tiny_mixtral", quantization="fp8")
    x = jnp.zeros((1, 4, moe_cfg.emb_dim))
    params = jax.eval_shape(RoutedMoE(moe_cfg).init, key, x)["params"]
    moe = RoutedMoE(moe_cfg)
    with self.assertRaisesRegex(ValueError, "'_overwrite_with_gradient'"):
      jax.eval_shape(moe.apply, {"params": params}, x)
    jax.eval_shape(
        functools.partial(moe.apply, mutable=["_overwrite_with_gradient"]),
        {"params": params},
        x,
    )


if __name__ == "__main__":
  absltest.main()
