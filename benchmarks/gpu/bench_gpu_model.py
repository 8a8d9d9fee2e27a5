"""The whole model against transformers on torch, same GPU, same weights: a
Qwen3-MoE-shaped decoder of 1.76 B parameters (`qwen3_30b_a3b`'s layer
dimensions, 6 layers of 32 experts, top-8, vocabulary 151,936), bf16.

  export    random weights (seeded), written by this library's own
            `hf.save_checkpoint` to --workdir and read back by
            `hf.load_checkpoint` (ours) and by transformers'
            `AutoModelForCausalLM.from_pretrained` (the peer)
  logits    both sides' logits of the same --logits-batch x --logits-seq
            tokens: max and norm relative differences (bf16: 2e-2), and
            the share of positions whose argmax agrees
  timing    `benchmarks/model/bench_model.py --checkpoint DIR --peer
            python` in a child: the train step (AdamW, clipped) and greedy
            decoding at batch 8 and 1, ours and transformers' alternating
            round by round (its `bench_model.json` is inlined here), and
            the ratios the issue bars (>= 2x each): ours' tokens/s over
            transformers'

Writes --out/bench_gpu_model.json. Without torch (this CPU host) the
logits comparison is skipped and the timing runs ours alone.

  python benchmarks/gpu/bench_gpu_model.py --out DIR          # on the GPU
  python benchmarks/gpu/bench_gpu_model.py --cpu-dry-run --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import gpu_timing  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ("qwen3_30b_a3b", {"num_layers": 6, "num_experts": 32})
TINY = ("tiny_qwen3_moe", {})
# bench_model.py's options on the GPU, and in the dry run.
TIMING = ("--batch", "4", "--seq", "2048", "--rounds", "3")
DRY_TIMING = ("--batch", "2", "--seq", "32", "--rounds", "1")
DRY_TIMING += ("--decode-batch", "1", "--prompt", "8", "--new", "4")


def config(tiny: bool):
  import linen_moe  # noqa: PLC0415

  name, changes = TINY if tiny else MODEL
  return linen_moe.load_model_config(name).replace(
      **changes, dtype="bfloat16", param_dtype="bfloat16"
  )


def export(cfg, folder: str) -> int:
  """Random weights through `hf.save_checkpoint`; their parameter count."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe import hf  # noqa: PLC0415

  sample = jnp.zeros((1, 8), jnp.int32)
  variables = jax.jit(linen_moe.Decoder(cfg).init)(jax.random.key(0), sample)
  variables = linen_moe.sharding.unbox(dict(variables))
  hf.save_checkpoint(cfg, variables, folder)
  return sum(x.size for x in jax.tree.leaves(variables["params"]))


def argmax_agreement(ours, theirs) -> float:
  """Share of positions whose largest logit is the same token."""
  import numpy as np  # noqa: PLC0415

  a = np.asarray(ours, np.float32).argmax(-1)
  b = theirs.detach().float().cpu().numpy().argmax(-1)
  return float((a == b).mean())


def compare_logits(folder: str, batch: int, seq: int, torch) -> dict:
  """Our logits (the checkpoint read back by `hf.load_checkpoint`) against
  transformers' on the same tokens."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe import hf  # noqa: PLC0415

  cfg, variables = hf.load_checkpoint(folder)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, seq))
  ours, _ = jax.jit(linen_moe.Decoder(cfg).apply)(variables, tokens)
  out = {"ours_config_layers": cfg.num_layers}
  if torch is None:
    out["skipped"] = "torch does not import here"
    return out
  import transformers  # noqa: PLC0415

  device = gpu_timing.torch_device(torch)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, dtype=torch.bfloat16
  ).to(device)
  with torch.no_grad():
    theirs = model(torch.tensor(tokens, device=device)).logits
  out["relative"] = gpu_timing.relative_errors(ours, theirs)
  out["agree"] = gpu_timing.agree(out["relative"])
  out["argmax_agreement"] = argmax_agreement(ours, theirs)
  del model, theirs
  if torch.cuda.is_available():
    torch.cuda.empty_cache()  # the child's peer needs it
  return out


def speedups(model: dict) -> dict:
  """Ours' tokens/s over the peer's, from bench_model's medians (seconds):
  the train step, and greedy generation per decode batch."""
  out = {}
  if model.get("peer_train_step_s") and model.get("train_step_s"):
    out["train"] = model["peer_train_step_s"] / model["train_step_s"]
  for key, ours in model.items():
    if key.startswith("b") and key.endswith("_generate_s"):
      peer = model.get(f"peer_{key}")
      if peer and ours:
        out[key.removesuffix("_generate_s") + "_decode"] = peer / ours
  return out


def timing(folder: str, out: str, dry: bool, torch, deadline) -> dict:
  """bench_model.py on the checkpoint, in a child (ended at `deadline`);
  its JSON."""
  path = os.path.join(out, "bench_model.json")
  argv = [
      sys.executable,
      str(ROOT / "benchmarks" / "model" / "bench_model.py"),
      "--model",
      "tiny_qwen3_moe" if dry else "qwen3_30b_a3b",
      "--checkpoint",
      folder,
      *(DRY_TIMING if dry else TIMING),
      "--out",
      path,
  ]
  if torch is not None:
    argv += ["--peer", sys.executable]
  env = {**os.environ, "LINEN_MOE_PEER_DEVICE": gpu_timing.torch_device(torch)}
  # The child's JAX: its usual pool, less the peer's share of the GPU.
  env.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
  env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.45"
  try:
    done = subprocess.run(
        argv, env=env, check=False, timeout=max(deadline.left(), 1)
    )
  except subprocess.TimeoutExpired:
    return {"exit": 124, "command": " ".join(argv)}
  if done.returncode or not os.path.exists(path):
    return {"exit": done.returncode, "command": " ".join(argv)}
  with open(path, encoding="utf-8") as f:
    return {"exit": 0, "command": " ".join(argv), "result": json.load(f)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=".")
  parser.add_argument("--workdir", help="where the checkpoint goes (a temp)")
  parser.add_argument("--logits-batch", type=int, default=2)
  parser.add_argument("--logits-seq", type=int, default=512)
  parser.add_argument("--no-timing", action="store_true")
  parser.add_argument("--budget-s", type=float, default=150)
  parser.add_argument("--cpu-dry-run", action="store_true")
  args = parser.parse_args(argv)
  if args.cpu_dry_run:
    args.logits_batch, args.logits_seq = 1, 16
  deadline = gpu_timing.Deadline(args.budget_s)
  torch = gpu_timing.torch_or_none()
  folder = args.workdir or tempfile.mkdtemp(prefix="bench_gpu_model_")
  cfg = config(args.cpu_dry_run)
  result = {
      "environment": gpu_timing.environment(),
      "params": export(cfg, folder),
  }
  print(f"exported {result['params']:,} parameters to {folder}", flush=True)
  result["logits"] = compare_logits(
      folder, args.logits_batch, args.logits_seq, torch
  )
  print(f"logits: {result['logits']}", flush=True)
  gpu_timing.write_json(args.out, "bench_gpu_model.json", result)
  if not args.no_timing:
    result["timing"] = timing(
        folder, args.out, args.cpu_dry_run, torch, deadline
    )
    models = result["timing"].get("result", {}).get("models", [])
    result["speedups"] = [speedups(m) for m in models]
    print(f"ours over transformers: {result['speedups']}", flush=True)
  path = gpu_timing.write_json(args.out, "bench_gpu_model.json", result)
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
