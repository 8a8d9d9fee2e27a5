"""`linen-moe bench` reporting: peer files, the table, the chart (no timing),
bad options, matplotlib missing."""

import json
import os
import sys
import tempfile
from unittest import mock

from absl.testing import absltest

from linen_moe import testing
from linen_moe_cli import bench_report
from linen_moe_cli import main as cli
from linen_moe_cli.bench import Case
from linen_moe_cli.bench_peer import load_peer


def _row(size, path, step_s, dtype="float32"):
  row = bench_report._row(
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
    table = bench_report.format_rows(rows, peer).splitlines()
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
    bench_report.write_chart(rows, path, peer)
    self.assertGreater(os.path.getsize(path), 1000)


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
            bench_report, "run_case_subprocess", return_value=fake
        ) as run_case,
    ):
      status, _, err = testing.run_capturing(
          cli.main, ["bench", "--sweep", "capacity", "--out", out]
      )
      self.assertEqual(status, 0)
      self.assertGreater(run_case.call_count, 1)
      self.assertEqual(sorted(os.listdir(out)), ["bench.json"])
      with open(os.path.join(out, "bench.json"), encoding="utf-8") as f:
        self.assertLen(json.load(f)["rows"], run_case.call_count - 1)
    self.assertRegex(
        err,
        r"^linen-moe bench: matplotlib is not installed, so the chart "
        r"\(bench.png\) is skipped; .* pip install 'linen_moe\[bench\]'",
    )

  def test_bad_repeats(self):
    status, _, err = testing.run_capturing(
        cli.main, ["bench", "--repeats", "0"]
    )
    self.assertEqual((status, err.count("\n")), (2, 1))
    self.assertIn("repeats=0 (--repeats) is invalid", err)


if __name__ == "__main__":
  absltest.main()
