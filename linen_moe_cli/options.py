"""The `train` flags as a `linen_moe.training.RunOptions`, the step flags
`train` and `plan` share, and the install hint of a missing optional
package.

Imports no jax: a bad flag or a missing optional package is reported
before any computation, not after minutes of compiling and running.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from typing import Any

from linen_moe import ModelConfig
from linen_moe import training
from linen_moe.training import RunOptions
from linen_moe_cli import model_args
import nnx_adapter  # noqa: F401 (registers the "nnx" front end)

# Optional packages -> the extra of this project that installs them.
EXTRAS = {
    "matplotlib": "bench",
    "hypothesis": "test",
    "tokamax": "kernels",
    "tensorboardX": "tensorboard",
}


def _fail(name: str, value: Any, allowed: str) -> None:
  flag = "--" + name.replace("_", "-")
  raise ValueError(f"{name}={value!r} ({flag}) is invalid: {allowed}.")


def check_int(name: str, value: Any, minimum: int) -> None:
  """`value` must be an integer (not a bool) >= `minimum`."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    _fail(name, value, f"expected an integer >= {minimum}")


def frontend_help() -> str:
  """ "linen: ..., nnx: ..." for a `--frontend` flag (no jax)."""
  return "; ".join(
      f"{name}: {what}" for name, what in training.FRONTENDS.items()
  )


def run_options(args: argparse.Namespace) -> RunOptions:
  """The `RunOptions` of a parsed `linen-moe train` command line: its
  strings parsed into the fields' objects, and checked (a bad value is a
  `ValueError` naming the field; `in_flag_words` names the flag)."""
  fields = {f.name for f in dataclasses.fields(RunOptions)} - {
      "overrides",
      "progress",
      "optimizer",  # an optax object: Python only
      "lora_targets",
      "profile_steps",
  }
  targets = args.lora_targets
  if targets is not None:
    targets = tuple(t.strip() for t in targets.split(",") if t.strip())
  return RunOptions(
      overrides=model_args.model_overrides(args),
      progress=not args.no_progress,
      lora_targets=targets,
      profile_steps=parse_steps(args.profile_steps),
      **{name: getattr(args, name) for name in fields},
  )


def parse_steps(spec: str | None) -> tuple[int, int] | None:
  """ "A:B" (`--profile-steps`) -> (A, B), the first and last step
  (1-based, inclusive); None -> None.

  Raises:
    ValueError: `spec` is not A:B with 1 <= A <= B.
  """
  if spec is None:
    return None
  first, sep, last = spec.partition(":")
  try:
    a, b = int(first), int(last)
  except ValueError:
    a = b = 0
  if not sep or not 1 <= a <= b:
    raise ValueError(
        f"--profile-steps {spec!r} is invalid: expected A:B, the first and "
        "the last step to trace, 1 <= A <= B."
    )
  return a, b


def flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
  """{field or dest name: its flag} of a command's parser, and of the
  `RunOptions` fields and config overrides whose flag has another name."""
  flags = {
      action.dest: action.option_strings[-1]
      for action in parser._actions  # noqa: SLF001 (argparse has no API)
      if action.option_strings and action.dest != "help"
  }
  return flags | {
      "progress": "--no-progress",
      "overrides": "--set",
      "scan_layers": "--layers",
  }


def in_flag_words(text: str, flags: dict[str, str]) -> str:
  """A run's message in the command line's words: the field an error
  starts with (`steps=0 is invalid: ...`) followed by its flag
  (`steps=0 (--steps) is invalid: ...`), and each field the message names
  in backticks (`checkpoint_dir`) written as its flag (--checkpoint-dir).

  Args:
    text: the message (`RunOptions`' and `training.run`'s).
    flags: `flags_of` the command's parser.

  Returns:
    The message with the flags.
  """
  first = re.match(r"(\w+)=", text)
  if first and first[1] in flags and " is invalid" in text:
    text = text.replace(" is invalid", f" ({flags[first[1]]}) is invalid", 1)
  return re.sub(
      r"`(\w+)`",
      lambda m: flags.get(m[1], m[0]),
      text,
  )


