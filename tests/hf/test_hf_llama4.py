"""Llama-4 checkpoints against transformers' own numbers.

Three fixtures transformers 5.25 wrote (scripts/make_hf_family_fixtures.py):
dense and MoE layers interleaved (as Maverick), a shared expert beside top-1
sigmoid routing that scales the expert's input, RoPE layers attending in
chunks of 4 < S with a weightless q/k norm after the rotary, NoPE layers
with temperature tuning, llama3 rotary scaling; every layer MoE with plain
RoPE and no q/k norm (as Scout); and the first one's text decoder inside a
multimodal `Llama4ForConditionalGeneration` checkpoint. The default run
checks each feature once; the product of layouts, front ends, paths and
attention implementations runs under slow in tests/hf/test_hf.py (`NAMES`).
"""

import json
import pathlib
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
from safetensors.numpy import load_file

from linen_moe import hf
from linen_moe._src.hf import families
from linen_moe._src.models import attention_blockwise
from linen_moe._src.models import attention_geometry
from linen_moe._src.testing import helpers
from tests.hf_helpers import ATOL
from tests.hf_helpers import FIXTURES
from tests.hf_helpers import assert_config_refused
from tests.hf_helpers import assert_greedy
from tests.hf_helpers import assert_int8_serving
from tests.hf_helpers import assert_logits
from tests.hf_helpers import assert_packed_equals_alone
from tests.hf_helpers import assert_save_is_the_fixture
from tests.hf_helpers import fixture
from tests.hf_helpers import forbid_data_reads
from tests.hf_helpers import load
from tests.hf_helpers import logits

CHUNKED = "llama4_text_nope_chunked"
ALL_MOE = "llama4_text_all_moe"
CONDITIONAL = "llama4_conditional_text"


class LogitsTest(parameterized.TestCase):

  @parameterized.parameters(
      (CHUNKED, False, "nnx", "dense"), (ALL_MOE, True, "linen", "sparse")
  )
  def test_logits_equal_transformers(self, name, scan, frontend, path):
    assert_logits(name, scan, frontend, path)

  def test_greedy_with_cache_equals_generate(self):
    # 13 tokens: the chunked layers' ring buffer of 4 crosses three chunk
    # boundaries; the NoPE layers' temperature at each decoded position; a
    # scanned (dense, MoE) x (chunked, full) group decoded.
    assert_greedy(CHUNKED)

  def test_blockwise_attention_in_chunks(self):
    for patcher in (
        mock.patch.object(attention_blockwise, "BLOCK_Q", 4),
        mock.patch.object(attention_blockwise, "BLOCK_K", 3),
    ):
      patcher.start()
      self.addCleanup(patcher.stop)
    ids, expected, _, _ = fixture(CHUNKED)
    config, variables = load(CHUNKED, True)
    got = logits(config.replace(attention="blockwise"), variables, "linen", ids)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)

  def test_packed_documents_equal_each_alone(self):
    # chunks and temperatures counted in each document's own positions
    assert_packed_equals_alone(CHUNKED)


