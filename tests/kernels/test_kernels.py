"""The accelerator kernels of `grouped_matmul="kernel"`, run on this CPU.

megablox `gmm` (what TPU users get) runs in Pallas interpret mode: the
kernel's own program, interpreted, with its own VJP (`gmm` with the
transposed rhs for the input gradient, `tgmm` for the weight gradient).
Tokamax runs its XLA implementation (the one it runs on a CPU; its GPU
kernels need a GPU) and its Pallas Mosaic TPU kernel in interpret mode.
Each is checked against `jax.lax.ragged_dot` and the NumPy row loop, then
inside the layer's sparse path (`linen_moe.testing.kernels_on_cpu`).

Interpret mode compiles slowly (about 0.5 s per kernel call here), so the
shapes are tiny and each test compiles one program; the layer in the other
quantization modes is marked slow.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import lax
from jax._src import mesh as mesh_lib
import jax.numpy as jnp
import numpy as np

from linen_moe import KernelFallbackWarning
from linen_moe import RoutedMoE
from linen_moe import load_moe_config
from linen_moe import quantization
from linen_moe import testing
from linen_moe._src.config.variables import AQT_RNG_STREAM
from linen_moe._src.kernels import accelerator as grouped_kernels
from linen_moe._src.kernels import tokamax_ragged_dot as tokamax_route
from linen_moe.quantization import MODES
from linen_moe.sharding import unbox
from linen_moe.variables import OVERWRITE_WITH_GRADIENT as OWG
from tests import gmm_cases
from tests import numpy_reference

try:
  import tokamax  # noqa: F401

  NO_TOKAMAX = None
except ImportError as e:  # the `kernels` extra is not installed
  NO_TOKAMAX = f"tokamax is not importable ({e}): pip install '.[kernels]'"

# Problems: (M, K, N, group sizes). "ragged": M = 600 is no multiple of the
# 512-row tile (two tiles, the wrapper pads), K = 160 no multiple of the
# 128 K tile (megablox masks the remainder); groups 1, 3 and 5 are empty,
# group 2 crosses the row-tile boundary, and the 22 rows past the total
# belong to no group. "one_group": a group holding every row.
PROBLEMS = {
    "ragged": (600, 160, 48, (137, 0, 390, 0, 51, 0)),
    "one_group": (72, 24, 40, (0, 72, 0)),
}
# openxla/tokamax#887's reproducer: groups 6-17 receive no row.
ISSUE_887 = (32, 64, 43, (6, 5, 5, 6, 5, 5) + (0,) * 12)
# Tokamax's Pallas Mosaic TPU kernel takes every non-group dimension >= 128.
TOKAMAX_PALLAS = (256, 128, 128, (100, 0, 120, 0))
TOLERANCE = {
    jnp.float32: dict(rtol=1e-5, atol=1e-4),
    # bf16 output (8 bits of mantissa) of sums of K products of O(1) terms.
    jnp.bfloat16: dict(rtol=2e-2, atol=0.25),
}


_operands = gmm_cases.operands
_fwd_bwd = gmm_cases.fwd_bwd


def _ragged_dot(lhs, rhs, group_sizes):
  return lax.ragged_dot(lhs, rhs, group_sizes)


def _run(matmul, problems, dtype=jnp.float32):
  """{name: (out, dlhs, drhs)} of every problem, in one compiled program."""
  operands = {name: _operands(*p, dtype=dtype) for name, p in problems.items()}
  run = jax.jit(lambda ops: {n: _fwd_bwd(matmul, *o) for n, o in ops.items()})
  return run(operands), operands


class KernelChecks(parameterized.TestCase):

  def check(self, matmul, problems, dtype=jnp.float32):
    """Against ragged_dot and NumPy; exact zeros where nothing flows."""
    got, operands = _run(matmul, problems, dtype)
    want, _ = _run(_ragged_dot, problems, dtype)
    for name, (lhs, rhs, sizes, dout) in operands.items():
      with self.subTest(problem=name):
        oracle = numpy_reference.grouped_matmul(lhs, rhs, sizes, dout)
        for what, g, w, o in zip(
            ("out", "dlhs", "drhs"), got[name], want[name], oracle, strict=True
        ):
          g64 = np.asarray(g, np.float64)
          tol = TOLERANCE[dtype]
          np.testing.assert_allclose(
              g64, np.asarray(w, np.float64), err_msg=what, **tol
          )
          np.testing.assert_allclose(g64, o, err_msg=what, **tol)
        out, dlhs, drhs = got[name]
        empty = np.asarray(sizes) == 0
        self.assertTrue(np.all(np.asarray(drhs)[empty] == 0), "empty drhs")
        total = int(np.sum(sizes))
        self.assertTrue(np.all(np.asarray(out)[total:] == 0), "rows past")
        self.assertTrue(np.all(np.asarray(dlhs)[total:] == 0), "rows past")


class MegabloxTest(KernelChecks):

  @parameterized.parameters(
      (jnp.float32, tuple(PROBLEMS)), (jnp.bfloat16, ("ragged",))
  )
  def test_forward_and_gradients_in_interpret_mode(self, dtype, problems):
    megablox = functools.partial(grouped_kernels.megablox_gmm, interpret=True)
    self.check(megablox, {p: PROBLEMS[p] for p in problems}, dtype)


@absltest.skipIf(NO_TOKAMAX, NO_TOKAMAX)
class TokamaxTest(KernelChecks):

  def test_xla_implementation(self):
    xla = functools.partial(
        grouped_kernels.tokamax_ragged_dot, implementation=("xla",)
    )
    self.check(xla, {**PROBLEMS, "issue_887": ISSUE_887})

  def test_pallas_tpu_kernel_in_interpret_mode(self):
    kernel, _ = _kernel_on_cpu("tokamax_pallas")
    # Tokamax reads the TPU generation from the abstract mesh's device.
    tpu = mesh_lib.AbstractDevice(
        device_kind="TPU v5p", num_cores=1, platform="tpu"
    )
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=jax.sharding.AxisType.Auto, abstract_device=tpu
    )
    with jax.sharding.use_abstract_mesh(mesh):
      self.check(kernel.fn, {"large": TOKAMAX_PALLAS})


def _kernel_on_cpu(kind):
  with testing.kernels_on_cpu(kind):
    return grouped_kernels.find_kernel("cpu")


class EmptyGroupGuardTest(parameterized.TestCase):
  """A kernel whose weight gradient is wrong exactly as openxla/tokamax#887
  reported (every group, empty or not, gets the same non-zero gradient):
  the wrapper gives empty groups exactly 0 and leaves the others alone."""

  def test_empty_groups_get_zero_whatever_the_kernel_says(self):
    @jax.custom_vjp
    def buggy(lhs, rhs, group_sizes):
      return lax.ragged_dot(lhs, rhs, group_sizes)

    def buggy_fwd(lhs, rhs, group_sizes):
      return buggy(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def buggy_bwd(residuals, g):
      lhs, rhs, group_sizes = residuals
      _, vjp = jax.vjp(lambda x: lax.ragged_dot(x, rhs, group_sizes), lhs)
      (dlhs,) = vjp(g)
      return dlhs, jnp.ones_like(rhs) * jnp.sum(g), None

    buggy.defvjp(buggy_fwd, buggy_bwd)

    def fake_call(lhs, rhs, group_sizes, preferred_element_type, impl):
      del preferred_element_type, impl
      return buggy(lhs, rhs, group_sizes)

    lhs, rhs, sizes, dout = _operands(*ISSUE_887)
    with absltest.mock.patch.object(tokamax_route, "_tokamax_call", fake_call):
      _, _, drhs = jax.jit(
          functools.partial(_fwd_bwd, tokamax_route.tokamax_ragged_dot)
      )(lhs, rhs, sizes, dout)
    empty = np.asarray(sizes) == 0
    np.testing.assert_array_equal(np.asarray(drhs)[empty], 0.0)
    self.assertTrue(np.all(np.asarray(drhs)[~empty] != 0))


# ---------------------------------------------------------------------------
# The layer's sparse path with grouped_matmul="kernel".
# ---------------------------------------------------------------------------


def _layer_step(mode: str, implementation: str, kind: str | None):
  """(output, grads of params / fp8 state / input, fallback warnings) of a
  sparse RoutedMoE, traced and compiled with `kind` on the CPU."""
  cfg = load_moe_config(
      "tiny_mixtral",
      quantization=mode,
      grouped_matmul=implementation,
      sparse_matmul=True,
  )
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.emb_dim))
  probe = jax.random.normal(jax.random.key(2), x.shape)

  def loss(params, state, x):
    variables = {"params": params, **({OWG: state} if state else {})}
    y, _ = RoutedMoE(cfg).apply(
        variables, x, rngs={AQT_RNG_STREAM: jax.random.key(3)}
    )
    return jnp.sum(y * probe), y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  context = testing.kernels_on_cpu(kind) if kind else contextlib.nullcontext()
  with context, warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    variables = unbox(jax.jit(RoutedMoE(cfg).init)(jax.random.key(0), x))
    (_, y), grads = step(variables["params"], variables.get(OWG, {}), x)
  fallbacks = [w for w in caught if w.category is KernelFallbackWarning]
  return y, grads, fallbacks


@functools.cache
def _reference_step(mode: str):
  return _layer_step(mode, "ragged_dot", None)[:2]


class LayerKernelChecks(parameterized.TestCase):

  def check_layer(self, mode, kind):
    y, grads, fallbacks = _layer_step(mode, "kernel", kind)
    want_y, want_grads = _reference_step(mode)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    for got, want in zip(
        jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True
    ):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if MODES[mode].grouped_operand_dtype is None:
      self.assertEqual(fallbacks, [])
    else:  # int8: its forward and input gradient say so; drhs is float
      self.assertNotEmpty(fallbacks)
      self.assertIn("int8", str(fallbacks[0].message))


class LayerKernelTest(LayerKernelChecks):
  """The default run: megablox on every contraction (float); int8, whose
  int8 contractions fall back visibly, and the other modes are slow
  (`LayerKernelProductTest`); a visible fallback is also
  `test_serving_layer_falls_back_visibly`."""

  def test_sparse_layer_with_megablox(self):
    self.check_layer("none", "megablox")

  def test_serving_layer_falls_back_visibly(self):
    cfg = load_moe_config(
        "tiny_mixtral", quantization="fp8", grouped_matmul="ragged_dot"
    )
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.emb_dim))
    float_vars = unbox(jax.jit(RoutedMoE(cfg).init)(jax.random.key(0), x))
    serve_cfg, serve_vars = quantization.quantize_weights(cfg, float_vars)
    want, _ = jax.jit(RoutedMoE(serve_cfg).apply)(serve_vars, x)
    kernel_cfg = serve_cfg.replace(grouped_matmul="kernel")
    with (
        testing.kernels_on_cpu("megablox"),
        self.assertWarnsRegex(KernelFallbackWarning, "float8_e4m3fn"),
    ):
      got, _ = jax.jit(RoutedMoE(kernel_cfg).apply)(serve_vars, x)
    np.testing.assert_array_equal(got, want)


@testing.slow
class LayerKernelProductTest(LayerKernelChecks):

  @parameterized.product(mode=tuple(MODES), kind=("megablox", "tokamax"))
  def test_sparse_layer(self, mode, kind):
    if kind == "tokamax" and NO_TOKAMAX:
      self.skipTest(NO_TOKAMAX)
    self.check_layer(mode, kind)


if __name__ == "__main__":
  absltest.main()
