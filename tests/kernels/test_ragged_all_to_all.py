"""Ragged all-to-all expert parallelism (`expert_parallel="ragged_all_to_all"`)
on 8 simulated CPU devices.

XLA:CPU cannot compile `ragged_all_to_all`, so the CPU programs run its
emulation (`linen_moe._src.kernels.ragged_collectives`); the first test proves the
emulation is the op's definition, values and transpose, on random ragged
slices with gaps and empty slices. The layer then runs the same program the
devices do with that one op swapped (the device program's lowering holds
the real op), and its loss, parameter, fp8-state and input gradients equal
the one-device layer's in every quantization mode, on meshes and rule tables
that exchange over one axis, over two, and exchange over one while summing
over another; a train step of the reference decoder equals one device's in
both front ends (slow). One worker runs every default job (one start-up, shared
compiles), all asserted in one test; another runs the slow ones.
"""

from __future__ import annotations

import functools
import json

from absl.testing import absltest
from absl.testing import parameterized

from linen_moe import testing
from linen_moe._src.config.quantization_modes import FP8_MODES
from linen_moe._src.parallel import ep_traffic
from linen_moe._src.testing.marks import heavy
from linen_moe.quantization import MODES
from tests import workers

RAGGED = "ragged_all_to_all"
# The default run: every mode but fp8 on a mesh that exchanges over `expert`
# inside each `data` row; fp8 under two rule tables (two exchange axes;
# exchange over one axis, sum over another). The slow run adds `expert=8`
# for every mode, fp8 on the first mesh, the other rule tables and the
# decoders' train steps (Linen and NNX; the layer's loss, parameter, fp8
# and input gradients are the default run's, the step adds the optimizer).
DEFAULT_MODES = [m for m in tuple(MODES) if m != "fp8"]
MESHES = [("data=2,expert=4", "default")]
RULE_MESHES = [
    ("fsdp=2,expert=4", "two_exchange_axes"),
    ("data=2,expert=4", "sum_then_exchange"),
]
SLOW_MESHES = [("expert=8", "default")]
SLOW_RULE_MESHES = [
    ("data=2,expert=4", "exchange_and_sum"),
    ("data=2,expert=4", "batch_on_data"),
]


def _jobs(meshes, rule_meshes, frontends, modes) -> tuple[dict, ...]:
  return (
      {
          "check": "layer",
          "quantizations": list(modes),
          "expert_parallel": RAGGED,
          "meshes": meshes,
          "inputs": ["random", "skewed"],
      },
      {
          "check": "layer",
          "quantization": "fp8",
          "expert_parallel": RAGGED,
          "meshes": rule_meshes,
      },
      *(
          {
              "check": "equivalence",
              "path": "sparse",
              "quantization": "fp8",
              "expert_parallel": RAGGED,
              "meshes": ["data=2,expert=4"],
              "frontend": frontend,
          }
          for frontend in frontends
      ),
  )


@functools.cache
def _results(slow: bool = False) -> list:
  jobs = (
      *_jobs(SLOW_MESHES, SLOW_RULE_MESHES, ("linen", "nnx"), tuple(MODES)),
      *_jobs(MESHES, [], (), ["fp8"])[:1],
  )
  if not slow:
    jobs = (
        {"check": "emulation"},
        {"check": "device_program"},
        *_jobs(MESHES, RULE_MESHES, (), DEFAULT_MODES),
        {"check": "traffic", "mesh": "expert=8"},
    )
  return workers.run_json("tests.ragged_worker", json.dumps(jobs))


class Checks(parameterized.TestCase):

  def check_layer(self, results, cases):
    self.assertLen(results, cases)
    for case, r in results.items():
      with self.subTest(case=case):
        self.assertLessEqual(r["loss_err"], 1e-6 * r["loss_scale"])
        for what in ("param_grad", "input_grad", "fp8"):
          self.assertLessEqual(
              r[f"{what}_err"], 1e-5 * r[f"{what}_scale"], what
          )
        if any(case.startswith(m + "/") for m in FP8_MODES):
          self.assertGreater(r["fp8_scale"], 0.0)

  def check_train_step(self, result):
    self.assertGreater(result["update"], 0.0)
    self.assertGreater(result["fp8_moved"], 0.0)
    for spec, r in result["meshes"].items():
      with self.subTest(mesh=spec):
        self.assertAlmostEqual(
            r["loss"], result["loss"], delta=1e-5 * abs(result["loss"])
        )
        self.assertLessEqual(r["param_err"], 1e-2 * result["update"])
        self.assertLessEqual(r["fp8_err"], 1e-2 * result["fp8_moved"])


