"""Quantized contractions: error bounds, compiled types, fp8 state, errors.

Each (config, path, mode) cell compiles one `value_and_grad` train step of
`RoutedMoE` and runs it `STEPS` times, writing the fp8 state's "gradient"
back as the next state (the `_overwrite_with_gradient` rule). The tests read
the cached cell; compiles dominate the run time.
"""

import dataclasses
import functools

from absl.testing import absltest
from absl.testing import parameterized
from aqt.jax.v2 import aqt_quantizer
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import MoEConfig
from linen_moe import RoutedMoE
from linen_moe import hlo
from linen_moe import load_moe_config
from linen_moe import testing
from linen_moe._src.config import variables
from linen_moe._src.config.quantization_modes import FP8_MODES as FP8
from linen_moe._src.config.quantization_modes import QUANTIZED
from linen_moe._src.hlo import reading
from linen_moe._src.kernels import grouped_matmul as gmm_lib
from linen_moe._src.kernels import int8_grouped
from linen_moe._src.layer import dense
from linen_moe._src.quantization import contractions as quantization
from linen_moe._src.testing import helpers
from linen_moe.quantization import MODES as FACTS
from linen_moe.sharding import unbox
from linen_moe.variables import OVERWRITE_WITH_GRADIENT as OWG
from tests import numpy_reference

MODES = tuple(FACTS)  # the mode names

CONFIGS = ("tiny_mixtral", "tiny_gemma4_26b")
MATMUL_PATHS = {
    "sparse": dict(sparse_matmul=True),
    "dense": dict(sparse_matmul=False, capacity_factor=0.0),
    "dense_dropping": dict(sparse_matmul=False, capacity_factor=1.0),
}
SITES = {
    "sparse": ("wi_0", "wi_1", "wo"),
    "dense": ("wi_0", "wi_1", "wo", "combine"),
    "dense_dropping": ("dispatch", "wi_0", "wi_1", "wo", "combine"),
}
STEPS = 3

# ||y_q - y|| / ||y|| of the RoutedMoE output against the unquantized layer
# (the NumPy oracle, which the unquantized layer matches to 1e-5: the "none"
# cell), same params and inputs ([2, 8, 64] normal), at step 3, i.e. after the fp8
# state was overwritten twice (at step 1 every scale is still 1; the scales
# come from the amax history only from step 2 on: delayed scaling).
# Measured on CPU (jax 0.12.0.1, flax 0.12.12, aqtp 0.9.0):
#
#   config           path            int8    fp8     nanoo_fp8
#   tiny_mixtral     sparse          0.0169  0.0699  0.0637
#   tiny_mixtral     dense           0.0194  0.0795  0.0723
#   tiny_mixtral     dense_dropping  0.0268  0.0809  0.0747
#   tiny_gemma4_26b  sparse          0.0136  0.0694  0.0612
#   tiny_gemma4_26b  dense           0.0177  0.0723  0.0735
#   tiny_gemma4_26b  dense_dropping  0.0254  0.0755  0.0725
#   sparse vs dense, both quantized (same mode):
#   tiny_mixtral                     0.0225  0.0541  0.0522
#   tiny_gemma4_26b                  0.0204  0.0542  0.0497
#
# Step 1 (scales 1) measures up to 0.0984 for fp8, 0.0826 for nanoo_fp8.
# e4m3 keeps 3 mantissa bits: qdq of a normal tensor is off by 2.6% (rms,
# relative), one matmul of two qdq operands by 3.9%, and the gated expert
# chains three of them (the dense paths add the combine weights, the dropping
# path the dispatch mask), so fp8 lands at 6-8%. int8 rounds to 1/254 of
# each row's or channel's range. Bounds are the worst case * ~1.5.
BOUND = {"none": 1e-5, "int8": 0.04, "fp8": 0.12, "nanoo_fp8": 0.12}
# Quantized element types feeding the compiled contractions: forward (lhs and
# rhs of every expert contraction) and backward (the input-gradient dot).
FWD_TYPE = {m: FACTS[m].hlo_forward_type for m in QUANTIZED}
GRAD_TYPE = {m: FACTS[m].hlo_gradient_type for m in QUANTIZED}


_rel_err = helpers.rel_err


def _inputs(config: MoEConfig):
  x = jax.random.normal(jax.random.key(1), (2, 8, config.emb_dim))
  target = jax.random.normal(jax.random.key(2), x.shape)
  return x, target


