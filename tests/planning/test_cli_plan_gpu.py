"""Plans for GPUs, honest, on this CPU: what a GPU compiled without one
gives (no cost analysis) and what the plan then says; the roofline's
words; the GPUs' figures against XLA's own description of them; install
hints that work from a checkout; libtpu told its slice.

A GPU compile needs jax's CUDA plugin (tests/planning/test_cli_plan.py's
`GpuPlanTest` runs one where it is installed); here the step is compiled
for the host's CPU with a cost analysis that returns None, as XLA:GPU's
does without a GPU.
"""

import functools
import importlib.resources
import os
import pathlib
import re
import tomllib
from unittest import mock

from absl.testing import absltest
import jax
import numpy as np

from linen_moe import load_model_config
from linen_moe import planning
from linen_moe._src.planning import chips as chips_lib
from linen_moe._src.planning import costs
from linen_moe._src.planning import plan as plan_lib
from linen_moe._src.planning import targets as targets_lib
from linen_moe_cli.commands import plan as plan_cmd
from tests import cli_helpers
from tests.planning.test_cli_plan import tiny_mixtral_train_flops

ROOT = pathlib.Path(__file__).resolve().parents[2]
B, S = 2, 8


class _NoCostAnalysis:
  """A compiled step whose cost analysis is None (XLA:GPU without a GPU)."""

  def __init__(self, compiled):
    self._compiled = compiled

  def memory_analysis(self):
    return self._compiled.memory_analysis()

  def cost_analysis(self):
    return None


@functools.cache
def _gpu_plan_without_cost() -> planning.Plan:
  """tiny_mixtral's train step planned for gpu:h200-1, compiled for this
  host's CPU (the target's devices replaced), its cost analysis None."""
  compile_ = jax.stages.Lowered.compile
  with (
      mock.patch.object(
          targets_lib,
          "target_devices",
          return_value=jax.devices("cpu")[:1],
      ),
      mock.patch.object(
          jax.stages.Lowered,
          "compile",
          autospec=True,
          side_effect=lambda self: _NoCostAnalysis(compile_(self)),
      ),
  ):
    return planning.plan(
        load_model_config("tiny_mixtral"),
        "gpu:h200-1",
        batch_size=B,
        seq_len=S,
    )


class NoCompilerFlopsTest(absltest.TestCase):

  def test_compiled_cost_of_none_is_empty(self):
    for returned in (None, [], [None], {}):
      fake = mock.Mock(cost_analysis=mock.Mock(return_value=returned))
      self.assertEqual(costs.compiled_cost(fake), {})
    fake = mock.Mock(cost_analysis=mock.Mock(return_value=[{"flops": 3.0}]))
    self.assertEqual(costs.compiled_cost(fake), {"flops": 3.0})

  def test_the_plan_says_there_are_none_and_uses_the_model_flops(self):
    plan = _gpu_plan_without_cost()
    self.assertIsNone(plan.compiler_flops_per_step)
    self.assertEqual(
        plan.compiler_flops_note,
        "XLA:GPU gives no cost analysis without the GPU",
    )
    self.assertEqual(plan.chip, "h200")
    self.assertEqual(plan.flops_per_step, tiny_mixtral_train_flops(B, S))
    # The roofline from the model FLOPs (written out by hand) and every
    # argument, output and temporary once (no "bytes accessed" either).
    chip = planning.CHIPS["h200"]
    d = plan.per_device
    moved = d.argument_bytes + d.output_bytes + d.temp_bytes
    compute_s = tiny_mixtral_train_flops(B, S) / 989e12
    memory_s = moved / 4.8e12
    self.assertAlmostEqual(
        plan.estimated_step_s, max(compute_s, memory_s), delta=1e-15
    )
    self.assertEqual(chip.peak_flops, 989e12)
    self.assertEqual(plan.roofline_bound, "memory")  # a tiny step
    self.assertAlmostEqual(plan.estimated_mfu, compute_s / memory_s)
    self.assertIsNone(plan.to_json()["compiler_flops_per_step"])

  def test_the_printed_plan_says_no_compiler_flops(self):
    text = plan_cmd.describe(_gpu_plan_without_cost(), "tiny_mixtral")
    self.assertIn(
        "(no compiler FLOPs: XLA:GPU gives no cost analysis without the GPU)",
        text,
    )
    self.assertNotIn("compiler counts", text)
    self.assertRegex(text, r"MFU <= \d+\.\d%")
    self.assertNotIn("MFU <= 100", text)

  def test_a_step_that_did_not_compile_has_none_either(self):
    message = "RESOURCE_EXHAUSTED: Used 2.0G of 1.0G hbm."
    with mock.patch.object(
        jax.stages.Lowered, "compile", side_effect=RuntimeError(message)
    ):
      plan = planning.plan(
          load_model_config("tiny_mixtral"), "cpu:1", batch_size=B, seq_len=S
      )
    self.assertIsNone(plan.compiler_flops_per_step)
    self.assertEqual(plan.compiler_flops_note, "the step did not compile")
    self.assertIsNone(plan.roofline_bound)


