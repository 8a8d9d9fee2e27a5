"""bench_mfu.py's arithmetic (one layer from two depths, the planner's
FLOPs of a layer, the released-depth estimate) and its program list, and
profile_step.py's reduction of a trace: a real CPU profile of a tiny step,
and a trace laid out as an accelerator's (device "XLA Ops" lines)."""

import json
import pathlib
import tempfile

from absl.testing import absltest
import bench_mfu
import profile_step

from linen_moe import planning


class LayerFiguresTest(absltest.TestCase):

  def test_one_layer_from_two_depths(self):
    fig = bench_mfu.layer_figures(
        depths=(1, 2),
        step_s={1: 0.50, 2: 0.80},
        optimizer_s={1: 0.01, 2: 0.02},
        model_flops={1: 10e12, 2: 16e12},
        peak_flops=200e12,
        released_layers=32,
        released_flops=10e12 + 31 * 6e12,
        compiler_flops={1: 11e12, 2: 18e12},
    )
    # the step less its update: 0.49 and 0.78; a layer 0.29 s for 6 TFLOP
    self.assertAlmostEqual(fig["layer_s"], 0.29)
    self.assertAlmostEqual(fig["layer_model_flops"], 6e12)
    self.assertAlmostEqual(fig["layer_mfu"], 6e12 / 0.29 / 200e12)
    self.assertAlmostEqual(fig["head_s"], 0.20)
    self.assertAlmostEqual(fig["head_model_flops"], 4e12)
    self.assertAlmostEqual(fig["optimizer_layer_s"], 0.01)
    self.assertAlmostEqual(fig["optimizer_head_s"], 0.0)
    self.assertAlmostEqual(fig["released_step_s"], 32 * 0.29 + 0.20)
    self.assertAlmostEqual(
        fig["released_mfu"], 196e12 / (32 * 0.29 + 0.20) / 200e12
    )
    self.assertAlmostEqual(fig["released_step_with_update_s"], 32 * 0.30 + 0.20)
    self.assertAlmostEqual(fig["layer_compiler_flops"], 7e12)
    self.assertAlmostEqual(fig["compiler_over_model"], 7 / 6)

  def test_depths_two_apart_and_no_update_timed(self):
    fig = bench_mfu.layer_figures(
        (1, 3),
        {1: 1.0, 3: 2.0},
        {1: None, 3: None},
        {1: 3.0, 3: 7.0},
        1.0,
        4,
        9.0,
    )
    self.assertAlmostEqual(fig["layer_s"], 0.5)
    self.assertAlmostEqual(fig["layer_model_flops"], 2.0)
    self.assertAlmostEqual(fig["head_s"], 0.5)
    self.assertAlmostEqual(fig["released_step_s"], 2.5)
    self.assertAlmostEqual(fig["released_mfu"], 9.0 / 2.5)
    self.assertNotIn("layer_compiler_flops", fig)

  def test_depths_must_rise(self):
    with self.assertRaisesRegex(ValueError, "depths must rise"):
      bench_mfu.layer_figures((2, 2), {}, {}, {}, 1.0, 1, 1.0)

  def test_load_and_ratios(self):
    self.assertEqual(
        bench_mfu.load_balance([[0.25] * 4, [0.5, 0.5, 0.0, 0.0]]), [1.0, 2.0]
    )
    self.assertEqual(
        bench_mfu.ratios({"bf16": 10.0, "int8": 5.0, "kernel": 20.0}),
        {"int8": 2.0, "kernel": 0.5},
    )
    self.assertEqual(bench_mfu.ratios({"int8": 5.0}), {})