@functools.cache
def _params(config_name: str):
  config = load_moe_config(config_name)
  init = jax.jit(RoutedMoE(config).init)
  return unbox(init(jax.random.key(0), _inputs(config)[0]))["params"]


@dataclasses.dataclass(frozen=True)
class Cell:
  """What `STEPS` train steps of one (config, path, mode) produced."""

  outputs: list  # the layer output at each step
  param_grads: dict  # at step 1
  states: list  # fp8 state before step 1, after step 1, ...
  hlo: str  # the compiled step


@functools.cache
def _cell(config_name: str, path: str, mode: str) -> Cell:
  config = load_moe_config(config_name, quantization=mode, **MATMUL_PATHS[path])
  model = RoutedMoE(config)
  x, target = _inputs(config)
  params = _params(config_name)
  state = {}
  if mode in FP8:
    state = jax.jit(model.init)(jax.random.key(0), x)[OWG]

  def loss(params, state, rng):
    y, aux = model.apply(
        {"params": params, OWG: state},
        x,
        rngs={variables.AQT_RNG_STREAM: rng},
    )
    return jnp.mean(jnp.square(y - target)) + aux.load_balance_loss, y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  step = step.lower(params, state, jax.random.key(0)).compile()
  outputs, states, first_grads = [], [state], None
  for i in range(STEPS):
    (_, y), (grads, state) = step(params, state, jax.random.key(i))
    outputs.append(y)
    states.append(state)
    first_grads = grads if i == 0 else first_grads
  return Cell(outputs, first_grads, states, step.as_text())


@functools.cache
def _reference(config_name: str, path: str):
  """The NumPy oracle's output (float64, unquantized), same params and
  inputs as the cells; with the dropping path's capacity."""
  config = load_moe_config(config_name, **MATMUL_PATHS[path])
  x = np.asarray(_inputs(config)[0], np.float64)
  capacity = None
  if config.dropping:
    capacity = dense.expert_capacity(config, x.shape[1])
  out, _ = numpy_reference.moe_reference(
      _params(config_name), x, config, capacity=capacity
  )
  return out


# (config, mode) -> the paths of its cells in the default run: every mode
# once, every path in float and in two quantized modes (the dropping path's
# dispatch contraction quantized), sparse vs dense in fp8 and in float.
DEFAULT_ROWS = {
    ("tiny_mixtral", "none"): tuple(MATMUL_PATHS),
    ("tiny_mixtral", "int8"): ("sparse", "dense_dropping"),
    ("tiny_mixtral", "fp8"): ("sparse", "dense"),
    ("tiny_gemma4_26b", "nanoo_fp8"): ("dense", "dense_dropping"),
}


