"""Properties of the layer over random small configs and inputs (hypothesis).

Every example draws a config (E, k <= E, routing, renormalisation, per-expert
scale, activation, compute dtype, grouped-matmul implementation), a shape
from a small set (so compiled programs are shared between examples) and
inputs, and checks what must hold whatever the numbers:

  - dense dropless == sparse (same params), and dense dropping whose
    capacity holds every assignment (C == S) == dense dropless;
  - outputs finite for finite inputs, on every path;
  - dropped fraction in [0, 1], and 0 on the dropless paths;
  - permuting the tokens permutes the outputs on the dropless paths;
  - routing weights non-negative, summing to 1 where the routing says so
    (top-k then softmax; softmax then top-k renormalised), at most 1 where it
    does not; chosen experts distinct and in [0, E).

The default profile ("ci", in conftest.py) runs a few derandomized examples;
`pytest tests/test_properties.py --hypothesis-profile=slow` explores more.
"""

import functools

from absl.testing import absltest
from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import RoutedMoE
from linen_moe import routing
from linen_moe._src.config import ROUTINGS
from linen_moe._src.config import MoEConfig
from linen_moe.sharding import unbox

EMB, MLP = 8, 16
SHAPES = ((1, 4), (2, 8))  # [B, S]
# Relative tolerance of two paths' outputs: they add the same products in a
# different order (float32), or round intermediates differently (bfloat16,
# 8 mantissa bits).
RTOL = {"float32": 2e-5, "bfloat16": 5e-2}


@st.composite
def configs(draw) -> MoEConfig:
  e = draw(st.sampled_from((1, 2, 3, 4, 8)))
  routing_kind = draw(st.sampled_from(ROUTINGS))
  return MoEConfig(
      num_experts=e,
      num_experts_per_tok=draw(st.integers(1, e)),
      emb_dim=EMB,
      moe_mlp_dim=MLP,
      mlp_activations=(draw(st.sampled_from(("silu", "gelu"))), "linear"),
      routing=routing_kind,
      norm_topk_prob=draw(st.booleans()),
      per_expert_scale=draw(st.booleans()),
      grouped_matmul=draw(st.sampled_from(("ragged_dot", "blocked"))),
      dtype=draw(st.sampled_from(("float32", "bfloat16"))),
  )


@functools.cache
def _apply(config: MoEConfig):
  return jax.jit(RoutedMoE(config).apply)


@functools.cache
def _init(config: MoEConfig):
  return jax.jit(RoutedMoE(config).init)


def _params(config: MoEConfig, seed: int):
  x = jnp.zeros((1, 2, EMB))
  params = unbox(_init(config)(jax.random.key(seed), x))["params"]
  if config.per_expert_scale:  # not all ones: a real scale
    scale = jax.random.uniform(
        jax.random.key(seed + 1), (config.num_experts,), minval=0.5, maxval=2
    )
    params = dict(params, per_expert_scale=scale)
  return params


def _path(config: MoEConfig, path: str, capacity_factor: float = 0.0):
  return config.replace(
      sparse_matmul=path == "sparse",
      capacity_factor=capacity_factor if path == "dense_dropping" else 0.0,
  )


def _assert_close(actual, expected, dtype: str, what: str):
  a = np.asarray(actual, np.float64)
  b = np.asarray(expected, np.float64)
  scale = max(float(np.abs(b).max()), 1e-6)
  np.testing.assert_allclose(
      a, b, rtol=0, atol=RTOL[dtype] * scale, err_msg=what
  )


class LayerPropertiesTest(absltest.TestCase):

  @given(
      config=configs(),
      shape=st.sampled_from(SHAPES),
      capacity_factor=st.sampled_from((0.5, 1.0, 2.0)),
      seed=st.integers(0, 2**16),
  )
  def test_paths_agree_and_stay_in_range(
      self, config, shape, capacity_factor, seed
  ):
    b, s = shape
    params = {"params": _params(config, seed)}
    x = jax.random.normal(jax.random.key(seed + 2), (b, s, EMB))
    outs = {}
    for path in ("sparse", "dense", "dense_dropping"):
      y, aux = _apply(_path(config, path, capacity_factor))(params, x)
      outs[path] = y
      self.assertTrue(np.isfinite(np.asarray(y, np.float32)).all(), path)
      dropped = float(aux.dropped_fraction)
      self.assertBetween(dropped, 0.0, 1.0)
      if path != "dense_dropping":
        self.assertEqual(dropped, 0.0, path)
      fraction = np.asarray(aux.expert_fraction)
      self.assertTrue((fraction >= 0).all(), path)
      self.assertAlmostEqual(float(fraction.sum()), 1.0, places=5)
    _assert_close(outs["dense"], outs["sparse"], config.dtype, "dense/sparse")

    # A capacity of S slots per expert and sequence holds every assignment
    # (a token's k experts are distinct), so nothing is dropped.
    full = _path(
        config, "dense_dropping", capacity_factor=float(config.num_experts)
    )
    y_full, aux_full = _apply(full)(params, x)
    self.assertEqual(float(aux_full.dropped_fraction), 0.0)
    _assert_close(y_full, outs["dense"], config.dtype, "full capacity/dense")

    # Dropless paths are token-wise: permuting the tokens (across the whole
    # batch) permutes the outputs.
    perm = np.random.default_rng(seed).permutation(b * s)
    x_perm = x.reshape(b * s, EMB)[perm].reshape(x.shape)
    for path in ("sparse", "dense"):
      y_perm, _ = _apply(_path(config, path))(params, x_perm)
      expected = np.asarray(outs[path], np.float64).reshape(b * s, EMB)[perm]
      _assert_close(
          np.asarray(y_perm, np.float64).reshape(b * s, EMB),
          expected,
          config.dtype,
          f"{path} permuted",
      )


class RoutingPropertiesTest(absltest.TestCase):

  @given(
      config=configs(),
      tokens=st.sampled_from((1, 5, 16)),
      logit_scale=st.sampled_from((1e-3, 1.0, 30.0)),
      seed=st.integers(0, 2**16),
  )
  def test_weights(self, config, tokens, logit_scale, seed):
    e, k = config.num_experts, config.num_experts_per_tok
    logits = logit_scale * jax.random.normal(jax.random.key(seed), (tokens, e))
    result = routing.route(logits, k, config.routing, config.norm_topk_prob)
    weights = np.asarray(result.weights, np.float64)
    indices = np.asarray(result.indices)
    self.assertEqual(weights.shape, (tokens, k))
    self.assertTrue((weights >= 0).all())
    self.assertTrue(((indices >= 0) & (indices < e)).all())
    for row in indices:
      self.assertLen(set(row.tolist()), k)  # distinct experts
    sums = weights.sum(axis=-1)
    if config.routing == "topk_then_softmax" or config.norm_topk_prob:
      np.testing.assert_allclose(sums, 1.0, rtol=1e-5)
    else:
      self.assertTrue((sums <= 1.0 + 1e-6).all())
    np.testing.assert_allclose(np.asarray(result.probs).sum(-1), 1, rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
