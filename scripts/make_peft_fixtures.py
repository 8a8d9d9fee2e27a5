"""Writes the PEFT fixtures: LoRA adapters on four Hugging Face fixtures in
PEFT's format, and what PEFT itself makes of them.

Two halves, in two venvs (CI has no torch):

  # 1. this project's venv: for each BASE of tests/fixtures/hf below,
  #    adapters of rank 4 on every target (seeded, B not zero), saved with
  #    `linen_moe.lora.save_adapters` (tests/fixtures/peft/BASE/adapters*)
  #    and `linen_moe.hf.save_peft_adapters` (.../BASE/peft/), and the
  #    merged model exported with `hf.save_checkpoint` (WORK/BASE/merged).
  .venv/bin/python scripts/make_peft_fixtures.py ours --work WORK

  # 2. the fixture venv of scripts/make_hf_fixtures.py (torch,
  #    transformers, peft): `peft.PeftModel.from_pretrained` loads
  #    .../BASE/peft onto the base fixture's transformers model, with no
  #    missing or unexpected adapter key; its logits on BASE's input_ids
  #    against transformers' logits of the merged export (1e-4); the names
  #    and shapes PEFT saves for that config (`get_peft_model` +
  #    `save_pretrained`, PEFT's own writer) against ours.
  python scripts/make_peft_fixtures.py peft --work WORK

The second half writes .../BASE/peft_logits.npy (PEFT's logits, float32
[2, S, V]) and peft.json (PEFT's tensor names and shapes, the largest
difference from the merged logits, the versions). tests/hf/test_hf_peft.py
writes the PEFT export again from the committed adapters (the same files),
checks its names and shapes against PEFT's, and our adapted decoder's
logits against PEFT's to 1e-4.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
HF = ROOT / "tests" / "fixtures" / "hf"
OUT = ROOT / "tests" / "fixtures" / "peft"
# Attention (GQA, MLA), dense MLPs, routed experts (Mixtral's and the
# Qwen3-MoE / DeepSeek-V3 names PEFT rewrites, Gemma-4's), shared experts.
BASES = (
    "qwen3_moe_dense0_norm",
    "mixtral_gqa_swa",
    "deepseek_v3_qlora_yarn_groups",
    "gemma4_text_moe_keqv",
)
RANK, ALPHA, SEED, SCALE = 4, 8.0, 0, 0.05


def ours(work: pathlib.Path) -> None:
  import jax  # noqa: PLC0415

  from linen_moe import hf  # noqa: PLC0415
  from linen_moe import lora  # noqa: PLC0415

  for base in BASES:
    config, variables = hf.load_checkpoint(HF / base)
    config = config.replace(lora_rank=RANK, lora_alpha=ALPHA)
    variables = lora.init_adapters(config, variables, jax.random.key(SEED))
    adapters, frozen = lora.split(variables["params"])
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(SEED + 1), len(leaves))
    leaves = [
        SCALE * jax.random.normal(k, x.shape, x.dtype)
        for k, x in zip(keys, leaves, strict=True)
    ]
    variables["params"] = lora.join(jax.tree.unflatten(tree, leaves), frozen)
    out = OUT / base
    for name in ("adapters.safetensors", "adapters.json", "peft"):
      path = out / name
      if path.is_dir():
        shutil.rmtree(path)
      elif path.exists():
        path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    staging = work / base / "native"
    if staging.exists():
      shutil.rmtree(staging)
    lora.save_adapters(config, variables, staging)
    for f in staging.iterdir():
      shutil.copy(f, out / f.name)
    hf.save_peft_adapters(
        config,
        variables,
        out / "peft",
        base_model_name_or_path=f"tests/fixtures/hf/{base}",
    )
    plain_config, plain = lora.merge(config, variables)
    merged = work / base / "merged"
    if merged.exists():
      shutil.rmtree(merged)
    hf.save_checkpoint(plain_config, plain, merged)
    print(f"{base}: adapters and PEFT files in {out}, merged in {merged}")


def _names(path: pathlib.Path) -> dict[str, list[int]]:
  from safetensors import safe_open  # noqa: PLC0415

  with safe_open(path, "np") as f:
    return {k: list(f.get_slice(k).get_shape()) for k in sorted(f.keys())}


def peft_half(work: pathlib.Path) -> None:
  import peft  # noqa: PLC0415
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  torch.set_num_threads(1)
  transformers.logging.set_verbosity_error()
  eager = {"attn_implementation": "eager", "experts_implementation": "eager"}

  def model(path):
    m, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True, **eager
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
      raise SystemExit(f"transformers did not load {path} cleanly: {bad}")
    return m.eval()

  failed = []
  for base in BASES:
    out = OUT / base
    ids = torch.from_numpy(
        np.load(HF / base / "input_ids.npy").astype(np.int64)
    )
    with torch.no_grad():
      merged = model(work / base / "merged")(ids).logits.numpy()
    adapted = peft.PeftModel.from_pretrained(model(HF / base), out / "peft")
    adapted.eval()
    with torch.no_grad():
      logits = adapted(ids).logits.numpy()
    # PEFT's own writer, for the same config: the names and shapes it saves.
    config = peft.PeftConfig.from_pretrained(out / "peft")
    fresh = peft.get_peft_model(model(HF / base), config)
    fresh.save_pretrained(work / base / "peft_own")
    own = _names(work / base / "peft_own" / "adapter_model.safetensors")
    ours_names = _names(out / "peft" / "adapter_model.safetensors")
    diff = float(np.abs(logits - merged).max())
    moved = float(np.abs(merged - np.load(HF / base / "logits.npy")).max())
    report = {
        "purpose": "PEFT's reading of hf.save_peft_adapters' files",
        "base": f"tests/fixtures/hf/{base}",
        "max_abs_diff_peft_vs_merged": diff,
        "max_abs_diff_merged_vs_base": moved,
        "names_match_peft_own_writer": own == ours_names,
        "peft_names": own,
        "peft": peft.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print(
        f"{base}: PEFT vs merged {diff:.2e} (the adapters move the logits "
        f"by {moved:.2e}); names as PEFT writes them: {own == ours_names}"
    )
    if not (diff <= 1e-4 and own == ours_names and moved > 1e-3):
      failed.append(base)
    np.save(out / "peft_logits.npy", logits.astype(np.float32))
    (out / "peft.json").write_text(json.dumps(report, indent=1) + "\n")
  if failed:
    raise SystemExit(f"FAIL: {failed}")
  print(f"OK: {len(BASES)} adapters load in PEFT with the merged logits")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("half", choices=("ours", "peft"))
  p.add_argument("--work", type=pathlib.Path, required=True)
  args = p.parse_args()
  if args.half == "ours":
    ours(args.work)
  else:
    peft_half(args.work)


if __name__ == "__main__":
  main()
