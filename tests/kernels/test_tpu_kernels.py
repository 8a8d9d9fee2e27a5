"""The Pallas TPU grouped matmul (`pallas_grouped`), run in Pallas interpret
mode on this CPU: forward, input gradient and weight gradient against
`jax.lax.ragged_dot` and the NumPy row loop, its visit schedule against a
NumPy one, and each bad input's error.

Imports only jax, NumPy and absl (no flax): the same file runs where only
jax is installed (the chip's jax 0.10.2), as `python -m
tests.kernels.test_tpu_kernels`. Interpret mode compiles slowly (about 1.5 s a
kernel here): the shapes are tiny, each problem is one program, and the
grid over dtypes x tilings is slow. On a TPU, `test_on_tpu` runs the same
problems compiled by Mosaic (benchmarks/device/one_chip.sh gmm).
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.kernels.tpu import gmm_schedule
from linen_moe._src.kernels.tpu import pallas_grouped
from linen_moe._src.kernels.tpu import pallas_int8
from linen_moe._src.kernels.tpu.gmm_tiling import GmmTiling
from linen_moe.testing import slow
from tests import gmm_cases
from tests import numpy_reference

# (M, K, N, group sizes, tiling). Row tiles of 16 with M = 72: the last
# tile is partial; contraction tiles of 128 with K = 384: three of them, the
# accumulator path.
# "ragged": empty groups (1, 4), a group of one row (3), groups straddling
# tiles, and 72 - 53 = 19 rows past the total (outputs and dlhs zero).
# "skewed": one group with half the rows, others none, no rows left over.
# "whole": dimensions no multiple of 128 (one tile each), a 32-row tile over
# 48 rows, a single group holding every row.
_T16 = GmmTiling(gmm=(16, 128, 128), gmm_t=(16, 128, 128), tgmm=(16, 128, 128))
PROBLEMS = {
    "ragged": (72, 384, 128, (5, 0, 17, 1, 0, 30), _T16),
    "skewed": (64, 128, 256, (0, 32, 0, 9, 0, 23), _T16),
    # 256-row tiles multiplied in 128-row sub-blocks where a group holds
    # part of a tile: group 0 only the first sub-block of tile 0, group 2
    # across the boundary, group 3 the second sub-block and on into tile 1;
    # K = 256 in two contraction tiles (the accumulator), rows past the
    # total (513 of 640), a partial last tile.
    "split": (
        640,
        256,
        128,
        (100, 0, 60, 200, 3, 150),
        GmmTiling(
            gmm=(256, 128, 128), gmm_t=(256, 128, 128), tgmm=(256, 128, 128)
        ),
    ),
    "whole": (
        48,
        24,
        40,
        (0, 48, 0),
        GmmTiling(gmm=(32, 24, 40), gmm_t=(32, 40, 24), tgmm=(32, 24, 40)),
    ),
}
TOLERANCE = {
    # Sums of up to 256 products of O(1) terms, float32 throughout.
    jnp.float32: dict(rtol=1e-5, atol=1e-4),
    # bf16 outputs and gradients (8 bits of mantissa), float32 accumulation.
    jnp.bfloat16: dict(rtol=2e-2, atol=0.25),
}


_operands = gmm_cases.operands
_fwd_bwd = gmm_cases.fwd_bwd


ON_TPU = jax.default_backend() == "tpu"


def _pallas(tiling, interpret=True):
  def matmul(lhs, rhs, sizes):
    return pallas_grouped.pallas_grouped_matmul(
        lhs, rhs, sizes, tiling=tiling, interpret=interpret
    )

  return matmul


class PallasGroupedMatmulTest(parameterized.TestCase):

  def check(self, name, dtype, interpret=True):
    m, k, n, sizes, tiling = PROBLEMS[name]
    operands = _operands(m, k, n, sizes, dtype)
    matmul = _pallas(tiling, interpret)
    got = jax.jit(lambda *a: _fwd_bwd(matmul, *a))(*operands)
    # A TPU's float32 dots run in bf16 passes unless asked for float32; a
    # TPU takes that precision of float32 operands only (bf16 ones are
    # widened: their products are exact in float32).
    lhs, rhs, sizes, dout = operands
    wide = [x.astype(jnp.float32) for x in (lhs, rhs)]
    with jax.default_matmul_precision("float32"):
      want = jax.jit(lambda *a: _fwd_bwd(lax.ragged_dot, *a))(
          *wide, sizes, dout.astype(jnp.float32)
      )
    oracle = numpy_reference.grouped_matmul(lhs, rhs, sizes, dout)
    for what, g, w, o, like in zip(
        ("out", "dlhs", "drhs"), got, want, oracle, (lhs, lhs, rhs), strict=True
    ):
      self.assertEqual(g.dtype, like.dtype, what)
      g64 = np.asarray(g, np.float64)
      bad = np.argwhere(~np.isfinite(g64))
      self.assertEqual(bad.size, 0, f"{what}: not finite at {bad[:8].tolist()}")
      tol = TOLERANCE[dtype]
      # On a TPU (jax 0.10.2), ragged_dot leaves the rows past the groups'
      # total unwritten (garbage, NaN): it is compared on the groups' rows,
      # the NumPy oracle on every row.
      rows = slice(None) if what == "drhs" else slice(int(np.sum(sizes)))
      np.testing.assert_allclose(
          g64[rows], np.asarray(w, np.float64)[rows], err_msg=what, **tol
      )
      np.testing.assert_allclose(g64, o, err_msg=what, **tol)
    out, dlhs, drhs = (np.asarray(x) for x in got)
    total = int(np.sum(sizes))
    np.testing.assert_array_equal(out[total:], 0, "rows past the total")
    np.testing.assert_array_equal(dlhs[total:], 0, "rows past the total")
    np.testing.assert_array_equal(drhs[np.asarray(sizes) == 0], 0, "empty")

  @parameterized.parameters(
      ("ragged", jnp.float32),
      ("skewed", jnp.bfloat16),
      ("whole", jnp.float32),
      ("split", jnp.float32),
  )
  def test_equals_ragged_dot_and_numpy(self, name, dtype):
    self.check(name, dtype)

  @slow
  @parameterized.product(
      name=tuple(PROBLEMS), dtype=(jnp.float32, jnp.bfloat16)
  )
  def test_every_problem_and_dtype(self, name, dtype):
    self.check(name, dtype)

  @absltest.skipUnless(ON_TPU, "compiles the kernels for the TPU it runs on")
  @parameterized.product(
      name=tuple(PROBLEMS), dtype=(jnp.float32, jnp.bfloat16)
  )
  def test_on_tpu(self, name, dtype):
    self.check(name, dtype, interpret=False)

  def test_mixed_dtypes_and_float32_output(self):
    # bf16 activations times float32 weights: the product runs in float32.
    m, k, n, sizes, tiling = PROBLEMS["whole"]
    lhs, rhs, sizes, _ = _operands(m, k, n, sizes, jnp.float32)
    lhs = lhs.astype(jnp.bfloat16)
    got = pallas_grouped.pallas_grouped_matmul(
        lhs, rhs, sizes, jnp.float32, tiling=tiling, interpret=True
    )
    want = lax.ragged_dot(lhs.astype(jnp.float32), rhs, sizes)
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_allclose(got, want, **TOLERANCE[jnp.float32])

  def test_default_tiles_and_empty_dimensions(self):
    lhs, rhs, sizes, _ = _operands(40, 128, 128, (10, 0, 30), jnp.float32)
    got = pallas_grouped.pallas_grouped_matmul(lhs, rhs, sizes, interpret=True)
    np.testing.assert_allclose(
        got, lax.ragged_dot(lhs, rhs, sizes), **TOLERANCE[jnp.float32]
    )
    empty = pallas_grouped.pallas_grouped_matmul(
        jnp.zeros((0, 8)), jnp.zeros((2, 8, 4)), jnp.array([0, 0])
    )
    self.assertEqual(empty.shape, (0, 4))


def _int8_case(m, c, o, sizes, transpose_rhs, seed=1):
  """q_lhs <int8>[M, C], lhs_scale [M, 1], q_rhs <int8>[G, C, O] (or
  [G, O, C]), rhs_scale [G, 1, O], sizes."""
  keys = jax.random.split(jax.random.key(seed), 4)
  g = len(sizes)
  shape = (g, o, c) if transpose_rhs else (g, c, o)
  q_lhs = jax.random.randint(keys[0], (m, c), -127, 128, jnp.int8)
  q_rhs = jax.random.randint(keys[1], shape, -127, 128, jnp.int8)
  lhs_scale = jax.random.uniform(keys[2], (m, 1), minval=0.01, maxval=0.1)
  rhs_scale = jax.random.uniform(keys[3], (g, 1, o), minval=0.01, maxval=0.1)
  return q_lhs, lhs_scale, q_rhs, rhs_scale, jnp.array(sizes, jnp.int32)


def _int8_numpy(q_lhs, lhs_scale, q_rhs, rhs_scale, sizes, transpose_rhs):
  """Row by row: float32(exact integer sum) * lhs_scale * rhs_scale."""
  q_lhs, q_rhs = np.asarray(q_lhs, np.int64), np.asarray(q_rhs, np.int64)
  if transpose_rhs:
    q_rhs = q_rhs.transpose(0, 2, 1)
  lhs_scale, rhs_scale = np.asarray(lhs_scale), np.asarray(rhs_scale)
  out = np.zeros((q_lhs.shape[0], q_rhs.shape[2]), np.float32)
  row = 0
  for g, size in enumerate(np.asarray(sizes)):
    for r in range(row, row + size):
      acc = (q_lhs[r] @ q_rhs[g]).astype(np.float32)
      out[r] = acc * lhs_scale[r] * rhs_scale[g, 0]
    row += size
  return out


class Int8ScaledTest(parameterized.TestCase):
  """int8 operands, int32 sums, the scales in the kernel's epilogue: equal,
  bit for bit, to a NumPy row loop (and so to int8_grouped's ragged_dot
  path, which computes the same float32 products in the same order)."""

  _T32 = GmmTiling(
      gmm=(32, 128, 128), gmm_t=(32, 128, 128), tgmm=(32, 128, 128)
  )

  def check(self, transpose_rhs, interpret=True):
    # 72 rows: a partial last 32-row tile; 3 contraction tiles; 19 rows past
    # the total; empty groups and a one-row group.
    case = _int8_case(72, 384, 128, (5, 0, 17, 1, 0, 30), transpose_rhs)
    got = pallas_int8.int8_grouped_matmul_scaled(
        *case,
        transpose_rhs=transpose_rhs,
        tiling=self._T32,
        interpret=interpret,
    )
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_array_equal(got, _int8_numpy(*case, transpose_rhs))

  @parameterized.parameters(False, True)
  def test_equals_numpy(self, transpose_rhs):
    self.check(transpose_rhs)

  @absltest.skipUnless(ON_TPU, "compiles the kernel for the TPU it runs on")
  @parameterized.parameters(False, True)
  def test_on_tpu(self, transpose_rhs):
    self.check(transpose_rhs, interpret=False)

  @parameterized.named_parameters(
      ("float_lhs", 0, jnp.float32, TypeError, "q_lhs has dtype float32"),
      ("bf16_scale", 1, jnp.bfloat16, TypeError, "lhs_scale has dtype bf"),
      (
          "scale_shape",
          3,
          (4, 1, 128),
          ValueError,
          r"rhs_scale must have shape \(6, 1, 128\)",
      ),
  )
  def test_bad_operands(self, index, change, error, message):
    case = list(_int8_case(72, 128, 128, (5, 0, 17, 1, 0, 30), False))
    if isinstance(change, tuple):
      case[index] = jnp.ones(change, jnp.float32)
    else:
      case[index] = case[index].astype(change)
    with self.assertRaisesRegex(error, message):
      pallas_int8.int8_grouped_matmul_scaled(*case, interpret=True)

  def test_int8_row_tiles_are_multiples_of_32(self):
    case = _int8_case(72, 128, 128, (5, 0, 17, 1, 0, 30), False)
    with self.assertRaisesRegex(
        ValueError, "row tile 16 must be a multiple of 32"
    ):
      pallas_int8.int8_grouped_matmul_scaled(*case, tiling=_T16, interpret=True)


def _numpy_visits(sizes, m, tm, fill_tail, visit_empty):
  """[(group, tile, computes)] in order: each group's tiles, G for tails."""
  visits, row = [], 0
  for g, size in enumerate(sizes):
    end = min(row + max(size, 0), m)
    if end > row:
      visits += [(g, t, 1) for t in range(row // tm, (end - 1) // tm + 1)]
    elif visit_empty:
      visits.append((g, min(row // tm, -(-m // tm) - 1), 0))
    row = end
  if fill_tail:
    visits += [(len(sizes), t, 0) for t in range(-(-row // tm), -(-m // tm))]
  return visits


class ScheduleTest(parameterized.TestCase):

  @parameterized.product(
      sizes=(
          (5, 0, 17, 1, 0, 30),
          (0, 0, 0),
          (16, 16, 16, 16),
          (3, -2, 40, 50),  # negative counts as 0; rows past M dropped
      ),
      tm=(16, 48),
      mode=((True, False), (False, True)),
  )
  def test_visits_equal_a_numpy_loop(self, sizes, tm, mode):
    m = 64
    build = jax.jit(
        gmm_schedule.build,
        static_argnums=(1, 2),
        static_argnames=("fill_tail", "visit_empty"),
    )
    schedule = jax.device_get(
        build(jnp.array(sizes), m, tm, fill_tail=mode[0], visit_empty=mode[1])
    )
    count = int(schedule.num_visits)
    got = list(
        zip(
            schedule.group[:count].tolist(),
            schedule.tile[:count].tolist(),
            schedule.compute[:count].tolist(),
            strict=True,
        )
    )
    self.assertEqual(got, _numpy_visits(sizes, m, tm, *mode))
    self.assertLessEqual(count, gmm_schedule.max_visits(m, tm, len(sizes)))
    # A visit without a matmul reads what the last one with a matmul read.
    for i in range(count):
      source = max((j for j in range(i + 1) if got[j][2]), default=0)
      self.assertEqual(int(schedule.read_tile[i]), got[source][1])


class BadInputTest(parameterized.TestCase):
  """One error each, before any work, naming the argument and the value."""

  def call(self, lhs=(32, 128), rhs=(2, 128, 128), sizes=None, **kw):
    def make(x, dtype=jnp.float32):
      return jnp.zeros(x, dtype) if isinstance(x, tuple) else x

    sizes = jnp.array([16, 16]) if sizes is None else make(sizes, jnp.int32)
    pallas_grouped.pallas_grouped_matmul(
        make(lhs), make(rhs), sizes, interpret=True, **kw
    )

  @parameterized.named_parameters(
      (
          "sum_past_rows",
          dict(sizes=jnp.array([20, 13])),
          "sum to 33, past the 32 rows",
      ),
      (
          "negative",
          dict(sizes=jnp.array([-1, 3])),
          r"must be >= 0; got \[-1, 3\]",
      ),
      ("lhs_rank", dict(lhs=(32,)), r"lhs \[M, K\] must have rank 2.*\(32,\)"),
      (
          "rhs_k",
          dict(rhs=(2, 64, 128)),
          (
              r"rhs \[G, K, N\] must have rank 3 and the same K.*128.*\(2, 64,"
              r" 128\)"
          ),
      ),
      (
          "sizes_shape",
          dict(sizes=(3,)),
          r"group_sizes must have shape \[G\] = \(2,\).*\(3,\)",
      ),
      (
          "tile_divides",
          dict(tiling=GmmTiling((16, 128, 128), (16, 128, 128), (16, 96, 128))),
          "tiling.tgmm contraction tile 96 must divide 128",
      ),
      (
          "tile_rows",
          dict(
              tiling=GmmTiling((24, 128, 128), (16, 128, 128), (16, 128, 128))
          ),
          "tiling.gmm row tile 24 must be a multiple of 16",
      ),
      (
          "tile_ints",
          dict(tiling=GmmTiling((16, 128), (16, 128, 128), (16, 128, 128))),
          "tiling.gmm must be 3 positive ints",
      ),
  )
  def test_value_errors(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      self.call(**kwargs)

  @parameterized.named_parameters(
      (
          "lhs_int8",
          dict(lhs=jnp.zeros((32, 128), jnp.int8)),
          "lhs has dtype int8.*float32, bfloat16",
      ),
      (
          "rhs_f16",
          dict(rhs=jnp.zeros((2, 128, 128), jnp.float16)),
          "rhs has dtype float16",
      ),
      (
          "sizes_float",
          dict(sizes=jnp.array([16.0, 16.0])),
          "group_sizes must be integers.*float32",
      ),
      (
          "out_int",
          dict(preferred_element_type=jnp.int32),
          "preferred_element_type=int32",
      ),
  )
  def test_type_errors(self, kwargs, message):
    with self.assertRaisesRegex(TypeError, message):
      self.call(**kwargs)

  def test_traced_sizes_are_not_checked_but_stay_in_bounds(self):
    # Under jit the sizes are unknown: a sum past M drops the rows past M,
    # as ragged_dot does (and a negative size counts as 0).
    lhs, rhs, _, _ = _operands(32, 128, 128, (0, 0), jnp.float32)
    sizes = jnp.array([20, 13], jnp.int32)
    got = jax.jit(_pallas(_T16))(lhs, rhs, sizes)
    np.testing.assert_allclose(
        got, lax.ragged_dot(lhs, rhs, sizes), **TOLERANCE[jnp.float32]
    )


if __name__ == "__main__":
  absltest.main()