class QuantizedLayerTest(parameterized.TestCase):
  """Train steps of RoutedMoE for every config x mode, on all three paths.

  One test per (config, mode) row computes its cells, so that no two tests
  (and no two pytest-xdist workers) compile the same step. The default run
  holds every mode and every config once, each on the paths `DEFAULT_ROWS`
  gives it; `test_train_steps_slow` the rest of the product, each row on
  all three paths.
  """

  @parameterized.parameters(*DEFAULT_ROWS)
  def test_train_steps(self, config, mode):
    self.check_row(config, mode, DEFAULT_ROWS[config, mode])

  @testing.slow
  @parameterized.parameters(
      ("tiny_mixtral", "int8"),
      ("tiny_mixtral", "fp8"),
      ("tiny_mixtral", "nanoo_fp8"),
      ("tiny_gemma4_26b", "none"),
      ("tiny_gemma4_26b", "int8"),
      ("tiny_gemma4_26b", "fp8"),
      ("tiny_gemma4_26b", "nanoo_fp8"),
  )
  def test_train_steps_slow(self, config, mode):
    self.check_row(config, mode, tuple(MATMUL_PATHS))

  def check_row(self, config, mode, paths):
    cells = {path: _cell(config, path, mode) for path in paths}
    for path, cell in cells.items():
      with self.subTest(path=path):
        err = _rel_err(cell.outputs[-1], _reference(config, path))
        self.assertLess(err, BOUND[mode], "output vs the NumPy oracle")
        self._check_gradients_finite(cell.param_grads)
        self._check_compiled_types(cell.hlo, mode)
        if mode in FP8:
          self._check_fp8_state(cell.states, config, path, mode)
    if {"sparse", "dense"} <= set(cells):
      with self.subTest(path="sparse vs dense"):
        err = _rel_err(cells["sparse"].outputs[-1], cells["dense"].outputs[-1])
        self.assertLess(err, BOUND[mode])

  def _check_gradients_finite(self, grads):
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
      self.assertTrue(np.isfinite(leaf).all(), path)
      self.assertGreater(float(np.abs(leaf).max()), 0, path)

  def _check_compiled_types(self, text, mode):
    """The quantized types reach the expert contractions of the step."""
    if not FACTS[mode].quantized:
      self.assertEmpty(reading.quantized_types_in_hlo(text))
      return
    expected = {FWD_TYPE[mode], GRAD_TYPE[mode]}
    self.assertEqual(hlo.quantized_types_at_contractions(text), expected)
    by_site = {
        site: [
            c.quantized_inputs
            for c in hlo.contractions(text)
            if f"/{site}_dot/" in c.op_name
        ]
        for site in ("wi_0", "wi_1", "wo")  # the expert weights
    }
    for site, fed in by_site.items():
      self.assertTrue(any(FWD_TYPE[mode] in t for t in fed), (site, fed))
    # The gradient with respect to the hidden activations (wo's dlhs): for
    # int8, a second contraction of wo fed by s8 (the forward is the first).
    with_grad_type = [t for t in by_site["wo"] if GRAD_TYPE[mode] in t]
    self.assertGreaterEqual(
        len(with_grad_type),
        2 if FWD_TYPE[mode] == GRAD_TYPE[mode] else 1,
        by_site["wo"],
    )

  def _check_fp8_state(self, states, config, path, mode):
    """Each step's state "gradient" is the new state, per call site."""
    init, after_1, after_2 = states[:3]
    e4m3, e5m2 = quantization.FP8_DTYPES[mode]
    self.assertEqual(set(init), {f"{s}_dot" for s in SITES[path]})
    self.assertEqual(
        jax.tree.map(jnp.shape, after_1), jax.tree.map(jnp.shape, init)
    )
    for site, state in after_1.items():
      for role in ("input", "kernel", "output_grad"):
        history = state[f"{role}_amax_history"]
        self.assertEqual(history.shape, (1024,))
        self.assertGreater(float(history[0]), 0, (site, role))
        np.testing.assert_array_equal(history[1:], 0)
        # Delayed scaling: step 1 had an empty history, so the scale stays 1;
        # step 2 scales by the amax step 1 recorded.
        np.testing.assert_array_equal(state[f"{role}_scale"], [1.0])
        fp8_max = float(jnp.finfo(e5m2 if role == "output_grad" else e4m3).max)
        np.testing.assert_allclose(
            after_2[site][f"{role}_scale"], history[0] / fp8_max, rtol=1e-6
        )
    params = _params(config)
    for site in ("wi_0", "wi_1", "wo"):  # the new value, computed here
      np.testing.assert_array_equal(
          after_1[f"{site}_dot"]["kernel_amax_history"][0],
          jnp.max(jnp.abs(params[site])),
      )
    flat = {
        site: np.concatenate([np.ravel(v) for v in jax.tree.leaves(s)])
        for site, s in after_1.items()
    }
    for a, state_a in flat.items():
      for b, state_b in flat.items():
        if a < b:
          self.assertFalse(np.array_equal(state_a, state_b), (a, b))

  @parameterized.product(config=CONFIGS, path=tuple(MATMUL_PATHS))
  def test_params_layout_same_for_every_mode(self, config, path):
    layouts, collections = {}, {}
    for mode in MODES:
      cfg = load_moe_config(config, quantization=mode, **MATMUL_PATHS[path])
      x = _inputs(cfg)[0]
      variables = jax.eval_shape(RoutedMoE(cfg).init, jax.random.key(0), x)
      layouts[mode] = jax.tree_util.tree_map_with_path(
          lambda p, a: (jax.tree_util.keystr(p), a.shape, a.dtype),
          variables["params"],
      )
      collections[mode] = set(variables)
    for mode in MODES:
      self.assertEqual(layouts[mode], layouts["none"], mode)
    self.assertEqual(collections["none"], {"params"})
    self.assertEqual(collections["int8"], {"params"})
    self.assertEqual(collections["fp8"], {"params", OWG})

  def test_int8_forward_needs_no_rng_but_gradient_does(self):
    x, w = jnp.ones((4, 8)), jnp.ones((8, 2))

    def loss(w, rngs):
      out = quantization.Int8Einsum().apply({}, "mk,kn->mn", x, w, rngs=rngs)
      return jnp.sum(out)

    jax.eval_shape(loss, w, {})  # the forward alone needs no RNG

    rngs = {variables.AQT_RNG_STREAM: jax.random.key(0)}
    jax.eval_shape(jax.grad(loss), w, rngs)
    with self.assertRaisesRegex(ValueError, r'rngs=\{"params": key\}'):
      jax.eval_shape(jax.grad(loss), w, {})


