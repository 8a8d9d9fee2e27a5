"""The training recipe's defaults, pinned to the values the docs state.

`default_optimizer()` is "AdamW after clipping the global gradient norm to
1" with "a constant rate, no weight decay" (docs/guides/training.md), at
its signature's learning rate of 1e-2 and optax's AdamW constants (eps
1e-8); the MoE layer's loss weights and rules default to the layer guide's
table (docs/guides/layer.md) and the load-balance weight to 0.01. A
changed default is a changed training run: each one here is a red test.
`test_optimizer` pins the rest of the recipe (betas, the schedules and
their default final ratio, the weight-decay mask).
"""

from absl.testing import absltest
import jax
import numpy as np
import optax

from linen_moe import MoEConfig
from linen_moe import training


class OptimizerDefaultsTest(absltest.TestCase):
  """The first update of `default_optimizer()` against AdamW's formula.

  One step of Adam moves each parameter by lr * g / (|g| + eps) (the bias
  corrections cancel the betas), so gradients of the size of eps pin eps,
  and with them the clipping: a global norm of 4 clipped to 1 turns 4e-8
  into 1e-8 = eps, half a step. A kernel (which decays) with a zero
  gradient stays exactly where it was: no weight decay by default.
  """

  def test_first_update_of_the_defaults(self):
    lr, eps, max_norm = 1e-2, 1e-8, 1.0
    params = {
        "norm": {"scale": np.ones(3, np.float32)},
        "w": {"kernel": np.full(2, 100.0, np.float32)},
    }
    grads = {
        "norm": {"scale": np.array([4e-8, -8e-8, 4.0], np.float32)},
        "w": {"kernel": np.zeros(2, np.float32)},
    }
    tx = training.default_optimizer()
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    got = optax.apply_updates(params, updates)

    g = grads["norm"]["scale"].astype(np.float64)
    g *= min(1.0, max_norm / np.linalg.norm(g))  # the global norm: 4
    want = 1.0 - lr * g / (np.abs(g) + eps)  # 1 - lr * [1/2, -2/3, ~1]
    np.testing.assert_allclose(got["norm"]["scale"], want, rtol=1e-6)
    np.testing.assert_array_equal(got["w"]["kernel"], params["w"]["kernel"])

  def test_schedule_is_constant_without_warmup(self):
    rate = training.learning_rate_schedule(0.02)
    self.assertEqual([float(rate(n)) for n in (0, 1, 10**6)], [0.02] * 3)
    # The schedules the docs list, in their order.
    self.assertEqual(training.SCHEDULES, ("constant", "cosine", "linear"))


class LossWeightDefaultsTest(absltest.TestCase):
  """The auxiliary losses' weights and the routing rules a layer trains
  with when its config does not say: the layer guide's table."""

  def test_moe_config_defaults(self):
    cfg = MoEConfig(
        num_experts=4, num_experts_per_tok=2, emb_dim=8, moe_mlp_dim=8
    )
    want = {
        "load_balance_loss_weight": 0.01,
        "router_z_loss_weight": 0.0,
        "routed_bias_update_rate": 0.0,  # frozen
        "router_jitter": 0.0,
        "routed_scaling_factor": 1.0,
        "capacity_factor": 0.0,  # dropless
        "drop_policy": "position",
        "sparse_matmul": True,
    }
    self.assertEqual({name: getattr(cfg, name) for name in want}, want)


if __name__ == "__main__":
  absltest.main()
