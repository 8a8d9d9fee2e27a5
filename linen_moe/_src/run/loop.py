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
import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.checkpoint import manager as ckpt_manager
from linen_moe._src.checkpoint import meta as ckpt_meta
from linen_moe._src.checkpoint import tree as ckpt_tree
from linen_moe._src.config.files import load_model_config
from linen_moe._src.parallel import distributed
from linen_moe._src.parallel import sharding
from linen_moe._src.run import banner
from linen_moe._src.run import host_memory
from linen_moe._src.run import init_from
from linen_moe._src.run import loss_chart
from linen_moe._src.run import progress
from linen_moe._src.run import recipes
from linen_moe._src.run import schedule
from linen_moe._src.run import sources
from linen_moe._src.run import throughput
from linen_moe._src.run import tokenizer_files
from linen_moe._src.run import watchdog
from linen_moe._src.run.checkpoints import RunCheckpoints
from linen_moe._src.run.directory import RunLock
from linen_moe._src.run.options import RunOptions
from linen_moe._src.run.options import RunStopped
from linen_moe._src.run.stop import RunInterrupted
from linen_moe._src.run.stop import StopRequest
from linen_moe._src.training.frontend import LinenFrontend
from linen_moe._src.training.frontend import TrainingFrontend

# Steps over which the final loss and expert loads are averaged.
TAIL_STEPS = 10


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What a run did: the steps this call ran (none when a resumed run was
  already at its `steps`).

  Attributes:
    losses: per-step cross-entropy of steps `start_step + 1` onwards (NaN
      where the step was skipped).
    best_loss: the best achievable loss (the synthetic data's; NaN for real
      data).
    skipped_steps: how many steps were skipped.
    expert_load: <float32>[L, E] each layer's share of routed assignments
      per expert, averaged over the last `TAIL_STEPS` steps.
    start_step: the step the run started from (0, or the resumed one).
    eval_losses: the held-out losses [(step, nats)] of the evaluated steps
      (`eval_every`).
  """

  losses: list[float]
  best_loss: float
  skipped_steps: int = 0
  expert_load: np.ndarray | None = None
  start_step: int = 0
  eval_losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)

  @property
  def first_loss(self) -> float:
    return next((x for x in self.losses if math.isfinite(x)), math.nan)

  @property
  def final_loss(self) -> float:
    """Mean of the last `TAIL_STEPS` (10) steps' finite losses (less noisy
    than the last one); `linen-moe train` prints it so labelled."""
    tail = [x for x in self.losses[-TAIL_STEPS:] if math.isfinite(x)]
    return sum(tail) / len(tail) if tail else math.nan

  @property
  def load_ratio(self) -> float:
    """Max / min expert load of the most unbalanced layer (1 = balanced; inf
    when an expert got nothing), from `expert_load`."""
    load = self.expert_load[self.expert_load.sum(axis=-1) > 0]  # MoE layers
    with np.errstate(divide="ignore"):
      ratios = load.max(axis=-1) / load.min(axis=-1)
    return float(np.max(ratios))


@dataclasses.dataclass
class _Setup:
  """What a run builds before its first step (no compile yet)."""

  cfg: Any  # ModelConfig
  data: Any  # sources.MarkovSource or CorpusSource
  fe: Any  # TrainingFrontend
  optimizer: Any
  mesh: str | None
  run: Any  # sharded training, or None on one device
  feed: Callable[[np.ndarray], jax.Array]
  device_mesh: Any = None  # jax.sharding.Mesh, or None on one device
  optimizer_settings: dict = dataclasses.field(default_factory=dict)
  lr_schedule: Callable = None  # updates applied -> learning rate


def _set_up(
    opts: RunOptions, fe: TrainingFrontend, optimizer_settings: dict
) -> _Setup:
  mesh = opts.mesh
  if mesh is None and jax.process_count() > 1:
    mesh = f"data={jax.device_count()}"
  device_mesh = None if mesh is None else sharding.make_mesh(mesh)
  if opts.init_from is not None:
    cfg = init_from.model_config(opts.init_from, opts.overrides)
  elif opts.init_from_hf is None:
    cfg = load_model_config(opts.config, **opts.overrides)
  else:
    from linen_moe._src.hf import config_map  # noqa: PLC0415

    base = config_map.model_config(_read_json(opts.init_from_hf))
    cfg = base.replace(**opts.overrides)
  optimizer, lr_schedule = schedule.optimizer(optimizer_settings)
  run, feed = None, jnp.asarray
  if device_mesh is not None:
    run = fe.sharded(cfg, optimizer, device_mesh, opts.grad_accum)
    tokens_sharding = run.token_sharding()
    feed = lambda batch: distributed.global_array(  # noqa: E731
        batch.shape, tokens_sharding, batch
    )
  if opts.data is None:
    source = sources.MarkovSource(cfg, opts, feed)
  else:  # reads and checks the files: any error comes before any step
    source = sources.CorpusSource(cfg, opts, run)
  return _Setup(
      cfg=cfg,
      data=source,
      fe=fe,
      optimizer=optimizer,
      mesh=mesh,
      run=run,
      feed=feed,
      device_mesh=device_mesh,
      optimizer_settings=optimizer_settings,
      lr_schedule=lr_schedule,
  )


def _load_hf(directory: str, cfg, device_mesh):
  """The variables of the Hugging Face checkpoint in `directory` for the
  run's model `cfg`, loaded straight into the mesh's shardings."""
  from linen_moe._src.hf import load as hf_load  # noqa: PLC0415
  from linen_moe._src.lora import tree as lora_tree  # noqa: PLC0415

  loaded, variables = hf_load.load_checkpoint(
      directory,
      scan_layers=cfg.scan_layers,
      dtype=cfg.moe.param_dtype,
      mesh=device_mesh,
      quantization=cfg.moe.quantization,
      serving=cfg.moe.serving,
  )
  # The checkpoint is the base: the run's config without its adapters.
  base = lora_tree.without_adapters(cfg)
  ckpt_meta.check_model_config(ckpt_meta.config_dict(loaded), base, directory)
  return variables


def _read_json(directory: str) -> dict:
  import json  # noqa: PLC0415

  with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
    return json.load(f)


def _with_variables(fe, state, variables):
  """`state` (a fresh one) with its params from `variables`; the fp8 and
  routing state and the optimizer moments stay fresh."""
  from flax import traverse_util  # noqa: PLC0415

  flat = traverse_util.flatten_dict(fe.checkpoint_tree(state))
  for path, value in traverse_util.flatten_dict(
      {ckpt_tree.VARIABLES: {"params": variables["params"]}}
  ).items():
    if path not in flat:
      raise ValueError(f"The loaded checkpoint has no {'/'.join(path)}.")
    flat[path] = value
  return fe.from_checkpoint_tree(traverse_util.unflatten_dict(flat), state)


def run(
    opts: RunOptions,
    frontend: TrainingFrontend | None = None,
    *,
    log: Callable[[str], None] = print,
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
    return _run(opts, fe, log, _Guard(stop, watch), held)


@dataclasses.dataclass(frozen=True)
class _Guard:
  """What a run's steps are watched by: the stop request and the
  watchdog."""

  stop: StopRequest
  watch: watchdog.Watchdog


def _run(opts: RunOptions, fe, log, guard: _Guard, held: list) -> RunResult:
  lock = None
  if opts.checkpoint_dir is not None:
    lock = _lock(opts.checkpoint_dir, log)
    held.append(lock)
  try:
    if opts.checkpoint_dir is None:
      job = _set_up(opts, fe, schedule.settings(opts))
      return _train_from(opts, job, None, resume=False, log=log, guard=guard)
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
      job = _set_up(opts, fe, _optimizer_settings(opts, ckpts, latest, log))
      tokenizer_files.keep(
          opts, sources.tokenizer_path(opts), ckpts.main_process
      )
      if latest is not None and latest >= opts.steps:
        log(
            f"{opts.checkpoint_dir} is already at step {latest} (--steps "
            f"{opts.steps}); nothing to train."
        )
        result = RunResult([], job.data.best_loss, start_step=latest)
      else:
        resume = bool(ckpts.checkpoints.all_steps())
        result = _train_from(
            opts, job, ckpts, resume=resume, log=log, guard=guard
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


def _optimizer_settings(opts, ckpts, latest: int | None, log) -> dict:
  """The flags' optimizer settings, or those of the run that checkpoint
  `latest` continues (`schedule.resumed`: the same flags, the schedule's
  first length)."""
  wanted = schedule.settings(opts)
  if latest is None or latest not in ckpts.checkpoints.all_steps():
    return wanted
  try:
    saved = ckpts.checkpoints.meta(latest).get("run", {})
  except ckpt_manager.DamagedCheckpointError:
    return wanted  # the resume skips it, or names it
  return schedule.resumed(
      wanted, saved, ckpts.checkpoints.step_dir(latest), log
  )


def _lock(directory: str, log: Callable[[str], None]) -> RunLock | None:
  """Locks `directory` for this run: process 0 alone takes the lock and
  the others follow its decision (they stop too when it fails), before any
  process writes there. Returns process 0's lock (None elsewhere)."""
  if jax.process_count() == 1:
    return RunLock.acquire(directory, log=log)
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = RunLock.acquire(directory, log=log)
    except ValueError as e:
      error = e
  from jax.experimental import multihost_utils  # noqa: PLC0415

  locked = multihost_utils.broadcast_one_to_all(np.int32(error is None))
  if error is not None:
    raise error
  if not int(locked):
    raise ValueError(
        f"process 0 could not lock {os.path.abspath(directory)} (its error "
        "says why); every process stops."
    )
  return lock


