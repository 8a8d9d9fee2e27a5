"""Which shipped configs have a Hugging Face form, and what the others lack.

Every shipped config named after a Hugging Face family (`tiny_mixtral`,
`tiny_qwen3_moe`, `tiny_gemma4_text`, `tiny_deepseek_v3_mla`, the tiny
GPT-OSS, GLM-4.5, MiniMax-M2 and Llama-4, and the released sizes) is
written by `hf.save_checkpoint`, as one family only; the two that are not
(`tiny_gemma4_26b`, `tiny_deepseek_v3`) name the family whose layers they
have and what it needs, in the direction a user changes the field
(`linen-moe train --help` lists them: tests/cli/test_cli_export_hf.py).
"""

from absl.testing import absltest
from absl.testing import parameterized

from linen_moe import available_configs
from linen_moe import hf
from linen_moe import load_model_config
from linen_moe._src.hf import config_map
from linen_moe._src.hf.config_map import FamilyMatch
from linen_moe._src.hf.families import FAMILIES
from linen_moe._src.testing import helpers

EXPORTED = {
    "tiny_mixtral": "mixtral",
    "tiny_qwen3_moe": "qwen3_moe",
    "tiny_gemma4_text": "gemma4_text",
    "tiny_deepseek_v3_mla": "deepseek_v3",
    "mixtral_8x7b": "mixtral",
    "qwen3_30b_a3b": "qwen3_moe",
    "gemma4_26b": "gemma4_text",
    "deepseek_v3_671b": "deepseek_v3",
    "tiny_gpt_oss": "gpt_oss",
    "tiny_glm4_moe": "glm4_moe",
    "tiny_minimax_m2": "minimax_m2",
    "tiny_llama4": "llama4_text",
    "gpt_oss_20b": "gpt_oss",
    "gpt_oss_120b": "gpt_oss",
    "glm4_5": "glm4_moe",
    "glm4_5_air": "glm4_moe",
    "minimax_m2": "minimax_m2",
    "llama4_scout": "llama4_text",
    "llama4_maverick": "llama4_text",
}
# The configs with no Hugging Face form: the family whose layers they have,
# and what it needs (field=needed, then this config's value).
NOT_EXPORTED = {
    "tiny_deepseek_v3": (
        "deepseek_v3",
        (
            "kv_lora_rank >= 1, multi-head latent attention (this config: 0)",
            "scale_embeddings=False (this config: True)",
        ),
    ),
    "tiny_gemma4_26b": (
        "gemma4_text",
        (
            "qk_norm=True (this config: False)",
            "value_norm=True (this config: False)",
            "attention_scale=1.0 (this config: 0.0)",
            "shared_pre_norm=True (this config: False)",
            "post_attention_norm=True (this config: False)",
            "post_mlp_norm=True (this config: False)",
            "layer_scalar=True (this config: False)",
            (
                "sliding_window >= 1 on the layers not in full_attention_layers"
                " (this config: 0)"
            ),
        ),
    ),
}


