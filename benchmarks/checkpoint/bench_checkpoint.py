"""What checkpointing costs: step time while saving, and size on disk.

Trains the reference decoder (tiny_mixtral, fp8 by default, one device) and
reports, side by side, the mean wall time of a step (the step, reading its
loss, and the save when there is one):

  no saving          the step alone;
  async every step   `Checkpoints.save` every step (orbax copies the arrays
                     to host memory, a background thread writes them; a
                     save first waits for the previous one to be written);
  sync every step    the same, waiting for each save to be on disk;
  async every 10     a save every 10th step, the cost spread over 10 steps;

and the median time a step spends inside `save` (its blocking part).

Then the size on disk of one checkpoint of the whole train state (params,
optimizer moments, fp8 state, step) and of its serving export (params and fp8
state, no optimizer state), in float32 and in bfloat16.

  python benchmarks/checkpoint/bench_checkpoint.py
  python benchmarks/checkpoint/bench_checkpoint.py --steps 50 --batch 16 \
      --seq 32 --quantization fp8 --frontend nnx
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from linen_moe import checkpoint
from linen_moe import load_model_config
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common.frontends import frontend as get_frontend

KIB = 1024


def directory_bytes(path: str) -> int:
  return sum(
      os.path.getsize(os.path.join(root, name))
      for root, _, names in os.walk(path)
      for name in names
  )


def time_steps(args, saving: str, every: int, workdir: str):
  """(per-step wall seconds, seconds inside each `save`) of `args.steps`
  steps after a warm-up step; `saving` is "none", "async" or "sync"."""
  cfg = load_model_config(args.config, quantization=args.quantization)
  fe = get_frontend(args.frontend)
  tx = default_optimizer()
  data = MarkovData(cfg.vocab_size)
  rng = jax.random.key(0)
  batch = lambda i: jnp.asarray(data.batch(i, args.batch, args.seq))  # noqa: E731
  state = fe.init(cfg, tx, batch(0), rng)
  step = jax.jit(fe.make_step(cfg, tx), donate_argnums=0)
  state, metrics = step(state, batch(0), rng)  # compile
  float(metrics["loss"])
  ckpts = None
  if saving != "none":
    ckpts = checkpoint.Checkpoints(
        os.path.join(workdir, f"{saving}_{every}"),
        save_every=every,
        keep=2,
        async_save=saving == "async",
    )
  meta = {"model_config": checkpoint.config_dict(cfg)}
  times, saves = [], []
  for i in range(1, args.steps + 1):
    tokens = batch(i)
    start = time.perf_counter()
    state, metrics = step(state, tokens, jax.random.fold_in(rng, i))
    float(metrics["loss"])
    if ckpts is not None and i % every == 0:
      saving_at = time.perf_counter()
      ckpts.save(i, fe.checkpoint_tree(state), meta)
      saves.append(time.perf_counter() - saving_at)
    times.append(time.perf_counter() - start)
  if ckpts is not None:
    ckpts.close()
  return times, saves


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="tiny_mixtral")
  parser.add_argument("--quantization", default="fp8")
  parser.add_argument("--frontend", choices=("linen", "nnx"), default="linen")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq", type=int, default=32)
  args = parser.parse_args()
  workdir = tempfile.mkdtemp()
  try:
    print(
        f"{args.config} {args.quantization} {args.frontend}, batch "
        f"{args.batch} x seq {args.seq}, {args.steps} steps, "
        f"{jax.devices()[0].platform}"
    )
    modes = {
        "no saving": ("none", 1),
        "async every step": ("async", 1),
        "sync every step": ("sync", 1),
        "async every 10": ("async", 10),
    }
    base = None
    for label, (saving, every) in modes.items():
      times, saves = time_steps(args, saving, every, workdir)
      mean = statistics.mean(times)  # a save every 10th step counts
      base = base or mean
      inside = (
          f"  save {statistics.median(saves) * 1e3:7.2f} ms" if saves else ""
      )
      print(
          f"  {label:<18} {mean * 1e3:8.2f} ms/step  x{mean / base:.2f}{inside}"
      )
    run = os.path.join(workdir, "async_1")
    full = directory_bytes(os.path.join(run, str(args.steps)))
    print(f"  train state checkpoint  {full / KIB:9.1f} KiB  x1.00")
    for dtype in (None, "bfloat16"):
      out = os.path.join(workdir, f"export_{dtype}")
      checkpoint.export(run, out, dtype=dtype)
      size = directory_bytes(out)
      name = f"serving export ({dtype or 'float32'})"
      print(f"  {name:<24}{size / KIB:9.1f} KiB  x{size / full:.2f}")
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  main()
