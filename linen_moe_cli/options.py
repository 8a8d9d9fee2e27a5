"""Checks of what a command is given and what it needs, before any work.

Imports no jax: a bad flag or a missing optional package is reported
before any computation, not after minutes of compiling and running.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

# Optional packages -> the extra of this project that installs them.
EXTRAS = {"matplotlib": "bench", "hypothesis": "test", "tokamax": "kernels"}


class RunStopped(Exception):
  """A run stopped on purpose (e.g. too many skipped steps); the message
  says where and why."""


def _fail(name: str, value: Any, allowed: str) -> None:
  flag = "--" + name.replace("_", "-")
  raise ValueError(f"{name}={value!r} ({flag}) is invalid: {allowed}.")


def check_int(name: str, value: Any, minimum: int) -> None:
  """`value` must be an integer (not a bool) >= `minimum`."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    _fail(name, value, f"expected an integer >= {minimum}")


def check_train_options(
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    learning_rate: float,
    grad_accum: int = 1,
    max_consecutive_skips: int = 1,
    checkpoint_dir: str | None = None,
    save_every: int | None = None,
    keep: int = 3,
) -> None:
  """Raises `ValueError` naming the first bad option of a training run.

  A next-token loss needs two positions, so `seq_len >= 2`; the batch splits
  into `grad_accum` equal microbatches, so `grad_accum` divides `batch_size`;
  `save_every` needs a `checkpoint_dir` to save to.
  """
  check_int("steps", steps, 1)
  check_int("batch_size", batch_size, 1)
  check_int("seq_len", seq_len, 2)
  lr = learning_rate
  if isinstance(lr, bool) or not isinstance(lr, (int, float)):
    _fail("learning_rate", lr, "expected a number > 0")
  if not (math.isfinite(lr) and lr > 0):
    _fail("learning_rate", lr, "expected a finite number > 0")
  check_int("grad_accum", grad_accum, 1)
  if batch_size % grad_accum:
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    _fail(
        "grad_accum",
        grad_accum,
        f"expected a divisor of batch_size={batch_size} ({divisors}), "
        "so that microbatches are equal",
    )
  check_int("max_consecutive_skips", max_consecutive_skips, 1)
  if save_every is not None:
    check_int("save_every", save_every, 1)
    if checkpoint_dir is None:
      _fail("save_every", save_every, "it needs a --checkpoint-dir to save to")
  check_int("keep", keep, 1)


def missing_optional(module: str, needed_for: str) -> str | None:
  """None when `module` imports; else a one-line notice saying how to
  install it (`needed_for` says what goes without it)."""
  try:
    importlib.import_module(module)
  except ImportError:
    extra = EXTRAS.get(module)
    how = (
        f"pip install 'linen_moe[{extra}]' (or scripts/setup_venv.sh {extra})"
        if extra
        else f"pip install {module}"
    )
    return f"{module} is not installed, so {needed_for}; install it with {how}."
  return None
