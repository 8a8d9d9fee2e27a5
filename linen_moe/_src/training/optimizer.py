"""The optimizer of the reference decoders: AdamW, a learning-rate schedule
and the weight-decay mask.

The learning rate of an update is `learning_rate_schedule(...)(n)`, where n
counts the updates applied before it (optax's count: a step skipped for a
non-finite loss leaves the optimizer state, its count included, as it was,
so the schedule waits for it). Warmup rises linearly from 0 (at n = 0) to
the peak at n = `warmup_steps`; then "constant" stays there, "cosine" and
"linear" fall to `final_lr_ratio` times the peak at n = `total_steps` and
stay there.

Weight decay (decoupled, AdamW's: `p -= lr * weight_decay * p`) applies to
the leaves `decays` says, a rule on the parameter's path, not on its rank:
with scanned layers a norm scale is a [L, D] matrix, so the usual
"decay what has 2 or more dimensions" would decay it. The rule reads the
leaf's name: embeddings (`embedding`), biases (`bias`, `*_bias`) and scales
(`scale`: every norm; `*_scale`: Gemma-4's `per_expert_scale` and
`router_input_scale`) never decay; every kernel does (attention, experts,
shared experts, dense MLPs, the output head, and the router's `gate`
kernel, a weight matrix like the others). The routed biases of DeepSeek-V3
sit in `updated_by_rule`, which the optimizer never sees.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any

import jax
import optax

from linen_moe._src.config.schedules import DEFAULT_FINAL_LR_RATIO
from linen_moe._src.config.schedules import SCHEDULES

PyTree = Any

# Leaf names that never decay, and the suffixes of such names.
NO_DECAY_NAMES = ("embedding", "bias", "scale")
NO_DECAY_SUFFIXES = ("_bias", "_scale")


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_schedule(
    learning_rate: float,
    schedule: str = "constant",
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    final_lr_ratio: float | None = None,
) -> float | None:
  """Checks a schedule's arguments (see `learning_rate_schedule`).

  Args:
    learning_rate: the peak learning rate.
    schedule: one of `SCHEDULES`.
    warmup_steps: updates of linear warmup.
    total_steps: the schedule's length, for "cosine" and "linear".
    final_lr_ratio: the final / peak ratio, for "cosine" and "linear".

  Returns:
    The final ratio to use: `final_lr_ratio`, or `DEFAULT_FINAL_LR_RATIO`
    for "cosine" and "linear" when it is None; None for "constant".

  Raises:
    ValueError: naming the argument, its value and what is allowed.
  """
  if not _is_number(learning_rate) or not (
      math.isfinite(learning_rate) and learning_rate > 0
  ):
    raise ValueError(
        f"learning_rate={learning_rate!r} is invalid: a finite number > 0."
    )
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r} is invalid: one of {SCHEDULES}.")
  if not _is_int(warmup_steps) or warmup_steps < 0:
    raise ValueError(
        f"warmup_steps={warmup_steps!r} is invalid: an integer >= 0."
    )
  if schedule == "constant":
    if final_lr_ratio is not None:
      raise ValueError(
          f"final_lr_ratio={final_lr_ratio!r} is invalid for the constant "
          "schedule: only 'cosine' and 'linear' decay to a final rate."
      )
    return None
  if not _is_int(total_steps) or total_steps <= warmup_steps:
    raise ValueError(
        f"total_steps={total_steps!r} is invalid for the {schedule} "
        f"schedule: an integer > warmup_steps={warmup_steps} (it decays "
        "over the updates after the warmup)."
    )
  ratio = DEFAULT_FINAL_LR_RATIO if final_lr_ratio is None else final_lr_ratio
  if not _is_number(ratio) or not 0 <= ratio <= 1:
    raise ValueError(
        f"final_lr_ratio={final_lr_ratio!r} is invalid: a number in [0, 1]."
    )
  return float(ratio)


def learning_rate_schedule(
    learning_rate: float,
    schedule: str = "constant",
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    final_lr_ratio: float | None = None,
) -> optax.Schedule:
  """The learning rate as a function of the updates applied, n.

  Linear warmup from 0 at n = 0 to `learning_rate` at n = `warmup_steps`
  (none when it is 0), then:

  - "constant": `learning_rate`;
  - "cosine": `optax.warmup_cosine_decay_schedule`: a half cosine from
    `learning_rate` to `final_lr_ratio * learning_rate` at n =
    `total_steps`;
  - "linear": a straight line between the same two points.

  After `total_steps` the rate stays at its final value.

  Args:
    learning_rate: the peak learning rate, > 0.
    schedule: one of `SCHEDULES`.
    warmup_steps: updates of linear warmup, >= 0.
    total_steps: for "cosine" and "linear": the schedule's length in
      updates, warmup included, > `warmup_steps`.
    final_lr_ratio: for "cosine" and "linear": the final rate over the peak,
      in [0, 1] (default `DEFAULT_FINAL_LR_RATIO`); not for "constant".

  Returns:
    An optax schedule, `n -> learning rate` (a float32 scalar).

  Raises:
    ValueError: (from `check_schedule`) for a bad argument.
  """
  ratio = check_schedule(
      learning_rate,
      schedule,
      warmup_steps=warmup_steps,
      total_steps=total_steps,
      final_lr_ratio=final_lr_ratio,
  )
  warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
  if schedule == "constant":
    if warmup_steps == 0:
      return optax.constant_schedule(learning_rate)
    return warmup  # it stays at its end value after the warmup
  end = ratio * learning_rate
  if schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup_steps, total_steps, end
    )
  decay = optax.linear_schedule(learning_rate, end, total_steps - warmup_steps)
  return optax.join_schedules([warmup, decay], [warmup_steps])


def parameter_path(key_path: Sequence[Any]) -> tuple[str, ...]:
  """The names of a parameter: the dict keys of its jax key path.

  Args:
    key_path: a leaf's key path in a parameter tree, Linen's (dicts) or
      NNX's (an `nnx.State`, whose leaves add a `.value` attribute key).

  Returns:
    The string keys in order, e.g. ("layers", "moe", "wi_0").
  """
  return tuple(
      str(k.key) for k in key_path if isinstance(k, jax.tree_util.DictKey)
  )


def decays(path: Sequence[str]) -> bool:
  """Whether weight decay applies to the parameter at `path`.

  The rule reads the leaf's name, `path[-1]`: no decay for `embedding`,
  `bias`, `scale`, and names ending in `_bias` or `_scale`; decay for
  everything else (the kernels).

  Args:
    path: the parameter's names (`parameter_path`), e.g. ("layers",
      "pre_moe_norm", "scale").

  Returns:
    True when the parameter decays.

  Raises:
    ValueError: for an empty path.
  """
  if not path:
    raise ValueError("decays: the parameter path is empty.")
  name = path[-1]
  return name not in NO_DECAY_NAMES and not name.endswith(NO_DECAY_SUFFIXES)


def weight_decay_mask(params: PyTree) -> PyTree:
  """`decays` of every leaf of a parameter tree.

  Args:
    params: the parameters (Linen's `params` collection, or an NNX
      `nnx.State` of them).

  Returns:
    The same tree of bools, True where weight decay applies (optax's
    `mask`).
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, _: decays(parameter_path(path)), params
  )


