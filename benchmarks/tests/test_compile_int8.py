"""compile_int8.py's reading of a compiled program and its roofline: on a
small optimised-HLO text written here, with every figure worked by hand."""

from absl.testing import absltest
import compile_int8

# An ENTRY computation with a Mosaic kernel on int8 operands, an XLA
# ragged dot, an int8-writing fusion and a float fusion; a fusion body
# (not top level) that must not count.
HLO = """\
%fused_body (p: f32[4,8]) -> s8[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %c = s8[4,8]{1,0} convert(%p)
}

ENTRY %main (a: bf16[4,8], w: s8[2,8,16]) -> f32[4,16] {
  %a = bf16[4,8]{1,0} parameter(0)
  %w = s8[2,8,16]{2,1,0} parameter(1)
  %q = s8[4,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_body, metadata={op_name="jit(f)/quantize"}
  %k = f32[4,16]{1,0} custom-call(%q, %w), custom_call_target="tpu_custom_call", operand_layout_constraints={s8[4,8]{1,0}, s8[2,8,16]{2,1,0}}, backend_config={}
  %r = s32[4,16]{1,0} ragged-dot(%q, %w), lhs_contracting_dims={1}
  ROOT %out = f32[4,16]{1,0} fusion(%k, %r), kind=kLoop, calls=%fused_body
}
"""


class ReadProgramTest(absltest.TestCase):

  def test_kernels_dots_int8_writes_and_bytes(self):
    got = compile_int8.read_program(HLO, top=2)
    self.assertEqual(got["kernels"], [{"kernel": "k", "operand_types": ["s8"]}])
    self.assertEqual(got["dots"], [["s8"]])  # the ragged dot's operands
    self.assertEqual(got["s8_writes"], [32])  # %q: 4 x 8 int8
    # Top level: q 32 + 64 (bf16 a); k 256 + 32 + 256; r 256 + 32 + 256;
    # out 256 + 256 + 256. Parameters and the fusion body do not count.
    self.assertAlmostEqual(got["entry_gb"], (96 + 544 + 544 + 768) / 1e9)
    self.assertEqual(
        [(o["name"], o["opcode"]) for o in got["top_ops"]],
        [("out", "fusion"), ("r", "ragged-dot")],
    )
    self.assertEqual(got["top_ops"][0]["gb"], round(768 / 1e9, 3))


class RooflineTest(absltest.TestCase):

  def test_bound_is_the_larger_of_compute_and_memory(self):
    # 394 TFLOP in all, half of it int8: 1 s at bf16 + 0.5 s at int8;
    # 819 GB: 1 s at the HBM rate.
    r = compile_int8.roofline(394e12, 197e12, 819e9)
    self.assertAlmostEqual(r["compute_ms"], 1500.0)
    self.assertAlmostEqual(r["memory_ms"], 1000.0)
    self.assertAlmostEqual(r["bound_ms"], 1500.0)
    r = compile_int8.roofline(0.0, 0.0, 2 * 819e9)
    self.assertAlmostEqual(r["bound_ms"], 2000.0)


if __name__ == "__main__":
  absltest.main()
