"""What one training run does (`RunOptions`), checked before any work.

Imports no jax: a bad value or a missing optional package is reported
before any computation, not after minutes of compiling and running. The
fields take Python objects (a `ModelConfig`, a `jax.sharding.Mesh`, an
optax optimizer, tuples); the command line parses its strings into them.
An error names the field (`batch_size=0 is invalid: ...`) and writes any
other field it mentions in backticks (`checkpoint_dir`), which the command
line turns into its flags.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import math
import os
import re
from typing import Any

from linen_moe._src.config import lora as lora_config
from linen_moe._src.config.checks import check_int
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.model_config import check_remat
from linen_moe._src.config.quantization_modes import SERVING_MODES
from linen_moe._src.config.schedules import SCHEDULES
from linen_moe._src.hf import download
from linen_moe._src.run import recipes

# The model of a run from scratch that names none.
DEFAULT_CONFIG = "tiny_mixtral"
# A run directory's default name ends in a time stamp (`-20261207-120000`,
# `-2` for a second one in the same second).
_STAMP = re.compile(r"-\d{8}-\d{6}(-\d+)?$")


class RunStopped(Exception):
  """A run stopped on purpose (e.g. too many skipped steps, a save that
  failed, or a SIGTERM / SIGINT after a step); the message says where and
  why.

  Attributes:
    signal: the signal's number when a signal stopped the run (15 for
      SIGTERM, 2 for SIGINT; its last step saved, see `StopRequest`), else
      None.
    exit_code: what `linen-moe train` exits with: 128 + `signal`, else 1.
  """

  signal: int | None = None
  exit_code: int = 1


def _fail(name: str, value: Any, allowed: str, error=ValueError) -> None:
  raise error(f"{name}={value!r} is invalid: {allowed}.")


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """What one training run does (`linen_moe.training.run`), checked at
  construction.

  Each field is also a `linen-moe train` flag, whose string the command
  line parses into the field's object; a
  bad value is a `ValueError` (a `TypeError` for a value of the wrong
  kind) naming the field, before jax is imported.

  Example usage:

    options = RunOptions(config="tiny_mixtral", steps=300)
    result = linen_moe.training.run(options)

    cfg = linen_moe.load_model_config("tiny_mixtral").replace(num_layers=2)
    options = RunOptions(
        config=cfg,
        mesh=linen_moe.sharding.make_mesh("data=1"),
        optimizer=optax.adamw(1e-3),
        lora_rank=4,
        lora_targets=("experts", "attention"),
    )

  Attributes:
    config: a `ModelConfig`, a config name (`linen_moe.available_configs()`)
      or a YAML path (default "tiny_mixtral"); None with `init_from_hf` or
      `init_from`, whose checkpoint is the model (a config given there is
      an error).
    overrides: config fields to override (`remat`, `quantization`, ...).
    steps: train up to this step (a resumed run continues to it).
    batch_size: sequences per step, B; split into `grad_accum` equal
      microbatches.
    seq_len: tokens per sequence, S >= 2 (a next-token loss needs two).
    learning_rate: AdamW's peak rate, > 0.

    These four, `lr_schedule` and `warmup_steps` default to the run's
    recipe (`recipe`): from scratch, a high constant rate on short rows;
    from a pretrained start (`init_from_hf`, `init_from`) or with adapters
    (`lora_rank`), the peers' fine-tuning rates with a warmup and a cosine
    decay on rows of 1,024 tokens (`linen_moe._src.run.recipes`).
    grad_accum: microbatches per step; divides `batch_size`.
    seed: the initialisation and dropout key, and (`seed + 1`) the data.
    mesh: a `jax.sharding.Mesh` of the axes data, fsdp, expert, tensor, or
      its spec, e.g. "data=2,expert=4" (`linen_moe.sharding.make_mesh`);
      None for one device (or "data=<device count>" over several
      processes).
    max_consecutive_skips: stop after this many skipped steps in a row.
    progress: show a progress bar (process 0 only, and only on a
      terminal); without one, a line every `log_every` steps.
    log_every: N >= 1: without a progress bar, a line every N steps (and
      the first and the last).
    checkpoint_dir: save here and resume from the latest checkpoint.
    save_every: save every N steps (default: only the last); needs
      `checkpoint_dir`.
    keep: keep the latest K checkpoints.
    fresh_fp8_state: resume a checkpoint whose fp8 state does not fit the
      model with fresh fp8 state.
    resume_step: resume from this checkpoint rather than the newest that
      reads; needs `checkpoint_dir`, at most `steps`.
    data: train on these files (a path, a directory or a glob;
      in sorted order) instead of synthetic Markov tokens.
    tokenizer: the `tokenizer.json` of text data (default: the one in
      `init_from_hf`'s directory, when the run starts from one).
    data_format: "text", "npy", "bin" or "chat" (JSONL conversations,
      rendered with the tokenizer's chat template, the loss on the
      assistant's tokens; `linen_moe.data.read_chat`) (default: from the
      extension; chat is never inferred).
    data_dtype: the ids' dtype of "bin" files ("uint16" or "uint32").
    packing: "pack" (windows across documents), "pad" (a document per
      window, padding masked out of the loss) or "first_fit" (documents
      packed whole into rows as segments, `linen_moe.data.first_fit`);
      default "pad" for chat data, else "pack".
    eod_id: the end-of-document id (default: the tokenizer's; none for
      pre-tokenized ids).
    eval_every: at every N-th step, the held-out loss and perplexity
      (only there: a run stopped and resumed evaluates where an
      uninterrupted one does); needs `data`.
    eval_batches: held-out batches per evaluation.
    eval_fraction: the share of the data's sequences held out.
    init_from_hf: a Hugging Face checkpoint directory to fine-tune from
      (`linen_moe.hf.load_checkpoint`): its config.json is the model
      (`config` is not read), `overrides` may change only the run fields
      and `param_dtype`; a checkpoint in `checkpoint_dir` resumes instead.
    init_from: another run's checkpoint directory to start a NEW run from:
      its latest checkpoint's model (config, parameters, fp8 and routing
      state), with a fresh optimizer, step 0 and this run's settings
      (`overrides` as for `init_from_hf`). To continue a run exactly,
      resume it (`checkpoint_dir`) instead.
    lr_schedule: "constant", "cosine" or "linear"
      (`linen_moe.training.learning_rate_schedule`); "cosine" and "linear"
      decay over `steps` (those of the run that began the schedule).
    warmup_steps: updates of linear warmup from 0, >= 0 (< `steps` for a
      decaying schedule).
    final_lr_ratio: the final rate over `learning_rate`, in [0, 1], for
      "cosine" and "linear" (default 0.1).
    weight_decay: AdamW's decoupled weight decay, >= 0, on the kernels
      (`linen_moe.training.weight_decay_mask`).
    profile_steps: (A, B): trace steps A to B (1-based, inclusive) with
      `jax.profiler` into `checkpoint_dir/profile` (needs `checkpoint_dir`;
      B at most `steps`).
    tensorboard: a directory to write each step's scalar metrics to as
      TensorBoard events (needs tensorboardX: the `tensorboard` extra).
    lora_rank: r >= 1 trains low-rank adapters alone, the base frozen
      (`linen_moe.lora`); 0: every parameter trains.
    lora_alpha: the adapters' alpha (scale alpha / r; 0 = r).
    lora_targets: a tuple of `linen_moe.lora.TARGETS` (default all).
    lora_dropout: dropout on the adapters' input, in [0, 1).
    frozen_base_serving: QLoRA: the frozen base's expert kernels stored
      in the `quantization` override's type (int8 / fp8), the serving
      weights (`serving=True`).
    step_timeout: seconds a phase of a step (data, step, evaluation, stop
      agreement, save) may take before the run dumps every thread's stack
      and exits with status 75 (sysexits.h's `EX_TEMPFAIL`); 0: off;
      None: off on a CPU, on an accelerator 20 x the median step time (of
      the 5 steps after the first), at least 300 s.
    optimizer: an optax `GradientTransformation` to train with instead of
      the recipe's AdamW; then `learning_rate`, `lr_schedule`,
      `warmup_steps`, `final_lr_ratio` and `weight_decay` stay unset (the
      metrics then have no `learning_rate`). A resume needs the same
      optimizer (it restores its state; its settings are not checked).
  """

  config: ModelConfig | str | None = None
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  steps: int | None = None
  batch_size: int | None = None
  seq_len: int | None = None
  learning_rate: float | None = None
  grad_accum: int = 1
  seed: int = 0
  mesh: Any = None  # jax.sharding.Mesh | str | None
  max_consecutive_skips: int = 10
  progress: bool = True
  log_every: int = 10
  checkpoint_dir: str | None = None
  save_every: int | None = None
  keep: int = 3
  fresh_fp8_state: bool = False
  resume_step: int | None = None
  data: str | None = None
  tokenizer: str | None = None
  data_format: str | None = None
  data_dtype: str | None = None
  packing: str | None = None
  eod_id: int | None = None
  eval_every: int | None = None
  eval_batches: int = 4
  eval_fraction: float = 0.1
  init_from_hf: str | None = None
  init_from: str | None = None
  lr_schedule: str | None = None
  warmup_steps: int | None = None
  final_lr_ratio: float | None = None
  weight_decay: float = 0.0
  profile_steps: tuple[int, int] | None = None
  tensorboard: str | None = None
  lora_rank: int = 0
  lora_alpha: float | None = None
  lora_targets: tuple[str, ...] | None = None
  lora_dropout: float | None = None
  frozen_base_serving: bool = False
  step_timeout: float | None = None
  optimizer: Any = None  # optax.GradientTransformation | None

  def __post_init__(self):
    object.__setattr__(self, "overrides", dict(self.overrides))
    self._check_objects()
    self._check_lora()
    self._fill_from_recipe()
    check_int("steps", self.steps, 1)
    check_int("batch_size", self.batch_size, 1)
    check_int("seq_len", self.seq_len, 2)
    lr = self.learning_rate
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
      _fail("learning_rate", lr, "expected a number > 0")
    if not (math.isfinite(lr) and lr > 0):
      _fail("learning_rate", lr, "expected a finite number > 0")
    check_int("grad_accum", self.grad_accum, 1)
    if self.batch_size % self.grad_accum:
      b = self.batch_size
      divisors = [d for d in range(1, b + 1) if b % d == 0]
      _fail(
          "grad_accum",
          self.grad_accum,
          f"expected a divisor of batch_size={b} ({divisors}), so that "
          "microbatches are equal",
      )
    check_int("seed", self.seed, 0)
    self._check_remat()
    check_int("max_consecutive_skips", self.max_consecutive_skips, 1)
    check_int("log_every", self.log_every, 1)
    if self.save_every is not None:
      check_int("save_every", self.save_every, 1)
      if self.checkpoint_dir is None:
        _fail(
            "save_every",
            self.save_every,
            "it needs a `checkpoint_dir` to save to",
        )
    check_int("keep", self.keep, 1)
    if self.resume_step is not None:
      check_int("resume_step", self.resume_step, 1)
      if self.checkpoint_dir is None:
        _fail(
            "resume_step",
            self.resume_step,
            "it needs a `checkpoint_dir` to resume from",
        )
      if self.resume_step > self.steps:
        _fail(
            "resume_step",
            self.resume_step,
            f"expected at most `steps` {self.steps}",
        )
    self._check_data()
    if self.init_from_hf is not None:
      self._check_init_from_hf()
    if self.init_from is not None:
      self._check_init_from()
    self._check_optimizer()
    self._check_observers()
    timeout = self.step_timeout
    if timeout is not None and not (
        _is_number(timeout) and math.isfinite(timeout) and timeout >= 0
    ):
      _fail("step_timeout", timeout, "expected seconds >= 0 (0: off)")

  @property
  def model_name(self) -> str:
    """What the run's directory is named after (`linen-moe train` without
    `checkpoint_dir`): the model trained. The config's file name (without
    the extension), the Hugging Face checkpoint's directory name, or the
    name of the run `init_from` starts from (its time stamp dropped)."""
    start = self.init_from_hf or self.init_from
    if isinstance(self.config, ModelConfig):
      where = "model"
    elif start is None:
      where = self.config or DEFAULT_CONFIG
    else:
      where = os.path.basename(os.path.normpath(start))
      if self.init_from is not None:
        where = _STAMP.sub("", where)
    return os.path.splitext(os.path.basename(where))[0] or "run"

  @property
  def recipe(self) -> recipes.Recipe:
    """The kind of run whose defaults fill the unset fields: "lora" with
    adapters, else "fine-tune" from a pretrained start, else "scratch"."""
    pretrained = self.init_from_hf is not None or self.init_from is not None
    return recipes.recipe_for(pretrained=pretrained, lora=self.lora_rank > 0)

  @classmethod
  def default_of(cls, field: str) -> str:
    """How field `field` defaults, for a flag's help: its value, or each
    recipe's for a field the recipe fills.

    Args:
      field: a field name.

    Returns:
      E.g. "3" or "200 from scratch, 1000 from a pretrained model, 1000 with LoRA".
    """
    if field in recipes.FIELDS:
      return recipes.described(field)
    return str(cls.__dataclass_fields__[field].default)

  def _fill_from_recipe(self) -> None:
    """The recipe's value of every recipe field left unset."""
    recipe = self.recipe
    for name in recipes.FIELDS[:-1]:
      if getattr(self, name) is None:
        object.__setattr__(self, name, getattr(recipe, name))
    if self.warmup_steps is None and isinstance(self.steps, int):
      object.__setattr__(self, "warmup_steps", recipe.warmup_steps(self.steps))

  def _check_remat(self) -> None:
    """The `remat` override names a policy (checked before jax loads)."""
    remat = self.overrides.get("remat")
    if remat is not None:
      check_remat(remat, "remat")

  def _old_strings(self) -> None:
    """0.2's strings of `lora_targets` ("a,b") and `profile_steps`
    ("A:B"), parsed with a warning."""
    from linen_moe._src import deprecation  # noqa: PLC0415

    if isinstance(self.lora_targets, str):
      deprecation.warn(
          "RunOptions(lora_targets=<str>)", "pass a tuple of targets"
      )
      targets = tuple(t.strip() for t in self.lora_targets.split(",") if t)
      object.__setattr__(self, "lora_targets", targets)
    if isinstance(self.profile_steps, str):
      deprecation.warn(
          "RunOptions(profile_steps=<str>)", "pass a pair (first, last)"
      )
      first, _, last = self.profile_steps.partition(":")
      try:
        pair = (int(first), int(last))
      except ValueError:
        _fail("profile_steps", self.profile_steps, "expected A:B")
      object.__setattr__(self, "profile_steps", pair)

  def _check_objects(self) -> None:
    """The fields that take objects: each of an accepted kind."""
    if not (self.config is None or isinstance(self.config, (str, ModelConfig))):
      _fail(
          "config",
          self.config,
          "expected a ModelConfig, a config name or a YAML path",
          TypeError,
      )
    mesh = self.mesh
    if not (
        mesh is None
        or isinstance(mesh, str)
        or (hasattr(mesh, "axis_names") and hasattr(mesh, "devices"))
    ):
      _fail(
          "mesh",
          mesh,
          'expected a jax.sharding.Mesh or its spec, e.g. "data=2,expert=4"',
          TypeError,
      )
    self._old_strings()
    for name, kind in (("lora_targets", str), ("profile_steps", int)):
      value = getattr(self, name)
      if value is not None and (
          isinstance(value, str)
          or not isinstance(value, (tuple, list))
          or not all(
              isinstance(v, kind) and not isinstance(v, bool) for v in value
          )
      ):
        _fail(name, value, f"expected a tuple of {kind.__name__}", TypeError)
      if value is not None:
        object.__setattr__(self, name, tuple(value))
    if self.optimizer is None:
      return
    if not (
        hasattr(self.optimizer, "init") and hasattr(self.optimizer, "update")
    ):
      _fail(
          "optimizer",
          self.optimizer,
          "expected an optax GradientTransformation (init, update)",
          TypeError,
      )
    given = [
        n
        for n in ("learning_rate", *recipes.FIELDS[3:], "final_lr_ratio")
        if getattr(self, n) is not None
    ] + (["weight_decay"] if self.weight_decay else [])
    if given:
      _fail(
          "optimizer",
          type(self.optimizer).__name__,
          "an optimizer of your own replaces the recipe's, so "
          + ", ".join(f"`{n}`" for n in given)
          + " would be ignored: leave them unset",
      )

  def _check_observers(self) -> None:
    """The profiler and TensorBoard fields."""
    if self.profile_steps is not None:
      if len(self.profile_steps) != 2 or not (
          1 <= self.profile_steps[0] <= self.profile_steps[1]
      ):
        _fail(
            "profile_steps",
            self.profile_steps,
            "expected (A, B), the first and the last step to trace, "
            "1 <= A <= B",
        )
      if self.checkpoint_dir is None:
        _fail(
            "profile_steps",
            self.profile_steps,
            "it writes into the run directory: give a `checkpoint_dir`",
        )
      if self.profile_steps[1] > self.steps:
        _fail(
            "profile_steps",
            self.profile_steps,
            f"the last step traced must be at most `steps` {self.steps}",
        )
    if self.tensorboard is not None:
      try:
        import tensorboardX  # noqa: F401, PLC0415
      except ImportError as e:
        raise ValueError(
            "tensorboardX is not installed, so `tensorboard` cannot write its"
            " events; install it with pip install tensorboardX (from a"
            " checkout: pip install '.[tensorboard]')."
        ) from e

  def _check_lora(self) -> None:
    """The LoRA fields, folded into the config overrides (`lora_*` fields,
    `serving` for a frozen serving base)."""
    check_int("lora_rank", self.lora_rank, 0)
    extra = {
        "lora_alpha": self.lora_alpha,
        "lora_targets": self.lora_targets,
        "lora_dropout": self.lora_dropout,
    }
    if not self.lora_rank:
      for name, value in extra.items():
        if value is not None:
          _fail(name, value, "it needs `lora_rank` >= 1")
      if self.frozen_base_serving:
        _fail(
            "frozen_base_serving",
            True,
            "a frozen base trains nothing without adapters: give a `lora_rank`",
        )
      return
    targets = lora_config.TARGETS
    if self.lora_targets is not None:
      targets = self.lora_targets
    alpha = 0.0 if self.lora_alpha is None else self.lora_alpha
    dropout = 0.0 if self.lora_dropout is None else self.lora_dropout
    try:
      lora_config.LoRAConfig(self.lora_rank, alpha, targets, dropout)
    except ValueError as e:  # said with the field's name
      field = str(e).split("=", 1)[0].removeprefix("LoRAConfig.")
      given = {"alpha": alpha, "targets": targets, "dropout": dropout}
      allowed = str(e).split(" is invalid: ", 1)[-1].rstrip(".")
      _fail(f"lora_{field}", given.get(field), allowed)
    lora = {
        "lora_rank": self.lora_rank,
        "lora_alpha": alpha,
        "lora_targets": targets,
        "lora_dropout": dropout,
    }
    if self.frozen_base_serving:
      mode = self.overrides.get("quantization")
      if mode not in SERVING_MODES:
        _fail(
            "frozen_base_serving",
            True,
            "it needs a `quantization` with a stored type, one of "
            f"{tuple(SERVING_MODES)} (got {mode!r})",
        )
      lora["serving"] = True
    self.overrides.update(lora)

  def _check_optimizer(self) -> None:
    """The schedule and weight-decay fields."""
    if self.lr_schedule not in SCHEDULES:
      _fail("lr_schedule", self.lr_schedule, f"expected one of {SCHEDULES}")
    check_int("warmup_steps", self.warmup_steps, 0)
    ratio = self.final_lr_ratio
    if self.lr_schedule == "constant":
      if ratio is not None:
        _fail(
            "final_lr_ratio",
            ratio,
            "only `lr_schedule` cosine and linear decay to a final rate",
        )
    else:
      if self.warmup_steps >= self.steps:
        _fail(
            "warmup_steps",
            self.warmup_steps,
            f"expected fewer than `steps` {self.steps}: the {self.lr_schedule}"
            " schedule decays over the steps after the warmup",
        )
      if ratio is not None and not (_is_number(ratio) and 0 <= ratio <= 1):
        _fail("final_lr_ratio", ratio, "expected a number in [0, 1]")
    decay = self.weight_decay
    if not (_is_number(decay) and math.isfinite(decay) and decay >= 0):
      _fail("weight_decay", decay, "expected a finite number >= 0")

  def _check_data(self) -> None:
    """The real-data fields; the files exist (read later, after jax)."""
    from linen_moe._src.data import chat  # noqa: PLC0415
    from linen_moe._src.data import packing  # noqa: PLC0415
    from linen_moe._src.data import sources  # noqa: PLC0415

    if self.data is None:
      for name in ("tokenizer", "data_format", "data_dtype", "eod_id"):
        if getattr(self, name) is not None:
          _fail(name, getattr(self, name), "it needs `data`")
      if self.eval_every is not None:
        _fail(
            "eval_every",
            self.eval_every,
            "it needs `data` (the synthetic data has a known best loss "
            "instead)",
        )
    formats = (*sources.FORMATS, chat.CHAT_FORMAT)
    if self.data_format is not None and self.data_format not in formats:
      _fail("data_format", self.data_format, f"expected one of {formats}")
    if self.data_dtype is not None:
      if self.data_dtype not in sources.BIN_DTYPES:
        _fail(
            "data_dtype",
            self.data_dtype,
            f"expected one of {sources.BIN_DTYPES}",
        )
      if self.data_format not in (None, "bin"):
        _fail("data_dtype", self.data_dtype, "only 'bin' data takes a dtype")
    is_chat = self.data_format == chat.CHAT_FORMAT
    if self.packing is None:
      object.__setattr__(self, "packing", "pad" if is_chat else "pack")
    if self.packing not in packing.PACKINGS:
      _fail("packing", self.packing, f"expected one of {packing.PACKINGS}")
    if self.eod_id is not None:
      check_int("eod_id", self.eod_id, 0)
    check_int("eval_batches", self.eval_batches, 1)
    fraction = self.eval_fraction
    if not (
        isinstance(fraction, (int, float))
        and not isinstance(fraction, bool)
        and 0 <= fraction < 1
    ):
      _fail("eval_fraction", fraction, "expected a number in [0, 1)")
    if self.eval_every is not None:
      check_int("eval_every", self.eval_every, 1)
      if fraction == 0:
        _fail("eval_every", self.eval_every, "`eval_fraction` 0 holds none out")
    if self.data is not None:
      sources.find_files(self.data)  # a one-line error naming it
    if self.tokenizer is not None and not os.path.isfile(self.tokenizer):
      raise ValueError(f"tokenizer {self.tokenizer}: no such file.")
    if is_chat:
      self._check_chat_tokenizer()

  def _check_chat_tokenizer(self) -> None:
    """Chat data needs a tokenizer, and its chat template."""
    from linen_moe._src.data import chat_template  # noqa: PLC0415

    where = self.tokenizer or self.init_from_hf
    if where is None:
      _fail(
          "data_format",
          self.data_format,
          "chat data needs a tokenizer with a chat template: `tokenizer` "
          "DIR/tokenizer.json, or `init_from_hf` DIR",
      )
    chat_template.load_chat_template(where)  # a one-line error naming the file

  def _check_init_from_hf(self) -> None:
    where = self.init_from_hf
    if not os.path.isdir(where):
      _fail(
          "init_from_hf",
          where,
          f"it does not exist; {download.download_hint(where)}",
      )
    if not os.path.isfile(os.path.join(where, "config.json")):
      _fail(
          "init_from_hf",
          where,
          "expected a Hugging Face checkpoint directory (with config.json)",
      )
    self._check_fixed_model("init_from_hf", where)

  def _check_init_from(self) -> None:
    where = self.init_from
    if self.init_from_hf is not None:
      _fail(
          "init_from", where, "a run starts from one model: drop `init_from_hf`"
      )
    if not os.path.isdir(where):
      _fail("init_from", where, "it does not exist")
    steps = [d for d in os.listdir(where) if d.isdigit()]
    if not steps:
      _fail(
          "init_from",
          where,
          "expected a run's checkpoint directory (a run's `checkpoint_dir`): "
          "it holds no checkpoint",
      )
    mine = self.checkpoint_dir
    if (
        mine is not None
        and os.path.isdir(mine)
        and os.path.samefile(where, mine)
    ):
      _fail(
          "init_from",
          where,
          "it is this run's `checkpoint_dir`: to continue that run, resume"
          " it (drop `init_from`)",
      )
    self._check_fixed_model("init_from", where)

  def _check_fixed_model(self, name: str, where: str) -> None:
    """A pretrained start fixes the model: no config, and the overrides
    may change only the run fields, `param_dtype` and the adapters."""
    if self.config is not None:
      _fail(
          "config",
          self.config,
          f"`{name}` {where} is the model (its checkpoint's config), so a "
          "config would be ignored: drop it",
      )
    run_fields = ModelConfig.run_fields
    adapters = {"lora_rank", "lora_alpha", "lora_targets", "serving"}
    fixed = sorted(
        set(self.overrides) - run_fields() - {"param_dtype"} - adapters
    )
    if fixed:
      _fail(
          name,
          where,
          f"the checkpoint fixes the model, so {fixed} cannot be overridden "
          f"(only the run fields {sorted(run_fields())} and param_dtype)",
      )
