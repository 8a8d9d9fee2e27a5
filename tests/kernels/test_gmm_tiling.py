"""How the Pallas grouped matmul gets its tiles and when "auto" runs it: the
shipped table (package data), the rule for shapes it lacks, the table's
answer for `grouped_matmul="auto"` on a TPU, and the layer's sparse path
with the kernels interpreted on this CPU (`kernels_on_cpu("pallas")`)."""

from __future__ import annotations

import json
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax._src import mesh as mesh_lib
import jax.numpy as jnp
import numpy as np

from linen_moe import testing
from linen_moe._src.kernels import accelerator
from linen_moe._src.kernels import grouped_matmul as gmm_lib
from linen_moe._src.kernels.tpu import gmm_tiling
from linen_moe._src.kernels.tpu import pallas_gate_up
from linen_moe._src.kernels.tpu import pallas_grouped
from linen_moe._src.kernels.tpu import tpu_chips
from linen_moe._src.planning import targets
from tests import workers
from tests.kernels import test_kernels

# The shapes: (M, K, N, G).
SHAPES = (
    (8192, 2048, 5632, 8),
    (32768, 4096, 14336, 8),
    (32768, 2048, 768, 128),
)


def _entry(m, k, n, g, fastest="kernel", chip="v5e"):
  """A table entry as bench_gmm.py writes one (tiles made up)."""
  key = dict(chip=chip, dtype="bfloat16", m=m, k=k, n=n, groups=g)
  tiles = dict(gmm=[512, k, 512], gmm_t=[512, 256, k], tgmm=[256, 512, 256])
  return {**key, **tiles, "fastest": fastest}


def _tpu_mesh(kind="TPU v5 lite"):
  device = mesh_lib.AbstractDevice(
      device_kind=kind, num_cores=1, platform="tpu"
  )
  return jax.sharding.AbstractMesh(
      (1,),
      ("x",),
      axis_types=jax.sharding.AxisType.Auto,
      abstract_device=device,
  )


