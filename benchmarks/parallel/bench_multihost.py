"""One process x 8 devices vs 2 processes x 4 devices: step time and the
collectives that cross processes.

Runs itself as each group of local processes (as `linen-moe launch` runs
`train`: coordinator flags on a free port, each process on its own simulated
CPU devices; one failure stops the group): every process builds the sharded
training
of the reference decoder on the global mesh, feeds its shards of the same
global batches, compiles one step and times `--steps` more; process 0
reports the median step time and, from the compiled HLO, each collective by
(op, mesh axes) with whether its device groups span processes.

  python benchmarks/parallel/bench_multihost.py
  python benchmarks/parallel/bench_multihost.py --mesh expert=8 \
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
import pathlib
import statistics
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import linen_moe
from linen_moe import distributed
from linen_moe import hlo
from linen_moe import sharding
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer

from common import frontends

GROUPS = ((1, 8), (2, 4))  # (processes, devices per process)
TIMEOUT_S = 1800


def child(args: argparse.Namespace) -> None:
  """One process of a group: time the step; process 0 prints a JSON line."""
  distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  cfg = linen_moe.load_model_config(
      args.config, **linen_moe.MATMUL_PATHS[args.path]
  )
  mesh = sharding.make_mesh(args.mesh)
  run = frontends.sharded_training(
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
  summary = hlo.collective_summary(text, process_of)
  if distributed.is_main_process():
    print(
        json.dumps({
            "step_ms": 1e3 * statistics.median(times),
            "loss": float(metrics["loss"]),
            "collectives": summary,
        }),
        flush=True,
    )


def run_group(processes: int, devices: int, argv: list[str]) -> str:
  """Process 0's output, after `processes` processes of this script (each on
  `devices` simulated CPU devices, joined by `linen_moe.distributed.launch`)
  ran to the end; SystemExit with the failing process's last lines when one
  fails or the group runs past `TIMEOUT_S` (the others are then stopped)."""
  out, err = io.StringIO(), io.StringIO()
  command = [sys.executable, os.path.abspath(__file__), "--child", *argv]
  result = distributed.launch(
      command,
      processes,
      devices_per_process=devices,
      timeout_s=TIMEOUT_S,
      out=out,
      err=err,
  )
  if result.code:
    raise SystemExit(f"{processes} x {devices}: {err.getvalue()}")
  return out.getvalue()


def parent(args: argparse.Namespace, argv: list[str]) -> None:
  results = {}
  for processes, devices in GROUPS:
    out = run_group(processes, devices, argv)
    lines = [x for x in out.splitlines() if x.startswith("{")]
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
