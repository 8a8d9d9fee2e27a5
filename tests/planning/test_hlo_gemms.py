"""`hlo/gemms.py`: what runs each contraction of a compiled GPU program, read
from optimised HLO written here by hand in the forms XLA:GPU writes (cuBLAS
and cuBLASLt custom calls, Triton GEMM fusions), every figure worked out
from the shapes."""

from absl.testing import absltest

from linen_moe._src.hlo import gemms

# Six contractions:
#   lt8   cuBLASLt fp8 call on two f8e4m3fn operands with two scalar scales.
#   dot.1 inside a Triton fusion that converts its f8e5m2 parameter to bf16
#         itself (in registers).
#   dot.2 inside a Triton fusion fed bf16 by a loop fusion that converts
#         s8 weights (a float copy written to memory).
#   dot.3 inside a Triton fusion on f8 x f8 parameters, a scalar beside.
#   gemm  cuBLAS on bf16 x bf16, no quantized type anywhere.
#   plain an XLA dot on s8 x s8 outside any fusion.
HLO = r"""HloModule m

%triton_convert (t0: f8e5m2[16,64], t1: bf16[64,32]) -> f32[16,32] {
  %t0 = f8e5m2[16,64]{1,0} parameter(0)
  %c0 = bf16[16,64]{1,0} convert(%t0)
  %t1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,32]{1,0} dot(%c0, %t1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(RoutedMoE))/wo_dot/dot_general"}
}

%dequantize (d0: s8[64,32]) -> bf16[64,32] {
  %d0 = s8[64,32]{1,0} parameter(0)
  ROOT %c1 = bf16[64,32]{1,0} convert(%d0)
}

%triton_float (u0: bf16[16,64], u1: bf16[64,32]) -> f32[16,32] {
  %u0 = bf16[16,64]{1,0} parameter(0)
  %u1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.2 = f32[16,32]{1,0} dot(%u0, %u1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(RoutedMoE)/wi_0_dot/dot_general"}
}

%triton_native (v0: f8e4m3fn[8,16,64], v1: f8e4m3fn[8,64,32], v2: f32[]) -> bf16[8,16,32] {
  %v0 = f8e4m3fn[8,16,64]{2,1,0} parameter(0)
  %v1 = f8e4m3fn[8,64,32]{2,1,0} parameter(1)
  %dot.3 = bf16[8,16,32]{2,1,0} dot(%v0, %v1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  %v2 = f32[] parameter(2)
  %s = bf16[] convert(%v2)
  %b = bf16[8,16,32]{2,1,0} broadcast(%s), dimensions={}
  ROOT %m = bf16[8,16,32]{2,1,0} multiply(%dot.3, %b)
}

ENTRY %main (p0: f8e4m3fn[16,64], p1: f8e4m3fn[64,32], p2: f8e5m2[16,64], p3: s8[64,32], p4: bf16[16,64], p5: f8e4m3fn[8,16,64], p6: f8e4m3fn[8,64,32], p7: s8[4,8], p8: bf16[64,32]) -> f32[16,32] {
  %p0 = f8e4m3fn[16,64]{1,0} parameter(0)
  %p1 = f8e4m3fn[64,32]{1,0} parameter(1)
  %sa = f32[] constant(0.5)
  %sb = f32[] constant(2)
  %lt8 = (bf16[16,32]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1, %sa, %sb), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %p2 = f8e5m2[16,64]{1,0} parameter(2)
  %p4 = bf16[16,64]{1,0} parameter(4)
  %p3 = s8[64,32]{1,0} parameter(3)
  %deq = bf16[64,32]{1,0} fusion(%p3), kind=kLoop, calls=%dequantize
  %p8 = bf16[64,32]{1,0} parameter(8)
  %f1 = f32[16,32]{1,0} fusion(%p2, %p8), kind=kCustom, calls=%triton_convert, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %f2 = f32[16,32]{1,0} fusion(%p4, %deq), kind=kCustom, calls=%triton_float, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %p5 = f8e4m3fn[8,16,64]{2,1,0} parameter(5)
  %p6 = f8e4m3fn[8,64,32]{2,1,0} parameter(6)
  %f3 = bf16[8,16,32]{2,1,0} fusion(%p5, %p6, %sa), kind=kCustom, calls=%triton_native, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %gemm = (bf16[16,32]{1,0}, s8[1048576]{0}) custom-call(%p4, %deq), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %p7 = s8[4,8]{1,0} parameter(7)
  %plain = s32[4,4]{1,0} dot(%p7, %p7), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %k = bf16[16,32]{1,0} custom-call(%p4, %p3, %p7), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %out = f32[16,32]{1,0} add(%f1, %f2)
}
"""


class GemmsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.found = {g.name: g for g in gemms.gemms(HLO)}

  def test_finds_every_contraction_once(self):
    self.assertCountEqual(
        self.found, ["lt8", "dot.1", "dot.2", "dot.3", "gemm", "plain"]
    )

  def test_routes(self):
    routes = {name: g.route for name, g in self.found.items()}
    self.assertEqual(
        routes,
        {
            "lt8": "cublaslt_fp8",
            "dot.1": "triton",
            "dot.2": "triton",
            "dot.3": "triton",
            "gemm": "cublas",
            "plain": "dot",
        },
    )
    self.assertEqual(self.found["dot.1"].call, "f1")
    self.assertEqual(self.found["lt8"].call, "lt8")
    self.assertEqual(self.found["plain"].call, "")

  def test_native_and_converted(self):
    lt8, d1, d2, d3 = (
        self.found[n] for n in ("lt8", "dot.1", "dot.2", "dot.3")
    )
    self.assertEqual(lt8.operand_types, ("f8e4m3fn", "f8e4m3fn"))
    self.assertTrue(lt8.native)
    self.assertEqual(lt8.converted, "")
    # f8e5m2 converted inside the Triton fusion (read as f8 from memory);
    # the s8 weight converted by the loop fusion before the other (a bf16
    # copy in memory).
    self.assertEqual(d1.operand_types, ("bf16", "bf16"))
    self.assertFalse(d1.native)
    self.assertEqual(d1.quantized_inputs, {"f8e5m2"})
    self.assertEqual(d1.converted, "fusion")
    self.assertEqual(d2.quantized_inputs, {"s8"})
    self.assertEqual(d2.converted, "memory")
    self.assertTrue(d3.native)
    self.assertTrue(self.found["plain"].native)
    self.assertEqual(self.found["gemm"].converted, "memory")  # the s8 copy

  def test_scales_flops_and_direction(self):
    self.assertEqual(self.found["lt8"].scales, 2)
    self.assertEqual(self.found["dot.3"].scales, 1)
    self.assertEqual(self.found["dot.2"].scales, 0)
    # 2 x out elements x contracted size.
    self.assertEqual(self.found["lt8"].flops, 2 * 16 * 32 * 64)
    self.assertEqual(self.found["dot.3"].flops, 2 * 8 * 16 * 32 * 64)
    self.assertEqual(self.found["plain"].flops, 2 * 4 * 4 * 8)
    self.assertEqual(self.found["gemm"].flops, 2 * 16 * 32 * 64)
    self.assertTrue(self.found["dot.1"].backward)
    self.assertFalse(self.found["dot.2"].backward)

  def test_summary_and_json(self):
    found = gemms.gemms(HLO)
    self.assertEqual(
        gemms.summary(found),
        {
            "cublas:bf16 x bf16:memory": 1,
            "cublaslt_fp8:f8e4m3fn x f8e4m3fn": 1,
            "dot:s8 x s8": 1,
            "triton:bf16 x bf16:fusion": 1,
            "triton:bf16 x bf16:memory": 1,
            "triton:f8e4m3fn x f8e4m3fn": 1,
        },
    )
    rows = {row["name"]: row for row in gemms.to_json(found)}
    self.assertEqual(rows["lt8"]["quantized_inputs"], ["f8e4m3fn"])
    self.assertEqual(rows["lt8"]["operand_types"], ["f8e4m3fn", "f8e4m3fn"])
    self.assertTrue(rows["dot.1"]["backward"])

  def test_kernel_calls_are_not_gemms(self):
    # The Pallas call reads bf16 and s8; the cuBLAS calls are not counted.
    self.assertEqual(
        gemms.kernel_calls(HLO), {"__gpu$xla.gpu.triton:bf16,s8": 1}
    )
    self.assertNotIn("k", self.found)


if __name__ == "__main__":
  absltest.main()
