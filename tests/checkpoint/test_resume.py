"""Exact resume through the library: a run stopped after step 6 and resumed
to step 12 equals the uninterrupted 12-step run bit for bit (losses and every
leaf of the final state: params, optimizer moments, fp8 state, step), on the
same machine.

Both front ends' train steps with gradient accumulation; the stop goes
through a checkpoint on disk (`linen_moe.checkpoint`) and a restore into an
abstract state. The cell is int8 on the dense path in NNX (AQT's
stochastic rounding draws from the step's key); fp8 on the sparse path, in
Linen and NNX, and the (slow) product of front ends, quantization modes and
paths run through `training.run` in tests/run/test_resume.py.
"""

from __future__ import annotations

import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import checkpoint
from linen_moe._src.testing import helpers
from linen_moe.frontend import VARIABLES
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe.variables import OVERWRITE_WITH_GRADIENT
from nnx_adapter import frontend as get_frontend

STOP, STEPS = 6, 12
BATCH, SEQ, GRAD_ACCUM = 4, 8, 2
_flat_numpy = helpers.flat_numpy


class ExactResumeMixin(parameterized.TestCase):

  def check_exact_resume(self, frontend: str, quantization: str, path: str):
    cfg = helpers.config_on_path(
        "tiny_mixtral", quantization, path, num_layers=1
    )
    fe = get_frontend(frontend)
    tx = default_optimizer()
    data = MarkovData(cfg.vocab_size)
    rng = jax.random.key(0)
    batch = lambda i: jnp.asarray(data.batch(i, BATCH, SEQ))  # noqa: E731
    step = jax.jit(fe.make_step(cfg, tx, GRAD_ACCUM), donate_argnums=0)

    def train(state, start, stop):
      losses = []
      for i in range(start, stop):
        state, metrics = step(state, batch(i), jax.random.fold_in(rng, i))
        losses.append(np.asarray(metrics["loss"]))
      return state, losses

    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    state = fe.init(cfg, tx, batch(0), rng)
    initial = _flat_numpy(fe.checkpoint_tree(state))
    with checkpoint.Checkpoints(directory) as ckpts:
      state, head = train(state, 0, STOP)
      meta = {"model_config": checkpoint.config_dict(cfg)}
      ckpts.save(STOP, fe.checkpoint_tree(state), meta)
      state, tail = train(state, STOP, STEPS)  # donates what is being saved
    final = _flat_numpy(fe.checkpoint_tree(state))

    template = jax.eval_shape(lambda: fe.init(cfg, tx, batch(0), rng))
    with checkpoint.Checkpoints(directory) as ckpts:
      restored = ckpts.restore(fe.checkpoint_tree(template), config=cfg)
    resumed = fe.from_checkpoint_tree(restored.tree, template)
    resumed, resumed_tail = train(resumed, STOP, STEPS)

    np.testing.assert_array_equal(resumed_tail, tail)
    # The restored state is the fresh one's kind of argument: one program.
    self.assertEqual(step._cache_size(), 1)
    got = _flat_numpy(fe.checkpoint_tree(resumed))
    self.assertEqual(sorted(got), sorted(final))
    for p in final:
      np.testing.assert_array_equal(got[p], final[p], err_msg=str(p))
    # It trained, and every kind of state moved (so each had to be restored).
    self.assertLess(float(np.mean(tail)), float(np.mean(head)))
    self.assertEqual(int(final[("step",)]), STEPS)
    for prefix in (
        ("variables", "params"),
        ("opt_state",),
        (VARIABLES, OVERWRITE_WITH_GRADIENT),
    ):
      moved = [
          not np.array_equal(final[p], initial[p])
          for p in final
          if p[: len(prefix)] == prefix
          and np.issubdtype(final[p].dtype, np.floating)
      ]
      if (
          prefix == (VARIABLES, OVERWRITE_WITH_GRADIENT)
          and "fp8" not in quantization
      ):
        self.assertEmpty(moved)
      else:
        self.assertTrue(moved and all(moved), prefix)


class ExactResumeTest(ExactResumeMixin):

  def test_resume_is_exact(self):
    self.check_exact_resume("nnx", "int8", "dense")

  @parameterized.parameters("linen", "nnx")
  def test_a_restored_state_needs_no_second_compile(self, frontend):
    # Its leaves committed to the device and its tree (an NNX graph's static
    # modules too) equal to a fresh state's: a step jitted over either is
    # one program, not a second compile on every resume.
    cfg = helpers.config_on_path("tiny_mixtral", "none", "dense", num_layers=1)
    fe, tx, rng = get_frontend(frontend), default_optimizer(), jax.random.key(0)
    tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
    fresh = fe.init(cfg, tx, tokens, rng)
    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    template = jax.eval_shape(lambda: fe.init(cfg, tx, tokens, rng))
    with checkpoint.Checkpoints(directory) as ckpts:
      ckpts.save(0, fe.checkpoint_tree(fresh), {})
      ckpts.wait_until_finished()
      restored = ckpts.restore(fe.checkpoint_tree(template))
    resumed = fe.from_checkpoint_tree(restored.tree, template)
    read = jax.jit(lambda state: jax.tree.leaves(state)[0] + 1)
    read(fresh)
    read(resumed)
    self.assertEqual(read._cache_size(), 1)


if __name__ == "__main__":
  absltest.main()
