"""benchmarks/gpu/compiled_contractions.py: its reading of a program's
contractions (by call site, on hand-written HLO), its cells and routes, its
refusals; and, where jax's CUDA plugin is installed (not in CI), one cell
compiled for gpu:h200-1 without a GPU."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest

from linen_moe._src.hlo import gemms  # noqa: TID251
from linen_moe._src.kernels import registry  # noqa: TID251
from linen_moe._src.planning import targets  # noqa: TID251

GPU = pathlib.Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU))

import compiled_contractions as cc  # noqa: E402

# Two expert contractions (wi_0 forward on s8 x s8 through Triton, wo's
# weight gradient on bf16 through cuBLAS) and the router's gate.
HLO = r"""HloModule m

%gemm_body (a: s8[16,64], b: s8[64,32]) -> s32[16,32] {
  %a = s8[16,64]{1,0} parameter(0)
  %b = s8[64,32]{1,0} parameter(1)
  ROOT %dot.1 = s32[16,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(loss)/jvp(RoutedMoE)/RoutedMoE.sparse/wi_0_dot/wi_0_dot._wrap/dot_general"}
}

ENTRY %main (p0: s8[16,64], p1: s8[64,32], p2: bf16[64,16], p3: bf16[16,32], p4: bf16[16,64], p5: bf16[64,8]) -> s32[16,32] {
  %p0 = s8[16,64]{1,0} parameter(0)
  %p1 = s8[64,32]{1,0} parameter(1)
  %f = s32[16,32]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%gemm_body, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %p2 = bf16[64,16]{1,0} parameter(2)
  %p3 = bf16[16,32]{1,0} parameter(3)
  %g = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%p2, %p3), custom_call_target="__cublas$gemm", metadata={op_name="jit(loss)/transpose(jvp(RoutedMoE))/wo_dot/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}
  %p4 = bf16[16,64]{1,0} parameter(4)
  %p5 = bf16[64,8]{1,0} parameter(5)
  %gate = f32[16,8]{1,0} dot(%p4, %p5), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(loss)/jvp(RoutedMoE)/gate/dot_general"}
  ROOT %out = s32[16,32]{1,0} copy(%f)
}
"""


class ReadingTest(absltest.TestCase):

  def test_site_of(self):
    self.assertEqual(cc.site_of("a/RoutedMoE.sparse/wi_0_dot/b"), "wi_0")
    self.assertEqual(cc.site_of("a/combine_dot._wrap/x"), "combine")
    self.assertEqual(cc.site_of("jit(loss)/jvp(RoutedMoE)/gate/dot"), "other")

  def test_summarize_counts_the_expert_matmuls_apart(self):
    got = cc.summarize(gemms.gemms(HLO))
    self.assertEqual(
        got["expert"], {"cublas:bf16 x bf16": 1, "triton:s8 x s8": 1}
    )
    self.assertEqual((got["expert_native"], got["expert_count"]), (1, 2))
    self.assertEqual(got["native_types"], ["s8"])
    self.assertEqual(got["contractions"]["dot:bf16 x bf16"], 1)  # the gate
    # 2 x out x contracted: wi_0 16*32*64, wo 64*32*16, gate 16*8*64.
    self.assertEqual(got["hlo_flops"], 2 * (16 * 32 * 64) * 2 + 2 * 16 * 8 * 64)


class CellsTest(absltest.TestCase):

  def test_routes_only_on_the_sparse_path(self):
    args = cc.argparse.Namespace(
        programs=["layer"],
        quantizations=["fp8"],
        paths=["sparse", "dense"],
        routes=["ragged_dot", "blocked"],
    )
    self.assertEqual(
        cc._cells(args),
        [
            ("layer", "fp8", "sparse", "ragged_dot"),
            ("layer", "fp8", "sparse", "blocked"),
            ("layer", "fp8", "dense", "ragged_dot"),
        ],
    )

  def test_route_context_points_kernel_at_the_entry_and_restores(self):
    saved = dict(registry.KERNEL)
    with cc.route_context("pallas_triton_gmm", "gpu") as setting:
      self.assertEqual(setting, "kernel")
      self.assertEqual(registry.KERNEL["gpu"], "gpu/pallas_triton_gmm")
    self.assertEqual(registry.KERNEL, saved)
    with cc.route_context("blocked", "gpu") as setting:
      self.assertEqual(setting, "blocked")
    self.assertEqual(registry.KERNEL, saved)

  def test_bad_arguments_are_refused(self):
    for argv in (
        ["--routes", "fast"],
        ["--quantizations", "int4"],
        ["--paths", "both"],
        ["--seq", "1"],
    ):
      with self.assertRaises(SystemExit, msg=argv):
        cc.main(argv)


@absltest.skipUnless(
    targets.cuda_plugin_available(),
    "needs jax's CUDA plugin (jax[cuda13]): pip install '.[gpu-plan]'",
)
class GpuCompileTest(absltest.TestCase):
  """One cell compiled for an H200 through the CUDA plugin's topology."""

  def test_int8_layer_feeds_s8_to_its_expert_gemms(self):
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "cc.json")
      env = dict(os.environ)
      root = str(GPU.parents[1])
      env["PYTHONPATH"] = os.pathsep.join(
          [root, env.get("PYTHONPATH", "")]
      ).strip(os.pathsep)
      proc = subprocess.run(
          [sys.executable, str(GPU / "compiled_contractions.py"),
           "--programs", "layer", "--quantizations", "int8", "--paths",
           "sparse", "--routes", "blocked", "--json", out],
          capture_output=True, text=True, env=env, timeout=600, check=False,
      )  # fmt: skip
      self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
      with open(out, encoding="utf-8") as f:
        got = json.load(f)
    self.assertIn("H200", got["device_kind"])
    (record,) = got["records"]
    self.assertNotIn("error", record)
    self.assertGreater(record["temp_bytes"], 0)
    self.assertIsNone(record["compiler_flops"])  # no GPU: no cost analysis
    # The int8 forward and input gradient: s8 x s8 at the GEMM itself.
    self.assertIn("s8", record["native_types"])
    self.assertGreater(record["expert_native"], 0)


if __name__ == "__main__":
  absltest.main()