class ErrorsTest(parameterized.TestCase):

  def test_unknown_mode_lists_allowed(self):
    allowed = r"\('none', 'int8', 'fp8', 'nanoo_fp8'\)"
    with self.assertRaisesRegex(ValueError, "'int4'.*" + allowed):
      quantization.contraction_modules("int4")
    with self.assertRaisesRegex(ValueError, "int4.*" + allowed):
      load_moe_config("tiny_mixtral", quantization="int4")
    with self.assertRaisesRegex(ValueError, "int4.*" + allowed):
      MoEConfig(4, 2, 8, 16, quantization="int4")

  def test_unknown_option_lists_allowed(self):
    with self.assertRaisesRegex(ValueError, "history.*amax_history_length"):
      quantization.contraction_modules("fp8", history=16)

  def test_unknown_call_site_lists_registered(self):
    model = RoutedMoE(load_moe_config("tiny_mixtral"))
    a = jnp.ones((2, 3))
    with self.assertRaisesRegex(
        ValueError, "'wi_2'.*'wi_0', 'wi_1', 'wo', 'dispatch', 'combine'"
    ):
      model.apply({}, "wi_2", "ij,jk->ik", a, a.T, method=model.einsum)
    sizes = jnp.array([2], jnp.int32)
    with self.assertRaisesRegex(ValueError, "'gate'.*'wi_0', 'wi_1', 'wo'"):
      model.apply({}, "gate", a, a.T[None], sizes, method=model.grouped)


def _numpy_int8(x, axis):
  """AQT's int8 grid from the formula: (round_half_even(clip(x / s, -127,
  127)), s) with s = max|x| / 127.5 along `axis` (1 for an all-zero slice)."""
  x = np.asarray(x, np.float64)
  amax = np.max(np.abs(x), axis=axis, keepdims=True)
  scale = np.where(amax == 0, 1.0, amax) / 127.5
  return np.round(np.clip(x / scale, -127, 127)), scale


def _numpy_int8_grouped(lhs, rhs, group_sizes):
  """[M, K] x [G, K, N] on the int8 grid: lhs per row, rhs per group and
  output channel; integer products, rescaled; rows past the groups 0."""
  q_lhs, s_lhs = _numpy_int8(lhs, 1)
  q_rhs, s_rhs = _numpy_int8(rhs, 1)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    rows = slice(start, start + size)
    out[rows] = (q_lhs[rows] @ q_rhs[g]) * s_lhs[rows] * s_rhs[g]
    start += size
  return out


