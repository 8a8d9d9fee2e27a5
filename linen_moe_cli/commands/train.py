"""`linen-moe train`: train the reference decoder from scratch or from a
Hugging Face checkpoint (`--init-from-hf`), on synthetic Markov data or on
your own (`--data`).

The flags become a `linen_moe.training.RunOptions` (checked before jax is
imported); with `--coordinator`, `--num-processes` and `--process-id` this
process first joins the others (`linen_moe.distributed.initialize`), then
every process runs the same job (`linen_moe.training.run`) and process 0
prints the summary, or, when a SIGTERM or Ctrl-C stopped the run
(`linen_moe.training.RunStopped` with its `signal`), where it stopped and the command
that resumes it, and the command exits with 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import shlex
import sys
import time

from linen_moe import data
from linen_moe.distributed import DEFAULT_HEARTBEAT_TIMEOUT_S
from linen_moe.distributed import DEFAULT_INIT_TIMEOUT_S
from linen_moe.training import SCHEDULES
from linen_moe.training import RunOptions
from linen_moe.training import RunStopped
from linen_moe_cli import model_args
from linen_moe_cli import options
from linen_moe_cli.options import train_default


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "train",
      help=(
          "train the reference decoder on synthetic Markov data, or on "
          "your own text or token ids (--data)"
      ),
      epilog=(
          "SIGTERM or Ctrl-C (SIGINT): the step in flight finishes, every "
          "process stops after the same step, which is saved (with "
          "--checkpoint-dir); one line says where and how to resume; exit "
          "status 143 (SIGTERM) or 130 (SIGINT). A second signal exits at "
          "once, the last committed checkpoint kept. A hang past "
          "--step-timeout: exit status 75."
      ),
  )
  model_args.add_model_args(p)
  # None: the default model, or the checkpoint of --init-from(-hf).
  p.set_defaults(config=None)
  p.add_argument(
      "--steps",
      type=int,
      default=train_default("steps"),
      help=options.recipe_help(
          "train up to this step (a resumed run continues to it)", "steps"
      ),
  )
  options.add_step_args(p, "batch_size", "seq_len")
  p.add_argument(
      "--learning-rate",
      type=float,
      default=train_default("learning_rate"),
      help=options.recipe_help("AdamW's peak learning rate", "learning_rate"),
  )
  options.add_step_args(p, "grad_accum")
  p.add_argument(
      "--seed",
      type=int,
      default=train_default("seed"),
      help="the initialisation and dropout key; seed + 1 orders the data",
  )
  options.add_step_args(p, "remat", "mesh", "frontend")
  p.add_argument(
      "--max-consecutive-skips",
      type=int,
      default=train_default("max_consecutive_skips"),
      help=(
          "stop after this many steps in a row were skipped for a "
          "non-finite loss or gradient"
      ),
  )
  p.add_argument(
      "--no-progress",
      action="store_true",
      help=(
          "no progress bar: a line every N steps instead (--log-every), as "
          "when the output is not a terminal"
      ),
  )
  p.add_argument(
      "--log-every",
      type=int,
      default=train_default("log_every"),
      metavar="N",
      help="without a progress bar, a line every N steps",
  )
  p.add_argument(
      "--checkpoint-dir",
      default=None,
      help=(
          "save checkpoints here and resume from the latest one (any front "
          "end, layer mode or mesh); per-step metrics in DIR/metrics.jsonl; "
          "one run at a time (DIR/run.lock) (default: a new "
          "runs/<config>-<timestamp>, printed; none when several processes "
          "train)"
      ),
  )
  p.add_argument(
      "--save-every",
      type=int,
      default=None,
      help="save every N steps (default: only the last step)",
  )
  p.add_argument(
      "--keep",
      type=int,
      default=train_default("keep"),
      help="keep the latest K checkpoints",
  )
  p.add_argument(
      "--resume-step",
      type=int,
      default=None,
      metavar="N",
      help=(
          "resume from checkpoint N (default: the newest that reads; a "
          "damaged one is skipped, with a message); newer ones are set aside"
      ),
  )
  p.add_argument(
      "--fresh-fp8-state",
      action="store_true",
      help=(
          "resume a checkpoint whose fp8 state does not fit the model "
          "(e.g. trained unquantized) with fresh fp8 state"
      ),
  )
  p.add_argument(
      "--init-from-hf",
      default=None,
      metavar="DIR",
      help=(
          "fine-tune a Hugging Face checkpoint folder (Mixtral, Qwen3-MoE, "
          "DeepSeek-V3, Gemma-4, GPT-OSS, GLM-4.5, MiniMax-M2, Llama-4; a "
          "released model: `hf download NAME --local-dir DIR` first): its "
          "config.json is the model (no --config; --quantization, "
          "--layers, the path flags and --set of run fields apply), on "
          "synthetic data over its vocabulary unless --data is given (text "
          "tokenized with its tokenizer.json unless --tokenizer)"
      ),
  )
  p.add_argument(
      "--init-from",
      default=None,
      metavar="RUN",
      help=(
          "start a new run from the latest checkpoint of another run's "
          "--checkpoint-dir RUN: its model and weights, with this run's "
          "flags, a fresh optimizer and step 0, and the fine-tuning recipe "
          "(to continue RUN exactly, resume it with --checkpoint-dir RUN)"
      ),
  )
  p.add_argument(
      "--profile-steps",
      default=None,
      metavar="A:B",
      help=(
          "trace steps A to B (from 1, inclusive) with jax.profiler into "
          "CHECKPOINT_DIR/profile (TensorBoard's profile plugin or Perfetto "
          "reads it)"
      ),
  )
  p.add_argument(
      "--tensorboard",
      default=None,
      metavar="DIR",
      help=(
          "also write each step's scalars (loss, learning_rate, tokens_per_s, "
          "model_tflops_per_s, mfu, ...) as TensorBoard events into DIR "
          "(needs tensorboardX: pip install tensorboardX, or from a checkout "
          "pip install '.[tensorboard]')"
      ),
  )
  p.add_argument(
      "--step-timeout",
      type=float,
      default=train_default("step_timeout"),
      metavar="SECONDS",
      help=(
          "end the run with exit status 75, every thread's stack on stderr "
          "and in CHECKPOINT_DIR/stacks.process_<i>.txt, when a phase of a "
          "step (data, step, eval, stop agreement, save) takes longer; not "
          "the first step and evaluation, which compile; 0: off (default: "
          "off on a CPU; on GPU and TPU 20 x the median of the 5 steps "
          "after the first, at least 300 s, on data, steps and the stop "
          "agreement)"
      ),
  )
  _add_data_args(p)
  _add_lora_args(p)
  _add_optimizer_args(p)
  _add_process_args(p)
  p.set_defaults(run=run, flags=options.flags_of(p))


def _add_data_args(p: argparse.ArgumentParser) -> None:
  group = p.add_argument_group(
      "real data",
      "train on your own files instead of synthetic Markov tokens: read "
      "through Grain, shuffled with --seed, each process reading only its "
      "rows; the data position is saved with each checkpoint",
  )
  group.add_argument(
      "--data",
      default=None,
      metavar="PATH_OR_GLOB",
      help=(
          "a file, a directory or a glob ('docs/**/*.md'), read in sorted "
          "order; a text file is one document"
      ),
  )
  group.add_argument(
      "--tokenizer",
      default=None,
      metavar="TOKENIZER_JSON",
      help=(
          "the Hugging Face tokenizer.json of text data (default: the "
          "tokenizer.json of the checkpoint the run starts from, if any)"
      ),
  )
  group.add_argument(
      "--data-format",
      choices=(*data.FORMATS, data.CHAT_FORMAT),
      default=None,
      help=(
          "text (tokenized), npy (1-D ids), bin (flat ids of --data-dtype) "
          'or chat (JSONL, one {"messages": [{"role", "content"}, ...]} a '
          "line, rendered with the tokenizer's chat template, trained on "
          "the assistant's replies); default: npy / bin by the extension, "
          "else text"
      ),
  )
  group.add_argument(
      "--data-dtype",
      choices=data.BIN_DTYPES,
      default=None,
      help="the ids' dtype of bin files",
  )
  group.add_argument(
      "--packing",
      choices=data.PACKINGS,
      default=train_default("packing"),
      help=(
          "pack: sequences cut across documents (each ends with the "
          "end-of-document token), a continuous stream; pad: sequences cut "
          "within each document, the last one padded, the padding masked "
          "out of the loss; first_fit: the documents (cut as for pad) "
          "packed whole into rows, first fit decreasing, each a segment "
          "that attends only to itself, its positions from 0, the fill "
          "fraction reported (default: pad for chat data, else pack)"
      ),
  )
  group.add_argument(
      "--eod-id",
      type=int,
      default=None,
      help=(
          "the end-of-document token id (default: the tokenizer's; "
          "pre-tokenized ids: none, a file is a document)"
      ),
  )
  group.add_argument(
      "--eval-every",
      type=int,
      default=None,
      metavar="N",
      help=(
          "at every N-th step, the held-out loss and perplexity "
          "(printed; eval_loss in metrics.jsonl; a chart losses.png beside it)"
      ),
  )
  group.add_argument(
      "--eval-batches",
      type=int,
      default=train_default("eval_batches"),
      metavar="K",
      help="held-out batches per evaluation",
  )
  group.add_argument(
      "--eval-fraction",
      type=float,
      default=train_default("eval_fraction"),
      help="the share of the sequences held out (the last ones)",
  )


def _add_optimizer_args(p: argparse.ArgumentParser) -> None:
  group = p.add_argument_group(
      "optimizer",
      "AdamW (gradients clipped to a global norm of 1) at --learning-rate, "
      "the peak of the schedule; a resumed run continues the schedule it "
      "began with",
  )
  group.add_argument(
      "--lr-schedule",
      choices=SCHEDULES,
      default=train_default("lr_schedule"),
      help=options.recipe_help(
          "after the warmup: constant, or cosine / linear decay to "
          "--final-lr-ratio times the peak at --steps",
          "lr_schedule",
      ),
  )
  group.add_argument(
      "--warmup-steps",
      type=int,
      default=train_default("warmup_steps"),
      metavar="N",
      help=options.recipe_help(
          "linear warmup from 0 to the peak over the first N updates",
          "warmup_steps",
      ),
  )
  group.add_argument(
      "--final-lr-ratio",
      type=float,
      default=None,
      metavar="R",
      help="cosine and linear: the final rate over the peak (default 0.1)",
  )
  group.add_argument(
      "--weight-decay",
      type=float,
      default=train_default("weight_decay"),
      help=(
          "AdamW's decoupled weight decay, on the kernels only (not on "
          "embeddings, norm scales or biases)"
      ),
  )


def _add_lora_args(p: argparse.ArgumentParser) -> None:
  group = p.add_argument_group(
      "LoRA and QLoRA",
      "train low-rank adapters alone, the base frozen (linen_moe.lora); "
      "`linen-moe export --format hf` writes the merged model, --format "
      "adapters the adapters alone",
  )
  group.add_argument(
      "--lora-rank",
      type=int,
      default=train_default("lora_rank"),
      metavar="R",
      help="adapter rank r >= 1 (0: train every parameter)",
  )
  group.add_argument(
      "--lora-alpha",
      type=float,
      default=None,
      metavar="A",
      help="the adapters' scale is A / r (default A = r)",
  )
  group.add_argument(
      "--lora-targets",
      default=None,
      metavar="T,...",
      help="what gets adapters: experts, shared, mlp, attention (default all)",
  )
  group.add_argument(
      "--lora-dropout",
      type=float,
      default=None,
      metavar="P",
      help="dropout on the adapters' input (default 0)",
  )
  group.add_argument(
      "--frozen-base-serving",
      action="store_true",
      help=(
          "QLoRA: keep the frozen expert kernels in the --quantization "
          "mode's storage type (int8, fp8), as serving does"
      ),
  )


def _add_process_args(p: argparse.ArgumentParser) -> None:
  group = p.add_argument_group(
      "multiple processes",
      "one process per host joined by jax.distributed (none of these under "
      "Slurm srun, Open MPI mpirun or a Cloud TPU pod, which JAX detects)",
  )
  group.add_argument(
      "--coordinator",
      default=None,
      metavar="HOST:PORT",
      help="address of process 0, which serves the coordination service",
  )
  group.add_argument(
      "--num-processes", type=int, default=None, help="N, all processes"
  )
  group.add_argument(
      "--process-id", type=int, default=None, help="this process, in [0, N)"
  )
  group.add_argument(
      "--init-timeout",
      type=int,
      default=DEFAULT_INIT_TIMEOUT_S,
      metavar="SECONDS",
      help="give up when the processes have not all joined by then",
  )
  group.add_argument(
      "--heartbeat-timeout",
      type=int,
      default=DEFAULT_HEARTBEAT_TIMEOUT_S,
      metavar="SECONDS",
      help="a silent process counts as dead after this; the others then stop",
  )


def run(args: argparse.Namespace) -> int:
  """Checks the flags, joins the processes (if asked) and trains; a
  message of the run names the flags (`options.in_flag_words`)."""
  try:
    return _run(args)
  except (ValueError, RunStopped) as e:
    e.args = (options.in_flag_words(str(e), args.flags),)
    raise


def _run(args: argparse.Namespace) -> int:
  opts = options.run_options(args)
  frontend = args.frontend
  from linen_moe import distributed  # noqa: PLC0415 (imports jax)

  timeouts = {
      "init_timeout_s": args.init_timeout,
      "heartbeat_timeout_s": args.heartbeat_timeout,
  }
  several = distributed.initialize(
      args.coordinator,
      args.num_processes,
      args.process_id,
      **{k: v for k, v in timeouts.items() if v is not None},
  )
  argv = getattr(args, "argv", None)
  flags = args.flags
  if not several:
    if opts.checkpoint_dir is None:  # one process: its own new directory
      where = options.default_run_dir(opts.model_name)
      opts = dataclasses.replace(opts, checkpoint_dir=where)
      print(f"run directory: {where} (--checkpoint-dir chooses one)")
      try:
        return train_and_report(opts, frontend, argv, flags)
      except ValueError:  # bad input: leave no empty run directory behind
        with contextlib.suppress(OSError):
          os.rmdir(where)
        raise
    return train_and_report(opts, frontend, argv, flags)
  try:
    return train_and_report(opts, frontend, argv, flags)
  except ValueError as e:
    e.args = (options.in_flag_words(str(e), flags),)
    # Every process rejects the same input together. The normal exit would
    # wait at JAX's shutdown barrier, where a loaded CI machine once held
    # process 0 past the launcher's 60 s grace (killed, -9): leave after it
    # or after the heartbeat timeout, whichever comes first.
    print(f"linen-moe: error: {e}", file=sys.stderr)
    wait_s = args.heartbeat_timeout or DEFAULT_HEARTBEAT_TIMEOUT_S
    exit_after_shutdown(2, wait_s)
  except RunStopped:
    # The same (replicated) skipped steps, or the same agreed stop: every
    # process exits together.
    raise
  except BaseException:  # noqa: BLE001
    # Leave now: the normal exit waits at a shutdown barrier for peers that
    # may be blocked in a collective with this process. Once its heartbeats
    # stop, JAX terminates the others with an error.
    import traceback  # noqa: PLC0415

    import jax  # noqa: PLC0415 (initialized above)

    # Under srun / mpirun JAX found the process index, not --process-id.
    print(f"[process {jax.process_index()}]", file=sys.stderr)
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def exit_after_shutdown(code: int, wait_s: float, shutdown=None) -> None:
  """Exits this process with `code` (`os._exit`: no other exit handler,
  no wait for other threads) once `shutdown` (`jax.distributed.shutdown`:
  the processes' barrier) returns or raises, or after `wait_s` seconds,
  whichever comes first; stdout and stderr flushed first."""
  import threading  # noqa: PLC0415

  if shutdown is None:
    import jax  # noqa: PLC0415

    shutdown = jax.distributed.shutdown
  sys.stdout.flush()
  sys.stderr.flush()
  done = threading.Event()

  def leave():
    try:
      shutdown()
    except BaseException:  # noqa: BLE001 (a failed barrier: leave anyway)
      pass
    finally:
      done.set()

  threading.Thread(target=leave, daemon=True).start()
  done.wait(wait_s)
  os._exit(code)


def train_and_report(
    opts: RunOptions,
    frontend: str = "linen",
    argv: list[str] | None = None,
    flags: dict[str, str] | None = None,
) -> int:
  """Runs the job with the front end named `frontend` (this process already
  joined any others) and prints its one-line summary on process 0; the exit
  status. `argv` (the command's arguments) is the resume command of a run
  a signal stopped; `flags` (`options.flags_of`; default: `train`'s) name
  the fields the run's messages mention."""
  if flags is None:
    flags = _train_flags()
  from linen_moe import distributed  # noqa: PLC0415 (imports jax)
  from linen_moe import training  # noqa: PLC0415

  start = time.perf_counter()
  try:
    result = training.run(
        opts,
        training.frontend(frontend),
        log=lambda line: print(options.in_flag_words(line, flags)),
    )
  except RunStopped as e:
    if e.signal is None:
      raise
    if distributed.is_main_process():
      hint = _resume_hint(opts, argv, e)
      print(f"linen-moe: {e} {hint}", file=sys.stderr, flush=True)
    return e.exit_code
  if not result.losses:  # already at --steps
    return 0
  if distributed.is_main_process():
    load = ""
    if result.expert_load is not None:
      load = f"expert load max/min: {result.load_ratio:.2f}  "
    best = ""
    if math.isfinite(result.best_loss):  # known for the synthetic data
      best = f"best achievable: {result.best_loss:.4f}  "
    held_out = ""
    if result.eval_losses:
      last = result.eval_losses[-1][1]
      held_out = (
          f"held-out loss: {last:.4f} (perplexity "
          f"{math.exp(min(last, 700.0)):.2f})  "
      )
    print(
        f"steps: {result.start_step + 1}-{opts.steps}  first loss:"
        f" {result.first_loss:.4f}  final loss: {result.final_loss:.4f} "
        f"(mean of the last {min(len(result.losses), 10)} steps)  "
        f"{best}{held_out}"
        f"skipped steps: {result.skipped_steps}  "
        f"{load}wall: {time.perf_counter() - start:.1f}s"
    )
  return 0


def _train_flags() -> dict[str, str]:
  """`train`'s flags by field name (`options.flags_of` of its parser)."""
  subparsers = argparse.ArgumentParser().add_subparsers()
  register(subparsers)
  return options.flags_of(subparsers.choices["train"])


def _resume_hint(
    opts: RunOptions, argv: list[str] | None, stopped: RunStopped
) -> str:
  """How to resume a run a signal stopped: the same command, without a
  `--resume-step` (the newest checkpoint is the stop's)."""
  if opts.checkpoint_dir is None:
    return "Without --checkpoint-dir a new run starts from step 0."
  if stopped.checkpoint is None:
    return "Nothing was saved: the same command starts from step 0."
  import jax  # noqa: PLC0415

  where = ""
  if jax.process_count() > 1:
    where = f" (on each of the {jax.process_count()} processes)"
  if argv is None:
    return f"Resume with the same command{where}."
  kept, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg == "--resume-step":
      skip = True
    elif not arg.startswith("--resume-step="):
      kept.append(arg)
  return f"Resume with{where}: {shlex.join(['linen-moe', *kept])}"
