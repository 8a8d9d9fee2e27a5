"""The MoE layer's features of the newer families, on every path, against
the NumPy oracle (tests/numpy_reference.py).

GPT-OSS: a router bias (in the logits: the choice and the weights),
per-expert biases on the three projections (the down bias inside the
routing weight's product) and the clamped SwiGLU, on the sparse path (the
sorted one, and the two decode-size ones), the dense path and the dropping
dense path with room for every token.

Llama-4: top-1 of the logits, whose sigmoid scales the chosen expert's
input (`weights_on_input`) on the same paths; its llama3 rotary
frequencies and temperature tuning against the formulas, in NumPy.
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import MoEConfig
from linen_moe import RoutedMoE
from linen_moe import load_model_config
from linen_moe._src.models import attention_geometry
from linen_moe._src.models.rotary import Rope
from linen_moe._src.testing import helpers
from tests import numpy_reference

GPT_OSS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    emb_dim=8,
    moe_mlp_dim=6,
    mlp_activations=("clamped_swiglu", "linear"),
    swiglu_alpha=1.702,
    swiglu_limit=0.5,  # the gate clips, the up projection both ways
    routing="topk_then_softmax",
    router_bias=True,
    expert_bias=True,
    load_balance_loss_weight=0.0,
)
# Paths: (MATMUL_PATHS entry, tokens [B, S]): the sorted sparse path, its
# decode-size forms (every expert: T * k >= E; the chosen experts: fewer),
# dense, and dense dropping with a capacity of every token (factor E / k).
PATHS = {
    "sparse": ("sparse", (2, 12)),
    "every_expert": ("sparse", (1, 4)),
    "chosen_experts": ("sparse", (1, 1)),
    "dense": ("dense", (2, 12)),
    "dense_dropping": ("dense_dropping", (2, 12)),
}


def _biased_variables(cfg: MoEConfig, seed: int = 0) -> dict:
  """The layer's variables with every bias random (they init to 0)."""
  variables = helpers.moe_variables(cfg, seed)
  params = jax.tree.map(lambda x: x, variables["params"])
  keys = iter(jax.random.split(jax.random.key(seed + 7), 8))
  for name in ("wi_0_bias", "wi_1_bias", "wo_bias"):
    params[name] = 0.5 * jax.random.normal(next(keys), params[name].shape)
  params["gate"] = dict(params["gate"])
  params["gate"]["bias"] = jax.random.normal(next(keys), (cfg.num_experts,))
  return {**variables, "params": params}


class GptOssExpertsTest(parameterized.TestCase):

  @parameterized.parameters(*PATHS)
  def test_matches_numpy_reference(self, path):
    name, (b, s) = PATHS[path]
    cfg = MoEConfig(**GPT_OSS, **MATMUL_PATHS[name])
    if name == "dense_dropping":
      cfg = cfg.replace(capacity_factor=2.0)
    variables = _biased_variables(cfg)
    x = 2.0 * helpers.random_inputs(cfg.emb_dim, b, s)
    y, aux = jax.jit(RoutedMoE(cfg).apply)(variables, x)
    want, dropped = numpy_reference.moe_reference(
        variables["params"], np.asarray(x, np.float64), cfg
    )
    self.assertEqual(dropped, 0)
    self.assertEqual(float(aux.dropped_fraction), 0.0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)

  def test_every_feature_changes_the_output(self):
    cfg = MoEConfig(**GPT_OSS)
    variables = _biased_variables(cfg)
    x = 2.0 * helpers.random_inputs(cfg.emb_dim, 2, 12)
    y = RoutedMoE(cfg).apply(variables, x)[0]
    params = variables["params"]
    changed = {
        "router bias": {"gate": {"kernel": params["gate"]["kernel"]}},
        "down bias": {"wo_bias": jnp.zeros_like(params["wo_bias"])},
        "gate bias": {"wi_0_bias": jnp.zeros_like(params["wi_0_bias"])},
    }
    for what, change in changed.items():
      cfg_w = cfg.replace(router_bias=False) if what == "router bias" else cfg
      other = {**variables, "params": {**params, **change}}
      got = RoutedMoE(cfg_w).apply(other, x)[0]
      self.assertGreater(helpers.rel_err(got, y), 1e-2, what)
    unclamped = cfg.replace(swiglu_limit=1e6)
    got = RoutedMoE(unclamped).apply(variables, x)[0]
    self.assertGreater(helpers.rel_err(got, y), 1e-2)

  def test_gradients_reach_every_bias(self):
    cfg = MoEConfig(**GPT_OSS)
    variables = _biased_variables(cfg)
    x = helpers.random_inputs(cfg.emb_dim, 2, 12)

    def loss(params):
      y = RoutedMoE(cfg).apply({**variables, "params": params}, x)[0]
      return jnp.sum(jnp.sin(y))

    grads = jax.grad(loss)(variables["params"])
    for name in ("wi_0_bias", "wi_1_bias", "wo_bias"):
      self.assertGreater(float(jnp.abs(grads[name]).max()), 0.0, name)
    self.assertGreater(float(jnp.abs(grads["gate"]["bias"]).max()), 0.0)

  def test_swiglu_fields_belong_to_the_clamped_activation(self):
    with self.assertRaisesRegex(ValueError, r"swiglu_limit=0.0 .*expected > 0"):
      MoEConfig(**{**GPT_OSS, "swiglu_limit": 0.0})
    plain = {**GPT_OSS, "mlp_activations": ("silu", "linear")}
    with self.assertRaisesRegex(
        ValueError, r"swiglu_alpha=1.702 .*read only by the 'clamped_swiglu'"
    ):
      MoEConfig(**{**plain, "swiglu_limit": 0.0})