class Int8GroupedMatmulTest(parameterized.TestCase):
  """The int8 grouped matmul on its own: scales, zero rows, gradients."""

  GROUP_SIZES = jnp.array([10, 0, 9], jnp.int32)  # 19 of 24 rows, one empty

  def _operands(self):
    lhs = jax.random.normal(jax.random.key(0), (24, 16))
    rhs = jax.random.normal(jax.random.key(1), (3, 16, 8))
    return lhs, rhs

  def test_quantize_int8(self):
    # AQT's grid: max|x| maps to 127.5, values clip to +-127, ties to even.
    x = jnp.array([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = int8_grouped.quantize_int8(x, axis=1)
    self.assertEqual(q.dtype, jnp.int8)
    np.testing.assert_allclose(scale, [[2.0 / 127.5], [1.0 / 127.5]])
    np.testing.assert_array_equal(q, [[64, -127, 32, 0], [0, 0, 0, 0]])

  def test_quantize_int8_is_aqts(self):
    # The sparse path's quantizer puts weights on the einsum path's (AQT's)
    # grid, bit for bit: one int8 grid for training on both paths and for
    # the converted serving weights.
    quantizer = aqt_quantizer.quantizer_make(8)
    for shape, axis in (((3, 16, 8), 1), ((24, 16), 1), ((2, 3, 5, 7), 2)):
      x = jax.random.normal(jax.random.key(len(shape)), shape)
      x = x.at[0].set(0.0)  # an all-zero slice
      qt, _ = quantizer.quant(x, calibration_axes=[axis])
      q, scale = int8_grouped.quantize_int8(x, axis)
      np.testing.assert_array_equal(q, qt.qvalue)
      np.testing.assert_array_equal(scale, qt.scale[0])

  @parameterized.parameters("ragged_dot", "auto")
  def test_matches_numpy_on_the_int8_grid(self, implementation):
    # Reference: NumPy quantizes both operands from the formula (per row,
    # per group and output channel) and multiplies the integers exactly.
    lhs, rhs = self._operands()
    out = jax.jit(int8_grouped.int8_grouped_matmul, static_argnums=3)(
        lhs, rhs, self.GROUP_SIZES, implementation
    )
    expected = _numpy_int8_grouped(lhs, rhs, self.GROUP_SIZES)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[19:], 0)

  def test_gradients(self):
    lhs, rhs = self._operands()
    g = jax.random.normal(jax.random.key(4), (24, 8))
    sizes = self.GROUP_SIZES

    def int8_loss(a, b):
      return jnp.sum(int8_grouped.int8_grouped_matmul(a, b, sizes) * g)

    def float_loss(a, b):
      return jnp.sum(gmm_lib.grouped_matmul(a, b, sizes) * g)

    dlhs, drhs = jax.jit(jax.grad(int8_loss, argnums=(0, 1)))(lhs, rhs)
    dlhs_ref, drhs_ref = jax.jit(jax.grad(float_loss, (0, 1)))(lhs, rhs)
    # drhs is straight-through: the float gradient at the float operands.
    np.testing.assert_allclose(drhs, drhs_ref, rtol=1e-6, atol=1e-6)
    # dlhs is an int8 grouped matmul, on the int8 grid (round to nearest),
    # of the cotangent (a scale per row) with rhs^T [G, N, K] (a scale per
    # group and column of rhs): exactly the forward's formula.
    expected = _numpy_int8_grouped(g, np.swapaxes(rhs, 1, 2), sizes)
    np.testing.assert_allclose(dlhs, expected, rtol=1e-5, atol=1e-5)
    self.assertGreater(_rel_err(dlhs, dlhs_ref), 0)  # not the float one
    np.testing.assert_array_equal(dlhs[19:], 0)


class HloTest(absltest.TestCase):

  def test_finds_types_through_converts_and_fusions(self):
    def qdq_matmul(x, w):
      x = x.astype(jnp.float8_e4m3fn).astype(jnp.float32) * 2.0
      return x @ w

    args = (jnp.ones((4, 8)), jnp.ones((8, 2)))
    text = jax.jit(qdq_matmul).lower(*args).compile().as_text()
    self.assertEqual(hlo.quantized_types_at_contractions(text), {"f8e4m3fn"})
    text = jax.jit(jnp.matmul).lower(*args).compile().as_text()
    self.assertEqual(hlo.quantized_types_at_contractions(text), set())
    self.assertLen(hlo.contractions(text), 1)

  def test_gemm_custom_calls_are_contractions(self):
    # What XLA:GPU writes for an fp8 matmul (cuBLASLt), by hand: the GEMM is
    # a custom call fed fp8 operands directly; the other custom call is not
    # a contraction.
    text = """HloModule m

ENTRY %main (p0: f8e4m3fn[16,64], p1: f8e4m3fn[32,64]) -> f32[16,32] {
  %p0 = f8e4m3fn[16,64]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,64]{1,0} parameter(1)
  %one = f32[] constant(1)
  %gemm = (f32[16,32]{1,0}, s8[33554432]{0}) custom-call(%p0, %p1, %one, %one), custom_call_target="__cublas$lt$matmul$f8"
  %out = f32[16,32]{1,0} get-tuple-element(%gemm), index=0
  ROOT %sort = f32[16,32]{1,0} custom-call(%out), custom_call_target="TopK"
}
"""
    (gemm,) = hlo.contractions(text)
    self.assertEqual((gemm.name, gemm.opcode), ("gemm", "custom-call"))
    self.assertEqual(gemm.quantized_inputs, {"f8e4m3fn"})


if __name__ == "__main__":
  absltest.main()
