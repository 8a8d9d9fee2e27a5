"""bench_gmm.py's group layouts and the tile table it writes, from a tiny
run in Pallas interpret mode (no timing is checked)."""

import json
import pathlib
import tempfile

from absl.testing import absltest
import bench_gmm
import numpy as np


class GroupLayoutTest(absltest.TestCase):

  def test_layouts(self):
    equal = bench_gmm.group_sizes(32768, 128, "equal")
    self.assertEqual(equal.tolist(), [256] * 128)
    skewed = bench_gmm.group_sizes(32768, 128, "skewed")
    self.assertEqual(int(skewed.sum()), 32768)
    self.assertBetween(int(skewed[0]), 16384, 16384 + 95)  # + the remainder
    self.assertEqual(int(np.sum(skewed == 0)), 32)
    small = bench_gmm.group_sizes(8192, 8, "skewed")
    self.assertEqual(small.tolist(), [4097, 819, 819, 819, 819, 819, 0, 0])


class TinyRunTest(absltest.TestCase):

  def test_writes_a_table_the_package_reads(self):
    with tempfile.TemporaryDirectory() as out:
      bench_gmm.main([
          "--interpret",
          "--shapes",
          "128,256,128,4",
          "--repeats",
          "1",
          "--top",
          "1",
          "--chip",
          "v5e",
          "--sweep-layouts",
          "equal",
          "skewed",
          "--out",
          out,
      ])
      table = json.loads(pathlib.Path(out, "gmm_tiles.json").read_text())
      (result,) = json.loads(pathlib.Path(out, "bench_gmm.json").read_text())
    # Each sweep candidate timed on both layouts, its total their sum.
    for record in result["sweep"]:
      self.assertAlmostEqual(
          record["ms"], record["equal"] + record["skewed"], places=3
      )
    (entry,) = [e for e in table["entries"] if e["m"] == 128]
    self.assertEqual(
        (entry["chip"], entry["k"], entry["n"], entry["groups"]),
        ("v5e", 256, 128, 4),
    )
    self.assertIn(entry["fastest"], ("kernel", "ragged_dot"))
    self.assertEqual(set(entry["ms"]), {"equal", "skewed"})
    for op in ("gmm", "gmm_t", "tgmm"):
      self.assertLen(entry[op], 3)


if __name__ == "__main__":
  absltest.main()