LLAMA4 = dict(
    num_experts=4,
    num_experts_per_tok=1,
    emb_dim=8,
    moe_mlp_dim=6,
    routing="topk_then_sigmoid",
    weights_on_input=True,
    load_balance_loss_weight=0.0,
)


class Llama4ExpertsTest(parameterized.TestCase):

  @parameterized.parameters(*PATHS)
  def test_matches_numpy_reference(self, path):
    name, (b, s) = PATHS[path]
    cfg = MoEConfig(**LLAMA4, **MATMUL_PATHS[name])
    if name == "dense_dropping":
      cfg = cfg.replace(capacity_factor=4.0)
    variables = helpers.moe_variables(cfg, 3)
    x = 2.0 * helpers.random_inputs(cfg.emb_dim, b, s)
    y, aux = jax.jit(RoutedMoE(cfg).apply)(variables, x)
    want, dropped = numpy_reference.moe_reference(
        variables["params"], np.asarray(x, np.float64), cfg
    )
    self.assertEqual((dropped, float(aux.dropped_fraction)), (0, 0.0))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # the weight on the input is not the weight on the output (SiLU)
    on_output = RoutedMoE(cfg.replace(weights_on_input=False))
    self.assertGreater(
        helpers.rel_err(jax.jit(on_output.apply)(variables, x)[0], y), 1e-2
    )

  def test_weights_on_input_needs_one_expert(self):
    with self.assertRaisesRegex(
        ValueError, r"weights_on_input=True .*num_experts_per_tok=1, not 2"
    ):
      MoEConfig(**{**LLAMA4, "num_experts_per_tok": 2})


def _llama3_frequencies(d, base, factor, low, high, original):
  """transformers' `_compute_llama3_parameters`, one frequency at a time."""
  out = []
  for i in range(d // 2):
    freq = base ** (-2 * i / d)
    wavelen = 2 * math.pi / freq
    if wavelen < original / high:
      out.append(freq)
    elif wavelen > original / low:
      out.append(freq / factor)
    else:
      smooth = (original / wavelen - low) / (high - low)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


class Llama4PositionsTest(absltest.TestCase):

  def test_llama3_frequencies(self):
    # Scout's: every branch (kept, ramped, divided) is taken
    args = dict(base=500000.0, factor=8.0, original_max_len=8192)
    rope = Rope(128, kind="llama3", low_freq_factor=1.0, **args)
    want = _llama3_frequencies(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    got = np.asarray(rope.inverse_frequencies())
    np.testing.assert_allclose(got, want, rtol=1e-6)
    self.assertTrue(np.any(got == want) and np.any(got < want))

  def test_temperature(self):
    # log1p(floor((p + 1) / F)) * s + 1, F = 4, s = 0.1
    cfg = load_model_config("tiny_mixtral").replace(
        full_attention_layers=(0,),
        attention_temperature_floor=4,
        attention_temperature_scale=0.1,
    )
    p = np.arange(20)
    want = np.log1p(np.floor((p + 1) / 4)) * 0.1 + 1
    got = attention_geometry.temperature(cfg, jnp.asarray(p)[None])
    np.testing.assert_allclose(np.asarray(got).ravel(), want, rtol=1e-6)


if __name__ == "__main__":
  absltest.main()
