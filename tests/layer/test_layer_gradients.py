"""The whole layer's gradients against `jax.grad` of a plain per-token `jnp`
reference, for every routing family on every single-device path, float32.

Each custom VJP (grouped matmul, permutations, quantized contractions) has
its own test; this one checks that they compose: the gradient of
sum(y * cotangent) + the weighted load-balance and z-losses with respect to
the layer inputs, the router's input, the router kernel, the three expert
kernels and the per-expert scale. The reference is written from the
formulas: per token, its k chosen experts' weights gathered and applied (no
grouping, no sorting, no custom VJP). The choices (and, dropping, the kept
assignments) come from the NumPy oracle; they are piecewise constant, so
they carry no gradient.
"""

import functools
import itertools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax._src.ad_checkpoint import saved_residuals
import jax.numpy as jnp
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import RoutedMoE
from linen_moe import load_moe_config
from linen_moe import testing
from linen_moe._src.config import activations
from linen_moe._src.layer import dense
from linen_moe._src.layer import expert
from linen_moe._src.layer import sparse
from linen_moe._src.testing import helpers
from linen_moe.variables import UPDATED_BY_RULE
from tests import numpy_reference

B, S = 2, 8
# One config per routing family, each with its options on: Mixtral (top-k
# of the logits, softmax over the k), Gemma-4 (softmax, top-k, renormalised,
# per-expert scale, the router reading its own input), DeepSeek-V3 (sigmoid,
# groups, a selection-only bias, renormalised, scaled by 2.5). Every one with
# both auxiliary losses weighted.
FAMILIES = {
    "topk_then_softmax": "tiny_mixtral",
    "softmax_then_topk": "tiny_gemma4_26b",
    "sigmoid_then_topk": "tiny_deepseek_v3",
}
AUX = dict(load_balance_loss_weight=0.1, router_z_loss_weight=0.01)
# Relative error of each gradient (norm-wise): float32 sums of the same
# products in another order (measured: at most 5.4e-7).
RTOL = 1e-5


def _act(name, x):
  if name == "silu":
    return x / (1 + jnp.exp(-x))
  if name == "gelu":  # the tanh form
    c = np.sqrt(2 / np.pi)
    return 0.5 * x * (1 + jnp.tanh(c * (x + 0.044715 * x**3)))
  raise ValueError(name)


def reference_loss(params, x, router_in, cotangent, ids, keep, fraction, cfg):
  """sum(y * cotangent) + weighted aux losses of the layer, per token.

  x, router_in [B, S, M]; ids <int>[T, k] the chosen experts, keep <bool>[T,
  k] the assignments that keep a slot (all, dropless), fraction [E] each
  expert's share of the T * k assignments.
  """
  t, m, e = B * S, cfg.emb_dim, cfg.num_experts
  logits = router_in.reshape(t, m) @ params["gate"]["kernel"]  # [T, E]
  chosen = jnp.take_along_axis(logits, ids, axis=-1)  # [T, k]
  if cfg.routing == "topk_then_softmax":
    weights = jnp.exp(chosen) / jnp.sum(jnp.exp(chosen), -1, keepdims=True)
    probs = jnp.exp(logits) / jnp.sum(jnp.exp(logits), -1, keepdims=True)
  else:
    if cfg.routing == "softmax_then_topk":
      scores = jnp.exp(logits) / jnp.sum(jnp.exp(logits), -1, keepdims=True)
      probs = scores
    else:
      scores = 1 / (1 + jnp.exp(-logits))
      probs = scores / jnp.sum(scores, -1, keepdims=True)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
      weights = weights / jnp.sum(weights, -1, keepdims=True)
  weights = weights * cfg.routed_scaling_factor
  if cfg.per_expert_scale:
    weights = weights * params["per_expert_scale"][ids]
  weights = jnp.where(keep, weights, 0.0)  # [T, k]

  xt = x.reshape(t, m)
  h0 = jnp.einsum("tm,tkmh->tkh", xt, params["wi_0"][ids])
  h1 = jnp.einsum("tm,tkmh->tkh", xt, params["wi_1"][ids])
  act = _act(cfg.mlp_activations[0], h0) * h1  # [T, k, H]
  y = jnp.einsum("tkh,tkhm->tkm", act, params["wo"][ids])  # [T, k, M]
  out = jnp.einsum("tk,tkm->tm", weights, y)  # [T, M]

  lb = e * jnp.sum(fraction * jnp.mean(probs, axis=0))
  z = jnp.mean(jnp.log(jnp.sum(jnp.exp(logits), -1)) ** 2)
  return (
      jnp.sum(out.reshape(x.shape) * cotangent)
      + cfg.load_balance_loss_weight * lb
      + cfg.router_z_loss_weight * z
  )


