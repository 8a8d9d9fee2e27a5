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
  - routing weights, per routing and renormalisation: each in [0, 1], in
    the order of the choices (non-increasing); summing to 1 for
    "topk_then_softmax" and for the renormalised routings; without
    renormalisation the k largest of E probabilities for "softmax_then_topk"
    (sum in [k/E, 1]) and k sigmoids for "sigmoid_then_topk" (sum in [0, k],
    above 1 for small logits and k > 2); chosen experts distinct, in [0, E),
    the top k of the selection scores.

The default profile ("ci", in conftest.py) runs a few derandomized examples
(`LAYER_EXAMPLES` and `ROUTING_EXAMPLES` of them: each layer example
compiles its own programs) plus an explicit one per routing x
renormalisation; the slow set runs the same tests under the "slow" profile
(`SlowProfileTest`), as does `pytest tests/layer/test_properties.py
--hypothesis-profile=slow`.
"""

import functools

from absl.testing import absltest
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import numpy as np

from linen_moe import MoEConfig
from linen_moe import RoutedMoE
from linen_moe import routing
from linen_moe import testing
from linen_moe._src.config.moe_config import ROUTINGS
from linen_moe._src.testing import helpers

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


def _params(config: MoEConfig, seed: int):
  return helpers.moe_params(config, seed, scale_range=(0.5, 2.0))


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


LAYER_DRAWS = dict(
    config=configs(),
    shape=st.sampled_from(SHAPES),
    capacity_factor=st.sampled_from((0.5, 1.0, 2.0)),
    seed=st.integers(0, 2**16),
)
ROUTING_DRAWS = dict(
    config=configs(),
    tokens=st.sampled_from((1, 5, 16)),
    logit_scale=st.sampled_from((1e-3, 1.0, 30.0)),
    seed=st.integers(0, 2**16),
)


def check_layer(test, config, shape, capacity_factor, seed):
  """The layer properties of the module docstring, on random params and
  inputs."""
  b, s = shape
  params = {"params": _params(config, seed)}
  x = jax.random.normal(jax.random.key(seed + 2), (b, s, EMB))
  outs = {}
  for path in ("sparse", "dense", "dense_dropping"):
    y, aux = _apply(_path(config, path, capacity_factor))(params, x)
    outs[path] = y
    test.assertTrue(np.isfinite(np.asarray(y, np.float32)).all(), path)
    dropped = float(aux.dropped_fraction)
    test.assertBetween(dropped, 0.0, 1.0)
    if path != "dense_dropping":
      test.assertEqual(dropped, 0.0, path)
    fraction = np.asarray(aux.expert_fraction)
    test.assertTrue((fraction >= 0).all(), path)
    test.assertAlmostEqual(float(fraction.sum()), 1.0, places=5)
  _assert_close(outs["dense"], outs["sparse"], config.dtype, "dense/sparse")

  # A capacity of S slots per expert and sequence holds every assignment
  # (a token's k experts are distinct), so nothing is dropped.
  full = _path(
      config, "dense_dropping", capacity_factor=float(config.num_experts)
  )
  y_full, aux_full = _apply(full)(params, x)
  test.assertEqual(float(aux_full.dropped_fraction), 0.0)
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


def _routing_example(routing_kind: str, norm: bool, e: int = 8, k: int = 4):
  """An explicit example of `test_weights`: one token, logits near 0 (the
  sigmoids all near 1/2, so k of them sum to about k/2)."""
  config = MoEConfig(
      num_experts=e,
      num_experts_per_tok=k,
      emb_dim=EMB,
      moe_mlp_dim=MLP,
      routing=routing_kind,
      norm_topk_prob=norm,
  )
  return example(config=config, tokens=1, logit_scale=1e-3, seed=0)


def _every_routing_and_renormalisation(test):
  for routing_kind in ROUTINGS:
    for norm in (False, True):
      test = _routing_example(routing_kind, norm)(test)
  return test


def check_weights(test, config, tokens, logit_scale, seed):
  """The routing properties of the module docstring, on random logits."""
  e, k = config.num_experts, config.num_experts_per_tok
  logits = logit_scale * jax.random.normal(jax.random.key(seed), (tokens, e))
  result = routing.route(logits, k, config.routing, config.norm_topk_prob)
  weights = np.asarray(result.weights, np.float64)
  indices = np.asarray(result.indices)
  test.assertEqual(weights.shape, (tokens, k))
  test.assertTrue(((indices >= 0) & (indices < e)).all())
  for row in indices:
    test.assertLen(set(row.tolist()), k)  # distinct experts
  # The choice is the top k of the selection scores. 1e-6: scores equal in
  # float32 (sigmoids near 1/2 or saturated at 1) tie to the lower index.
  logits = np.asarray(logits, np.float64)
  scores = {
      "topk_then_softmax": logits,
      "topk_then_sigmoid": logits,  # Llama-4: chosen by logit, then squashed
      "softmax_then_topk": (
          np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
      ),
      "sigmoid_then_topk": 1 / (1 + np.exp(-logits)),
  }[config.routing]
  chosen = np.take_along_axis(scores, indices, axis=-1)
  is_chosen = (np.arange(e) == indices[:, :, None]).any(axis=1)  # [T, E]
  others = np.where(is_chosen, -np.inf, scores)
  test.assertTrue((chosen.min(-1) >= others.max(-1) - 1e-6).all())
  # Each weight in [0, 1], in the order of the choices.
  eps = 1e-6
  test.assertTrue(((weights >= 0) & (weights <= 1 + eps)).all())
  test.assertTrue((np.diff(weights, axis=-1) <= eps).all())
  sums = weights.sum(axis=-1)
  if config.routing == "topk_then_softmax" or config.norm_topk_prob:
    np.testing.assert_allclose(sums, 1.0, rtol=1e-5)
  elif config.routing == "softmax_then_topk":  # the k largest of E probs
    test.assertTrue((sums >= k / e - eps).all() and (sums <= 1 + eps).all())
  else:  # k sigmoids, unnormalised: up to k (about k/2 near logit 0)
    test.assertTrue((sums <= k + eps).all())
    if logit_scale < 0.01:
      np.testing.assert_allclose(sums, k / 2, rtol=0.01)
  np.testing.assert_allclose(np.asarray(result.probs).sum(-1), 1, rtol=1e-5)


# Derandomized examples of the layer test in the default run (each draws a
# new config and compiles four programs of it), and of the routing test
# beyond its explicit ones.
LAYER_EXAMPLES = 3
ROUTING_EXAMPLES = 4


def _in_the_default_profile(examples: int):
  """`examples` examples under the default "ci" profile; another loaded
  profile (--hypothesis-profile=slow) keeps its own count."""
  loaded = settings.default.max_examples
  ci = settings.get_profile("ci").max_examples
  return settings(max_examples=examples if loaded == ci else loaded)


class LayerPropertiesTest(absltest.TestCase):

  @_in_the_default_profile(LAYER_EXAMPLES)
  @given(**LAYER_DRAWS)
  def test_paths_agree_and_stay_in_range(self, **draws):
    check_layer(self, **draws)


class RoutingPropertiesTest(absltest.TestCase):

  @_in_the_default_profile(ROUTING_EXAMPLES)
  @given(**ROUTING_DRAWS)
  @_every_routing_and_renormalisation
  def test_weights(self, **draws):
    check_weights(self, **draws)


@testing.slow
class SlowProfileTest(absltest.TestCase):
  """The same properties under the "slow" hypothesis profile (conftest.py:
  many more examples, random), in the slow set."""

  @settings(settings.get_profile("slow"))
  @given(**LAYER_DRAWS)
  def test_paths_agree_and_stay_in_range(self, **draws):
    check_layer(self, **draws)

  @settings(settings.get_profile("slow"))
  @given(**ROUTING_DRAWS)
  @_every_routing_and_renormalisation
  def test_weights(self, **draws):
    check_weights(self, **draws)


if __name__ == "__main__":
  absltest.main()
