"""A training run of the reference decoder, start to end: `run`.

On synthetic Markov data or the user's files (`sources`), from scratch, from
a Hugging Face checkpoint or resumed from its own checkpoints
(`checkpoints`), with the optimizer its options say (`schedule`), its
throughput measured (`throughput`), in one process or several. What
`linen-moe train` does, callable from Python.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Sequence
import contextlib
import dataclasses
import os
import time

import jax
import numpy as np

from linen_moe._src.checkpoint import meta as ckpt_meta
from linen_moe._src.checkpoint import tree as ckpt_tree
from linen_moe._src.parallel import distributed
from linen_moe._src.run import banner
from linen_moe._src.run import callbacks as cbs
from linen_moe._src.run import host_memory
from linen_moe._src.run import init_from
from linen_moe._src.run import progress
from linen_moe._src.run import recipes
from linen_moe._src.run import schedule
from linen_moe._src.run import setup
from linen_moe._src.run import sources
from linen_moe._src.run import throughput
from linen_moe._src.run import tokenizer_files
from linen_moe._src.run import watchdog
from linen_moe._src.run.callbacks import Callback
from linen_moe._src.run.callbacks import RunInfo
from linen_moe._src.run.callbacks import StepInfo
from linen_moe._src.run.checkpoints import RunCheckpoints
from linen_moe._src.run.options import RunOptions
from linen_moe._src.run.options import RunStopped
from linen_moe._src.run.result import TAIL_STEPS
from linen_moe._src.run.result import RunResult
from linen_moe._src.run.stop import RunInterrupted
from linen_moe._src.run.stop import StopRequest
from linen_moe._src.training.frontend import LinenFrontend
from linen_moe._src.training.frontend import TrainingFrontend


def run(
    opts: RunOptions,
    frontend: TrainingFrontend | None = None,
    *,
    log: Callable[[str], None] = print,
    callbacks: Sequence[Callback] = (),
) -> RunResult:
  """Trains the reference decoder as `opts` says, as `linen-moe train` does.

  Example usage:

    result = linen_moe.training.run(
        RunOptions(config="tiny_mixtral", steps=300, checkpoint_dir="runs/a")
    )
    print(result.final_loss, result.best_loss)

  Args:
    opts: what to train, on what, for how long, and where to save.
    frontend: the decoder and train step (`TrainingFrontend`; default
      `LinenFrontend`, the Linen `Decoder`; `nnx_adapter.NNXFrontend` for
      the NNX one). A checkpoint of one resumes in the other.
    log: where the run's messages go (resumes, skipped checkpoints, the
      held-out losses when there is no progress bar, the chart).
    callbacks: `Callback`s to call at the start, after every step and at
      the end, after the run's own (progress, throughput, profiler,
      held-out loss, TensorBoard, checkpoints); one whose `name` is one of
      those takes its place (`linen_moe._src.run.callbacks`). A callback
      may add metrics to the step's row, stop the run (`RunInfo.stop`:
      the step saved, the result's `stop_reason` set), or raise (the step
      saved, then `RunStopped` from its exception).

  Returns:
    The `RunResult` (the losses of the steps this call ran, the best
    achievable loss of synthetic data, the skipped steps, the expert loads
    and the held-out losses).

  Raises:
    TypeError: `opts` is not a `RunOptions`.
    ValueError: bad data, a checkpoint of another run, a directory another
      run holds: before the first step.
    RunStopped: the run stopped on purpose (too many skipped steps in a row,
      a failed save), saying where and why.
    RunInterrupted: (a RunStopped) a SIGTERM or SIGINT stopped the run
      after a step, that step saved (see below).

  A batch holding an id outside [0, vocab_size) is a `ValueError`
  (`linen_moe.tokens.validate_tokens`) before its step.

  With `opts.mesh` (e.g. "data=2,expert=4", see `sharding.make_mesh`) the
  state is sharded at initialisation and every step runs on that mesh. One
  of several processes (`jax.distributed`) trains on a mesh over every
  process's devices (default: "data=<global device count>"); each process
  generates the same global batches from the seed and places only its own
  shards, and only process 0 shows the progress bar. Step i (from 0) trains
  on batch i of the data stream `seed + 1` with the key
  `fold_in(key(seed), i)`, so a run is a function of its step.

  With `opts.data` the batches are the user's files through
  `linen_moe.data.DataPipeline` (shuffled with `seed + 1`; each process
  reads only the rows its devices hold), a padded batch's mask keeps the
  padding out of the loss, every checkpoint holds the Grain iterator's
  state, and with `opts.eval_every` the held-out loss is printed and
  written (`eval_loss`, `eval_perplexity`), and charted beside the metrics
  at the end (`loss_chart`). Every problem with the files is a
  `ValueError` before the first step.

  With `opts.checkpoint_dir` the run first locks the directory
  (`RunLock`; process 0 of a group, for all), then resumes
  from the newest checkpoint there that reads, or `opts.resume_step` (in
  any front end, layer mode or mesh), saves every `save_every` steps and
  always its last, keeps the latest `keep`, and appends one JSON line per
  step to `checkpoint_dir/metrics.jsonl` (`RunCheckpoints`).

  The optimizer is AdamW with the schedule and weight decay of the flags
  (`schedule`); each metrics row has the step's `learning_rate`, and a
  resumed run continues the schedule of the run it resumes.

  A step with a non-finite loss or gradient is skipped (the state stays as
  it was; `linen_moe.training.skip`) and counted; after
  `max_consecutive_skips` skipped steps in a row the run stops with
  `RunStopped`.

  A SIGTERM or SIGINT (`StopRequest`) lets the step in flight finish;
  every process stops after the same step, which is saved (after any save
  in flight), its metrics row written, TensorBoard flushed, the directory
  unlocked, and the run raises `RunInterrupted`. A second signal exits at
  once with 128 + its number. With `opts.step_timeout` a phase of a step
  that hangs ends the process (`STEP_TIMEOUT_EXIT`, the stacks written).
  """
  if not isinstance(opts, RunOptions):
    raise TypeError(f"opts must be a RunOptions; got {type(opts).__name__}.")
  callbacks = list(callbacks)
  cbs.arrange({}, callbacks)  # a TypeError for a non-Callback, before work
  fe = LinenFrontend() if frontend is None else frontend
  # Processes started with other options would wait in their first
  # collective forever: one clear error on each instead.
  options = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
  distributed.check_same(
      {**options, "frontend": fe.name}, ignore=("progress", "log_every")
  )
  held = []  # the lock, released by the exits that skip `finally`
  release = lambda: [lock.release() for lock in held]  # noqa: E731
  with (
      StopRequest(on_exit=release) as stop,
      watchdog.Watchdog(
          opts.step_timeout,
          platform=jax.default_backend(),
          directory=opts.checkpoint_dir
          and os.path.abspath(opts.checkpoint_dir),
          process=(jax.process_index(), jax.process_count()),
          on_exit=release,
      ) as watch,
  ):
    return _run(opts, fe, log, _Guard(stop, watch), held, callbacks)


@dataclasses.dataclass(frozen=True)
class _Guard:
  """What a run's steps are watched by: the stop request and the
  watchdog."""

  stop: StopRequest
  watch: watchdog.Watchdog


def _run(
    opts: RunOptions, fe, log, guard: _Guard, held: list, callbacks: list
) -> RunResult:
  lock = None
  if opts.checkpoint_dir is not None:
    lock = setup.lock(opts.checkpoint_dir, log)
    held.append(lock)
  try:
    if opts.checkpoint_dir is None:
      job = setup.set_up(opts, fe, schedule.settings(opts))
      return _train_from(
          opts,
          job,
          None,
          resume=False,
          log=log,
          guard=guard,
          callbacks=callbacks,
      )
    ckpts = RunCheckpoints(
        opts.checkpoint_dir,
        steps=opts.steps,
        save_every=opts.save_every,
        keep=opts.keep,
        log=log,
    )
    try:
      latest = opts.resume_step
      if latest is None:
        latest = ckpts.latest_step()
      job = setup.set_up(
          opts, fe, setup.optimizer_settings(opts, ckpts, latest, log)
      )
      tokenizer_files.keep(
          opts, sources.tokenizer_path(opts), ckpts.main_process
      )
      if latest is not None and latest >= opts.steps:
        log(
            f"{opts.checkpoint_dir} is already at step {latest} (`steps` "
            f"{opts.steps}); nothing to train."
        )
        result = RunResult([], job.data.best_loss, start_step=latest)
      else:
        result = _train_from(
            opts,
            job,
            ckpts,
            resume=bool(ckpts.steps()),
            log=log,
            guard=guard,
            callbacks=callbacks,
        )
    except BaseException:
      ckpts.close(report=False)
      raise
    ckpts.close()  # waits for the last save; a failed one stops the run
    return result
  finally:
    if lock is not None:
      lock.release()
      held.remove(lock)


def _train_from(
    opts: RunOptions,
    job: setup.Setup,
    ckpts,
    *,
    resume: bool,
    log,
    guard: _Guard,
    callbacks: Sequence[Callback],
) -> RunResult:
  """Restores a checkpoint (`resume`) or initialises, records the start,
  and trains to the end, or to the step after which a signal or a
  callback stops it."""
  start, state, rng = _restore_or_init(opts, job, ckpts, resume, log)
  run_info, observers, last = _record_start(
      opts, job, ckpts, start, state, rng, callbacks, log
  )
  if guard.stop.should_stop():  # during set-up: nothing new to save
    resumed = ckpts and start and ckpts.step_dir(start)
    raise RunInterrupted(guard.stop.signal, start, opts.steps, resumed or None)
  everyone = [*observers, *([last] if last else [])]
  for cb in everyone:
    cb.on_start(run_info)
  error = None
  try:
    return _steps(opts, job, run_info, state, rng, (observers, last), guard)
  except BaseException as e:
    error = e
    raise
  finally:
    for cb in everyone:
      cb.on_end(run_info, error)


def _restore_or_init(opts: RunOptions, job: setup.Setup, ckpts, resume, log):
  """(start step, state, rng): the checkpoint's (`resume`) or a fresh
  state's, with the weights of `init_from_hf` or `init_from`."""
  fe, run, cfg, source = job.fe, job.run, job.cfg, job.data
  fill = source.meta.get("pipeline", {}).get("fill_fraction")
  if fill is not None:
    log(f"packing first_fit: {100 * fill:.1f}% of positions hold tokens.")
  # The state's shapes (and a fresh one's values) come from any batch.
  sample = source.sample()
  start, state, rng = 0, None, jax.random.key(opts.seed)
  if resume:
    start, state, rng = ckpts.resume(
        fe,
        run,
        cfg,
        job.optimizer,
        sample,
        opts.seed,
        opts.fresh_fp8_state,
        opts.resume_step,
        check_data=source.check_meta,
    )
    source.restore(ckpts, start)
  if state is not None:
    return start, state, rng
  state = (
      run.init(sample, rng) if run else fe.init(cfg, job.optimizer, sample, rng)
  )
  if opts.init_from_hf is not None:
    variables = setup.load_hf(opts.init_from_hf, cfg, job.device_mesh)
    state = setup.with_variables(fe, state, variables)
    del variables
    if run is not None:
      state = run.place(state, sample, rng)
  elif opts.init_from is not None:
    state = init_from.load(opts.init_from, fe, state, cfg, log)
  return start, state, rng


