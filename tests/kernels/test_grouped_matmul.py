"""Tests for linen_moe.grouped_matmul: "blocked" against "ragged_dot" and NumPy."""

from __future__ import annotations

import functools
import math
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax._src import mesh as mesh_lib
import jax.numpy as jnp
import numpy as np

from linen_moe import KernelFallbackWarning
from linen_moe import testing
from linen_moe._src.kernels import accelerator
from linen_moe._src.kernels import blocked
from linen_moe._src.kernels import grouped_matmul as gmm_lib
from linen_moe._src.kernels import int8_grouped
from linen_moe._src.kernels import platform
from linen_moe._src.kernels import ragged_collectives
from linen_moe._src.kernels.tpu import pallas_int8
from tests import numpy_reference

try:
  import tokamax  # noqa: F401

  NO_TOKAMAX = None
except ImportError as e:  # the `kernels` extra is not installed
  NO_TOKAMAX = f"tokamax is not importable ({e}): pip install '.[kernels]'"

M, K, N = 96, 24, 40  # M > K, N: only a dense fallback reaches G * M * N


def _operands(num_groups, m=M, dtype=jnp.float32, seed=0):
  """lhs [m, K], rhs [G, K, N], cotangent [m, N]."""
  keys = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(keys[0], (m, K), dtype)
  rhs = jax.random.normal(keys[1], (num_groups, K, N), dtype)
  dout = jax.random.normal(keys[2], (m, N), dtype)
  return lhs, rhs, dout


def _fwd_bwd(matmul, group_sizes):
  """jit(lhs, rhs, dout -> (out, dlhs, drhs)) for matmul(lhs, rhs, sizes)."""

  def fwd_bwd(lhs, rhs, dout):
    out, vjp = jax.vjp(lambda x, w: matmul(x, w, group_sizes), lhs, rhs)
    return (out, *vjp(dout))

  return jax.jit(fwd_bwd)


def _blocked(block_rows=None, slot_rows=None, **kwargs):
  """ "blocked" with C = `slot_rows(M, G)` unless given: these problems are
  small enough that the default C would be M (`default_slot_rows`), and no
  row would reach the overflow tiles these tests are about."""

  def matmul(lhs, rhs, group_sizes):
    c = slot_rows
    if c is None:
      c = blocked.slot_rows(lhs.shape[0], rhs.shape[0])
    return blocked.blocked_grouped_matmul(
        lhs,
        rhs,
        group_sizes,
        block_rows_override=block_rows,
        slot_rows_override=c,
        **kwargs,
    )

  return matmul


def _assert_all_close(got, want, **tolerance):
  """(out, dlhs, drhs) against (out, dlhs, drhs)."""
  for name, g, w in zip(("out", "dlhs", "drhs"), got, want, strict=True):
    np.testing.assert_allclose(g, w, err_msg=name, **tolerance)


def _max_jaxpr_size(jaxpr) -> int:
  """Largest element count of any value in `jaxpr` and its sub-jaxprs."""
  sizes = [math.prod(v.aval.shape) for v in jaxpr.invars]
  for eqn in jaxpr.eqns:
    sizes += [math.prod(v.aval.shape) for v in eqn.outvars]
    for param in eqn.params.values():
      for item in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          sizes.append(_max_jaxpr_size(sub))
  return max(sizes, default=0)


def _max_hlo_size(compiled_text: str) -> int:
  """Largest element count of any array shape in compiled HLO text."""
  shapes = re.findall(r"\b(?:pred|[suf]\d+|bf16)\[([\d,]+)\]", compiled_text)
  return max(math.prod(int(d) for d in s.split(",")) for s in shapes)


class BlockedMatchesRaggedDotTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("empty_groups", [13, 0, 37, 20, 0, 5, 21, 0], 16),
      ("one_group_holds_all", [0, 0, 96, 0], 16),
      ("not_block_multiples", [7, 33, 1, 55], 8),
      ("trailing_rows", [20, 0, 31, 10], 16),
      ("single_group", [70], 32),
      ("no_rows", [0, 0, 0], 16),
      ("total_above_m", [50, 60, 40], 16),
      ("block_of_one_row", [30, 3, 0, 41], 1),
      ("block_of_all_rows", [30, 3, 0, 41], M),
      ("default_block_rows", [13, 0, 37, 20, 0, 5, 21, 0], None),
      # Slots: default C = 16 for 8 groups of M = 96, 32 for 4 groups.
      ("only_tiles", [13, 0, 37, 20, 0, 5, 21, 0], 16, 0),
      ("only_slots", [13, 0, 37, 20, 0, 5, 21, 0], 16, M),
      ("one_group_overflows", [0, 0, 96, 0], 8, 8),
      ("slots_of_one_row", [7, 33, 1, 55], 8, 1),
      ("overflow_past_m", [50, 60, 40], 16, 24),
  )
  def test_forward_and_gradients(self, sizes, block_rows, slot_rows=None):
    group_sizes = jnp.array(sizes, jnp.int32)
    lhs, rhs, dout = _operands(len(sizes))
    blocked = _blocked(block_rows, slot_rows)
    got = _fwd_bwd(blocked, group_sizes)(lhs, rhs, dout)
    want = _fwd_bwd(gmm_lib.ragged_dot, group_sizes)(lhs, rhs, dout)
    _assert_all_close(got, want, rtol=1e-5, atol=1e-5)

  def test_matches_numpy_loop(self):
    group_sizes = jnp.array([9, 0, 40, 1, 30], jnp.int32)  # 80 of 96 rows
    lhs, rhs, dout = _operands(5, seed=1)
    got = _fwd_bwd(_blocked(16), group_sizes)(lhs, rhs, dout)
    want = numpy_reference.grouped_matmul(lhs, rhs, group_sizes, dout)
    _assert_all_close(got, want, rtol=1e-5, atol=1e-4)

  def test_rows_past_total_are_zero_with_zero_gradient(self):
    group_sizes = jnp.array([10, 0, 25], jnp.int32)  # rows 35: are past
    lhs, rhs, dout = _operands(3)
    out, dlhs, _ = _fwd_bwd(_blocked(16), group_sizes)(lhs, rhs, dout)
    np.testing.assert_array_equal(out[35:], 0)
    np.testing.assert_array_equal(dlhs[35:], 0)
    self.assertGreater(float(jnp.abs(out[:35]).min()), 0)

  @parameterized.named_parameters(("bf16_out", None), ("f32_out", jnp.float32))
  def test_bfloat16(self, preferred):
    group_sizes = jnp.array([13, 0, 50, 20], jnp.int32)
    lhs, rhs, dout = _operands(4, dtype=jnp.bfloat16)
    if preferred is not None:
      dout = dout.astype(preferred)
    got = _fwd_bwd(_blocked(16, preferred_element_type=preferred), group_sizes)(
        lhs, rhs, dout
    )
    want = _fwd_bwd(
        functools.partial(gmm_lib.ragged_dot, preferred_element_type=preferred),
        group_sizes,
    )(lhs, rhs, dout)
    for name, g, w in zip(("out", "dlhs", "drhs"), got, want, strict=True):
      self.assertEqual(g.dtype, w.dtype, name)
      scale = float(jnp.abs(w.astype(jnp.float32)).max())
      np.testing.assert_allclose(
          g.astype(np.float32),
          w.astype(np.float32),
          atol=2e-2 * scale,
          err_msg=name,
      )

  def test_int8_accumulates_in_int32_exactly(self):
    rng = np.random.default_rng(0)
    lhs = rng.integers(-128, 128, (M, K), dtype=np.int8)
    rhs = rng.integers(-128, 128, (3, K, N), dtype=np.int8)
    sizes = np.array([40, 0, 45], np.int32)  # 11 trailing rows
    got = jax.jit(_blocked(16, preferred_element_type=jnp.int32))(
        lhs, rhs, sizes
    )
    want = np.zeros((M, N), np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for g in range(3):
      rows = slice(starts[g], starts[g + 1])
      want[rows] = lhs[rows].astype(np.int64) @ rhs[g].astype(np.int64)
    self.assertEqual(got.dtype, jnp.int32)
    np.testing.assert_array_equal(got, want)

  def test_grouped_matmul_dispatches_to_blocked(self):
    group_sizes = jnp.array([20, 0, 76], jnp.int32)
    lhs, rhs, _ = _operands(3)
    got = jax.jit(
        functools.partial(gmm_lib.grouped_matmul, implementation="blocked")
    )(lhs, rhs, group_sizes)
    want = gmm_lib.ragged_dot(lhs, rhs, group_sizes)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def test_zero_rows(self):
    lhs, rhs, _ = _operands(2, m=0)
    out = blocked.blocked_grouped_matmul(lhs, rhs, jnp.zeros(2, jnp.int32))
    self.assertEqual(out.shape, (0, N))


class NoDenseFallbackTest(absltest.TestCase):
  """The blocked forward+backward holds no [G, M, ...]-sized array."""

  def setUp(self):
    super().setUp()
    self.group_sizes = jnp.array([10, 30, 0, 40], jnp.int32)
    self.operands = _operands(4)
    self.limit = 4 * M * N  # G * M * N

  def _sizes(self, matmul):
    fwd_bwd = _fwd_bwd(matmul, self.group_sizes)
    jaxpr = jax.make_jaxpr(fwd_bwd)(*self.operands).jaxpr
    compiled = fwd_bwd.lower(*self.operands).compile().as_text()
    return _max_jaxpr_size(jaxpr), _max_hlo_size(compiled)

  def test_blocked_has_no_all_group_array(self):
    jaxpr_size, hlo_size = self._sizes(_blocked(16))
    self.assertLess(jaxpr_size, self.limit)
    self.assertLess(hlo_size, self.limit)
    # The largest values are the slots [G, C, K or N] (C = 32 here) and, in
    # the backward, drhs [G, K, N]; the walk reaches both.
    self.assertEqual(jaxpr_size, max(4 * 32 * max(K, N), 4 * K * N))
    jaxpr_size, _ = self._sizes(_blocked(16, slot_rows=0))
    self.assertEqual(jaxpr_size, 4 * K * N)

  def test_check_catches_a_dense_fallback(self):
    def dense_fallback(lhs, rhs, group_sizes):
      group_of_row = jnp.searchsorted(
          jnp.cumsum(group_sizes), jnp.arange(lhs.shape[0]), side="right"
      )
      all_groups = jnp.einsum("mk,gkn->gmn", lhs, rhs)  # [G, M, N]
      mask = jnp.arange(rhs.shape[0])[:, None] == group_of_row  # [G, M]
      return jnp.sum(jnp.where(mask[..., None], all_groups, 0), axis=0)

    jaxpr_size, hlo_size = self._sizes(dense_fallback)
    self.assertGreaterEqual(jaxpr_size, self.limit)
    self.assertGreaterEqual(hlo_size, self.limit)


class KernelSeamTest(parameterized.TestCase):
  """How implementations resolve; the kernels themselves are run in
  tests/kernels/test_kernels.py."""

  @parameterized.named_parameters(
      ("cpu_auto", "auto", "cpu", (), "blocked"),
      ("cpu_explicit", "ragged_dot", "cpu", (), "ragged_dot"),
      ("tpu_auto", "auto", "tpu", (jnp.float32,), "ragged_dot"),
      ("tpu_kernel", "kernel", "tpu", (jnp.float32,), "kernel"),
      ("tpu_auto_int8", "auto", "tpu", (jnp.int8,), "ragged_dot"),
      ("gpu_auto_int8", "auto", "gpu", (jnp.int8,), "blocked"),
      ("gpu_blocked", "blocked", "gpu", (), "blocked"),
  )
  def test_resolve(self, implementation, backend, dtypes, want):
    got = gmm_lib.resolve_implementation(implementation, backend, dtypes)
    self.assertEqual(got, want)

  def test_choices_follow_the_mesh_traced_for(self):
    # A plan traces on a CPU host under a mesh of a TPU topology: every
    # choice by platform must be the TPU's (it was the host's: blocked
    # grouped matmuls on float32 copies, emulated collectives).
    tpu = mesh_lib.AbstractDevice(
        device_kind="TPU v5p", num_cores=1, platform="tpu"
    )
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=jax.sharding.AxisType.Auto, abstract_device=tpu
    )
    lhs = jnp.ones((4, 8), jnp.bfloat16)
    self.assertEqual(platform.target_platform(), jax.default_backend())
    with jax.sharding.use_abstract_mesh(mesh):
      self.assertEqual(platform.target_platform(), "tpu")
      self.assertEqual(gmm_lib.resolve_implementation("auto"), "ragged_dot")
      a, b, acc = blocked.float32_accumulation(lhs, lhs)
      self.assertEqual(
          (a.dtype, b.dtype, acc), (lhs.dtype, lhs.dtype, jnp.float32)
      )
      self.assertFalse(ragged_collectives.needs_emulation())

  def test_int8_auto_takes_the_kernel_on_a_tpu_at_training_sizes(self):
    # Measured faster than XLA's int8 ragged_dot at 16,384 rows and up;
    # fewer (decoding) keep ragged_dot, and so does any other platform.
    tpu = mesh_lib.AbstractDevice(
        device_kind="TPU v5 lite", num_cores=1, platform="tpu"
    )
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=jax.sharding.AxisType.Auto, abstract_device=tpu
    )
    rows = accelerator.AUTO_INT8_MIN_ROWS
    self.assertEqual(rows, 16384)
    self.assertIsNone(accelerator.int8_kernel("auto", rows))
    with jax.sharding.use_abstract_mesh(mesh):
      got = accelerator.int8_kernel("auto", rows)
      self.assertIs(got.func, pallas_int8.int8_grouped_matmul_scaled)
      self.assertIsNotNone(accelerator.int8_kernel("auto"))
      self.assertIsNone(accelerator.int8_kernel("auto", rows - 1))
      self.assertIsNotNone(accelerator.int8_kernel("kernel", rows - 1))
      self.assertIsNone(accelerator.int8_kernel("ragged_dot", rows))
      # The int8 mode's forward traced there: the Pallas kernel, not XLA's.
      lhs = jnp.ones((rows, 128), jnp.bfloat16)
      rhs = jnp.ones((2, 128, 128), jnp.bfloat16)
      sizes = jnp.asarray((rows // 2, rows // 2), jnp.int32)
      text = str(
          jax.make_jaxpr(int8_grouped.int8_grouped_matmul, static_argnums=3)(
              lhs, rhs, sizes, "auto"
          )
      )
      self.assertIn("pallas_call", text)
      self.assertNotIn("ragged_dot", text)

  def test_no_kernel_on_cpu_is_a_clear_error(self):
    with self.assertRaisesRegex(
        ValueError, "no grouped-matmul kernel.*Available here"
    ):
      gmm_lib.resolve_implementation("kernel", "cpu", ())

  @parameterized.parameters(
      ((jnp.int8, jnp.int8), "'int8', 'int8'"),
      ((jnp.bfloat16, jnp.float8_e4m3fn), "'bfloat16', 'float8_e4m3fn'"),
  )
  def test_kernel_falls_back_visibly_for_other_operands(self, dtypes, named):
    with self.assertWarnsRegex(
        KernelFallbackWarning,
        f"pallas gmm takes float32/bfloat16 operands, not \\({named}\\);"
        ".*ragged_dot",
    ):
      got = gmm_lib.resolve_implementation("kernel", "tpu", dtypes)
    self.assertEqual(got, "ragged_dot")

  def test_megablox_inside_a_shard_map_falls_back_visibly(self):
    # jax's megablox gives its pallas_call outputs no manual-axis type, which
    # a shard_map checking them (the expert-parallel path's) requires: the
    # kernel raised a ValueError there (any `grouped_matmul="kernel"` run or
    # plan on a TPU mesh) before it fell back.
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    lhs, rhs, _ = _operands(2, m=16)
    sizes = jnp.asarray((7, 9), jnp.int32)
    spec = jax.sharding.PartitionSpec

    def loss(a, b):
      def body(a, b):
        return gmm_lib.grouped_matmul(a, b, sizes, implementation="kernel")

      out = jax.shard_map(
          body, mesh=mesh, in_specs=(spec("x"), spec()), out_specs=spec("x")
      )(a, b)
      return jnp.sum(out * out), out

    with (
        testing.kernels_on_cpu("megablox"),
        self.assertWarnsRegex(KernelFallbackWarning, "shard_map.*ragged_dot"),
    ):
      (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
          lhs, rhs
      )
    want, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs)
    np.testing.assert_array_equal(out, want)
    for got, ref in zip(grads, vjp(2 * want), strict=True):
      np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)

  @parameterized.named_parameters(
      ("tpu", "tpu", "pallas gmm takes float32/bfloat16"),
      ("gpu", "gpu", "tokamax ragged_dot takes float16/bfloat16/float32"),
  )
  def test_a_dtype_the_kernel_cannot_take_falls_back_alike(self, backend, msg):
    # The same visible fallback on a GPU path as on a TPU one.
    if backend == "gpu" and NO_TOKAMAX:
      self.skipTest(NO_TOKAMAX)
    with self.assertWarnsRegex(
        KernelFallbackWarning, f"{msg} operands, not \\('int8', 'int8'\\)"
    ):
      got = gmm_lib.resolve_implementation("kernel", backend, (jnp.int8,) * 2)
    self.assertEqual(got, "ragged_dot")

  @parameterized.named_parameters(
      ("tpu", "tpu", "TPU v5 lite"), ("gpu", "gpu", "NVIDIA H200")
  )
  def test_group_sizes_past_the_rows_are_an_error_alike(self, backend, kind):
    # grouped_matmul="kernel" traced for the backend (a mesh of its
    # devices): concrete sizes past the rows fail before the kernel runs,
    # with the same message on a GPU path as on a TPU one.
    if backend == "gpu" and NO_TOKAMAX:
      self.skipTest(NO_TOKAMAX)
    device = mesh_lib.AbstractDevice(
        device_kind=kind, num_cores=1, platform=backend
    )
    mesh = jax.sharding.AbstractMesh(
        (1,),
        ("x",),
        axis_types=jax.sharding.AxisType.Auto,
        abstract_device=device,
    )
    lhs, rhs, _ = _operands(2, m=16)
    sizes = jnp.asarray((7, 10), jnp.int32)
    with (
        jax.sharding.use_abstract_mesh(mesh),
        self.assertRaisesRegex(ValueError, "sum to 17, past the 16 rows"),
    ):
      gmm_lib.grouped_matmul(lhs, rhs, sizes, implementation="kernel")

  def test_gpu_without_tokamax(self):
    try:
      import tokamax  # noqa: F401

      self.skipTest("tokamax is installed")
    except ImportError:
      pass
    self.assertEqual(gmm_lib.resolve_implementation("auto", "gpu"), "blocked")
    with self.assertRaisesRegex(ValueError, "tokamax"):
      gmm_lib.resolve_implementation("kernel", "gpu")


class ValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("lhs_not_2d", (2, M, K), (3, K, N), (3,), {}, "lhs \\[M, K\\]"),
      ("rhs_not_3d", (M, K), (K, N), (3,), {}, "rhs \\[G, K, N\\]"),
      ("k_mismatch", (M, K), (3, K + 1, N), (3,), {}, "same K"),
      ("sizes_shape", (M, K), (3, K, N), (4,), {}, "group_sizes must have"),
      ("sizes_2d", (M, K), (3, K, N), (3, 1), {}, "group_sizes must have"),
      (
          "unknown_impl",
          (M, K),
          (3, K, N),
          (3,),
          {"implementation": "magic"},
          "'magic'.*allowed",
      ),
  )
  def test_bad_arguments(self, lhs_shape, rhs_shape, sizes_shape, kw, msg):
    with self.assertRaisesRegex(ValueError, msg):
      gmm_lib.grouped_matmul(
          jnp.zeros(lhs_shape),
          jnp.zeros(rhs_shape),
          jnp.zeros(sizes_shape, jnp.int32),
          **kw,
      )

  def test_float_group_sizes(self):
    with self.assertRaisesRegex(ValueError, "integers"):
      gmm_lib.grouped_matmul(
          jnp.zeros((M, K)), jnp.zeros((3, K, N)), jnp.zeros((3,))
      )

  @parameterized.parameters(
      ("block_rows_override", 0, r"block rows must be in \[1, M=96\]; got 0"),
      ("slot_rows_override", M + 1, r"slot rows must be in \[0, M=96\]"),
  )
  def test_tile_sizes_out_of_range(self, name, value, message):
    with self.assertRaisesRegex(ValueError, message):
      blocked.blocked_grouped_matmul(
          jnp.zeros((M, K)),
          jnp.zeros((3, K, N)),
          jnp.zeros((3,), jnp.int32),
          **{name: value},
      )

  # A quarter of the mean group, a power of two in [8, 256], at most M.
  @parameterized.parameters(
      (8192, 8, 256),  # mean 1024: capped at 256
      (32768, 128, 64),  # mean 256: 64
      (300, 8, 8),  # mean 37: 9 -> 8
      (96, 4, 8),  # mean 24: 6 -> at least 8
      (5, 8, 5),  # never above M
      (40, 1, 8),  # mean 40: 10 -> 8
  )
  def test_block_rows(self, m, g, want):
    self.assertEqual(blocked.block_rows(m, g), want)

  # M (every row a slot) while the slots [G, M, max(K, N)] hold at most 2^20
  # elements and their matmul takes at most 2^24 multiply-adds.
  @parameterized.parameters(
      (32, 8, 64, 128, 32),  # tiny_mixtral's layer on 2 x 8 tokens
      (128, 16, 64, 32, 128),  # tiny_gemma4_26b's (top-8 of 16)
      (96, 8, 24, 40, 96),  # these tests' operands
      (32768, 128, 512, 128, 320),  # gemma-like: slot_rows
      (1024, 8, 256, 512, 160),  # 2^30 multiply-adds: slot_rows
      (4096, 16, 32, 2, 320),  # 2^22 multiply-adds, but 2^21 elements
  )
  def test_default_slot_rows(self, m, g, k, n, want):
    self.assertEqual(blocked.default_slot_rows(m, g, k, n), want)

  def test_small_problem_runs_without_loops(self):
    group_sizes = jnp.array([13, 0, 57, 20, 0, 5, 1, 0], jnp.int32)
    lhs, rhs, dout = _operands(8)
    default = blocked.blocked_grouped_matmul  # C = M here
    got = _fwd_bwd(default, group_sizes)(lhs, rhs, dout)
    want = _fwd_bwd(gmm_lib.ragged_dot, group_sizes)(lhs, rhs, dout)
    _assert_all_close(got, want, rtol=1e-5, atol=1e-5)

    def loops(matmul):
      fwd_bwd = _fwd_bwd(matmul, group_sizes)
      return str(jax.make_jaxpr(fwd_bwd)(lhs, rhs, dout)).count("while[")

    self.assertEqual(loops(default), 0)
    self.assertGreater(loops(_blocked(16)), 0)  # C = 16: the overflow loops

  def test_a_bound_on_group_sizes_drops_the_loops(self):
    # No group above 12 rows (a MoE of 12 tokens: a token picks an expert
    # once). With the bound, C = min(16, 12) covers every group: no loop.
    group_sizes = jnp.array([12, 0, 11, 12, 9, 5, 1, 0], jnp.int32)
    keys = jax.random.split(jax.random.key(4), 3)
    lhs = jax.random.normal(keys[0], (M, 256))
    rhs = jax.random.normal(keys[1], (8, 256, 256))
    dout = jax.random.normal(keys[2], (M, 256))
    self.assertEqual(blocked.default_slot_rows(M, 8, 256, 256), 16)
    bounded = functools.partial(
        gmm_lib.grouped_matmul, implementation="blocked", max_group_size=12
    )
    got = _fwd_bwd(bounded, group_sizes)(lhs, rhs, dout)
    want = numpy_reference.grouped_matmul(lhs, rhs, group_sizes, dout)
    _assert_all_close(got, want, rtol=1e-4, atol=1e-3)

    def loops(matmul):
      fwd_bwd = _fwd_bwd(matmul, group_sizes)
      return str(jax.make_jaxpr(fwd_bwd)(lhs, rhs, dout)).count("while[")

    self.assertEqual(loops(bounded), 0)
    unbounded = functools.partial(
        gmm_lib.grouped_matmul, implementation="blocked"
    )
    self.assertGreater(loops(unbounded), 0)

  @parameterized.parameters(0, -1, 2.0, True)
  def test_bad_bound(self, bound):
    with self.assertRaisesRegex(
        ValueError, "max_group_size must be a positive"
    ):
      gmm_lib.grouped_matmul(
          jnp.zeros((M, K)),
          jnp.zeros((3, K, N)),
          jnp.zeros((3,), jnp.int32),
          implementation="blocked",
          max_group_size=bound,
      )

  # 1.25 x the mean group, rounded up to a multiple of 8, in [8, M].
  @parameterized.parameters(
      (32768, 128, 320),  # mean 256
      (1024, 64, 24),  # mean 16: 20 -> 24
      (96, 8, 16),  # mean 12: 15 -> 16
      (16, 64, 8),  # mean 0.25: at least 8
      (5, 8, 5),  # never above M
  )
  def test_slot_rows(self, m, g, want):
    self.assertEqual(blocked.slot_rows(m, g), want)