class TableTest(parameterized.TestCase):

  def test_shipped_table_loads_and_its_entries_are_complete(self):
    for entry in gmm_tiling.load_table():
      self.assertContainsSubset(
          {
              "chip",
              "dtype",
              "m",
              "k",
              "n",
              "groups",
              "fastest",
              *gmm_tiling.OPS,
          },
          entry,
      )
      self.assertIn(entry["chip"], gmm_tiling.CHIPS)
      self.assertIn(entry["fastest"], ("kernel", "ragged_dot"))

  def test_nearest_rows_of_the_same_problem(self):
    table = (_entry(8192, 2048, 5632, 8), _entry(65536, 2048, 5632, 8, "x"))
    with mock.patch.object(gmm_tiling, "load_table", return_value=table):
      tiling = gmm_tiling.choose_tiling(
          16384, 2048, 5632, 8, jnp.bfloat16, "v5e"
      )
      self.assertEqual(tiling.source, "table")
      self.assertEqual(tiling.gmm, (512, 2048, 512))
      # A few rows: the row tiles are cut to them.
      self.assertEqual(
          gmm_tiling.choose_tiling(40, 2048, 5632, 8, jnp.bfloat16, "v5e").gmm,
          (48, 2048, 512),
      )
      for other in (
          dict(m=8192, k=2048, n=5632, g=16),  # other groups
          dict(m=8192, k=2048, n=5632, g=8, chip="v6e"),
      ):
        chip = other.pop("chip", "v5e")
        args = (*other.values(), jnp.bfloat16, chip)
        self.assertIsNone(gmm_tiling.fastest_implementation(*args))
        self.assertEqual(gmm_tiling.choose_tiling(*args).source, "rule")

  def test_transposed_problem_takes_the_entry_turned(self):
    # [M, 5632] x [G, 5632, 2048] (a down projection) is [M, 2048] x
    # [G, 2048, 5632]'s three products: its forward is the entry's input
    # gradient, its input gradient the entry's forward.
    entry = dict(
        _entry(8192, 2048, 5632, 8),
        gmm=[256, 2048, 2816],
        gmm_t=[512, 5632, 1024],
        tgmm=[128, 1024, 5632],
    )
    with mock.patch.object(gmm_tiling, "load_table", return_value=(entry,)):
      turned = gmm_tiling.choose_tiling(
          8192, 5632, 2048, 8, jnp.bfloat16, "v5e"
      )
      self.assertEqual(turned.source, "table")
      self.assertEqual(turned.gmm, (512, 5632, 1024))
      self.assertEqual(turned.gmm_t, (256, 2048, 2816))
      self.assertEqual(turned.tgmm, (128, 5632, 1024))
      pallas_grouped.check_tiling(turned, 5632, 2048)
      self.assertEqual(
          gmm_tiling.fastest_implementation(
              8192, 5632, 2048, 8, jnp.bfloat16, "v5e"
          ),
          "kernel",
      )
    # An entry of the problem itself wins over a turned one.
    own = dict(_entry(8192, 5632, 2048, 8), gmm=[128, 5632, 2048])
    table = (entry, own)
    with mock.patch.object(gmm_tiling, "load_table", return_value=table):
      self.assertEqual(
          gmm_tiling.choose_tiling(
              8192, 5632, 2048, 8, jnp.bfloat16, "v5e"
          ).gmm,
          (128, 5632, 2048),
      )

  def test_raised_vmem_limit_is_most_of_the_chips_vmem(self):
    # 0.85 of the chip's VMEM (the rest Mosaic's own); the table's big
    # tiles ask for exactly this.
    for chip in ("v5e", "v5p"):
      vmem = gmm_tiling.CHIPS[chip].vmem_bytes
      self.assertEqual(gmm_tiling.raised_vmem_limit(chip), int(0.85 * vmem))
    big = gmm_tiling.choose_tiling(32768, 4096, 14336, 8, jnp.bfloat16, "v5e")
    self.assertEqual(big.vmem_limit_bytes, gmm_tiling.raised_vmem_limit("v5e"))
    self.assertEqual(
        gmm_tiling.raised_vmem_limit(),
        gmm_tiling.raised_vmem_limit(gmm_tiling.DEFAULT_CHIP),
    )

  @parameterized.parameters(*SHAPES)
  def test_rule_picks_tiles_that_divide_and_fit(self, m, k, n, g):
    for chip in ("v5e", "v5p"):
      tiling = gmm_tiling.rule_tiling(m, k, n, g, jnp.bfloat16, chip)
      pallas_grouped.check_tiling(tiling, k, n)
      vmem = gmm_tiling.CHIPS[chip].vmem_bytes
      self.assertLess(tiling.vmem_limit_bytes or 0, vmem)
      for op in gmm_tiling.OPS:
        self.assertIn(
            getattr(tiling, op),
            gmm_tiling.candidates(op, m, k, n, jnp.bfloat16, chip),
        )

  def test_chip_names(self):
    self.assertEqual(tpu_chips.tpu_chip_name("TPU v5 lite"), "v5e")
    self.assertEqual(tpu_chips.tpu_chip_name("TPU v5p"), "v5p")
    self.assertIsNone(tpu_chips.tpu_chip_name("cpu"))
    with jax.sharding.use_abstract_mesh(_tpu_mesh("TPU v6 lite")):
      self.assertEqual(gmm_tiling.current_chip(), "v6e")


class AutoOnTpuTest(parameterized.TestCase):

  @parameterized.parameters(("kernel", "kernel"), ("ragged_dot", "ragged_dot"))
  def test_auto_follows_the_table(self, fastest, want):
    table = (_entry(8192, 2048, 5632, 8, fastest),)
    shape = (8192, 2048, 5632, 8)
    with (
        mock.patch.object(gmm_tiling, "load_table", return_value=table),
        jax.sharding.use_abstract_mesh(_tpu_mesh()),
    ):
      bf16 = (jnp.bfloat16, jnp.bfloat16)
      got = gmm_lib.resolve_implementation("auto", "tpu", bf16, shape)
      self.assertEqual(got, want)
      # Not measured: other dims, an unknown shape, int8 operands.
      for dtypes, other in (
          (bf16, (8192, 2048, 768, 8)),
          (bf16, None),
          ((jnp.int8, jnp.int8), shape),
      ):
        got = gmm_lib.resolve_implementation("auto", "tpu", dtypes, other)
        self.assertEqual(got, "ragged_dot")

  def test_kernel_on_tpu_is_ours(self):
    kernel, _ = accelerator.find_kernel("tpu")
    self.assertEqual(kernel.name, "pallas gmm")


