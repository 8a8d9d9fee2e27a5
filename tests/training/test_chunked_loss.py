"""The chunked vocabulary loss: `decoder_loss`'s numbers and gradients from
the hidden state, the head applied a chunk of positions at a time."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import load_model_config
from linen_moe._src.testing import helpers
from linen_moe.frontend import hidden_decoder_loss
from linen_moe.frontend import loss_weights
from linen_moe.models import output_kernel
from linen_moe.sharding import unbox
from linen_moe.training import chunked_cross_entropy
from linen_moe.training import cross_entropy
from linen_moe.training import decoder_loss
from linen_moe.training import make_eval_step


def _inputs(seed=0, b=2, s=9, m=8, v=37):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(b, s, m)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(m, v)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
  mask = rng.random((b, s)) > 0.2
  return hidden, kernel, tokens, loss_weights(mask)


class ChunkedCrossEntropyTest(parameterized.TestCase):

  @parameterized.parameters((1, 0.0), (4, 0.0), (9, 0.0), (37, 0.0), (4, 3.0))
  def test_value_and_gradients_equal_the_full_logits(self, chunk, softcap):
    hidden, kernel, tokens, weights = _inputs()

    def full(h, k):
      z = jnp.einsum("BSM,MV->BSV", h, k)
      if softcap:
        z = jnp.tanh(z / softcap) * softcap
      return cross_entropy(z, tokens, weights)

    def chunked(h, k):
      return chunked_cross_entropy(
          h, k, tokens, weights, softcap=softcap, chunk_size=chunk
      )

    want, (dh, dk) = jax.value_and_grad(full, argnums=(0, 1))(hidden, kernel)
    got, (gh, gk) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(
        hidden, kernel
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(gh, dh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gk, dk, rtol=1e-5, atol=1e-7)

  def test_bad_chunk_size(self):
    hidden, kernel, tokens, _ = _inputs()
    with self.assertRaisesRegex(ValueError, "chunk_size=0"):
      chunked_cross_entropy(hidden, kernel, tokens, chunk_size=0)

  def test_decoder_loss_from_hidden_equals_from_logits(self):
    # An untied head (the tied one is every train step's) and a final logit
    # softcap; packed segments.
    cfg = load_model_config("tiny_mixtral").replace(
        tie_embeddings=False, final_logit_softcap=2.0, num_layers=1
    )
    tokens = helpers.markov_tokens(cfg.vocab_size, 2, 12, 4)
    seg = jnp.asarray([[1] * 5 + [2] * 7, [1] * 10 + [0] * 2], jnp.int32)
    variables = unbox(Decoder(cfg).init(jax.random.key(0), tokens))
    params = variables["params"]

    def from_logits(p):
      logits, aux = Decoder(cfg).apply({**variables, "params": p}, tokens, seg)
      return decoder_loss(logits, aux, tokens, segment_ids=seg)[0]

    def from_hidden(p):
      model = Decoder(cfg, hidden_only=True)
      hidden, aux = model.apply({**variables, "params": p}, tokens, seg)
      return hidden_decoder_loss(
          hidden,
          output_kernel(cfg, p),
          aux,
          tokens,
          segment_ids=seg,
          softcap=cfg.final_logit_softcap,
          chunk_size=5,
      )[0]

    self.assertGreater(cfg.final_logit_softcap, 0)
    l1, g1 = jax.jit(jax.value_and_grad(from_logits))(params)
    l2, g2 = jax.jit(jax.value_and_grad(from_hidden))(params)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
        g2,
        g1,
    )

  def test_eval_step_sums_the_logits_terms(self):
    # The held-out loss: an untied, soft-capped head, a mask and packed
    # segments; the sum and count against NumPy on the decoder's logits.
    cfg = load_model_config("tiny_mixtral").replace(
        tie_embeddings=False, final_logit_softcap=2.0, num_layers=1
    )
    tokens = helpers.markov_tokens(cfg.vocab_size, 2, 12, 4)
    seg = jnp.asarray([[1] * 5 + [2] * 7, [1] * 10 + [0] * 2], jnp.int32)
    mask = np.ones((2, 12), bool)
    mask[0, 9:] = False
    variables = unbox(Decoder(cfg).init(jax.random.key(0), tokens))
    logits, _ = Decoder(cfg).apply(variables, tokens, seg)
    x = np.asarray(logits, np.float64)[:, :-1]
    logp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))[..., None]
    logp -= x.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    seg_np = np.asarray(seg)
    counted = mask[:, :-1] & mask[:, 1:] & (seg_np[:, :-1] == seg_np[:, 1:])
    counted &= seg_np[:, 1:] > 0
    total, count = jax.jit(make_eval_step(Decoder(cfg)))(
        variables, tokens, mask, seg
    )
    self.assertEqual(float(count), counted.sum())
    np.testing.assert_allclose(float(total), nll[counted].sum(), rtol=1e-5)

  def test_eval_step_holds_no_full_logits(self):
    # Compiled, never run, at two vocabularies past a block (S = 1024:
    # a block holds 32,768 entries): full float32 logits would grow the
    # temporaries by 4 * S * (V2 - V1) = 805 MB; blocks keep them flat.
    b, s = 1, 1024

    def temp(v):
      cfg = load_model_config("tiny_mixtral").replace(
          num_layers=1, vocab_size=v
      )
      model = Decoder(cfg)
      sample = jnp.zeros((b, 8), jnp.int32)
      variables = jax.eval_shape(
          lambda: unbox(model.init(jax.random.key(0), sample))
      )
      tokens = jax.ShapeDtypeStruct((b, s), jnp.int32)
      step = jax.jit(make_eval_step(model))
      compiled = step.lower(variables, tokens).compile()
      return compiled.memory_analysis().temp_size_in_bytes

    v1, v2 = 1 << 16, 1 << 18
    growth = temp(v2) - temp(v1)
    self.assertLess(growth, 0.1 * 4 * s * (v2 - v1), growth)


if __name__ == "__main__":
  absltest.main()
