"""Config validation: every bad value is a ValueError naming the field."""

import dataclasses
import importlib.resources
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import yaml

from linen_moe import MoEConfig
from linen_moe import available_configs
from linen_moe import load_model_config
from linen_moe import load_moe_config
from linen_moe._src.config.moe_config import check_serving
from linen_moe.quantization import SERVING_MODES

GOOD = dict(num_experts=8, num_experts_per_tok=2, emb_dim=16, moe_mlp_dim=32)
# The released models' shapes as their Hugging Face config.json files state
# them (copied by hand; in the repository under configs/hf/): Mixtral-8x7B
# (num_local_experts, hidden_size, intermediate_size, router_aux_loss_coef,
# rope_theta), Gemma-4-26B-A4B (num_experts, top_k_experts,
# moe_intermediate_size, intermediate_size = the shared expert's width,
# gelu_pytorch_tanh), DeepSeek-V3 (n_routed_experts, n_shared_experts x
# moe_intermediate_size, n_group, topk_group, scoring_func sigmoid,
# routed_scaling_factor) and Qwen3-30B-A3B.
RELEASED = {
    "mixtral_8x7b": dict(
        num_experts=8,
        num_experts_per_tok=2,
        emb_dim=4096,
        moe_mlp_dim=14336,
        mlp_activations=("silu", "linear"),
        # transformers' softmax over every expert, top-k, renormalised: the
        # softmax of the top-k logits.
        routing="softmax_then_topk",
        norm_topk_prob=True,
        shared_experts=0,
        # router_aux_loss_coef 0.02, but output_router_logits false: no
        # auxiliary loss in transformers' loss.
        load_balance_loss_weight=0.0,
        vocab_size=32000,
        num_layers=32,
        num_heads=32,
        rope_max_wavelength=1e6,
    ),
    "gemma4_26b": dict(
        num_experts=128,
        num_experts_per_tok=8,
        emb_dim=2816,
        moe_mlp_dim=704,
        mlp_activations=("gelu", "linear"),
        routing="softmax_then_topk",
        norm_topk_prob=True,
        shared_experts=1,
        shared_mlp_dim=2112,
        vocab_size=262144,
        num_layers=30,
        num_heads=16,
        head_dim=256,
    ),
    "deepseek_v3_671b": dict(
        num_experts=256,
        num_experts_per_tok=8,
        emb_dim=7168,
        moe_mlp_dim=2048,
        mlp_activations=("silu", "linear"),
        routing="sigmoid_then_topk",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_routing_groups=8,
        topk_routing_group=4,
        shared_experts=1,
        shared_mlp_dim=2048,
        vocab_size=129280,
        num_layers=61,
        num_heads=128,
    ),
    "qwen3_30b_a3b": dict(
        num_experts=128,
        num_experts_per_tok=8,
        emb_dim=2048,
        moe_mlp_dim=768,
        mlp_activations=("silu", "linear"),
        routing="softmax_then_topk",
        norm_topk_prob=True,
        shared_experts=0,
        load_balance_loss_weight=0.0,  # as Mixtral's: output_router_logits
        # is false in its config.json.
        vocab_size=151936,
        num_layers=48,
        num_heads=32,
        head_dim=128,
        rope_max_wavelength=1e6,
    ),
}
# Each tiny config and the release whose structure it mirrors at toy size.
TINY_OF = {
    "tiny_mixtral": "mixtral_8x7b",
    "tiny_gemma4_26b": "gemma4_26b",
    "tiny_deepseek_v3": "deepseek_v3_671b",
    "tiny_qwen3_moe": "qwen3_30b_a3b",
}
# The fields that make a family what it is, not how big it is.
STRUCTURE = (
    "mlp_activations",
    "routing",
    "norm_topk_prob",
    "per_expert_scale",
    "routed_scaling_factor",
    "routed_bias",
)


def _field(cfg, name):
  """A field of a ModelConfig, looked up on its MoEConfig when it is one."""
  return getattr(cfg.moe if hasattr(cfg.moe, name) else cfg, name)


