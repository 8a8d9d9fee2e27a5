"""bench_maxtext_layer.py's counting and a tiny run of its own variants
(dense and ours; MaxText's need MaxText, which only the chip's run
installs), and maxtext_wheels.py's trimming of MaxText's wheel."""

import json
import pathlib
import sys
import tempfile
import types
from unittest import mock
import zipfile

from absl.testing import absltest
import bench_maxtext_layer as bench
import maxtext_wheels


class CountingTest(absltest.TestCase):

  def test_useful_flops_give_the_issues_figures(self):
    # Issue 46: MaxText's megablox 62.0 ms at 8 experts is 110 TFLOP/s,
    # both layers' 73 ms at 128 experts 50.
    eight, many = bench.SHAPES["8x2048x5632"], bench.SHAPES["128x2048x768"]
    self.assertAlmostEqual(bench.useful_flops(eight) / 62.0e-3 / 1e12, 110, 0)
    self.assertAlmostEqual(bench.useful_flops(many) / 73e-3 / 1e12, 51, 0)

  def test_variants(self):
    self.assertEqual(bench.parse_variant("dense"), ("dense", "", False, True))
    self.assertEqual(
        bench.parse_variant("maxtext_ragged_dot"),
        ("maxtext", "ragged_dot", False, True),
    )
    self.assertEqual(
        bench.parse_variant("ours_auto_rows_once"),
        ("ours", "auto", True, True),
    )
    self.assertEqual(
        bench.parse_variant("ours_kernel_rows_once_unpaired"),
        ("ours", "kernel", True, False),
    )
    for bad in (
        "maxtext_kernel",
        "maxtext_megablox_rows_once",
        "maxtext_megablox_unpaired",
        "ours_x",
        "ours_auto_paired",
        "ours_auto_unpaired_rows_once",
    ):
      with self.assertRaisesRegex(ValueError, "unknown variant"):
        bench.parse_variant(bad)

  def test_fractions(self):
    self.assertEqual(
        bench.fractions({"dense": 2.0, "ours_auto": 4.0}),
        {"dense": 1.0, "ours_auto": 0.5},
    )
    self.assertEqual(bench.fractions({"ours_auto": 4.0}), {})


class CompiledSizesTest(absltest.TestCase):
  """`--target gpu:...` compiles without a GPU, whose cost analysis is
  None (it crashed with "'NoneType' object has no attribute 'get'")."""

  def test_a_gpu_compile_without_cost_analysis(self):
    shape = bench.TINY["8x2048x5632"]
    memory = types.SimpleNamespace(
        temp_size_in_bytes=2**30, argument_size_in_bytes=2**29
    )
    flops = 3 * bench.useful_flops(shape)
    calls = {
        "gpu": mock.Mock(
            memory_analysis=mock.Mock(return_value=memory),
            cost_analysis=mock.Mock(return_value=None),
        ),
        "tpu": mock.Mock(
            memory_analysis=mock.Mock(return_value=memory),
            cost_analysis=mock.Mock(return_value=[{"flops": flops}]),
        ),
    }
    got = bench.compiled_sizes(calls, shape)
    self.assertEqual(
        got["gpu"],
        {"temp_gib": 1.0, "argument_gib": 0.5, "flops_over_useful": None},
    )
    self.assertAlmostEqual(got["tpu"]["flops_over_useful"], 3.0)


class TinyRunTest(absltest.TestCase):

  def test_ours_beside_dense(self):
    with tempfile.TemporaryDirectory() as out:
      bench.main([
          "--interpret",
          "--shapes",
          "128x2048x768",
          "--variants",
          "dense",
          "ours_ragged_dot",
          "ours_auto",
          "ours_kernel_unpaired",
          "--repeats",
          "1",
          "--out",
          out,
      ])
      got = json.loads(
          pathlib.Path(out, "bench_maxtext_layer.json").read_text()
      )
    shape = got["shapes"]["128x2048x768"]
    self.assertEqual(shape["errors"], {})
    self.assertEqual(
        set(shape["ms"]),
        {"dense", "ours_ragged_dot", "ours_auto", "ours_kernel_unpaired"},
    )
    self.assertEqual(shape["fraction_of_dense"]["dense"], 1.0)
    diffs = shape["differences"]
    self.assertEqual(diffs["reference"], "ours_ragged_dot")
    # ours_kernel_unpaired: the Pallas kernels (interpreted), the gate and
    # up projections as two calls; both compute what ragged_dot does.
    for name in ("ours_auto", "ours_kernel_unpaired"):
      leaves = diffs["variants"][name]
      self.assertContainsSubset(
          {"out", "x_grad", "grad/wi_0", "grad/wo", "grad/gate/kernel"},
          leaves,
      )
      self.assertLess(max(leaves.values()), bench.BF16_TOLERANCE, name)
    self.assertNotIn("maxtext", sys.modules)


class TrimWheelTest(absltest.TestCase):

  def test_drops_assets_and_their_record_lines(self):
    with tempfile.TemporaryDirectory() as tmp:
      source, target = pathlib.Path(tmp, "a.whl"), pathlib.Path(tmp, "b.whl")
      with zipfile.ZipFile(source, "w") as z:
        z.writestr("maxtext/layers/moe.py", "x = 1\n")
        z.writestr("maxtext/assets/tokenizers/t.model", "big")
        z.writestr("maxtext/examples/demo.ipynb", "{}")
        z.writestr(
            "maxtext-0.2.5.dist-info/RECORD",
            "maxtext/layers/moe.py,sha256=a,6\n"
            "maxtext/assets/tokenizers/t.model,sha256=b,3\n"
            "maxtext/examples/demo.ipynb,sha256=c,2\n"
            "maxtext-0.2.5.dist-info/RECORD,,\n",
        )
      self.assertEqual(maxtext_wheels.trim_wheel(source, target), 2)
      with zipfile.ZipFile(target) as z:
        self.assertEqual(
            z.namelist(),
            ["maxtext/layers/moe.py", "maxtext-0.2.5.dist-info/RECORD"],
        )
        self.assertEqual(
            z.read("maxtext-0.2.5.dist-info/RECORD").decode(),
            "maxtext/layers/moe.py,sha256=a,6\n"
            "maxtext-0.2.5.dist-info/RECORD,,\n",
        )


if __name__ == "__main__":
  absltest.main()
