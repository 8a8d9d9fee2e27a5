"""Training from your own Python script on every process of a cluster job.

    srun python train.py --checkpoint-dir /shared/runs/a --steps 1000
    mpirun -np 16 python train.py --checkpoint-dir /shared/runs/a

Every process runs this same script. `distributed.initialize()` joins them
when Slurm (srun) or Open MPI (mpirun) started several, and does nothing in a
single process; `training.run` then trains on a mesh over every process's
devices and saves to, and resumes from, the one shared directory. A SIGTERM
(scancel, a time limit, a preemption) stops every process after the same
step, saved: the script exits with 143 like `linen-moe train`, and the same
command resumes.
"""

import argparse
import sys

from linen_moe import distributed
from linen_moe import training


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--checkpoint-dir", required=True)
  parser.add_argument("--config", default="tiny_mixtral")
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--batch-size", type=int, default=None)
  parser.add_argument("--seq-len", type=int, default=None)
  parser.add_argument("--num-layers", type=int, default=None)
  args = parser.parse_args()

  distributed.initialize()  # before anything else touches jax's devices
  overrides = {} if args.num_layers is None else {"num_layers": args.num_layers}
  opts = training.RunOptions(
      config=args.config,
      overrides=overrides,
      steps=args.steps,
      batch_size=args.batch_size,
      seq_len=args.seq_len,
      checkpoint_dir=args.checkpoint_dir,
      progress=False,
  )
  try:
    result = training.run(opts)
  except training.RunStopped as e:
    if e.signal is None:  # stopped for another reason: a failure
      raise
    if distributed.is_main_process():
      print(f"{e} Run the same command to resume.", file=sys.stderr)
    return e.exit_code  # 143 after a SIGTERM
  if distributed.is_main_process() and result.losses:
    print(f"final loss: {result.final_loss:.4f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
