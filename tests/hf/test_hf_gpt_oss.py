"""GPT-OSS checkpoints against transformers' own numbers.

The fixtures (tests/fixtures/hf, written by scripts/make_hf_family_fixtures.py
and scripts/make_mxfp4_fixtures.py with transformers 5.25): a float GPT-OSS
(sliding, full, sliding layers with a window of 4 < S; random sinks, biases
on q/k/v/o, the router and the experts; the clamp of limit 1 clipping; YaRN
with `truncate: false`) and one with its experts in the released MXFP4
layout. The default run checks each once (their logits, a greedy
continuation over the KV cache, blockwise attention with sinks); the
product of layouts, front ends, paths and attention implementations runs
under slow in tests/hf/test_hf.py (`NAMES`).
"""

import importlib.resources
import json
import pathlib
import shutil
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
from safetensors.numpy import load_file
from safetensors.numpy import save_file

from linen_moe import Decoder
from linen_moe import hf
from linen_moe import quantization
from linen_moe._src.hf import mxfp4
from linen_moe._src.models import attention_blockwise
from linen_moe._src.models.rotary import rope_of
from linen_moe._src.testing import helpers
from tests.hf_helpers import ATOL
from tests.hf_helpers import FIXTURES
from tests.hf_helpers import assert_config_refused
from tests.hf_helpers import assert_greedy
from tests.hf_helpers import assert_logits
from tests.hf_helpers import assert_save_is_the_fixture
from tests.hf_helpers import equal_trees
from tests.hf_helpers import fixture
from tests.hf_helpers import forbid_data_reads
from tests.hf_helpers import load
from tests.hf_helpers import logits

FLOAT, MXFP4 = "gpt_oss_sinks_swa_yarn", "gpt_oss_mxfp4"
CONFIGS = importlib.resources.files("linen_moe.configs") / "hf"
# int8 per-channel serving weights against the float model (tests/hf/test_hf.py's
# bound; measured 1.0% from the MXFP4 checkpoint).
INT8_REL = 0.04


class LogitsTest(parameterized.TestCase):

  @parameterized.parameters(
      (FLOAT, False, "nnx", "dense"), (MXFP4, True, "linen", "sparse")
  )
  def test_logits_equal_transformers(self, name, scan, frontend, path):
    assert_logits(name, scan, frontend, path)

  def test_greedy_with_cache_equals_generate(self):
    # the sliding layers' ring buffer of 4 and the full layer's cache, the
    # sinks in every decode step's softmax, a scanned (sliding, full) group
    assert_greedy(FLOAT)

  def test_blockwise_attention_with_sinks(self):
    for patcher in (
        mock.patch.object(attention_blockwise, "BLOCK_Q", 4),
        mock.patch.object(attention_blockwise, "BLOCK_K", 3),
    ):
      patcher.start()
      self.addCleanup(patcher.stop)
    ids, expected, _, _ = fixture(FLOAT)
    config, variables = load(FLOAT, True)
    got = logits(config.replace(attention="blockwise"), variables, "linen", ids)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


class ModelConfigTest(absltest.TestCase):

  def test_fixture(self):
    config, variables = load(FLOAT, True)
    self.assertEqual(
        (config.sliding_window, config.full_attention_layers), (4, (1,))
    )
    self.assertTrue(
        config.attention_sinks
        and config.attention_qkv_bias
        and config.attention_out_bias
    )
    self.assertEqual((config.rope_type, config.rope_truncate), ("yarn", False))
    moe = config.moe
    self.assertEqual(moe.mlp_activations[0], "clamped_swiglu")
    self.assertEqual((moe.swiglu_alpha, moe.swiglu_limit), (1.702, 1.0))
    self.assertEqual(moe.routing, "topk_then_softmax")
    self.assertTrue(moe.router_bias and moe.expert_bias)
    block = variables["params"]["layers"]["block_1"]
    self.assertEqual(block["attention"]["sinks"].shape, (1, 4))
    self.assertEqual(block["attention"]["query"]["bias"].shape, (1, 4, 16))
    self.assertEqual(block["moe"]["wi_0_bias"].shape, (1, 4, 16))

  def test_released_yarn_is_transformers(self):
    # transformers 5.25's `_compute_yarn_parameters` of the released
    # gpt-oss-120b config (truncate false: a fractional correction range)
    config = hf.model_config(
        json.loads((CONFIGS / "gpt_oss_120b" / "config.json").read_text())
    )
    rope = rope_of(config, 64)
    np.testing.assert_allclose(
        np.asarray(rope.inverse_frequencies())[[0, 4, 8, 9, 12, 16, 31]],
        [
            1.0,
            0.225418,
            0.0508133,
            0.0317057,
            0.00679496,
            4.56484e-4,
            3.0235e-7,
        ],
        rtol=1e-5,
    )
    self.assertAlmostEqual(rope.scale, 1.3465736, places=6)
    self.assertEqual(config.full_attention_layers, tuple(range(1, 36, 2)))


