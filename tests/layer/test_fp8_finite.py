"""fp8 amax histories never record a non-finite amax, at the layer level.

A step differentiates a loss with respect to the fp8 state and writes the
"gradient" back (the overwrite-with-gradient rule), as any train step does.
The references are the delayed-scaling formulas: the amax a step records is
max |x| of its input (or of its output gradient), and the scale a step
returns is max(history before the step) / fp8_max.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import RoutedMoE
from linen_moe import load_moe_config
from linen_moe import testing
from linen_moe._src.quantization import contractions as quantization
from linen_moe.variables import OVERWRITE_WITH_GRADIENT as OWG

ROLES = ("input", "kernel", "output_grad")
HISTORY = 4


@functools.cache
def _einsum_step(mode: str):
  """(state, x, w) -> (y, new_state) of an fp8 einsum, loss sum(y**2)."""
  modules = quantization.contraction_modules(mode, amax_history_length=HISTORY)
  layer = modules.einsum(**modules.einsum_kwargs)

  def loss(state, x, w):
    y = layer.apply({OWG: state}, "mk,kn->mn", x, w)
    return jnp.sum(jnp.square(y)), y

  def step(state, x, w):
    (_, y), new_state = jax.value_and_grad(loss, has_aux=True)(state, x, w)
    return y, new_state

  x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
  state = layer.init(jax.random.key(0), "mk,kn->mn", x, w)[OWG]
  return jax.jit(step), state


def _fp8_max(mode: str, role: str) -> float:
  e4m3, e5m2 = quantization.FP8_DTYPES[mode]
  return float(jnp.finfo(e5m2 if role == "output_grad" else e4m3).max)


def _record(history, amax) -> np.ndarray:
  """Flax's history update (roll left by one, newest amax at index 0), with
  a non-finite amax recorded as 0."""
  new = np.roll(np.asarray(history, np.float32), -1)
  new[0] = amax if np.isfinite(amax) else 0
  return new


def _amax(x) -> np.float32:
  return np.float32(np.max(np.abs(np.asarray(x, np.float32))))


class Fp8EinsumTest(parameterized.TestCase):
  """One einsum: x1 (finite), x2 (one inf or nan), x3 (finite, larger), x1."""

  @parameterized.product(mode=("fp8", "nanoo_fp8"), bad=(np.inf, np.nan))
  def test_bad_input_is_not_recorded_and_scales_adapt(self, mode, bad):
    step, state = _einsum_step(mode)
    w = jax.random.normal(jax.random.key(2), (8, 2))
    x1 = jax.random.normal(jax.random.key(1), (4, 8))
    x2 = x1.at[1, 3].set(bad)
    x3 = 3.0 * x1
    y1, s1 = step(state, x1, w)
    y2, s2 = step(s1, x2, w)
    for role in ROLES:
      self.assertTrue(np.isfinite(s2[f"{role}_amax_history"]).all(), role)
      self.assertTrue(np.isfinite(s2[f"{role}_scale"]).all(), role)
    # x2's input amax (non-finite) is recorded as 0, the kernel's (finite) as
    # itself. The forward clips an inf to the fp8 range (the output and its
    # gradient stay finite); a nan propagates, and the output gradient's amax
    # is not recorded either.
    w_amax = _amax(w)
    g1_amax = _amax(2 * y1)  # d sum(y^2) / dy
    g2_amax = _amax(2 * y2)
    self.assertEqual(bool(np.isfinite(y2).all()), bool(np.isinf(bad)))
    zeros = np.zeros(HISTORY)
    expected_histories = {
        "input": _record(_record(zeros, _amax(x1)), _amax(x2)),
        "kernel": _record(_record(zeros, w_amax), w_amax),
        "output_grad": _record(_record(zeros, g1_amax), g2_amax),
    }
    for role, history in expected_histories.items():
      np.testing.assert_allclose(
          s2[f"{role}_amax_history"], history, rtol=1e-6, err_msg=role
      )
    if not np.isfinite(g2_amax):
      g2_amax = 0
    y3, s3 = step(s2, x3, w)
    _, s4 = step(s3, x1, w)
    # The scales adapt to x3 at once (Flax alone would keep the old scale
    # while the non-finite amax is in the window, i.e. for HISTORY steps).
    expected = {
        "input": max(_amax(x1), _amax(x3)),
        "kernel": w_amax,
        "output_grad": max(g1_amax, g2_amax, _amax(2 * y3)),
    }
    for role, amax in expected.items():
      np.testing.assert_allclose(
          s4[f"{role}_scale"], [amax / _fp8_max(mode, role)], rtol=1e-6
      )

  def test_nan_in_history_is_cleared(self):
    """A history that already holds a non-finite entry (an old checkpoint)
    is cleaned by the next step."""
    step, state = _einsum_step("fp8")
    state = dict(state, input_amax_history=jnp.array([0, 0, jnp.nan, 0]))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    _, new = step(state, x, jnp.ones((8, 2)))
    np.testing.assert_array_equal(
        new["input_amax_history"], [_amax(x), 0, 0, 0]
    )


@functools.cache
def _layer_step(mode: str, path: str):
  sparse = path == "sparse"
  cfg = load_moe_config(
      "tiny_mixtral",
      quantization=mode,
      sparse_matmul=sparse,
      fp8_amax_history_length=HISTORY,
  )
  model = RoutedMoE(cfg)
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.emb_dim))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  params = jax.tree.map(
      lambda b: getattr(b, "value", b),
      variables["params"],
      is_leaf=lambda b: hasattr(b, "value"),
  )

  def loss(state, x):
    y, aux = model.apply({"params": params, OWG: state}, x)
    return jnp.sum(jnp.square(y)) + aux.load_balance_loss

  return jax.jit(jax.grad(loss)), variables[OWG], x


class RoutedMoETest(parameterized.TestCase):

  @parameterized.parameters(("fp8", "sparse"), ("nanoo_fp8", "dense"))
  def test_inf_input_leaves_histories_finite(self, mode, path):
    self.check(mode, path)

  @testing.slow
  @parameterized.parameters(("fp8", "dense"), ("nanoo_fp8", "sparse"))
  def test_inf_input_leaves_histories_finite_slow(self, mode, path):
    self.check(mode, path)

  def check(self, mode, path):
    step, state, x = _layer_step(mode, path)
    state = step(state, x)
    poisoned = step(state, x.at[0, 3, 5].set(jnp.inf))
    for site in poisoned.values():
      for role in ROLES:
        history = site[f"{role}_amax_history"]
        self.assertTrue(np.isfinite(history).all(), role)
    after = step(step(poisoned, 2.0 * x), x)
    before = step(poisoned, 2.0 * x)
    for name, site in after.items():
      for role in ROLES:
        # The scale a step returns comes from the history before it: the
        # finite amaxes of x and 2x, not a frozen value.
        history = np.asarray(before[name][f"{role}_amax_history"])
        self.assertGreater(history.max(), 0, (name, role))
        np.testing.assert_allclose(
            site[f"{role}_scale"],
            [history.max() / _fp8_max(mode, role)],
            rtol=1e-6,
            err_msg=f"{name}/{role}",
        )


if __name__ == "__main__":
  absltest.main()
