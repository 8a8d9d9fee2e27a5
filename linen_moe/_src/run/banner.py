"""What a run says before its first step: the model and what differs from
its named config, its parameters (total, active per token, trainable), the
devices and mesh, the data and its epoch, and the recipe's settings.

    linen-moe train: tiny_mixtral (quantization=fp8), scratch recipe
      Hugging Face: exports as mixtral
      parameters: 1.42 M total, 0.53 M active a token, 1.42 M trainable
      devices: 8 cpu, mesh data=2,expert=4
      data: 3 files of text, 40,961 tokens, 1,170 training sequences of 32:
        73 steps an epoch at batch 16
      steps 1-200, batch 16 x 32 tokens (102,400 in all), learning rate
        0.01 (constant), weight decay 0

Counts come from the shapes of the state's parameters (no computation).
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any

from flax import traverse_util

from linen_moe._src.config.expert_weights import KERNELS
from linen_moe._src.config.expert_weights import ROUTER
from linen_moe._src.lora import tree as lora_tree
from linen_moe._src.parallel import sharding


def _size(leaf: Any) -> int:
  return int(math.prod(getattr(leaf, "shape", ())))


def parameter_counts(params: Mapping, config: Any) -> dict[str, int]:
  """Total, active-per-token and trainable parameter counts.

  A routed expert kernel (a kernel of `KERNELS` beside a router `gate`)
  counts `num_experts_per_tok / num_experts` of itself as active; every
  other parameter counts whole. With adapters, only they train.

  Args:
    params: the `params` collection (arrays or abstract, boxed or not).
    config: the run's `ModelConfig`.

  Returns:
    {"total", "active", "trainable"}.
  """
  params = sharding.unbox(dict(params))
  flat = traverse_util.flatten_dict(params)
  moe = config.moe
  share = moe.num_experts_per_tok / moe.num_experts
  total = active = 0
  for path, leaf in flat.items():
    n = _size(leaf)
    total += n
    parent = params
    for key in path[:-1]:
      parent = parent[key]
    kernel = str(path[-1]).removesuffix("_lora_a").removesuffix("_lora_b")
    routed = kernel in KERNELS and ROUTER in parent  # adapters of one too
    active += n * share if routed else n
  trainable = lora_tree.count_trainable(params)
  if not lora_tree.has_adapters(params):
    trainable = total
  return {"total": total, "active": round(active), "trainable": trainable}


def _millions(n: int) -> str:
  if n >= 1e9:
    return f"{n / 1e9:.2f} B"
  return f"{n / 1e6:.2f} M"


def _model_line(opts: Any, config: Any) -> str:
  start = opts.init_from_hf or opts.init_from
  name = f"from {start}" if start else opts.model_name
  overrides = dict(opts.overrides)
  if "lora_alpha" in overrides and config.moe.lora is not None:
    overrides["lora_alpha"] = config.moe.lora.alpha  # 0 means the rank
  changed = ", ".join(f"{k}={v}" for k, v in sorted(overrides.items()))
  return (
      f"linen-moe train: {name}{f' ({changed})' if changed else ''}, "
      f"{opts.recipe.name} recipe"
  )


def _family_line(config: Any) -> str:
  """Whether the Hugging Face export writes the model, said before
  training rather than at export."""
  from linen_moe._src.hf import config_map  # noqa: PLC0415

  match = config_map.family_match(config)
  if match.exports and config.moe.lora is not None:
    from linen_moe._src.hf import peft  # noqa: PLC0415

    adapters = "adapters in PEFT's format"
    if peft.without_peft_form(config):
      adapters += (
          " but the routed experts' (stored as x @ W: linen_moe's files "
          "hold them)"
      )
    return f"  Hugging Face: exports as {match.model_type}, {adapters}"
  if match.exports:
    return f"  Hugging Face: exports as {match.model_type}"
  siblings = ", ".join(exporting_configs(match.model_type))
  return (
      f"  Hugging Face: no form (the nearest family, {match.model_type}, "
      f"needs {'; '.join(match.differences)}"
      + (f"; shipped configs that export as it: {siblings}" if siblings else "")
      + ")"
  )


def exporting_configs(model_type: str) -> list[str]:
  """The shipped configs that export as Hugging Face's `model_type`
  (sorted; reads the YAML files, no jax)."""
  from linen_moe._src.config.files import available_configs  # noqa: PLC0415
  from linen_moe._src.config.files import load_model_config  # noqa: PLC0415
  from linen_moe._src.hf import config_map  # noqa: PLC0415

  found = []
  for name in available_configs():
    match = config_map.family_match(load_model_config(name))
    if match.exports and match.model_type == model_type:
      found.append(name)
  return found


def _data_line(opts: Any, meta: Mapping) -> list[str]:
  if meta.get("kind", "markov") == "markov":
    return [f"  data: synthetic Markov tokens (seed {opts.seed + 1})"]
  pipeline = meta["pipeline"]
  corpus = pipeline["corpus"]
  files = corpus["files"]
  sequences = pipeline["train_sequences"]
  per_epoch = sequences // pipeline["batch_size"]
  return [
      (
          f"  data: {len(files)} file{'s' if len(files) != 1 else ''} of "
          f"{corpus['format']}, {corpus['num_tokens']:,} tokens, "
          f"{sequences:,} training sequences of {pipeline['seq_len']}:"
      ),
      f"    {per_epoch:,} steps an epoch at batch {pipeline['batch_size']}",
  ]


def lines(
    opts: Any,
    config: Any,
    params: Mapping,
    data_meta: Mapping,
    devices: list,
    mesh: str | None,
    optimizer: Mapping[str, Any],
    first_step: int = 1,
) -> list[str]:
  """The banner of a run, a line a fact.

  Args:
    opts: the run's `RunOptions`.
    config: its `ModelConfig`.
    params: its state's `params` (arrays or abstract).
    data_meta: its data source's `meta`.
    devices: the devices a step runs on.
    mesh: the mesh spec, or None on one device.
    optimizer: the run's optimizer settings (`schedule.settings`).
    first_step: the first step this run takes (a resumed run's is the
      restored step + 1).

  Returns:
    The lines, without newlines.
  """
  counts = parameter_counts(params, config)
  kinds = sorted({d.platform for d in devices})
  schedule = optimizer["lr_schedule"]
  warmup = optimizer["warmup_steps"]
  after = f"{schedule} after {warmup} warmup steps" if warmup else schedule
  tokens = opts.batch_size * opts.seq_len
  steps = opts.steps - first_step + 1
  if optimizer["learning_rate"] is None:
    rates = f"your optimizer ({type(opts.optimizer).__name__})"
  else:
    rates = (
        f"learning rate {optimizer['learning_rate']:g} ({after}), weight "
        f"decay {optimizer['weight_decay']:g}"
    )
  return [
      _model_line(opts, config),
      _family_line(config),
      (
          f"  parameters: {_millions(counts['total'])} total, "
          f"{_millions(counts['active'])} active a token, "
          f"{_millions(counts['trainable'])} trainable"
      ),
      f"  devices: {len(devices)} {'/'.join(kinds)}"
      + (f", mesh {mesh}" if mesh else ""),
      *_data_line(opts, data_meta),
      (
          f"  steps {first_step}-{opts.steps}, batch {opts.batch_size} x "
          f"{opts.seq_len} tokens ({tokens * steps:,} in all), {rates}"
      ),
  ]