class FamilyMatchTest(parameterized.TestCase):

  def test_every_shipped_config_is_accounted_for(self):
    self.assertEqual(
        set(available_configs()), set(EXPORTED) | set(NOT_EXPORTED)
    )

  @parameterized.parameters(*EXPORTED.items())
  def test_exported(self, name, model_type):
    match = hf.family_match(load_model_config(name))
    self.assertEqual(match, FamilyMatch(model_type, ()))
    self.assertTrue(match.exports)

  @parameterized.parameters(*EXPORTED.items())
  def test_no_config_is_two_families(self, name, model_type):
    config = load_model_config(name)
    expressing = [
        t
        for t in config_map._WRITTEN_AS  # noqa: SLF001
        if not config_map.differences(config, FAMILIES[t])
    ]
    self.assertEqual(expressing, [model_type])

  @parameterized.parameters(*NOT_EXPORTED.items())
  def test_not_exported_names_the_nearest_family(self, name, expected):
    match = hf.family_match(load_model_config(name))
    self.assertEqual((match.model_type, match.differences), expected)
    self.assertFalse(match.exports)

  def test_direction_and_family_of_the_message(self):
    # A Qwen3-MoE without its q/k norms and with scaled embeddings (the
    # old tiny_qwen3_moe) is nearest to Qwen3-MoE, whose fields it names
    # as Qwen3-MoE has them, its own values after.
    config = load_model_config(
        "tiny_qwen3_moe", qk_norm=False, scale_embeddings=True
    )
    self.assertEqual(
        hf.family_match(config),
        FamilyMatch(
            "qwen3_moe",
            (
                "scale_embeddings=False (this config: True)",
                "qk_norm=True (this config: False)",
            ),
        ),
    )
    with self.assertRaisesRegex(
        ValueError,
        r"^This ModelConfig has no Hugging Face form: the nearest family, "
        r"qwen3_moe, needs scale_embeddings=False \(this config: True\); "
        r"qk_norm=True \(this config: False\)\. The shipped configs that "
        r"export as qwen3_moe: tiny_qwen3_moe, qwen3_30b_a3b\.$",
    ):
      hf.save_checkpoint(config, {"params": {}}, helpers.tempdir(self))
    # Mixtral's routing written as softmax-then-top-k renormalised is still
    # Mixtral (mixtral_8x7b's config.json maps to it).
    mixtral = load_model_config("mixtral_8x7b")
    self.assertEqual(mixtral.moe.routing, "softmax_then_topk")
    self.assertEqual(hf.family_match(mixtral).model_type, "mixtral")

  @parameterized.named_parameters(
      # Each newer family's own config, one field away: that family, and
      # the field as the family has it.
      (
          "gpt_oss",
          "tiny_gpt_oss",
          {"scale_embeddings": True},
          "gpt_oss",
          ("scale_embeddings=False (this config: True)",),
      ),
      (
          "glm4_moe",
          "tiny_glm4_moe",
          {"dense_layers": (1,)},
          "glm4_moe",
          ("dense_layers a prefix (0, 1, ...) (this config: (1,))",),
      ),
      (
          "minimax_m2",
          "tiny_minimax_m2",
          {"scale_embeddings": True},
          "minimax_m2",
          ("scale_embeddings=False (this config: True)",),
      ),
      (
          "llama4",
          "tiny_llama4",
          {"rope_type": "yarn", "rope_factor": 4.0},
          "llama4_text",
          ("rope_type='default' or 'llama3' (this config: 'yarn')",),
      ),
      (
          "gpt_oss_biases",
          "tiny_gpt_oss",
          {"attention_out_bias": False, "sliding_window": 0},
          "gpt_oss",
          (
              (
                  "attention_out_bias=attention_qkv_bias, config.json's one "
                  "attention_bias (this config: False, attention_qkv_bias=True)"
              ),
              (
                  "sliding_window >= 1 on the layers not in"
                  " full_attention_layers (this config: 0)"
              ),
          ),
      ),
      (
          "gpt_oss_llama3_rope",
          "tiny_gpt_oss",
          {"rope_type": "llama3", "rope_factor": 8.0},
          "gpt_oss",
          ("rope_type='default' or 'yarn' (this config: 'llama3')",),
      ),
      # A Mixtral with GPT-OSS's attention sinks is nearest GPT-OSS, which
      # names its experts' activation and biases.
      (
          "sinks",
          "tiny_mixtral",
          {"attention_sinks": True},
          "gpt_oss",
          (
              (
                  "mlp_activations=('clamped_swiglu', 'linear') (this config: "
                  "('silu', 'linear'))"
              ),
              "router_bias=True (this config: False)",
              "expert_bias=True (this config: False)",
          ),
      ),
      # DeepSeek's MoE without latent attention but with GLM-4.5's grouped
      # kv heads and q/k norms is GLM-4.5's, needing its shared expert.
      (
          "glm_attention",
          "tiny_glm4_moe",
          {"shared_experts": 0},
          "glm4_moe",
          (
              (
                  "shared_experts >= 1 of shared_mlp_dim=moe_mlp_dim (this "
                  "config: 0 of 8, moe_mlp_dim=8)"
              ),
          ),
      ),
      # A Mixtral with Llama-4's chunked attention is nearest Llama-4.
      (
          "chunks",
          "tiny_mixtral",
          {"attention_chunk": 4},
          "llama4_text",
          (
              "rope_interleave=True (this config: False)",
              "routing='topk_then_sigmoid' (this config: 'topk_then_softmax')",
              "weights_on_input=True (this config: False)",
              "shared_experts=1 (this config: 0)",
              "shared_mlp_dim=moe_mlp_dim=128 (this config: 0)",
          ),
      ),
      # Mixtral's and Qwen3-MoE's checks name the newer families' fields.
      (
          "mixtral_llama3_rope",
          "tiny_mixtral",
          {
              "rope_type": "llama3",
              "rope_factor": 8.0,
              "rope_original_max_len": 16,
          },
          "mixtral",
          ("rope_type='default' (this config: 'llama3')",),
      ),
      # A router bias is GPT-OSS's alone.
      (
          "router_bias",
          "tiny_qwen3_moe",
          {"router_bias": True},
          "gpt_oss",
          (
              "attention_sinks=True (this config: False)",
              "qk_norm=False (this config: True)",
              (
                  "mlp_activations=('clamped_swiglu', 'linear') (this config: "
                  "('silu', 'linear'))"
              ),
              "routing='topk_then_softmax' (this config: 'softmax_then_topk')",
              "expert_bias=True (this config: False)",
          ),
      ),
  )
  def test_newer_families(self, name, overrides, model_type, differences):
    match = hf.family_match(load_model_config(name, **overrides))
    self.assertEqual(match, FamilyMatch(model_type, differences))
    self.assertFalse(match.exports)

  def test_bad_input(self):
    with self.assertRaisesRegex(
        TypeError, r"family_match: config must be a ModelConfig; got str"
    ):
      hf.family_match("tiny_mixtral")


if __name__ == "__main__":
  absltest.main()