class ModelConfigTest(absltest.TestCase):

  def test_fixtures(self):
    config, variables = load(CHUNKED, True)
    self.assertEqual(config.dense_layers, (0, 2))
    self.assertEqual(config.dense_mlp_dim, 48)
    self.assertEqual(config.full_attention_layers, (2, 3))
    self.assertEqual(config.attention_chunk, 4)
    self.assertTrue(config.full_nope and config.qk_norm_after_rope)
    self.assertFalse(config.qk_norm)
    self.assertEqual(
        (
            config.attention_temperature_floor,
            config.attention_temperature_scale,
        ),
        (4, 0.1),
    )
    self.assertEqual(config.rope_type, "llama3")
    self.assertEqual(config.stack_plan.period, 4)
    moe = config.moe
    self.assertEqual(
        (moe.routing, moe.num_experts_per_tok, moe.shared_experts),
        ("topk_then_sigmoid", 1, 1),
    )
    self.assertTrue(moe.weights_on_input)
    self.assertEqual(moe.shared_mlp_dim, moe.moe_mlp_dim)
    block = variables["params"]["layers"]["block_1"]
    self.assertEqual(block["moe"]["shared_experts"]["wi_0"].shape, (1, 64, 16))
    text, _ = load(CONDITIONAL, True)
    self.assertEqual(text, config)  # the same text decoder
    scout, _ = load(ALL_MOE, False)
    self.assertEqual((scout.dense_layers, scout.attention_chunk), ((), 5))
    self.assertEqual(scout.rope_type, "default")
    self.assertFalse(scout.qk_norm_after_rope)

  def test_temperature_is_transformers(self):
    # transformers' scales by position (the fixture's meta.json)
    config, _ = load(CHUNKED, True)
    meta = json.loads((FIXTURES / CHUNKED / "meta.json").read_text())
    want = meta["family_stats"]["attn_temperature_scales_by_position"]
    got = attention_geometry.temperature(config, np.arange(len(want))[None])
    np.testing.assert_allclose(np.ravel(got), want, rtol=1e-6)

  def test_what_is_not_llama4(self):
    config, _ = load(CHUNKED, True)
    for change, pattern in (
        (dict(sliding_window=4), r"attention_chunk=4 .*not with sliding"),
        (dict(full_attention_layers=()), r"full_nope=True .*there are none"),
        (
            dict(attention_temperature_floor=0),
            r"attention_temperature_scale=0.1 .*needs attention_temp",
        ),
        (dict(rope_low_freq_factor=5.0), r"rope_high_freq_factor=4.0 .*exc"),
    ):
      with self.assertRaisesRegex(ValueError, "ModelConfig." + pattern):
        config.replace(**change)
    with self.assertRaisesRegex(ValueError, r"weights_on_input=True .*not 2"):
      config.moe.replace(num_experts_per_tok=2)


class ServingOnLoadTest(absltest.TestCase):

  def test_int8_within_its_bound(self):
    assert_int8_serving(self, ALL_MOE)


class FilesTest(absltest.TestCase):

  def test_save_writes_the_hub_tensors(self):
    assert_save_is_the_fixture(self, CHUNKED)

  def test_multimodal_text_saves_as_the_text_model(self):
    # The text decoder of the multimodal checkpoint (its vision tower
    # skipped) saves as the Llama4ForCausalLM transformers wrote of it.
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    config, variables = hf.load_checkpoint(FIXTURES / CONDITIONAL)
    hf.save_checkpoint(config, variables, out)
    saved = load_file(out / "model.safetensors")
    want = load_file(FIXTURES / CHUNKED / "model.safetensors")
    self.assertEqual(sorted(saved), sorted(want))
    for name, value in want.items():
      np.testing.assert_array_equal(saved[name], value, err_msg=name)
    written = json.loads((out / "config.json").read_text())
    self.assertEqual(written["model_type"], "llama4_text")
    self.assertEqual(hf.model_config(written), config)

  def test_families_share_the_text_decoder(self):
    self.assertEqual(
        families.FAMILIES["llama4"].codec,
        families.FAMILIES["llama4_text"].codec,
    )


class BadInputTest(parameterized.TestCase):
  """Each error names the field, before any data is read."""

  def setUp(self):
    super().setUp()
    forbid_data_reads(self)

  @parameterized.parameters(
      ({"num_experts_per_tok": 2}, r"num_experts_per_tok=2 is not supp"),
      ({"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 is not supp"),
      ({"no_rope_layers": [1, 0]}, r"no_rope_layers=\[1, 0\] .*expected 4"),
      ({"moe_layers": [1, 4]}, r"moe_layers=\[1, 4\] .*indices < 4"),
      (
          {"layer_types": ["full_attention"] * 4},
          r"layer_types=.* RoPE layers .* must be chunked",
      ),
      (
          {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
          r"rope_parameters.rope_type='yarn' .*only 'default' and 'llama3'",
      ),
      ({"moe_every": 2}, r"field\(s\) \['moe_every'\]"),
  )
  def test_config_fields(self, change, pattern):
    assert_config_refused(self, CHUNKED, change, pattern)

  def test_multimodal_config_fields(self):
    assert_config_refused(
        self,
        CONDITIONAL,
        {"tie_word_embeddings": True},
        r"text_config.tie_word_embeddings=False .*tie_word_embeddings=True",
    )
    assert_config_refused(
        self, CONDITIONAL, {"text_config": None}, r"text_config=None"
    )


if __name__ == "__main__":
  absltest.main()
