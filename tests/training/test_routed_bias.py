"""The aux-loss-free balancing rule in both front ends' train steps.

An overloaded expert's `routed_bias` falls and the loads even out with no
load-balance loss; with a frozen rule they do not. One step with gradient
accumulation moves the biases exactly as the rule on the whole batch's
loads (the 8-device case is `test_sharding.RoutedBiasMeshTest`). The
default run holds each front end at least once; the slow set the rest.
"""

import tempfile

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import checkpoint
from linen_moe import frontend
from linen_moe import load_model_config
from linen_moe import routing
from linen_moe import testing
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
import nnx_adapter
from nnx_adapter import frontend as get_frontend

OPTIMIZER = default_optimizer(1e-3)


def _config(rate, **overrides):
  cfg = load_model_config(
      "tiny_deepseek_v3", routed_bias_update_rate=rate, **overrides
  )
  assert cfg.moe.load_balance_loss_weight == 0.0  # no aux loss helps
  return cfg


def _set_bias(frontend, state, bias):
  """`state` with every layer's routed_bias set to `bias` [E]."""
  fill = lambda tree: jax.tree.map(  # noqa: E731
      lambda b: jnp.broadcast_to(bias, b.shape).astype(b.dtype), tree
  )
  if frontend == "linen":
    return state.replace(rule_state=fill(state.rule_state))
  model, optimizer = state.merge()
  rule_state = nnx.state(model, nnx_adapter.RuleState)
  nnx.replace_by_pure_dict(rule_state, fill(nnx.to_pure_dict(rule_state)))
  nnx.update(model, rule_state)
  return nnx_adapter.TrainState(*nnx.split((model, optimizer)))


def _bias_leaves(frontend, state):
  return jax.tree.leaves(get_frontend(frontend).rule_state(state))


class OverloadedExpertTest(parameterized.TestCase):

  def _train(self, frontend, rate, steps=60):
    """Trains from a state whose expert 0 is overloaded (its bias starts at
    +0.5, above the spread of the sigmoid scores); returns expert 0's bias
    after each step and the loads per step in units of the mean load."""
    cfg = _config(rate, num_layers=1)
    fe = get_frontend(frontend)
    batches = MarkovData(cfg.vocab_size).batches(4, 16, seed=1)
    state = fe.init(
        cfg, OPTIMIZER, jnp.asarray(next(batches)), jax.random.key(0)
    )
    state = _set_bias(frontend, state, jnp.zeros(16).at[0].set(0.5))
    step = jax.jit(fe.make_step(cfg, OPTIMIZER))
    biases, loads = [], []
    for i in range(steps):
      state, metrics = step(
          state, jnp.asarray(next(batches)), jax.random.key(i)
      )
      biases.append(float(_bias_leaves(frontend, state)[0].reshape(-1)[0]))
      loads.append(np.asarray(metrics["expert_load"][0]) * cfg.moe.num_experts)
    return np.array(biases), np.array(loads)

  def test_bias_falls_and_loads_even_out(self):
    self.check_bias_falls("linen")

  @testing.slow  # 60 steps; GradAccumulationTest has the NNX rule update
  def test_bias_falls_and_loads_even_out_in_nnx(self):
    self.check_bias_falls("nnx")

  def check_bias_falls(self, frontend):
    rate = 0.02
    biases, loads = self._train(frontend, rate)
    self.assertGreater(loads[0, 0], 2.5)  # overloaded: > 2.5x the mean load
    self.assertEqual(biases[0], np.float32(0.5) - np.float32(rate))
    # Every step moves expert 0's bias by the rule, from that step's load
    # (in units of the mean load: sign(1 - load)).
    np.testing.assert_allclose(
        np.diff(biases), rate * np.sign(1.0 - loads[1:, 0]), atol=1e-6
    )
    self.assertLess(biases[19], biases[0] - 0.1)  # mostly overloaded: falls
    tail = loads[-10:].mean(axis=0)  # measured: expert 0 1.12, max 1.20
    self.assertLess(tail[0], 1.3)
    self.assertLess(tail.max(), 1.5)

  @testing.slow  # the control of the test above: 60 more steps
  def test_frozen_bias_keeps_the_overload(self):
    biases, loads = self._train("linen", 0.0)
    np.testing.assert_array_equal(biases, 0.5)
    self.assertGreater(loads[-10:, 0].mean(), 2.5)  # measured: 3.4


