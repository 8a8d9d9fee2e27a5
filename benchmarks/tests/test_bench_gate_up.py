"""bench_gate_up.py's variants' tiles and a tiny interpreted run."""

import json
import pathlib
import tempfile

from absl.testing import absltest
import bench_gate_up as bench
import jax.numpy as jnp

from linen_moe._src.kernels.tpu import gmm_tiling  # noqa: TID251


class VariantTilingTest(absltest.TestCase):

  def test_each_variant_changes_only_its_tiles(self):
    m, k, n, g = 32768, 2048, 5632, 8
    single = gmm_tiling.choose_tiling(m, k, n, g, jnp.bfloat16, "v5e")
    tiles = lambda t: (t.gmm, t.gmm_t, t.tgmm)  # noqa: E731
    self.assertIsNone(bench.variant_tiling("two", m, k, n, g, "v5e"))
    self.assertEqual(
        tiles(bench.variant_tiling("paired_single", m, k, n, g, "v5e")),
        tiles(single),
    )
    # N = 5632 = 44 x 128: the multiples of 128 dividing it are 128 x
    # (1, 2, 4, 11, 22, 44); below 2816 comes 1408, below 1408 comes 512.
    half_n = bench.variant_tiling("paired_half_n", m, k, n, g, "v5e")
    (am, ak, an), (bm, bn, bk), (cm, ck, cn) = tiles(single)
    self.assertEqual(an, 2816)
    self.assertEqual(half_n.gmm, (am, ak, 1408))
    self.assertEqual(half_n.gmm_t, (bm, 512, bk))
    self.assertEqual(half_n.tgmm, (cm, ck, 1408))
    with self.assertRaisesRegex(ValueError, "unknown variant 'x'"):
      bench.variant_tiling("x", m, k, n, g, "v5e")


class TinyRunTest(absltest.TestCase):

  def test_every_variant_is_timed(self):
    with tempfile.TemporaryDirectory() as out:
      bench.main(["--interpret", "--out", out])
      got = json.loads(pathlib.Path(out, "bench_gate_up.json").read_text())
    (shape,) = got["results"]
    self.assertEqual(shape["shape"], [512, 256, 384, 4])
    self.assertEqual(set(shape["variants"]), set(bench.VARIANTS))
    for name, entry in shape["variants"].items():
      self.assertNotIn("error", entry, name)
      self.assertGreater(min(entry["ms"], entry["forward_ms"]), 0, name)
    self.assertIsNone(shape["variants"]["two"]["tiling"])
    self.assertIsNotNone(shape["variants"]["paired"]["tiling"])


if __name__ == "__main__":
  absltest.main()
