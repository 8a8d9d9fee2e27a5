"""The chart of a run's losses, drawn from its `metrics.jsonl`.

`losses.png` beside it: the training cross-entropy of every step and the
held-out loss of the evaluated steps (`eval_loss`), against the step.
Drawn with matplotlib when it is installed; without it, one line says how
to install it and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable
import json
import os

CHART_FILE = "losses.png"


def read_losses(metrics_path: str) -> tuple[list, list]:
  """([(step, cross_entropy)], [(step, eval_loss)]) of a metrics file; torn
  lines are skipped."""
  train, held_out = [], []
  with open(metrics_path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      step = row.get("step")
      if "cross_entropy" in row:
        train.append((step, row["cross_entropy"]))
      if "eval_loss" in row:
        held_out.append((step, row["eval_loss"]))
  return train, held_out


def draw(metrics_path: str, out: str) -> str:
  """Draws the chart of `metrics_path` into `out` (PNG); returns `out`."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  train, held_out = read_losses(metrics_path)
  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    ax.plot(*zip(*train, strict=True), label="train (cross-entropy)", lw=1)
  if held_out:
    ax.plot(*zip(*held_out, strict=True), "o-", label="held-out", lw=1.5)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per token)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def chart_beside(metrics_path: str, log: Callable[[str], None]) -> str | None:
  """Draws `losses.png` beside `metrics_path` and says where; without
  matplotlib, says how to install it. Returns the chart's path or None."""
  out = os.path.join(os.path.dirname(metrics_path), CHART_FILE)
  try:
    import matplotlib  # noqa: F401, PLC0415
  except ImportError:
    log(
        f"matplotlib is not installed, so the chart of the losses ({out}) is"
        " not drawn; install it with pip install matplotlib (from a checkout:"
        " pip install '.[bench]' or scripts/setup_venv.sh bench)."
    )
    return None
  log(f"chart of the losses: {draw(metrics_path, out)}")
  return out
