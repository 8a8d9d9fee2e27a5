"""A new run from another run's weights (`RunOptions.init_from`).

Resuming continues a run exactly: the same optimizer settings, its moments
and its step, which is why a resume refuses a new learning rate. Starting
from a run is the other thing a user wants after a first run: its model
(config, parameters, fp8 and routing state) read from its latest
checkpoint that reads, with this run's settings, a fresh optimizer and
step 0. The checkpoint is read as a resume reads it (any front end, layer
layout or mesh, straight into the run's shardings); adapters this run adds
(`lora_rank`) start fresh on the loaded base, and an fp8 state that does
not fit this run's quantization starts fresh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import traverse_util

from linen_moe._src.checkpoint import manager
from linen_moe._src.checkpoint import meta as ckpt_meta
from linen_moe._src.checkpoint.tree import VARIABLES
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.lora import tree as lora_tree


def _latest(ckpts: manager.Checkpoints) -> tuple[int, dict]:
  """The newest step whose metadata reads, and that metadata."""
  problems = []
  for step in reversed(ckpts.all_steps()):
    try:
      return step, ckpts.meta(step)
    except manager.DamagedCheckpointError as e:
      problems.append(str(e))
  raise ValueError(
      f"init_from={ckpts.directory!r} is invalid: no checkpoint"
      f" there can be read ({'; '.join(problems) or 'it holds none'})."
  )


def model_config(directory: str, overrides: dict[str, Any]) -> ModelConfig:
  """The model of the run in `directory` (its latest checkpoint's), with
  `overrides` (run fields, `param_dtype`, adapters) applied.

  Args:
    directory: a run's checkpoint directory.
    overrides: this run's config overrides.

  Returns:
    The `ModelConfig` this run trains.

  Raises:
    ValueError: no checkpoint there can be read.
  """
  with manager.Checkpoints(directory, create=False) as ckpts:
    _, meta = _latest(ckpts)
  saved = ckpt_meta.config_from_dict(meta.get("model_config", {}))
  return saved.replace(**overrides)


def load(
    directory: str,
    fe: Any,
    state: Any,
    cfg: ModelConfig,
    log: Callable[[str], None] = print,
) -> Any:
  """`state` (a fresh one) with the model of the run in `directory`.

  Args:
    directory: a run's checkpoint directory.
    fe: the run's `TrainingFrontend`.
    state: the run's freshly initialised state (arrays, in their
      shardings).
    cfg: the run's `ModelConfig` (`model_config`).
    log: where the one-line note goes.

  Returns:
    The state with the checkpoint's variables; its optimizer state and
    step are the fresh ones.

  Raises:
    ValueError: no checkpoint reads, or its model is not `cfg`'s.
  """
  tree = fe.checkpoint_tree(state)
  flat = traverse_util.flatten_dict({VARIABLES: tree[VARIABLES]})
  with manager.Checkpoints(directory, create=False) as ckpts:
    step, _ = _latest(ckpts)
    saved = ckpts.saved_leaves(step)
    # Adapters the checkpoint lacks (this run adds them) stay fresh.
    fresh = {
        p: v
        for p, v in flat.items()
        if p not in saved and lora_tree.is_adapter(p[2:])
    }
    target = traverse_util.unflatten_dict(
        {p: v for p, v in flat.items() if p not in fresh}
    )
    restored = ckpts.restore(
        target,
        step,
        config=lora_tree.without_adapters(cfg) if fresh else cfg,
        fresh_fp8_state=True,
        partial=True,
    )
  loaded = traverse_util.flatten_dict(restored.tree) | fresh
  out = traverse_util.flatten_dict(dict(tree)) | loaded
  note = ", fresh fp8 state" if restored.fresh_fp8_state else ""
  log(
      f"init from {ckpts.step_dir(step)}: its model{note}; a fresh optimizer"
      " from step 0"
  )
  return fe.from_checkpoint_tree(traverse_util.unflatten_dict(out), state)
