"""Our Pallas-Triton decode expert matmul (`gpu/triton_decode`), run in
Pallas interpret mode on this CPU: each projection and the gated expert MLP
against a float64 NumPy loop at batch 1, 2 and 8 of top-1 and top-2
(repeated experts, experts no token routes to), in bfloat16, float32, int8
and float8 weights with their scales; its expert slots against NumPy's
unique; each bad input's error before any work; and its kernel lowered to
Triton for an H200 (the Pallas -> Triton IR step of a GPU compile, which
needs no GPU), the module verified by MLIR.

Interpret mode costs about a second a call here: the default run holds a
few cases, the rest are `slow`. On a GPU `test_on_gpu` runs them compiled.
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

from linen_moe._src.kernels import registry
from linen_moe._src.kernels.gpu import decode_stored
from linen_moe._src.kernels.gpu import triton_decode
from linen_moe._src.kernels.gpu.triton_tiles import Tiles
from linen_moe._src.quantization import stored_weights
from linen_moe.testing import slow

# 16 x 16 tiles: K = 40 and N = 24 take partial tiles, two N tiles.
SMALL = Tiles(block_n=16, block_k=16)
E, K, N = 6, 40, 24
WEIGHTS = ("bfloat16", "float32", "int8", "float8_e4m3fn", "float8_e5m2")
# (batch, top-k, weight dtype, x dtype): the default run's cases.
DEFAULT_RUN = (
    (1, 1, "bfloat16", "bfloat16"),
    (2, 2, "int8", "bfloat16"),
    (8, 2, "float8_e4m3fn", "bfloat16"),
    (8, 1, "float32", "float32"),
)


def _routing(batch: int, top_k: int, seed: int = 0) -> np.ndarray:
  """<int32>[B * k] expert ids: tokens share experts (expert 2 is every
  token's first choice past batch 1), experts 0 and 5 never chosen."""
  rng = np.random.default_rng(seed)
  ids = np.empty((batch, top_k), np.int32)
  for b in range(batch):
    ids[b] = rng.choice([1, 3, 4], size=top_k, replace=False)
    ids[b, 0] = 2 if b > 0 else ids[b, 0]
    if top_k > 1 and ids[b, 1] == ids[b, 0]:
      ids[b, 1] = 1 if ids[b, 0] != 1 else 3
  return ids.reshape(-1)


def _weights(dtype: str, shape=(E, K, N), seed: int = 1):
  """(w, scale or None, w as float64 = values * scale): random values of
  the stored type, scales per expert and output channel [E, 1, N]."""
  rng = np.random.default_rng(seed)
  e, _, n = shape
  if dtype == "int8":
    values = rng.integers(-127, 128, shape).astype(np.int8)
  else:
    values = np.asarray(
        jnp.asarray(rng.standard_normal(shape), jnp.dtype(dtype))
    )
  if dtype in ("bfloat16", "float32"):
    return jnp.asarray(values), None, values.astype(np.float64)
  scale = rng.uniform(0.01, 0.05, (e, 1, n)).astype(np.float32)
  wide = values.astype(np.float64) * scale
  return jnp.asarray(values), jnp.asarray(scale), wide


def _x(rows: int, dtype: str, k: int = K, seed: int = 2):
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((rows, k)))
  return x.astype(jnp.dtype(dtype))


def numpy_decode(x, w64, ids) -> np.ndarray:
  """float64 row loop: out[t] = x[t] @ w[ids[t]]; 0 where ids[t] is no
  expert's."""
  x = np.asarray(x, np.float64)
  out = np.zeros((x.shape[0], w64.shape[2]))
  for t, e in enumerate(np.asarray(ids)):
    if 0 <= e < w64.shape[0]:
      out[t] = x[t] @ w64[e]
  return out


# bfloat16 x bfloat16 (and int8 / float8 values, exact in bfloat16)
# products are exact in float32: a float32 output differs from the float64
# loop by float32 accumulation alone.
F32_OUT = dict(rtol=1e-5, atol=1e-5)


