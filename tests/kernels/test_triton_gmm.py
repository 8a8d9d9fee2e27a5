"""Our Pallas-Triton grouped matmul (`gpu/triton_grouped`), run in Pallas
interpret mode on this CPU: forward, input gradient and weight gradient
against the float64 NumPy row loop, its work items against a NumPy
schedule, each bad input's error, and its kernels lowered to Triton for an
H200 (the Pallas -> Triton IR step of a GPU compile, which needs no GPU).

Interpret mode is slow (a few seconds a problem here): the default run
holds two tiny problems, the rest are `slow`. On a GPU, `test_on_gpu`
runs the same problems compiled by Triton (the GPU run's `tests` step,
`-k on_gpu`).
"""

from __future__ import annotations

import functools
import re
from unittest import mock
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax._src import mesh as mesh_lib
import jax.numpy as jnp
import numpy as np

from linen_moe._src.kernels.gpu import triton_gmm
from linen_moe._src.kernels.gpu import triton_grouped
from linen_moe._src.kernels.gpu.triton_tiles import Tiles
from linen_moe._src.kernels.gpu.triton_tiles import Tiling
from linen_moe.testing import slow
from tests import gmm_cases
from tests import numpy_reference

# 16-row, 16-column tiles and 16-deep K steps: many row tiles straddle a
# group boundary, and K and N (40, 24) take partial tiles.
_SMALL = Tiles(block_m=16, block_n=16, block_k=16, group_m=2)
SMALL = Tiling(gmm=_SMALL, gmm_t=_SMALL, tgmm=_SMALL)
# (M, K, N, group sizes). "ragged": groups 1 and 3 empty, group 0 one row,
# sizes skewed (50 against 5), 72 - 56 = 16 rows past the total, K and N no
# multiple of a tile. "straddle": every group but the last starts inside a
# row tile, 2 rows past the total inside the last tile. "none": no rows in
# any group (all zeros; every drhs zero). "whole": one group holds every
# row, no tail. Traced (under `jit`) sizes are not checked: "past_m" sums
# past M (the rows past M dropped), "negative" has a size < 0 (counted as
# 0), as `jax.lax.ragged_dot` does and the NumPy loop reads them.
PROBLEMS = {
    "ragged": (72, 40, 24, (1, 0, 50, 0, 5)),
    "straddle": (50, 32, 16, (7, 9, 1, 31)),
    "none": (24, 16, 16, (0, 0, 0)),
    "whole": (40, 24, 40, (0, 40)),
    "past_m": (40, 16, 24, (3, 100, 5)),
    "negative": (24, 16, 16, (-3, 10, 5)),
}
# The default run: two problems, each in one dtype (the conformance class
# runs "ragged" in float32 with the default tiles); `slow` runs them all.
DEFAULT_RUN = (("ragged", "bfloat16"), ("straddle", "float32"))
# The float32 product is IEEE float32 (no TF32), accumulated in float32.
F32_TOLERANCE = dict(rtol=1e-5, atol=1e-4)


def _bf16_tolerance(k_like: int) -> dict:
  """Outputs rounded to bfloat16 (2^-8 relative) of sums of `k_like`
  unit-normal products (magnitude ~ sqrt(k_like))."""
  return dict(rtol=2e-2, atol=2e-2 * np.sqrt(k_like))


def _check(test, problem, dtype, tiling, interpret=True):
  m, k, n, sizes = problem
  lhs, rhs, group_sizes, dout = gmm_cases.operands(m, k, n, sizes, dtype)
  matmul = functools.partial(
      triton_grouped.triton_grouped_matmul, tiling=tiling, interpret=interpret
  )
  got = jax.jit(functools.partial(gmm_cases.fwd_bwd, matmul))(
      lhs, rhs, group_sizes, dout
  )
  want = numpy_reference.grouped_matmul(lhs, rhs, sizes, dout)
  total = min(sum(max(s, 0) for s in sizes), m)
  for what, g, w, depth in zip(
      ("out", "dlhs", "drhs"), got, want, (k, n, m), strict=True
  ):
    test.assertEqual(g.dtype, dtype, what)
    tolerance = (
        F32_TOLERANCE if dtype == jnp.float32 else _bf16_tolerance(depth)
    )
    np.testing.assert_allclose(
        np.asarray(g, np.float64), w, err_msg=what, **tolerance
    )
  out, dlhs, drhs = (np.asarray(a, np.float64) for a in got)
  np.testing.assert_array_equal(out[total:], 0, "output past the total")
  np.testing.assert_array_equal(dlhs[total:], 0, "dlhs past the total")
  empty = np.asarray(sizes) <= 0
  np.testing.assert_array_equal(drhs[empty], 0, "an empty group's drhs")


