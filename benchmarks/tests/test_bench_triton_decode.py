"""benchmarks/gpu/bench_triton_decode.py: its routing, and what it reports
from the times and bandwidth it measures (here given, not measured),
against numbers worked out by hand."""

import pathlib
import sys
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

GPU = pathlib.Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU))

import bench_triton_decode as bench  # noqa: E402

# One layer, two tokens of top-2 among 6 experts of 40 x 24: experts 2, 3
# and 5, 2 twice.
IDS = np.asarray([[[2, 3], [2, 5]]], np.int32)
TIMES = {"decode": 4e-6, "triton_gmm": 8e-6, "ragged_dot": 2e-5}


class BenchTritonDecodeTest(parameterized.TestCase):

  @parameterized.parameters((1, 8, 128), (8, 2, 8), (8, 8, 128), (3, 1, 1))
  def test_routing_picks_distinct_experts_per_token(self, batch, top_k, e):
    ids = bench.routing(batch, top_k, e, layers=2)
    self.assertEqual(ids.shape, (2, batch, top_k))
    rows = ids.reshape(-1, top_k)
    self.assertTrue(all(len(set(row)) == top_k for row in rows))
    self.assertTrue(((ids >= 0) & (ids < e)).all())

  # 3 distinct experts of 40 x 24: bfloat16 3 * 960 * 2 = 5,760 bytes;
  # int8 3 * (960 * 1 + 24 * 4 scale bytes) = 3,168; float8 3 * 960 + 2
  # scalar scales of 4 bytes = 2,888. At 4 us and 1 GB/s: 1.44, 0.792,
  # 0.722 of the limit.
  @parameterized.parameters(
      ("bfloat16", 5760, 1.44, 0.72, 0.288),
      ("int8", 3168, 0.792, 0.72, 0.288),
      ("float8_e4m3fn", 2888, 0.722, 0.72, 0.288),
  )
  def test_reports_the_fraction_of_the_weight_read_limit(
      self, w_dtype, nbytes, decode, gmm, ragged
  ):
    with mock.patch.object(bench, "_alternating", return_value=TIMES):
      r = bench.time_decode(
          6, 40, 24, 2, 2, 1, w_dtype=w_dtype, bandwidth=1e9, ids=IDS,
          interpret=True,
      )  # fmt: skip
    self.assertEqual(r["distinct_experts"], 3)
    self.assertEqual(r["weight_bytes"], nbytes)
    self.assertAlmostEqual(r["limit_s"], nbytes / 1e9)
    # bf16 route bytes 5,760 at 8 us and 20 us: 0.72 and 0.288 of 1 GB/s.
    want = {"decode": decode, "triton_gmm": gmm, "ragged_dot": ragged}
    for route, fraction in want.items():
      self.assertAlmostEqual(r["fraction_of_limit"][route], fraction)
    self.assertAlmostEqual(r["bytes_per_s"]["decode"], nbytes / 4e-6)
    self.assertAlmostEqual(r["decode_speedup"]["triton_gmm"], 2.0)
    self.assertAlmostEqual(r["decode_speedup"]["ragged_dot"], 5.0)

  def test_layers_add_their_distinct_experts(self):
    """Two layers: the first's 3 experts and [[2, 3], [3, 2]]'s 2 (the
    same experts of another layer's weights), so 5 x 960 weights: bfloat16
    9,600 bytes; float8 4,800 + 2 x 8 = 4,816."""
    ids = np.concatenate([IDS, [[[2, 3], [3, 2]]]])
    self.assertEqual(bench.weight_bytes(ids, 40, 24, "bfloat16"), 9600)
    self.assertEqual(bench.weight_bytes(ids, 40, 24, "float8_e4m3fn"), 4816)
    self.assertEqual(bench.weight_bytes(ids, 40, 24, "int8"), 4800 + 480)
    with mock.patch.object(bench, "_alternating", return_value=TIMES):
      r = bench.time_decode(
          6, 40, 24, 2, 2, 2, bandwidth=1e9, ids=ids, interpret=True
      )
    self.assertEqual(r["distinct_experts"], 5)
    self.assertAlmostEqual(r["fraction_of_limit"]["decode"], 9600e-9 / 4e-6)
    with self.assertRaisesRegex(ValueError, r"ids must have shape \[L, B, k\]"):
      bench.time_decode(6, 40, 24, 2, 2, 1, bandwidth=1e9, ids=ids)

  def test_copy_bandwidth_counts_a_read_and_a_write(self):
    with mock.patch.object(bench, "_alternating", return_value={"copy": 0.5}):
      self.assertEqual(bench.copy_bandwidth(1 << 20, rounds=1), 4 * (1 << 20))


if __name__ == "__main__":
  absltest.main()
