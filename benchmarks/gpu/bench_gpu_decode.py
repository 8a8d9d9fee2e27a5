"""Decoding on the GPU against the weight-read limit: a 2.4 B-parameter bf16
Mixtral-shaped MoE (8 layers of 8 experts of 2048 x 5632, top-2), bf16 and
int8 serving weights, at batch 1 and 8.

  copy      the device's copy bandwidth: a jitted `x * 2` over --copy-mib
            MiB of bf16 (read once, written once: 2 x bytes / seconds),
            and a jitted sum (read once) beside it
  steps     --steps greedy decode steps in one program
            (`decoding.decode_step` in a `fori_loop`, from an empty cache
            of `--steps + 2` slots: no dispatch between steps), less 2
            steps in the same program, over --steps - 2: one step's seconds
  limit     the bytes a step must read: every parameter but the routed
            experts and the token embedding, the embedding's B rows, the
            expected distinct experts of B tokens' top-k under uniform
            routing (E (1 - (1 - k / E)^B) of each layer's E), and the KV
            cache's slots; over the copy bandwidth: the least seconds a step
            takes. Reported: tokens/s, the limit's tokens/s and their ratio
            (the issue's bar: >= 0.80), the all-weights limit beside it
  int8      the same with `quantization.quantize_weights` int8 serving
            weights; its tokens/s over bf16's (bar: >= 1.6 at batch 1)

Medians of --rounds alternating rounds. Writes --out/bench_gpu_decode.json.

  python benchmarks/gpu/bench_gpu_decode.py --out DIR          # on the GPU
  python benchmarks/gpu/bench_gpu_decode.py --cpu-dry-run --out DIR
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import gpu_timing  # noqa: E402

# bf16 Mixtral layers of 2.4 B parameters in all (gpu_run's DECODE_SET).
MODEL = {
    "num_layers": 8,
    "num_heads": 16,
    "num_kv_heads": 8,
    "vocab_size": 32000,
    "emb_dim": 2048,
    "moe_mlp_dim": 5632,
}
TINY = {
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "emb_dim": 64,
    "moe_mlp_dim": 128,
}
VARIANTS = ("bf16", "int8")


def expected_experts(experts: int, top_k: int, batch: int) -> float:
  """Expected distinct experts B tokens pick, each its top-k of E uniformly:
  E (1 - (1 - k / E)^B)."""
  return experts * (1.0 - (1.0 - top_k / experts) ** batch)


def step_bytes(
    *,
    params_bytes: int,
    expert_bytes: int,
    embed_bytes: int,
    emb_dim: int,
    embed_itemsize: int,
    experts: int,
    top_k: int,
    batch: int,
    cache_bytes_per_row: int,
) -> dict[str, float]:
  """{"routed": the bytes a decode step must read, "all": every parameter
  and the cache}: see the module docstring's `limit`."""
  rest = params_bytes - expert_bytes - embed_bytes
  rows = batch * emb_dim * embed_itemsize
  routed = expert_bytes * expected_experts(experts, top_k, batch) / experts
  cache = batch * cache_bytes_per_row
  return {
      "routed": rest + rows + routed + cache,
      "all": params_bytes + cache,
  }


def limit_figures(step_s: float, batch: int, nbytes: dict, bandwidth: float):
  """tokens/s of a step of `step_s`, the limits' tokens/s (batch over
  bytes / bandwidth) and the step's fraction of each."""
  out = {"tokens_per_s": batch / step_s}
  for name, b in nbytes.items():
    least = b / bandwidth
    out[f"limit_{name}_tokens_per_s"] = batch / least
    out[f"fraction_of_{name}"] = least / step_s
  return out


def leaf_bytes(tree) -> int:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  return sum(
      leaf.size * np.dtype(leaf.dtype).itemsize
      for leaf in jax.tree.leaves(tree)
  )


def embedding_bytes(params) -> int:
  """Bytes of the token embedding table (the leaf named `embedding`)."""
  import jax  # noqa: PLC0415

  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return sum(
      leaf.size * leaf.dtype.itemsize
      for path, leaf in flat
      if str(getattr(path[-1], "key", "")) == "embedding"
  )


