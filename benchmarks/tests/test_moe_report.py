"""The layer benchmark's reporting (`layer/moe_report.py`, `bench_moe.py`):
peer files, the table, the chart (no timing), bad options, matplotlib
missing."""

import contextlib
import io
import json
import os
import struct
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
import bench_moe
import matplotlib
import matplotlib.figure
import numpy as np

from linen_moe import testing

from common.layer_case import SIZES
from common.layer_case import Case
import moe_report
from moe_report import load_peer


def _row(size, path, step_s, dtype="float32"):
  row = moe_report._row(
      Case(size, path, dtype=dtype),
      {
          "step_s": step_s,
          "cpu_s": step_s,
          "compile_s": 1.0,
          "tokens_per_s": 100.0,
          "useful_gflops": 10.0,
          "roofline_gflops": 100.0,
          "cpu_roofline_fraction": 0.2,
          "max_rss_mib": 1.0,
      },
      100.0,
  )
  return row


def _write(payload) -> str:
  fd, path = tempfile.mkstemp(suffix=".json")
  with os.fdopen(fd, "w") as f:
    f.write(payload if isinstance(payload, str) else json.dumps(payload))
  return path


class PeerTest(absltest.TestCase):

  def test_table_shows_peer_time_and_ratio(self):
    peer = load_peer(
        _write({
            "name": "MaxText",
            "rows": [
                {"size": "gemma_like", "path": "dense_dropping", "step_s": 2.0},
                {"size": "gemma_like", "path": "sparse", "error": "OOM"},
            ],
        })
    )
    rows = [
        _row("gemma_like", "dense_dropping", 0.5),
        _row("gemma_like", "sparse", 1.0),
        _row("gemma_like", "dense_dropping", 0.7, dtype="bfloat16"),
    ]
    table = moe_report.format_rows(rows, peer).splitlines()
    self.assertIn("ours/peer", table[0])
    self.assertRegex(table[1], r"2000\.0\s+0\.25$")  # 0.5 s / 2.0 s
    self.assertIn("peer: OOM", table[2])
    self.assertNotIn("peer", table[3])  # no bfloat16 peer row

  def test_bad_peer_files_name_the_problem(self):
    for payload, message in (
        ("not json", "cannot read JSON"),
        ({"rows": {}}, "'rows' list"),
        ({"rows": [{"size": "tiny", "path": "sparse"}]}, "row 0"),
    ):
      with self.assertRaisesRegex(ValueError, message):
        load_peer(_write(payload))

  def test_chart_with_peer_and_roofline(self):
    peer = {
        "name": "MaxText",
        "rows": [{
            "size": "small",
            "path": "sparse",
            "dtype": "float32",
            "step_s": 0.3,
        }],
    }
    rows = [_row("tiny", "sparse", 0.1), _row("small", "sparse", 0.2)]
    path = os.path.join(tempfile.mkdtemp(), "bench.png")
    figures = []
    save = matplotlib.figure.Figure.savefig

    def recording_save(fig, *args, **kwargs):
      figures.append(fig)
      return save(fig, *args, **kwargs)

    with mock.patch.object(matplotlib.figure.Figure, "savefig", recording_save):
      moe_report.write_chart(rows, path, peer)
    (fig,) = figures
    (ax,) = fig.axes  # one panel: float32, no quantization
    self.assertEqual(ax.get_title(), "RoutedMoE, float32, quantization=none")
    self.assertEqual(ax.get_yscale(), "log")
    self.assertEqual([t.get_text() for t in ax.get_xticklabels()], list(SIZES))
    lines = {line.get_label(): line for line in ax.get_lines()}
    self.assertEqual(
        set(lines), {"sparse", "sparse (MaxText)", "matmul roofline"}
    )
    # x: the index of the size in SIZES; y: step seconds.
    ours, theirs = lines["sparse"], lines["sparse (MaxText)"]
    np.testing.assert_array_equal(ours.get_xdata(), [0, 1])  # tiny, small
    np.testing.assert_allclose(ours.get_ydata(), [0.1, 0.2])
    np.testing.assert_array_equal(theirs.get_xdata(), [1])  # small only
    np.testing.assert_allclose(theirs.get_ydata(), [0.3])
    self.assertEqual(theirs.get_linestyle(), "--")
    self.assertEqual(theirs.get_color(), ours.get_color())
    # The roofline: useful GFLOP / roofline GFLOP/s = 10 * step / 100.
    roofline = lines["matmul roofline"]
    np.testing.assert_allclose(roofline.get_ydata(), [0.01, 0.02])
    self.assertEqual(
        (roofline.get_color(), roofline.get_linestyle()), ("black", ":")
    )
    # The file holds that figure: a PNG of 5.5 x 4.5 inches at 100 dpi.
    with open(path, "rb") as f:
      header = f.read(24)
    self.assertEqual(header[:8], b"\x89PNG\r\n\x1a\n")
    self.assertEqual(struct.unpack(">II", header[16:24]), (550, 450))


class CommandTest(absltest.TestCase):

  def test_without_matplotlib_writes_json_and_says_how(self):
    fake = {
        "step_s": 1e-3,
        "compile_s": 1.0,
        "tokens_per_s": 1.0,
        "useful_gflops": 1.0,
        "gflops": 2.0,
        "max_rss_mib": 1.0,
    }
    with (
        tempfile.TemporaryDirectory() as out,
        mock.patch.dict(sys.modules, {"matplotlib": None}),
        mock.patch.object(
            bench_moe, "run_case_subprocess", return_value=fake
        ) as run_case,
    ):
      status, _, err = testing.run_capturing(
          bench_moe.main, ["--sweep", "capacity", "--out", out]
      )
      self.assertEqual(status, 0)
      self.assertGreater(run_case.call_count, 1)
      self.assertEqual(sorted(os.listdir(out)), ["bench.json"])
      with open(os.path.join(out, "bench.json"), encoding="utf-8") as f:
        self.assertLen(json.load(f)["rows"], run_case.call_count - 1)
    self.assertRegex(
        err,
        r"^bench_moe: matplotlib is not installed, so the chart "
        r"\(bench.png\) is skipped; .*pip install matplotlib",
    )

  def test_bad_repeats(self):
    err = io.StringIO()
    with (
        contextlib.redirect_stderr(err),
        self.assertRaises(SystemExit) as exit_,
    ):
      bench_moe.main(["--repeats", "0"])
    self.assertEqual(exit_.exception.code, 2)
    self.assertIn("--repeats must be >= 1; got 0", err.getvalue())


if __name__ == "__main__":
  absltest.main()
