"""Multi-process checks: one process of a group joined by `jax.distributed`.

`python -m tests.multihost_worker '<json list of jobs>' [--coordinator
HOST:PORT --num-processes N --process-id I] [--heartbeat-timeout S]` runs
each job in order (every process runs the same jobs) and process 0 prints
one JSON line per finished job: {"job": index, "result": ...}. Without the process flags it runs alone,
on whatever devices XLA_FLAGS gives it: the single-process reference.
`tests/test_multihost.py` starts the groups through `linen_moe_cli.launch`.

Jobs:
  train        `linen-moe train <argv>` in this process; its printed lines.
  bad_mesh     the error of `train --mesh <mesh>` (a mesh of the wrong size).
  collectives  the compiled sharded step's collectives on `mesh`: for each
               (op, mesh axes), how many, and whether they cross processes.
  spin         an all-reduce every 0.2 s, forever; process `victim` kills
               itself with SIGKILL after step `die_at`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import time

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from linen_moe import distributed
from linen_moe import sharding
from linen_moe import testing
from linen_moe._src.config import PATHS
from linen_moe._src.config import load_model_config
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe_cli import main as cli_main
from linen_moe_cli import train_job
from linen_moe_cli.commands import train as train_command
from linen_moe_cli.options import TrainOptions


def train(job: dict) -> dict:
  args = cli_main.build_parser().parse_args(["train", *job["argv"]])
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = train_command.train_and_report(TrainOptions.from_args(args))
  return {"exit_code": code, "stdout": out.getvalue()}


def bad_mesh(job: dict) -> dict:
  try:
    train({"argv": ["--mesh", job["mesh"], "--steps", "1", "--no-progress"]})
  except ValueError as e:
    return {"error": str(e)}
  return {"error": None}


def collectives(job: dict) -> dict:

  cfg = load_model_config("tiny_mixtral", **PATHS[job.get("path", "sparse")])
  mesh = sharding.make_mesh(job["mesh"])
  run = train_job.sharded_training(
      job.get("frontend", "linen"),
      cfg,
      default_optimizer(),
      mesh,
  )
  batch = next(MarkovData(cfg.vocab_size).batches(8, 8))
  tokens = distributed.global_array(batch.shape, run.token_sharding(), batch)
  state = run.init(tokens, jax.random.key(0))
  text = run.lower(state, tokens, jax.random.key(1)).compile().as_text()
  process_of = [d.process_index for d in mesh.devices.flat]
  summary = testing.collective_summary(text, process_of)
  return {
      "process_of": process_of,
      "counts": summary,
  }


def spin(job: dict) -> dict:

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  x = np.ones((jax.device_count(),), np.float32)
  array = distributed.global_array(x.shape, NamedSharding(mesh, P("data")), x)
  total = jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(mesh, P()))
  for i in range(10**9):
    value = float(total(array))
    if distributed.is_main_process():
      print(f"step {i} sum {value}", flush=True)
    if jax.process_index() == job["victim"] and i == job["die_at"]:
      os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
  return {}


CHECKS = {
    "train": train,
    "bad_mesh": bad_mesh,
    "collectives": collectives,
    "spin": spin,
}


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("jobs")
  parser.add_argument("--coordinator")
  parser.add_argument("--num-processes", type=int)
  parser.add_argument("--process-id", type=int)
  parser.add_argument("--heartbeat-timeout", type=int, default=30)
  args = parser.parse_args(argv)

  distributed.initialize(
      args.coordinator,
      args.num_processes,
      args.process_id,
      heartbeat_timeout_s=args.heartbeat_timeout,
  )
  for i, job in enumerate(json.loads(args.jobs)):
    result = CHECKS[job["check"]](job)
    if distributed.is_main_process():
      print(json.dumps({"job": i, "result": result}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