def _routing(cfg) -> tuple[str, bool]:
  """(routing, renormalised) as computed: top-k then softmax is the softmax
  over every expert, top-k, renormalised."""
  if cfg.moe.routing == "topk_then_softmax":
    return ("softmax_then_topk", True)
  return (cfg.moe.routing, cfg.moe.norm_topk_prob)


class ConfigValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (
          "topk_gt_experts",
          dict(num_experts_per_tok=9),
          r"num_experts_per_tok=9.*<= num_experts=8",
      ),
      ("zero_experts", dict(num_experts=0), r"num_experts=0.*positive"),
      ("negative_emb", dict(emb_dim=-4), r"emb_dim=-4.*positive"),
      ("zero_mlp", dict(moe_mlp_dim=0), r"moe_mlp_dim=0.*positive"),
      ("float_size", dict(emb_dim=16.0), r"emb_dim=16.0.*integer"),
      (
          "bad_activation",
          dict(mlp_activations=("swish", "linear")),
          r"mlp_activations=.*swish.*silu",
      ),
      (
          "non_linear_second",
          dict(mlp_activations=("silu", "gelu")),
          r"mlp_activations",
      ),
      (
          "bad_routing",
          dict(routing="sinkhorn"),
          r"routing='sinkhorn'.*topk_then_softmax",
      ),
      (
          "bad_quantization",
          dict(quantization="int4"),
          r"quantization='int4'.*'none', 'int8', 'fp8', 'nanoo_fp8'",
      ),
      ("bad_dtype", dict(dtype="float64"), r"dtype='float64'"),
      (
          "shared_without_width",
          dict(shared_experts=1),
          r"shared_mlp_dim=0.*positive",
      ),
      ("negative_shared", dict(shared_experts=-1), r"shared_experts=-1"),
      (
          "nan_capacity",
          dict(capacity_factor=float("nan")),
          r"capacity_factor=nan.*finite",
      ),
      (
          "dropping_on_sparse",
          dict(capacity_factor=1.0, sparse_matmul=True),
          r"capacity_factor=1.0.*sparse_matmul=False",
      ),
      (
          "negative_lb",
          dict(load_balance_loss_weight=-1.0),
          r"load_balance_loss_weight",
      ),
      ("bad_gmm", dict(grouped_matmul="cuda"), r"grouped_matmul='cuda'"),
      (
          "zero_scaling",
          dict(routed_scaling_factor=0.0),
          r"routed_scaling_factor=0.0.*> 0",
      ),
      (
          "inf_scaling",
          dict(routed_scaling_factor=float("inf")),
          r"routed_scaling_factor=inf.*finite",
      ),
      (
          "string_scaling",
          dict(routed_scaling_factor="2.5"),
          r"routed_scaling_factor='2.5'.*number",
      ),
      (
          "zero_groups",
          dict(num_routing_groups=0),
          r"num_routing_groups=0.*positive",
      ),
      (
          "groups_not_dividing",
          dict(num_routing_groups=3),
          r"num_routing_groups=3.*divide num_experts=8",
      ),
      (
          "groups_of_one",
          dict(num_routing_groups=8, topk_routing_group=2),
          r"num_routing_groups=8.*>= 2 experts",
      ),
      (
          "topk_groups_gt_groups",
          dict(num_routing_groups=2, topk_routing_group=3),
          r"topk_routing_group=3.*<= num_routing_groups=2",
      ),
      (
          "zero_topk_groups",
          dict(topk_routing_group=0),
          r"topk_routing_group=0.*positive",
      ),
      (
          "k_beyond_chosen_groups",
          dict(
              num_experts_per_tok=3, num_routing_groups=4, topk_routing_group=1
          ),
          r"num_experts_per_tok=3.*= 2",
      ),
      ("bias_not_bool", dict(routed_bias=1), r"routed_bias=1.*bool"),
      (
          "negative_rate",
          dict(routed_bias=True, routed_bias_update_rate=-0.1),
          r"routed_bias_update_rate=-0.1.*>= 0",
      ),
      (
          "rate_without_bias",
          dict(routed_bias_update_rate=0.01),
          r"routed_bias_update_rate=0.01.*routed_bias=True",
      ),
      (
          "negative_z_loss",
          dict(router_z_loss_weight=-1e-3),
          r"router_z_loss_weight=-0.001.*>= 0",
      ),
      ("negative_jitter", dict(router_jitter=-0.1), r"router_jitter=-0.1"),
      ("jitter_one", dict(router_jitter=1.0), r"router_jitter=1.0.*< 1"),
      (
          "bad_drop_policy",
          dict(drop_policy="random"),
          r"drop_policy='random'.*'position', 'probability'",
      ),
      (
          "bad_routing_sigmoid",
          dict(routing="sigmoid"),
          r"routing='sigmoid'.*sigmoid_then_topk",
      ),
      (
          "serving_unquantized",
          dict(serving=True),
          r"MoEConfig.serving=True is invalid: .* quantized mode \('int8',"
          r" 'fp8', 'nanoo_fp8'\), but quantization='none'",
      ),
  )
  def test_invalid(self, change, pattern):
    with self.assertRaisesRegex(ValueError, pattern):
      MoEConfig(**{**GOOD, **change})

  def test_valid_and_frozen(self):
    cfg = MoEConfig(**GOOD)
    self.assertEqual(cfg.path, "sparse")
    self.assertEqual(cfg.replace(sparse_matmul=False).path, "dense")
    self.assertEqual(
        cfg.replace(sparse_matmul=False, capacity_factor=1.0).path,
        "dense_dropping",
    )
    with self.assertRaises(dataclasses.FrozenInstanceError):
      cfg.emb_dim = 3  # frozen

  def test_serving_rule_has_one_home(self):
    # The config's check is the one the loaders and the conversion ask: a
    # mode that stores weights serves, and the same mode string fails alike
    # as a config field and as an argument.
    for mode in SERVING_MODES:
      self.assertTrue(MoEConfig(**GOOD, quantization=mode, serving=True))
      check_serving(True, mode)
    check_serving(False, "none")
    with self.assertRaisesRegex(
        ValueError, r"^serving=True is invalid: .*quantization='none'"
    ):
      check_serving(True, "none")
    with self.assertRaisesRegex(ValueError, r"^MoEConfig.serving=True"):
      MoEConfig(**GOOD).replace(serving=True)

  def test_replace_rejects_unknown(self):
    with self.assertRaisesRegex(ValueError, r"\['num_expert'\].*num_experts"):
      MoEConfig(**GOOD).replace(num_expert=4)