def _record_start(opts, job, ckpts, start, state, rng, callbacks, log):
  """The banner, and the run's observers (`callbacks.arrange`): the
  defaults (the checkpoints' with the metadata every save carries) and the
  user's. Returns (`RunInfo`, the observers before the stop agreement,
  the one after it or None)."""
  cfg, source, main = job.cfg, job.data, distributed.is_main_process()
  # Shapes only: a cast of a global array would be a program that the
  # other processes do not run.
  params = job.fe.checkpoint_tree(ckpt_tree.abstract(state))
  devices = setup.run_devices(job)
  if main:
    for line in banner.lines(
        opts,
        cfg,
        params[ckpt_tree.VARIABLES]["params"],
        source.meta,
        devices,
        job.mesh,
        job.optimizer_settings,
        first_step=start + 1,
    ):
      log(line)
  run_info = RunInfo(opts, cfg, job.fe, start, ckpts, main, log)
  defaults = {
      "throughput": cbs.Throughput(
          throughput.Throughput(cfg, opts.batch_size, opts.seq_len, devices)
      ),
      "progress": cbs.Progress(
          lambda run: progress.StepReport(
              start,
              opts.steps,
              main=main,
              bar=opts.progress,
              every=opts.log_every,
              best_loss=source.best_loss,
              log=log,
          )
      ),
  }
  if opts.eval_every is not None:
    evaluate = sources.Evaluator(cfg, job.fe, job.run, source)
    defaults["evaluation"] = cbs.HeldOut(evaluate, opts.eval_every)
  if opts.profile_steps is not None:
    where = os.path.join(opts.checkpoint_dir, throughput.PROFILE_DIR)
    defaults["profiler"] = cbs.Profiler(
        throughput.Profiler(opts.profile_steps, where)
    )
  if opts.tensorboard is not None and main:
    defaults["tensorboard"] = cbs.TensorBoard(
        throughput.TensorBoard(opts.tensorboard)
    )
  if ckpts is not None:
    recipe = recipes.record(opts.recipe.name, job.optimizer_settings, opts)
    meta = _checkpoint_meta(opts, job, rng, recipe)
    defaults["checkpoints"] = cbs.Checkpoints(
        ckpts, meta, recipe, job.fe.checkpoint_tree, source, log
    )
  observers, last = cbs.arrange(defaults, list(callbacks))
  return run_info, observers, last


