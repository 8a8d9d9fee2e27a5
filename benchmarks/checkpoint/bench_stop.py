"""How long a stop takes: SIGTERM to exit of `linen-moe train`, and the
save's share of it at full size.

1. For each tiny config, `linen-moe train --checkpoint-dir DIR` on one
   process (`--processes 2`: a local group over gloo, one CPU device
   each) is sent SIGTERM at a step past compiling; it finishes the step,
   agrees on it, saves it and exits 143. Printed: seconds from the signal
   to the exit of the last process (a scheduler's grace period is ~30 s),
   the step it stopped after, and the size of that checkpoint on disk.
2. This machine's write rate of a checkpoint (`checkpoint.Checkpoints`,
   a synchronous save of `--write-mib` MiB of float32, to commit).
3. For full-size configs, the checkpoint bytes a host writes (the train
   state's checkpoint tree, from `jax.eval_shape`: params, optimizer
   moments, fp8 and routing state, sharded over `--hosts` hosts) and the
   seconds that takes at the rate of 2: the save's share of a stop.

  python benchmarks/checkpoint/bench_stop.py
  python benchmarks/checkpoint/bench_stop.py --processes 2 \
      --configs tiny_mixtral --full mixtral_8x7b --hosts 2
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import checkpoint
from linen_moe import load_model_config
from linen_moe import testing
from linen_moe.training import LinenFrontend
from linen_moe.training import default_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
MIB = 1024**2
GIB = 1024**3


def directory_bytes(path: str) -> int:
  return sum(
      os.path.getsize(os.path.join(root, name))
      for root, _, names in os.walk(path)
      for name in names
  )


def _rows(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    return f.read().count("\n")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def stop_time(config: str, processes: int, workdir: str) -> dict:
  """SIGTERM to `linen-moe train --config config` after its 3rd step's
  row: seconds to the last process's exit, the step, the checkpoint's
  bytes."""
  run_dir = os.path.join(workdir, f"{config}_{processes}")
  argv = [sys.executable, "-m", "linen_moe_cli.main", "train"]
  argv += ["--config", config, "--steps", "100000", "--save-every", "100000"]
  argv += ["--checkpoint-dir", run_dir, "--no-progress"]
  group = [[]]
  if processes > 1:
    port = _free_port()
    group = [
        ["--coordinator", f"localhost:{port}"]
        + ["--num-processes", str(processes), "--process-id", str(i)]
        for i in range(processes)
    ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if processes > 1:
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  procs = [
      subprocess.Popen(
          argv + flags,
          cwd=ROOT,
          env=env,
          stdout=subprocess.DEVNULL,
          stderr=subprocess.PIPE,
          text=True,
      )
      for flags in group
  ]
  try:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    while _rows(metrics) < 3:
      if any(p.poll() is not None for p in procs):
        raise RuntimeError(procs[0].communicate()[1][-2000:])
      time.sleep(0.01)
    sent = time.monotonic()
    for p in procs:
      p.send_signal(signal.SIGTERM)
    errs = [p.communicate(timeout=300)[1] for p in procs]
    seconds = time.monotonic() - sent
  finally:
    for p in procs:
      p.kill()
  codes = [p.returncode for p in procs]
  if codes != [143] * processes:
    raise RuntimeError(f"exit statuses {codes}: {errs[0][-2000:]}")
  with checkpoint.Checkpoints(run_dir, create=False) as ckpts:
    step = ckpts.latest_step()
  size = directory_bytes(os.path.join(run_dir, str(step)))
  return {"seconds": seconds, "step": step, "bytes": size}


def write_rate(mib: int, workdir: str) -> float:
  """Bytes per second of a synchronous `Checkpoints.save` of `mib` MiB of
  float32, to its commit (the best of 3)."""
  rows = mib * MIB // (4 * 1024)
  tree = {
      f"w{i}": jnp.asarray(np.random.default_rng(i).random((rows // 4, 1024)))
      for i in range(4)
  }
  jax.block_until_ready(tree)
  nbytes = sum(x.nbytes for x in tree.values())
  best = float("inf")
  for attempt in range(3):
    path = os.path.join(workdir, f"rate_{attempt}")
    with checkpoint.Checkpoints(path, async_save=False) as ckpts:
      start = time.perf_counter()
      ckpts.save(1, tree, {})
      ckpts.wait_until_finished()
      best = min(best, time.perf_counter() - start)
    shutil.rmtree(path, ignore_errors=True)
  return nbytes / best


def checkpoint_bytes(config: str) -> int:
  """The bytes of a train state's checkpoint tree of `config` (the Linen
  front end, the default optimizer), from shapes only."""
  cfg = load_model_config(config)
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)

  def init(tokens):
    return LinenFrontend.init(
        cfg, default_optimizer(), tokens, jax.random.key(0)
    )

  state = jax.eval_shape(init, tokens)
  tree = LinenFrontend.checkpoint_tree(state)
  return sum(
      x.size * np.dtype(x.dtype).itemsize
      for x in jax.tree.leaves(tree)
      if hasattr(x, "size") and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--configs",
      default=",".join(sorted(testing.TINY_CONFIGS)),
      help="tiny configs to stop, comma-separated",
  )
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--write-mib", type=int, default=256)
  parser.add_argument("--full", default="mixtral_8x7b,qwen3_30b_a3b,gemma4_26b")
  parser.add_argument(
      "--hosts",
      type=int,
      default=2,
      help="hosts the full-size state is sharded over (e.g. a v5p-16: 2)",
  )
  args = parser.parse_args()
  workdir = tempfile.mkdtemp()
  try:
    print(f"SIGTERM to exit, {args.processes} process(es), CPU:")
    for config in args.configs.split(","):
      r = stop_time(config, args.processes, workdir)
      print(
          f"  {config:<22} {r['seconds']:6.2f} s  (stopped after step "
          f"{r['step']}; checkpoint {r['bytes'] / MIB:7.2f} MiB)"
      )
    rate = write_rate(args.write_mib, workdir)
    print(f"checkpoint write rate here: {rate / MIB:.0f} MiB/s")
    print(f"full size, sharded over {args.hosts} hosts:")
    for config in filter(None, args.full.split(",")):
      per_host = checkpoint_bytes(config) / args.hosts
      print(
          f"  {config:<22} {per_host / GIB:8.1f} GiB a host: "
          f"{per_host / rate:7.0f} s at {rate / MIB:.0f} MiB/s"
      )
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  main()
