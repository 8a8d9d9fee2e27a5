"""`linen-moe train --checkpoint-dir`: a run directory resumed, by the same
command or in the other front end, equals an uninterrupted run (every
metric of every step; with the slow product, also the final checkpoint),
including after SIGKILLs at random moments (slow). The library's exact
resume: test_resume.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import checkpoint
from linen_moe import load_model_config
from linen_moe import planning
from linen_moe import testing
from linen_moe._src.run import loop as train_job
from linen_moe._src.run import throughput
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from linen_moe.quantization import MODES
from linen_moe.training import RunOptions
import nnx_adapter
from tests import cli_helpers
from tests import workers

FRONTENDS = ("linen", "nnx")

STOP, STEPS = 6, 12
BATCH, SEQ, GRAD_ACCUM = 4, 8, 2


_run_cli = cli_helpers.cli


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
  `split` at step 6 to 12 with `--frontend nnx` (the library's crossing:
  test_nnx_fp8.py, test_checkpoint.py). One test, so that the runs are not
  repeated per test process."""

  @heavy
  def test_resume_from_the_command_line(self):
    self.check_resume(in_nnx=True)

  def check_resume(self, in_nnx: bool):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    dirs = {k: os.path.join(tmp, k) for k in ("whole", "split", "in_nnx")}
    outputs = {}

    def run(name, steps, *extra):
      code, out, _ = _run_cli(
          *TRAIN, "--steps", str(steps), "--checkpoint-dir", dirs[name], *extra
      )
      self.assertEqual(code, 0, out)
      outputs.setdefault(name, []).append(out)

    run("whole", STEPS)
    run("split", STOP)
    if in_nnx:
      shutil.copytree(dirs["split"], dirs["in_nnx"])
    run("split", STEPS)
    if in_nnx:
      run("in_nnx", STEPS, "--frontend", "nnx")

    whole, split = helpers.run_metrics(dirs["whole"]), helpers.run_metrics(
        dirs["split"]
    )
    self.assertEqual(whole[0]["recipe"]["steps"], STEPS)
    split = cli_helpers.as_started_for(self, split, STOP, STEPS)
    self.assertEqual([m["step"] for m in split], list(range(1, STEPS + 1)))
    self.assertEqual(split, whole)  # every metric of every step, exactly
    self.assertNotIn("resumed", outputs["split"][0])
    self.assertIn("resumed from step 6", outputs["split"][1])
    # The banner counts the steps this run takes, not those behind it.
    self.assertIn(f"  steps {STOP + 1}-{STEPS}, ", outputs["split"][1])
    self.assertIn(f"  steps 1-{STOP}, ", outputs["split"][0])
    if in_nnx:  # a Linen run resumed in NNX matches too
      resumed = helpers.run_metrics(dirs["in_nnx"])
      self.assertIn("resumed from step 6", outputs["in_nnx"][0])
      self.assertEqual([m["step"] for m in resumed], list(range(1, STEPS + 1)))
      # One update rule in both front ends, fp8 state included: every
      # resumed step's loss that of the Linen run (batch 8 x 32: 8.6e-5
      # relative apart at step 12 when the NNX step rounded its update
      # otherwise; test_nnx_fp8.py).
      np.testing.assert_allclose(
          [m["loss"] for m in resumed[STOP:]],
          [m["loss"] for m in whole[STOP:]],
          rtol=1e-6,
      )
      final, linen = _final_tree(dirs["in_nnx"]), _final_tree(dirs["whole"])
      self.assertEqual(sorted(final), sorted(linen))
      for p in linen:  # the state too: fp8 scale histories, weights, moments
        np.testing.assert_allclose(
            np.asarray(final[p], np.float64),
            np.asarray(linen[p], np.float64),
            rtol=1e-6,
            err_msg=str(p),
        )
    with checkpoint.Checkpoints(dirs["split"]) as ckpts:
      self.assertEqual(ckpts.all_steps(), [6, 9, 12])  # --keep 3
      self.assertEqual(ckpts.meta()["data"]["position"], STEPS)

    code, out, _ = _run_cli(
        *TRAIN, "--steps", "12", "--checkpoint-dir", dirs["split"]
    )
    self.assertEqual(code, 0)
    self.assertIn("already at step 12 (--steps 12)", out)
    again = cli_helpers.as_started_for(
        self, helpers.run_metrics(dirs["split"]), STOP, STEPS
    )
    self.assertEqual(again, whole)

    argv = [*TRAIN, "--steps", "13", "--checkpoint-dir", dirs["split"]]
    gemma = [a if a != "tiny_mixtral" else "tiny_gemma4_26b" for a in argv]
    for bad, message in (
        (gemma, "another model config: .*num_experts=8 there, 16 here"),
        ([*argv, "--seed", "3"], "--seed 3 differs from the seed 0"),
    ):
      code, _, err = _run_cli(*bad)
      self.assertEqual(code, 2)
      self.assertRegex(err, message)