class FamilyFieldsValidationTest(parameterized.TestCase):
  """The fields of DeepSeek-V3's and Gemma-4's attention and blocks: a bad
  value is a ValueError naming the field, its value and what is allowed."""

  @parameterized.named_parameters(
      ("unknown_rope_type", dict(rope_type="linear"), r"rope_type='linear'"
       r".*allowed \('default', 'yarn', 'llama3'\)"),
      ("yarn_without_length", dict(rope_original_max_len=0),
       r"rope_original_max_len=0 .*YaRN needs"),
      ("mla_grouped_kv", dict(num_kv_heads=2),
       r"num_kv_heads=2 .*MLA expands keys and values to every head"),
      ("odd_rope_width", dict(qk_rope_head_dim=3),
       r"qk_rope_head_dim=3 .*even width"),
      ("interleave_not_bool", dict(rope_interleave="yes"),
       r"rope_interleave='yes' .*expected a bool"),
      ("negative_rank", dict(q_lora_rank=-1),
       r"q_lora_rank=-1 .*integer >= 0"),
  )  # fmt: skip
  def test_deepseek(self, change, pattern):
    config = load_model_config("tiny_deepseek_v3_mla")
    with self.assertRaisesRegex(ValueError, "ModelConfig." + pattern):
      config.replace(**change)

  @parameterized.named_parameters(
      ("full_layer_out_of_range", dict(full_attention_layers=(1, 9)),
       r"full_attention_layers=\(1, 9\) .*\[0, num_layers=4\)"),
      ("full_fields_without_full_layers", dict(full_attention_layers=()),
       r"full_head_dim=16 .*there are none"),
      ("rope_fraction_above_one", dict(full_rope_fraction=1.5),
       r"full_rope_fraction=1.5 .*\(0, 1\]"),
      ("shared_pre_norm_alone", dict(post_moe_norms=False),
       r"shared_pre_norm=True .*needs post_moe_norms"),
      ("negative_softcap", dict(final_logit_softcap=-1.0),
       r"final_logit_softcap=-1.0 .*>= 0"),
      ("yarn_beside_full_layers",
       dict(rope_type="yarn", rope_original_max_len=8),
       r"rope_type='yarn' .*only 'default' beside them"),
  )  # fmt: skip
  def test_gemma4(self, change, pattern):
    config = load_model_config("tiny_gemma4_text")
    with self.assertRaisesRegex(ValueError, "ModelConfig." + pattern):
      config.replace(**change)

  def test_mla_fields_need_mla(self):
    with self.assertRaisesRegex(
        ValueError, r"q_lora_rank=4 .*needs kv_lora_rank > 0"
    ):
      load_model_config("tiny_mixtral").replace(q_lora_rank=4)