def _plan_with(**fields) -> planning.Plan:
  base = dict(
      target="gpu:h200-8",
      devices=8,
      mesh={"fsdp": 8},
      step="train",
      batch_size=8,
      seq_len=4096,
      grad_accum=1,
      per_device=plan_lib.PerDevice(10, 10, 10, 10, 30),
      device_memory_bytes=141 * 10**9,
      fits=True,
      biggest_consumer="parameters",
      flops_per_step=8 * 989e12,
      compiler_flops_per_step=1e15,
      tokens_per_step=8 * 4096,
      estimated_step_s=1.0,
      estimated_mfu=1.0,
      chip="h200",
      roofline_bound="compute",
  )
  return planning.Plan(**{**base, **fields})


class RooflineTest(absltest.TestCase):

  def test_the_slower_of_flops_and_bytes(self):
    chip = chips_lib.Chip(
        "x",
        "x",
        peak_flops=100.0,
        memory_bytes=1,
        memory_bandwidth=10.0,
        source="https://x",
    )
    # 200 FLOPs take 2 s, 10 bytes 1 s: compute-bound, MFU 1 by definition.
    self.assertEqual(costs.roofline(200.0, 10.0, chip), (2.0, 1.0, "compute"))
    # 100 FLOPs take 1 s, 40 bytes 4 s: memory-bound, a quarter of the peak.
    self.assertEqual(costs.roofline(100.0, 40.0, chip), (4.0, 0.25, "memory"))

  def test_a_compute_bound_plan_prints_no_mfu_bound(self):
    text = plan_cmd.describe(_plan_with(), "qwen3_30b_a3b")
    self.assertNotIn("MFU <=", text)
    self.assertIn(
        "roofline (h200): >= 1e+03 ms per step, <= 3.28e+04 tokens/s, bound "
        "by the model FLOPs at the chip's peak",
        text,
    )
    self.assertIn("(the compiler counts 1e+15)", text)

  def test_a_memory_bound_plan_prints_its_mfu_bound(self):
    text = plan_cmd.describe(
        _plan_with(estimated_mfu=0.25, roofline_bound="memory"), "c"
    )
    self.assertIn(
        "bound by memory traffic at the chip's bandwidth: MFU <= 25.0%", text
    )


class GpuSpecTest(absltest.TestCase):
  """The chip table's H100 and H200 against XLA's own description of each
  GPU (gpu_specs/*.txtpb, shipped with the package): peak bf16 FLOP/s =
  2 (a fused multiply-add) x SMs x tensor units per SM x bf16 ops per clock
  x clock; bandwidth and memory as XLA has them."""

  def _spec(self, name: str) -> str:
    files = importlib.resources.files("linen_moe._src.planning.gpu_specs")
    return files.joinpath(targets_lib._GPU_SPECS[name]).read_text()

  def _field(self, text: str, name: str) -> float:
    return float(re.search(rf"\b{name}: ([\d.e+]+)", text).group(1))

  def test_the_chips_figures_are_xlas(self):
    for name, sms in (("h100", 132), ("h200", 132)):
      text = self._spec(name)
      self.assertEqual(self._field(text, "core_count"), sms)
      matrix = text[text.index("matrix_unit_description") :]
      bf16 = re.search(  # PrimitiveType BF16 = 16
          r"key: 16\s+value \{\s+clock_rate_ghz: ([\d.]+)\s+"
          r"units_per_core: (\d+)\s+ops_per_clock: (\d+)",
          matrix,
      )
      clock, units, ops = (float(g) for g in bf16.groups())
      peak = 2 * sms * units * ops * clock * 1e9
      chip = planning.CHIPS[name]
      np.testing.assert_allclose(chip.peak_flops, peak, rtol=2e-3)
      np.testing.assert_allclose(  # H100: 3.35 TB/s, XLA's 3.35232
          chip.memory_bandwidth,
          self._field(text, "memory_bandwidth"),
          rtol=1e-3,
      )
      # The vendor's decimal GB, under what XLA says the device has.
      self.assertLessEqual(
          chip.memory_bytes, self._field(text, "device_memory_size")
      )
    self.assertIn('name: "NVIDIA H200 141GB HBM3e"', self._spec("h200"))

  def test_gpu_h200_1_is_one_h200(self):
    target = planning.parse_target("gpu:h200-1")
    self.assertEqual(
        (target.platform, target.num_devices, target.topology),
        ("gpu", 1, "1x1x1"),
    )
    self.assertEqual(target.chip, planning.CHIPS["h200"])
    self.assertEqual(target.device_memory_bytes, 141 * 10**9)


