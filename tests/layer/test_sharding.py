"""Logical sharding, sharded training and expert parallelism on 8 devices.

The multi-device checks run in subprocesses (`tests/sharding_worker.py`),
which set `--xla_force_host_platform_device_count=8` before importing jax;
each test batches several meshes (and cases) into one subprocess, since
compiling dominates. The default run holds a representative subset of
{sparse, dense, dense + dropping} x {none, int8, fp8, nanoo_fp8} x meshes x
{Linen, NNX}, each value at least once; the full product, and each
default check's other front end or meshes, are marked slow.

Tolerances. One SGD step (lr 0.1) from the same init, tokens and RNG, on one
device and on a mesh. The sharded program multiplies and reduces in other
blocks and orders (per-device batch shapes, reduce-scatters), so the results
agree to float rounding. Measured over every path x mode x front end on the
three meshes: losses within 2e-7 (relative), updated parameters within
7.5e-6 of the step's largest update, fp8 scales and amax histories equal;
but for nanoo_fp8 on the dense path, 2.65e-4 of the update: an input that
differs in its last bit there flips an e4m3fnuz code. So losses to rtol
1e-5, parameters to 1e-4 of the update (nanoo_fp8: 1e-3), fp8 state to 1e-5
of how far the step moved it. A wrong routing, a lost expert or a missing
gradient reduction moves them by O(1) of it; AQT's stochastic rounding on
another key than the single device's (int8, dense path) by 5e-4. AQT draws
from the same RNG with sharding-invariant (`threefry_partitionable`) bits,
so that is no source of difference.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

from linen_moe import Decoder
from linen_moe import load_model_config
from linen_moe import sharding
from linen_moe import testing
from linen_moe._src.config.quantization_modes import FP8_MODES
from linen_moe._src.parallel import sharding as sharding_lib
from linen_moe._src.testing.marks import heavy
from linen_moe.quantization import MODES
from tests import workers

MESHES = ("data=8", "expert=8", "data=2,expert=4")
MATMUL_PATHS = ("sparse", "dense", "dense_dropping")
FRONTENDS = ("linen", "nnx")

# Of the step's largest update; see the module docstring.
PARAM_TOL = {"none": 1e-4, "int8": 1e-4, "fp8": 1e-4, "nanoo_fp8": 1e-3}


run_worker = workers.sharding_jobs


def equivalence_job(path: str, quantization: str, meshes, **options) -> dict:
  return {
      "check": "equivalence",
      "path": path,
      "quantization": quantization,
      "meshes": list(meshes),
      **options,
  }


class EquivalenceMixin(parameterized.TestCase):

  def check_equivalent(
      self, path: str, quantization: str, meshes, **options
  ) -> dict:
    """Every mesh: same loss, params and fp8 state as one device."""
    (result,) = run_worker(
        equivalence_job(path, quantization, meshes, **options)
    )
    self.assert_equivalent(result, quantization)
    return result

  def check_cases(self, *cases: tuple) -> None:
    """`check_equivalent` for each (path, quantization, meshes[, frontend[,
    packed]]) case, all in one worker (one start-up)."""

    def job(path, mode, meshes, frontend="linen", packed=False):
      return equivalence_job(
          path, mode, meshes, frontend=frontend, packed=packed
      )

    jobs = [job(*case) for case in cases]
    for case, job, result in zip(cases, jobs, run_worker(*jobs), strict=True):
      with self.subTest(case=case):
        self.assert_equivalent(result, job["quantization"])

  def assert_equivalent(self, result: dict, quantization: str) -> None:
    rtol = 1e-5
    tol = PARAM_TOL[quantization] * result["update"]
    self.assertGreater(result["update"], 0.0)
    if quantization in FP8_MODES:
      self.assertGreater(result["fp8_moved"], 0.0)
    for spec, r in result["meshes"].items():
      with self.subTest(mesh=spec):
        self.assertAlmostEqual(
            r["loss"], result["loss"], delta=rtol * abs(result["loss"])
        )
        self.assertLessEqual(r["param_err"], tol)
        self.assertLessEqual(r["fp8_err"], 1e-5 * result["fp8_moved"])


class MeshSpecTest(absltest.TestCase):

  def test_parse(self):
    self.assertEqual(
        sharding_lib.parse_mesh_spec("data=2, expert=4"),
        {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1},
    )
    self.assertEqual(sharding_lib.parse_mesh_spec({"tensor": 2})["tensor"], 2)

  def test_bad_specs(self):
    for spec, message in (
        ("data:2", "Bad mesh spec item"),
        ("model=2", "Unknown mesh axis 'model'"),
        ("data=2,data=2", "appears twice"),
        ("data=0", "must be an integer >= 1"),
    ):
      with self.subTest(spec=spec), self.assertRaisesRegex(ValueError, message):
        sharding_lib.parse_mesh_spec(spec)

  def test_product_must_match_devices(self):
    n = jax.device_count() + 1
    with self.assertRaisesRegex(ValueError, "multiply to the device count"):
      sharding.make_mesh(f"data={n}")
    # On a CPU the message says how to simulate the devices.
    with self.assertRaisesRegex(
        ValueError,
        rf"On a CPU, simulate {n} devices: set XLA_FLAGS="
        rf"--xla_force_host_platform_device_count={n} before jax starts",
    ):
      sharding.make_mesh(f"data={n}", jax.devices("cpu"))

  def test_rules_cover_every_parameter_name(self):
    cfg = load_model_config("tiny_gemma4_26b", quantization="fp8")
    abstract = jax.eval_shape(
        Decoder(cfg).init, jax.random.key(0), jnp.zeros((2, 4), jnp.int32)
    )
    specs = jax.tree.leaves(
        jax.tree.map(
            lambda x: x.names,
            abstract["params"],
            is_leaf=lambda x: hasattr(x, "names"),
        )
    )
    names = {n for n in specs if n is not None}
    self.assertLessEqual(names, {rule for rule, _ in sharding.DEFAULT_RULES})
    self.assertTrue({"exp", "embed", "mlp", "vocab", "layers"} <= names)


class ParameterShardingTest(absltest.TestCase):

  def test_rule_table_shardings(self):
    tp, ep, nnx = run_worker(
        {"check": "shardings", "mesh": "fsdp=2,expert=2,tensor=2"},
        {"check": "shardings", "mesh": "data=2,expert=4"},
        {
            "check": "shardings",
            "mesh": "fsdp=2,expert=2,tensor=2",
            "frontend": "nnx",
        },
    )
    moe = ".params['layers']['moe']"
    expected = {
        f"{moe}['wi_0']": "P(None, 'expert', 'fsdp', 'tensor')",
        f"{moe}['wo']": "P(None, 'expert', 'tensor', 'fsdp')",
        f"{moe}['gate']['kernel']": "P(None, 'fsdp', None)",
        f"{moe}['per_expert_scale']": "P(None, 'expert')",
        ".params['embed']['embedding']": "P('tensor', 'fsdp')",
        ".params['layers']['attention']['query']['kernel']": (
            "P(None, 'fsdp', 'tensor', None)"
        ),
        ".params['layers']['shared_experts']['wi_0']": (
            "P(None, 'fsdp', 'tensor')"
        ),
        ".opt_state[1][0].mu['layers']['moe']['wi_0']": (
            "P(None, 'expert', 'fsdp', 'tensor')"
        ),
        ".fp8_state['layers']['moe']['wi_0_dot']['kernel_scale']": "P()",
        ".fp8_state['layers']['moe']['wo_dot']['input_amax_history']": "P()",
    }
    for path, spec in expected.items():
      self.assertEqual(tp[path], spec, path)
    self.assertEqual(ep[f"{moe}['wi_0']"], expected[f"{moe}['wi_0']"])
    fp8 = [p for p in tp if p.startswith(".fp8_state")]
    self.assertLen(fp8, 18)
    self.assertEqual({tp[p] for p in fp8}, {"P()"})
    # The NNX decoder's state (model, optimizer), through NNX metadata.
    for path, spec in {
        ".state[0]['layers']['moe']['wi_0'].value": expected[f"{moe}['wi_0']"],
        ".state[0]['embed']['embedding'].value": "P('tensor', 'fsdp')",
        ".state[1]['opt_state'][1][0]['nu']['layers']['moe']['wo'].value": (
            expected[f"{moe}['wo']"]
        ),
        ".state[0]['layers']['moe']['wo_dot']['kernel_scale'].value": "P()",
    }.items():
      self.assertEqual(nnx[path], spec, path)


class SparseExpertParallelTest(EquivalenceMixin):
  """Sparse path, no quantization: one step on a mesh equals one device's,
  each expert weight lives on its shard only and the compiled step gathers
  tokens, never a full expert weight. By default Linen on every mesh (NNX
  steps on a mesh in `EquivalenceTest` and `SkipStepOnMeshTest`); NNX on
  the expert meshes is `test_nnx` (slow)."""

  @heavy
  def test_sparse_matches_one_device_and_keeps_experts_local(self):
    self.check_sparse(("linen", MESHES))

  @testing.slow
  def test_nnx(self):
    self.check_sparse(("nnx", MESHES[1:]))

  def check_sparse(self, *cases: tuple[str, tuple[str, ...]]) -> None:
    jobs = [
        equivalence_job(
            "sparse",
            "none",
            meshes,
            frontend=frontend,
            hlo=True,
            check_init=True,
        )
        for frontend, meshes in cases
    ]
    for (frontend, _), result in zip(cases, run_worker(*jobs), strict=True):
      with self.subTest(frontend=frontend):
        self.assert_equivalent(result, "none")
        self.assert_experts_local(result)

  def assert_experts_local(self, result: dict) -> None:
    self.assertEqual(result["init_err"], 0.0)
    for spec, r in result["meshes"].items():
      shards = sharding_lib.parse_mesh_spec(spec)["expert"]
      for name in ("wi_0", "wi_1", "wo"):
        self.assertEqual(
            r["specs"][name],
            "P(None, 'expert', 'fsdp', 'tensor')"
            if name != "wo"
            else "P(None, 'expert', 'tensor', 'fsdp')",
        )
        self.assertEqual(r["local_fraction"][name], 1 / shards)
      self.assertEqual(r["full_weight_gathers"], [], spec)
      self.assertEqual(r["collectives"]["all-to-all"], 0, spec)
      if shards > 1:  # tokens gathered, outputs reduce-scattered
        self.assertGreater(r["collectives"]["all-gather"], 0, spec)
        self.assertGreater(r["collectives"]["reduce-scatter"], 0, spec)


class RulesTest(absltest.TestCase):

  def test_own_rules_and_fsdp_tensor_meshes(self):
    """fp8 sparse layer: batch on `data` only (tokens replicated over
    `expert`, outputs summed), and a mesh with fsdp and tensor axes."""
    (result,) = run_worker({
        "check": "layer",
        "meshes": [
            ("data=2,expert=4", "batch_on_data"),
            ("fsdp=2,expert=2,tensor=2", "default"),
        ],
    })
    for case, r in result.items():
      with self.subTest(case=case):
        self.assertLess(r["loss_err"], 1e-5)
        # The expert-parallel path counts the same assignments (the single
        # device's count is checked against np.bincount in test_moe.py).
        self.assertEqual(r["fraction_err"], 0.0)
        self.assertLess(r["param_grad_err"], 1e-5)
        self.assertLess(r["fp8_err"], 1e-5)


FSDP_MESHES = [("fsdp=4,expert=2", "default"), ("fsdp=8", "default")]


class FsdpKernelGatherTest(absltest.TestCase):
  """Kernels split over `fsdp` enter the expert-parallel `shard_map` split
  and are all-gathered inside the sparse path's rematerialized regions
  (`expert_parallel.kernel_shards`): loss, parameter, fp8-state and input
  gradients equal one device's in every quantization mode, with experts
  also split (`expert`) and not: by default each mode on one of the two
  meshes (each mesh in two modes), every mode on both in the slow set."""

  @heavy
  def test_every_mode_matches_one_device(self):
    modes = tuple(MODES)
    half = len(modes) // 2
    self.check(
        (modes[:half], [FSDP_MESHES[0]]), (modes[half:], [FSDP_MESHES[1]])
    )

  @testing.slow
  def test_every_mode_on_both_meshes(self):
    self.check((tuple(MODES), FSDP_MESHES))

  def check(self, *cases):
    results = run_worker(*[
        {"check": "layer", "quantizations": list(modes), "meshes": meshes}
        for modes, meshes in cases
    ])
    for (modes, meshes), result in zip(cases, results, strict=True):
      self.assertLen(result, len(modes) * len(meshes))
      for case, r in result.items():
        with self.subTest(case=case):
          self.assertLess(r["loss_err"], 1e-5)
          self.assertEqual(r["fraction_err"], 0.0)
          for what in ("param_grad", "input_grad", "fp8"):
            self.assertLessEqual(
                r[f"{what}_err"], 1e-5 * max(1.0, r[f"{what}_scale"]), what
            )


class EquivalenceTest(EquivalenceMixin):
  """A representative subset: with `SparseExpertParallelTest` (sparse, no
  quantization, every mesh), `RulesTest` (sparse fp8
  layer) and `SkipStepOnMeshTest` (sparse fp8 step), each path, mode, mesh
  and front end at least once. The full product is `test_full_product`
  (slow), the rest of the old subset `test_more`."""

  @heavy
  def test_matches_one_device(self):
    """The default cases, in one worker (one start-up); the first trains
    packed documents (segment ids and their positions)."""
    self.check_cases(
        ("dense_dropping", "int8", ("data=2,expert=4",), "linen", True),
        ("dense", "nanoo_fp8", ("expert=8",), "nnx"),
    )

  @testing.slow
  @parameterized.parameters(
      ("dense_dropping", "none", ("data=2,expert=4",)),
      ("sparse", "int8", ("expert=8",)),
      ("dense", "nanoo_fp8", ("expert=8",)),
      ("dense", "fp8", ("data=2,expert=4",), "nnx"),
      ("dense", "none", ("expert=8", "data=2,expert=4")),
      ("sparse", "fp8", ("data=2,expert=4",)),
      ("dense", "int8", ("data=2,expert=4",)),
  )
  def test_more(self, path, quantization, meshes, fe="linen"):
    self.check_equivalent(path, quantization, meshes, frontend=fe)

  @testing.slow
  @parameterized.product(
      path=MATMUL_PATHS, quantization=tuple(MODES), frontend=FRONTENDS
  )
  def test_full_product(self, path, quantization, frontend):
    self.check_equivalent(path, quantization, MESHES, frontend=frontend)


class RoutedBiasMeshTest(EquivalenceMixin):
  """tiny_deepseek_v3 (sigmoid, groups, shared expert, routed bias): one
  step on 8 devices with 2 microbatches moves every routed bias exactly as
  one step on one device with the whole batch. Linen by default (NNX runs
  this file's other multi-device steps); NNX is slow."""

  @heavy
  def test_rule_update_equals_one_device_one_batch(self):
    self.check_rule_update("linen")

  @testing.slow
  def test_rule_update_nnx(self):
    """NNX keeps the rule state in its own variables."""
    self.check_rule_update("nnx")

  def check_rule_update(self, frontend: str) -> None:
    (result,) = run_worker(
        equivalence_job(
            "sparse",
            "none",
            ["data=2,expert=4"],
            config="tiny_deepseek_v3",
            grad_accum=2,
            batch=16,
            frontend=frontend,
        )
    )
    self.assertGreater(result["rule_moved"], 0.0)
    for r in result["meshes"].values():
      self.assertEqual(r["rule_err"], 0.0)
      self.assertLessEqual(r["param_err"], 1e-4 * result["update"])
      self.assertAlmostEqual(
          r["loss"], result["loss"], delta=1e-5 * result["loss"]
      )


class SkipStepOnMeshTest(absltest.TestCase):
  """fp8, sparse (expert parallel), two microbatches, the second step's
  last one poisoned. NNX by default (RoutedBiasMeshTest steps Linen with
  microbatches on this mesh); Linen is slow."""

  def test_poisoned_microbatch_skips_the_sharded_step(self):
    self.check_skip("nnx")

  @testing.slow
  def test_poisoned_microbatch_skips_the_sharded_linen_step(self):
    self.check_skip("linen")

  def check_skip(self, frontend: str) -> None:
    (r,) = run_worker(
        {"check": "skip", "mesh": "data=2,expert=4", "frontend": frontend}
    )
    self.assertEqual([m["skipped"] for m in r["metrics"]], [0, 1, 0])
    self.assertEqual(r["skipped_steps"], 1)
    self.assertEqual(r["steps"], [0, 1, 2, 3])
    self.assertGreater(r["fp8_leaves"], 0)
    self.assertEqual(r["skip_diff"], 0.0)  # params, fp8, optimizer
    self.assertTrue(r["finite"])
    self.assertGreater(r["moved_after"], 0.0)
    losses = [m["loss"] for m in r["metrics"]]
    self.assertLess(losses[2], losses[0])


if __name__ == "__main__":
  absltest.main()
