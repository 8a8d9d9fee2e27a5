"""Multi-process checks: one process of a group joined by `jax.distributed`.

`python -m tests.cli_multihost_worker '<json list of jobs>' [--coordinator
HOST:PORT --num-processes N --process-id I] [--heartbeat-timeout S]` runs
each job in order (every process runs the same jobs) and process 0 prints
one JSON line per finished job: {"job": index, "result": ...}. Without the process flags it runs alone,
on whatever devices XLA_FLAGS gives it: the single-process reference.
`tests/cli/test_cli_launch.py` starts the groups through `linen_moe.distributed.launch`'s machinery.

Jobs:
  train        `linen-moe train <argv>` in this process; its printed lines.
  bad_mesh     the error of `train --mesh <mesh>` (a mesh of the wrong size).
  collectives  the compiled sharded step's collectives on `mesh`: for each
               (op, mesh axes), how many, and whether they cross processes.
  spin         an all-reduce every 0.2 s, forever; process `victim` kills
               itself with SIGKILL after step `die_at`.
  layer        one sparse `RoutedMoE` layer's loss and gradients (params,
               fp8 state, input) on the global `mesh` with `expert_parallel`,
               in each of `quantizations`, against the one-device layer
               computed in this process; and which collectives of the
               compiled program cross processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import distributed
from linen_moe import hlo
from linen_moe import load_model_config
from linen_moe import load_moe_config
from linen_moe import sharding
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe_cli import main as cli_main
from linen_moe_cli import options
from linen_moe_cli.commands import train as train_command
import nnx_adapter
from tests import workers


def train(job: dict) -> dict:
  args = cli_main.build_parser().parse_args(["train", *job["argv"]])
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = train_command.train_and_report(
        options.run_options(args), args.frontend
    )
  return {"exit_code": code, "stdout": out.getvalue()}


def bad_mesh(job: dict) -> dict:
  try:
    train({"argv": ["--mesh", job["mesh"], "--steps", "1", "--no-progress"]})
  except ValueError as e:
    return {"error": str(e)}
  return {"error": None}


def collectives(job: dict) -> dict:

  cfg = load_model_config(
      "tiny_mixtral", **MATMUL_PATHS[job.get("path", "sparse")]
  )
  mesh = sharding.make_mesh(job["mesh"])
  run = nnx_adapter.frontend(job.get("frontend", "linen")).sharded(
      cfg, default_optimizer(), mesh
  )
  batch = next(MarkovData(cfg.vocab_size).batches(8, 8))
  tokens = distributed.global_array(batch.shape, run.token_sharding(), batch)
  state = run.init(tokens, jax.random.key(0))
  text = run.lower(state, tokens, jax.random.key(1)).compile().as_text()
  process_of = [d.process_index for d in mesh.devices.flat]
  summary = hlo.collective_summary(text, process_of)
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


def _max_abs(tree) -> float:
  return max(
      (float(np.max(np.abs(x))) for x in jax.tree.leaves(tree)), default=0.0
  )


def layer(job: dict) -> dict:
  from linen_moe import RoutedMoE  # noqa: PLC0415
  from linen_moe.variables import OVERWRITE_WITH_GRADIENT  # noqa: PLC0415

  mesh = sharding.make_mesh(job["mesh"])
  replicated = NamedSharding(mesh, P())
  out = {"process_of": [d.process_index for d in mesh.devices.flat]}
  for mode in job["quantizations"]:
    cfg = load_moe_config(
        "tiny_mixtral",
        quantization=mode,
        expert_parallel=job["expert_parallel"],
        **MATMUL_PATHS["sparse"],
    )
    moe = RoutedMoE(cfg)
    x = jax.random.normal(jax.random.key(3), (8, 8, cfg.emb_dim))
    host = jax.device_get(sharding.unbox(moe.init(jax.random.key(0), x)))
    host = {
        "params": host["params"],
        "fp8": host.get(OVERWRITE_WITH_GRADIENT, {}),
    }
    host["x"] = np.asarray(x)

    def loss(params, fp8, x, moe=moe):
      variables = {"params": params, OVERWRITE_WITH_GRADIENT: fp8}
      y, _ = moe.apply(variables, x, rngs={"params": jax.random.key(4)})
      return jnp.sum(y**2)

    step = jax.value_and_grad(loss, (0, 1, 2))
    args = (host["params"], host["fp8"], host["x"])
    ref_loss, ref_grads = jax.jit(step)(*args)  # this process's device
    ref_grads = jax.device_get(ref_grads)
    global_args = jax.tree.map(
        lambda a: distributed.global_array(a.shape, replicated, np.asarray(a)),
        args,
    )
    with sharding.mesh_context(mesh):
      compiled = (
          jax.jit(step, out_shardings=replicated).lower(*global_args).compile()
      )
      value, grads = compiled(*global_args)
    local = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), grads)
    errs = [
        max(
            (
                float(np.max(np.abs(np.asarray(g, np.float64) - r)))
                for g, r in zip(
                    jax.tree.leaves(a), jax.tree.leaves(b), strict=True
                )
            ),
            default=0.0,
        )
        for a, b in zip(local, ref_grads, strict=True)
    ]
    out[mode] = {
        "loss_err": abs(
            float(np.asarray(value.addressable_data(0))) - float(ref_loss)
        ),
        "loss_scale": abs(float(ref_loss)),
        "grad_errs": errs,
        "grad_scales": [_max_abs(g) for g in ref_grads],
        "collectives": hlo.collective_summary(
            compiled.as_text(), out["process_of"]
        ),
    }
  return out


CHECKS = {
    "layer": layer,
    "train": train,
    "bad_mesh": bad_mesh,
    "collectives": collectives,
    "spin": spin,
}


def main(argv: list[str]) -> None:
  args = workers.join_group(argv, "jobs")
  for i, job in enumerate(json.loads(args.jobs)):
    result = CHECKS[job["check"]](job)
    if distributed.is_main_process():
      print(json.dumps({"job": i, "result": result}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
