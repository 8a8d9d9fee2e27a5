"""Layer stacks: which layers scan, their names, conversions between layouts."""

import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import checkpoint
from linen_moe import frontend
from linen_moe import load_model_config
from linen_moe import testing
from linen_moe._src.checkpoint import tree as ckpt_tree
from linen_moe._src.models import layer_stack
from linen_moe.frontend import routed_bias_rule
from linen_moe.models import StackPlan
from linen_moe.sharding import unbox

D, M, S, F = "dense", "moe", "sliding", "full"


def _tree(plan: StackPlan, kinds) -> dict:
  """A fake params tree in `plan`'s layout: layer i holds [i] in `w` and
  its kind's own leaf."""
  unrolled = {
      frontend.layer_name(i): {
          "w": jnp.full((2,), float(i)),
          kind: jnp.full((3,), float(i)),
      }
      for i, kind in enumerate(kinds)
  }
  return layer_stack.to_scanned(unrolled, plan)


class StackPlanTest(parameterized.TestCase):

  @parameterized.parameters(
      ((M, M, M), StackPlan(3, 0, 1, 3)),  # today's configs: `layers` [L]
      ((M,), StackPlan(1, 0, 1, 1)),
      ((D, M, M), StackPlan(3, 1, 1, 2)),  # a dense layer 0
      ((D, M, D, M), StackPlan(4, 0, 2, 2)),  # decoder_sparse_step 2
      ((D, D, D) + (M,) * 58, StackPlan(61, 3, 1, 58)),  # DeepSeek-V3
      (((S,) * 5 + (F,)) * 5, StackPlan(30, 0, 6, 5)),  # Gemma-4
      ((M, M, D), StackPlan(3, 0, 1, 2)),  # a dense layer last
  )
  def test_for_kinds(self, kinds, plan):
    self.assertEqual(StackPlan.for_kinds(kinds, scan=True), plan)
    self.assertEqual(
        StackPlan.for_kinds(kinds, scan=False), StackPlan(len(kinds))
    )
    for r in range(plan.repeats):
      for j in range(plan.period):
        self.assertEqual(kinds[plan.layer(r, j)], kinds[plan.layer(0, j)])
        self.assertEqual(plan.slot(plan.layer(r, j)), (r, j))
    for i in plan.before + plan.after:
      self.assertIsNone(plan.slot(i))
    self.assertEqual(
        len(plan.before) + len(plan.after) + plan.period * plan.repeats,
        len(kinds),
    )

  @parameterized.parameters(
      ((D, M, M),), ((D, M, D, M),), ((M, M, M),), ((M, D, M, D, M),)
  )
  def test_convert_round_trip_and_plan_of_tree(self, kinds):
    plan = StackPlan.for_kinds(kinds, scan=True)
    scanned = _tree(plan, kinds)
    flat = traverse_util.flatten_dict(scanned)
    self.assertEqual(layer_stack.plan_of_tree(flat), plan)
    unrolled = layer_stack.to_unrolled(scanned, plan)
    for i, kind in enumerate(kinds):
      layer = unrolled[frontend.layer_name(i)]
      np.testing.assert_array_equal(layer["w"], [i, i])
      np.testing.assert_array_equal(layer[kind], [i, i, i])
    back = layer_stack.to_scanned(unrolled, plan)
    jax.tree.map(np.testing.assert_array_equal, back, scanned)
    for path, leaf in flat.items():
      rows = layer_stack.layer_rows(path, plan)
      np.testing.assert_array_equal(np.asarray(leaf)[..., 0], rows)

  def test_rejects(self):
    with self.assertRaisesRegex(ValueError, "does not fit 3 layers"):
      StackPlan(3, 1, 2, 2)
    plan = StackPlan.for_kinds((D, M, M), scan=True)
    tree = layer_stack.to_unrolled(_tree(plan, (D, M, M)), plan)
    del tree["layers_2"]
    with self.assertRaisesRegex(ValueError, "has 1 of the 2 layers"):
      layer_stack.to_scanned(tree, plan)

  def test_a_stack_of_another_length_is_refused(self):
    # Neither dropping the rows past the plan nor inventing missing ones.
    stacked = {"params": {"layers": {"w": np.zeros((4, 3))}}}
    for layers in (2, 6):
      with self.assertRaisesRegex(
          ValueError,
          f"stacks \\[4\\] layers on axis 0, but the plan scans {layers}",
      ):
        layer_stack.to_unrolled(stacked, StackPlan.uniform(layers))
    unrolled = layer_stack.to_unrolled(stacked, StackPlan.uniform(4))
    self.assertEqual(
        sorted(unrolled["params"]), [f"layers_{i}" for i in range(4)]
    )

  def test_routed_bias_rule_reads_each_layers_row(self):
    plan = StackPlan.for_kinds((D, M, D, M), scan=True)
    rule = {"layers": {"block_1": {"moe": {"routed_bias": jnp.zeros((2, 4))}}}}
    load = jnp.zeros((4, 4)).at[1, 0].set(1.0).at[3, 2].set(1.0)
    new = routed_bias_rule(rule, load, 0.5, plan)
    bias = np.asarray(new["layers"]["block_1"]["moe"]["routed_bias"])
    # Rows 0, 1 are layers 1, 3: their most loaded expert moves down.
    self.assertLess(bias[0, 0], 0)
    self.assertLess(bias[1, 2], 0)
    self.assertGreater(bias[0, 2], 0)


