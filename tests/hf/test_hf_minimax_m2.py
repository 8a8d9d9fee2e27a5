"""MiniMax-M2 checkpoints against transformers' own numbers.

The fixture transformers 5.25 wrote (scripts/make_hf_family_fixtures.py):
`rotary_dim` 8 of 16, q / k RMSNorms over all heads at once, sigmoid
routing with a random selection bias kept on the MoE block, GQA 4 / 2. The
default run checks it once; the product of layouts, front ends, paths and
attention implementations runs under slow in tests/hf/test_hf.py (`NAMES`).
"""

import json
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from linen_moe import Decoder
from linen_moe import hf
from linen_moe._src.testing import helpers
from tests.hf_helpers import FIXTURES
from tests.hf_helpers import assert_config_refused
from tests.hf_helpers import assert_greedy
from tests.hf_helpers import assert_logits
from tests.hf_helpers import assert_save_is_the_fixture
from tests.hf_helpers import fixture
from tests.hf_helpers import forbid_data_reads
from tests.hf_helpers import load

NAME = "minimax_m2_partial_qknorm"
# Block fp8 weights (blocks of 16 here) against the float model: every
# linear weight but the routers rounded to e4m3, 3 mantissa bits (measured
# 5.7% on the fixture's random weights).
FP8_REL = 0.1


class LogitsTest(absltest.TestCase):

  def test_logits_equal_transformers(self):
    assert_logits(NAME, False, "nnx", "sparse")

  def test_greedy_with_cache_equals_generate(self):
    assert_greedy(NAME)


class ModelConfigTest(absltest.TestCase):

  def test_fixture(self):
    config, variables = load(NAME, True)
    self.assertEqual((config.head_dim, config.rotary_dim), (16, 8))
    self.assertTrue(config.qk_norm and config.qk_norm_over_heads)
    attention = variables["params"]["layers"]["attention"]
    self.assertEqual(attention["query_norm"]["scale"].shape, (3, 4 * 16))
    self.assertEqual(attention["key_norm"]["scale"].shape, (3, 2 * 16))
    moe = config.moe
    self.assertEqual(
        (moe.routing, moe.norm_topk_prob), ("sigmoid_then_topk", True)
    )
    bias = variables["updated_by_rule"]["layers"]["moe"]["routed_bias"]
    self.assertGreater(float(np.abs(bias).max()), 0.0)
    with self.assertRaisesRegex(
        ValueError, r"qk_norm_over_heads=True .*qk_norm"
    ):
      config.replace(qk_norm=False)


class FilesTest(absltest.TestCase):

  def test_save_writes_the_hub_tensors(self):
    out = assert_save_is_the_fixture(self, NAME)
    written = json.loads((out / "config.json").read_text())
    self.assertEqual(written["rotary_dim"], 8)
    self.assertEqual(written["rope_parameters"]["partial_rotary_factor"], 0.5)

  def test_the_released_block_fp8_layout(self):
    # The release: block-fp8 linear weights beside `weight_scale_inv`,
    # config.json's `quantization_config` as MiniMax wrote it.
    config, variables = hf.load_checkpoint(FIXTURES / NAME)
    out = pathlib.Path(helpers.tempdir(self)) / "fp8"
    hf.save_checkpoint(
        config,
        variables,
        out,
        weight_format="block_fp8",
        block_size=(16, 16),
    )
    written = json.loads((out / "config.json").read_text())
    written["quantization_config"] |= {
        "fmt": "float8_e4m3fn",
        "modules_to_not_convert": [
            "gate",
            "e_score_correction_bias",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(written))
    fp8_config, fp8 = hf.load_checkpoint(out)
    self.assertEqual(fp8_config, config)
    ids, expected, _, _ = fixture(NAME)
    got, _ = jax.jit(Decoder(config).apply)(fp8, ids)
    self.assertLess(helpers.rel_err(got, expected), FP8_REL)


class BadInputTest(parameterized.TestCase):
  """Each error names the key, before any data is read: the released keys
  transformers ignores must hold the values its model hard-codes."""

  def setUp(self):
    super().setUp()
    forbid_data_reads(self)

  @parameterized.parameters(
      ({"use_qk_norm": False}, r"use_qk_norm=False is not supported"),
      ({"qk_norm_type": "per_head"}, r"qk_norm_type='per_head' is not supp"),
      ({"scoring_func": "softmax"}, r"scoring_func='softmax' is not supp"),
      ({"use_routing_bias": False}, r"use_routing_bias=False is not supp"),
      ({"shared_intermediate_size": 512}, r"shared_intermediate_size=512"),
      ({"attn_type_list": [0, 1, 1]}, r"attn_type_list=\[0, 1, 1\]"),
      ({"rotary_dim": 4}, r"rotary_dim=4 is not supported: .* rotates 8"),
      ({"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 is not supp"),
  )
  def test_config_fields(self, change, pattern):
    assert_config_refused(self, NAME, change, pattern)


if __name__ == "__main__":
  absltest.main()