def default_optimizer(
    learning_rate: float = 1e-2,
    *,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
    final_lr_ratio: float | None = None,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
  """AdamW after clipping the global gradient norm to 1.

  With the defaults: a constant learning rate and no weight decay. The
  optimizer state has the same leaves whatever `weight_decay` is; a
  schedule other than a constant rate without warmup adds one count.

  Args:
    learning_rate: the peak learning rate (`learning_rate_schedule`).
    schedule: one of `SCHEDULES`.
    warmup_steps: updates of linear warmup.
    total_steps: the schedule's length in updates ("cosine", "linear").
    final_lr_ratio: the final rate over the peak ("cosine", "linear").
    weight_decay: AdamW's decoupled decay rate, >= 0, applied where
      `weight_decay_mask` says.

  Returns:
    The optax `GradientTransformation`.

  Raises:
    ValueError: for a bad argument (see `check_schedule`), or a negative
      or non-finite `weight_decay`.
  """
  if not _is_number(weight_decay) or not (
      math.isfinite(weight_decay) and weight_decay >= 0
  ):
    raise ValueError(
        f"weight_decay={weight_decay!r} is invalid: a finite number >= 0."
    )
  lr = learning_rate_schedule(
      learning_rate,
      schedule,
      warmup_steps=warmup_steps,
      total_steps=total_steps,
      final_lr_ratio=final_lr_ratio,
  )
  if schedule == "constant" and warmup_steps == 0:
    lr = learning_rate  # no count in the state: checkpoints keep their leaves
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(lr, weight_decay=weight_decay, mask=weight_decay_mask),
  )
