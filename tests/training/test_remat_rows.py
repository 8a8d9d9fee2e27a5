"""The sparse path's own remat of its sorted rows (`RoutedMoE.remat_rows`).

A layer alone gathers its sorted rows [T k, M] again in its backward
rather than keep them; a decoder block under a `remat` policy recomputes
the whole layer anyway, and with `ModelConfig.remat_moe_rows=False` turns
that off: one gather of the rows fewer in the step, the same numbers
(float32, CPU) with it on or off, under no remat and under full remat.
"""

import functools
import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax._src.ad_checkpoint import saved_residuals
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import RoutedAndSharedMoE
from linen_moe import RoutedMoE
from linen_moe import load_model_config
from linen_moe import load_moe_config
from linen_moe import training
from linen_moe._src.config.model_config import REMAT_POLICIES
from linen_moe._src.layer import sparse
from linen_moe._src.models import blocks
from linen_moe._src.models.remat import layer_remats_rows
from linen_moe._src.testing import helpers
from linen_moe.sharding import unbox

B, S = 2, 16


def _decoder_loss(cfg):
  """loss(params) of a one-layer Linen decoder at `cfg`, and its params."""
  tokens = helpers.markov_tokens(cfg.vocab_size, B, S, 1)
  variables = unbox(Decoder(cfg).init(jax.random.key(0), tokens))

  def loss(p):
    logits, aux = Decoder(cfg).apply({**variables, "params": p}, tokens)
    return training.decoder_loss(logits, aux, tokens)[0]

  return loss, variables["params"]


def _with_rows(remat_rows: bool):
  """The decoder's blocks built with `remat_rows`, whatever their policy."""
  return mock.patch.object(
      blocks, "layer_remats_rows", lambda config: remat_rows
  )


@functools.cache
def _decoder_case(remat: str):
  cfg = load_model_config(
      "tiny_mixtral", num_layers=1, scan_layers=False, remat=remat
  )
  return cfg, *_decoder_loss(cfg)


def _row_gathers(cfg, loss, params) -> int:
  """The gathers of [T k, M] rows in the jaxpr of the loss's gradient
  (the remats' recomputes are in it)."""
  rows = B * S * cfg.moe.num_experts_per_tok
  jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
  return len(re.findall(rf":f32\[{rows},{cfg.moe.emb_dim}\] = gather\[", jaxpr))


class DecoderTest(parameterized.TestCase):

  def test_off_by_default_and_only_under_a_block_remat(self):
    cfg = load_model_config("tiny_mixtral")
    self.assertTrue(cfg.remat_moe_rows)
    for remat in REMAT_POLICIES:
      cfg = cfg.replace(remat=remat)
      with self.subTest(remat=remat):
        self.assertTrue(layer_remats_rows(cfg))
        self.assertEqual(
            layer_remats_rows(cfg.replace(remat_moe_rows=False)),
            remat == "none",
        )

  def test_bad_remat_moe_rows_names_the_field(self):
    with self.assertRaisesRegex(ValueError, "remat_moe_rows='no'"):
      load_model_config("tiny_mixtral", remat_moe_rows="no")

  @parameterized.parameters("none", "full")
  def test_same_loss_and_gradients(self, remat):
    cfg, loss, params = _decoder_case(remat)
    with _with_rows(True):
      want = jax.jit(jax.value_and_grad(loss))(params)
    with _with_rows(False):
      got = jax.jit(jax.value_and_grad(loss))(params)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got),
        jax.tree.leaves(want),
        strict=True,
    ):
      scale = float(np.max(np.abs(w)))
      np.testing.assert_allclose(
          g, w, rtol=0, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path)
      )

  def test_full_remat_gathers_the_rows_once_fewer(self):
    cfg, loss, params = _decoder_case("full")
    nested = _row_gathers(cfg, loss, params)  # the default
    cfg = cfg.replace(remat_moe_rows=False)
    got = _row_gathers(cfg, *_decoder_loss(cfg))
    # The forward, the block's recompute and the layer's own: the last
    # goes (the rest of the [T k, M] gathers are there either way).
    self.assertEqual(nested - got, 1)

  def test_no_remat_keeps_the_layers_own(self):
    cfg, loss, params = _decoder_case("none")
    want = _row_gathers(cfg, loss, params)
    cfg = cfg.replace(remat_moe_rows=False)
    self.assertEqual(_row_gathers(cfg, *_decoder_loss(cfg)), want)


class LayerTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.cfg = load_moe_config("tiny_mixtral")
    self.x = jax.random.normal(jax.random.key(1), (B, S, self.cfg.emb_dim))
    self.variables = unbox(RoutedMoE(self.cfg).init(jax.random.key(0), self.x))

  def _loss(self, moe):
    def loss(params, x):
      y, aux = moe.apply({**self.variables, "params": params}, x)
      return jnp.sum(y**2) + aux.load_balance_loss

    return loss

  def test_default_remats_and_off_keeps_the_rows(self):
    rows = (B * S * self.cfg.num_experts_per_tok, self.cfg.emb_dim)

    def kept(moe):
      return sum(
          aval.shape == rows and not where.startswith("named")
          for aval, where in saved_residuals(
              self._loss(moe), self.variables["params"], self.x
          )
      )

    self.assertTrue(RoutedMoE(self.cfg).remat_rows)
    self.assertEqual(kept(RoutedMoE(self.cfg)), 0)
    self.assertEqual(kept(RoutedMoE(self.cfg, remat_rows=False)), 1)

  def test_same_outputs_and_gradients(self):
    args = (self.variables["params"], self.x)
    on = RoutedMoE(self.cfg)
    off = RoutedMoE(self.cfg, remat_rows=False)
    np.testing.assert_array_equal(
        on.apply(self.variables, self.x)[0],
        off.apply(self.variables, self.x)[0],
    )
    want = jax.jit(jax.grad(self._loss(on), argnums=(0, 1)))(*args)
    got = jax.jit(jax.grad(self._loss(off), argnums=(0, 1)))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      self.assertLess(helpers.rel_err(g, w), 1e-6)

  def test_bad_remat_rows(self):
    for moe in (RoutedMoE, RoutedAndSharedMoE):
      with self.assertRaisesRegex(TypeError, "remat_rows.*'yes'"):
        moe(self.cfg, remat_rows="yes").init(jax.random.key(0), self.x)

  def test_bad_remat_argument(self):
    with self.assertRaisesRegex(TypeError, "remat must be a bool; got 1"):
      sparse.sparse_experts_remat(None, None, None, None, (), None, remat=1)


if __name__ == "__main__":
  absltest.main()
