"""The halves of tests/gpu/test_on_gpu_resume.py: a short training run that
saves a checkpoint and one that resumes from it, on whatever device this
process has; and, as `python -m tests.gpu_resume_worker '<json job>'`,
the CPU side (the test starts it with JAX_PLATFORMS=cpu), which prints one
JSON line.

A job: {"frontend", "quantization", "path", "restore": DIR, "start": N,
"save": DIR, "save_at": M, "stop": S}: restore step N from DIR (checked
leaf by leaf, bit for bit, against DIR/saved.npz, what was saved), train
steps N .. S - 1, saving step M in `save` (with save.npz beside it); print
{"backend", "restored_equal", "losses"}.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import checkpoint
from linen_moe._src.testing import helpers
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from nnx_adapter import frontend as get_frontend

BATCH, SEQ = 4, 8
SAVED = "saved.npz"


class Run:
  """One front end's training of tiny_mixtral (one layer) on this
  process's default device: the same batches and keys for step i
  everywhere."""

  def __init__(self, frontend: str, quantization: str, path: str):
    self.cfg = helpers.config_on_path(
        "tiny_mixtral", quantization, path, num_layers=1
    )
    self.fe = get_frontend(frontend)
    self.tx = default_optimizer()
    self.data = MarkovData(self.cfg.vocab_size)
    self.step = jax.jit(self.fe.make_step(self.cfg, self.tx))

  def batch(self, i: int) -> jax.Array:
    return jnp.asarray(self.data.batch(i, BATCH, SEQ))

  def init(self):
    return self.fe.init(self.cfg, self.tx, self.batch(0), jax.random.key(0))

  def train(self, state, start: int, stop: int, save=None, save_at=None):
    """(state after step stop - 1, losses of steps start .. stop - 1),
    saving the state before step `save_at` in `save` (a directory)."""
    losses = []
    for i in range(start, stop):
      if i == save_at:
        self.save(state, i, save)
      key = jax.random.fold_in(jax.random.key(1), i)
      with jax.default_matmul_precision("highest"):
        state, metrics = self.step(state, self.batch(i), key)
      losses.append(float(metrics["loss"]))
    return state, losses

  def save(self, state, step: int, directory) -> None:
    """Step `step`'s checkpoint in `directory`, and its leaves as NumPy
    arrays in `directory`/saved.npz (what a restore must give back)."""
    tree = self.fe.checkpoint_tree(state)
    with checkpoint.Checkpoints(directory) as ckpts:
      meta = {"model_config": checkpoint.config_dict(self.cfg)}
      ckpts.save(step, tree, meta)
      ckpts.wait_until_finished()
    flat = helpers.flat_numpy(jax.device_get(tree))
    np.savez(pathlib.Path(directory, SAVED), **_named(flat))

  def restore(self, directory, step: int):
    """(the state of step `step` from `directory`, whether every leaf
    equals what was saved, bit for bit)."""
    template = jax.eval_shape(self.init)
    with checkpoint.Checkpoints(directory) as ckpts:
      restored = ckpts.restore(
          self.fe.checkpoint_tree(template), step=step, config=self.cfg
      )
    state = self.fe.from_checkpoint_tree(restored.tree, template)
    got = _named(helpers.flat_numpy(self.fe.checkpoint_tree(state)))
    with np.load(pathlib.Path(directory, SAVED)) as saved:
      equal = sorted(saved.files) == sorted(got) and all(
          np.array_equal(saved[k], got[k]) for k in saved.files
      )
    return state, equal


def _named(flat: dict) -> dict[str, np.ndarray]:
  """Flat paths as strings (npz keys)."""
  return {"/".join(str(p) for p in path): v for path, v in flat.items()}


def main(job: dict) -> dict:
  run = Run(job["frontend"], job["quantization"], job["path"])
  state, equal = run.restore(job["restore"], job["start"])
  _, losses = run.train(
      state, job["start"], job["stop"], job["save"], job["save_at"]
  )
  return {
      "backend": jax.default_backend(),
      "restored_equal": equal,
      "losses": losses,
  }


if __name__ == "__main__":
  print(json.dumps(main(json.loads(sys.argv[1]))))
