"""DeepSeek-V3 and Gemma-4 checkpoint files: round trips, what is skipped,
bad input. Loading and saving compile nothing but the fresh rule state.
"""

import json
import pathlib
import shutil

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file
from safetensors.numpy import save_file

from linen_moe import Decoder
from linen_moe import hf
from linen_moe import testing
from linen_moe import training
from linen_moe._src.testing import helpers
import nnx_adapter
from tests.hf_helpers import FIXTURES
from tests.hf_helpers import forbid_data_reads


def _equal_trees(test, a, b):
  test.assertEqual(jax.tree.structure(a), jax.tree.structure(b))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    test.assertEqual(x.dtype, y.dtype)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _copy(name: str, tmp: pathlib.Path) -> pathlib.Path:
  out = tmp / name
  shutil.copytree(FIXTURES / name, out)
  return out


def _edit_config(d: pathlib.Path, edit) -> None:
  config = json.loads((d / "config.json").read_text())
  edit(config)
  (d / "config.json").write_text(json.dumps(config))


def _edit_tensors(d: pathlib.Path, edit) -> None:
  path = d / "model.safetensors"
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


class RoundTripTest(parameterized.TestCase):

  @parameterized.parameters(
      # (fixture, scanned, shard size, the prefix of its text tensors)
      ("deepseek_v3_qlora_yarn_groups", True, 60_000, "model."),
      ("deepseek_v3_plain_nogroup", False, "2GB", "model."),
      ("gemma4_text_moe_keqv", True, "2GB", "model."),
      ("gemma4_conditional_text", False, "2GB", "model.language_model."),
  )
  def test_load_save_load_and_the_tensors_on_disk(
      self, name, scan, shard, prefix
  ):
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    config, variables = hf.load_checkpoint(FIXTURES / name, scan_layers=scan)
    hf.save_checkpoint(config, variables, out, max_shard_size=shard)
    again_config, again = hf.load_checkpoint(out, scan_layers=scan)
    self.assertEqual(again_config, config)
    _equal_trees(self, again, variables)
    # The tensors written are transformers' own, byte for byte (DeepSeek's
    # per-expert names, Gemma-4's fused experts; the multimodal checkpoint's
    # text decoder saved as Gemma4ForCausalLM: `model.` names).
    saved = {}
    files = list(out.glob("*.safetensors"))
    for file in files:
      saved |= load_file(file)
    self.assertEqual(len(files) > 1, shard != "2GB")
    hub = load_file(FIXTURES / name / "model.safetensors")
    hub = {n.replace(prefix, "model.", 1): v for n, v in hub.items()}
    self.assertEqual(sorted(saved), sorted(hub))
    for n, value in hub.items():
      np.testing.assert_array_equal(saved[n], value, err_msg=n)
    written = json.loads((out / "config.json").read_text())
    self.assertIn(written["model_type"], ("deepseek_v3", "gemma4_text"))

  def test_nnx_variables_save_the_saved_buffers(self):
    name = "deepseek_v3_qlora_yarn_groups"
    config, variables = hf.load_checkpoint(FIXTURES / name)
    model = nnx_adapter.Decoder.from_linen(config, variables)
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    hf.save_checkpoint(config, nnx_adapter.nnx_to_linen(model), out)
    saved = load_file(out / "model.safetensors")
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    np.testing.assert_array_equal(
        saved[bias], load_file(FIXTURES / name / "model.safetensors")[bias]
    )


def _fine_tune(name: str, quantization: str = "fp8"):
  """One train step in `quantization` from fixture `name`, unrolled:
  (config, the loaded variables, the trained variables, the step's
  metrics)."""
  config, variables = hf.load_checkpoint(
      FIXTURES / name, scan_layers=False, quantization=quantization
  )
  optimizer = training.default_optimizer(1e-2)
  state = training.train_state_from_variables(variables, optimizer)
  step = jax.jit(training.make_train_step(Decoder(config), optimizer))
  tokens = helpers.markov_tokens(config.vocab_size, 4, 16, seed=0)
  state, metrics = step(state, jnp.asarray(tokens), jax.random.key(0))
  trained = {"params": state.params, "updated_by_rule": state.rule_state}
  return config, variables, trained, jax.device_get(metrics)


