"""Writes the LoRA export fixture: adapters on a Hugging Face fixture, and
the logits transformers computes from the merged checkpoint we export.

Two halves, in two venvs (CI has no torch):

  # 1. this project's venv: adapters for tests/fixtures/hf/BASE (seeded,
  #    B not zero), saved with `linen_moe.lora.save_adapters`, and the
  #    merged model (`lora.merge`) exported with `hf.save_checkpoint`.
  .venv/bin/python scripts/make_lora_fixture.py ours --merged /tmp/merged

  # 2. the fixture venv of scripts/make_hf_fixtures.py (torch, transformers):
  #    transformers loads the merged checkpoint (no missing or unexpected
  #    key) and writes its logits on BASE's input_ids.
  /work/hf311/bin/python scripts/make_lora_fixture.py transformers \\
      --merged /tmp/merged

It writes tests/fixtures/lora/BASE/: `adapters.safetensors`,
`adapter_config.json` and `transformers_logits.npy` (float32 [2, S, V]),
and `meta.json` (versions, seed). tests/training/test_lora.py loads the base
fixture, adds these adapters, and checks our adapted decoder's logits
against transformers' to 1e-4.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = "qwen3_moe_dense0_norm"
RANK, ALPHA, SEED, SCALE = 4, 8.0, 0, 0.05


def ours(merged: pathlib.Path, out: pathlib.Path) -> None:
  import jax  # noqa: PLC0415

  from linen_moe import hf  # noqa: PLC0415
  from linen_moe import lora  # noqa: PLC0415

  config, variables = hf.load_checkpoint(ROOT / "tests/fixtures/hf" / BASE)
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
  if out.exists():
    shutil.rmtree(out)
  lora.save_adapters(config, variables, out)
  plain_config, plain = lora.merge(config, variables)
  if merged.exists():
    shutil.rmtree(merged)
  hf.save_checkpoint(plain_config, plain, merged)
  print(f"adapters in {out}, merged model in {merged}")


def transformers_half(merged: pathlib.Path, out: pathlib.Path) -> None:
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      merged,
      torch_dtype=torch.float32,
      attn_implementation="eager",
      output_loading_info=True,
  )
  bad = {k: v for k, v in info.items() if v}
  if bad:
    raise SystemExit(f"transformers did not load {merged} cleanly: {bad}")
  model.eval()
  ids = np.load(ROOT / "tests/fixtures/hf" / BASE / "input_ids.npy")
  with torch.no_grad():
    logits = model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
  np.save(out / "transformers_logits.npy", logits.astype(np.float32))
  meta = {
      "purpose": "transformers' logits of the merged LoRA export",
      "base": f"tests/fixtures/hf/{BASE}",
      "rank": RANK,
      "alpha": ALPHA,
      "seed": SEED,
      "adapter_scale": SCALE,
      "torch": torch.__version__,
      "transformers": transformers.__version__,
  }
  (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
  print(f"transformers' logits {logits.shape} in {out}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("half", choices=("ours", "transformers"))
  p.add_argument("--merged", type=pathlib.Path, required=True)
  p.add_argument(
      "--out", type=pathlib.Path, default=ROOT / "tests/fixtures/lora" / BASE
  )
  args = p.parse_args()
  if args.half == "ours":
    ours(args.merged, args.out)
  else:
    transformers_half(args.merged, args.out)


if __name__ == "__main__":
  main()
