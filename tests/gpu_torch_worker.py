"""transformers' side of tests/gpu/test_on_gpu_families.py, in a process of its
own (torch and the JAX CUDA plugin each load their own CUDA libraries; the
test's process holds JAX's). Imports no jax.

  python -m tests.gpu_torch_worker OUT DEVICE FIXTURE...

For each fixture (a directory of tests/fixtures/hf) on DEVICE ("cuda" or
"cpu"), eager attention and experts, TF32 off: writes OUT/FIXTURE.npz with
`logits` (float32 model, [B, S, V]), `logits_bf16` (the bfloat16 model's,
as float32) and `tokens` (greedy `generate` of NEW_TOKENS from the first
`prompt_len` tokens of `input_ids`); prints one JSON line: {"torch",
"transformers", "device", "fixtures": {FIXTURE: "ok" or why not}}.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import torch
import transformers
from transformers.models.auto import configuration_auto

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
NEW_TOKENS = 8
EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}


def _model(directory: pathlib.Path, dtype, device: str):
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=dtype, **EAGER
  )
  return model.to(device).eval()


def _outputs(model, ids: np.ndarray, prompt_len: int, device: str):
  with torch.no_grad():
    tokens = torch.as_tensor(ids, device=device)
    logits = model(tokens, use_cache=False).logits.float().cpu().numpy()
    prompt = tokens[:, :prompt_len]
    generated = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=True,
    )
  return logits, generated.cpu().numpy()


def run(out: pathlib.Path, device: str, fixture: str) -> str:
  """Writes OUT/FIXTURE.npz; "ok", or why transformers cannot run it."""
  directory = FIXTURES / fixture
  config = json.loads((directory / "config.json").read_text())
  if config["model_type"] not in configuration_auto.CONFIG_MAPPING:
    return (
        f"transformers {transformers.__version__} does not know model_type"
        f" {config['model_type']!r}"
    )
  meta = json.loads((directory / "meta.json").read_text())
  ids = np.load(directory / "input_ids.npy")
  logits, tokens = _outputs(
      _model(directory, torch.float32, device), ids, meta["prompt_len"], device
  )
  logits_bf16, _ = _outputs(
      _model(directory, torch.bfloat16, device), ids, meta["prompt_len"], device
  )
  np.savez(
      out / f"{fixture}.npz",
      logits=logits,
      logits_bf16=logits_bf16,
      tokens=tokens,
  )
  return "ok"


def main(out: str, device: str, fixtures: list[str]) -> dict:
  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  if device == "cuda" and not torch.cuda.is_available():
    why = f"torch {torch.__version__} sees no CUDA device"
    return {"device": device, "fixtures": dict.fromkeys(fixtures, why)}
  return {
      "torch": torch.__version__,
      "transformers": transformers.__version__,
      "device": device,
      "fixtures": {f: run(pathlib.Path(out), device, f) for f in fixtures},
  }


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
