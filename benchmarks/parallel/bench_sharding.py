"""Data parallel vs expert parallel, both matmul paths, on simulated devices.

For each (path, mesh) it builds the reference decoder sharded on the mesh
(`ShardedTraining`), compiles one training step and reports, side by side:
the median step time, the per-device peak memory of the compiled step
(`memory_analysis()`: arguments + outputs + temporaries - aliased), the live
per-device bytes of the train state and of the routed experts' weights, and
how many collectives of each kind the compiled step holds.

  python benchmarks/parallel/bench_sharding.py
  python benchmarks/parallel/bench_sharding.py --meshes data=8 expert=8 \
      data=2,expert=4 --batch 32 --seq 64

Devices are simulated on the CPU (`--xla_force_host_platform_device_count`,
set here before jax is imported), so step times measure the partitioned
program sharing a few cores, not a real interconnect; memory and collective
counts are what a real mesh would get.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

DEVICES = 8
if "jax" not in sys.modules:
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={DEVICES}"
  )

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe import Decoder  # noqa: E402
from linen_moe import hlo  # noqa: E402
from linen_moe import load_model_config  # noqa: E402
from linen_moe import sharding  # noqa: E402
from linen_moe.training import MarkovData  # noqa: E402
from linen_moe.training import ShardedTraining  # noqa: E402
from linen_moe.training import default_optimizer  # noqa: E402

MIB = 2**20
SHORT = {
    "all-to-all": "a2a",
    "all-gather": "ag",
    "reduce-scatter": "rs",
    "all-reduce": "ar",
    "collective-permute": "cp",
}


def device0_bytes(tree) -> int:
  """Bytes of `tree`'s arrays that live on the first device."""
  device = jax.devices()[0]
  return sum(
      shard.data.nbytes
      for leaf in jax.tree.leaves(tree)
      for shard in leaf.addressable_shards
      if shard.device == device
  )


def measure(cfg, mesh_spec: str, batch: int, seq: int, steps: int) -> dict:
  model = Decoder(cfg)
  run = ShardedTraining(
      model, default_optimizer(), sharding.make_mesh(mesh_spec)
  )
  data = MarkovData(cfg.vocab_size).batches(batch, seq)
  tokens = jnp.asarray(next(data))
  state = run.init(tokens, jax.random.key(0))
  start = time.perf_counter()
  compiled = run.lower(state, tokens, jax.random.key(1)).compile()
  compile_s = time.perf_counter() - start
  mem = compiled.memory_analysis()
  peak = (
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      + mem.temp_size_in_bytes
      - mem.alias_size_in_bytes
  )
  moe = state.params["layers"]["moe"]
  result = {
      "compile_s": compile_s,
      "peak_mib": peak / MIB,
      "temp_mib": mem.temp_size_in_bytes / MIB,
      "state_mib": device0_bytes(state) / MIB,
      "experts_mib": (
          device0_bytes([moe[n] for n in ("wi_0", "wi_1", "wo")]) / MIB
      ),
      "collectives": dict(
          collections.Counter(
              c.opcode for c in hlo.collectives(compiled.as_text())
          )
      ),
  }
  times = []
  for i in range(steps + 1):
    batch_tokens = jnp.asarray(next(data))
    start = time.perf_counter()
    state, metrics = compiled(state, batch_tokens, jax.random.key(i))
    jax.block_until_ready(metrics)
    if i:  # the first call warms up
      times.append(time.perf_counter() - start)
  result["step_ms"] = 1e3 * float(np.median(times))
  return result


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="tiny_mixtral")
  p.add_argument("--meshes", nargs="+", default=["data=8", "expert=8"])
  p.add_argument("--paths", nargs="+", default=["sparse", "dense"])
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--emb", type=int, default=128)
  p.add_argument("--mlp", type=int, default=512)
  p.add_argument("--experts", type=int, default=8)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--steps", type=int, default=5)
  args = p.parse_args(argv)
  print(
      f"{args.config}: emb {args.emb}, mlp {args.mlp}, {args.experts} experts,"
      f" {args.layers} layers, batch {args.batch} x seq {args.seq}, "
      f"{jax.device_count()} simulated {jax.devices()[0].platform} devices"
  )
  header = (
      f"{'path':<7}{'mesh':<17}{'step ms':>9}{'compile s':>11}"
      f"{'peak/dev MiB':>14}{'temp/dev':>10}{'state/dev':>11}"
      f"{'experts/dev':>13}  collectives"
  )
  print(header)
  for path in args.paths:
    cfg = load_model_config(
        args.config,
        sparse_matmul=path == "sparse",
        capacity_factor=0.0,
        emb_dim=args.emb,
        moe_mlp_dim=args.mlp,
        num_experts=args.experts,
        num_layers=args.layers,
    )
    for spec in args.meshes:
      r = measure(cfg, spec, args.batch, args.seq, args.steps)
      ops = " ".join(f"{SHORT[k]}={v}" for k, v in r["collectives"].items())
      print(
          f"{path:<7}{spec:<17}{r['step_ms']:>9.1f}{r['compile_s']:>11.1f}"
          f"{r['peak_mib']:>14.2f}{r['temp_mib']:>10.2f}"
          f"{r['state_mib']:>11.2f}{r['experts_mib']:>13.2f}  {ops}",
          flush=True,
      )


if __name__ == "__main__":
  main()
