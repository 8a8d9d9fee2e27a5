"""Documented boundaries, each with a case that sits exactly on it.

A docstring that says "until their mass reaches p", "at least min_p times
the largest", "ids in [0, vocab_size)", "at most C tokens", "rounded up",
"an integer >= 2" or "in [0, 1)" draws a line; a `<` that becomes `<=`
moves it by one case, which only a case on the line sees. Each test names
the docstring it reads. The sliding window's `0 <= i - j < W` and the
kept ties of top-k are pinned by `test_attention` and `test_generate`.
"""

import os
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import MoEConfig
from linen_moe import RoutedMoE
from linen_moe import data
from linen_moe import decoding
from linen_moe import frontend
from linen_moe import load_model_config
from linen_moe import tokens as tokens_lib
from linen_moe import training
from linen_moe._src.models import sampling
from linen_moe.sharding import unbox

# Probabilities that float32 holds exactly, so that sums of them land
# exactly on a top-p and products exactly on a min-p floor.
PROBS = (0.5, 0.25, 0.125, 0.125)
LOGITS = np.log(np.float32(PROBS))
T, F = True, False


@jax.jit
def _filter(logits, top_k, top_p, min_p):
  return sampling.filter_logits(logits, 1.0, top_k, top_p, min_p)


def _kept(logits, top_k=0, top_p=1.0, min_p=0.0):
  out = _filter(jnp.asarray(logits, jnp.float32), top_k, top_p, min_p)
  return np.isfinite(np.asarray(out)).tolist()


class FilterBoundaryTest(parameterized.TestCase):
  """`filter_logits`: "top-p keeps the most likely tokens ... until their
  mass reaches p (the smallest such set, at least one token, ties with the
  last kept; p = 1: all); min-p keeps the tokens whose renormalized
  probability is at least min_p times the largest"; top-k "k = 0: all"."""

  def test_exact_probabilities_and_unfiltered_logits(self):
    self.assertEqual(jax.nn.softmax(LOGITS).tolist(), list(PROBS))
    self.assertEqual(_filter(LOGITS, 0, 1.0, 0.0).tolist(), LOGITS.tolist())

  @parameterized.named_parameters(
      # 0.5 + 0.25 reaches 0.75: the third token is not needed.
      ("top_p_reached_by_two", dict(top_p=0.75), [T, T, F, F]),
      ("top_p_reached_by_one", dict(top_p=0.5), [T, F, F, F]),
      # Reached at the third token; the fourth ties with it.
      ("top_p_reached_at_a_tie", dict(top_p=0.875), [T, T, T, T]),
      ("top_p_below_the_first", dict(top_p=0.01), [T, F, F, F]),
      # The floor is 0.25 * 0.5 = 0.125: the last two sit on it.
      ("min_p_floor_on_the_last", dict(min_p=0.25), [T, T, T, T]),
      ("min_p_floor_on_the_second", dict(min_p=0.5), [T, T, F, F]),
      ("min_p_one", dict(min_p=1.0), [T, F, F, F]),
  )
  def test_exact_mass_and_floor(self, kwargs, want):
    self.assertEqual(_kept(LOGITS, **kwargs), want)

  def test_top_k_of_the_whole_vocabulary(self):
    distinct = [3.0, 2.0, 1.0, 0.0]
    self.assertEqual(_kept(distinct, top_k=4), [T, T, T, T])
    self.assertEqual(_kept(distinct, top_k=3), [T, T, T, F])

  def test_min_p_one_keeps_the_tied_largest(self):
    self.assertEqual(_kept([1.0, 1.0, 0.0, 0.0], min_p=1.0), [T, T, F, F])

  def test_top_p_that_float32_rounds_to_zero_keeps_one(self):
    # "At least one token", also for a top_p in (0, 1] that float32 rounds
    # to 0 (`generate` checks 0 < top_p in float64 and accepts 1e-46): the
    # filter, in float32, keeps the most likely token.
    self.assertEqual(_kept(LOGITS, top_p=1e-46), [T, F, F, F])

  def test_top_p_one_keeps_all(self):
    # The first token's float32 probability is 1: the mass above each of
    # the others has reached 1 already, and p = 1 still keeps them.
    logits = [0.0, -30.0, -30.0, -30.0]
    self.assertEqual(float(jax.nn.softmax(jnp.asarray(logits))[0]), 1.0)
    self.assertEqual(_kept(logits, top_p=1.0), [T, T, T, T])


