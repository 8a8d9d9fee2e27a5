"""Writes the shipped YAML configs that come from Hugging Face config.json.

  .venv/bin/python scripts/make_hf_configs.py [--check]

Each `configs/<name>.yml` of `DERIVED` is `linen_moe.hf.model_config` of a
config.json, written field by field (every field that differs from the
`ModelConfig` / `MoEConfig` default): the released models' shapes
(`configs/hf/*/config.json`) and the tiny models the matrix trains (the
fixtures' config.json). `--check` writes nothing and fails when a file
differs from what it would write (tests/hf/test_hf_sizes.py checks the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import yaml

from linen_moe import ModelConfig
from linen_moe import MoEConfig
from linen_moe import hf

ROOT = pathlib.Path(__file__).resolve().parent.parent
# shipped config name -> (config.json, what it is)
DERIVED = {
    "mixtral_8x7b": ("configs/hf/mixtral_8x7b/config.json", "Mixtral-8x7B"),
    "qwen3_30b_a3b": ("configs/hf/qwen3_30b_a3b/config.json", "Qwen3-30B-A3B"),
    "deepseek_v3_671b": ("configs/hf/deepseek_v3/config.json", "DeepSeek-V3"),
    "gemma4_26b": (
        "configs/hf/gemma4_26b_a4b/config.json",
        "Gemma-4-26B-A4B (its text decoder)",
    ),
    "tiny_deepseek_v3_mla": (
        "tests/fixtures/hf/deepseek_v3_qlora_yarn_groups/config.json",
        "a tiny DeepSeek-V3 (MLA with q_lora, YaRN, groups, 1 dense layer)",
    ),
    "tiny_gemma4_text": (
        "tests/fixtures/hf/gemma4_text_moe_keqv/config.json",
        "a tiny Gemma-4 (sliding and full layers, k_eq_v, soft-capping)",
    ),
    "gpt_oss_120b": ("configs/hf/gpt_oss_120b/config.json", "gpt-oss-120b"),
    "gpt_oss_20b": ("configs/hf/gpt_oss_20b/config.json", "gpt-oss-20b"),
    "tiny_gpt_oss": (
        "tests/fixtures/hf/gpt_oss_sinks_swa_yarn/config.json",
        (
            "a tiny GPT-OSS (sliding and full layers, sinks, biases, clamped "
            "SwiGLU, YaRN)"
        ),
    ),
    "glm4_5": ("configs/hf/glm4_5/config.json", "GLM-4.5"),
    "glm4_5_air": ("configs/hf/glm4_5_air/config.json", "GLM-4.5-Air"),
    "tiny_glm4_moe": (
        "tests/fixtures/hf/glm4_moe_partial_qknorm_groups/config.json",
        (
            "a tiny GLM-4.5 (partial rotary, q/k norms and biases, a dense "
            "layer, shared experts, sigmoid routing in groups)"
        ),
    ),
    "minimax_m2": ("configs/hf/minimax_m2/config.json", "MiniMax-M2"),
    "tiny_minimax_m2": (
        "tests/fixtures/hf/minimax_m2_partial_qknorm/config.json",
        (
            "a tiny MiniMax-M2 (rotary_dim half the head, q/k norms over all "
            "heads, sigmoid routing with a selection bias)"
        ),
    ),
    "llama4_scout": (
        "configs/hf/llama4_scout/config.json",
        "Llama-4-Scout-17B-16E (its text decoder)",
    ),
    "llama4_maverick": (
        "configs/hf/llama4_maverick/config.json",
        "Llama-4-Maverick-17B-128E (its text decoder)",
    ),
    "tiny_llama4": (
        "tests/fixtures/hf/llama4_text_nope_chunked/config.json",
        (
            "a tiny Llama-4 (dense and MoE layers, a shared expert beside "
            "top-1 sigmoid routing, chunked RoPE and NoPE layers, llama3 RoPE)"
        ),
    ),
}


def _plain(value):
  return list(value) if isinstance(value, tuple) else value


def _changed(obj, cls) -> dict:
  """The fields of `obj` that differ from the defaults of `cls` (required
  fields always)."""
  out = {}
  for field in dataclasses.fields(cls):
    if field.name == "moe" or not field.init:
      continue
    value = getattr(obj, field.name)
    if field.default is dataclasses.MISSING or value != field.default:
      out[field.name] = _plain(value)
  return out


def render(name: str) -> str:
  """The YAML text of config `name`."""
  source, what = DERIVED[name]
  config = hf.model_config(json.loads((ROOT / source).read_text()))
  body = {
      "moe": _changed(config.moe, MoEConfig),
      "decoder": _changed(config, ModelConfig),
  }
  header = (
      f"# {what}:\n# hf.model_config of {source},\n"
      "# written by scripts/make_hf_configs.py (do not edit; rerun it).\n"
  )
  return header + yaml.safe_dump(body, sort_keys=False)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true")
  args = parser.parse_args()
  stale = []
  for name in DERIVED:
    path = ROOT / "configs" / f"{name}.yml"
    text = render(name)
    if args.check:
      if not path.exists() or path.read_text() != text:
        stale.append(path.name)
    else:
      path.write_text(text)
      print(f"wrote {path.relative_to(ROOT)}")
  if stale:
    print(f"stale: {stale}; rerun scripts/make_hf_configs.py", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
