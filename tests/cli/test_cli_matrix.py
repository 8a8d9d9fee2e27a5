"""`linen-moe matrix`: every quantization x path cell trains, really
quantized, in the Linen and the NNX decoder.

A cell compiles one train step, reads its HLO for the quantized types, runs
two steps and checks the loss is finite and falls on the batch, the params
moved and every fp8 call site's state moved and differs from the others'.
The default run holds one cell (NNX nanoo_fp8/sparse/unrolled); the Linen
cells (`test_cell_trains_slow`), the family cells and the full products are
slow. CI runs `linen-moe matrix` (every mode x path of tiny_mixtral, Linen)
on the installed wheel; `linen-moe matrix --all` is the whole product on
demand.
"""

import itertools

from absl.testing import absltest
from absl.testing import parameterized

from linen_moe import MATMUL_PATHS
from linen_moe import testing
from linen_moe.quantization import MODES
from linen_moe.testing import FAMILY_CONFIGS
from linen_moe_cli import matrix

# Each (quantization, path) cell once, rotating through the configs (each
# meets every path) and alternating the layer mode every len(CONFIGS) cells
# (each config meets both modes).
_N = len(matrix.CONFIGS)
_DEFAULT = [
    (matrix.CONFIGS[i % _N], quant, path, matrix.LAYERS[(i // _N) % 2])
    for i, (quant, path) in enumerate(
        itertools.product(tuple(MODES), MATMUL_PATHS)
    )
]

# (config, quantization, path, layers) of NNX cells: the last in the
# default run, the others slow.
_NNX_DEFAULT = (
    ("tiny_mixtral", "fp8", "dense_dropping", "scanned"),
    ("tiny_mixtral", "int8", "sparse", "unrolled"),
    ("tiny_gemma4_26b", "none", "dense", "scanned"),
    ("tiny_gemma4_26b", "nanoo_fp8", "sparse", "unrolled"),
)


def _check(test, cell):
  result = matrix.run_cell(cell)
  test.assertTrue(result.ok, f"{cell}: {result.error}")
  test.assertEqual(
      result.quantized_types, matrix.EXPECTED_TYPES[cell.quantization]
  )


class MatrixTest(parameterized.TestCase):

  def test_cell_trains(self):
    _check(self, matrix.Cell(*_NNX_DEFAULT[3], "nnx"))  # nanoo_fp8, unrolled

  # The Linen cells are slow here: CI runs the twelve of `linen-moe matrix`
  # on the installed wheel, and the layer's train step in every mode on
  # every path, its quantized types read from the compiled step, is
  # test_quantization's default run.
  @testing.slow
  @parameterized.parameters(
      *((*cell, "linen") for cell in _DEFAULT),
      *((*cell, "nnx") for cell in _NNX_DEFAULT[:3]),
  )
  def test_cell_trains_slow(self, config, quant, path, layers, frontend):
    _check(self, matrix.Cell(config, quant, path, layers, frontend))

  @testing.slow
  @parameterized.product(
      config=matrix.CONFIGS,
      quant=tuple(MODES),
      path=tuple(MATMUL_PATHS),
      layers=matrix.LAYERS,
      frontend=matrix.FRONTENDS,
  )
  def test_full_product(self, config, quant, path, layers, frontend):
    _check(self, matrix.Cell(config, quant, path, layers, frontend))


class FamilyMatrixTest(parameterized.TestCase):
  """The whole-model families (tiny DeepSeek-V3 with MLA, tiny Gemma-4) on
  their matrix cells, slow: by default a cell's mechanics are
  `MatrixTest`'s, MLA trains in test_hf_family_files.FineTuneTest and
  Gemma-4 in test_decoder.TrainStepTest; every mode of both is
  `FamilyMatrixFullTest`."""

  @testing.slow
  def test_cell_trains(self):
    self.check("tiny_gemma4_text", "int8")

  @testing.slow
  def test_mla_cell_trains(self):
    self.check("tiny_deepseek_v3_mla", "fp8")

  def check(self, config, quant):
    path, layers, fe = matrix.FAMILY_CELLS[config]
    _check(self, matrix.Cell(config, quant, path, layers, fe))

  def test_every_family_has_its_cells(self):
    self.assertEqual(tuple(matrix.FAMILY_CELLS), FAMILY_CONFIGS)


@testing.slow
class FamilyMatrixFullTest(parameterized.TestCase):

  @parameterized.parameters(*[c for g in matrix.family_cells() for c in g])
  def test_cell_trains(self, cell):
    _check(self, cell)


@testing.slow  # a whole cell's compile to see a check fail
class MatrixChecksCanFailTest(absltest.TestCase):

  def test_missing_quantized_types_fail_the_cell(self):
    # A cell that claims int8 but whose step holds no s8 must fail.
    saved = matrix.EXPECTED_TYPES
    matrix.EXPECTED_TYPES = {**saved, "none": frozenset({"s8"})}
    try:
      result = matrix.run_cell(matrix.Cell("tiny_mixtral", "none", "dense"))
    finally:
      matrix.EXPECTED_TYPES = saved
    self.assertFalse(result.ok)
    self.assertIn("lacks quantized types ['s8']", result.error)


if __name__ == "__main__":
  absltest.main()
