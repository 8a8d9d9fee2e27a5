"""LoRA adapters in PEFT's format (`hf.save_peft_adapters`), against what
PEFT 0.21.2 made of them.

tests/fixtures/peft/BASE (scripts/make_peft_fixtures.py) holds, for four
Hugging Face fixtures (Qwen3-MoE with a dense layer, Mixtral, DeepSeek-V3
with MLA and shared experts, Gemma-4), adapters of rank 4 on every target
(linen_moe's files), the PEFT files `save_peft_adapters` wrote from them,
and what PEFT did with those: `PeftModel.from_pretrained` on the base's
transformers model gave the merged model's logits (within 5e-6; kept as
peft_logits.npy), and `get_peft_model` + `save_pretrained` with the same
config wrote the same tensor names and shapes (peft.json). Here: the
writer writes those files again, byte for byte, and our adapted decoder
gives PEFT's logits.
"""

import json
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
from safetensors.numpy import load_file

from linen_moe import Decoder
from linen_moe import hf
from linen_moe import load_model_config
from linen_moe import lora
from linen_moe._src.testing import helpers

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
BASES = (
    "qwen3_moe_dense0_norm",
    "mixtral_gqa_swa",
    "deepseek_v3_qlora_yarn_groups",
    "gemma4_text_moe_keqv",
)


def _adapted(base: str):
  """(config, variables) of the HF fixture `base` with the adapters of
  tests/fixtures/peft/`base`."""
  config, variables = hf.load_checkpoint(FIXTURES / "hf" / base)
  return lora.load_adapters(config, variables, FIXTURES / "peft" / base)