class GenerateArgumentTest(absltest.TestCase):
  """`generate`'s arguments on the edges of their documented ranges: ids in
  [0, vocab_size), top_k >= 0, top_p in (0, 1], min_p in [0, 1],
  temperature >= 0, max_new_tokens >= 1. The arguments are checked before
  anything runs, then `variables` (here holding a cache, which it must
  not): reaching that error means every argument was accepted."""

  def _generate(self, error, **kwargs):
    config = load_model_config("tiny_mixtral")
    v = config.vocab_size
    args = dict(prompts=[[0, v - 1]], max_new_tokens=1, stop_ids=[0, v - 1])
    settings = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    for name in settings:
      if name in kwargs:
        settings[name] = kwargs.pop(name)
    args |= kwargs
    with self.assertRaisesRegex(ValueError, error):
      args["sampling"] = decoding.Sampling(**settings)
      decoding.generate(config, {"cache": {}}, args.pop("prompts"), **args)

  def test_edges_inside_are_accepted(self):
    accepted = "must not hold a cache"
    self._generate(accepted)
    self._generate(accepted, min_p=1.0, top_k=10**6)

  def test_edges_outside_are_rejected(self):
    v = load_model_config("tiny_mixtral").vocab_size
    above_one = float(np.nextafter(1, 2))  # 1.0000000000000002
    self._generate(r"prompts\[0\]\[0\]=-1 is outside", prompts=[[-1]])
    self._generate(rf"prompts\[0\]\[1\]={v} is outside", prompts=[[0, v]])
    self._generate(rf"stop_ids\[0\]={v} is outside", stop_ids=[v])
    self._generate("top_k=-1", top_k=-1)
    self._generate(f"top_p={above_one}", top_p=above_one)
    self._generate(f"min_p={above_one}", min_p=above_one)
    self._generate("min_p=-5e-324", min_p=float(np.nextafter(0, -1)))


class TokenRangeTest(absltest.TestCase):
  """Token ids "in [0, vocab_size)": vocab_size - 1 is in, vocab_size out,
  in the decoders' checks and in a corpus of pre-tokenized ids."""

  def test_last_id_is_valid(self):
    v = 8
    ids = np.array([[-1, 0, v - 1, v]], np.int32)
    np.testing.assert_array_equal(
        tokens_lib.valid_token_mask(ids, v), [[F, T, T, F]]
    )
    good = ids[:, 1:3]
    self.assertIs(tokens_lib.validate_tokens(good, v), good)
    with self.assertRaisesRegex(ValueError, rf"tokens\[0, 2\]={v} is invalid"):
      tokens_lib.validate_tokens(ids[:, 1:], v)

  def test_corpus_ids_and_end_of_document_id(self):
    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory)
    path = os.path.join(directory, "ids.npy")
    np.save(path, np.array([3, 15, 0, 15], np.uint16))
    corpus = data.read_corpus(path, vocab_size=16, eod_id=15)
    self.assertEqual(corpus.documents.tolist(), [[0, 2], [2, 4]])
    with self.assertRaisesRegex(ValueError, r"eod_id=16 is outside"):
      data.read_corpus(path, vocab_size=16, eod_id=16)
    with self.assertRaisesRegex(ValueError, r"id 15 at position 1"):
      data.read_corpus(path, vocab_size=15)


