"""A non-finite step is skipped, in both front ends, with gradient accumulation.

fp8 training of a one-layer decoder on one batch, repeated; the second step
gets a poisoned copy of it: one token id out of range, which the embedding
maps to NaN inside `jit` (`linen_moe.tokens`), so the loss and every gradient
are NaN, as after a corrupt example or an overflow. That step must leave the
whole state as it was (but for the step counter and the skip count), and
training must go on. With two microbatches, only the second is poisoned, and
the whole step is skipped. The mesh case is in `tests/layer/test_sharding.py`.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from linen_moe import load_model_config
from linen_moe import testing
from linen_moe._src.training import skip
from linen_moe.frontend import all_finite
from linen_moe.frontend import keep_if_finite
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from nnx_adapter import frontend as get_frontend


def _comparable(frontend: str, state):
  """Everything a skipped step must leave unchanged, as one pytree."""
  if frontend == "linen":
    return (state.params, state.fp8_state, state.opt_state)
  model, optimizer = state.merge()
  return (nnx.state(model), optimizer.opt_state)


@functools.cache
def _run(frontend: str, grad_accum: int):
  cfg = load_model_config("tiny_mixtral", quantization="fp8", num_layers=1)
  fe = get_frontend(frontend)
  optimizer = default_optimizer(1e-2)
  good = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(4, 8, seed=1)))
  bad = good.at[3, 5].set(cfg.vocab_size)  # in the last microbatch
  state = fe.init(cfg, optimizer, good, jax.random.key(0))
  step = jax.jit(fe.make_step(cfg, optimizer, grad_accum))
  states, metrics = [state], []
  for i, tokens in enumerate((good, bad, good, good)):
    state, m = step(state, tokens, jax.random.key(i + 1))
    states.append(state)
    metrics.append(jax.device_get(m))
  return states, metrics


class KeepIfFiniteTest(absltest.TestCase):

  def test_the_finite_check_is_compiled_once(self):
    # One is-finite per gradient leaf and the loss. XLA would otherwise copy
    # the chain of checks into the fused update of every leaf: leaves x
    # leaves ops, and a compile time that grows with them.
    leaves = 16  # without the barrier: 65 is-finite ops (measured)
    params = {f"w{i}": jnp.full((i + 1, 3), 0.1 * i) for i in range(leaves)}
    optimizer = default_optimizer(1e-3)

    def step(params, opt_state, x):
      loss, grads = jax.value_and_grad(
          lambda p: sum(jnp.sum(jnp.sin(w * x)) for w in p.values())
      )(params)
      updates, new_opt_state = optimizer.update(grads, opt_state, params)
      new = (optax.apply_updates(params, updates), new_opt_state)
      ok = all_finite((loss, grads))
      return keep_if_finite(ok, new, (params, opt_state))

    args = (params, optimizer.init(params), 1.0)
    compiled = jax.jit(step).lower(*args).compile()  # compiled once here
    self.assertLessEqual(compiled.as_text().count(" is-finite("), leaves + 1)
    new_params, _ = compiled(*args)
    self.assertFalse(np.array_equal(new_params["w5"], params["w5"]))


class SkipStepTest(parameterized.TestCase):

  def test_poisoned_step_is_skipped_and_training_goes_on(self):
    self.check("linen", 2)

  # NNX's skipped step is the default run's on a mesh
  # (test_sharding.SkipStepOnMeshTest); here in the slow set.
  @testing.slow
  @parameterized.parameters(("linen", 1), ("nnx", 2), ("nnx", 1))
  def test_poisoned_step_is_skipped_and_training_goes_on_slow(
      self, frontend, grad_accum
  ):
    self.check(frontend, grad_accum)

  def check(self, frontend, grad_accum):
    states, metrics = _run(frontend, grad_accum)
    self.assertEqual([int(m["skipped"]) for m in metrics], [0, 1, 0, 0])
    self.assertEqual([int(m["skipped_steps"]) for m in metrics], [0, 1, 1, 1])
    self.assertEqual(int(states[-1].skipped_steps), 1)
    self.assertFalse(np.isfinite(metrics[1]["loss"]))
    self.assertEqual([int(s.step) for s in states], [0, 1, 2, 3, 4])

    before, after = (_comparable(frontend, s) for s in states[1:3])
    self.assertTrue(bool(all_finite(after)))
    jax.tree.map(np.testing.assert_array_equal, after, before)
    fp8 = get_frontend(frontend).fp8_state(states[2])
    self.assertNotEmpty(jax.tree.leaves(fp8))

    # The steps after the skip apply: the state moves, and the loss on the
    # batch keeps falling (each loss is computed before its step's update).
    moved = jax.tree.map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
        _comparable(frontend, states[3]),
        after,
    )
    self.assertGreater(max(jax.tree.leaves(moved)), 0)
    losses = [float(m["loss"]) for m in metrics]
    self.assertLess(losses[2], losses[0])
    self.assertLess(losses[3], losses[2])
    self.assertTrue(bool(all_finite(_comparable(frontend, states[-1]))))


class SkipRuleTest(absltest.TestCase):

  def test_all_finite_and_keep(self):
    new = {"a": jnp.array([1.0, jnp.nan]), "n": jnp.array(3)}
    old = {"a": jnp.array([0.0, 0.0]), "n": jnp.array(2)}
    self.assertFalse(bool(all_finite(new)))
    self.assertTrue(bool(all_finite(old)))
    self.assertTrue(bool(all_finite({"n": jnp.array(1)})))  # ints: no
    kept = keep_if_finite(all_finite(new), new, old)
    jax.tree.map(np.testing.assert_array_equal, kept, old)
    kept = keep_if_finite(jnp.array(True), new, old)
    jax.tree.map(np.testing.assert_array_equal, kept, new)

  def test_apply_if_finite(self):
    state = {"a": jnp.array([1.0, 2.0]), "n": jnp.array(3)}

    def update(s):
      return {"a": s["a"] * 3.0, "n": s["n"] + 1}

    step = jax.jit(
        lambda ok, s: skip.apply_if_finite(ok, update, s), donate_argnums=1
    )
    applied = step(jnp.array(True), jax.tree.map(jnp.copy, state))
    np.testing.assert_array_equal(applied["a"], [3.0, 6.0])
    self.assertEqual(int(applied["n"]), 4)
    kept = step(jnp.array(False), jax.tree.map(jnp.copy, state))
    jax.tree.map(np.testing.assert_array_equal, kept, state)


if __name__ == "__main__":
  absltest.main()
