"""DeepSeek-V3 and Gemma-4 checkpoints: what is particular to them.

The fixtures (tests/fixtures/hf, written by scripts/make_hf_fixtures.py with
transformers 5.24): two DeepSeek-V3 (MLA with and without q_lora, YaRN on
and off, groups on and off, 2 and 3 shared experts, norm_topk_prob both
ways, interleaved and half-split RoPE) and three Gemma-4 (sliding and full
layers with a window shorter than the sequence, attention_k_eq_v on and
off, soft-capping, tied and untied, the multimodal checkpoint's text
decoder). Their logits and greedy continuations against transformers' are
tested with the other families' in tests/hf/test_hf.py; here: what their
config.json maps to, serving weights on load, and the rotary embeddings
against the frequencies transformers computes (its values) and the
rotation against a NumPy loop.
"""

import importlib.resources
import json

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import hf
from linen_moe import quantization
from linen_moe import testing
from linen_moe._src.models import mla
from linen_moe._src.models.rotary import Rope
from linen_moe._src.testing import helpers
from tests.hf_helpers import fixture
from tests.hf_helpers import load

# The released config.json files ship in the package (configs/hf/).
CONFIGS = importlib.resources.files("linen_moe.configs") / "hf"
# Serving weights against the float model: int8 per channel as
# tests/hf/test_hf.py (measured 1.7% here); fp8 per tensor: Gemma-4's norms
# around each MLP make its logits more sensitive to weight rounding than
# Mixtral's: rounding only the expert and MLP weights to e4m3 (per-tensor
# scale, float activations) already moves them by 15% (measured; 2.6% for
# mixtral_tied_sharded), serving fp8 by 18%.
SERVING_REL = {"int8": 0.04, "fp8": 0.25}


class ModelConfigTest(absltest.TestCase):

  def test_model_configs(self):
    ds, variables = load("deepseek_v3_qlora_yarn_groups", True)
    self.assertEqual(
        (ds.kv_lora_rank, ds.q_lora_rank, ds.qk_nope_head_dim, ds.v_head_dim),
        (20, 24, 8, 12),
    )
    self.assertEqual((ds.rope_type, ds.rope_interleave), ("yarn", True))
    self.assertEqual(ds.dense_layers, (0,))
    self.assertEqual(ds.stack_plan.start, 1)
    moe = ds.moe
    self.assertEqual((moe.shared_experts, moe.num_routing_groups), (2, 4))
    self.assertEqual(moe.routed_scaling_factor, 2.5)
    # e_score_correction_bias is loaded into the rule's state, stacked.
    bias = variables["updated_by_rule"]["layers"]["moe"]["routed_experts"]
    self.assertEqual(bias["routed_bias"].shape, (2, 16))
    self.assertGreater(float(jnp.abs(bias["routed_bias"]).max()), 0.0)
    plain, _ = load("deepseek_v3_plain_nogroup", True)
    self.assertEqual((plain.q_lora_rank, plain.rope_type), (0, "default"))
    self.assertFalse(plain.moe.norm_topk_prob or plain.rope_interleave)
    gemma, variables = load("gemma4_text_moe_keqv", True)
    self.assertEqual(gemma.full_attention_layers, (1, 3))
    self.assertEqual((gemma.full_head_dim, gemma.full_kv_heads), (16, 1))
    self.assertTrue(gemma.full_k_eq_v)
    self.assertEqual(
        (gemma.sliding_window, gemma.final_logit_softcap), (4, 3.0)
    )
    self.assertEqual(gemma.stack_plan.period, 2)
    scalar = variables["updated_by_rule"]["layers"]["block_1"]["layer_scalar"]
    self.assertEqual(scalar.shape, (2, 1))
    text, _ = load("gemma4_conditional_text", True)
    self.assertEqual(text, gemma)  # the same text decoder