@functools.cache
def _reference_grad(cfg):
  """jit(grad) of `reference_loss` in (params, x, router_in), one program
  per config (paths differ only in `keep`)."""
  return jax.jit(
      jax.grad(
          functools.partial(
              reference_loss, cfg=cfg.replace(**MATMUL_PATHS["sparse"])
          ),
          argnums=(0, 1, 2),
      )
  )


@functools.cache
def _case(family: str):
  """(config, variables, x, router input or None, cotangent) of a family."""
  cfg = load_moe_config(FAMILIES[family], **AUX)
  variables = helpers.moe_variables(cfg, seed=0, bias_scale=0.1)
  x = helpers.random_inputs(cfg.emb_dim, B, S, seed=3)
  gate_inputs = None
  if family == "softmax_then_topk":
    gate_inputs = helpers.random_inputs(cfg.emb_dim, B, S, seed=4)
  cotangent = helpers.random_inputs(cfg.emb_dim, B, S, seed=5)
  return cfg, variables, x, gate_inputs, cotangent


def _oracle_choices(cfg, variables, router_in, capacity):
  """(ids <int32>[T, k], keep <bool>[T, k]) from the NumPy oracle."""
  params = variables["params"]
  gate = np.asarray(params["gate"]["kernel"], np.float64)
  scale = params.get("per_expert_scale")
  scale = None if scale is None else np.asarray(scale, np.float64)
  bias = variables.get(UPDATED_BY_RULE, {}).get("routed_bias")
  bias = None if bias is None else np.asarray(bias, np.float64)
  logits = np.asarray(router_in, np.float64) @ gate  # [B, S, E]
  routes = [
      [numpy_reference.route_token(row, cfg, scale, bias) for row in seq]
      for seq in logits
  ]
  ids = np.array([[r[0] for r in seq] for seq in routes])  # [B, S, k]
  keep = np.ones(ids.shape, bool)
  if capacity is not None:
    keep = np.stack(
        [numpy_reference.keep_mask(seq, cfg, capacity) for seq in routes]
    )
  k = cfg.num_experts_per_tok
  return ids.reshape(-1, k).astype(np.int32), keep.reshape(-1, k)


# (family, path) of the default run: each family and each path once; the
# rest of the product is slow.
DEFAULT = tuple(zip(FAMILIES, MATMUL_PATHS, strict=True))


class WholeLayerGradientTest(parameterized.TestCase):

  @parameterized.parameters(*DEFAULT)
  def test_matches_per_token_reference(self, family, path):
    self.check(family, path)

  @testing.slow
  @parameterized.parameters(*(
      case
      for case in itertools.product(FAMILIES, MATMUL_PATHS)
      if case not in DEFAULT
  ))
  def test_matches_per_token_reference_slow(self, family, path):
    self.check(family, path)

  def check(self, family, path):
    base, variables, x, gate_inputs, cotangent = _case(family)
    cfg = base.replace(**MATMUL_PATHS[path])
    router_in = x if gate_inputs is None else gate_inputs
    capacity = dense.expert_capacity(cfg, S) if cfg.dropping else None
    ids, keep = _oracle_choices(cfg, variables, router_in, capacity)
    if capacity is not None:
      self.assertFalse(keep.all())  # the case drops something
    moe = RoutedMoE(cfg)

    def layer_loss(params, x, router_in):
      y, aux = moe.apply(
          {**variables, "params": params},
          x,
          None if gate_inputs is None else router_in,
      )
      return jnp.sum(y * cotangent) + aux.load_balance_loss + aux.router_z_loss

    args = (variables["params"], x, router_in)
    got = jax.jit(jax.grad(layer_loss, argnums=(0, 1, 2)))(*args)
    fraction = np.bincount(ids.ravel(), minlength=cfg.num_experts) / ids.size
    want = _reference_grad(base)(
        *args, cotangent, ids, keep, fraction.astype(np.float32)
    )
    names = ["params", "x", "router input"]
    if gate_inputs is None:  # the router reads x (both gradients in "x")
      got, names = got[:2], names[:2]
      want = (want[0], jax.tree.map(jnp.add, want[1], want[2]))
    for name, g, w in zip(names, got, want, strict=True):
      flat_g = jax.tree_util.tree_leaves_with_path(g)
      for (path_, leaf), w_leaf in zip(flat_g, jax.tree.leaves(w), strict=True):
        what = f"{name}{jax.tree_util.keystr(path_)}"
        self.assertGreater(float(jnp.abs(w_leaf).max()), 0.0, what)
        self.assertLess(helpers.rel_err(leaf, w_leaf), RTOL, what)
    expected_leaves = {"gate", "wi_0", "wi_1", "wo"}
    if cfg.per_expert_scale:
      expected_leaves.add("per_expert_scale")
    self.assertEqual(set(got[0]), expected_leaves)