class FineTuneTest(absltest.TestCase):
  """Load -> fine-tune in fp8 -> save -> load: the saved buffers are the
  trained ones (transformers' side of the same round trip:
  scripts/hf_finetune_roundtrip.py and scripts/check_hf_roundtrip.py)."""

  def test_the_loaded_routed_bias_keeps_training_and_is_saved(self):
    config, loaded, trained, metrics = _fine_tune("deepseek_v3_plain_nogroup")
    rate = config.moe.routed_bias_update_rate
    self.assertEqual(rate, 0.001)  # DeepSeek-V3's bias_update_speed
    load = np.asarray(metrics["expert_load"], np.float64)  # [L, E]
    for i in range(config.num_layers):
      if i in config.dense_layers:
        self.assertNotIn(f"layers_{i}", trained["updated_by_rule"])
        continue
      path = (f"layers_{i}", "moe", "routed_experts", "routed_bias")
      before, after = loaded["updated_by_rule"], trained["updated_by_rule"]
      for key in path:
        before, after = before[key], after[key]
      # The aux-loss-free rule from the file's e_score_correction_bias:
      # an overloaded expert's bias falls by the rate, an underloaded one's
      # rises.
      want = np.asarray(before, np.float64) + rate * np.sign(
          load[i].mean() - load[i]
      )
      np.testing.assert_allclose(after, want, rtol=0, atol=1e-7)
      self.assertGreater(float(np.abs(np.asarray(after) - before).max()), 0)
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    hf.save_checkpoint(config, trained, out)
    again_config, again = hf.load_checkpoint(
        out, scan_layers=False, quantization="fp8"
    )
    self.assertEqual(again_config, config)
    _equal_trees(self, {k: again[k] for k in trained}, jax.device_get(trained))
    bias = load_file(out / "model.safetensors")[
        "model.layers.2.mlp.gate.e_score_correction_bias"
    ]
    np.testing.assert_array_equal(
        bias,
        trained["updated_by_rule"]["layers_2"]["moe"]["routed_experts"][
            "routed_bias"
        ],
    )

  @testing.slow
  def test_gemma4_layer_scalars_are_not_trained(self):
    config, loaded, trained, _ = _fine_tune("gemma4_text_moe_untied")
    _equal_trees(self, trained["updated_by_rule"], loaded["updated_by_rule"])
    moved = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()),
        trained["params"],
        loaded["params"],
    )
    self.assertGreater(max(jax.tree.leaves(moved)), 0.0)
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    hf.save_checkpoint(config, trained, out)
    _, again = hf.load_checkpoint(out, scan_layers=False)
    _equal_trees(self, again["params"], jax.device_get(trained["params"]))


class SkippedTensorsTest(absltest.TestCase):

  def test_mtp_layer_is_skipped_with_a_message(self):
    d = _copy(
        "deepseek_v3_qlora_yarn_groups", pathlib.Path(helpers.tempdir(self))
    )
    extra = {}

    def add_mtp(tensors):  # layer 3 = num_hidden_layers: the MTP layer
      for name, value in list(tensors.items()):
        if name.startswith("model.layers.2."):
          extra[name.replace("layers.2.", "layers.3.")] = value
      tensors.update(extra)

    _edit_tensors(d, add_mtp)
    with self.assertRaisesRegex(
        ValueError, r"holds the tensor 'model.layers.3"
    ):
      hf.load_checkpoint(d)  # num_nextn_predict_layers is 0: not MTP
    _edit_config(d, lambda c: c.update(num_nextn_predict_layers=1))
    with self.assertLogs("linen_moe.hf", "WARNING") as logs:
      config, variables = hf.load_checkpoint(d)
    self.assertIn(
        f"Skipping the {len(extra)} tensors of the multi-token-prediction "
        "layer(s) [3]",
        logs.output[0],
    )
    _, plain = hf.load_checkpoint(FIXTURES / "deepseek_v3_qlora_yarn_groups")
    _equal_trees(self, variables, plain)
    self.assertEqual(config.num_layers, 3)

  def test_multimodal_towers_are_skipped_with_a_message(self):
    d = _copy("gemma4_conditional_text", pathlib.Path(helpers.tempdir(self)))
    _edit_tensors(
        d,
        lambda t: t.update({
            "model.vision_tower.patch.weight": np.ones((2, 3), np.float32),
            "model.embed_vision.embedding_projection.weight": np.ones(
                (32, 4), np.float32
            ),
        }),
    )
    with self.assertLogs("linen_moe.hf", "WARNING") as logs:
      hf.load_checkpoint(d)
    self.assertIn("Skipping 2 tensors of the multimodal towers", logs.output[0])


