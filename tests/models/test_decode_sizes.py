"""The sparse path at decode sizes: every expert on every token, or the
chosen experts' weights alone.

A handful of tokens (`sparse.uses_every_expert`) takes `sparse.every_expert`,
more take the sorted grouped matmuls (`sparse.sparse_experts`). Both must be
the same layer: against the NumPy oracle, and against each other in every
quantization mode, forward and backward, the fp8 state's new values
included, and from converted serving weights. Fewer choices than experts in
float (`sparse.uses_chosen_experts`) take `sparse.chosen_experts`: the same
checks, in float.
"""

import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import RoutedMoE
from linen_moe import load_moe_config
from linen_moe import quantization
from linen_moe import testing
from linen_moe._src.config.variables import AQT_RNG_STREAM
from linen_moe._src.layer import sparse
from linen_moe._src.testing import helpers
from linen_moe.sharding import unbox
from tests import numpy_reference

# (config, decode-step tokens [B, 1]): Mixtral (E=8, k=2) at batch 8, the
# Gemma-4 style layer (E=16, k=8, shared expert) at batch 2; both take
# `every_expert`.
CASES = {"tiny_mixtral": 8, "tiny_gemma4_26b": 2}
MODES = ("none", "int8", "fp8", "nanoo_fp8")
# The default run compares these, every mode but nanoo_fp8 (fp8's code with
# other types) once, each config once; the slow set adds the others.
DEFAULT = (
    ("tiny_mixtral", "int8"),
    ("tiny_mixtral", "fp8"),
    ("tiny_gemma4_26b", "none"),
)


def _x(config, batch: int, seed: int = 1):
  return jax.random.normal(jax.random.key(seed), (batch, 1, config.emb_dim))


def _sorted_path():
  """Forces the sorted grouped matmuls at every size."""
  return mock.patch.object(sparse, "EVERY_EXPERT_MAX_TOKENS", 0)


_rel_err = helpers.rel_err


@functools.cache
def _variables(name: str, mode: str = "none"):
  config = load_moe_config(name, quantization=mode)
  x = _x(config, CASES[name])
  return unbox(jax.jit(RoutedMoE(config).init)(jax.random.key(0), x))


@functools.cache
def _two_steps(name: str, mode: str, every: bool):
  """Two gradient steps of the layer (the fp8 state overwritten in between):
  per step the output, the gradients of params and input, the new fp8
  state."""
  config = load_moe_config(name, quantization=mode)
  model = RoutedMoE(config)
  x = _x(config, CASES[name])
  variables = dict(_variables(name, mode))
  params = variables.pop("params")

  def loss(params, state, x):
    y, aux = model.apply(
        {"params": params, **state},
        x,
        rngs={AQT_RNG_STREAM: jax.random.key(2)},
    )
    return jnp.sum(jnp.sin(y)) + aux.load_balance_loss, y

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  with mock.patch.object(
      sparse, "EVERY_EXPERT_MAX_TOKENS", sparse.EVERY_EXPERT_MAX_TOKENS * every
  ):
    step = jax.jit(grad).lower(params, variables, x).compile()
  steps = []
  for _ in range(2):
    (_, y), (dparams, dstate, dx) = step(params, variables, x)
    steps.append((y, dparams, dx, dstate))
    variables = dstate  # the fp8 rule: the "gradient" is the new value
  return steps


class RuleTest(absltest.TestCase):

  def test_chosen_by_token_count(self):
    self.assertTrue(sparse.uses_every_expert(8, 8, 2))
    self.assertTrue(sparse.uses_every_expert(4, 8, 2))  # 8 choices, 8 experts
    self.assertFalse(sparse.uses_every_expert(3, 8, 2))  # fewer choices
    self.assertFalse(sparse.uses_every_expert(9, 8, 2))  # past decode sizes
    self.assertFalse(sparse.uses_every_expert(1, 128, 8))

  def test_chosen_experts_by_choices_and_mode(self):
    self.assertTrue(sparse.uses_chosen_experts(1, 8, 2, False))
    self.assertTrue(sparse.uses_chosen_experts(3, 8, 2, False))
    self.assertFalse(sparse.uses_chosen_experts(4, 8, 2, False))  # 8 choices
    self.assertFalse(sparse.uses_chosen_experts(1, 8, 2, True))  # quantized
    self.assertFalse(sparse.uses_chosen_experts(9, 128, 8, False))

  def test_layer_takes_it_at_decode_sizes_only(self):
    config = load_moe_config("tiny_mixtral")
    variables = _variables("tiny_mixtral")

    def lowered(x):
      return jax.jit(RoutedMoE(config).apply).lower(variables, x).as_text()

    # The sorted path sorts the assignments by expert; every_expert does not.
    self.assertNotIn("stablehlo.sort", lowered(_x(config, 8)))
    self.assertIn("stablehlo.sort", lowered(_x(config, 9)))