def bandwidth(mib: int, rounds: int) -> dict[str, float]:
  """Bytes/s of a device copy (read + write) and of a read alone."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  n = mib * 2**20 // 2
  x = jnp.ones((n,), jnp.bfloat16)
  copy = jax.jit(lambda a: a * 2)
  read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
  seconds, _ = gpu_timing.alternating_medians(
      {
          "copy": gpu_timing.jax_thunk(copy, x),
          "read": gpu_timing.jax_thunk(read, x),
      },
      rounds,
  )
  return {
      "copy_bytes_per_s": 2 * 2 * n / seconds["copy"],
      "read_bytes_per_s": 2 * n / seconds["read"],
  }


def decode_program(cfg, max_len: int):
  """jit of (variables, token [B], n) -> the last token after n greedy
  decode steps from an empty cache of `max_len` slots."""
  import jax  # noqa: PLC0415

  from linen_moe import decoding  # noqa: PLC0415

  @jax.jit
  def run(variables, token, n):
    cache = decoding.init_cache(cfg, token.shape[0], max_len)

    def body(_, carry):
      tok, cache = carry
      tok, _, cache = decoding.decode_step(cfg, variables, cache, tok)
      return tok, cache

    return jax.lax.fori_loop(0, n, body, (token, cache))[0]

  return run


def models(base, tiny: bool):
  """{variant: (config, variables)}: bf16 random weights and their int8
  serving conversion."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe import quantization  # noqa: PLC0415

  cfg = base.replace(
      **(TINY if tiny else MODEL), dtype="bfloat16", param_dtype="bfloat16"
  )
  tokens = jnp.zeros((1, 4), jnp.int32)
  variables = jax.jit(linen_moe.Decoder(cfg).init)(jax.random.key(0), tokens)
  variables = {"params": linen_moe_unbox(variables["params"])}
  int8_cfg, int8_vars = quantization.quantize_weights(
      cfg.replace(quantization="int8"), variables
  )
  return {"bf16": (cfg, variables), "int8": (int8_cfg, int8_vars)}


def linen_moe_unbox(tree):
  import flax.linen as nn  # noqa: PLC0415

  return nn.meta.unbox(tree)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--steps", type=int, default=34)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--copy-mib", type=int, default=2048)
  parser.add_argument("--budget-s", type=float, default=120)
  parser.add_argument("--out", default=".")
  parser.add_argument("--cpu-dry-run", action="store_true")
  args = parser.parse_args(argv)
  if args.cpu_dry_run:
    args.steps, args.rounds, args.copy_mib = 4, 1, 16
  import jax.numpy as jnp  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe import decoding  # noqa: PLC0415
  from linen_moe import quantization  # noqa: PLC0415

  deadline = gpu_timing.Deadline(args.budget_s)
  bw = bandwidth(args.copy_mib, max(args.rounds, 3))
  print(
      f"copy {bw['copy_bytes_per_s'] / 1e12:.2f} TB/s, read"
      f" {bw['read_bytes_per_s'] / 1e12:.2f} TB/s",
      flush=True,
  )
  built = models(linen_moe.load_model_config("mixtral_8x7b"), args.cpu_dry_run)
  max_len = args.steps + 2
  result = {
      "environment": gpu_timing.environment(),
      "settings": vars(args),
      "bandwidth": bw,
      "params": leaf_bytes(built["bf16"][1]["params"]) // 2,
      "batches": {},
  }
  # Every (batch, variant)'s program compiled at once; n is an argument,
  # so one program runs both step counts.
  jobs = {
      (b, v): (
          decode_program(cfg, max_len),
          (variables, jnp.ones((b,), jnp.int32), args.steps),
      )
      for b in args.batches
      for v, (cfg, variables) in built.items()
  }
  compiled, compile_errors = gpu_timing.compile_all(jobs, len(jobs))
  for b in args.batches:
    if deadline.passed():
      result["batches"][str(b)] = {"cut": "deadline"}
      continue
    thunks = {}
    for v, (variables, token, _) in (
        (v, jobs[b, v][1]) for v in built if (b, v) in compiled
    ):
      run = compiled[b, v]
      thunks[v] = gpu_timing.jax_thunk(run, variables, token, args.steps)
      thunks[f"{v}_short"] = gpu_timing.jax_thunk(run, variables, token, 2)
    seconds, errors = gpu_timing.alternating_medians(
        thunks, args.rounds, deadline
    )
    errors.update({v: e for (c, v), e in compile_errors.items() if c == b})
    record = {"errors": errors, "seconds": seconds}
    for v, (cfg, variables) in built.items():
      if v not in seconds or f"{v}_short" not in seconds:
        continue
      step_s = (seconds[v] - seconds[f"{v}_short"]) / (args.steps - 2)
      params = variables["params"]
      cache = sum(
          c["slots"] * c["bytes_per_token"]
          for c in decoding.cache_bytes_per_token(cfg, max_len).values()
      )
      nbytes = step_bytes(
          params_bytes=leaf_bytes(params),
          expert_bytes=quantization.expert_weight_bytes(variables),
          embed_bytes=embedding_bytes(params),
          emb_dim=cfg.moe.emb_dim,
          embed_itemsize=2,
          experts=cfg.moe.num_experts,
          top_k=cfg.moe.num_experts_per_tok,
          batch=b,
          cache_bytes_per_row=cache,
      )
      record[v] = {
          "step_s": step_s,
          "bytes": nbytes,
          **limit_figures(step_s, b, nbytes, bw["copy_bytes_per_s"]),
      }
      print(
          f"  batch {b} {v}: {record[v]['tokens_per_s']:.1f} tokens/s,"
          f" {record[v]['fraction_of_routed']:.2f} of the weight-read limit"
          f" ({record[v]['limit_routed_tokens_per_s']:.1f})",
          flush=True,
      )
    if "bf16" in record and "int8" in record:
      record["int8_over_bf16"] = (
          record["int8"]["tokens_per_s"] / record["bf16"]["tokens_per_s"]
      )
    result["batches"][str(b)] = record
    path = gpu_timing.write_json(args.out, "bench_gpu_decode.json", result)
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