def _check(test, batch, top_k, w_dtype, x_dtype, interpret=True, tiles=SMALL):
  ids = _routing(batch, top_k)
  x = _x(ids.size, x_dtype)
  w, scale, w64 = _weights(w_dtype)
  got = triton_decode.decode_matmul(
      x,
      w,
      jnp.asarray(ids),
      scale,
      jnp.float32,
      tiles=tiles,
      interpret=interpret,
  )
  test.assertEqual(got.shape, (ids.size, N))
  np.testing.assert_allclose(
      np.asarray(got, np.float64), numpy_decode(x, w64, ids), **F32_OUT
  )
  # In x's dtype: the float32 result rounded once.
  got = triton_decode.decode_matmul(
      x, w, jnp.asarray(ids), scale, tiles=tiles, interpret=interpret
  )
  test.assertEqual(got.dtype, x.dtype)
  rtol = 1e-5 if x_dtype == "float32" else 2**-8
  np.testing.assert_allclose(
      np.asarray(got, np.float64),
      numpy_decode(x, w64, ids),
      rtol=rtol,
      atol=rtol * np.abs(w64).max(),
  )


class TritonDecodeTest(parameterized.TestCase):

  @parameterized.parameters(*DEFAULT_RUN)
  def test_matches_numpy_loop(self, batch, top_k, w_dtype, x_dtype):
    _check(self, batch, top_k, w_dtype, x_dtype)

  @slow
  @parameterized.product(
      batch=(1, 2, 8),
      top_k=(1, 2),
      w_dtype=WEIGHTS,
      x_dtype=("bfloat16", "float32"),
      tiles=("small", "default"),
  )
  def test_matches_numpy_loop_everywhere(
      self, batch, top_k, w_dtype, x_dtype, tiles
  ):
    tiles = SMALL if tiles == "small" else None
    _check(self, batch, top_k, w_dtype, x_dtype, tiles=tiles)

  def test_unrouted_experts_are_never_read(self):
    """NaN weights in the experts no row routes to (0 and 5): a kernel
    that multiplied them (and masked the product after) would put NaN in
    the rows."""
    ids = _routing(2, 2)
    w, _, w64 = _weights("bfloat16")
    w = w.at[jnp.asarray([0, 5])].set(jnp.nan)
    x = _x(ids.size, "bfloat16")
    got = triton_decode.decode_matmul(
        x, w, jnp.asarray(ids), None, jnp.float32, tiles=SMALL, interpret=True
    )
    np.testing.assert_allclose(
        np.asarray(got, np.float64), numpy_decode(x, w64, ids), **F32_OUT
    )

  def test_traced_ids_out_of_range_give_zero_rows(self):
    ids = np.asarray([2, -1, 6, 2, 40], np.int32)
    w, scale, w64 = _weights("int8")
    x = _x(ids.size, "float32")
    run = jax.jit(
        functools.partial(
            triton_decode.decode_matmul, tiles=SMALL, interpret=True
        )
    )
    got = np.asarray(run(x, w, jnp.asarray(ids), scale), np.float64)
    np.testing.assert_array_equal(got[[1, 2, 4]], 0)
    np.testing.assert_allclose(got, numpy_decode(x, w64, ids), **F32_OUT)

  def test_per_tensor_fp8_scale(self):
    """fp8 serving's one scale [1] multiplies the output."""
    ids = _routing(8, 1)
    w, _, w64 = _weights("float8_e4m3fn")
    w64 = np.asarray(w, np.float64) * 0.125
    x = _x(ids.size, "bfloat16")
    got = triton_decode.decode_matmul(
        x,
        w,
        jnp.asarray(ids),
        jnp.asarray([0.125], jnp.float32),
        jnp.float32,
        tiles=SMALL,
        interpret=True,
    )
    np.testing.assert_allclose(
        np.asarray(got, np.float64), numpy_decode(x, w64, ids), **F32_OUT
    )

  def test_gated_experts_match_numpy_loop(self):
    """`decode_experts`: batch 2 of top-2, int8 gate and up, bfloat16
    down, against the per-token loop of the gated MLP."""
    b, k, m, h = 2, 2, 24, 40
    ids = _routing(b, k).reshape(b, k)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((b, m)).astype(np.float32)
    route_w = rng.uniform(0.2, 0.8, (b, k)).astype(np.float32)
    wi_0, s0, w0 = _weights("int8", (E, m, h), seed=4)
    wi_1, s1, w1 = _weights("int8", (E, m, h), seed=5)
    wo, _, wo64 = _weights("float32", (E, h, m), seed=6)
    got = triton_decode.decode_experts(
        jnp.asarray(x),
        jnp.asarray(ids),
        jnp.asarray(route_w),
        (wi_0, s0),
        (wi_1, s1),
        wo,
        tiles=SMALL,
        interpret=True,
    )
    want = np.zeros((b, m))
    for t in range(b):
      for j in range(k):
        e, xt = ids[t, j], x[t].astype(np.float64)
        gate, up = xt @ w0[e], xt @ w1[e]
        hidden = gate / (1 + np.exp(-gate)) * up
        want[t] += route_w[t, j] * (hidden @ wo64[e])
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4)

  @parameterized.parameters(("int8", None), ("float8_e4m3fn", 0.02))
  def test_stored_weights_give_the_serving_contractions_numbers(
      self, w_dtype, input_scale
  ):
    """`decode_matmul_stored` against the serving layer's own contraction
    (`StoredGroupedMatmul`, input quantized as it does, XLA's ragged_dot)
    on the rows sorted by expert: batch 8 of top-2."""
    ids = _routing(8, 2)
    x = _x(ids.size, "float32")
    values, scale, _ = _weights(w_dtype)
    mode = "int8"
    if input_scale is not None:  # float8: one scale a tensor
      scale, mode = jnp.asarray([0.03], jnp.float32), "fp8"
      input_scale = jnp.asarray([input_scale], jnp.float32)
    got = decode_stored.decode_matmul_stored(
        x, values, jnp.asarray(ids), scale, input_scale, tiles=SMALL,
        interpret=True,
    )  # fmt: skip
    order = np.argsort(ids, kind="stable")
    sizes = jnp.asarray(np.bincount(ids, minlength=E), jnp.int32)
    kernel = stored_weights.StoredKernel(values, scale, input_scale, mode)
    serving = stored_weights.StoredGroupedMatmul("ragged_dot")
    want = np.empty((ids.size, N))
    want[order] = serving.apply({}, x[order], kernel, sizes)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

  def test_stored_weights_bad_input_are_value_errors(self):
    x, ids = jnp.ones((4, 16)), jnp.zeros(4, int)
    w, scale = jnp.ones((3, 16, 8), jnp.int8), jnp.ones((3, 1, 8))
    one = jnp.ones((1,))
    for args, message in (
        ((x, w.astype(jnp.bfloat16), ids, scale), "values has dtype bfloat16"),
        ((x, w, ids, scale, one), "int8 takes none; got values int8"),
        ((x, w.astype(jnp.float8_e4m3fn), ids, one), "float8_e4m3fn with"),
    ):
      with self.assertRaisesRegex(ValueError, message):
        fail = mock.Mock(side_effect=AssertionError("a kernel was traced"))
        with mock.patch.object(triton_decode, "decode_kernel", fail):
          decode_stored.decode_matmul_stored(*args, interpret=True)

  @parameterized.parameters(
      ([3, 1, 3, 0, 1], 4),
      ([2, 2, 2], 6),
      ([5, -1, 9, 5, 0, 2, 2, 7], 6),
      ([-1, 6], 6),
      ([0], 1),
  )
  def test_expert_slots_are_the_distinct_ids(self, ids, e):
    slots, count = jax.jit(triton_decode.expert_slots, static_argnums=1)(
        jnp.asarray(ids, jnp.int32), e
    )
    want = np.unique([i for i in ids if 0 <= i < e])
    self.assertEqual(int(count[0]), want.size)
    np.testing.assert_array_equal(slots[: want.size], want)
    np.testing.assert_array_equal(slots[want.size :], e)

  def _no_work(self, *args, **kwargs):
    """Calls the decode matmul with the kernel replaced by a failure: the
    error must come before any kernel is traced."""
    fail = mock.Mock(side_effect=AssertionError("a kernel was traced"))
    with mock.patch.object(triton_decode, "decode_kernel", fail):
      triton_decode.decode_matmul(*args, interpret=True, **kwargs)

  def test_bad_dtypes_are_type_errors(self):
    x, w, ids = jnp.ones((4, 16)), jnp.ones((3, 16, 8)), jnp.zeros(4, int)
    scale = jnp.ones((3, 1, 8))
    for args, message in (
        ((x.astype(jnp.int8), w, ids), "x has dtype int8; .* takes float16"),
        ((x, w.astype(jnp.int32), ids), "w has dtype int32; .* int8, float8"),
        ((x, w, ids.astype(jnp.float32)), "expert_ids must be integers"),
        ((x, w.astype(jnp.int8), ids, scale.astype(jnp.bfloat16)), "scale"),
        ((x, w, ids, None, jnp.int32), "preferred_element_type=int32"),
    ):
      with self.assertRaisesRegex(TypeError, message):
        self._no_work(*args)

  def test_bad_shapes_are_value_errors(self):
    x, w, ids = jnp.ones((4, 16)), jnp.ones((3, 16, 8)), jnp.zeros(4, int)
    for args, message in (
        ((x[None], w, ids), r"x \[T, K\] must have rank 2"),
        ((x, w[0], ids), r"w \[E, K, N\] must have rank 3"),
        ((x, w[:, :8], ids), "the same K as x"),
        ((x, w, ids[:3]), r"expert_ids must have shape \[T\]=\(4,\)"),
        ((x, w, ids, jnp.ones((3, 8, 1))), "scale must have shape"),
        ((x, w.astype(jnp.int8), ids), "pass its scale"),
    ):
      with self.assertRaisesRegex(ValueError, message):
        self._no_work(*args)

  def test_too_many_rows_is_a_value_error(self):
    x, w = jnp.ones((65, 16)), jnp.ones((3, 16, 8))
    with self.assertRaisesRegex(ValueError, "T=65 rows; .* 1 to 64"):
      self._no_work(x, w, jnp.zeros(65, int))

  def test_concrete_ids_out_of_range_are_a_value_error(self):
    x, w = jnp.ones((4, 16)), jnp.ones((3, 16, 8))
    with self.assertRaisesRegex(
        ValueError, r"expert_ids must be in \[0, 3\) .* got \[3, -1\]"
    ):
      self._no_work(x, w, jnp.asarray([0, 3, 2, -1]))

  def test_bad_tiles_are_value_errors(self):
    x, w, ids = jnp.ones((4, 16)), jnp.ones((3, 16, 8)), jnp.zeros(4, int)
    with self.assertRaisesRegex(ValueError, "tiles.block_n must be a power"):
      self._no_work(x, w, ids, tiles=Tiles(block_n=24))
    with self.assertRaisesRegex(ValueError, "tiles must be a Tiles or None"):
      self._no_work(x, w, ids, tiles=(16, 16))

  def test_the_registry_loads_it_by_key_only(self):
    decode, missing = registry.find_decode("gpu/pallas_triton_gmm", "cpu")
    self.assertIsNone(missing)
    self.assertIs(decode.func, triton_decode.decode_matmul)
    self.assertTrue(decode.keywords["interpret"])
    with self.assertRaisesRegex(ValueError, "has no decode expert matmul"):
      registry.find_decode("tpu/pallas", "cpu")

  # T = 8 rows (batch 8 top-1, or batch 4 top-2): 9 slots x N tiles of 128
  # (N = 768: 6; N = 2048: 16).
  @parameterized.parameters(
      ("bfloat16", None, 768, 9 * 6),
      ("int8", (64, 1, 2048), 2048, 9 * 16),
      ("float8_e4m3fn", (64, 1, 768), 768, 9 * 6),
  )
  def test_lowers_to_triton_for_an_h200(self, w_dtype, scale, n, grid):
    """The kernel goes through Pallas' Triton lowering for an H200 with
    the default (unmeasured) tiles, the int8 and float8 weights converted
    in the kernel, into a Triton module that MLIR's verifier passes."""
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
    k, t = 2048 if n == 768 else 768, 8
    spec = jax.ShapeDtypeStruct
    args = [
        spec((t, k), jnp.bfloat16),
        spec((64, k, n), jnp.dtype(w_dtype)),
        spec((t,), jnp.int32),
    ]
    if scale is not None:
      args.append(spec(scale, jnp.float32))
    run = jax.jit(triton_decode.decode_matmul)
    lower, verified = lowering.lower_jaxpr_to_triton_module, []

    def lower_and_verify(*a, **kw):
      result = lower(*a, **kw)
      verified.append(result.module.operation.verify())
      return result

    with (
        jax.sharding.use_abstract_mesh(mesh),
        warnings.catch_warnings(),
        mock.patch.object(
            lowering, "lower_jaxpr_to_triton_module", lower_and_verify
        ),
    ):
      warnings.simplefilter("ignore", DeprecationWarning)
      text = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    self.assertEqual(verified, [True])
    self.assertEqual(text.count("custom_call @__gpu$xla.gpu.triton("), 1)
    self.assertEqual(
        [int(g) for g in re.findall(r"grid_x = (\d+)", text)], [grid]
    )

  def test_on_gpu(self):
    """On a GPU: the cases compiled by Triton, default tiles."""
    if jax.default_backend() != "gpu":
      self.skipTest("needs a GPU (compiled by Triton there)")
    for batch in (1, 2, 8):
      for top_k in (1, 2):
        for w_dtype in WEIGHTS:
          with self.subTest(batch=batch, top_k=top_k, w=w_dtype):
            _check(self, batch, top_k, w_dtype, "bfloat16", False, tiles=None)


if __name__ == "__main__":
  absltest.main()