class InstallHintTest(absltest.TestCase):
  """The package is installed from a checkout or a wheel, on no index:
  `pip install 'linen_moe[gpu-plan]'` cannot work."""

  def test_errors_name_the_checkouts_extras(self):
    for extra, platform_ready, target in (
        ("gpu-plan", "cuda_plugin_available", "gpu:h200-1"),
        ("tpu-plan", "libtpu_available", "tpu:v5e-1"),
    ):
      with (
          mock.patch.object(planning, "prepare_process"),
          mock.patch.object(targets_lib, platform_ready, return_value=False),
      ):
        status, out, err = cli_helpers.cli("plan", "--target", target)
      self.assertEqual((status, out), (2, ""))
      self.assertIn(f"pip install '.[{extra}]'", err)
      self.assertIn(f"scripts/setup_venv.sh {extra}", err)
      self.assertNotIn("linen_moe[", err)
      self.assertEqual(err.count("\n"), 1, err)

  def test_docs_and_help_name_no_index_install(self):
    texts = {
        "planning.md": (ROOT / "docs/guides/planning.md").read_text(),
        "cli.md": (ROOT / "docs/guides/cli.md").read_text(),
        "plan --help": cli_helpers.cli("plan", "--help")[1],
    }
    for name, text in texts.items():
      self.assertNotIn("linen_moe[gpu-plan]", text, name)
      self.assertNotIn("linen_moe[tpu-plan]", text, name)
    self.assertIn("scripts/setup_venv.sh gpu-plan", texts["planning.md"])
    self.assertIn("'.[gpu-plan]'", texts["plan --help"])
    row = next(
        line
        for line in texts["cli.md"].splitlines()
        if line.startswith("| `plan` |")
    )
    self.assertIn("gpu:h200-1", row)

  def test_the_gpu_plan_extra_is_the_h200_machines_stack(self):
    # jax[cuda13] of the supported range (the H200 machine runs jax 0.11.2
    # with the CUDA 13 plugin), not a pin it cannot run.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (requirement,) = pyproject["project"]["optional-dependencies"]["gpu-plan"]
    match = re.fullmatch(r"jax\[cuda13\]>=([\d.]+),<([\d.]+)", requirement)
    self.assertIsNotNone(match, requirement)
    low, high = (tuple(map(int, v.split("."))) for v in match.groups())
    self.assertLessEqual(low, (0, 11, 2))
    self.assertGreater(high, (0, 12, 99))


class LibtpuAcceleratorTypeTest(absltest.TestCase):
  """libtpu without a TPU warns "could not determine TPU accelerator type"
  on every start unless `TPU_ACCELERATOR_TYPE` names one: a plan gives it
  the slice's (a v5e slice is a "v5litepod" to Cloud TPU), one set stays."""

  def _prepared(self, target: str, **env) -> str:
    with (
        mock.patch.dict(os.environ, env, clear=True),
        mock.patch.object(targets_lib, "_backends_started", return_value=True),
    ):
      planning.prepare_process(planning.parse_target(target))  # no-op
      self.assertEqual(dict(os.environ), env)
    with (
        mock.patch.dict(os.environ, env, clear=True),
        mock.patch.object(targets_lib, "_backends_started", return_value=False),
        mock.patch.object(jax.config, "update"),
    ):
      planning.prepare_process(planning.parse_target(target))
      return os.environ.get("TPU_ACCELERATOR_TYPE")

  def test_the_slices_accelerator_type(self):
    self.assertEqual(self._prepared("tpu:v5e-16"), "v5litepod-16")
    self.assertEqual(self._prepared("tpu:v5litepod-4"), "v5litepod-4")
    self.assertEqual(self._prepared("tpu:v5p-64"), "v5p-64")
    self.assertEqual(self._prepared("tpu:v6e-1"), "v6e-1")
    self.assertIsNone(self._prepared("gpu:h200-1"))
    self.assertIsNone(self._prepared("cpu:2"))
    self.assertEqual(
        self._prepared("tpu:v5p-8", TPU_ACCELERATOR_TYPE="v5p-16"), "v5p-16"
    )


if __name__ == "__main__":
  absltest.main()
