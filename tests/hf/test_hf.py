"""Hugging Face checkpoints against transformers' own numbers.

The fixtures (tests/fixtures/hf, written by scripts/make_hf_fixtures.py with
transformers 5.24) hold tiny random Mixtral, Qwen3-MoE, DeepSeek-V3 and
Gemma-4 checkpoints and transformers' logits and greedy continuations for
them; neither torch nor transformers runs here.

The default run checks one fixture a family in `LogitsTest` (fixtures the
attention and bfloat16 tests do not hold), spread over the (layers x front
end x path) combinations so that every value of every axis is covered;
`SlowProductTest` runs the whole product over every fixture. What is
particular to DeepSeek-V3 and Gemma-4 is in tests/hf/test_hf_families.py.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from linen_moe import testing
from linen_moe._src.models import attention_blockwise
from linen_moe._src.testing import helpers
from tests.hf_helpers import ATOL
from tests.hf_helpers import assert_int8_serving
from tests.hf_helpers import assert_packed_equals_alone
from tests.hf_helpers import fixture as _fixture
from tests.hf_helpers import generate as _generate
from tests.hf_helpers import load as _load
from tests.hf_helpers import logits as _logits

NAMES = (
    "mixtral_gqa_swa",
    "mixtral_gqa_swa_fused",
    "mixtral_tied_sharded",
    "qwen3_moe_dense0_norm",
    "qwen3_moe_step2_nonorm_tied",
    "deepseek_v3_qlora_yarn_groups",
    "deepseek_v3_plain_nogroup",
    "gemma4_text_moe_keqv",
    "gemma4_text_moe_untied",
    "gemma4_conditional_text",
    "gpt_oss_sinks_swa_yarn",
    "gpt_oss_mxfp4",
    "glm4_moe_partial_qknorm_groups",
    "glm4_moe_nogroup_tied",
    "minimax_m2_partial_qknorm",
    "llama4_text_nope_chunked",
    "llama4_text_all_moe",
    "llama4_conditional_text",
)
# fixture -> (scanned, front end, path) of the default run: one fixture a
# family, together scanned and unrolled, Linen and NNX, sparse and dense;
# each is a fixture no other default test holds against transformers' logits
# (`ATTENTION_DEFAULT` and the bfloat16 test hold three more): the Mixtral
# checkpoint with fused expert weights, the scanned Qwen3 (dense, MoE)
# group, the plain DeepSeek-V3 attention (an unrolled dense layer + MoE
# layers), the multimodal Gemma-4 checkpoint's text model. `SlowProductTest`
# runs every fixture in every combination.
DEFAULT = {
    "mixtral_gqa_swa_fused": (False, "nnx", "dense"),
    "qwen3_moe_step2_nonorm_tied": (True, "linen", "dense"),
    "deepseek_v3_plain_nogroup": (False, "nnx", "dense"),
    "gemma4_conditional_text": (False, "linen", "sparse"),
}
# bfloat16 weights and activations against transformers' float32 logits:
# bf16 keeps 8 significant bits (relative rounding 2^-9), and each layer
# rounds its weights, every activation and the residual stream a dozen
# times, so the logits (std ~0.55, |max| < 2.3 here) move by about 1%; a
# router choice whose float32 margin (>= 1e-4, the fixtures' seeds) is below
# that may flip and add a few percent more. Measured: 1.0-3.1% relative,
# 0.03-0.16 max abs; transformers' own bf16 logits of the same fixtures
# are as far from its float32 ones (1.0-3.2%, 0.03-0.17).
BF16_REL, BF16_ATOL = 0.05, 0.25
# Serving weights against the float model: the per-layer bounds of
# tests/layer/test_serving.py (int8 per channel 4%, fp8 per tensor 12%, relative
# norm), which the few layers here stay within. Measured: int8 0.5-0.8%,
# fp8 1.6-6.7%.
SERVING_REL = {"int8": 0.04, "fp8": 0.12, "nanoo_fp8": 0.12}


_rel = helpers.rel_err


class LogitsTest(parameterized.TestCase):

  @parameterized.parameters(*DEFAULT.items())
  def test_logits_equal_transformers(self, name, case):
    scan, frontend, path = case
    ids, expected, _, _ = _fixture(name)
    config, variables = _load(name, scan, path)
    logits = _logits(config, variables, frontend, ids)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)

  @parameterized.parameters(
      ("mixtral_gqa_swa", "linen"),  # the sliding window over the cache
      # MLA's latent cache read in the absorbed form; YaRN.
      ("deepseek_v3_qlora_yarn_groups", "linen"),
      # sliding layers over the cache, k_eq_v full layers, a scanned group.
      ("gemma4_text_moe_keqv", "nnx"),
  )
  def test_greedy_with_cache_equals_generate(self, name, frontend):
    self.check_greedy(name, frontend)

  @testing.slow  # the NNX cache is gemma4_text_moe_keqv's above
  def test_greedy_with_cache_equals_generate_qwen3_nnx(self):
    # a scanned (dense, MoE) group, decoded unrolled
    self.check_greedy("qwen3_moe_step2_nonorm_tied", "nnx")

  def check_greedy(self, name, frontend):
    _, _, expected, prompt_len = _fixture(name)
    config, variables = _load(name, True)
    prompt = expected[:, :prompt_len]
    tokens = _generate(config, variables, frontend, prompt, 8)
    np.testing.assert_array_equal(tokens, expected)

  def test_bfloat16_within_its_bound(self):
    ids, expected, _, _ = _fixture("mixtral_tied_sharded")
    config, variables = _load("mixtral_tied_sharded", True, dtype="bfloat16")
    self.assertEqual(
        variables["params"]["layers"]["moe"]["wi_0"].dtype, "bfloat16"
    )
    logits = _logits(config, variables, "linen", ids)
    self.assertLess(_rel(logits, expected), BF16_REL)
    self.assertLess(float(np.abs(logits - expected).max()), BF16_ATOL)

  def test_model_config(self):
    config, _ = _load("qwen3_moe_step2_nonorm_tied", True)
    self.assertEqual(config.dense_layers, (0, 2))
    self.assertEqual(config.stack_plan.period, 2)
    self.assertFalse(config.moe.norm_topk_prob)
    self.assertTrue(config.tie_embeddings and config.qk_norm)
    mixtral, _ = _load("mixtral_gqa_swa", True)
    self.assertEqual(
        (mixtral.num_kv_heads, mixtral.head_dim, mixtral.sliding_window),
        (2, 12, 4),
    )
    self.assertFalse(mixtral.scale_embeddings or mixtral.tie_embeddings)


# fixture -> (scanned, front end) of the attention implementations' default
# run: GQA with head_dim 12 and a window 4 < S; MLA (Dk = 24 != Dv = 12
# here). The blocks see q, k and v after the q/k norms (Qwen3) and with
# k = v (Gemma-4's k_eq_v layers): those fixtures, and every other, are in
# `SlowAttentionImplementationsTest`.
ATTENTION_DEFAULT = {
    "mixtral_gqa_swa": (False, "nnx"),
    "deepseek_v3_qlora_yarn_groups": (True, "linen"),
}


def _implementation_logits(test, name, scan, frontend, implementation):
  """Logits of a fixture with `implementation`, blockwise in blocks of 4
  queries and 3 keys (the fixtures' 12 positions make several)."""
  for patcher in (
      mock.patch.object(attention_blockwise, "BLOCK_Q", 4),
      mock.patch.object(attention_blockwise, "BLOCK_K", 3),
  ):
    patcher.start()
    test.addCleanup(patcher.stop)
  ids, expected, _, _ = _fixture(name)
  config, variables = _load(name, scan)
  config = config.replace(attention=implementation)
  return _logits(config, variables, frontend, ids), expected


class AttentionImplementationsTest(parameterized.TestCase):
  """`ATTENTION_DEFAULT`'s fixtures with attention="blockwise" (under slow,
  every fixture with "blockwise" and "dot_product", XLA's on CPU) against
  transformers' logits; the KV-cache decode step runs the einsum whatever
  the config says, so the greedy continuations are the einsum's (tested
  above)."""

  @parameterized.parameters(*ATTENTION_DEFAULT.items())
  def test_blockwise(self, name, case):
    logits, expected = _implementation_logits(self, name, *case, "blockwise")
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@testing.slow
class SlowAttentionImplementationsTest(parameterized.TestCase):

  @parameterized.product(
      name=NAMES,
      scan=(True, False),
      frontend=("linen", "nnx"),
      implementation=("blockwise", "dot_product"),
  )
  def test_logits_equal_transformers(
      self, name, scan, frontend, implementation
  ):
    logits, expected = _implementation_logits(
        self, name, scan, frontend, implementation
    )
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@testing.slow
class SlowProductTest(parameterized.TestCase):

  @parameterized.product(
      name=NAMES,
      scan=(True, False),
      frontend=("linen", "nnx"),
      path=("sparse", "dense"),
  )
  def test_logits_equal_transformers(self, name, scan, frontend, path):
    ids, expected, _, _ = _fixture(name)
    config, variables = _load(name, scan, path)
    logits = _logits(config, variables, frontend, ids)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)

  @parameterized.product(
      name=NAMES, scan=(True, False), frontend=("linen", "nnx")
  )
  def test_greedy_with_cache_equals_generate(self, name, scan, frontend):
    _, _, expected, prompt_len = _fixture(name)
    config, variables = _load(name, scan)
    tokens = _generate(config, variables, frontend, expected[:, :prompt_len], 8)
    np.testing.assert_array_equal(tokens, expected)