def _numpy_items(sizes, m, tm):
  """The (segment, tile) pairs a schedule must cover: each group's (and
  the tail's) row tiles, in order; and each row's segment."""
  bounds = np.minimum(np.cumsum([0, *np.maximum(sizes, 0)]), m)
  bounds = [*bounds, m]  # the tail: [sum, M)
  items, owner = [], np.full(m, -1)
  for s in range(len(bounds) - 1):
    lo, hi = bounds[s], bounds[s + 1]
    owner[lo:hi] = s
    if hi > lo:
      items += [(s, t) for t in range(lo // tm, (hi - 1) // tm + 1)]
  return items, owner


class TritonGmmTest(parameterized.TestCase):

  @parameterized.parameters(*DEFAULT_RUN)
  def test_matches_numpy_loop(self, problem, dtype):
    _check(self, PROBLEMS[problem], jnp.dtype(dtype), SMALL)

  @slow
  @parameterized.product(
      problem=tuple(PROBLEMS),
      dtype=("float32", "bfloat16", "float16"),
      tiling=("small", "default"),
  )
  def test_matches_numpy_loop_everywhere(self, problem, dtype, tiling):
    tiling = SMALL if tiling == "small" else None
    _check(self, PROBLEMS[problem], jnp.dtype(dtype), tiling)

  @parameterized.parameters(
      ((1, 0, 50, 0, 5), 72, 16),
      ((7, 9, 1, 31), 50, 16),
      ((0, 0, 0), 24, 16),
      ((16, 16), 32, 16),
      ((3, 200, 5), 40, 16),  # past M under jit: rows past M dropped
      ((-4, 10, 3), 20, 8),  # negative under jit: counts as 0
      ((5,), 5, 128),
  )
  def test_work_items_cover_every_row_once(self, sizes, m, tm):
    segment, tile, starts, ends, count = jax.jit(
        triton_gmm.work_items, static_argnums=(1, 2)
    )(jnp.asarray(sizes, jnp.int32), m, tm)
    want, owner = _numpy_items(sizes, m, tm)
    count = int(count[0])
    got = list(
        zip(np.asarray(segment[:count]), np.asarray(tile[:count]), strict=True)
    )
    self.assertEqual([(int(s), int(t)) for s, t in got], want)
    self.assertEqual(segment.shape, (-(-m // tm) + len(sizes),))
    writes = np.zeros(m, int)
    for s, t in got:
      rows = np.arange(t * tm, min((t + 1) * tm, m))
      mine = rows[(rows >= starts[s]) & (rows < ends[s])]
      np.testing.assert_array_equal(owner[mine], s)
      writes[mine] += 1
    np.testing.assert_array_equal(writes, 1, "every row written once")

  @parameterized.parameters(("float32", 3), ("bfloat16", 0))
  def test_float32_products_are_ieee_not_tf32(self, dtype, highest):
    """Pallas-Triton multiplies float32 in TF32 unless asked for HIGHEST
    (IEEE): the three kernels' products ask for it in float32 only (a CPU
    computes float32 exactly either way, so the numbers cannot show it)."""
    lhs, rhs, sizes, dout = gmm_cases.operands(32, 16, 16, (10, 20), dtype)
    matmul = functools.partial(
        triton_grouped.triton_grouped_matmul, interpret=True
    )
    text = str(
        jax.make_jaxpr(functools.partial(gmm_cases.fwd_bwd, matmul))(
            lhs, rhs, sizes, dout
        )
    )
    self.assertEqual(text.count("dot_general"), 3)
    self.assertEqual(text.count("precision=(Precision.HIGHEST"), highest)

  def test_a_dtype_it_cannot_take_is_a_type_error(self):
    lhs, rhs = jnp.ones((8, 16), jnp.int8), jnp.ones((2, 16, 8), jnp.int8)
    sizes = jnp.asarray([3, 5], jnp.int32)
    with self.assertRaisesRegex(TypeError, "lhs has dtype int8; .*float32"):
      self._no_work(lhs, rhs, sizes)
    f32 = lhs.astype(jnp.float32)
    with self.assertRaisesRegex(TypeError, "rhs has dtype int8"):
      self._no_work(f32, rhs, sizes)
    with self.assertRaisesRegex(TypeError, "preferred_element_type=int32"):
      self._no_work(f32, rhs.astype(jnp.float32), sizes, jnp.int32)
    with self.assertRaisesRegex(TypeError, "group_sizes must be integers"):
      self._no_work(f32, rhs.astype(jnp.float32), sizes.astype(jnp.float32))

  def test_group_sizes_past_the_rows_are_a_value_error(self):
    lhs, rhs = jnp.ones((8, 16)), jnp.ones((2, 16, 8))
    with self.assertRaisesRegex(
        ValueError, "group_sizes sum to 9, past the 8 rows of lhs"
    ):
      self._no_work(lhs, rhs, jnp.asarray([4, 5], jnp.int32))
    with self.assertRaisesRegex(ValueError, "group_sizes must be >= 0"):
      self._no_work(lhs, rhs, jnp.asarray([-1, 5], jnp.int32))

  def test_wrong_ranks_and_shapes_are_value_errors(self):
    lhs, rhs = jnp.ones((8, 16)), jnp.ones((2, 16, 8))
    sizes = jnp.asarray([3, 5], jnp.int32)
    with self.assertRaisesRegex(ValueError, r"lhs \[M, K\] must have rank 2"):
      self._no_work(lhs[None], rhs, sizes)
    with self.assertRaisesRegex(ValueError, r"rhs \[G, K, N\] must have rank"):
      self._no_work(lhs, rhs[0], sizes)
    with self.assertRaisesRegex(ValueError, r"same K as lhs"):
      self._no_work(lhs, rhs[:, :8], sizes)
    with self.assertRaisesRegex(ValueError, r"group_sizes must have shape"):
      self._no_work(lhs, rhs, sizes[:1])

  def test_bad_tiles_are_value_errors(self):
    lhs, rhs = jnp.ones((8, 16)), jnp.ones((2, 16, 8))
    sizes = jnp.asarray([3, 5], jnp.int32)
    for tiling, message in (
        (Tiling(gmm=Tiles(block_m=24)), r"tiling.gmm.block_m must be a power"),
        (Tiling(tgmm=Tiles(block_k=8)), r"tiling.tgmm.block_k .* >= 16"),
        (Tiling(gmm_t=Tiles(num_warps=3)), r"tiling.gmm_t.num_warps"),
        (Tiling(gmm=Tiles(num_stages=0)), r"tiling.gmm.num_stages must be"),
        ((128, 128, 64), r"tiling must be a Tiling or None"),
    ):
      with self.assertRaisesRegex(ValueError, message):
        self._no_work(lhs, rhs, sizes, tiling=tiling)

  def _no_work(self, *args, **kwargs):
    """Calls the grouped matmul with the kernels replaced by a failure:
    the error must come before any kernel is traced."""
    fail = mock.Mock(side_effect=AssertionError("a kernel was traced"))
    with (
        mock.patch.object(triton_gmm, "gmm", fail),
        mock.patch.object(triton_gmm, "tgmm", fail),
    ):
      triton_grouped.triton_grouped_matmul(*args, interpret=True, **kwargs)

  # Launch grids with the default tiles at M, K, N, G = 512, 256, 384, 8:
  # gmm (cdiv(512, 128) + 8) items x 3 N tiles; gmm_t 12 x 2 K tiles; tgmm
  # 8 groups x K tiles x N tiles (128 x 128 blocks; 64 x 64 in float32).
  # At 72, 40, 24 every load and store is masked: 1 + 8 items x 1 tile.
  @parameterized.parameters(
      ("bfloat16", (512, 256, 384), (12 * 3, 12 * 2, 8 * 2 * 3)),
      ("float32", (512, 256, 384), (12 * 3, 12 * 2, 8 * 4 * 6)),
      ("bfloat16", (72, 40, 24), (9, 9, 8)),
  )
  def test_lowers_to_triton_for_an_h200(self, dtype, mkn, grids):
    """The three kernels of forward + backward go through Pallas' Triton
    lowering (every primitive has a Triton rule) for an H200 with the
    default (unmeasured) tiles, into Triton modules that pass MLIR's
    verifier (which Pallas does not run: an `scf.for` whose bounds differ
    in type lowers without it): three Triton custom calls, their grids."""
    from jax._src.pallas.triton import lowering  # noqa: PLC0415

    h200 = mesh_lib.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh(
        (1,),
        ("x",),
        axis_types=jax.sharding.AxisType.Auto,
        abstract_device=h200,
    )
    (m, k, n), g = mkn, 8
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype))  # noqa: E731
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    run = jax.jit(
        functools.partial(
            gmm_cases.fwd_bwd, triton_grouped.triton_grouped_matmul
        )
    )
    lower = lowering.lower_jaxpr_to_triton_module
    verified = []

    def lower_and_verify(*args, **kwargs):
      result = lower(*args, **kwargs)
      verified.append(result.module.operation.verify())
      return result

    with (
        jax.sharding.use_abstract_mesh(mesh),
        warnings.catch_warnings(),
        mock.patch.object(
            lowering, "lower_jaxpr_to_triton_module", lower_and_verify
        ),
    ):
      # jax 0.12 warns that Pallas' Triton backend is deprecated.
      warnings.simplefilter("ignore", DeprecationWarning)
      text = (
          run.trace(shape(m, k), shape(g, k, n), sizes, shape(m, n))
          .lower(lowering_platforms=("cuda",))
          .as_text()
      )
    self.assertEqual(verified, [True] * 3)
    self.assertEqual(text.count("custom_call @__gpu$xla.gpu.triton("), 3)
    got = sorted(int(x) for x in re.findall(r"grid_x = (\d+)", text))
    self.assertEqual(got, sorted(grids))

  def test_on_gpu(self):
    """On a GPU: the problems compiled by Triton, default tiles."""
    if jax.default_backend() != "gpu":
      self.skipTest("needs a GPU (compiled by Triton there)")
    for name, problem in PROBLEMS.items():
      for dtype in (jnp.float32, jnp.bfloat16):
        with self.subTest(problem=name, dtype=dtype.__name__):
          _check(self, problem, jnp.dtype(dtype), None, interpret=False)


if __name__ == "__main__":
  absltest.main()