class SavePeftAdaptersTest(parameterized.TestCase):

  @parameterized.parameters(*BASES)
  def test_the_files_peft_loaded(self, base):
    config, variables = _adapted(base)
    out = pathlib.Path(helpers.tempdir(self)) / "peft"
    files = hf.save_peft_adapters(
        config,
        variables,
        out,
        base_model_name_or_path=f"tests/fixtures/hf/{base}",
    )
    self.assertEqual(
        [f.name for f in files],
        ["adapter_config.json", "adapter_model.safetensors"],
    )
    loaded = FIXTURES / "peft" / base / "peft"
    self.assertEqual(
        json.loads((out / "adapter_config.json").read_text()),
        json.loads((loaded / "adapter_config.json").read_text()),
    )
    got = load_file(out / "adapter_model.safetensors")
    want = load_file(loaded / "adapter_model.safetensors")
    self.assertEqual(list(got), list(want))
    for name in want:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # PEFT's own writer: the same names and shapes.
    report = json.loads((FIXTURES / "peft" / base / "peft.json").read_text())
    self.assertTrue(report["names_match_peft_own_writer"])
    self.assertEqual(
        {k: list(v.shape) for k, v in got.items()}, report["peft_names"]
    )
    self.assertLessEqual(report["max_abs_diff_peft_vs_merged"], 1e-4)

  @parameterized.parameters(*BASES)
  def test_peft_gives_our_logits(self, base):
    config, variables = _adapted(base)
    ids = np.load(FIXTURES / "hf" / base / "input_ids.npy")
    ours, _ = jax.jit(Decoder(config).apply)(variables, ids)
    peft_logits = np.load(FIXTURES / "peft" / base / "peft_logits.npy")
    np.testing.assert_allclose(ours, peft_logits, atol=1e-4, rtol=0)
    # The adapters move the logits far more than the tolerance.
    plain = np.load(FIXTURES / "hf" / base / "logits.npy")
    self.assertGreater(float(np.abs(peft_logits - plain).max()), 0.5)

  def test_rank_and_dropout_of_the_config(self):
    config, variables = _adapted("qwen3_moe_dense0_norm")
    meta = json.loads(
        (
            FIXTURES / "peft" / "qwen3_moe_dense0_norm" / "peft"
            / "adapter_config.json"
        ).read_text()
    )  # fmt: skip
    self.assertEqual(
        {k: meta[k] for k in ("peft_type", "task_type", "r", "lora_alpha")},
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4,
         "lora_alpha": 8.0},
    )  # fmt: skip
    # gate and up fused: rank 2r, alpha 2 alpha (the same scale).
    self.assertEqual(meta["rank_pattern"], {"gate_up_proj": 8})
    self.assertEqual(meta["alpha_pattern"], {"gate_up_proj": 16.0})
    # Attention alone: modules, and the run's dropout kept.
    attention = config.replace(lora_targets=("attention",), lora_dropout=0.1)
    out = pathlib.Path(helpers.tempdir(self)) / "attention"
    hf.save_peft_adapters(attention, variables, out)
    meta = json.loads((out / "adapter_config.json").read_text())
    self.assertEqual(
        (meta["target_modules"], meta["target_parameters"]),
        (["k_proj", "o_proj", "q_proj", "v_proj"], []),
    )
    self.assertEqual(meta["lora_dropout"], 0.1)

  def test_bad_input(self):
    config, variables = _adapted("qwen3_moe_dense0_norm")
    tmp = pathlib.Path(helpers.tempdir(self))
    with self.assertRaisesRegex(ValueError, r"out=.* exists; it never over"):
      hf.save_peft_adapters(config, variables, tmp)
    with self.assertRaisesRegex(
        ValueError, r"save_peft_adapters needs a config with adapters"
    ):
      hf.save_peft_adapters(config.replace(lora_rank=0), variables, tmp / "a")
    with self.assertRaisesRegex(TypeError, r"config must be a ModelConfig"):
      hf.save_peft_adapters("qwen3", variables, tmp / "b")
    gemma = load_model_config("tiny_gemma4_26b", lora_rank=2)
    with self.assertRaisesRegex(
        ValueError, r"no Hugging Face form: the nearest family, gemma4_text"
    ):
      hf.save_peft_adapters(gemma, {"params": {}}, tmp / "c")
    # GPT-OSS's and Llama-4's experts are stored as x @ W: PEFT's form of
    # their adapters is not proven, so none is written rather than a file
    # without them.
    for name in ("tiny_gpt_oss", "tiny_llama4"):
      columns = load_model_config(name, lora_rank=2, lora_targets=("experts",))
      with self.assertRaisesRegex(
          ValueError, r"routed experts of .*stored as x @ W\) have no PEFT"
      ):
        hf.save_peft_adapters(columns, {"params": {}}, tmp / "c")
    no_adapters = {"params": lora.split(variables["params"])[1]}
    with self.assertRaisesRegex(ValueError, r"variables hold no adapter lay"):
      hf.save_peft_adapters(config, no_adapters, tmp / "d")
    self.assertFalse(any((tmp / n).exists() for n in "abcd"))


class LinenMoEAdaptersTest(absltest.TestCase):

  def test_own_files_have_their_own_names(self):
    # save_adapters writes adapters.json, not PEFT's adapter_config.json;
    # a directory of linen_moe 0.2 (adapter_config.json in our schema)
    # still loads (tests/fixtures/lora: test_lora.py).
    config, variables = _adapted("mixtral_gqa_swa")
    out = pathlib.Path(helpers.tempdir(self)) / "ours"
    lora.save_adapters(config, variables, out)
    self.assertEqual(
        sorted(p.name for p in out.iterdir()),
        ["adapters.json", "adapters.safetensors"],
    )
    legacy = FIXTURES / "lora" / "qwen3_moe_dense0_norm"
    self.assertTrue((legacy / "adapter_config.json").is_file())
    base, base_vars = hf.load_checkpoint(FIXTURES / "hf" / legacy.name)
    loaded, _ = lora.load_adapters(base, base_vars, legacy)
    self.assertEqual(loaded.moe.lora_rank, 4)
    peft_dir = pathlib.Path(helpers.tempdir(self))
    hf.save_peft_adapters(config, variables, peft_dir / "p")
    (peft_dir / "p" / "adapters.safetensors").write_bytes(b"")
    with self.assertRaisesRegex(ValueError, r"is PEFT's adapter config"):
      lora.load_adapters(config, variables, peft_dir / "p")


if __name__ == "__main__":
  absltest.main()