class ServingOnLoadTest(absltest.TestCase):

  def test_int8_from_mxfp4(self):
    config, variables = hf.load_checkpoint(
        FIXTURES / MXFP4, quantization="int8", serving=True
    )
    float_config, floats = hf.load_checkpoint(
        FIXTURES / MXFP4, quantization="int8"
    )
    want_config, want = quantization.quantize_weights(float_config, floats)
    self.assertEqual(config, want_config)
    equal_trees(self, variables, want)
    kernel = variables["params"]["layers"]["block_0"]["moe"]["wi_0"]
    self.assertEqual(kernel.dtype, "int8")
    ids, expected, _, _ = fixture(MXFP4)
    got, _ = jax.jit(Decoder(config).apply)(variables, ids)
    self.assertLess(helpers.rel_err(got, expected), INT8_REL)


class FilesTest(absltest.TestCase):

  def test_save_writes_transformers_tensors(self):
    assert_save_is_the_fixture(self, FLOAT)

  def test_mxfp4_is_exact_float(self):
    # Each value is an e2m1 number times a power of two: the dequantized
    # experts are the float tensors transformers dequantizes to.
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    config, variables = hf.load_checkpoint(FIXTURES / MXFP4)
    hf.save_checkpoint(config, variables, out)
    saved = load_file(out / "model.safetensors")
    disk = load_file(FIXTURES / MXFP4 / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    want = mxfp4.dequantize(disk[f"{name}_blocks"], disk[f"{name}_scales"])
    np.testing.assert_array_equal(saved[name], want.transpose(0, 2, 1))
    self.assertNotIn(
        "quantization_config", json.loads((out / "config.json").read_text())
    )


class BadInputTest(parameterized.TestCase):
  """Each error names the field or the tensor, before any data is read."""

  def setUp(self):
    super().setUp()
    self.tmp = pathlib.Path(helpers.tempdir(self))
    forbid_data_reads(self)

  def _copy(self, name):
    d = self.tmp / f"{name}_{len(list(self.tmp.iterdir()))}"
    shutil.copytree(FIXTURES / name, d)
    return d

  @parameterized.parameters(
      ({"rope_parameters": {"rope_type": "linear"}}, r"rope_type='linear'"),
      ({"attention_dropout": 0.1}, r"attention_dropout=0.1 is not supp"),
      ({"layer_types": ["sliding_attention"]}, r"layer_types=.* expected 3"),
      ({"sliding_window": None}, r"sliding_window=None is not supported"),
      ({"use_kernels": True}, r"field\(s\) \['use_kernels'\]"),
      ({"swiglu_limit": 0}, r"swiglu_limit=0 is not supported"),
  )
  def test_config_fields(self, change, pattern):
    assert_config_refused(self, FLOAT, change, pattern)

  def _mxfp4_tensors(self, edit):
    d = self._copy(MXFP4)
    path = d / "model.safetensors"
    tensors = load_file(path)  # safetensors' own reader, not the loader's
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return d

  def test_scales_that_do_not_match_the_blocks(self):
    name = "model.layers.0.mlp.experts.down_proj_scales"

    def edit(tensors):
      tensors[name] = tensors[name][:, :, :1].copy()

    d = self._mxfp4_tensors(edit)
    with self.assertRaisesRegex(
        ValueError, rf"tensor '{name}' has shape \[4, 64, 1\]; the blocks"
    ):
      hf.load_checkpoint(d)

  def test_blocks_without_scales(self):
    name = "model.layers.1.mlp.experts.gate_up_proj_scales"
    d = self._mxfp4_tensors(lambda t: t.pop(name))
    with self.assertRaisesRegex(
        ValueError, rf"gate_up_proj_blocks' is MXFP4, but .* no '{name}'"
    ):
      hf.load_checkpoint(d)

  def test_unknown_quantization_field(self):
    d = self._copy(MXFP4)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64
    (d / "config.json").write_text(json.dumps(config))
    with self.assertRaisesRegex(
        ValueError, r"quantization_config has field\(s\) \['group_size'\]"
    ):
      hf.load_checkpoint(d)


if __name__ == "__main__":
  absltest.main()
