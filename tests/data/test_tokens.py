"""Token ids outside [0, vocab_size): an error naming the id outside `jit`,
NaN logits inside it, and a checked mode that raises."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import tokens as tokens_lib
from linen_moe._src.testing import helpers

V = 256  # tiny_mixtral's vocabulary


class ValidateTokensTest(absltest.TestCase):

  def test_validate_tokens(self):
    good = np.zeros((2, 8), np.int32)
    self.assertIs(tokens_lib.validate_tokens(good, V), good)
    for bad_id in (-1, V, 10**6):
      bad = good.copy()
      bad[1, 5] = bad_id
      with self.assertRaisesRegex(
          ValueError,
          rf"^tokens\[1, 5\]={bad_id} is invalid: token ids must be in "
          rf"\[0, vocab_size={V}\) \(1 of 16 ids",
      ):
        tokens_lib.validate_tokens(bad, V)
    with self.assertRaisesRegex(
        TypeError, r"integer token ids .*float32\[2, 8\]"
    ):
      tokens_lib.validate_tokens(good.astype(np.float32), V)
    with self.assertRaisesRegex(TypeError, r"int32\[16\]"):
      tokens_lib.validate_tokens(good.reshape(-1), V)
    with self.assertRaisesRegex(TypeError, "traced.*checked"):
      jax.jit(lambda t: tokens_lib.validate_tokens(t, V))(good)


class InsideJitTest(absltest.TestCase):

  def test_bad_ids_embed_as_nan_and_checked_mode_raises(self):
    cfg = helpers.config_on_path("tiny_mixtral", num_layers=1)
    model = Decoder(cfg)
    good = jnp.ones((1, 4), jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(0), good)
    apply = jax.jit(model.apply)
    self.assertTrue(np.isfinite(apply(variables, good)[0]).all())
    for bad_id in (-1, V):  # -1 would wrap to the last row in nn.Embed
      bad = good.at[0, 2].set(bad_id)
      logits = np.asarray(apply(variables, bad)[0])
      self.assertTrue(np.isnan(logits[0, 2]).all())  # so the loss is NaN
      with self.assertRaisesRegex(
          ValueError,
          rf"^tokens\[0, 2\]={bad_id} is invalid: token ids must be in "
          rf"\[0, vocab_size={V}\)\.$",
      ):
        tokens_lib.checked(apply)(variables, bad)
    logits, _ = tokens_lib.checked(apply)(variables, good)
    self.assertTrue(np.isfinite(logits).all())


if __name__ == "__main__":
  absltest.main()