class EveryExpertTest(parameterized.TestCase):

  @parameterized.parameters(*CASES)
  def test_matches_numpy_reference(self, name):
    config = load_moe_config(name)
    x = _x(config, CASES[name])
    variables = _variables(name)
    y, _ = jax.jit(RoutedMoE(config).apply)(variables, x)
    expected, _ = numpy_reference.moe_reference(
        variables["params"], np.asarray(x, np.float64), config
    )
    self.assertLess(_rel_err(y, expected), 1e-5)

  @parameterized.parameters(*DEFAULT)
  def test_equals_sorted_path(self, name, mode):
    _assert_equal_paths(self, name, mode)

  @parameterized.parameters("int8", "fp8", "nanoo_fp8")
  def test_serving_weights_equal_sorted_path(self, mode):
    name = "tiny_mixtral"
    config = load_moe_config(name, quantization=mode)
    variables = dict(_variables(name, mode))
    serve_config, serve_variables = quantization.quantize_weights(
        config, variables
    )
    x = _x(config, CASES[name])
    apply = RoutedMoE(serve_config).apply
    every = jax.jit(apply)(serve_variables, x)[0]
    with _sorted_path():
      ordered = jax.jit(apply)(serve_variables, x)[0]
    self.assertLess(_rel_err(every, ordered), 1e-6)


class ChosenExpertsTest(absltest.TestCase):
  """Batch 3 of tiny_mixtral (6 choices among 8 experts): chosen experts."""

  def test_matches_numpy_reference(self):
    config = load_moe_config("tiny_mixtral")
    x = _x(config, 3)
    variables = _variables("tiny_mixtral")
    y, _ = jax.jit(RoutedMoE(config).apply)(variables, x)
    expected, _ = numpy_reference.moe_reference(
        variables["params"], np.asarray(x, np.float64), config
    )
    self.assertLess(_rel_err(y, expected), 1e-5)

  def test_equals_sorted_path_forward_and_backward(self):
    config = load_moe_config("tiny_mixtral")
    x = _x(config, 3)
    variables = _variables("tiny_mixtral")

    def loss(params, x):
      y, aux = RoutedMoE(config).apply({"params": params}, x)
      return jnp.sum(jnp.sin(y)) + aux.load_balance_loss, y

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    lowered = jax.jit(grad).lower(variables["params"], x)
    self.assertNotIn("stablehlo.sort", lowered.as_text())
    (_, y), (dparams, dx) = lowered.compile()(variables["params"], x)
    with _sorted_path():
      (_, y_s), (dparams_s, dx_s) = jax.jit(grad)(variables["params"], x)
    self.assertLess(_rel_err(y, y_s), 1e-6)
    self.assertLess(_rel_err(dx, dx_s), 1e-6)
    for (path, want), got in zip(
        jax.tree_util.tree_leaves_with_path(dparams_s),
        jax.tree.leaves(dparams),
        strict=True,
    ):
      self.assertLess(_rel_err(got, want), 1e-6, jax.tree_util.keystr(path))

  def test_a_quantized_layer_keeps_the_sorted_path(self):
    config = load_moe_config("tiny_mixtral", quantization="int8")
    x = _x(config, 3)
    variables = _variables("tiny_mixtral", "int8")
    text = jax.jit(RoutedMoE(config).apply).lower(variables, x).as_text()
    self.assertIn("stablehlo.sort", text)


@testing.slow
class EveryExpertSlowTest(parameterized.TestCase):

  @parameterized.parameters(
      *((n, m) for n in CASES for m in MODES if (n, m) not in DEFAULT)
  )
  def test_equals_sorted_path(self, name, mode):
    _assert_equal_paths(self, name, mode)


def _assert_equal_paths(test, name: str, mode: str) -> None:
  """Both strategies' two steps: outputs, gradients, new fp8 state."""
  every, ordered = _two_steps(name, mode, True), _two_steps(name, mode, False)
  for i, (got, want) in enumerate(zip(every, ordered, strict=True)):
    names = ("y", "dparams", "dx", "fp8 state")
    for what, g, w in zip(names, got, want, strict=True):
      leaves = jax.tree_util.tree_leaves_with_path(w)
      got_leaves = jax.tree.leaves(g)
      test.assertLen(got_leaves, len(leaves), what)
      for (path, w_leaf), g_leaf in zip(leaves, got_leaves, strict=True):
        where = f"step {i + 1} {what}{jax.tree_util.keystr(path)}"
        test.assertLess(_rel_err(g_leaf, w_leaf), 1e-5, where)


if __name__ == "__main__":
  absltest.main()
