"""Packed rows: segment ids and positions through the decoders and the loss.

A document inside a packed row gives the logits it gives alone, in the
Linen and the NNX decoder (one MoE, one MLA and one Gemma-4 config); the
gradient of a packed batch's loss is that of the same documents unpacked;
rotary positions restart per document; bad segment ids or positions are a
`ValueError` naming the argument.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import load_model_config
from linen_moe import testing
from linen_moe._src.models.attention import CausalSelfAttention
from linen_moe._src.models.segments import same_segment_targets
from linen_moe._src.testing import helpers
from linen_moe.frontend import loss_weights
from linen_moe.models import scanned_to_unrolled
from linen_moe.models import segment_positions
from linen_moe.sharding import unbox
from linen_moe.training import decoder_loss
import nnx_adapter

LENGTHS = (5, 7, 6)  # three documents, then padding
SEQ = 20


def _packed(vocab_size):
  """(documents, packed row [1, SEQ], segment ids [1, SEQ])."""
  tokens = np.asarray(helpers.markov_tokens(vocab_size, 1, sum(LENGTHS), 3))
  docs, start = [], 0
  for n in LENGTHS:
    docs.append(tokens[:, start : start + n])
    start += n
  pad = SEQ - sum(LENGTHS)
  row = np.concatenate([tokens, np.zeros((1, pad), np.int32)], axis=1)
  seg = np.concatenate(
      [np.full(n, i + 1) for i, n in enumerate(LENGTHS)] + [np.zeros(pad)]
  )
  return docs, row, seg[None].astype(np.int32)


def _alone(docs):
  """The documents alone, one a row, padded after their end (which a
  causal decoder's logits of the document do not see): [3, max], mask."""
  width = max(LENGTHS)
  rows = np.zeros((len(docs), width), np.int32)
  mask = np.zeros((len(docs), width), bool)
  for i, doc in enumerate(docs):
    rows[i, : doc.shape[1]], mask[i, : doc.shape[1]] = doc[0], True
  return rows, mask


@functools.cache
def _model(name):
  cfg = load_model_config(name)
  docs, row, seg = _packed(cfg.vocab_size)
  model = Decoder(cfg)
  variables = unbox(model.init(jax.random.key(0), row))
  return cfg, model, variables, docs, row, seg


@functools.cache
def _apply(name):
  """The jitted forward of config `name`: (variables, tokens, segment ids,
  positions) -> logits."""
  _, model, *_ = _model(name)
  return jax.jit(lambda v, t, s, p: model.apply(v, t, s, p)[0])


class SegmentHelpersTest(absltest.TestCase):

  def test_segment_positions_restart_in_each_run(self):
    seg = np.array([[1, 1, 1, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3]], np.int32)
    expected = np.zeros_like(seg)
    for b in range(seg.shape[0]):  # the loop from the definition
      for t in range(1, seg.shape[1]):
        same = seg[b, t] == seg[b, t - 1]
        expected[b, t] = expected[b, t - 1] + 1 if same else 0
    np.testing.assert_array_equal(segment_positions(seg), expected)
    np.testing.assert_array_equal(
        same_segment_targets(seg),
        [[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1]],
    )

  def test_loss_skips_targets_across_documents(self):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 11, (2, 7)).astype(np.int32)
    logits = rng.normal(size=(2, 7, 11)).astype(np.float32)
    seg = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 2, 2, 2]], np.int32)
    aux = {
        "load_balance_loss": 0.0,
        "router_z_loss": 0.0,
        "dropped_fraction": 0.0,
        "expert_load": np.zeros((1, 2)),
    }
    loss, _ = decoder_loss(logits, aux, tokens, segment_ids=seg)
    terms = []
    for b in range(2):
      for t in range(6):
        if seg[b, t] and seg[b, t] == seg[b, t + 1]:
          x = logits[b, t].astype(np.float64)
          lse = np.log(np.sum(np.exp(x - x.max()))) + x.max()
          terms.append(lse - x[tokens[b, t + 1]])
    self.assertLen(terms, 8)
    np.testing.assert_allclose(loss, np.mean(terms), rtol=1e-6)
    # The weights of a mask and segments: zero at the crossing targets.
    w = loss_weights(np.ones((2, 7), bool), seg)
    np.testing.assert_array_equal(w > 0, same_segment_targets(seg))


