"""plan_vs_run.py's comparison of a plan with the device's own run: the
differences and ratios, written out by hand from made-up figures."""

from absl.testing import absltest
import plan_vs_run

GIB = 2**30


def _plan(**fields) -> dict:
  plan = {
      "target": "gpu:h200-1",
      "exit_status": 0,
      "fits": True,
      "compile_s": 100.0,
      "per_device": {
          "temp_bytes": 20 * GIB,
          "argument_bytes": 3 * GIB,
          "peak_bytes": 23 * GIB,
      },
      "flops_per_step": 8.0e13,
      "estimated_step_s": 0.08,  # 8e13 at 1e15 FLOP/s
      "estimated_mfu": 1.0,
      "compiler_flops_note": "XLA:GPU gives no cost analysis without the GPU",
  }
  plan.update(fields)
  return plan


def _run(**fields) -> dict:
  run = {
      "device": "NVIDIA H200",
      "called": "compiled",
      "compiled_temp_bytes": 20 * GIB + 4096,
      "compiled_argument_bytes": 3 * GIB,
      "device_peak_bytes": 24 * GIB,
      "step_s": 0.2,
      "loss": 10.0,
  }
  run.update(fields)
  return run


class CompareTest(absltest.TestCase):

  def test_bytes_and_step(self):
    got = plan_vs_run.compare(_plan(), _run())
    self.assertTrue(got["fits_agree"])
    self.assertEqual(got["temp_bytes"]["run_minus_plan"], 4096)
    self.assertEqual(got["argument_bytes"]["run_minus_plan"], 0)
    self.assertEqual(got["peak_bytes"]["run_minus_plan"], GIB)
    self.assertAlmostEqual(got["peak_bytes"]["run_over_plan"], 24 / 23)
    self.assertAlmostEqual(got["step_s"]["run_over_roofline"], 2.5)
    self.assertAlmostEqual(got["model_tflops_per_s"], 400.0)
    # The plan's own peak: 8e13 FLOPs in 0.08 s at MFU 1 is 1e15 FLOP/s.
    self.assertAlmostEqual(got["mfu"], 0.4)
    text = plan_vs_run.report("head", _plan(), _run(), got)
    self.assertIn("run - plan 4.000 KiB", text)
    self.assertIn("run / roofline 2.50", text)
    self.assertIn("MFU 40.0%", text)
    self.assertIn("XLA:GPU gives no cost analysis", text)

  def test_a_memory_bound_roofline_gives_the_peak_too(self):
    # 8e13 FLOPs over 0.4 s of memory traffic at MFU <= 0.2: 1e15 again.
    plan = _plan(estimated_step_s=0.4, estimated_mfu=0.2)
    self.assertAlmostEqual(plan_vs_run.compare(plan, _run())["mfu"], 0.4)

  def test_no_chip_and_no_memory_stats(self):
    plan = _plan(estimated_step_s=None, estimated_mfu=None)
    got = plan_vs_run.compare(plan, _run(device_peak_bytes=None))
    self.assertIsNone(got["mfu"])
    self.assertIsNone(got["step_s"]["run_over_roofline"])
    self.assertIsNone(got["peak_bytes"]["run_minus_plan"])
    text = plan_vs_run.report("head", plan, _run(device_peak_bytes=None), got)
    self.assertIn("roofline - (no chip figures)", text)

  def test_verdicts(self):
    too_big = _plan(exit_status=1, fits=False)
    refused = _run(refused="RESOURCE_EXHAUSTED: out of memory")
    self.assertEqual(
        plan_vs_run.compare(too_big, refused), {"fits_agree": True}
    )
    # A GPU plan that does not fit still has its bytes: compared too.
    ran = plan_vs_run.compare(too_big, _run())
    self.assertFalse(ran["fits_agree"])
    self.assertEqual(ran["temp_bytes"]["run_minus_plan"], 4096)
    self.assertFalse(plan_vs_run.compare(_plan(), refused)["fits_agree"])


if __name__ == "__main__":
  absltest.main()