def train_default(name: str) -> Any:
  """The default of `RunOptions` field `name` (the flag's default; None
  for a field the run's recipe fills)."""
  return RunOptions.__dataclass_fields__[name].default


def recipe_help(text: str, name: str) -> str:
  """`text` and how field `name` defaults: the recipe's value, which
  depends on where the run starts (`RunOptions.default_of`)."""
  default = RunOptions.default_of(name).replace("%", "%%")  # argparse's
  return f"{text} (default: the recipe's: {default})"


def default_run_dir(name: str, now: float | None = None) -> str:
  """runs/<name>-<YYYYmmdd-HHMMSS>, the run directory of a `train`
  without --checkpoint-dir (a new one: -2, -3, ... if it exists); runs/ is
  $LINEN_MOE_RUNS_DIR where that is set.

  Args:
    name: the model trained (`RunOptions.model_name`).
    now: the time (default: now).

  Returns:
    The path, relative to the working directory.
  """
  import os  # noqa: PLC0415
  import time  # noqa: PLC0415

  stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
  runs = os.environ.get("LINEN_MOE_RUNS_DIR") or "runs"
  path, n = os.path.join(runs, f"{name}-{stamp}"), 1
  while os.path.lexists(path):
    n += 1
    path = os.path.join(runs, f"{name}-{stamp}-{n}")
  return path


def add_step_args(
    p: argparse.ArgumentParser, *names: str, **helps: str
) -> None:
  """Registers the flags of a train step's shape and placement that `train`
  and `plan` share, those of `names` in that order: batch_size, seq_len,
  grad_accum, remat, mesh, frontend (`--batch-size`, ...; parsed under the
  same names, with `RunOptions`' defaults). `helps` (name=text) rewords
  a flag's help for one command."""
  flags = {
      "batch_size": {
          "type": int,
          "default": train_default("batch_size"),
          "help": recipe_help("sequences per step", "batch_size"),
      },
      "seq_len": {
          "type": int,
          "default": train_default("seq_len"),
          "help": recipe_help("tokens per sequence", "seq_len"),
      },
      "grad_accum": {
          "type": int,
          "default": train_default("grad_accum"),
          "help": "microbatches per step",
      },
      "remat": {
          "choices": ModelConfig.REMAT_POLICIES,
          "default": None,
          "help": (
              "what each layer keeps for the backward pass (the config's "
              f"remat field): {', '.join(ModelConfig.REMAT_POLICIES)} "
              "(default: the config's)"
          ),
      },
      "mesh": {
          "default": train_default("mesh"),
          "help": (
              "train sharded on a device mesh, e.g. data=2,expert=4 (axes "
              "data, fsdp, expert, tensor; missing axes have size 1; the sizes "
              "must multiply to the device count)"
          ),
      },
      "frontend": {
          "choices": tuple(training.FRONTENDS),
          "default": "linen",
          "help": frontend_help(),
      },
  }
  if set(helps) - set(names):
    raise TypeError(
        f"help for flags not added: {sorted(set(helps) - set(names))}"
    )
  for name in names:
    kwargs = flags[name] | ({"help": helps[name]} if name in helps else {})
    p.add_argument("--" + name.replace("_", "-"), **kwargs)


def missing_optional(module: str, needed_for: str) -> str | None:
  """None when `module` imports; else a one-line notice saying how to
  install it (`needed_for` says what goes without it)."""
  try:
    importlib.import_module(module)
  except ImportError:
    extra = EXTRAS.get(module)
    # The package is on no index: an extra installs from a checkout.
    how = (
        f"pip install '.[{extra}]' from a checkout (or scripts/setup_venv.sh"
        f" {extra}), else pip install {module}"
        if extra
        else f"pip install {module}"
    )
    return f"{module} is not installed, so {needed_for}; install it with {how}."
  return None