class PackedDecoderTest(parameterized.TestCase):

  def test_document_in_packed_row_equals_alone(self):
    self._document_equals_alone("tiny_mixtral")

  @testing.slow
  @parameterized.parameters("tiny_deepseek_v3_mla", "tiny_gemma4_text")
  def test_document_equals_alone_mla_and_gemma4(self, name):
    self._document_equals_alone(name)

  def _document_equals_alone(self, name):
    cfg, _, variables, docs, row, seg = _model(name)
    apply = _apply(name)
    rows, _ = _alone(docs)
    packed = apply(variables, row, seg, None)
    alone = apply(variables, rows, None, None)
    for i in (1, 2):  # the second and third document of the row
      start, n = sum(LENGTHS[:i]), LENGTHS[i]
      np.testing.assert_allclose(
          packed[0, start : start + n], alone[i, :n], rtol=1e-5, atol=1e-5
      )
    if name == "tiny_mixtral":  # the NNX decoder, the same packed row
      nnx_model = nnx_adapter.Decoder.from_linen(
          cfg, variables, sample_shape=row.shape
      )
      got = nnx.jit(lambda m, t, s: m(t, segment_ids=s)[0])(nnx_model, row, seg)
      np.testing.assert_allclose(got, packed, rtol=1e-5, atol=1e-5)

  def test_rotary_positions_restart_per_document(self):
    cfg, _, scanned, _, row, seg = _model("tiny_mixtral")
    # Unrolled and eager, the first attention's positions are concrete; the
    # run stops there.
    model = Decoder(cfg.replace(scan_layers=False))
    variables = scanned_to_unrolled(scanned, cfg.stack_plan)
    seen = []

    class Stop(Exception):
      pass

    def record(next_fun, args, kwargs, context):
      if isinstance(context.module, CausalSelfAttention):
        seen.append(np.asarray(args[1]))
        raise Stop
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(record), self.assertRaises(Stop):
      model.apply(variables, row, seg)
    expected = np.concatenate([np.arange(n) for n in LENGTHS] + [[0, 1]])
    np.testing.assert_array_equal(seen[0], expected[None])
    apply = _apply("tiny_mixtral")
    explicit = apply(scanned, row, seg, expected[None].astype(np.int32))
    default = apply(scanned, row, seg, None)
    np.testing.assert_array_equal(explicit, default)

  def test_gradient_of_packed_batch_equals_unpacked(self):
    # The aux losses see every token of a batch (padding too): off here.
    cfg = load_model_config("tiny_mixtral")
    cfg = cfg.replace(load_balance_loss_weight=0.0)
    _, _, variables, docs, row, seg = _model("tiny_mixtral")
    model = Decoder(cfg)
    rows, mask = _alone(docs)

    def packed_loss(params):
      logits, aux = model.apply({"params": params}, row, seg)
      return decoder_loss(logits, aux, row, segment_ids=seg)[0]

    def unpacked_loss(params):
      logits, aux = model.apply({"params": params}, rows)
      return decoder_loss(logits, aux, rows, loss_weights(mask))[0]

    params = variables["params"]
    l1, g1 = jax.jit(jax.value_and_grad(packed_loss))(params)
    l2, g2 = jax.jit(jax.value_and_grad(unpacked_loss))(params)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    self.assertGreater(float(jnp.abs(g1["embed"]["embedding"]).max()), 0.0)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        g1,
        g2,
    )


class BadSegmentsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("segment_shape", "segment_ids", np.ones((1, 3), np.int32), True),
      ("segment_dtype", "segment_ids", np.ones((1, SEQ), np.float32), True),
      ("segment_negative", "segment_ids", -np.ones((1, SEQ), np.int32), False),
      ("positions_negative", "positions", -np.ones((1, SEQ), np.int32), False),
      ("positions_rank", "positions", np.ones((SEQ,), np.int32), True),
  )
  def test_bad_argument_is_a_value_error_naming_it(self, arg, value, traced):
    _, model, variables, _, row, _ = _model("tiny_mixtral")
    with self.assertRaisesRegex(ValueError, arg):
      model.apply(variables, row, **{arg: value})
    if traced:  # shapes and dtypes: checked when traced too
      with self.assertRaisesRegex(ValueError, arg):
        jax.jit(lambda v, x: model.apply(v, row, **{arg: x}))(variables, value)

  def test_decode_takes_no_segments(self):
    cfg, _, _, _, row, seg = _model("tiny_mixtral")
    model = Decoder(cfg, decode=True)
    with self.assertRaisesRegex(ValueError, "segment_ids.*decode"):
      model.init(jax.random.key(0), row, seg)


if __name__ == "__main__":
  absltest.main()