class MixedStackCheckpointTest(absltest.TestCase):

  def test_unrolled_checkpoint_restores_into_a_scanned_group(self):
    kinds = (D, M, D, M, M)
    plan = StackPlan.for_kinds(kinds, scan=True)
    self.assertEqual(plan, StackPlan(5, 0, 2, 2))  # and layer 4 unrolled
    scanned = {"params": _tree(plan, kinds)}
    unrolled = ckpt_tree.relayout(scanned, False, plan)
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    with checkpoint.Checkpoints(tmp) as ckpts:
      ckpts.save(1, {frontend.VARIABLES: unrolled}, {})
      target = {frontend.VARIABLES: checkpoint.abstract(scanned)}
      restored = ckpts.restore(target).tree[frontend.VARIABLES]
    jax.tree.map(np.testing.assert_array_equal, restored, scanned)


@testing.slow
class MixedStackDecoderTest(absltest.TestCase):

  def test_scanned_group_equals_unrolled_and_restores_across_layouts(self):
    cfg = load_model_config(
        "tiny_qwen3_moe",
        num_layers=4,
        dense_layers=(0, 2),
        dense_mlp_dim=32,
        num_kv_heads=2,
        qk_norm=True,
        sliding_window=3,
        tie_embeddings=False,
        scale_embeddings=False,
    )
    self.assertEqual(cfg.stack_plan, StackPlan(4, 0, 2, 2))
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % cfg.vocab_size
    variables = unbox(Decoder(cfg).init(jax.random.key(0), tokens))
    self.assertIn("mlp", variables["params"]["layers"]["block_0"])
    self.assertIn("moe", variables["params"]["layers"]["block_1"])
    unrolled_cfg = cfg.replace(scan_layers=False)
    unrolled = ckpt_tree.relayout(variables, False, cfg.stack_plan)
    scanned_logits, aux = jax.jit(Decoder(cfg).apply)(variables, tokens)
    unrolled_logits, _ = jax.jit(Decoder(unrolled_cfg).apply)(unrolled, tokens)
    np.testing.assert_allclose(
        scanned_logits, unrolled_logits, atol=1e-5, rtol=1e-5
    )
    load = np.asarray(aux["expert_load"])
    np.testing.assert_array_equal(load[[0, 2]], 0)  # dense layers
    np.testing.assert_allclose(load[[1, 3]].sum(-1), 1, rtol=1e-5)
    again = ckpt_tree.relayout(unrolled, True, cfg.stack_plan)
    jax.tree.map(np.testing.assert_array_equal, again, variables)
    # An unrolled checkpoint restores into the scanned group's layout.
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    meta = {"model_config": checkpoint.config_dict(unrolled_cfg)}
    with checkpoint.Checkpoints(tmp) as ckpts:
      ckpts.save(1, {frontend.VARIABLES: unrolled}, meta)
      target = {frontend.VARIABLES: checkpoint.abstract(variables)}
      restored = ckpts.restore(target, config=cfg).tree
    jax.tree.map(
        np.testing.assert_array_equal,
        restored[frontend.VARIABLES],
        variables,
    )


if __name__ == "__main__":
  absltest.main()