class LoadConfigTest(parameterized.TestCase):

  def test_shipped_configs_load_as_written(self):
    self.assertContainsSubset({*RELEASED, *TINY_OF}, set(available_configs()))
    for name in available_configs():
      cfg = load_model_config(name)
      resource = importlib.resources.files("linen_moe.configs") / f"{name}.yml"
      written = yaml.safe_load(resource.read_text(encoding="utf-8"))
      self.assertEqual(set(written), {"moe", "decoder"}, name)
      for section, fields in written.items():
        for field, value in fields.items():
          got = getattr(cfg.moe if section == "moe" else cfg, field)
          want = tuple(value) if isinstance(value, list) else value
          self.assertEqual(got, want, f"{name}: {section}.{field}")

  @parameterized.parameters(*RELEASED)
  def test_released_shapes(self, name):
    cfg = load_model_config(name)
    for field, value in RELEASED[name].items():
      self.assertEqual(_field(cfg, field), value, f"{name}: {field}")
    if name == "gemma4_26b":  # its router reads its own, normalised input
      self.assertTrue(cfg.router_input_norm and cfg.post_moe_norms)
      self.assertTrue(cfg.moe.per_expert_scale)

  @parameterized.parameters(*TINY_OF.items())
  def test_tiny_configs_mirror_their_release(self, tiny, released):
    small, full = load_model_config(tiny), load_model_config(released)
    self.assertEqual(_routing(small), _routing(full), tiny)
    for field in (*STRUCTURE, "router_input_norm", "post_moe_norms"):
      if field in ("routing", "norm_topk_prob"):
        continue
      self.assertEqual(
          _field(small, field), _field(full, field), f"{tiny}: {field}"
      )
    # Shared experts and expert groups: present in both, or in neither.
    self.assertEqual(
        small.moe.shared_experts > 0, full.moe.shared_experts > 0, tiny
    )
    self.assertEqual(
        small.moe.num_routing_groups > 1, full.moe.num_routing_groups > 1, tiny
    )
    # Tiny: trains in seconds on a CPU.
    self.assertLessEqual(small.moe.emb_dim, 64)
    self.assertLessEqual(small.num_layers, 2)
    self.assertEqual(small.vocab_size, 256)

  def test_structure_of_tiny_configs(self):
    mix = load_moe_config("tiny_mixtral")
    self.assertEqual((mix.num_experts, mix.num_experts_per_tok), (8, 2))
    self.assertEqual(mix.mlp_activations, ("silu", "linear"))
    self.assertEqual(
        (mix.routing, mix.shared_experts), ("topk_then_softmax", 0)
    )
    gem = load_model_config("tiny_gemma4_26b")
    self.assertEqual(gem.moe.num_experts_per_tok, 8)
    self.assertEqual(gem.moe.routing, "softmax_then_topk")
    self.assertTrue(gem.moe.norm_topk_prob and gem.moe.per_expert_scale)
    self.assertEqual(gem.moe.shared_experts, 1)
    self.assertTrue(gem.router_input_norm and gem.post_moe_norms)
    full = load_moe_config("gemma4_26b")
    self.assertEqual(
        (full.num_experts, full.emb_dim, full.moe_mlp_dim), (128, 2816, 704)
    )

  def test_structure_of_deepseek_and_qwen_configs(self):
    ds = load_moe_config("tiny_deepseek_v3")
    self.assertEqual((ds.num_experts, ds.num_experts_per_tok), (16, 4))
    self.assertEqual((ds.num_routing_groups, ds.topk_routing_group), (4, 2))
    self.assertEqual(ds.routing, "sigmoid_then_topk")
    self.assertEqual(ds.routed_scaling_factor, 2.5)
    self.assertTrue(ds.norm_topk_prob and ds.routed_bias)
    self.assertGreater(ds.routed_bias_update_rate, 0.0)
    self.assertEqual((ds.shared_experts, ds.load_balance_loss_weight), (1, 0.0))
    qw = load_moe_config("tiny_qwen3_moe")
    self.assertEqual(qw.routing, "softmax_then_topk")
    self.assertTrue(qw.norm_topk_prob)
    self.assertEqual(qw.shared_experts, 0)
    self.assertGreater(qw.num_experts, qw.moe_mlp_dim)  # many small experts
    full = load_moe_config("deepseek_v3_671b")
    self.assertEqual(
        (full.num_experts, full.num_routing_groups, full.emb_dim),
        (256, 8, 7168),
    )
    full = load_moe_config("qwen3_30b_a3b")
    self.assertEqual((full.num_experts, full.moe_mlp_dim), (128, 768))

  def test_overrides(self):
    cfg = load_moe_config(
        "tiny_mixtral", quantization="fp8", sparse_matmul=False
    )
    self.assertEqual((cfg.quantization, cfg.sparse_matmul), ("fp8", False))
    model = load_model_config("tiny_mixtral", num_layers=3, quantization="int8")
    self.assertEqual((model.num_layers, model.moe.quantization), (3, "int8"))

  def test_unknown_override(self):
    with self.assertRaisesRegex(ValueError, r"\['num_exprts'\]"):
      load_moe_config("tiny_mixtral", num_exprts=3)
    with self.assertRaisesRegex(ValueError, r"\['depth'\]"):
      load_model_config("tiny_mixtral", depth=3)

  def test_unknown_name(self):
    with self.assertRaisesRegex(ValueError, r"'tiny_llama'.*tiny_mixtral"):
      load_moe_config("tiny_llama")

  def test_unknown_yaml_key_in_file(self):
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "bad.yml")
      with open(path, "w") as f:
        f.write(
            "moe:\n  num_experts: 4\n  num_experts_per_tok: 1\n"
            "  emb_dim: 8\n  moe_mlp_dim: 8\n  expert_count: 3\n"
        )
      with self.assertRaisesRegex(ValueError, r"\['expert_count'\]"):
        load_moe_config(path)
      with open(path, "w") as f:
        f.write(
            "moe:\n  num_experts: 4\n  num_experts_per_tok: 1\n"
            "  emb_dim: 8\n  moe_mlp_dim: 8\ndecoder:\n  num_layers: 1\n"
        )
      self.assertEqual(load_model_config(path).num_layers, 1)
    with self.assertRaisesRegex(ValueError, "does not exist"):
      load_moe_config("/nonexistent/cfg.yml")


if __name__ == "__main__":
  absltest.main()