class BadInputTest(parameterized.TestCase):
  """Each error names the field or the tensor, before any data is read."""

  def setUp(self):
    super().setUp()
    self.tmp = pathlib.Path(helpers.tempdir(self))
    forbid_data_reads(self)

  def _fails(self, name, change, pattern, text=False):
    d = self.tmp / f"{name}_{len(list(self.tmp.iterdir()))}"
    shutil.copytree(FIXTURES / name, d)

    def edit(config):
      (config["text_config"] if text else config).update(change)

    _edit_config(d, edit)
    with self.assertRaisesRegex(ValueError, pattern):
      hf.load_checkpoint(d)

  @parameterized.parameters(
      (
          {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
          r"rope_parameters.rope_type='linear' is not supported: only "
          r"'default' and 'yarn'",
      ),
      (
          {
              "rope_parameters": {
                  "rope_type": "yarn",
                  "factor": 4.0,
                  "attention_factor": 1.1,
              }
          },
          r"its keys \['attention_factor'\] change the rotary embedding",
      ),
      ({"num_key_value_heads": 2}, r"num_key_value_heads=2 is not supp.*MLA"),
      ({"scoring_func": "softmax"}, r"scoring_func='softmax' is not supp"),
      ({"attention_bias": True}, r"attention_bias=True is not supported"),
      ({"head_dim": 24}, r"head_dim=24 .* transformers sets it to 16"),
      ({"moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
      ({"use_mla_cache": True}, r"field\(s\) \['use_mla_cache'\]"),
      (
          {"quantization_config": {"quant_method": "awq"}},
          r"quantization_config.quant_method='awq' is not supported",
      ),
  )
  def test_deepseek_config_fields(self, change, pattern):
    self._fails("deepseek_v3_qlora_yarn_groups", change, pattern)

  @parameterized.parameters(
      (
          {"hidden_size_per_layer_input": 256},
          r"hidden_size_per_layer_input=256 is not supported: per-layer "
          r"embeddings",
      ),
      (
          {
              "rope_parameters": {
                  "sliding_attention": {"rope_type": "default"},
                  "full_attention": {"rope_type": "yarn", "factor": 8.0},
              }
          },
          r"rope_parameters.full_attention.rope_type='yarn' is not supp",
      ),
      (
          {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
          r"rope_parameters=.* expected one mapping per layer type",
      ),
      (
          {"use_bidirectional_attention": "all"},
          r"use_bidirectional_attention='all' is not supported",
      ),
      ({"num_kv_shared_layers": 2}, r"num_kv_shared_layers=2 is not supp"),
      ({"enable_moe_block": False}, r"enable_moe_block=False .* dense model"),
      (
          {"per_layer_config": {"1": {"head_dim": 16}, "3": {"head_dim": 32}}},
          r"per_layer_config=.* one geometry",
      ),
      (
          {"per_layer_config": {"1": {"sliding_window": 2}}},
          r"per_layer_config.1=.* only head_dim and num_key_value_heads",
      ),
  )
  def test_gemma4_config_fields(self, change, pattern):
    self._fails("gemma4_text_moe_keqv", change, pattern)

  def test_gemma4_defaults_and_the_multimodal_config(self):
    # Absent, hidden_size_per_layer_input is transformers' default 256.
    d = _copy("gemma4_text_moe_keqv", self.tmp)
    _edit_config(d, lambda c: c.pop("hidden_size_per_layer_input"))
    with self.assertRaisesRegex(ValueError, "hidden_size_per_layer_input=256"):
      hf.load_checkpoint(d)
    self._fails(
        "gemma4_conditional_text",
        {"hidden_size_per_layer_input": 64},
        r"hidden_size_per_layer_input=64",
        text=True,
    )
    self._fails(
        "gemma4_conditional_text",
        {"tie_word_embeddings": False},
        r"text_config.tie_word_embeddings=False .* must equal",
        text=True,
    )

  def test_tensors(self):
    d = _copy("gemma4_text_moe_keqv", self.tmp)
    pristine = (d / "model.safetensors").read_bytes()
    v0 = "model.layers.0.self_attn.v_proj.weight"
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    cases = [
        (lambda t: t.pop(v0), rf"missing the tensor\(s\) \['{v0}'\]"),
        (  # a full layer of k_eq_v has no v_proj
            lambda t: t.update(
                {"model.layers.1.self_attn.v_proj.weight": t[v0]}
            ),
            r"holds the tensor 'model.layers.1.self_attn.v_proj.weight'",
        ),
        (
            lambda t: t.update({v0: t[v0][:-1]}),
            rf"tensor '{v0}' has shape \[15, 32\]; .* needs \[16, 32\]",
        ),
    ]
    for edit, pattern in cases:
      with self.subTest(pattern=pattern):
        (d / "model.safetensors").write_bytes(pristine)
        _edit_tensors(d, edit)
        with self.assertRaisesRegex(ValueError, pattern):
          hf.load_checkpoint(d)
    ds = _copy("deepseek_v3_plain_nogroup", self.tmp)
    _edit_tensors(ds, lambda t: t.update({kv_b: t[kv_b][:, :-1]}))
    with self.assertRaisesRegex(ValueError, rf"'{kv_b}' has shape \[80, 19\]"):
      hf.load_checkpoint(ds)


class SaveErrorsTest(absltest.TestCase):

  def test_rejects(self):
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    config, variables = hf.load_checkpoint(FIXTURES / "gemma4_text_moe_keqv")
    with self.assertRaisesRegex(
        ValueError,
        r"the nearest family, gemma4_text, needs rope_interleave=False \(this"
        r" config: True\)\. The shipped configs that export as gemma4_text: "
        r"tiny_gemma4_text, gemma4_26b\.$",
    ):
      hf.save_checkpoint(config.replace(rope_interleave=True), variables, out)
    ds, ds_variables = hf.load_checkpoint(
        FIXTURES / "deepseek_v3_plain_nogroup"
    )
    with self.assertRaisesRegex(
        ValueError, r"not the updated_by_rule state of this config: missing"
    ):
      hf.save_checkpoint(ds, {"params": ds_variables["params"]}, out)
    self.assertFalse(out.exists())


if __name__ == "__main__":
  absltest.main()
