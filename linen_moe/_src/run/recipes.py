"""The defaults of a kind of run: training from scratch, fine-tuning a
pretrained model, or training LoRA adapters on one.

A run's options leave these fields unset unless the user sets them
(`RunOptions.steps`, `batch_size`, `seq_len`, `learning_rate`,
`lr_schedule`, `warmup_steps`); the run's kind picks the recipe that fills
them. From scratch, the reference decoder's tiny configs train on synthetic
data in seconds at a high constant rate. From a pretrained start (a Hugging
Face checkpoint, another run's checkpoint) the rates are the ones the peers
fine-tune at: about 2e-5 for every weight (torchtune's full fine-tuning
configs, TRL's and Axolotl's examples; Hugging Face's Trainer defaults to
5e-5), 2e-4 for adapters (the QLoRA paper, PEFT's and TRL's examples;
torchtune's LoRA configs use 3e-4), each after a linear warmup of 3 % of
the steps (Alpaca's and TRL's `warmup_ratio`) and with a cosine decay to a
tenth (`DEFAULT_FINAL_LR_RATIO`), on rows of 1,024 tokens in batches of 8,
what one small GPU or TPU host trains.

The recipe and what it resolved to go into the first row of a run's
metrics.jsonl (`record`) and its start banner. Imports no jax.
"""

from __future__ import annotations

import dataclasses

# The fields a recipe fills, `RunOptions`' of the same names.
FIELDS = (
    "steps",
    "batch_size",
    "seq_len",
    "learning_rate",
    "lr_schedule",
    "warmup_steps",
)


@dataclasses.dataclass(frozen=True)
class Recipe:
  """The defaults of one kind of run.

  Attributes:
    name: "scratch", "fine-tune" or "lora".
    steps: steps to train.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    learning_rate: the peak rate.
    lr_schedule: after the warmup, "constant" or "cosine".
    warmup_fraction: the share of `steps` of linear warmup from 0.
  """

  name: str
  steps: int
  batch_size: int
  seq_len: int
  learning_rate: float
  lr_schedule: str
  warmup_fraction: float

  def warmup_steps(self, steps: int) -> int:
    """The warmup of a run of `steps` steps: `warmup_fraction` of them.

    Args:
      steps: the run's steps.

    Returns:
      round(warmup_fraction x steps), fewer than `steps` when the schedule
      decays.
    """
    warmup = round(self.warmup_fraction * steps)
    return min(warmup, steps - 1) if self.lr_schedule != "constant" else warmup


SCRATCH = Recipe("scratch", 200, 16, 32, 1e-2, "constant", 0.0)
FINE_TUNE = Recipe("fine-tune", 1000, 8, 1024, 2e-5, "cosine", 0.03)
LORA = Recipe("lora", 1000, 8, 1024, 2e-4, "cosine", 0.03)
RECIPES = {r.name: r for r in (SCRATCH, FINE_TUNE, LORA)}


def recipe_for(*, pretrained: bool, lora: bool) -> Recipe:
  """The recipe of a run.

  Args:
    pretrained: the run starts from trained weights (a Hugging Face
      checkpoint or another run's checkpoint).
    lora: the run trains adapters alone.

  Returns:
    `LORA` for adapters, else `FINE_TUNE` from a pretrained start, else
    `SCRATCH`.
  """
  if lora:
    return LORA
  return FINE_TUNE if pretrained else SCRATCH


def described(field: str) -> str:
  """Each recipe's default of `field`, for a flag's help: "200 from
  scratch, 1000 from a pretrained model, 1000 with LoRA"."""
  where = {
      "scratch": "from scratch",
      "fine-tune": "from a pretrained model",
      "lora": "with LoRA",
  }
  if field == "warmup_steps":
    values = {
        r.name: (
            f"{round(100 * r.warmup_fraction)}% of the steps"
            if r.warmup_fraction
            else "0"
        )
        for r in RECIPES.values()
    }
  else:
    values = {r.name: f"{getattr(r, field)}" for r in RECIPES.values()}
  return ", ".join(f"{values[n]} {where[n]}" for n in RECIPES)


def record(name: str, optimizer: dict, opts) -> dict:
  """What a run trains with, for its metrics' first row.

  Args:
    name: the recipe's name.
    optimizer: the run's optimizer settings (`schedule.settings`).
    opts: its `RunOptions` (filled: no field unset).

  Returns:
    {"name", "steps", "batch_size", "seq_len", "learning_rate",
    "lr_schedule", "warmup_steps", "final_lr_ratio", "weight_decay"}: the
    values the run uses, the recipe's or the user's.
  """
  out = {"name": name}
  out.update({f: getattr(opts, f) for f in FIELDS[:3]})
  for key in (*FIELDS[3:], "final_lr_ratio", "weight_decay"):
    out[key] = optimizer[key]
  return out
