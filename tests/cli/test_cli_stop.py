"""`linen-moe train` stopped by SIGTERM or Ctrl-C, hung, or killed while it
saves, in one process and in two (`--coordinator`, 1 CPU device each,
gloo), and resumed, on the same number of processes or another.

A stopped run exits with 128 + the signal's number within the grace
period, after the checkpoint of its last step is committed and that
step's metrics row written; run again, it resumes there, and its metrics
(losses, expert loads, held-out losses, every value) equal an uninterrupted
run's to the bit, each step's row once. A second signal during the stop's
save, or a SIGKILL, leaves the previous checkpoint the latest, loadable. A
process that hangs ends both (`--step-timeout`), with every thread's stack
written. A run stopped on 2 processes resumes on 1 and the other way, its
losses equal to float rounding.

The signals land at chosen points: `tests.cli_stop_worker` sends each to
its own process as a phase of a step begins (data, step, eval, stop
agreement, save), or the test sends one from outside at a random moment.
The default run holds one SIGTERM from outside; the rest is slow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from absl.testing import absltest
import numpy as np

from linen_moe import checkpoint
from linen_moe import testing
from linen_moe._src.parallel import launcher
from linen_moe._src.testing import helpers
from linen_moe_cli import main as cli
from tests import workers
from tests.run import test_stop

TRAIN = ["--set", "num_layers=1", "--batch-size", "2", "--seq-len", "8"]
TRAIN += ["--no-progress"]
GRACE_S = 30  # what TPU VMs, GCE and Kubernetes give after SIGTERM
STEPS = 40  # room for the stops from outside, which land where they may
# Real data on 1 or 2 processes: 2 rows a process (a global batch of one
# row a process makes Grain's endless dataset overflow when sliced).
DATA_TRAIN = [a if a != "2" else "4" for a in TRAIN]


def _committed(directory: str) -> list[int]:
  with checkpoint.Checkpoints(directory, create=False) as ckpts:
    return ckpts.all_steps()


def _loads(test, directory: str, step: int) -> None:
  """Checkpoint `step` of `directory` reads: its metadata and every array."""
  with checkpoint.Checkpoints(directory, create=False) as ckpts:
    test.assertEqual(ckpts.meta(step)["step"], step)
    tree = ckpts.read(step, checkpoint.abstract(ckpts.saved_leaves(step)))
  test.assertEqual(int(tree["step"]), step)


def _lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    return f.read().count("\n")


def _env(processes: int) -> dict[str, str]:
  """A process's environment, on one CPU device. In a group, without the
  persistent compilation cache: its key leaves out where a program was
  traced from, and a collective over gloo loaded from an entry traced
  from another call stack (the worker's, the command's) hangs (measured,
  jax 0.12.1)."""
  env = workers.env(devices=1)
  if processes > 1:
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  return env


def _train_process(argv: list[str], processes: int = 1) -> subprocess.Popen:
  """`linen-moe train ARGV` as a process of its own, on one CPU device
  (one of `processes`)."""
  return subprocess.Popen(
      [sys.executable, "-m", "linen_moe_cli.main", "train", *argv],
      cwd=workers.ROOT,
      env=_env(processes),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )


def _signal_after_rows(test, procs, metrics: str, rows: int, signum):
  """Sends `signum` (None: none) to `procs` once `metrics` holds more than
  `rows` rows; returns when."""
  while _lines(metrics) <= rows:
    test.assertTrue(all(p.poll() is None for p in procs), "ended too soon")
    time.sleep(0.02)
  sent = time.monotonic()
  for p in procs:
    if signum is not None:
      p.send_signal(signum)
  return sent


STOPPED = re.compile(
    r"linen-moe: stopped by (SIG\w+) after step (\d+) of (\d+); its "
    r"checkpoint is (\S+)\. Resume with(?: \(on each of the 2 processes\))?: "
    r"(.*)$"
)


class SigtermCommandTest(absltest.TestCase):
  """The default run's case: `linen-moe train` sent SIGTERM from outside
  after its second step; resumed by the command it prints, in this
  process."""

  def test_sigterm_saves_its_step_and_resumes_exactly(self):
    tmp = helpers.tempdir(self)
    split = os.path.join(tmp, "split")
    argv = [*TRAIN, "--steps", "300", "--save-every", "4"]
    argv += ["--checkpoint-dir", split]
    proc = _train_process(argv)
    self.addCleanup(proc.kill)
    metrics = os.path.join(split, "metrics.jsonl")
    sent = _signal_after_rows(self, [proc], metrics, 1, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    seconds = time.monotonic() - sent
    self.assertEqual(proc.returncode, 143, err)
    self.assertLess(seconds, 10)
    line = err.strip().splitlines()[-1]
    match = STOPPED.fullmatch(line)
    self.assertIsNotNone(match, line)
    name, step, steps, saved, resume = match.groups()
    stop = int(step)
    self.assertEqual((name, steps), ("SIGTERM", "300"))
    self.assertEqual(saved, os.path.join(split, step))
    self.assertEqual(resume, "linen-moe train " + " ".join(argv))
    self.assertEqual(_committed(split)[-1], stop)  # committed, the latest
    self.assertEqual(
        [r["step"] for r in helpers.run_metrics(split, recipe_steps=False)],
        list(range(1, stop + 1)),
    )
    self.assertFalse(os.path.exists(os.path.join(split, "run.lock")))

    # The printed command (with fewer --steps) resumes, to the bit.
    again = [a if a != "300" else str(stop + 2) for a in argv]
    code, out, err = testing.run_capturing(cli.main, ["train", *again])
    self.assertEqual(code, 0, err)
    self.assertIn(f"resumed from step {stop}", out)
    whole = os.path.join(tmp, "whole")
    code, _, err = testing.run_capturing(
        cli.main,
        ["train", *TRAIN, "--steps", str(stop + 2), "--checkpoint-dir", whole],
    )
    self.assertEqual(code, 0, err)
    self.assertEqual(
        helpers.run_metrics(split, recipe_steps=False),
        helpers.run_metrics(whole, recipe_steps=False),
    )

  def test_bad_step_timeout_is_one_line(self):
    code, _, err = testing.run_capturing(
        cli.main, ["train", *TRAIN, "--step-timeout", "-1"]
    )
    self.assertEqual((code, err.count("\n")), (2, 1), err)
    self.assertRegex(
        err, r"^linen-moe: error: step_timeout=-1.0 \(--step-timeout\) is "
    )


# ------------------------------------------------------------------- slow ---


def _ids_file(test) -> str:
  """A corpus of pre-tokenized ids (one .npy document, the tiny configs'
  vocabulary): real data without a tokenizer."""
  path = os.path.join(helpers.tempdir(test), "ids.npy")
  rng = np.random.default_rng(0)
  np.save(path, rng.integers(0, 256, size=6000, dtype=np.int32))
  return path


def _group(runs: list[dict], processes: int) -> list[subprocess.Popen]:
  """`tests.cli_stop_worker RUNS` on `processes` processes (1 CPU device
  each), started."""
  return [
      subprocess.Popen(
          [sys.executable, "-m", "tests.cli_stop_worker", json.dumps(runs)]
          + ["--heartbeat-timeout", "10", *flags],
          cwd=workers.ROOT,
          env=_env(processes),
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for flags in launcher.process_flags(processes)
  ]


def _finish(test, procs, timeout: float = 900):
  """Waits for a group: (return codes, each process's JSON lines, each
  one's stderr, when each ended: Unix time)."""
  ended, outputs = {}, []
  deadline = time.monotonic() + timeout
  while len(ended) < len(procs):
    test.assertLess(time.monotonic(), deadline, "the group did not end")
    for i, p in enumerate(procs):
      if i not in ended and p.poll() is not None:
        ended[i] = time.time()
    time.sleep(0.05)
  errs = []
  for p in procs:
    out, err = p.communicate(timeout=60)
    outputs.append([json.loads(x) for x in out.splitlines() if x[:1] == "{"])
    errs.append(err)
  return [p.returncode for p in procs], outputs, errs, ended


class _Chain(absltest.TestCase):
  """One run directory stopped at ten points in turn, each run resuming
  where the last stopped, and run to the end; against an uninterrupted
  run of the same processes. `processes` runs each command on that many
  processes."""

  processes = 1

  def setUp(self):
    super().setUp()
    self.tmp = helpers.tempdir(self)
    self.ids = _ids_file(self)
    self.dir = os.path.join(self.tmp, "chain")
    self.whole = os.path.join(self.tmp, "whole")
    self.stops: list[tuple[int, int]] = []  # (exit status, step)

  def argv(self, directory: str, steps: int = STEPS) -> list[str]:
    return [
        *DATA_TRAIN,
        "--data",
        self.ids,
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--save-every",
        "4",
        "--steps",
        str(steps),
        "--checkpoint-dir",
        directory,
    ]

  def group(self, runs):
    codes, outputs, errs, ended = _finish(self, _group(runs, self.processes))
    return codes, outputs, errs, ended

  def check_stopped(self, step, signum, line, seconds, state=None):
    """The run stopped after `step` within the grace period, printing
    `line`: its checkpoint committed, the latest; the rows of steps
    1..step, once each; the directory unlocked. `state`: the worker's
    record of the directory after the run (None: read it now)."""
    self.assertRegex(
        line,
        rf"^linen-moe: stopped by {signal.Signals(signum).name} after step "
        rf"{step} of {STEPS}; its checkpoint is {self.dir}/{step}\. Resume",
    )
    if state is None:
      state = {
          "committed": _committed(self.dir),
          "rows": [
              r["step"]
              for r in helpers.run_metrics(self.dir, recipe_steps=False)
          ],
          "locked": os.path.exists(os.path.join(self.dir, "run.lock")),
      }
    self.assertEqual(state["committed"][-1], step, line)
    self.assertEqual(state["rows"], list(range(1, step + 1)), line)
    self.assertFalse(state["locked"], line)
    self.assertLess(seconds, GRACE_S, line)
    self.stops.append((128 + signum, step))

  def start(self) -> int:
    """The step the next run resumes from."""
    steps = _committed(self.dir) if os.path.isdir(self.dir) else []
    return steps[-1] if steps else 0

  def in_process_points(self, points: list[list[dict]]) -> None:
    """The uninterrupted run, then one run per point (faults sent by the
    worker to itself as a phase begins), all in one group of processes."""
    runs = [{"argv": self.argv(self.whole)}]
    runs += [{"argv": self.argv(self.dir), "faults": f} for f in points]
    codes, outputs, errs, _ = self.group(runs)
    self.assertEqual(codes, [0] * self.processes, errs)
    self.assertEqual(outputs[0][0]["code"], 0)
    steps = [f[0]["step"] for f in points]
    for n, faults in enumerate(points, start=1):
      signum = faults[0]["signal"]
      # A signal in a step's save (after its stop agreement): the next.
      step = steps[n - 1] + (faults[0]["phase"] == "save")
      for p in range(self.processes):
        record = outputs[p][n]
        self.assertEqual(record["code"], 128 + signum, (n, p, record))
      seconds = [
          o[n]["after_signal_s"] for o in outputs if o[n]["after_signal_s"]
      ]
      record = outputs[0][n]
      self.check_stopped(step, signum, record["line"], max(seconds), record)
    _loads(self, self.dir, step)

  def from_outside(self, signum: int) -> None:
    """A `linen-moe train` (group) sent `signum` at a random moment of its
    fifth step."""
    argv = self.argv(self.dir)
    procs = [
        _train_process(argv + flags, self.processes)
        for flags in launcher.process_flags(self.processes)
    ]
    for p in procs:
      self.addCleanup(p.kill)
    metrics = os.path.join(self.dir, "metrics.jsonl")
    rows = self.start()
    # Past compiling (three new rows: a step and an evaluation), then a
    # random moment of the next step.
    _signal_after_rows(self, procs, metrics, rows + 2, None)
    seen, t0 = _lines(metrics), time.monotonic()
    _signal_after_rows(self, procs, metrics, seen, None)
    rng = np.random.default_rng(len(self.stops))
    time.sleep(rng.uniform(0, time.monotonic() - t0))
    sent, at = time.monotonic(), _lines(metrics)
    for p in procs:
      p.send_signal(signum)
    errs = []
    for p in procs:
      out, err = p.communicate(timeout=300)
      self.assertEqual(p.returncode, 128 + signum, (rows, seen, at, out, err))
      errs.append(err)
    seconds = time.monotonic() - sent
    line = errs[0].strip().splitlines()[-1]  # process 0's
    step = int(re.search(r"after step (\d+)", line).group(1))
    self.check_stopped(step, signum, line, seconds)

  def killed_in_the_stop_save(self, second: int) -> None:
    """SIGTERM in a step, then `second` (SIGTERM or SIGKILL) while the
    stop's checkpoint is committed: the process ends at once; the last
    committed checkpoint stays the latest, and loads."""
    before = self.start()
    step = before + 2
    faults = [
        {"signal": 15, "phase": "step", "step": step},
        {"second": second},
    ]
    codes, _, errs, _ = self.group(
        [{"argv": self.argv(self.dir), "faults": faults}]
    )
    want = 143 if second == signal.SIGTERM else -signal.SIGKILL
    self.assertEqual(codes, [want] * self.processes, (before, errs))
    if second == signal.SIGTERM:
      self.assertIn("a second SIGTERM: exiting at once", errs[0])
    # The stop's checkpoint is not committed; a periodic one before it is.
    latest = max([before] + [s for s in range(before + 1, step) if s % 4 == 0])
    self.assertEqual(_committed(self.dir)[-1], latest, before)
    _loads(self, self.dir, latest)
    self.assertGreaterEqual(
        len(helpers.run_metrics(self.dir, recipe_steps=False)), step
    )  # resumed over

  def finish(self) -> None:
    """Runs the chain to the end: every row equals the uninterrupted
    run's, to the bit."""
    codes, outputs, errs, _ = self.group([{"argv": self.argv(self.dir)}])
    self.assertEqual(codes, [0] * self.processes, errs)
    self.assertEqual(outputs[0][0]["code"], 0)
    whole = helpers.run_metrics(self.whole, recipe_steps=False)
    self.assertEqual([r["step"] for r in whole], list(range(1, STEPS + 1)))
    self.assertTrue(any("eval_loss" in r for r in whole))
    self.assertEqual(helpers.run_metrics(self.dir, recipe_steps=False), whole)


@testing.slow
class OneProcessChainTest(_Chain):
  """Ten stops of one process: SIGTERM as data, a step, an evaluation, a
  save (then in flight) or the stop agreement begins; Ctrl-C in a step;
  SIGTERM and SIGINT from outside at random moments; a second SIGTERM and
  a SIGKILL while the stop's checkpoint is committed."""

  processes = 1

  def test_ten_stops(self):
    self.in_process_points([
        [{"signal": 15, "phase": "data", "step": 2}],
        [{"signal": 15, "phase": "step", "step": 3}],
        [{"signal": 15, "phase": "eval", "step": 6}],
        [
            {"signal": 15, "phase": "save", "step": 8},
            {"slow_commit": 1.0, "step": 8},
        ],
        [{"signal": 15, "phase": "stop agreement", "step": 10}],
        [{"signal": 2, "phase": "step", "step": 11}],
    ])
    self.killed_in_the_stop_save(signal.SIGTERM)
    self.killed_in_the_stop_save(signal.SIGKILL)
    self.from_outside(signal.SIGTERM)
    self.from_outside(signal.SIGINT)
    self.assertLen(self.stops, 8)  # and the two killed
    self.assertLess(self.stops[-1][1], STEPS)
    self.finish()


@testing.slow
class TwoProcessChainTest(_Chain):
  """Ten stops of two processes: SIGTERM to process 1, process 0 or both as
  data, a step, an evaluation, a save (then in flight) or the stop
  agreement begins; Ctrl-C to process 1; SIGTERM to one and Ctrl-C to the
  other in the same step (both stop for process 0's); SIGTERM to both from
  outside at a random moment; a second SIGTERM and a SIGKILL to both while
  the stop's checkpoint is committed."""

  processes = 2

  def test_ten_stops(self):
    self.in_process_points([
        [{"signal": 15, "phase": "data", "step": 2, "process": 1}],
        [{"signal": 15, "phase": "step", "step": 3, "process": 0}],
        [{"signal": 15, "phase": "eval", "step": 6}],
        [
            {"signal": 15, "phase": "save", "step": 8, "process": 1},
            {"slow_commit": 1.0, "step": 8},
        ],
        [{"signal": 15, "phase": "stop agreement", "step": 10, "process": 0}],
        [{"signal": 2, "phase": "step", "step": 11, "process": 1}],
        [
            {"signal": 15, "phase": "step", "step": 13, "process": 0},
            {"signal": 2, "phase": "step", "step": 13, "process": 1},
        ],
    ])
    self.killed_in_the_stop_save(signal.SIGTERM)
    self.killed_in_the_stop_save(signal.SIGKILL)
    self.from_outside(signal.SIGTERM)
    self.assertLen(self.stops, 8)
    self.assertLess(self.stops[-1][1], STEPS)
    self.finish()


@testing.slow
class HangTest(absltest.TestCase):
  """Process 1 of 2 stops before the stop agreement of step 5 (a sleep of
  2 minutes, outside any watched phase); process 0 waits in that
  collective, runs past `--step-timeout 5` and exits with status 75 within
  5 + 10 s, its stacks on stderr and in the run directory. The same
  command then resumes the run, to an uninterrupted run's metrics."""

  def test_one_of_two_processes_hangs(self):
    tmp = helpers.tempdir(self)
    ids = _ids_file(self)
    run, whole = os.path.join(tmp, "run"), os.path.join(tmp, "whole")

    def argv(directory, *extra):
      return [
          *DATA_TRAIN,
          "--data",
          ids,
          "--steps",
          "8",
          "--save-every",
          "2",
          "--checkpoint-dir",
          directory,
          *extra,
      ]

    hang = {"hang": 120, "phase": "stop agreement", "step": 5, "process": 1}
    procs = _group(
        [
            {"argv": argv(whole)},
            {"argv": argv(run, "--step-timeout", "5"), "faults": [hang]},
        ],
        2,
    )
    for p in procs:
      self.addCleanup(p.kill)
    while procs[0].poll() is None:
      time.sleep(0.05)
    ended = time.time()
    procs[1].kill()  # it would end when the coordinator's heartbeats stop
    _, err = procs[0].communicate(timeout=60)
    out, _ = procs[1].communicate(timeout=60)
    self.assertEqual(procs[0].returncode, 75, err)
    started = [json.loads(x) for x in out.splitlines() if "hang_started" in x]
    self.assertLen(started, 1, [x for x in err.splitlines() if "past" in x])
    self.assertLess(ended - started[0]["hang_started"], 5 + 10)
    stacks = os.path.join(run, "stacks.process_0.txt")
    head = (
        "linen-moe: step 5: stop agreement ran past step_timeout 5s on "
        f"process 0 of 2; every thread's stack follows (also in {stacks})."
    )
    written = test_stop.assert_stacks(self, err, stacks, head)
    self.assertIn("in should_stop", written)  # the collective it waits in
    self.assertFalse(os.path.exists(os.path.join(run, "run.lock")))

    codes, _, errs, _ = _finish(
        self, _group([{"argv": argv(run, "--step-timeout", "5")}], 2)
    )
    self.assertEqual(codes, [0, 0], errs)
    self.assertEqual(
        helpers.run_metrics(run, recipe_steps=False),
        helpers.run_metrics(whole, recipe_steps=False),
    )


@testing.slow
class ProcessCountTest(absltest.TestCase):
  """Come back smaller, or larger: a run on real data stopped by SIGTERM
  after step 2 on 2 processes resumes on 1 (and one stopped on 1 resumes
  on 2) through the command, data position included: its 5 steps' losses
  equal an uninterrupted run's to float rounding. A mesh the next
  allocation cannot hold is a one-line error naming it."""

  def test_two_to_one_and_one_to_two(self):
    tmp = helpers.tempdir(self)
    ids = _ids_file(self)
    dirs = {k: os.path.join(tmp, k) for k in ("whole", "two_one", "one_two")}

    def argv(name, *extra):
      return [
          *DATA_TRAIN,
          "--data",
          ids,
          "--steps",
          "5",
          "--checkpoint-dir",
          dirs[name],
          *extra,
      ]

    term = [{"signal": 15, "phase": "step", "step": 2, "process": 1}]
    two = _group(
        [{"argv": argv("two_one", "--mesh", "data=2"), "faults": term}], 2
    )
    codes, outputs, errs, _ = _finish(self, two)
    self.assertEqual(codes, [0, 0], errs)
    self.assertEqual([o[0]["code"] for o in outputs], [143, 143])
    self.assertEqual(outputs[0][0]["committed"], [2])
    one = _group(
        [
            {"argv": argv("whole")},
            {
                "argv": argv("one_two"),
                "faults": [{"signal": 15, "phase": "step", "step": 2}],
            },
        ],
        1,
    )
    codes, outputs, errs, _ = _finish(self, one)
    self.assertEqual(codes, [0], errs)
    self.assertEqual([r["code"] for r in outputs[0]], [0, 143])

    # 2 -> 1: the saved mesh needs 2 devices; this allocation has 1.
    proc = _train_process(argv("two_one", "--mesh", "data=2"))
    _, err = proc.communicate(timeout=300)
    self.assertEqual(proc.returncode, 2, err)
    self.assertRegex(
        err.strip().splitlines()[-1],
        r"^linen-moe: error: Mesh 'data=2' has 2 devices .* but 1 are "
        r"available",
    )
    codes, _, errs, _ = _finish(self, _group([{"argv": argv("two_one")}], 1))
    self.assertEqual(codes, [0], errs)
    codes, _, errs, _ = _finish(self, _group([{"argv": argv("one_two")}], 2))
    self.assertEqual(codes, [0, 0], errs)

    whole = helpers.run_metrics(dirs["whole"], recipe_steps=False)
    self.assertEqual([r["step"] for r in whole], [1, 2, 3, 4, 5])
    for name in ("two_one", "one_two"):
      rows = helpers.run_metrics(dirs[name], recipe_steps=False)
      self.assertEqual([r["step"] for r in rows], [1, 2, 3, 4, 5], name)
      np.testing.assert_allclose(
          [r["cross_entropy"] for r in rows],
          [r["cross_entropy"] for r in whole],
          rtol=1e-6,
          err_msg=name,
      )