class ServingOnLoadTest(parameterized.TestCase):

  # One mode and layout each here, the other in the slow set;
  # test_hf_files's default case has the other.
  def test_stored_kernels_straight_from_the_checkpoint(self):
    self.check("gemma4_text_moe_untied", False, "fp8")

  @testing.slow
  def test_stored_kernels_straight_from_the_checkpoint_slow(self):
    self.check("deepseek_v3_qlora_yarn_groups", True, "int8")

  def check(self, name, scan, mode):
    config, variables = load(name, scan, quantization=mode, serving=True)
    float_config, floats = load(name, scan, quantization=mode)
    want_config, want = quantization.quantize_weights(
        float_config,
        {k: v for k, v in floats.items() if k != "_overwrite_with_gradient"},
    )
    self.assertEqual(config, want_config)
    self.assertEqual(jax.tree.structure(variables), jax.tree.structure(want))
    for a, b in zip(
        jax.tree.leaves(variables), jax.tree.leaves(want), strict=True
    ):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    storage = {"int8": "int8", "fp8": "float8_e4m3fn"}[mode]
    kernels = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(variables)
        if str(path[-1].key) in ("wi_0", "wi_1", "wo")
    ]
    self.assertGreaterEqual(len(kernels), 6)  # routed and shared
    self.assertTrue(all(k.dtype == storage for k in kernels))
    ids, expected, _, _ = fixture(name)
    got, _ = jax.jit(Decoder(config).apply)(variables, ids)
    self.assertLess(helpers.rel_err(got, expected), SERVING_REL[mode])


def _rotate_reference(x, freq, scale, interleave):
  """NumPy: pair i = lanes (2i, 2i+1) or (i, i + D/2), rotated by
  positions * freq[i], written half-split."""
  b, s, n, d = x.shape
  out = np.zeros_like(x)
  for p in range(s):
    for i in range(d // 2):
      a, c = (2 * i, 2 * i + 1) if interleave else (i, i + d // 2)
      cos, sin = np.cos(p * freq[i]) * scale, np.sin(p * freq[i]) * scale
      out[:, p, :, i] = x[:, p, :, a] * cos - x[:, p, :, c] * sin
      out[:, p, :, i + d // 2] = x[:, p, :, c] * cos + x[:, p, :, a] * sin
  return out


class RotaryTest(parameterized.TestCase):
  """Frequencies and factors as transformers 5.24 computes them (values
  printed by its modeling_rope_utils for these configs)."""

  def test_yarn_of_the_fixture(self):
    rope = Rope(
        16,
        1e4,
        "yarn",
        factor=4.0,
        original_max_len=32,
        beta_fast=8.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.8,
    )
    np.testing.assert_allclose(
        rope.inverse_frequencies(),
        [
            1.0,
            0.19764,
            0.025,
            0.0079057,
            0.0025,
            0.00079057,
            0.00025,
            7.9057e-05,
        ],
        rtol=1e-4,
    )
    self.assertAlmostEqual(rope.scale, 1.0249580, places=6)
    config, _ = load("deepseek_v3_qlora_yarn_groups", True)
    self.assertAlmostEqual(mla.softmax_scale(config), 0.2519110, places=6)

  def test_yarn_of_deepseek_v3(self):
    rope = Rope(
        64,
        1e4,
        "yarn",
        factor=40.0,
        original_max_len=4096,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    freq = np.asarray(rope.inverse_frequencies())
    np.testing.assert_allclose(
        freq[:4], [1.0, 0.74989, 0.56234, 0.42170], rtol=1e-4
    )
    np.testing.assert_allclose(freq[-1], 3.3338e-06, rtol=1e-4)
    self.assertEqual(rope.scale, 1.0)  # mscale == mscale_all_dim
    released = json.loads((CONFIGS / "deepseek_v3" / "config.json").read_text())
    scale = mla.softmax_scale(hf.model_config(released))
    self.assertAlmostEqual(scale, 0.1352338, places=6)  # 192**-0.5 = 0.0722

  def test_proportional_of_gemma4(self):
    rope = Rope(16, 1e6, "proportional", fraction=0.25)
    np.testing.assert_allclose(
        rope.inverse_frequencies(),
        [1.0, 0.177828, 0, 0, 0, 0, 0, 0],
        rtol=1e-5,
    )

  @parameterized.parameters(False, True)
  def test_rotation(self, interleave):
    rope = Rope(
        8,
        100.0,
        "yarn",
        factor=2.0,
        original_max_len=4,
        beta_fast=2.0,
        interleave=interleave,
    )  # YaRN's default cos / sin factor g(2) = 1.069
    x = np.random.default_rng(0).normal(size=(2, 5, 3, 8)).astype(np.float32)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    freq = np.asarray(rope.inverse_frequencies(), np.float64)
    want = _rotate_reference(x.astype(np.float64), freq, rope.scale, interleave)
    np.testing.assert_allclose(rope(x, positions), want, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
