"""Hugging Face checkpoints against transformers' own numbers.

The fixtures (tests/fixtures/hf, written by scripts/make_hf_fixtures.py with
transformers 5.24) hold tiny random Mixtral and Qwen3-MoE checkpoints and
transformers' logits and greedy continuations for them; neither torch nor
transformers runs here.

The default run loads each fixture once and spreads the (layers x front
end x path) combinations over them so that every value of every axis is
covered; `SlowProductTest` runs the whole product.
"""

import functools
import json
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import numpy as np

from linen_moe import PATHS
from linen_moe import Decoder
from linen_moe import decoding
from linen_moe import hf
from linen_moe import testing
import nnx_adapter

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
NAMES = (
    "mixtral_gqa_swa",
    "mixtral_gqa_swa_fused",
    "mixtral_tied_sharded",
    "qwen3_moe_dense0_norm",
    "qwen3_moe_step2_nonorm_tied",
)
# fixture -> (scanned, front end, path) of the default run: scanned and
# unrolled, Linen and NNX, sparse and dense each at least twice; the
# scanned Qwen3 fixtures are a dense prefix + MoE stack and a scanned
# (dense, MoE) group.
DEFAULT = {
    "mixtral_gqa_swa": (True, "linen", "sparse"),
    "mixtral_gqa_swa_fused": (False, "nnx", "dense"),
    "mixtral_tied_sharded": (False, "linen", "dense"),
    "qwen3_moe_dense0_norm": (True, "nnx", "sparse"),
    "qwen3_moe_step2_nonorm_tied": (True, "linen", "dense"),
}
# float32 against transformers' float32 logits (max abs over the vocab).
ATOL = 1e-4
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
# tests/test_serving.py (int8 per channel 4%, fp8 per tensor 12%, relative
# norm), which the few layers here stay within. Measured: int8 0.5-0.8%,
# fp8 1.6-6.7%.
SERVING_REL = {"int8": 0.04, "fp8": 0.12, "nanoo_fp8": 0.12}


_rel = testing.rel_err


@functools.cache
def _fixture(name: str):
  d = FIXTURES / name
  meta = json.loads((d / "meta.json").read_text())
  return (
      np.load(d / "input_ids.npy"),
      np.load(d / "logits.npy"),
      np.load(d / "generate.npy"),
      meta["prompt_len"],
  )


@functools.cache
def _load(name: str, scan: bool, path: str = "sparse", **kwargs):
  config, variables = hf.load_checkpoint(
      FIXTURES / name, scan_layers=scan, **kwargs
  )
  return config.replace(**PATHS[path]), variables


def _logits(config, variables, frontend: str, ids) -> np.ndarray:
  if frontend == "linen":
    forward = jax.jit(lambda v, t: Decoder(config).apply(v, t)[0])
    return np.asarray(forward(variables, ids))
  model = nnx_adapter.Decoder.from_linen(config, variables)
  return np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, ids))


def _generate(config, variables, frontend: str, prompt, n) -> np.ndarray:
  if frontend == "linen":
    return np.asarray(decoding.greedy_generate(config, variables, prompt, n))
  model = nnx_adapter.Decoder.from_linen(config, variables)
  return np.asarray(nnx_adapter.greedy_generate(model, prompt, n))


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
      ("qwen3_moe_step2_nonorm_tied", "nnx"),  # a scanned (dense, MoE) group
  )
  def test_greedy_with_cache_equals_generate(self, name, frontend):
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


if __name__ == "__main__":
  absltest.main()
