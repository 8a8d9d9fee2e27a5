"""bench_int8_mxu.py, run in Pallas interpret mode at a tiny shape: every
program compiles and runs, and each rate is its work over its time."""

import json
import os
import tempfile

from absl.testing import absltest
import bench_int8_mxu


class Int8MxuTest(absltest.TestCase):

  def test_tiny_run(self):
    m, k, n, g = 256, 256, 512, 4
    with tempfile.TemporaryDirectory() as out:
      argv = ["--interpret", "--shapes", f"{m},{k},{n},{g}", "--repeats", "1"]
      self.assertEqual(
          bench_int8_mxu.main([*argv, "--top", "1", "--out", out]), 0
      )
      with open(os.path.join(out, "bench_int8_mxu.json")) as f:
        (result,) = json.load(f)["results"]
    ms, rate = result["ms"], result["rate"]
    for name in ("dense_bf16", "dense_int8", "gmm_bf16", "quant_lhs"):
      self.assertIn(name, ms)
    self.assertTrue(any(name.startswith("gmm_int8 ") for name in ms))
    # TOP/s: 2 M K N over the time; GB/s: bf16 read, int8 and scales written.
    self.assertAlmostEqual(
        rate["dense_int8"], 2 * m * k * n / (ms["dense_int8"] / 1e3) / 1e12
    )
    moved = g * k * n * 3 + g * n * 4
    self.assertAlmostEqual(
        rate["quant_rhs"], moved / (ms["quant_rhs"] / 1e3) / 1e9
    )


if __name__ == "__main__":
  absltest.main()
