"""The command lines of the GPU benchmarks' steps in `gpu_run.STEPS`
(issue 63's measurements): each takes the step's context (`gpu_run.Context`:
`python`, `out`, `dry`, `budget_s`) and returns its command lines.

Each script stops itself at `--budget-s`, `MARGIN_S` before the step's
limit (a run cut by its own deadline still writes its JSON; one killed at
the limit keeps only what it wrote before).
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPU = "benchmarks/gpu"
MARGIN_S = 25
# JAX takes 75 % of the GPU by default: leave torch, in the same process,
# its share.
TORCH_ENV = (("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5"),)
# bench_gpu_model.py's own process exports and compares, untimed, then
# starts bench_model.py (JAX) and its transformers peer: it takes GPU
# memory as it goes and gives it back (the platform allocator), leaving the
# child JAX's usual pool (`CHILD_ENV`).
MODEL_ENV = (
    ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform"),
    ("LINEN_MOE_PEER_DEVICE", "cuda"),
)


def _script(ctx, name: str, *args: str) -> list[list[str]]:
  budget = max(ctx.budget_s - MARGIN_S, 10)
  dry = ("--cpu-dry-run",) if ctx.dry else ()
  return [[
      ctx.python,
      str(ROOT / GPU / name),
      *dry,
      *args,
      "--budget-s",
      str(budget),
      "--out",
      str(ctx.out),
  ]]


def gmm(ctx) -> list[list[str]]:
  return _script(ctx, "bench_gpu_gmm.py")


def layer_torch(ctx) -> list[list[str]]:
  shapes = ("--shapes", "8x2048x5632") if ctx.dry else ()
  return _script(ctx, "bench_vs_torch.py", *shapes)


def fp8(ctx) -> list[list[str]]:
  return _script(ctx, "bench_gpu_fp8.py")


def decode_limit(ctx) -> list[list[str]]:
  return _script(ctx, "bench_gpu_decode.py")


def model_torch(ctx) -> list[list[str]]:
  # The model's own timing (bench_model.py in a child) runs past a dry
  # run's limit on two shared cores: the dry run exports and compares.
  timing = ("--no-timing",) if ctx.dry else ()
  return _script(ctx, "bench_gpu_model.py", *timing)


WHAT = {
    "gmm": (
        "the expert matmul fwd+bwd: every GPU route of the registry,"
        " blocked and torch._grouped_mm beside dense cuBLAS (bench_gpu_gmm.py)"
    ),
    "layer_torch": (
        "the MoE layer fwd+bwd: ours beside dense, torchtitan's layer on"
        " torch._grouped_mm and transformers' blocks (bench_vs_torch.py)"
    ),
    "fp8": (
        "the fp8 train step against bf16's at Mixtral dimensions, and"
        " which contractions run in fp8 (bench_gpu_fp8.py)"
    ),
    "decode_limit": (
        "decode at batch 1 and 8 against the weight-read limit,"
        " bf16 and int8 serving (bench_gpu_decode.py)"
    ),
    "model_torch": (
        "the whole model (Qwen3-MoE-shaped, 1.76 B) against"
        " transformers, same exported weights: logits, train, decode"
        " (bench_gpu_model.py)"
    ),
}