class GradAccumulationTest(parameterized.TestCase):
  """The default run holds the NNX front end, unrolled (the Linen rule
  update is `OverloadedExpertTest`'s, Linen's accumulated step
  `tests/training/test_skip_steps.py`'s); Linen on a scanned stack is slow."""

  def test_update_equals_the_rule_on_the_whole_batch(self):
    self.check_update("nnx", False)

  @testing.slow
  def test_update_equals_the_rule_on_the_whole_batch_scanned_linen(self):
    self.check_update("linen", True)

  def check_update(self, frontend, scan):
    """One step with 2 microbatches; the expected biases come from the rule
    applied to the loads of a forward pass over the whole batch."""
    rate = 0.01
    cfg = _config(rate, scan_layers=scan)
    fe = get_frontend(frontend)
    tokens = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(4, 8, 2)))
    state = fe.init(cfg, OPTIMIZER, tokens, jax.random.key(0))
    bias0 = 0.05 * jax.random.normal(jax.random.key(1), (16,))
    state = _set_bias(frontend, state, bias0)
    if frontend == "linen":
      variables = {"params": state.params, "updated_by_rule": state.rule_state}
      _, aux = jax.jit(Decoder(cfg).apply)(variables, tokens)
    else:  # the model's forward, jitted (a copy: `state` stays as it is)
      graphdef, model_state = nnx.split(state.merge()[0])
      _, aux = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(
          model_state, tokens
      )
    load = aux["expert_load"]  # [L, E], the whole batch
    self.assertEqual(load.shape, (2, 16))
    new, _ = jax.jit(fe.make_step(cfg, OPTIMIZER, grad_accum=2))(
        state, tokens, jax.random.key(3)
    )
    got = np.stack([b.reshape(-1, 16) for b in _bias_leaves(frontend, new)])
    expected = routing.routed_bias_update(bias0, load, rate)  # [L, E]
    np.testing.assert_array_equal(got.reshape(2, 16), expected)
    # Most experts move (an expert exactly at the mean load keeps its bias).
    self.assertGreater(float(jnp.mean(expected != bias0)), 0.5)


class SkippedStepTest(parameterized.TestCase):
  """Linen by default (its rule state is a field of its own, which the skip
  must keep); NNX (the rule state inside the model's state, which
  `tests/training/test_skip_steps.py` compares whole) in the slow set."""

  def test_skipped_step_keeps_the_biases(self):
    self.check_skipped("linen")

  @testing.slow
  def test_skipped_step_keeps_the_biases_in_nnx(self):
    self.check_skipped("nnx")

  def check_skipped(self, frontend):
    """A step with a NaN loss (an out-of-range token id) changes no bias; the
    next, finite step moves them."""
    cfg = _config(0.01, num_layers=1)
    fe = get_frontend(frontend)
    good = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(2, 8, 4)))
    bad = good.at[1, 3].set(cfg.vocab_size)
    state = fe.init(cfg, OPTIMIZER, good, jax.random.key(0))
    step = jax.jit(fe.make_step(cfg, OPTIMIZER))
    skipped, m_bad = step(state, bad, jax.random.key(1))
    moved, m_good = step(skipped, good, jax.random.key(2))
    self.assertEqual((int(m_bad["skipped"]), int(m_good["skipped"])), (1, 0))
    before, after = _bias_leaves(frontend, state), _bias_leaves(
        frontend, skipped
    )
    jax.tree.map(np.testing.assert_array_equal, after, before)
    self.assertGreater(
        float(jnp.abs(_bias_leaves(frontend, moved)[0] - after[0]).max()), 0.0
    )


class CheckpointTest(absltest.TestCase):

  def test_saved_by_linen_restored_by_nnx(self):
    """The routed biases are in the checkpoint tree (`variables/
    updated_by_rule/...`), the same in both front ends, and come back."""
    cfg = _config(0.01, num_layers=1)
    tokens = jnp.zeros((2, 8), jnp.int32)
    bias = jnp.linspace(-0.1, 0.1, 16)
    linen = _set_bias(
        "linen",
        get_frontend("linen").init(cfg, OPTIMIZER, tokens, jax.random.key(3)),
        bias,
    )
    tree = frontend.tree_of(linen)
    path = ("layers", "moe", "routed_experts", "routed_bias")
    saved = tree[frontend.VARIABLES]["updated_by_rule"]
    np.testing.assert_array_equal(
        saved["layers"]["moe"]["routed_experts"]["routed_bias"][0], bias
    )
    fe = nnx_adapter.NNXFrontend
    template = fe.init(cfg, OPTIMIZER, tokens, jax.random.key(3))
    with tempfile.TemporaryDirectory() as directory:
      with checkpoint.Checkpoints(directory) as ckpts:
        ckpts.save(1, tree, {"model_config": checkpoint.config_dict(cfg)})
      with checkpoint.Checkpoints(directory) as ckpts:
        restored = ckpts.restore(fe.checkpoint_tree(template), config=cfg)
    state = fe.from_checkpoint_tree(restored.tree, template)
    rule = fe.rule_state(state)
    for key in path:
      rule = rule[key]
    np.testing.assert_array_equal(rule[0], bias)


if __name__ == "__main__":
  absltest.main()
