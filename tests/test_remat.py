"""Rematerialization (`ModelConfig.remat`): same numbers, less kept.

Every policy gives the loss and the gradients of no remat (float32, CPU:
bitwise, or within 1e-6 of each leaf's largest value), scanned and
unrolled, in both front ends. Compiled programs are shared per module
(`_loss_and_grads` caches them).
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import numpy as np

from linen_moe import load_model_config
from linen_moe import testing
from linen_moe._src.config.model_config import REMAT_POLICIES
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.training import step as train_lib
from linen_moe.sharding import unbox
import nnx_adapter

POLICIES = tuple(p for p in REMAT_POLICIES if p != "none")


def _tokens(cfg):
  return testing.markov_tokens(cfg.vocab_size, 2, 16, 1)


@functools.cache
def _variables(cfg):
  return unbox(Decoder(cfg).init(jax.random.key(0), _tokens(cfg)))


@functools.cache
def _loss_and_grads(cfg):
  """(loss, grads of the params) of the Linen decoder at `cfg` (whose
  `remat` is ignored by the variables: they are the same for every one)."""
  tokens = _tokens(cfg)
  variables = _variables(cfg.replace(remat="none"))

  def loss(p):
    logits, aux = Decoder(cfg).apply({**variables, "params": p}, tokens)
    return train_lib.decoder_loss(logits, aux, tokens)[0]

  return jax.jit(jax.value_and_grad(loss))(variables["params"])


def _nnx_loss_and_grads(cfg):
  tokens = _tokens(cfg)
  model = nnx_adapter.Decoder(cfg, rngs=nnx.Rngs(0))
  nnx_adapter.linen_to_nnx(_variables(cfg.replace(remat="none")), model)

  def loss(m):
    logits, aux = m(tokens)
    return train_lib.decoder_loss(logits, aux, tokens)[0]

  value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
  return (
      value,
      nnx_adapter.nnx_to_linen(nnx.merge(nnx.graphdef(model), grads))["params"],
  )


def assert_close_per_leaf(test, got, want, rtol=1e-6):
  """Each leaf of `got` within `rtol` of `want`'s largest magnitude."""
  test.assertEqual(jax.tree.structure(got), jax.tree.structure(want))
  for (path, got_leaf), want_leaf in zip(
      jax.tree_util.tree_leaves_with_path(got),
      jax.tree.leaves(want),
      strict=True,
  ):
    a, b = np.asarray(got_leaf), np.asarray(want_leaf)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    np.testing.assert_allclose(
        a, b, rtol=0, atol=rtol * scale, err_msg=jax.tree_util.keystr(path)
    )


class RematConfigTest(parameterized.TestCase):

  @parameterized.parameters("", "Full", "dots", 1, None)
  def test_bad_remat_names_value_and_allowed(self, value):
    with self.assertRaisesRegex(ValueError, r"remat=.*allowed.*'full'"):
      load_model_config("tiny_mixtral").replace(remat=value)

  def test_remat_is_a_run_field(self):
    from linen_moe import ModelConfig  # noqa: PLC0415

    self.assertIn("remat", ModelConfig.run_fields())
    self.assertEqual(load_model_config("tiny_mixtral").remat, "none")


class RematGradientsTest(parameterized.TestCase):

  @parameterized.product(remat=POLICIES, scan=(True, False))
  def test_linen_loss_and_grads_equal_no_remat(self, remat, scan):
    cfg = load_model_config("tiny_mixtral", scan_layers=scan)
    want_loss, want = _loss_and_grads(cfg)
    got_loss, got = _loss_and_grads(cfg.replace(remat=remat))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_close_per_leaf(self, got, want)

  @parameterized.parameters(True, False)
  def test_nnx_loss_and_grads_equal_linen_no_remat(self, scan):
    cfg = load_model_config("tiny_mixtral", scan_layers=scan)
    want_loss, want = _loss_and_grads(cfg)
    got_loss, got = _nnx_loss_and_grads(cfg.replace(remat="full"))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_close_per_leaf(self, got, want)


if __name__ == "__main__":
  absltest.main()