class CapacityTest(absltest.TestCase):
  """The dropping dense path: "each expert takes at most
  ceil(capacity_factor * seq * k / E) tokens per sequence", claimed by all
  first choices in token order, then all second choices (`MoEConfig`).

  Every token of two sequences of 5 chooses experts 0 and 1; the capacity
  is ceil(1.0 * 5 * 2 / 4) = ceil(2.5) = 3: tokens 0-2 keep both choices,
  tokens 3-4 lose both, and 4 of the 10 assignments of a sequence drop.
  `expert_fraction` is counted before the dropping.
  """

  def test_capacity_rounds_up_and_is_reached(self):
    cfg = MoEConfig(
        num_experts=4,
        num_experts_per_tok=2,
        emb_dim=4,
        moe_mlp_dim=4,
        sparse_matmul=False,
        capacity_factor=1.0,
    )
    x = jnp.ones((2, 5, 4), jnp.float32)
    params = unbox(RoutedMoE(cfg).init(jax.random.key(0), x))["params"]
    # Router logits of every token: [8, 4, 0, 0].
    params["gate"]["kernel"] = jnp.tile(jnp.array([2.0, 1.0, 0.0, 0.0]), (4, 1))
    y, aux = jax.jit(RoutedMoE(cfg).apply)({"params": params}, x)
    self.assertAlmostEqual(float(aux.dropped_fraction), 0.4, places=6)
    np.testing.assert_array_equal(aux.expert_fraction, [0.5, 0.5, 0, 0])
    y = np.abs(np.asarray(y)).max(-1)  # [2, 5]
    self.assertTrue((y[:, :3] > 0).all())
    np.testing.assert_array_equal(y[:, 3:], 0)


def _corpus(test, n):
  """A corpus of n ids (no end-of-document id) in a temporary file."""
  directory = tempfile.mkdtemp()
  test.addCleanup(shutil.rmtree, directory)
  path = os.path.join(directory, "ids.npy")
  np.save(path, np.arange(n, dtype=np.uint16) % 16)
  return data.read_corpus(path, vocab_size=16)


class HeldOutSplitTest(absltest.TestCase):
  """`DataPipeline`: seq_len "S >= 2"; eval_fraction "in [0, 1): the share
  held out, rounded up to whole sequences", 0.1 by default; at least one
  sequence left to train on; `eval_dataset` needs num_batches * B held-out
  sequences, no more."""

  def test_default_fraction_rounds_up(self):
    # 26 ids, pairs: 13 sequences; 0.1 of them is 1.3, rounded up to 2.
    pipeline = data.DataPipeline(_corpus(self, 26), seq_len=2, batch_size=2)
    self.assertEqual(pipeline.eval_fraction, 0.1)
    self.assertEqual((len(pipeline.train), len(pipeline.eval)), (11, 2))
    self.assertLen(pipeline.eval_dataset(1), 1)  # 1 batch of 2: exactly all
    with self.assertRaisesRegex(ValueError, "need 4 held-out sequences"):
      pipeline.eval_dataset(2)

  def test_edges_of_the_fraction_and_the_length(self):
    corpus = _corpus(self, 4)
    # Two sequences, one held out: one left to train on is enough.
    pipeline = data.DataPipeline(
        corpus, seq_len=2, batch_size=1, eval_fraction=0.5
    )
    self.assertEqual((len(pipeline.train), len(pipeline.eval)), (1, 1))
    with self.assertRaisesRegex(ValueError, r"eval_fraction=1 .*\[0, 1\)"):
      data.DataPipeline(corpus, seq_len=2, batch_size=1, eval_fraction=1)
    with self.assertRaisesRegex(ValueError, "seq_len=1 is invalid"):
      data.DataPipeline(corpus, seq_len=1, batch_size=1)


class SkipRuleBoundaryTest(absltest.TestCase):
  """A step is skipped when its loss or a gradient is "non-finite": an
  infinity as much as a NaN; the largest float is finite."""

  def test_infinities_are_not_finite(self):
    big = np.finfo(np.float32).max
    for value, finite in ((big, T), (-big, T), (np.inf, F), (-np.inf, F)):
      tree = {"loss": jnp.float32(1.0), "grad": jnp.array([0.0, value])}
      self.assertEqual(bool(frontend.all_finite(tree)), finite, value)


class TwoTokensTest(absltest.TestCase):
  """The loss "needs at least 2 tokens per row": 2 is one target."""

  def test_two_tokens_are_one_target(self):
    logits = np.log(np.float32([[[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]]))
    tokens = jnp.array([[0, 1]], jnp.int32)
    loss = training.cross_entropy(jnp.asarray(logits), tokens)
    np.testing.assert_allclose(loss, -np.log(0.25), rtol=1e-6)
    kernel = jnp.eye(3)  # hidden @ kernel = the logits above
    chunked = training.chunked_cross_entropy(
        jnp.asarray(logits), kernel, tokens
    )
    np.testing.assert_allclose(chunked, -np.log(0.25), rtol=1e-6)


if __name__ == "__main__":
  absltest.main()