def _checkpoint_meta(opts, job, rng, recipe: dict) -> dict:
  """What every checkpoint of the run carries besides its step's row."""
  return {
      "model_config": ckpt_meta.config_dict(job.cfg),
      "rng": ckpt_meta.rng_to_json(rng),
      "data": job.data.meta,
      "run": {
          "config": opts.model_name,
          "init_from_hf": opts.init_from_hf,
          "init_from": opts.init_from,
          "recipe": recipe["name"],
          "frontend": job.fe.name,
          "mesh": job.mesh,
          "seed": opts.seed,
          "optimizer": job.optimizer_settings,
      },
  }


def _steps(opts, job, run_info, state, rng, observers, guard) -> RunResult:
  """The steps from `run_info.start_step + 1` to `opts.steps` (or the
  stop), each followed by the observers (`_observe`)."""
  fe, cfg, source = job.fe, job.cfg, job.data
  step_fn = (
      job.run.step
      if job.run
      else jax.jit(
          fe.make_step(cfg, job.optimizer, opts.grad_accum), donate_argnums=0
      )
  )
  start, watch = run_info.start_step, guard.watch.phase
  stream = source.batches(start)
  losses, skipped, in_a_row = [], 0, 0
  loads = collections.deque(maxlen=TAIL_STEPS)
  held_out = next((o for o in observers[0] if isinstance(o, cbs.HeldOut)), None)
  for i in range(start, opts.steps):
    began = time.perf_counter()
    with watch("data", i + 1):
      tokens, *extras = next(stream)
    key = jax.random.fold_in(rng, i)
    while extras and extras[-1] is None:  # e.g. every position real: the
      extras.pop()  # unmasked loss, the step without a mask
    with watch("step", i + 1):
      state, metrics = step_fn(state, tokens, key, *extras)
      loss = float(metrics["cross_entropy"])
    seconds = time.perf_counter() - began
    if job.lr_schedule is not None:  # None: the user's own optimizer
      rate = schedule.learning_rate(job.lr_schedule, i, metrics)
      metrics = {**metrics, "learning_rate": rate}
    host_memory.settle()  # waits only where host memory is reused
    losses.append(loss)
    loads.append(metrics["expert_load"])
    in_a_row = in_a_row + 1 if int(metrics["skipped"]) else 0
    skipped += in_a_row > 0
    info = StepInfo(i + 1, loss, metrics, state, seconds, skipped)
    if _observe(run_info, info, observers, guard):
      break
    if in_a_row >= opts.max_consecutive_skips:
      raise RunStopped(
          f"stopped at step {i + 1} of {opts.steps}: the last {in_a_row} "
          f"steps ({i + 2 - in_a_row} to {i + 1}) were all skipped for a "
          "non-finite loss or gradient (`max_consecutive_skips` "
          f"{opts.max_consecutive_skips}; {skipped} skipped in all). The run "
          "is not recovering: lower `learning_rate`, or check the data."
      )
  return RunResult(
      losses,
      source.best_loss,
      skipped,
      expert_load=np.mean(jax.device_get(list(loads)), axis=0),
      start_step=start,
      eval_losses=list(held_out.losses) if held_out else [],
      stop_reason=run_info.stop_reason,
  )


