"""Exact resume: a run stopped after step 6 and resumed to step 12 equals the
uninterrupted 12-step run bit for bit (losses and every leaf of the final
state: params, optimizer moments, fp8 state, step), on the same machine.

`ExactResumeTest` drives the library (`linen_moe.checkpoint`) with gradient
accumulation; the stop goes through a checkpoint on disk and a restore into
an abstract state. Its default cells are fp8 and int8 (AQT's stochastic
rounding draws from the step's key), one path and one front end each; the
full product of front ends, quantization modes and paths is marked slow.
`TrainCommandResumeTest` runs `linen-moe train --checkpoint-dir` itself:
one command of 12 steps against 6 then 12, and a Linen run resumed in NNX.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import shutil
import signal
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linen_moe import OVERWRITE_WITH_GRADIENT
from linen_moe import checkpoint
from linen_moe import load_model_config
from linen_moe._src.config import PATHS
from linen_moe._src.config import QUANTIZATIONS
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe_cli import main as cli
from linen_moe_cli import train_job
from linen_moe_cli.frontends import FRONTENDS
from linen_moe_cli.frontends import frontend as get_frontend
from linen_moe_cli.options import TrainOptions
from tests import workers

STOP, STEPS = 6, 12
BATCH, SEQ, GRAD_ACCUM = 4, 8, 2


def _flat_numpy(tree) -> dict:
  return {p: np.asarray(x) for p, x in traverse_util.flatten_dict(tree).items()}


class ExactResumeMixin(parameterized.TestCase):

  def check_exact_resume(self, frontend: str, quantization: str, path: str):
    cfg = load_model_config(
        "tiny_mixtral", quantization=quantization, num_layers=1, **PATHS[path]
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
        (checkpoint.VARIABLES, OVERWRITE_WITH_GRADIENT),
    ):
      moved = [
          not np.array_equal(final[p], initial[p])
          for p in final
          if p[: len(prefix)] == prefix
          and np.issubdtype(final[p].dtype, np.floating)
      ]
      if (
          prefix == (checkpoint.VARIABLES, OVERWRITE_WITH_GRADIENT)
          and "fp8" not in quantization
      ):
        self.assertEmpty(moved)
      else:
        self.assertTrue(moved and all(moved), prefix)


class ExactResumeTest(ExactResumeMixin):

  def test_resume_is_exact(self):
    # fp8 on the sparse path, in Linen and NNX: TrainCommandResumeTest.
    self.check_exact_resume("nnx", "int8", "dense")


def _run_cli(*argv) -> tuple[int, str]:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = cli.main(list(argv))
  return code, out.getvalue()


def _metrics(directory: str) -> list[dict]:
  with open(os.path.join(directory, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


TRAIN = (
    "train",
    "--config",
    "tiny_mixtral",
    "--quantization",
    "fp8",
    "--batch-size",
    "2",
    "--seq-len",
    "8",
    "--save-every",
    "3",
    "--no-progress",
)


class TrainCommandResumeTest(absltest.TestCase):
  """`linen-moe train`: `whole` runs 12 steps in one command (Linen),
  `split` 6 and then the same command with 12, `in_nnx` resumes a copy of
  `split` at step 6 to 12 with `--frontend nnx`. One test, so that the four
  runs are not repeated per test process."""

  def test_resume_from_the_command_line(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    dirs = {k: os.path.join(tmp, k) for k in ("whole", "split", "in_nnx")}
    outputs = {}

    def run(name, steps, *extra):
      code, out = _run_cli(
          *TRAIN, "--steps", str(steps), "--checkpoint-dir", dirs[name], *extra
      )
      self.assertEqual(code, 0, out)
      outputs.setdefault(name, []).append(out)

    run("whole", STEPS)
    run("split", STOP)
    shutil.copytree(dirs["split"], dirs["in_nnx"])
    run("split", STEPS)
    run("in_nnx", STEPS, "--frontend", "nnx")

    whole, split = _metrics(dirs["whole"]), _metrics(dirs["split"])
    self.assertEqual([m["step"] for m in split], list(range(1, STEPS + 1)))
    self.assertEqual(split, whole)  # every metric of every step, exactly
    self.assertNotIn("resumed", outputs["split"][0])
    self.assertIn("resumed from step 6", outputs["split"][1])
    # A Linen run resumed in NNX matches too.
    in_nnx = _metrics(dirs["in_nnx"])
    self.assertIn("resumed from step 6", outputs["in_nnx"][0])
    self.assertEqual(in_nnx[-1]["step"], STEPS)
    self.assertEqual(in_nnx[-1]["loss"], whole[-1]["loss"])
    with checkpoint.Checkpoints(dirs["split"]) as ckpts:
      self.assertEqual(ckpts.all_steps(), [6, 9, 12])  # --keep 3
      self.assertEqual(ckpts.meta()["data"]["position"], STEPS)

    code, out = _run_cli(
        *TRAIN, "--steps", "12", "--checkpoint-dir", dirs["split"]
    )
    self.assertEqual(code, 0)
    self.assertIn("already at step 12 (--steps 12)", out)
    self.assertEqual(_metrics(dirs["split"]), whole)

    argv = [*TRAIN, "--steps", "13", "--checkpoint-dir", dirs["split"]]
    gemma = [a if a != "tiny_mixtral" else "tiny_gemma4_26b" for a in argv]
    for bad, message in (
        (gemma, "another model config: .*num_experts=8 there, 16 here"),
        ([*argv, "--seed", "3"], "--seed 3 differs from the seed 0"),
    ):
      err = io.StringIO()
      with contextlib.redirect_stderr(err):
        code, _ = _run_cli(*bad)
      self.assertEqual(code, 2)
      self.assertRegex(err.getvalue(), message)


def _lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    return f.read().count("\n")


def _final_tree(directory: str) -> dict:
  with checkpoint.Checkpoints(directory) as ckpts:
    leaves = ckpts.saved_leaves()
    return _flat_numpy(
        ckpts.read(ckpts.latest_step(), checkpoint.abstract(leaves))
    )


@pytest.mark.slow
class TrainResumeProductTest(parameterized.TestCase):
  """`train_job.train` (what `linen-moe train` runs), with gradient
  accumulation: 12 steps against 6 then 12, in every front end,
  quantization mode and path; metrics and the final checkpoint equal."""

  @parameterized.parameters(*itertools.product(FRONTENDS, QUANTIZATIONS, PATHS))
  def test_resume_is_exact(self, frontend, quantization, path):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    overrides = dict(quantization=quantization, **PATHS[path])
    dirs = {}
    for name, stops in (("whole", (STEPS,)), ("split", (STOP, STEPS))):
      dirs[name] = os.path.join(tmp, name)
      for steps in stops:
        opts = TrainOptions(
            "tiny_mixtral",
            overrides,
            steps=steps,
            batch_size=BATCH,
            seq_len=SEQ,
            grad_accum=GRAD_ACCUM,
            frontend=frontend,
            progress=False,
            checkpoint_dir=dirs[name],
            save_every=3,
        )
        train_job.train(opts, log=lambda _: None)
    self.assertEqual(_metrics(dirs["split"]), _metrics(dirs["whole"]))
    whole, split = _final_tree(dirs["whole"]), _final_tree(dirs["split"])
    self.assertEqual(sorted(split), sorted(whole))
    for p in whole:
      np.testing.assert_array_equal(split[p], whole[p], err_msg=str(p))


@pytest.mark.slow
class FreshFp8StateCommandTest(absltest.TestCase):
  """An unquantized run resumed with fp8 needs `--fresh-fp8-state`."""

  def test_switch_to_fp8(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    plain = [a if a != "fp8" else "none" for a in TRAIN]
    self.assertEqual(
        _run_cli(*plain, "--steps", "3", "--checkpoint-dir", tmp)[0], 0
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      code, _ = _run_cli(*TRAIN, "--steps", "5", "--checkpoint-dir", tmp)
    self.assertEqual(code, 2)
    self.assertIn("--fresh-fp8-state", err.getvalue())
    self.assertLen(_metrics(tmp), 3)
    code, out = _run_cli(
        *TRAIN, "--steps", "5", "--checkpoint-dir", tmp, "--fresh-fp8-state"
    )
    self.assertEqual(code, 0)
    self.assertIn("resumed from step 3 with fresh fp8 state", out)
    self.assertEqual([m["step"] for m in _metrics(tmp)], [1, 2, 3, 4, 5])


@pytest.mark.slow
class KilledTrainingTest(absltest.TestCase):
  """`linen-moe train --save-every 1` killed (SIGKILL) at several moments,
  whatever it is doing, then run again until done: its metrics equal an
  uninterrupted run's."""

  def test_kill_anywhere_then_resume(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    steps = 30
    argv = [*TRAIN, "--save-every", "1", "--steps", str(steps)]
    whole = os.path.join(tmp, "whole")
    self.assertEqual(_run_cli(*argv, "--checkpoint-dir", whole)[0], 0)
    killed = os.path.join(tmp, "killed")
    rng = np.random.default_rng(0)
    for _ in range(4):
      proc = workers.start(
          "linen_moe_cli.main", *argv, "--checkpoint-dir", killed
      )
      metrics = os.path.join(killed, "metrics.jsonl")
      start = _lines(metrics)
      while proc.poll() is None:  # past compilation: a step is written
        if _lines(metrics) > start:
          break
        time.sleep(0.05)
      time.sleep(rng.uniform(0.0, 1.0))
      proc.send_signal(signal.SIGKILL)
      proc.wait()
    code, _ = _run_cli(*argv, "--checkpoint-dir", killed)
    self.assertEqual(code, 0)
    self.assertEqual(_metrics(killed), _metrics(whole))


if __name__ == "__main__":
  absltest.main()