class LayerWithPallasTest(test_kernels.LayerKernelChecks):
  """The sparse layer's forward and gradients with every grouped matmul on
  the Pallas kernels (interpreted) equal those with ragged_dot."""

  def _check_layer_pairing(self, paired: bool):
    with (
        accelerator.paired_gate_up(paired),
        mock.patch.object(
            pallas_gate_up,
            "paired_grouped_matmul",
            wraps=pallas_gate_up.paired_grouped_matmul,
        ) as pairs,
    ):
      self.check_layer("none", "pallas")
    self.assertEqual(pairs.called, paired)

  def test_sparse_layer(self):
    # The gate and up projections as two calls each way.
    self._check_layer_pairing(False)

  def test_sparse_layer_with_the_paired_gate_up(self):
    # Its gate and up projections run as one call each way.
    self._check_layer_pairing(True)

  def test_paired_gate_up_where_the_pallas_kernel_runs(self):
    shape, floats = (64, 128, 128, 4), (jnp.bfloat16, jnp.bfloat16)
    with testing.kernels_on_cpu("pallas"):
      self.assertIsNotNone(gmm_lib.paired_kernel("kernel", floats, shape))
      self.assertIsNone(gmm_lib.paired_kernel("auto", floats, shape))  # CPU
      with accelerator.paired_gate_up(False):
        self.assertIsNone(gmm_lib.paired_kernel("kernel", floats, shape))
        with accelerator.paired_gate_up():
          self.assertIsNotNone(gmm_lib.paired_kernel("kernel", floats, shape))
        self.assertIsNone(gmm_lib.paired_kernel("kernel", floats, shape))
      self.assertIsNotNone(gmm_lib.paired_kernel("kernel", floats, shape))
    with testing.kernels_on_cpu("megablox"):
      self.assertIsNone(gmm_lib.paired_kernel("kernel", floats, shape))

  def test_paired_gate_up_takes_a_bool(self):
    with self.assertRaisesRegex(TypeError, "on=True or False; got 'no'"):
      with accelerator.paired_gate_up("no"):
        pass
    self.assertTrue(accelerator.pairs_gate_up())

  def test_int8_layer_reaches_the_kernel(self):
    # The int8 mode's forward and dlhs contractions run the int8 kernel
    # (no fallback to ragged_dot), with the same numbers.
    y, grads, fallbacks = test_kernels._layer_step("int8", "kernel", "pallas")
    want_y, want_grads = test_kernels._reference_step("int8")
    self.assertEqual(fallbacks, [])
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    for got, want in zip(
        jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True
    ):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def test_grouped_matmul_kernel_runs_ours(self):
    lhs = jnp.ones((40, 128))
    rhs = jnp.ones((3, 128, 128))
    sizes = jnp.array([10, 0, 25], jnp.int32)
    with (
        testing.kernels_on_cpu("pallas"),
        mock.patch.object(
            pallas_grouped,
            "pallas_grouped_matmul",
            wraps=pallas_grouped.pallas_grouped_matmul,
        ) as called,
    ):
      got = gmm_lib.grouped_matmul(lhs, rhs, sizes, implementation="kernel")
    self.assertTrue(called.called)
    np.testing.assert_array_equal(got, jax.lax.ragged_dot(lhs, rhs, sizes))


@absltest.skipUnless(
    targets.libtpu_available(),
    "needs libtpu to compile for a TPU: pip install '.[tpu-plan]'",
)
class CompileForTpuTest(absltest.TestCase):
  """Mosaic accepts the kernels, forward + backward, for a TPU v5e: the
  interpret-mode tests' problems with their tiles (float32, bfloat16), an
  issue shape with the package's tiles, and there the int8 kernel with its
  scales; each compiled program counts the useful FLOPs (plus the visit
  schedule's few). Skipped
  without libtpu (benchmarks/device/compile_gmm.py compiles every tile a
  sweep would time)."""

  def test_compiles_with_the_useful_flops(self):
    proc = workers.run("tests.gmm_tpu_worker", "tpu:v5e-1")
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    self.assertLen(result, 9)
    for name, got in result.items():
      extra = got["flops"] - got["useful"]  # the schedule's cumulative sums
      self.assertBetween(extra, 0, max(1e-5 * got["useful"], 1e4), name)


if __name__ == "__main__":
  absltest.main()