def _observe(run_info: RunInfo, info: StepInfo, observers, guard) -> bool:
  """Calls the observers after step `info.step`: those before the stop
  agreement (the first exception skips the rest and stops the run), the
  agreement, then the one that records the step (saving it when the run
  stops). Returns whether a callback stopped the run (`RunInfo.stop`).

  Raises:
    RunInterrupted: a signal stopped the run (the step saved).
    RunStopped: a callback raised (the step saved), from its exception.
  """
  before, last = observers
  done, watch = info.step, guard.watch.phase
  failed = None
  for cb in before:
    try:
      with _watched(watch, cb.phase, done):
        cb.after_step(run_info, info)
    except Exception as e:  # noqa: BLE001 (any callback's: stop, saved)
      failed = (cbs.callback_name(cb), e)
      break
  with watch("stop agreement", done):  # a collective: every process
    signalled = guard.stop.should_stop() and done < run_info.steps
    asked = failed is not None or run_info.stop_reason is not None
    asked = _anywhere(asked and done < run_info.steps)
  info.stopping = signalled or asked
  if last is not None:
    with _watched(watch, last.phase, done):
      last.after_step(run_info, info)
  saved = (
      run_info.checkpoints
      and info.stopping
      and (run_info.checkpoints.step_dir(done))
  )
  if signalled:
    raise RunInterrupted(guard.stop.signal, done, run_info.steps, saved)
  if failed is not None:
    name, error = failed
    raise RunStopped(cbs.failure(name, error, done, saved)) from error
  if asked and run_info.stop_reason is None:
    run_info.stop_reason = "another process's callback stopped the run"
  return asked


def _watched(watch, phase: str | None, step: int):
  return contextlib.nullcontext() if phase is None else watch(phase, step)


def _anywhere(flag: bool) -> bool:
  """`flag` or-ed over every process (one all-gather in a group)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # noqa: PLC0415

  return bool(np.any(multihost_utils.process_allgather(np.array(flag))))
