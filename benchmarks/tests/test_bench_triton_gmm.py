"""benchmarks/gpu/bench_triton_gmm.py: its group patterns, what it reports
from the times it measures (here given, not measured), and that a sweep's
entry is one `triton_tiles.choose_tiling` reads back."""

import pathlib
import sys
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

GPU = pathlib.Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU))

import bench_triton_gmm as bench  # noqa: E402

from linen_moe._src.kernels.gpu import triton_tiles  # noqa: E402, TID251


class BenchTritonGmmTest(parameterized.TestCase):

  @parameterized.parameters((64, 4), (100, 8), (131072, 128), (7, 1))
  def test_group_patterns(self, m, g):
    equal = bench.group_sizes("equal", m, g)
    self.assertEqual(int(equal.sum()), m)
    self.assertLessEqual(int(equal.max() - equal.min()), g)
    skewed = bench.group_sizes("skewed", m, g)
    self.assertEqual(int(skewed.sum()), m)
    self.assertGreaterEqual(int(skewed[0]), m // 2)
    self.assertEqual(int(np.sum(skewed == 0)), g // 4)
    with self.assertRaisesRegex(ValueError, "pattern must be one of"):
      bench.group_sizes("zipf", m, g)

  def test_reports_the_fraction_of_dense(self):
    times = {"ours": 4e-3, "dense": 3e-3}
    with mock.patch.object(bench, "_alternating", return_value=times):
      r = bench.time_triton_gmm(64, 32, 48, 4, interpret=True)
    self.assertAlmostEqual(r["fraction_of_dense"], 0.75)
    self.assertAlmostEqual(r["tflops"]["ours"], 6 * 64 * 32 * 48 / 4e-3 / 1e12)
    self.assertEqual((r["m"], r["k"], r["n"], r["g"]), (64, 32, 48, 4))

  def test_a_sweep_entry_is_read_back_by_choose_tiling(self):
    # The second candidate of each pass is the fastest.
    seconds = iter([2.0, 1.0] * 3)
    with mock.patch.object(
        bench, "_alternating", side_effect=lambda *a: {"t": next(seconds)}
    ):
      s = bench.sweep_tiles(
          64, 32, 48, 4, interpret=True, candidates=bench.DRY_CANDIDATES
      )
    entry = s["entry"]
    for name in triton_tiles.PASSES:
      self.assertEqual(entry[name], bench.DRY_CANDIDATES[name][1])
    tiling = triton_tiles.choose_tiling(
        100, 32, 48, 4, "bfloat16", entry["device_kind"], table=(entry,)
    )
    tiling.check()
    self.assertEqual(tiling.gmm, triton_tiles.Tiles(32, 16, 16, 4, 3, 2))
    other = triton_tiles.choose_tiling(
        100, 32, 48, 4, "bfloat16", "NVIDIA B200", table=(entry,)
    )
    self.assertEqual(other, triton_tiles.DEFAULT)


if __name__ == "__main__":
  absltest.main()