class RaggedAllToAllTest(Checks):
  """The default checks, one subtest each, in one test: a parallel run
  (`pytest -n`) hands each test to any of its processes, so checks that
  share one worker run must share one test to start it once."""

  @heavy
  def test_default_checks(self):
    checks = (
        self.check_emulation_is_the_definition,
        self.check_devices_get_the_real_op_and_auto_is_all_gather_here,
        self.check_layer_equals_one_device_in_every_other_mode,
        self.check_layer_equals_one_device_under_other_rules,
        self.check_traffic_model_is_the_compiled_programs,
    )
    for check, result in zip(checks, _results(), strict=True):
      with self.subTest(check=check.__name__):
        check(result)

  def check_emulation_is_the_definition(self, results):
    results = dict(results)
    self.assertEqual(
        results.pop("docstring_example"), [[1, 3, 0, 0], [2, 2, 4, 0]]
    )
    for case, r in results.items():
      with self.subTest(case=case):
        self.assertGreater(r["sent_rows"], 0)
        self.assertEqual(r["value_err"], 0.0)
        self.assertEqual(r["operand_grad_err"], 0.0)
        self.assertEqual(r["output_grad_err"], 0.0)

  def check_devices_get_the_real_op_and_auto_is_all_gather_here(self, r):
    # Forward: tokens out, results back; backward (no input gradient
    # asked): the results' transpose.
    self.assertEqual(r["real_op_calls"], 3)
    self.assertGreater(r["emulated_counts"]["all-to-all"], 0)
    self.assertEqual(r["emulated_counts"]["reduce-scatter"], 0)
    # "auto" models the emulation as dearer than the all-gather on a CPU.
    self.assertEqual(r["auto_counts"]["all-to-all"], 0)
    self.assertGreater(r["auto_counts"]["reduce-scatter"], 0)

  def check_layer_equals_one_device_in_every_other_mode(self, results):
    self.check_layer(results, 2 * len(DEFAULT_MODES) * len(MESHES))

  def check_layer_equals_one_device_under_other_rules(self, results):
    self.check_layer(results, len(RULE_MESHES))

  def check_traffic_model_is_the_compiled_programs(self, measured):
    """The bytes each device sends in the expert-parallel body, read from
    the compiled HLO of the layer's forward and backward on expert=8,
    equal `ep_traffic`'s model: the all-gather's, and the ragged
    exchange's as emulated here (the real op's bytes depend on the data)."""
    # tiny_mixtral: 64 tokens over 8 devices, emb 64, top-2, float32.
    problem = ep_traffic.Problem(
        tokens=8, emb=64, k=2, ep=8, act_bytes=4, experts_per_device=1
    )
    for strategy, emulated in (("all_gather", False), (RAGGED, True)):
      model = ep_traffic.traffic(problem, strategy, emulated)
      with self.subTest(strategy=strategy):
        self.assertEqual(measured[strategy]["forward"], model.forward)
        self.assertEqual(measured[strategy]["backward"], model.backward)


@testing.slow
class RaggedAllToAllSlowTest(Checks):

  def test_layer_on_expert_8_in_every_mode(self):
    self.check_layer(
        _results(True)[0], 2 * len(tuple(MODES)) * len(SLOW_MESHES)
    )

  def test_layer_under_the_other_rules(self):
    self.check_layer(_results(True)[1], len(SLOW_RULE_MESHES))

  def test_linen_train_step_equals_one_device(self):
    self.check_train_step(_results(True)[2])

  def test_nnx_train_step_equals_one_device(self):
    self.check_train_step(_results(True)[3])

  def test_fp8_layer_on_the_default_mesh(self):
    self.check_layer(_results(True)[4], 2 * len(MESHES))


if __name__ == "__main__":
  absltest.main()