def _train_from(
    opts: RunOptions, job: _Setup, ckpts, *, resume: bool, log, guard: _Guard
):
  """Restores a checkpoint (`resume`) or initialises, and trains to the
  end, or to the step after which `guard.stop` stops it."""
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
  if state is None:
    state = (
        run.init(sample, rng)
        if run
        else fe.init(cfg, job.optimizer, sample, rng)
    )
    if opts.init_from_hf is not None:
      variables = _load_hf(opts.init_from_hf, cfg, job.device_mesh)
      state = _with_variables(fe, state, variables)
      del variables
      if run is not None:
        state = run.place(state, sample, rng)
    elif opts.init_from is not None:
      state = init_from.load(opts.init_from, fe, state, cfg, log)
  # Shapes only: a cast of a global array would be a program that the
  # other processes do not run.
  params = fe.checkpoint_tree(ckpt_tree.abstract(state))
  if distributed.is_main_process():
    for line in banner.lines(
        opts,
        cfg,
        params[ckpt_tree.VARIABLES]["params"],
        source.meta,
        _run_devices(job),
        job.mesh,
        job.optimizer_settings,
    ):
      log(line)
  recipe = recipes.record(opts.recipe.name, job.optimizer_settings, opts)
  if run is None:
    step = jax.jit(
        fe.make_step(cfg, job.optimizer, opts.grad_accum), donate_argnums=0
    )
  else:
    step = run.step
  if ckpts is not None:
    ckpts.begin(
        start,
        {
            "model_config": ckpt_meta.config_dict(cfg),
            "rng": ckpt_meta.rng_to_json(rng),
            "data": source.meta,
            "run": {
                "config": opts.config,
                "init_from_hf": opts.init_from_hf,
                "init_from": opts.init_from,
                "recipe": recipe["name"],
                "frontend": job.fe.name,
                "mesh": job.mesh,
                "seed": opts.seed,
                "optimizer": job.optimizer_settings,
            },
        },
    )
  evaluate = None
  if opts.eval_every is not None:
    evaluate = sources.Evaluator(cfg, fe, run, source)
  stream = source.batches(start)
  losses, skipped, in_a_row, held_out = [], 0, 0, []
  loads = collections.deque(maxlen=TAIL_STEPS)
  bar = progress.StepReport(
      start,
      opts.steps,
      main=distributed.is_main_process(),
      bar=opts.progress,
      every=opts.log_every,
      best_loss=source.best_loss,
      log=log,
  )
  meter = throughput.Throughput(
      cfg, opts.batch_size, opts.seq_len, _run_devices(job)
  )
  profiler = throughput.Profiler(
      opts.profile_steps and throughput.parse_steps(opts.profile_steps),
      opts.checkpoint_dir
      and os.path.join(opts.checkpoint_dir, throughput.PROFILE_DIR),
  )
  board = throughput.TensorBoard(
      opts.tensorboard if distributed.is_main_process() else None
  )
  watch = guard.watch.phase
  if guard.stop.should_stop():  # during set-up: nothing new to save
    resumed = ckpts and start and ckpts.checkpoints.step_dir(start)
    raise RunInterrupted(guard.stop.signal, start, opts.steps, resumed or None)
  try:
    for i in bar:
      profiler.before(i + 1)
      meter.start()
      with watch("data", i + 1):
        tokens, *extras = next(stream)
      key = jax.random.fold_in(rng, i)
      while extras and extras[-1] is None:  # e.g. every position real: the
        extras.pop()  # unmasked loss, the step without a mask
      with watch("step", i + 1):
        state, metrics = step(state, tokens, key, *extras)
        loss = float(metrics["cross_entropy"])
      speed = meter.stop()
      profiler.after(i + 1)
      metrics = {
          **metrics,
          "learning_rate": schedule.learning_rate(job.lr_schedule, i, metrics),
          **speed,
      }
      host_memory.settle()  # waits only where host memory is reused
      losses.append(loss)
      loads.append(metrics["expert_load"])
      done = i + 1
      if evaluate is not None and done % opts.eval_every == 0:
        with watch("eval", done):
          eval_loss = evaluate(state)
        held_out.append((done, eval_loss))
        perplexity = math.exp(min(eval_loss, 700.0))
        metrics = {
            **metrics,
            "eval_loss": eval_loss,
            "eval_perplexity": perplexity,
        }
        bar.write(
            f"step {done}: held-out loss {eval_loss:.4f}, perplexity "
            f"{perplexity:.2f} (train loss {loss:.4f})"
        )
      with watch("stop agreement", done):  # a collective: every process
        stopping = guard.stop.should_stop() and done < opts.steps
      board.write(done, metrics)
      if ckpts is not None:
        with watch("save", done):
          row = {**metrics, "recipe": recipe} if done == 1 else metrics
          ckpts.after_step(
              done,
              row,
              fe.checkpoint_tree,
              state,
              data=source.iterator,
              force=stopping,
          )
          if stopping:  # on disk and committed before the run ends
            ckpts.wait(done)
      if stopping:
        saved = ckpts and ckpts.checkpoints.step_dir(done)
        raise RunInterrupted(guard.stop.signal, done, opts.steps, saved)
      in_a_row = in_a_row + 1 if int(metrics["skipped"]) else 0
      skipped += in_a_row > 0
      if in_a_row >= opts.max_consecutive_skips:
        raise RunStopped(
            f"stopped at step {i + 1} of {opts.steps}: the last {in_a_row} "
            f"steps ({i + 2 - in_a_row} to {i + 1}) were all skipped for a "
            "non-finite loss or gradient (--max-consecutive-skips "
            f"{opts.max_consecutive_skips}; {skipped} skipped in all). The run "
            "is not recovering: lower --learning-rate, or check the data."
        )
      bar.step(done, loss, metrics["learning_rate"], skipped, speed)
  finally:
    profiler.close()
    board.close()
  if ckpts is not None and opts.data is not None and ckpts.main_process:
    loss_chart.chart_beside(ckpts.metrics_path, log)
  return RunResult(
      losses,
      source.best_loss,
      skipped,
      expert_load=np.mean(jax.device_get(list(loads)), axis=0),
      start_step=start,
      eval_losses=held_out,
  )


def _run_devices(job: _Setup) -> list:
  """The devices a step runs on: the mesh's, or the one default device."""
  if job.device_mesh is not None:
    return list(job.device_mesh.devices.flat)
  return jax.devices()[:1]