class LayerFlopsTest(absltest.TestCase):

  def test_mixtral_layer_is_the_planners_formula(self):
    # One Mixtral-8x7B layer at 2 x 4096 tokens, by hand: 6 x tokens x the
    # active matmul parameters (q, o: 4096 x 4096; k, v: 4096 x 1024; the
    # router 4096 x 8; two of the eight experts' 3 x 4096 x 14336), plus 3
    # x the forward attention over the causal pairs S (S + 1) / 2 only.
    shape = bench_mfu.SHAPES["mixtral"]
    b, s = 2, bench_mfu.SEQ
    flops = {
        d: planning.model_flops(bench_mfu.model_config(shape, d), b, s)
        for d in (1, 2)
    }
    active = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 8
    active += 2 * 3 * 4096 * 14336
    attention = 2 * b * (s * (s + 1) // 2) * 32 * (128 + 128)
    self.assertEqual(flops[2] - flops[1], 6 * b * s * active + 3 * attention)


class ProgramsTest(absltest.TestCase):

  def test_variant_major_and_no_remat_where_it_fits(self):
    shapes = {
        "a": bench_mfu.Shape("x", 32, 4, "full", 2, (1,)),
    }
    keys = [
        p.key
        for p in bench_mfu.programs(shapes, ["a"], ["bf16", "no_remat", "int8"])
    ]
    self.assertEqual(
        keys, ["a/1/bf16", "a/2/bf16", "a/1/no_remat", "a/1/int8", "a/2/int8"]
    )
    self.assertEqual(bench_mfu.batch_of(shapes["a"], "no_remat"), 2)
    self.assertEqual(bench_mfu.batch_of(shapes["a"], "int8"), 4)
    self.assertEqual(bench_mfu.batch_of(shapes["a"], "unrolled"), 4)
    wider = bench_mfu.Shape("x", 32, 4, "full", 2, (1,), unrolled_batch=6)
    self.assertEqual(bench_mfu.batch_of(wider, "unrolled"), 6)
    self.assertEqual(bench_mfu.batch_of(wider, "bf16"), 4)

  def test_unrolled_without_remat(self):
    # Its own batch at both depths where one is given; else no_remat's
    # batch at no_remat's depths.
    shape = bench_mfu.Shape("x", 32, 4, "full", 2, (1,))
    keys = [
        p.key
        for p in bench_mfu.programs({"a": shape}, ["a"], ["unrolled_no_remat"])
    ]
    self.assertEqual(keys, ["a/1/unrolled_no_remat"])
    self.assertEqual(bench_mfu.batch_of(shape, "unrolled_no_remat"), 2)
    wider = bench_mfu.Shape(
        "tiny_mixtral", 32, 4, "full", 2, (1,), unrolled_no_remat_batch=3
    )
    keys = [
        p.key
        for p in bench_mfu.programs({"a": wider}, ["a"], ["unrolled_no_remat"])
    ]
    self.assertEqual(keys, ["a/1/unrolled_no_remat", "a/2/unrolled_no_remat"])
    self.assertEqual(bench_mfu.batch_of(wider, "unrolled_no_remat"), 3)
    for variant, remat in (
        ("bf16", "full"),
        ("no_remat", "none"),
        ("unrolled", "full"),
        ("unrolled_no_remat", "none"),
    ):
      self.assertEqual(bench_mfu.remat_of(wider, variant), remat)
    cfg = bench_mfu.model_config(wider, 2, "unrolled_no_remat")
    self.assertEqual((cfg.scan_layers, cfg.remat), (False, "none"))

  def test_unrolled_saving_the_experts(self):
    # Its own batch where one is given, else the unrolled variant's.
    shape = bench_mfu.Shape("x", 32, 4, "full", 2, (1,), unrolled_batch=6)
    self.assertEqual(bench_mfu.batch_of(shape, "unrolled_save_experts"), 6)
    own = bench_mfu.Shape(
        "tiny_mixtral",
        32,
        4,
        "full",
        2,
        (1,),
        unrolled_batch=6,
        unrolled_save_experts_batch=5,
    )
    self.assertEqual(bench_mfu.batch_of(own, "unrolled_save_experts"), 5)
    self.assertEqual(
        bench_mfu.remat_of(own, "unrolled_save_experts"), "save_experts"
    )
    keys = [
        p.key
        for p in bench_mfu.programs(
            {"a": own}, ["a"], ["unrolled_save_experts"]
        )
    ]
    self.assertEqual(
        keys, ["a/1/unrolled_save_experts", "a/2/unrolled_save_experts"]
    )
    cfg = bench_mfu.model_config(own, 2, "unrolled_save_experts")
    self.assertEqual((cfg.scan_layers, cfg.remat), (False, "save_experts"))
    self.assertEqual(
        bench_mfu.layouts(["unrolled_save_experts", "bf16"]),
        [["bf16"], ["unrolled_save_experts"]],
    )

  def test_one_state_per_layout(self):
    # The unrolled variant holds another variables' layout: its own state,
    # after the stacked ones, each list in the order given.
    self.assertEqual(
        bench_mfu.layouts(["unrolled", "bf16", "int8"]),
        [["bf16", "int8"], ["unrolled"]],
    )
    self.assertEqual(bench_mfu.layouts(["unrolled"]), [["unrolled"]])
    self.assertEqual(bench_mfu.layouts(["bf16"]), [["bf16"]])
    cfg = bench_mfu.model_config(bench_mfu.SHAPES["mixtral"], 2, "unrolled")
    self.assertFalse(cfg.scan_layers)

  def test_variant_configs(self):
    shape = bench_mfu.SHAPES["qwen3"]
    cfg = bench_mfu.model_config(shape, 2, "int8")
    self.assertEqual(cfg.num_layers, 2)
    self.assertEqual(cfg.moe.quantization, "int8")
    self.assertEqual(cfg.moe.load_balance_loss_weight, 0.01)
    self.assertEqual(cfg.remat, shape.remat)
    self.assertEqual(bench_mfu.model_config(shape, 1, "no_remat").remat, "none")
    self.assertEqual(
        bench_mfu.model_config(shape, 1, "kernel").moe.grouped_matmul, "kernel"
    )


# An accelerator's trace: the device's ops on its "XLA Ops" line, the whole
# program on "XLA Modules" (not an op), host events on another process.
def _tpu_trace():
  meta = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "host"}},
      {
          "ph": "M",
          "pid": 2,
          "name": "process_name",
          "args": {"name": "/device:TPU:0"},
      },
      {
          "ph": "M",
          "pid": 2,
          "tid": 1,
          "name": "thread_name",
          "args": {"name": "XLA Modules"},
      },
      {
          "ph": "M",
          "pid": 2,
          "tid": 2,
          "name": "thread_name",
          "args": {"name": "XLA Ops"},
      },
  ]

  def op(name, ts, dur, tid=2, pid=2, module="jit_step(7)"):
    return {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "name": name,
        "args": {"hlo_module": module},
    }

  events = []
  for step in range(2):
    t = step * 1000
    events += [
        op("jit_step(7)", t, 900, tid=1),
        op("ragged-dot.1", t, 400),
        op("fusion.2", t + 400, 100),
        op("conditional.3", t + 500, 300),  # holds the update's fusion
        op("fusion.4", t + 550, 200),
        op("copy.5", t + 800, 50),
        op("fusion.9", t + 850, 50, module="jit_other(3)"),
        op("$python", t, 900, pid=1, tid=9),
    ]
  return {"traceEvents": meta + events}


