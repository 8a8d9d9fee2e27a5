"""A run's chart of its losses (`losses.png` beside `metrics.jsonl`,
`_src/run/loss_chart.py`): the training cross-entropy of every step and the
held-out loss of the evaluated steps; without matplotlib, one line instead."""

import json
import os
import sys
from unittest import mock

from absl.testing import absltest
import matplotlib.figure
import numpy as np

from linen_moe._src.run import loss_chart
from linen_moe._src.testing import helpers


class LossChartTest(absltest.TestCase):

  def test_both_curves(self):
    directory = helpers.tempdir(self)
    metrics = os.path.join(directory, "metrics.jsonl")
    rows = [{"step": i, "loss": 9.0, "cross_entropy": 5.0 - i} for i in (1, 2)]
    rows[1].update(eval_loss=4.5, eval_perplexity=90.0)
    with open(metrics, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
      f.write('{"step": 3, "cross_')  # a torn last line is passed over
    figures = []
    save = matplotlib.figure.Figure.savefig

    def recording_save(fig, *args, **kwargs):
      figures.append(fig)
      return save(fig, *args, **kwargs)

    logged = []
    with mock.patch.object(matplotlib.figure.Figure, "savefig", recording_save):
      out = loss_chart.chart_beside(metrics, logged.append)
    self.assertEqual(out, os.path.join(directory, "losses.png"))
    self.assertEqual(logged, [f"chart of the losses: {out}"])
    (fig,) = figures
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    self.assertEqual(set(lines), {"train (cross-entropy)", "held-out"})
    train, held_out = lines["train (cross-entropy)"], lines["held-out"]
    np.testing.assert_array_equal(train.get_xdata(), [1, 2])
    np.testing.assert_array_equal(train.get_ydata(), [4.0, 3.0])
    np.testing.assert_array_equal(held_out.get_xdata(), [2])
    np.testing.assert_array_equal(held_out.get_ydata(), [4.5])
    with open(out, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    os.remove(out)
    logged.clear()
    with mock.patch.dict(sys.modules, {"matplotlib": None}):
      self.assertIsNone(loss_chart.chart_beside(metrics, logged.append))
    self.assertFalse(os.path.exists(out))
    (line,) = logged
    self.assertRegex(line, r"^matplotlib is not installed, .*losses.png")


if __name__ == "__main__":
  absltest.main()
