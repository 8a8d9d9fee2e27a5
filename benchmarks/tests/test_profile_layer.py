"""profile_layer.py's grouping of the layer's ops (op names as the chip's
trace of `one_chip.sh profile_layer` gave them) and a tiny CPU profile."""

import json
import pathlib
import tempfile

from absl.testing import absltest
import profile_layer

_SPARSE = "jit(step)/jvp(RoutedMoE)/RoutedMoE._sparse"
_BACK = "jit(step)/transpose(jvp(RoutedMoE))/RoutedMoE._sparse"


class GroupTest(absltest.TestCase):

  def test_groups_by_op_name(self):
    cases = [
        (  # a Pallas grouped matmul of the gate projection
            "linen_moe_gmm.6",
            "custom-call",
            (
                f"{_SPARSE}/RoutedMoE.gate_and_up/RoutedMoE.grouped/wi_0_dot/"
                "wi_0_dot._wrap/wi_0_dot._matmul/jit(gmm)/linen_moe_gmm/"
                "pallas_call"
            ),
            "matmuls",
        ),
        (  # the two input gradients of gate and up, summed by XLA
            "add_any.5",
            "add",
            (
                f"{_SPARSE}/RoutedMoE.gate_and_up/RoutedMoE.grouped/wi_0_dot/"
                "wi_0_dot._wrap/wi_0_dot._matmul/add_any"
            ),
            "matmuls",
        ),
        (  # the dispatch's DMA row gather
            "linen_moe_gather_vmem.2",
            "custom-call",
            (
                f"{_SPARSE}/RoutedMoE.gate_and_up/jit(gather_rows)/"
                "linen_moe_gather_vmem/pallas_call"
            ),
            "permutation",
        ),
        ("gather_fusion", "fusion", f"{_SPARSE}/gather", "permutation"),
        (  # the gated product's backward
            "multiply_multiply_fusion",
            "fusion",
            f"{_BACK}/transpose(jvp())/mul",
            "permutation",
        ),
        (
            "fusion.86",
            "fusion",
            "jit(step)/jvp(RoutedMoE)/gate/dot_general",
            "routing",
        ),
        ("fusion.7", "fusion", "jit(step)/jvp()/dot_general", "matmuls"),
        (  # the paired gate and up projections: no call site's name
            "linen_moe_tgmm.2",
            "custom-call",
            (
                f"{_SPARSE}/checkpoint/RoutedMoE.gate_and_up/jit(tgmm)"
                "/linen_moe_tgmm/pallas_call"
            ),
            "matmuls",
        ),
        (
            "divide_fusion",
            "fusion",
            f"{_SPARSE}/jvp(jit(silu))/div",
            "activation",
        ),
        ("copy.3", "copy", "", "copies"),
        ("copy-start", "copy-start", "", "copies"),
        ("fusion.9", "fusion", "jit(step)/add", "other"),
    ]
    for name, opcode, op_name, group in cases:
      self.assertEqual(
          profile_layer.group_of(name, opcode, op_name), group, op_name
      )
      self.assertIn(group, profile_layer.GROUPS)


class CpuProfileTest(absltest.TestCase):

  def test_a_tiny_layers_profile(self):
    with tempfile.TemporaryDirectory() as out:
      code = profile_layer.main([
          "--interpret",
          "--shapes",
          "8x2048x5632",
          "--calls",
          "1",
          "--out",
          out,
      ])
      self.assertEqual(code, 0)
      got = json.loads(pathlib.Path(out, "profile_layer.json").read_text())
      self.assertTrue(pathlib.Path(out, "8x2048x5632.ours_auto.txt").exists())
    self.assertEqual([r["variant"] for r in got], ["dense", "ours_auto"])
    ours = {g["group"]: g["ms"] for g in got[1]["groups"]}
    for group in ("matmuls", "routing", "permutation"):
      self.assertGreater(ours[group], 0.0, group)
    dense = {g["group"]: g["ms"] for g in got[0]["groups"]}
    self.assertGreater(dense["matmuls"], 0.0)
    self.assertEqual(dense["permutation"], 0.0)  # no routing, no sort


if __name__ == "__main__":
  absltest.main()