def _cosine_lr(n: int, peak=1e-2, warmup=2, total=STEPS, ratio=0.1) -> float:
  """The rate of `ScheduleResumeTest`'s schedule after n updates, from its
  definition."""
  if n < warmup:
    return peak * n / warmup
  frac = min(n - warmup, total - warmup) / (total - warmup)
  return ratio * peak + (1 - ratio) * peak * 0.5 * (1 + np.cos(np.pi * frac))


@testing.slow  # 2 more runs; TrainCommandResumeTest is the default's resume
class ScheduleResumeTest(absltest.TestCase):
  """A run with a cosine schedule, warmup and weight decay: `whole` runs 12
  steps; `killed` is a copy of it put back at its step 6 (`--resume-step 6`
  sets the newer checkpoints aside, as a run killed after step 6 leaves its
  directory) and run again to 12 by the same command."""

  def test_resume_continues_the_schedule(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    whole, killed = os.path.join(tmp, "whole"), os.path.join(tmp, "killed")
    argv = [
        *[a for a in TRAIN if a not in ("--quantization", "fp8")],
        "--set",
        "num_layers=1",
        "--steps",
        str(STEPS),
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--weight-decay",
        "0.1",
    ]
    board = os.path.join(tmp, "board")
    code, out, err = _run_cli(
        *argv,
        "--checkpoint-dir",
        whole,
        "--profile-steps",
        "2:3",
        "--tensorboard",
        board,
    )
    self.assertEqual(code, 0, out + err)
    _check_throughput(self, whole, board)
    shutil.copytree(whole, killed)
    code, out, err = _run_cli(
        *argv, "--checkpoint-dir", killed, "--resume-step", str(STOP)
    )
    self.assertEqual(code, 0, out + err)
    self.assertIn(f"resumed from step {STOP}", out)
    rows = helpers.run_metrics(whole)
    self.assertEqual(
        helpers.run_metrics(killed), rows
    )  # every metric, rates included
    self.assertEqual([m["skipped_steps"] for m in rows], [0] * STEPS)
    np.testing.assert_allclose(
        [m["learning_rate"] for m in rows],
        [_cosine_lr(n) for n in range(STEPS)],
        rtol=1e-6,
        atol=1e-12,
    )
    with checkpoint.Checkpoints(killed) as ckpts:
      self.assertEqual(
          ckpts.meta()["run"]["optimizer"],
          {
              "learning_rate": 1e-2,
              "lr_schedule": "cosine",
              "warmup_steps": 2,
              "total_steps": STEPS,
              "final_lr_ratio": 0.1,
              "weight_decay": 0.1,
          },
      )
    # Other optimizer flags are refused before any step.
    plain = [a for a in argv if a not in ("cosine", "--lr-schedule")]
    code, _, err = _run_cli(*plain, "--steps", "13", "--checkpoint-dir", killed)
    self.assertEqual(code, 2)
    self.assertRegex(
        err, "another optimizer: --lr-schedule 'constant' here, 'cosine' there"
    )
    self.assertLen(helpers.run_metrics(killed), STEPS)


def _check_throughput(test, run: str, board: str) -> None:
  """Every row of RUN/metrics.jsonl has the step's throughput, whose
  TFLOP/s over tokens/s is the model FLOPs per token of the run's config
  (no MFU on a CPU: no peak known); RUN/profile holds the trace of the
  profiled steps, BOARD the TensorBoard events of the same scalars."""
  rows = helpers.read_jsonl(os.path.join(run, "metrics.jsonl"))
  cfg = load_model_config("tiny_mixtral", num_layers=1)
  per_token = planning.model_flops(cfg, 2, 8) / (2 * 8)
  for row in rows:
    test.assertGreater(row["tokens_per_s"], 0)
    test.assertNotIn("mfu", row)
    np.testing.assert_allclose(
        row["model_tflops_per_s"] * 1e12 / row["tokens_per_s"],
        per_token,
        rtol=1e-9,
    )
  profiles = [
      name
      for _, _, names in os.walk(os.path.join(run, throughput.PROFILE_DIR))
      for name in names
      if name.endswith(".xplane.pb")
  ]
  test.assertLen(profiles, 1)
  (events,) = os.listdir(board)
  with open(os.path.join(board, events), "rb") as f:
    written = f.read()
  for tag in ("cross_entropy", "learning_rate", *throughput.TIMING_METRICS[:2]):
    test.assertIn(tag.encode(), written)


def _lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    return f.read().count("\n")


def _final_tree(directory: str) -> dict:
  with checkpoint.Checkpoints(directory) as ckpts:
    leaves = ckpts.saved_leaves()
    return helpers.flat_numpy(
        ckpts.read(ckpts.latest_step(), checkpoint.abstract(leaves))
    )


class TrainResumeProductTest(parameterized.TestCase):
  """`train_job.train` (what `linen-moe train` runs), with gradient
  accumulation: 12 steps against 6 then 12, in every front end,
  quantization mode and path; metrics and the final checkpoint equal."""

  @testing.slow
  @parameterized.product(
      frontend=FRONTENDS, quantization=tuple(MODES), path=tuple(MATMUL_PATHS)
  )
  def test_resume_is_exact(self, frontend, quantization, path):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    overrides = dict(quantization=quantization, **MATMUL_PATHS[path])
    dirs = {}
    for name, stops in (("whole", (STEPS,)), ("split", (STOP, STEPS))):
      dirs[name] = os.path.join(tmp, name)
      for steps in stops:
        opts = RunOptions(
            "tiny_mixtral",
            overrides,
            steps=steps,
            batch_size=BATCH,
            seq_len=SEQ,
            grad_accum=GRAD_ACCUM,
            progress=False,
            checkpoint_dir=dirs[name],
            save_every=3,
        )
        train_job.run(opts, nnx_adapter.frontend(frontend), log=lambda _: None)
    self.assertEqual(
        cli_helpers.as_started_for(
            self, helpers.run_metrics(dirs["split"]), STOP, STEPS
        ),
        helpers.run_metrics(dirs["whole"]),
    )
    whole, split = _final_tree(dirs["whole"]), _final_tree(dirs["split"])
    self.assertEqual(sorted(split), sorted(whole))
    for p in whole:
      np.testing.assert_array_equal(split[p], whole[p], err_msg=str(p))


@testing.slow
class FreshFp8StateCommandTest(absltest.TestCase):
  """An unquantized run resumed with fp8 needs `--fresh-fp8-state`."""

  def test_switch_to_fp8(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    plain = [a if a != "fp8" else "none" for a in TRAIN]
    self.assertEqual(
        _run_cli(*plain, "--steps", "3", "--checkpoint-dir", tmp)[0], 0
    )
    code, _, err = _run_cli(*TRAIN, "--steps", "5", "--checkpoint-dir", tmp)
    self.assertEqual(code, 2)
    self.assertIn("--fresh-fp8-state", err)
    self.assertLen(helpers.run_metrics(tmp), 3)
    code, out, _ = _run_cli(
        *TRAIN, "--steps", "5", "--checkpoint-dir", tmp, "--fresh-fp8-state"
    )
    self.assertEqual(code, 0)
    self.assertIn("resumed from step 3 with fresh fp8 state", out)
    self.assertEqual(
        [m["step"] for m in helpers.run_metrics(tmp)], [1, 2, 3, 4, 5]
    )


@testing.slow
class KilledTrainingTest(absltest.TestCase):
  """`linen-moe train --save-every 1` killed (SIGKILL) at several moments,
  whatever it is doing, then run again until done: its metrics equal an
  uninterrupted run's. Each kill lands mid-run: the process dies of it,
  after recording a step more than the last one did and before the end."""

  def _wait_for_line(self, proc, path: str, lines: int) -> bool:
    """Waits until `path` holds more than `lines` lines; False if the
    process ended first."""
    while proc.poll() is None:
      if _lines(path) > lines:
        return True
      time.sleep(0.02)
    return False

  def test_kill_anywhere_then_resume(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    steps = 30
    argv = [*TRAIN, "--save-every", "1", "--steps", str(steps)]
    whole = os.path.join(tmp, "whole")
    self.assertEqual(_run_cli(*argv, "--checkpoint-dir", whole)[0], 0)
    killed = os.path.join(tmp, "killed")
    metrics = os.path.join(killed, "metrics.jsonl")
    rng = np.random.default_rng(0)
    recorded = 0
    for attempt in range(4):
      proc = workers.start(
          "linen_moe_cli.main", *argv, "--checkpoint-dir", killed
      )
      # Past compilation (a step is recorded), then a random moment within
      # the next step's time, measured: whatever the run is doing then.
      self.assertTrue(self._wait_for_line(proc, metrics, recorded), attempt)
      seen, t0 = _lines(metrics), time.monotonic()
      self.assertTrue(self._wait_for_line(proc, metrics, seen), attempt)
      time.sleep(rng.uniform(0.0, time.monotonic() - t0))
      proc.send_signal(signal.SIGKILL)
      self.assertEqual(proc.wait(), -signal.SIGKILL, attempt)
      now = _lines(metrics)
      self.assertGreater(now, recorded, attempt)
      self.assertLess(now, steps, attempt)
      recorded = now
    code, _, _ = _run_cli(*argv, "--checkpoint-dir", killed)
    self.assertEqual(code, 0)
    self.assertEqual(helpers.run_metrics(killed), helpers.run_metrics(whole))


if __name__ == "__main__":
  absltest.main()
