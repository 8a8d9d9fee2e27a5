"""Which shipped configs have a Hugging Face form, and what the others lack.

Every shipped config named after a Hugging Face family (`tiny_mixtral`,
`tiny_qwen3_moe`, `tiny_gemma4_text`, `tiny_deepseek_v3_mla`, and the
released sizes) is written by `hf.save_checkpoint`; the two that are not
(`tiny_gemma4_26b`, `tiny_deepseek_v3`) name the family whose layers they
have and what it needs, in the direction a user changes the field
(`linen-moe train --help` lists them: tests/test_cli_export_hf.py).
"""

from absl.testing import absltest
from absl.testing import parameterized

from linen_moe import available_configs
from linen_moe import hf
from linen_moe import load_model_config
from linen_moe._src.hf.config_map import FamilyMatch
from tests import cli_helpers

EXPORTED = {
    "tiny_mixtral": "mixtral",
    "tiny_qwen3_moe": "qwen3_moe",
    "tiny_gemma4_text": "gemma4_text",
    "tiny_deepseek_v3_mla": "deepseek_v3",
    "mixtral_8x7b": "mixtral",
    "qwen3_30b_a3b": "qwen3_moe",
    "gemma4_26b": "gemma4_text",
    "deepseek_v3_671b": "deepseek_v3",
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
        r"qk_norm=True \(this config: False\)\.$",
    ):
      hf.save_checkpoint(config, {"params": {}}, cli_helpers.tempdir(self))
    # Mixtral's routing written as softmax-then-top-k renormalised is still
    # Mixtral (mixtral_8x7b's config.json maps to it).
    mixtral = load_model_config("mixtral_8x7b")
    self.assertEqual(mixtral.moe.routing, "softmax_then_topk")
    self.assertEqual(hf.family_match(mixtral).model_type, "mixtral")

  def test_bad_input(self):
    with self.assertRaisesRegex(
        TypeError, r"family_match: config must be a ModelConfig; got str"
    ):
      hf.family_match("tiny_mixtral")


if __name__ == "__main__":
  absltest.main()
