"""linen_moe.jit_init: the compiled init builds exactly what Linen's init does."""

from absl.testing import absltest
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import RoutedMoE
from linen_moe import frontend
from linen_moe import load_moe_config
from linen_moe._src.layer import jit_init
from linen_moe.variables import OVERWRITE_WITH_GRADIENT


def _assert_same_variables(test, got, want):
  test.assertEqual(
      jax.tree.structure(got), jax.tree.structure(want), "variable layout"
  )
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(g, w)


class CompiledInitTest(absltest.TestCase):

  def test_equals_eager_linen_init_with_fp8_state(self):
    cfg = load_moe_config("tiny_mixtral", quantization="fp8")
    x = jnp.ones((1, 4, cfg.emb_dim))
    moe = RoutedMoE(cfg)
    got = moe.init(jax.random.key(3), x)  # the mixin's compiled init
    want = nn.Module.init(moe, jax.random.key(3), x)  # Linen's, eager
    self.assertIn(OVERWRITE_WITH_GRADIENT, got)
    _assert_same_variables(self, got, want)

  def test_equal_modules_share_one_program(self):
    cfg = load_moe_config("tiny_mixtral", num_experts=3)
    x = jnp.ones((1, 4, cfg.emb_dim))
    before = jit_init._jitted_init.top_level._cache_size()
    a = RoutedMoE(cfg).init(jax.random.key(0), x)
    self.assertEqual(jit_init._jitted_init.top_level._cache_size(), before + 1)
    b = RoutedMoE(cfg).init(jax.random.key(1), x)  # an equal, new module
    self.assertEqual(jit_init._jitted_init.top_level._cache_size(), before + 1)
    # Different keys, different draws: the key is an argument, not baked in.
    self.assertFalse(
        np.array_equal(a["params"]["wi_0"].value, b["params"]["wi_0"].value)
    )

  def test_placed_outputs_are_the_arguments_a_restore_gives(self):
    # A restored checkpoint's arrays are committed to their device: a step
    # jitted over `placed` outputs is then one program for both.
    device = jax.devices()[0]
    make = lambda placed: frontend.jit_once(  # noqa: E731
        lambda k: jax.random.normal(k, (3,)), placed=placed
    )(jax.random.key(0))
    restored = jax.device_put(np.ones(3, np.float32), device)
    for placed, programs in ((True, 1), (False, 2)):
      with self.subTest(placed=placed):
        step = jax.jit(lambda x: x + 1)
        step(make(placed))
        step(restored)
        self.assertEqual(step._cache_size(), programs)
    np.testing.assert_array_equal(make(True), make(False))  # no other value

  def test_placed_must_be_a_bool(self):
    with self.assertRaisesRegex(TypeError, "placed='yes' must be True or"):
      frontend.jit_once(lambda x: x, placed="yes")

  def test_under_jit_and_with_linen_options(self):
    cfg = load_moe_config("tiny_mixtral")
    x = jnp.ones((1, 4, cfg.emb_dim))
    moe = RoutedMoE(cfg)
    want = nn.Module.init(moe, jax.random.key(0), x)
    # Inside another jit the init is traced into that program.
    _assert_same_variables(self, jax.jit(moe.init)(jax.random.key(0), x), want)
    # Linen-only arguments take Linen's own init.
    got = moe.init(jax.random.key(0), x, mutable=["params"])
    _assert_same_variables(self, got, {"params": want["params"]})

  def test_python_arguments_fall_back_to_eager(self):
    class Scaled(nn.Module):

      @nn.compact
      def __call__(self, x, double: bool):
        y = nn.Dense(2)(x)
        return 2 * y if double else y

    x = jnp.ones((1, 3))
    got = frontend.compiled_init(Scaled(), jax.random.key(0), x, double=True)
    want = nn.Module.init(Scaled(), jax.random.key(0), x, double=True)
    _assert_same_variables(self, got, want)


if __name__ == "__main__":
  absltest.main()
