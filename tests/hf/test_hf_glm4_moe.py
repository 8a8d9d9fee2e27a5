"""GLM-4.5 checkpoints against transformers' own numbers.

Two fixtures transformers 5.25 wrote (scripts/make_hf_family_fixtures.py):
partial rotary 0.5, per-head q/k norms, q/k/v biases, a dense layer 0, 2
shared experts beside 8 routed ones in 4 groups (top 2), a random selection
bias, `routed_scaling_factor` 2.5; and GLM-4.5-Air's routing (one group,
scaling 1), no q/k norm, two dense layers, tied. The default run checks
each once; the product of layouts, front ends, paths and attention
implementations runs under slow in tests/hf/test_hf.py (`NAMES`).
"""

import importlib.resources
import json

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from linen_moe import hf
from linen_moe._src.models.rotary import rope_of
from tests.hf_helpers import assert_config_refused
from tests.hf_helpers import assert_greedy
from tests.hf_helpers import assert_logits
from tests.hf_helpers import assert_save_is_the_fixture
from tests.hf_helpers import forbid_data_reads
from tests.hf_helpers import load

GROUPS, AIR = "glm4_moe_partial_qknorm_groups", "glm4_moe_nogroup_tied"


class LogitsTest(parameterized.TestCase):

  @parameterized.parameters(
      (GROUPS, False, "nnx", "sparse"), (AIR, True, "linen", "dense")
  )
  def test_logits_equal_transformers(self, name, scan, frontend, path):
    assert_logits(name, scan, frontend, path)

  def test_greedy_with_cache_equals_generate(self):
    assert_greedy(GROUPS)


class ModelConfigTest(absltest.TestCase):

  def test_fixtures(self):
    config, variables = load(GROUPS, True)
    self.assertEqual((config.head_dim, config.rotary_dim), (16, 8))
    self.assertTrue(config.qk_norm and config.attention_qkv_bias)
    self.assertFalse(config.attention_out_bias)
    self.assertEqual(config.dense_layers, (0,))
    moe = config.moe
    self.assertEqual((moe.shared_experts, moe.num_routing_groups), (2, 4))
    self.assertEqual(
        (moe.routed_scaling_factor, moe.routing), (2.5, "sigmoid_then_topk")
    )
    self.assertEqual(moe.routed_bias_update_rate, 0.0)
    bias = variables["updated_by_rule"]["layers"]["moe"]["routed_experts"]
    self.assertGreater(float(np.abs(bias["routed_bias"]).max()), 0.0)
    air, _ = load(AIR, True)
    self.assertFalse(air.qk_norm)
    self.assertEqual(air.dense_layers, (0, 1))
    with self.assertRaisesRegex(ValueError, r"rotary_dim=7 .*even width <= "):
      config.replace(rotary_dim=7)
    with self.assertRaisesRegex(ValueError, r"rotary_dim=32 .*even width <= "):
      config.replace(rotary_dim=32)

  def test_partial_rotary_is_transformers(self):
    # transformers' `compute_default_rope_parameters` with
    # partial_rotary_factor 0.5 of head_dim 128: base ** (-2i / 64)
    # The released config.json ships in the package (configs/hf/).
    released = json.loads(
        (importlib.resources.files("linen_moe.configs") / "hf" / "glm4_5")
        .joinpath("config.json")
        .read_text()
    )
    config = hf.model_config(released)
    self.assertEqual((config.head_dim, config.rotary_dim), (128, 64))
    rope = rope_of(config, 128)
    self.assertEqual(rope.dim, 64)
    np.testing.assert_allclose(
        rope.inverse_frequencies(),
        1e6 ** -(np.arange(0, 64, 2) / 64),
        rtol=1e-6,
    )
    x = np.random.default_rng(0).normal(size=(1, 3, 2, 128)).astype("f4")
    out = np.asarray(rope(x, np.arange(3)[None]))
    np.testing.assert_array_equal(out[..., 64:], x[..., 64:])
    self.assertGreater(np.abs(out[:, 1:, :, :64] - x[:, 1:, :, :64]).max(), 0.1)


class FilesTest(absltest.TestCase):

  def test_save_writes_the_hub_tensors(self):
    out = assert_save_is_the_fixture(self, GROUPS)
    written = json.loads((out / "config.json").read_text())
    self.assertEqual(written["rope_parameters"]["partial_rotary_factor"], 0.5)


class BadInputTest(parameterized.TestCase):
  """Each error names the field, before any data is read."""

  def setUp(self):
    super().setUp()
    forbid_data_reads(self)

  @parameterized.parameters(
      (
          {
              "rope_parameters": {
                  "rope_type": "default",
                  "partial_rotary_factor": 0.1,
              }
          },
          r"rope_parameters.partial_rotary_factor=0.1 .* rotates 1 of 16",
      ),
      (
          {
              "rope_parameters": {
                  "rope_type": "default",
                  "partial_rotary_factor": 2,
              }
          },
          r"rope_parameters.partial_rotary_factor=2 .* share in \(0, 1\]",
      ),
      ({"use_qk_norm": "yes"}, r"use_qk_norm='yes' is not supported"),
      ({"attention_dropout": 0.1}, r"attention_dropout=0.1 is not supp"),
      ({"moe_layer_freq": 2}, r"field\(s\) \['moe_layer_freq'\]"),
  )
  def test_config_fields(self, change, pattern):
    assert_config_refused(self, GROUPS, change, pattern)


if __name__ == "__main__":
  absltest.main()