if __name__ == "__main__":
  absltest.main()


class BackwardMemoryTest(absltest.TestCase):
  """What the bfloat16 blocked backward keeps and makes: the forward's
  slots are not saved for it (they are gathered again there, so that XLA
  cannot keep their float32 copy from the forward), and dlhs is rounded
  to bfloat16 per dot, never a float32 [M, K]."""

  def setUp(self):
    super().setUp()
    lhs, rhs, _ = _operands(4, dtype=jnp.bfloat16)
    self.operands = lhs, rhs
    self.group_sizes = jnp.array([10, 30, 0, 40], jnp.int32)
    self.matmul = _blocked(16)  # C = 32 slots a group, overflow tiles

  def test_saves_no_slots(self):
    _, vjp = jax.vjp(
        lambda x, w: self.matmul(x, w, self.group_sizes), *self.operands
    )
    saved = {(x.shape, x.dtype) for x in jax.tree.leaves(vjp)}
    self.assertIn(((M, K), jnp.dtype(jnp.bfloat16)), saved)  # lhs itself
    self.assertFalse([s for s in saved if s[0] == (4, 32, K)], saved)

  def test_no_float32_rows_of_lhs(self):
    def loss(x, w):
      out = self.matmul(x, w, self.group_sizes)
      return jnp.sum(out.astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, (0, 1))).lower(*self.operands).compile()
    dlhs = jax.eval_shape(jax.grad(loss), *self.operands)
    self.assertEqual(dlhs.dtype, jnp.bfloat16)
    self.assertNotIn(f"f32[{M},{K}]", compiled.as_text())