class GatedProductTest(parameterized.TestCase):
  """`expert.gated_product`, act(gate) * up: its backward keeps gate and up
  alone (not act's intermediates) and gives the gradients of the product
  differentiated as written, for every activation."""

  def setUp(self):
    super().setUp()
    keys = jax.random.split(jax.random.key(0), 3)
    self.gate, self.up, self.g = (
        jax.random.normal(k, (16, 24), jnp.bfloat16) for k in keys
    )

  def test_backward_keeps_gate_and_up_alone(self):
    act = activations.activation("silu")
    _, vjp = jax.vjp(
        functools.partial(expert.gated_product, act), self.gate, self.up
    )
    saved = [(x.shape, x.dtype) for x in jax.tree.leaves(vjp)]
    self.assertEqual(saved, [((16, 24), jnp.bfloat16)] * 2)

  @parameterized.parameters(*activations.ACTIVATIONS)
  def test_gradients_are_the_products(self, name):
    # GPT-OSS's clamp (limit 1) clips some of these gates and ups.
    act = activations.activation(name, 1.702, 1.0)
    args = (self.gate.astype(jnp.float32), self.up.astype(jnp.float32))
    got = jax.vjp(functools.partial(expert.gated_product, act), *args)[1](
        self.g.astype(jnp.float32)
    )
    want = jax.vjp(
        lambda a, b: act(a) * activations.linear_branch(act, b), *args
    )[1](self.g.astype(jnp.float32))
    for g, w in zip(got, want, strict=True):
      np.testing.assert_array_equal(g, w)


def _sparse_as_written(
    module,
    x,
    indices,
    weights,
    experts,
    act,
    first_expert=0,
    all_experts=False,
    max_group_size=None,
    remat=True,
):
  """`sparse.sparse_experts_remat` without its remat (whatever `remat`
  says): the path differentiated as written."""
  del remat
  grouped = functools.partial(module.grouped, max_group_size=max_group_size)
  return sparse.sparse_experts(
      grouped, x, indices, weights, experts, act, first_expert, all_experts
  )


class SparseBackwardTest(absltest.TestCase):
  """The sparse path's backward gathers the sorted rows [T k, M] again
  instead of keeping them (`sparse.sparse_experts_remat`), to the
  gradients of the path differentiated as written."""

  def setUp(self):
    super().setUp()
    base, variables, x, _, cotangent = _case("topk_then_softmax")
    cfg = base.replace(**MATMUL_PATHS["sparse"])
    moe = RoutedMoE(cfg)

    def loss(params, x):
      y, aux = moe.apply({**variables, "params": params}, x)
      return jnp.sum(y * cotangent) + aux.load_balance_loss

    self.loss, self.args = loss, (variables["params"], x)
    self.rows = (B * S * cfg.num_experts_per_tok, cfg.emb_dim)

  def _kept_rows(self):
    """How many saved residuals are [T k, M] arrays that no name keeps
    (the expert outputs are named `expert_down`)."""
    return sum(
        aval.shape == self.rows and not where.startswith("named")
        for aval, where in saved_residuals(self.loss, *self.args)
    )

  def test_keeps_no_sorted_rows(self):
    self.assertEqual(self._kept_rows(), 0)
    with mock.patch.object(sparse, "sparse_experts_remat", _sparse_as_written):
      self.assertEqual(self._kept_rows(), 1)

  def test_gradients_match_as_written(self):
    got = jax.jit(jax.grad(self.loss, argnums=(0, 1)))(*self.args)
    with mock.patch.object(sparse, "sparse_experts_remat", _sparse_as_written):
      want = jax.jit(jax.grad(self.loss, argnums=(0, 1)))(*self.args)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got),
        jax.tree.leaves(want),
        strict=True,
    ):
      self.assertGreater(float(jnp.abs(w).max()), 0.0)
      self.assertLess(helpers.rel_err(g, w), RTOL, jax.tree_util.keystr(path))


if __name__ == "__main__":
  absltest.main()
