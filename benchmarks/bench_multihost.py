"""One process x 8 devices vs 2 processes x 4 devices: step time and the
collectives that cross processes.

Runs itself as each group (through `linen_moe_cli.launch.run_group`, the
machinery of `linen-moe launch`): every process builds the sharded training
of the reference decoder on the global mesh, feeds its shards of the same
global batches, compiles one step and times `--steps` more; process 0
reports the median step time and, from the compiled HLO, each collective by
(op, mesh axes) with whether its device groups span processes.

  PYTHONPATH=. python benchmarks/bench_multihost.py
  PYTHONPATH=. python benchmarks/bench_multihost.py --mesh expert=8 \
      --frontend nnx --path dense --steps 20

All devices are simulated on this machine's CPU cores, so the step times
compare gloo (between processes) with in-process collectives on shared
cores, not a network; which collectives cross is what a real cluster gets.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time

import jax

from linen_moe import distributed
from linen_moe import sharding
from linen_moe import testing
from linen_moe._src.config.files import load_model_config
from linen_moe._src.config.moe_config import MATMUL_PATHS as PATHS
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe_cli import launch
from linen_moe_cli import train_job

GROUPS = ((1, 8), (2, 4))  # (processes, devices per process)


def child(args: argparse.Namespace) -> None:
  """One process of a group: time the step; process 0 prints a JSON line."""
  distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  cfg = load_model_config(args.config, **PATHS[args.path])
  mesh = sharding.make_mesh(args.mesh)
  run = train_job.sharded_training(
      args.frontend, cfg, default_optimizer(), mesh
  )
  batches = MarkovData(cfg.vocab_size).batches(args.batch, args.seq)
  token_sharding = run.token_sharding()

  def feed():
    batch = next(batches)
    return distributed.global_array(batch.shape, token_sharding, batch)

  tokens, rng = feed(), jax.random.key(0)
  state = run.init(tokens, rng)
  text = run.lower(state, tokens, rng).compile().as_text()
  state, metrics = run.step(state, tokens, rng)  # compiles
  jax.block_until_ready(metrics)
  times = []
  for i in range(args.steps):
    tokens = feed()
    start = time.perf_counter()
    state, metrics = run.step(state, tokens, jax.random.fold_in(rng, i))
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  process_of = [d.process_index for d in mesh.devices.flat]
  summary = testing.collective_summary(text, process_of)
  if distributed.is_main_process():
    print(
        json.dumps({
            "step_ms": 1e3 * statistics.median(times),
            "loss": float(metrics["loss"]),
            "collectives": summary,
        }),
        flush=True,
    )


def parent(args: argparse.Namespace, argv: list[str]) -> None:
  results = {}
  for processes, devices in GROUPS:
    commands = [
        [sys.executable, os.path.abspath(__file__), "--child", *argv, *flags]
        for flags in launch.process_flags(processes)
    ]
    out = io.StringIO()
    group = launch.run_group(
        commands, launch.child_env(devices), timeout_s=1800, out=out
    )
    if group.code:
      sys.exit(group.code)
    lines = [x for x in out.getvalue().splitlines() if x.startswith("{")]
    results[(processes, devices)] = json.loads(lines[-1])
  base = results[GROUPS[0]]["step_ms"]
  print(
      f"mesh {args.mesh}, {args.frontend}, {args.path} path, batch "
      f"{args.batch} x {args.seq}, median of {args.steps} steps"
  )
  print(f"{'processes x devices':<22}{'step ms':>10}{'ratio':>8}{'loss':>10}")
  for (processes, devices), r in results.items():
    print(
        f"{f'{processes} x {devices}':<22}{r['step_ms']:>10.1f}"
        f"{r['step_ms'] / base:>8.2f}{r['loss']:>10.4f}"
    )
  print("collectives of the step on 2 processes (op over mesh axes: count):")
  for op, axes, crosses, n in results[GROUPS[1]]["collectives"]:
    where = "crosses processes" if crosses else "inside each process"
    print(f"  {op} over {axes}: {n}  {where}")


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mesh", default="data=2,expert=4")
  parser.add_argument("--config", default="tiny_mixtral")
  parser.add_argument("--frontend", choices=("linen", "nnx"), default="linen")
  parser.add_argument("--path", choices=("sparse", "dense"), default="sparse")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq", type=int, default=32)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", help=argparse.SUPPRESS)
  parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    child(args)
  else:
    parent(args, argv)


if __name__ == "__main__":
  main(sys.argv[1:])