_TPU_HLO = """\
HloModule jit_step, entry_computation_layout={}

ENTRY %main.1 (p: bf16[8,4]) -> bf16[8,4] {
  %ragged-dot.1 = bf16[8,4]{1,0} ragged-dot(%a, %b, %c), metadata={op_name="jit(step)/jvp(Decoder)/layers/moe/moe._sparse/moe.grouped/wo_dot/wo_dot._matmul/ragged_dot"}
  %fusion.2 = (bf16[8,4]{1,0}, s32[8]{0}) fusion(%x), kind=kLoop, calls=%f, metadata={op_name="jit(step)/jvp(Decoder)/layers/moe/moe._sparse/jit(argsort)/sort"}
  %conditional.3 = bf16[8,4]{1,0} conditional(%p), branch_computations={%b0, %b1}, metadata={op_name="jit(step)/cond"}
  %fusion.4 = bf16[8,4]{1,0} fusion(%y), kind=kLoop, calls=%g, metadata={op_name="jit(step)/cond/branch_1_fun/mul"}
  ROOT %copy.5 = bf16[8,4]{0,1} copy(%z), metadata={op_name="jit(step)/transpose(jvp(Decoder))/layers/layers._attention/attention/transpose"}
}
"""


class ReduceTraceTest(absltest.TestCase):

  def test_accelerator_lines(self):
    got = profile_step.reduce_trace(_tpu_trace(), _TPU_HLO, steps=2)
    ms = {r["op"]: round(r["ms"], 9) for r in got["top"]}
    # self time: the conditional less the update fusion it holds; the
    # module line, the other program and the host are not device ops
    self.assertEqual(
        ms,
        {
            "ragged-dot.1": 0.4,
            "fusion.4": 0.2,
            "fusion.2": 0.1,
            "conditional.3": 0.1,
            "copy.5": 0.05,
        },
    )
    self.assertAlmostEqual(got["step_ms"], 0.85)
    groups = {g["group"]: g["ms"] for g in got["groups"]}
    self.assertAlmostEqual(groups["expert matmuls"], 0.4)
    self.assertAlmostEqual(groups["permutation"], 0.1)
    self.assertAlmostEqual(groups["optimizer"], 0.2)
    self.assertAlmostEqual(groups["copies"], 0.05)
    self.assertAlmostEqual(groups["other"], 0.1)  # the cond itself
    self.assertEqual(set(groups), set(profile_step.GROUPS))
    self.assertAlmostEqual(sum(g["share"] for g in got["groups"]), 1.0)
    self.assertEqual(got["ops_without_hlo"], 0)

  def test_groups_by_op_name(self):
    cases = {
        ".../moe/moe._sparse/moe.gate_and_up/moe.grouped/wi_0_dot/wi_0_dot._matmul/pallas_call": (
            "expert matmuls"
        ),
        ".../moe/moe._sparse/moe.gate_and_up/mul": "expert matmuls",
        ".../moe/top_k": "routing",
        ".../moe/gate/dot_general": "routing",
        ".../moe/moe._sparse/gather": "permutation",
        ".../moe/moe._sparse/scatter-add": "permutation",
        # The DMA gather's operand packing, inside the gate-and-up checkpoint.
        ".../moe._sparse/moe.gate_and_up/jit(gather_rows)/or": "permutation",
        ".../layers._attention/attention/query/BSM,MND->BSND/dot_general": (
            "attention"
        ),
        ".../layers._attention/pre_attention_norm/mul": "norms",
        "jit(step)/jvp(Decoder)/final_norm/mul": "head and loss",
        "jit(step)/jvp(Decoder)/embed/embed/jit(_take)/gather": "head and loss",
        "jit(step)/jvp()/while/body/BSM,MV->BSV/dot_general": "head and loss",
        "jit(step)/cond/branch_1_fun/mul": "optimizer",
        "jit(step)/is_finite": "other",
    }
    for op_name, group in cases.items():
      self.assertEqual(
          profile_step.group_of("fusion.1", "fusion", op_name), group, op_name
      )
    self.assertEqual(profile_step.group_of("copy.3", "copy", ""), "copies")
    # Splash's kernels carry no op_name (seen on the chip).
    self.assertEqual(
        profile_step.group_of(
            "splash_mha_dkv_segmented_no_residuals.2", "custom-call", ""
        ),
        "attention",
    )

  def test_gather_kernels_are_permutation(self):
    # Seen on the chip: the dispatch's kernel inside the gate-and-up
    # checkpoint, and the combine's backward.
    for name, op_name in (
        (
            "linen_moe_gather_vmem.15",
            (
                ".../moe._sparse/moe.gate_and_up/jit(gather_rows)/"
                "linen_moe_gather_vmem/pallas_call"
            ),
        ),
        ("linen_moe_gather_scale_dot.2", ""),
    ):
      self.assertEqual(
          profile_step.group_of(name, "custom-call", op_name), "permutation"
      )

  def test_instructions(self):
    got = profile_step.instructions(_TPU_HLO)
    self.assertEqual(got["fusion.2"][0], "fusion")  # after a tuple shape
    self.assertEqual(got["ragged-dot.1"][0], "ragged-dot")
    self.assertEqual(got["copy.5"][0], "copy")
    self.assertEqual(got["fusion.4"][1], "jit(step)/cond/branch_1_fun/mul")


class CpuProfileTest(absltest.TestCase):

  def test_a_tiny_steps_profile(self):
    with tempfile.TemporaryDirectory() as out:
      code = profile_step.main(
          ["--tiny", "--depth", "1", "--steps", "2", "--out", out]
      )
      self.assertEqual(code, 0)
      got = json.loads(pathlib.Path(out, "profile.json").read_text())
      self.assertTrue(pathlib.Path(out, "profile.txt").exists())
    groups = {g["group"]: g["ms"] for g in got["groups"]}
    for group in (
        "expert matmuls",
        "attention",
        "routing",
        "permutation",
        "optimizer",
        "head and loss",
    ):
      self.assertGreater(groups[group], 0.0, group)
    self.assertAlmostEqual(sum(g["share"] for g in got["groups"]), 1.0)
    # every op of the trace is an instruction of the compiled step
    self.assertEqual(got["ops_without_hlo"], 0)
    ms = [r["ms"] for r in got["top"]]
    self.assertEqual(ms, sorted(ms, reverse=True))


if __name__ == "__main__":
  absltest.main()
