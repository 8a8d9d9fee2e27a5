"""What `ModelConfig.remat` trades: device memory against step time.

  python benchmarks/model/bench_remat.py memory [--seq 8192] [--layers 2 4]
      [--target tpu:v6e-1]
  python benchmarks/model/bench_remat.py time [--seq 2048] [--steps 5]

`memory`: compiles (never runs) the train step's gradient of the
Qwen3-30B-A3B layer shape (`qwen3_30b_a3b`: emb 2048, 32 heads of 128, 4
key/value heads, 128 experts top-8 of width 768, bfloat16), batch 1 at
`--seq` tokens, blockwise attention, the stack scanned as a loop of one
layer per iteration (`scan_unroll=1`, what a deep stack compiles to; in
line, each layer's weight gradients are buffers of their own until they
are stacked, 1.2-2.4 GB of temporaries per layer of this shape whatever the
policy), with each number of `--layers`, for each policy, and prints the
compiled program's temporary bytes
(`memory_analysis().temp_size_in_bytes`, host temporaries apart) and the
growth per layer between the first and the last layer count. The carried
activation of one layer is batch x seq x emb x 2 bytes (34 MB at 8192).
`--target` compiles for one device of a planning target instead of this
host (`linen_moe.planning`: a TPU chip through libtpu, e.g. `tpu:v6e-1`),
where `offload`'s host memory is not the device's.

`time`: the whole-model benchmark's train step (`common/whole_model.Ours`,
the Mixtral shape, batch `--batch` x `--seq`) under each policy, built and
timed in one process, alternating policies each round, and prints the
median step seconds of each and its ratio to "none".
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

import linen_moe
from linen_moe import planning
from linen_moe import training

from common import whole_model

POLICIES = ("none", "full", "save_experts", "save_attention_experts", "offload")
GB = 1e9


def _temp_bytes(cfg, seq: int, mesh=None) -> tuple[int, int]:
  """(device, host) temporary bytes of the compiled loss gradient of `cfg`
  at batch 1 x `seq`: the variables are abstract, nothing runs. Under
  `mesh` (one device of a target) it is traced and compiled for it."""
  model = linen_moe.Decoder(cfg)
  variables = jax.eval_shape(
      lambda: linen_moe.sharding.unbox(
          model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
      )
  )
  tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  if mesh is not None:  # inputs without the target's sharding compile here
    placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    variables, tokens = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed),
        (variables, tokens),
    )

  def loss(params, tokens):
    logits, aux = model.apply({**variables, "params": params}, tokens)
    return training.decoder_loss(logits, aux, tokens)[0]

  context = (
      contextlib.nullcontext()
      if mesh is None
      else linen_moe.sharding.mesh_context(mesh)
  )
  with context:
    compiled = (
        jax.jit(jax.grad(loss)).lower(variables["params"], tokens).compile()
    )
  analysis = compiled.memory_analysis()
  return analysis.temp_size_in_bytes, analysis.host_temp_size_in_bytes


def memory(args) -> None:
  base = linen_moe.load_model_config(
      "qwen3_30b_a3b", attention=args.attention, vocab_size=args.vocab
  )
  lo, hi = min(args.layers), max(args.layers)
  mesh = None
  if args.target:
    target = planning.parse_target(args.target)
    planning.prepare_process(target)
    devices = planning.target_devices(target)[:1]
    mesh = linen_moe.sharding.make_mesh("data=1", devices)
  print(
      f"qwen3_30b_a3b layer shape, batch 1 x {args.seq}, bf16, attention"
      f" {args.attention}, vocab {args.vocab}, a loop of one layer per"
      " iteration; compiled temp bytes (GB) of the loss gradient, for"
      f" {args.target or jax.default_backend()}"
  )
  head = "".join(f" {f'{n} layers':>10}" for n in args.layers)
  print(f"{'remat':<24}{head} {'per layer':>10} {'host':>8}")
  for remat in args.policies:
    temps, host = [], 0
    for layers in args.layers:
      cfg = base.replace(num_layers=layers, remat=remat, scan_unroll=1)
      device, host = _temp_bytes(cfg, args.seq, mesh)
      temps.append(device)
    growth = (temps[-1] - temps[0]) / max(hi - lo, 1)
    cells = "".join(f" {t / GB:>10.3f}" for t in temps)
    print(f"{remat:<24}{cells} {growth / GB:>10.3f} {host / GB:>8.3f}")


def time_policies(args) -> None:
  cfg = whole_model.model_config(whole_model.MIXTRAL_SHAPE)
  runs = {}
  for remat in args.policies:
    ours = whole_model.Ours(cfg.replace(remat=remat), None)
    ours.setup_train(args.batch, args.seq)
    ours.train()  # warm
    runs[remat] = (ours, [])
  for _ in range(args.steps):
    for ours, times in runs.values():
      times.append(ours.train())
  print(
      f"{whole_model.MIXTRAL_SHAPE} train step, batch {args.batch} x"
      f" {args.seq}, median of {args.steps} (policies alternating)"
  )
  base = statistics.median(runs["none"][1]) if "none" in runs else None
  for remat, (_, times) in runs.items():
    step = statistics.median(times)
    ratio = f" {step / base:>5.2f}x" if base else ""
    print(f"{remat:<24} {step:>8.3f}s{ratio}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="what", required=True)
  mem = sub.add_parser("memory")
  mem.add_argument("--seq", type=int, default=8192)
  mem.add_argument("--layers", type=int, nargs="+", default=[2, 4])
  mem.add_argument("--attention", default="blockwise")
  mem.add_argument("--vocab", type=int, default=151936)
  mem.add_argument("--policies", nargs="+", default=list(POLICIES))
  mem.add_argument(
      "--target", help="compile for one device of it, e.g. tpu:v6e-1"
  )
  tim = sub.add_parser("time")
  tim.add_argument("--seq", type=int, default=2048)
  tim.add_argument("--batch", type=int, default=1)
  tim.add_argument("--steps", type=int, default=5)
  tim.add_argument("--policies", nargs="+", default=list(POLICIES))
  args = parser.parse_args()
  memory(args) if args.what == "memory" else time_policies(args)


if __name__ == "__main__":
  main()