# The newer families' fixtures (issue 50) for the checks below: by default
# one each (Llama-4's are in tests/hf/test_hf_llama4.py, GPT-OSS's int8 from
# MXFP4 in tests/hf/test_hf_gpt_oss.py), every one under slow.
NEWER = (
    "gpt_oss_sinks_swa_yarn",
    "glm4_moe_partial_qknorm_groups",
    "glm4_moe_nogroup_tied",
    "minimax_m2_partial_qknorm",
    "llama4_text_nope_chunked",
    "llama4_text_all_moe",
)


class NewerFamiliesTest(parameterized.TestCase):
  """Packed documents (segment ids, positions restarting) give the logits
  each gives alone, sinks, windows and chunks included; int8 serving
  weights on load stay within their bound of transformers' logits."""

  def test_packed_documents_equal_each_alone(self):
    assert_packed_equals_alone("gpt_oss_sinks_swa_yarn")  # sinks, a window

  def test_int8_serving_within_its_bound(self):
    assert_int8_serving(self, "glm4_moe_partial_qknorm_groups")

  @testing.slow
  @parameterized.product(name=NEWER, implementation=("einsum", "blockwise"))
  def test_packed_documents_everywhere(self, name, implementation):
    assert_packed_equals_alone(name, implementation)

  @testing.slow
  @parameterized.product(name=NEWER, scan=(True, False))
  def test_int8_serving_everywhere(self, name, scan):
    assert_int8_serving(self, name, scan)


if __name__ == "__main__":
  absltest.main()
