"""Concrete token ids are checked where a decoder is entered; traced ids keep
the NaN contract.

Outside a trace, `Decoder.apply`, the NNX decoder and
`decoding.greedy_generate` raise the error of `tokens.validate_tokens` for
an id outside [0, vocab_size); under `jit` such an id embeds as NaN (and
`tokens.checked` reports it). `linen_moe.tokens` keeps one function per
job; `check_tokens`, the old name of `valid_token_mask`, still works with a
DeprecationWarning.
"""

import functools

from absl.testing import absltest
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import decoding
from linen_moe import frontend
from linen_moe import load_model_config
from linen_moe import tokens as tokens_lib
import nnx_adapter

CFG = load_model_config("tiny_mixtral", num_layers=1)
V = CFG.vocab_size
# [0, 2] is the first id outside [0, V): the error names it.
BAD = np.array([[1, 2, V, 3], [4, -1, 5, 6]], np.int32)
MESSAGE = (
    rf"tokens\[0, 2\]={V} is invalid: token ids must be in "
    rf"\[0, vocab_size={V}\) \(2 of 8 ids are outside it\)"
)


@functools.cache
def _variables():
  return jax.jit(Decoder(CFG).init)(
      jax.random.key(0), jnp.ones((2, 4), jnp.int32)
  )


class LinenDecoderTest(absltest.TestCase):

  def test_eager_apply_raises_naming_the_id(self):
    with self.assertRaisesRegex(ValueError, MESSAGE):
      Decoder(CFG).apply(_variables(), BAD)
    with self.assertRaisesRegex(ValueError, MESSAGE):
      Decoder(CFG).apply(_variables(), jnp.asarray(BAD))

  def test_eager_apply_of_good_ids_runs(self):
    logits, _ = Decoder(CFG).apply(_variables(), np.ones((2, 4), np.int32))
    self.assertEqual(logits.shape, (2, 4, V))

  def test_traced_ids_keep_the_nan_contract(self):
    logits, _ = jax.jit(Decoder(CFG).apply)(_variables(), BAD)
    logits = np.asarray(logits)
    self.assertTrue(np.isnan(logits[0, 2]).all())
    self.assertTrue(np.isnan(logits[1, 1]).all())

  def test_shape_and_dtype_are_checked_even_traced(self):
    for bad in (np.ones((2, 4), np.float32), np.ones((8,), np.int32)):
      with self.assertRaisesRegex(TypeError, "integer token ids"):
        jax.jit(Decoder(CFG).apply)(_variables(), bad)


class NNXDecoderTest(absltest.TestCase):

  def test_eager_call_raises_naming_the_id(self):
    model = nnx_adapter.Decoder(CFG, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, MESSAGE):
      model(BAD)


class GreedyGenerateTest(absltest.TestCase):

  def test_bad_prompt_raises_before_any_decoding(self):
    with self.assertRaisesRegex(
        ValueError, MESSAGE.replace("tokens", "prompt")
    ):
      decoding.greedy_generate(CFG, _variables(), jnp.asarray(BAD), 2)

  def test_nnx_greedy_generate_checks_the_prompt_like_linen(self):
    model = nnx_adapter.Decoder(CFG, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(
        ValueError, MESSAGE.replace("tokens", "prompt")
    ):
      nnx_adapter.greedy_generate(model, BAD, 2)
    with self.assertRaisesRegex(TypeError, "integer token ids"):
      nnx_adapter.greedy_generate(model, np.array([[1.7, 2.2]]), 2)


class NamesTest(absltest.TestCase):

  def test_one_function_per_job(self):
    self.assertEqual(
        sorted(tokens_lib.__all__),
        [
            "checked",
            "valid_token_mask",
            "validate_tokens",
        ],
    )
    good = np.zeros((2, 3), np.int32)
    self.assertIs(frontend.validate_tokens_if_concrete(good, V), good)
    mask = jax.jit(lambda t: tokens_lib.valid_token_mask(t, V))(BAD)
    np.testing.assert_array_equal(mask, (BAD >= 0) & (BAD < V))

  def test_old_name_warns(self):
    with self.assertWarnsRegex(DeprecationWarning, "valid_token_mask"):
      old = tokens_lib.check_tokens
    self.assertIs(old, tokens_lib.valid_token_mask)


if __name__ == "__main__":
  absltest.main()
