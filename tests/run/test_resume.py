"""A run resumed from its directory (`training.run` with `checkpoint_dir`)
equals the uninterrupted run: every metric of every step and the final
checkpoint, in every front end, quantization mode and matmul path (slow);
the schedule, the throughput metrics and the optimizer's settings across a
resume; an unquantized run resumed in fp8 with `fresh_fp8_state`; a run
killed (SIGKILL) at random moments and run again to its end.

The command's own resume (its lines, flags and exit statuses):
test_cli_resume.py; the library's exact resume of a train state:
tests/checkpoint/test_resume.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import checkpoint
from linen_moe import load_model_config
from linen_moe import planning
from linen_moe import testing
from linen_moe import training
from linen_moe._src.run import throughput
from linen_moe._src.testing import helpers
from linen_moe.quantization import MODES
import nnx_adapter
from tests import workers

STOP, STEPS = 6, 12
BATCH, SEQ, GRAD_ACCUM = 4, 8, 2
# What the fp8 tests train (`linen-moe train --config tiny_mixtral
# --quantization fp8 --batch-size 2 --seq-len 8 --save-every 3`).
FP8_RUN = dict(
    config="tiny_mixtral",
    overrides={"quantization": "fp8"},
    batch_size=2,
    seq_len=8,
    save_every=3,
    progress=False,
)


def _quiet(_: str) -> None:
  pass


def _as_started_for(
    test: absltest.TestCase, rows: list[dict], started: int, steps: int
) -> list[dict]:
  """Metrics rows of a run started for `started` steps (checked) and
  resumed, their first row's `recipe.steps` set to `steps`, to compare
  with a run started for `steps`."""
  test.assertEqual(rows[0]["recipe"]["steps"], started)
  rows[0]["recipe"]["steps"] = steps
  return rows


def _final_state(directory: str) -> dict:
  """{path: array} of the newest checkpoint in `directory`: weights,
  optimizer moments, fp8 state."""
  with checkpoint.Checkpoints(directory) as ckpts:
    abstract = checkpoint.abstract(ckpts.saved_leaves())
    return helpers.flat_numpy(ckpts.read(ckpts.latest_step(), abstract))


class ResumeProductTest(parameterized.TestCase):
  """With gradient accumulation: `whole` runs 12 steps, `split` 6 and then
  12, in every front end, quantization mode and matmul path; metrics and
  the final checkpoint equal."""

  @testing.slow
  @parameterized.product(
      frontend=("linen", "nnx"),
      quantization=tuple(MODES),
      path=tuple(MATMUL_PATHS),
  )
  def test_resume_is_exact(self, frontend, quantization, path):
    tmp = helpers.tempdir(self)
    overrides = dict(quantization=quantization, **MATMUL_PATHS[path])
    dirs, results = {}, {}
    for name, stops in (("whole", (STEPS,)), ("split", (STOP, STEPS))):
      dirs[name] = os.path.join(tmp, name)
      for steps in stops:
        opts = training.RunOptions(
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
        fe = nnx_adapter.frontend(frontend)
        results[name] = training.run(opts, fe, log=_quiet)
    self.assertEqual(
        _as_started_for(self, helpers.run_metrics(dirs["split"]), STOP, STEPS),
        helpers.run_metrics(dirs["whole"]),
    )
    self.assertEqual(results["split"].start_step, STOP)
    self.assertEqual(results["split"].losses, results["whole"].losses[STOP:])
    whole, split = _final_state(dirs["whole"]), _final_state(dirs["split"])
    self.assertEqual(sorted(split), sorted(whole))
    for p in whole:
      np.testing.assert_array_equal(split[p], whole[p], err_msg=str(p))


def _cosine_lr(n: int, peak=1e-2, warmup=2, total=STEPS, ratio=0.1) -> float:
  """The rate of `ScheduleResumeTest`'s schedule after n updates, from its
  definition."""
  if n < warmup:
    return peak * n / warmup
  frac = min(n - warmup, total - warmup) / (total - warmup)
  return ratio * peak + (1 - ratio) * peak * 0.5 * (1 + np.cos(np.pi * frac))


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


@testing.slow  # 2 more runs; tests/cli/test_cli_resume.py is the heavy tier's
class ScheduleResumeTest(absltest.TestCase):
  """A run with a cosine schedule, warmup and weight decay: `whole` runs 12
  steps; `killed` is a copy of it put back at its step 6 (`resume_step=6`
  sets the newer checkpoints aside, as a run killed after step 6 leaves its
  directory) and run again to 12 with the same options."""

  def test_resume_continues_the_schedule(self):
    tmp = helpers.tempdir(self)
    whole, killed = os.path.join(tmp, "whole"), os.path.join(tmp, "killed")
    fields = dict(
        FP8_RUN,
        overrides={"num_layers": 1},
        steps=STEPS,
        lr_schedule="cosine",
        warmup_steps=2,
        weight_decay=0.1,
    )
    board = os.path.join(tmp, "board")
    training.run(
        training.RunOptions(
            **fields,
            checkpoint_dir=whole,
            profile_steps=(2, 3),
            tensorboard=board,
        ),
        log=_quiet,
    )
    _check_throughput(self, whole, board)
    shutil.copytree(whole, killed)
    said = []
    result = training.run(
        training.RunOptions(**fields, checkpoint_dir=killed, resume_step=STOP),
        log=said.append,
    )
    self.assertIn(f"resumed from step {STOP} ", "\n".join(said))
    self.assertEqual(result.start_step, STOP)
    rows = helpers.run_metrics(whole)
    # every metric, rates included
    self.assertEqual(helpers.run_metrics(killed), rows)
    self.assertEqual(result.losses, [m["cross_entropy"] for m in rows[STOP:]])
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
    # Other optimizer settings are refused before any step.
    del fields["lr_schedule"]
    fields["steps"] = STEPS + 1
    with self.assertRaisesRegex(
        ValueError,
        "another optimizer: `lr_schedule` 'constant' here, 'cosine' there",
    ):
      training.run(
          training.RunOptions(**fields, checkpoint_dir=killed), log=_quiet
      )
    self.assertLen(helpers.run_metrics(killed), STEPS)


@testing.slow
class FreshFp8StateTest(absltest.TestCase):
  """An unquantized run resumed with fp8 needs `fresh_fp8_state`."""

  def test_switch_to_fp8(self):
    tmp = helpers.tempdir(self)
    plain = dict(FP8_RUN, overrides={"quantization": "none"})
    training.run(
        training.RunOptions(**plain, steps=3, checkpoint_dir=tmp), log=_quiet
    )
    fp8 = training.RunOptions(**FP8_RUN, steps=5, checkpoint_dir=tmp)
    with self.assertRaisesRegex(ValueError, "fresh_fp8_state=True"):
      training.run(fp8, log=_quiet)
    self.assertLen(helpers.run_metrics(tmp), 3)
    said = []
    result = training.run(
        training.RunOptions(
            **FP8_RUN, steps=5, checkpoint_dir=tmp, fresh_fp8_state=True
        ),
        log=said.append,
    )
    self.assertIn("resumed from step 3 with fresh fp8 state", "\n".join(said))
    self.assertEqual((result.start_step, len(result.losses)), (3, 2))
    self.assertEqual(
        [m["step"] for m in helpers.run_metrics(tmp)], [1, 2, 3, 4, 5]
    )


def _lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    return f.read().count("\n")


# A process that runs `training.run(RunOptions(**json.loads(argv[1])))`.
_RUN_IN_A_CHILD = (
    "import json, sys\n"
    "from linen_moe import training\n"
    "training.run(training.RunOptions(**json.loads(sys.argv[1])),"
    " log=lambda _: None)\n"
)


@testing.slow
class KilledRunTest(absltest.TestCase):
  """A run saving every step (`save_every=1`), in a child process, killed
  (SIGKILL) at several moments, whatever it is doing, then run again until
  done: its metrics equal an uninterrupted run's. Each kill lands mid-run:
  the process dies of it, after recording a step more than the last one
  did and before the end."""

  def _wait_for_line(self, proc, path: str, lines: int) -> bool:
    """Waits until `path` holds more than `lines` lines; False if the
    process ended first."""
    while proc.poll() is None:
      if _lines(path) > lines:
        return True
      time.sleep(0.02)
    return False

  def test_kill_anywhere_then_resume(self):
    tmp = helpers.tempdir(self)
    steps = 30
    fields = dict(FP8_RUN, save_every=1, steps=steps)
    whole = os.path.join(tmp, "whole")
    training.run(
        training.RunOptions(**fields, checkpoint_dir=whole), log=_quiet
    )
    killed = os.path.join(tmp, "killed")
    metrics = os.path.join(killed, "metrics.jsonl")
    child = json.dumps(dict(fields, checkpoint_dir=killed))
    rng = np.random.default_rng(0)
    recorded = 0
    for attempt in range(4):
      proc = subprocess.Popen(
          [sys.executable, "-c", _RUN_IN_A_CHILD, child],
          cwd=workers.ROOT,
          env=workers.env(),
          stdout=subprocess.DEVNULL,
          stderr=subprocess.DEVNULL,
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
    training.run(
        training.RunOptions(**fields, checkpoint_dir=killed), log=_quiet
    )
    self.assertEqual(helpers.run_metrics(killed), helpers.run_metrics(whole))


if __name__ == "__main__":
  absltest.main()
