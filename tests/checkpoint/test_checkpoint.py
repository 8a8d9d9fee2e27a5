"""Checkpoints: the checkpoint tree, checked restores, faults, export.

Most tests share one saved checkpoint: a tiny Mixtral (fp8, sparse path,
scanned) whose every leaf was moved off its initial value by a leaf-specific
ramp, so that a leaf restored from the wrong place, or not restored at all,
differs. Restores into other meshes live in `CheckpointMeshTest` (a
subprocess on 8 simulated devices); exact resume of training runs in
`test_resume.py`.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile

from absl.testing import absltest
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linen_moe import Decoder
from linen_moe import checkpoint
from linen_moe import frontend
from linen_moe._src.checkpoint import meta
from linen_moe._src.checkpoint import tree as ckpt_tree
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from linen_moe.training import LinenFrontend
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe.variables import OVERWRITE_WITH_GRADIENT
import nnx_adapter
from tests import checkpoint_worker
from tests import workers

TX = default_optimizer()
TOKENS = jnp.zeros((2, 8), jnp.int32)
FP8 = (frontend.VARIABLES, OVERWRITE_WITH_GRADIENT)


def _config(quantization="fp8", path="sparse", **overrides):
  return helpers.config_on_path("tiny_mixtral", quantization, path, **overrides)


def _moved(tree):
  """Every float leaf plus a ramp unique to the leaf; ints plus 7."""
  flat = traverse_util.flatten_dict(tree)
  out = {}
  for i, (path, x) in enumerate(sorted(flat.items())):
    if jnp.issubdtype(x.dtype, jnp.floating):
      out[path] = x + jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) + i
    else:
      out[path] = x + 7
  return traverse_util.unflatten_dict(out)


_flat_numpy = helpers.flat_numpy


def _abstract_linen(cfg):
  return jax.eval_shape(
      lambda: LinenFrontend.init(cfg, TX, TOKENS, jax.random.key(0))
  )


def _meta(cfg):
  return {"model_config": checkpoint.config_dict(cfg)}


class CheckpointTestBase(absltest.TestCase):
  """A moved fp8 checkpoint at `self.saved_dir` (step 5), its tree in
  `self.saved` (flat NumPy) and its config `self.cfg`."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    cls.cfg = _config()
    state = LinenFrontend.init(cls.cfg, TX, TOKENS, jax.random.key(0))
    cls.state = LinenFrontend.from_checkpoint_tree(
        _moved(frontend.tree_of(state)), state
    )
    cls.tree = frontend.tree_of(cls.state)
    cls.saved = _flat_numpy(cls.tree)
    cls.saved_dir = os.path.join(cls.tmp, "run")
    with checkpoint.Checkpoints(cls.saved_dir) as ckpts:
      ckpts.save(5, cls.tree, _meta(cls.cfg))

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp, ignore_errors=True)
    super().tearDownClass()

  def restore(self, target, directory=None, **kwargs):
    with checkpoint.Checkpoints(directory or self.saved_dir) as ckpts:
      return ckpts.restore(target, **kwargs)

  def assert_trees_equal(self, got: dict, want: dict):
    got, want = _flat_numpy(got), _flat_numpy(want)
    self.assertEqual(sorted(got), sorted(want))
    for path in want:
      self.assertEqual(got[path].dtype, want[path].dtype, path)
      np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


class CheckpointTreeTest(CheckpointTestBase):

  def test_linen_layout(self):
    flat = traverse_util.flatten_dict(self.tree)
    params = traverse_util.flatten_dict(self.state.params)
    fp8 = traverse_util.flatten_dict(self.state.fp8_state)
    for path, x in params.items():
      self.assertIs(flat[(frontend.VARIABLES, "params", *path)], x)
    for path, x in fp8.items():
      self.assertIs(flat[(*FP8, *path)], x)
    mu = self.state.opt_state[1][0].mu["layers"]["moe"]["wi_0"]
    self.assertIs(
        flat[("opt_state", "1", "0", "mu", "layers", "moe", "wi_0")], mu
    )
    self.assertEqual(flat[("step",)].dtype, jnp.int32)
    # Nothing else: every leaf of the state is in the tree once.
    self.assertLen(flat, len(jax.tree.leaves(self.state)))

  def test_nnx_tree_equals_linen_tree(self):
    """Same seed, same tree: paths, dtypes and values (the NNX decoder starts
    at the Linen init's weights; the optimizer states mirror them)."""
    linen = LinenFrontend.init(self.cfg, TX, TOKENS, jax.random.key(3))
    nnx = nnx_adapter.init_train_state(self.cfg, TX, TOKENS, jax.random.key(3))
    self.assert_trees_equal(
        nnx_adapter.NNXFrontend.checkpoint_tree(nnx), frontend.tree_of(linen)
    )

  def test_state_round_trip_and_misfit(self):
    back = frontend.state_from(self.tree, self.state)
    self.assertEqual(jax.tree.structure(back), jax.tree.structure(self.state))
    self.assert_trees_equal(frontend.tree_of(back), self.tree)
    nnx = nnx_adapter.init_train_state(self.cfg, TX, TOKENS, jax.random.key(0))
    nnx = nnx_adapter.NNXFrontend.from_checkpoint_tree(self.tree, nnx)
    self.assertEqual(nnx.step.dtype, jnp.uint32)  # NNX's own counter dtype
    self.assert_trees_equal(
        nnx_adapter.NNXFrontend.checkpoint_tree(nnx), self.tree
    )
    partial = dict(self.tree)
    del partial["opt_state"]
    with self.assertRaisesRegex(ValueError, "missing .*opt_state"):
      frontend.state_from(partial, self.state)

  def test_relayout_moves_rows(self):
    """Unrolled layer i holds row i of each stack, in every subtree."""
    unrolled = ckpt_tree.relayout(self.tree, False, self.cfg.num_layers)
    flat = _flat_numpy(unrolled)
    stacked = [p for p in self.saved if "layers" in p]
    self.assertNotEmpty(stacked)
    for path in stacked:
      j = path.index("layers")
      for i in range(self.cfg.num_layers):
        row = flat[(*path[:j], f"layers_{i}", *path[j + 1 :])]
        np.testing.assert_array_equal(row, self.saved[path][i])
    self.assertLen(flat, len(self.saved) + len(stacked))
    back = ckpt_tree.relayout(unrolled, True, self.cfg.num_layers)
    self.assert_trees_equal(back, self.tree)


class CheckpointRestoreTest(CheckpointTestBase):

  def test_restores_exactly(self):
    target = frontend.tree_of(_abstract_linen(self.cfg))
    restored = self.restore(target, config=self.cfg)
    self.assertEqual((restored.step, restored.fresh_fp8_state), (5, False))
    self.assertEqual(
        restored.meta["model_config"], checkpoint.config_dict(self.cfg)
    )
    self.assert_trees_equal(restored.tree, self.tree)

  def test_scanned_into_unrolled_and_back(self):
    cfg = self.cfg.replace(scan_layers=False)
    target = frontend.tree_of(_abstract_linen(cfg))
    restored = self.restore(target, config=cfg)
    expected = ckpt_tree.relayout(self.tree, False, cfg.num_layers)
    self.assert_trees_equal(restored.tree, expected)
    other = os.path.join(self.tmp, "unrolled")
    with checkpoint.Checkpoints(other) as ckpts:
      ckpts.save(5, restored.tree, _meta(cfg))
    back = self.restore(frontend.tree_of(_abstract_linen(self.cfg)), other)
    self.assert_trees_equal(back.tree, self.tree)

  def test_restores_into_the_nnx_front_end(self):
    fe = nnx_adapter.NNXFrontend
    for scanned in (True, False):
      cfg = self.cfg.replace(scan_layers=scanned)
      template = jax.eval_shape(
          lambda c=cfg: fe.init(c, TX, TOKENS, jax.random.key(0))
      )
      restored = self.restore(fe.checkpoint_tree(template), config=cfg)
      state = fe.from_checkpoint_tree(restored.tree, template)
      expected = ckpt_tree.relayout(self.tree, scanned, cfg.num_layers)
      self.assert_trees_equal(fe.checkpoint_tree(state), expected)

  def test_another_model_config_fails_first(self):
    cfg = self.cfg.replace(moe_mlp_dim=64)
    with self.assertRaisesRegex(
        ValueError,
        r"run/5 was trained with another model config: "
        r"moe_mlp_dim=128 there, 64 here",
    ):
      self.restore(frontend.tree_of(_abstract_linen(cfg)), config=cfg)

  def test_mismatched_leaf_names_path_and_both_shapes(self):
    cfg = self.cfg.replace(fp8_amax_history_length=16)  # a run field
    target = frontend.tree_of(_abstract_linen(cfg))
    with self.assertRaisesRegex(
        ValueError,
        r"run/5 does not fit the model: first mismatched leaf "
        r"variables/_overwrite_with_gradient/layers/moe/wi_0_dot/"
        r"input_amax_history: float32\[2, 1024\] in the checkpoint, "
        r"float32\[2, 16\] in the model",
    ):
      self.restore(target, config=cfg)

  def test_missing_fp8_state_needs_consent(self):
    plain = _config("none")
    plain_dir = os.path.join(self.tmp, "plain")
    plain_state = LinenFrontend.init(plain, TX, TOKENS, jax.random.key(1))
    plain_tree = _moved(frontend.tree_of(plain_state))
    with checkpoint.Checkpoints(plain_dir) as ckpts:
      ckpts.save(3, plain_tree, _meta(plain))
    abstract_target = frontend.tree_of(_abstract_linen(self.cfg))
    with self.assertRaisesRegex(
        ValueError,
        r"plain/3 does not fit the model: leaf variables/"
        r"_overwrite_with_gradient/layers/moe/wi_0_dot/input_amax_history "
        r"\(float32\[2, 1024\] in the model\) is not in the checkpoint\. "
        r".*fresh_fp8_state=True",
    ):
      self.restore(abstract_target, plain_dir, config=self.cfg)
    with self.assertRaisesRegex(ValueError, "needs the initial fp8 state"):
      self.restore(abstract_target, plain_dir, fresh_fp8_state=True)
    initial = frontend.tree_of(
        LinenFrontend.init(self.cfg, TX, TOKENS, jax.random.key(0))
    )
    with self.assertLogs("linen_moe.checkpoint", "WARNING") as logs:
      restored = self.restore(initial, plain_dir, fresh_fp8_state=True)
    self.assertIn("fresh fp8 state", logs.output[0])
    self.assertTrue(restored.fresh_fp8_state)
    got = traverse_util.flatten_dict(restored.tree)
    want = {
        **_flat_numpy(plain_tree),
        **{p: x for p, x in _flat_numpy(initial).items() if p[:2] == FP8},
    }
    self.assert_trees_equal(
        traverse_util.unflatten_dict(got), traverse_util.unflatten_dict(want)
    )
    # A checkpoint whose fp8 state fits keeps it, even when fresh is allowed.
    kept = self.restore(initial, fresh_fp8_state=True)
    self.assertFalse(kept.fresh_fp8_state)
    self.assert_trees_equal(kept.tree, self.tree)

  def test_fp8_state_the_model_lacks_is_not_dropped_silently(self):
    cfg = self.cfg.replace(quantization="int8")  # int8 keeps no state
    with self.assertRaisesRegex(
        ValueError, r"_overwrite_with_gradient/.* is not in the model"
    ):
      self.restore(frontend.tree_of(_abstract_linen(cfg)), config=cfg)

  # After the failed read, a tensorstore callback reaches orbax's closed
  # event loop ("Event loop is closed", ignored by Python); ours is the
  # ValueError checked below.
  @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
  def test_truncated_checkpoint_is_named(self):
    damaged = os.path.join(self.tmp, "damaged")
    shutil.copytree(self.saved_dir, damaged)
    data = [
        f
        for f in glob.glob(
            os.path.join(damaged, "5", "state", "**", "d", "*"), recursive=True
        )
        if os.path.isfile(f)
    ]
    self.assertNotEmpty(data)
    for f in data:
      with open(f, "r+b") as handle:
        handle.truncate(os.path.getsize(f) // 2)
    target = frontend.tree_of(_abstract_linen(self.cfg))
    with self.assertRaisesRegex(
        ValueError, r"damaged/5 cannot be read; it is truncated or damaged"
    ):
      self.restore(target, damaged)
    os.remove(os.path.join(damaged, "5", "state", "_METADATA"))
    with self.assertRaisesRegex(ValueError, r"damaged/5 cannot be read"):
      self.restore(target, damaged)

  def test_no_checkpoint(self):
    with self.assertRaisesRegex(ValueError, r"No checkpoint in .*/empty\."):
      self.restore({}, os.path.join(self.tmp, "empty"))
    with self.assertRaisesRegex(ValueError, r"does not exist"):
      checkpoint.Checkpoints(os.path.join(self.tmp, "nowhere"), create=False)


class CheckpointsManagerTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

  def test_every_n_keep_k_and_never_overwrite(self):
    tree = checkpoint_worker.kill_tree
    with checkpoint.Checkpoints(self.dir, save_every=2, keep=2) as ckpts:
      saved = [ckpts.save(s, tree(s), {}) for s in range(1, 8)]
      self.assertEqual(saved, [False, True, False, True, False, True, False])
      self.assertTrue(ckpts.save(7, tree(7), {}, force=True))
      ckpts.wait_until_finished()
      self.assertEqual(ckpts.all_steps(), [6, 7])
      with self.assertRaisesRegex(
          ValueError, r"step 7 is not after the latest one \(7\)"
      ):
        ckpts.save(7, tree(70), {}, force=True)
    target = checkpoint.abstract(tree(0))
    with checkpoint.Checkpoints(self.dir) as ckpts:
      np.testing.assert_array_equal(
          ckpts.restore(target).tree["variables"]["params"]["w"],
          tree(7)["variables"]["params"]["w"],
      )
      np.testing.assert_array_equal(ckpts.restore(target, 6).tree["step"], 6)

  def test_rng_and_config_as_json(self):
    for rng in (jax.random.key(7), jax.random.key(7, impl="rbg")):
      back = meta.rng_from_json(json.loads(json.dumps(meta.rng_to_json(rng))))
      self.assertEqual(jax.random.key_impl(back), jax.random.key_impl(rng))
      np.testing.assert_array_equal(
          jax.random.key_data(back), jax.random.key_data(rng)
      )
    cfg = _config()
    saved = json.loads(json.dumps(checkpoint.config_dict(cfg)))
    run_changes = _config(
        "int8", "dense_dropping", scan_layers=False, dtype="bfloat16"
    )
    meta.check_model_config(saved, run_changes, "here")  # allowed
    with self.assertRaisesRegex(
        ValueError, r"num_experts=8 there, 4 here; num_layers=2 there, 3 here\."
    ):
      meta.check_model_config(
          saved, cfg.replace(num_experts=4, num_layers=3), "x"
      )

  def test_bad_arguments(self):
    for kwargs in ({"save_every": 0}, {"keep": 0}, {"save_every": 1.5}):
      with self.assertRaisesRegex(ValueError, f"{next(iter(kwargs))}="):
        checkpoint.Checkpoints(self.dir, **kwargs)

  def test_killed_mid_commit_leaves_the_previous_checkpoint(self):
    """SIGKILL while step 2 is being committed: step 1 stays the latest,
    byte for byte, and the next save of step 2 succeeds."""
    proc = workers.start(
        "tests.checkpoint_worker", "kill", self.dir, stdout=subprocess.PIPE
    )
    lines = []
    step1 = None
    try:
      for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("saved 1"):
          step1 = _directory_bytes(os.path.join(self.dir, "1"))
        if line.startswith("committing"):
          break
    finally:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(timeout=60)
    self.assertEqual(lines, ["saved 1", "committing"])
    self.assertNotEmpty(
        glob.glob(os.path.join(self.dir, "2.orbax-checkpoint-tmp*"))
    )
    self.assertFalse(os.path.exists(os.path.join(self.dir, "2")))
    target = checkpoint.abstract(checkpoint_worker.kill_tree(0))
    with checkpoint.Checkpoints(self.dir) as ckpts:
      self.assertEqual(ckpts.all_steps(), [1])
      restored = ckpts.restore(target)
      self.assert_tree(restored.tree, checkpoint_worker.kill_tree(1))
      self.assertEqual(_directory_bytes(os.path.join(self.dir, "1")), step1)
      ckpts.save(2, checkpoint_worker.kill_tree(2), {})
      ckpts.wait_until_finished()
      self.assertEqual(ckpts.all_steps(), [1, 2])
      self.assert_tree(
          ckpts.restore(target).tree, checkpoint_worker.kill_tree(2)
      )
    self.assertEmpty(glob.glob(os.path.join(self.dir, "*tmp*")))

  def assert_tree(self, got, want):
    jax.tree.map(np.testing.assert_array_equal, got, want)


def _directory_bytes(path: str) -> dict[str, bytes]:
  out = {}
  for root, _, files in os.walk(path):
    for name in files:
      full = os.path.join(root, name)
      with open(full, "rb") as f:
        out[os.path.relpath(full, path)] = f.read()
  return out


class ExportTest(CheckpointTestBase):

  def test_export_serving_variables(self):
    model = Decoder(self.cfg)
    tokens = jnp.asarray(MarkovData(self.cfg.vocab_size).batch(0, 2, 8))
    variables = {
        "params": self.state.params,
        OVERWRITE_WITH_GRADIENT: self.state.fp8_state,
    }
    for dtype in (None, "bfloat16"):
      out = os.path.join(self.tmp, f"export_{dtype}")
      self.assertEqual(checkpoint.export(self.saved_dir, out, dtype=dtype), 5)
      exported, info = checkpoint.load_export(out)
      self.assertEqual(info["step"], 5)
      self.assertEqual(info["model_config"], checkpoint.config_dict(self.cfg))
      self.assertEqual(sorted(exported), ["_overwrite_with_gradient", "params"])
      want = dict(variables)
      if dtype:
        want["params"] = jax.tree.map(
            lambda x, d=dtype: x.astype(d), want["params"]
        )
      jax.tree.map(
          lambda g, w: (
              self.assertEqual(g.dtype, w.dtype),
              np.testing.assert_array_equal(g, w),
          ),
          exported,
          want,
      )
      if dtype is None:  # the exported variables serve the same logits
        np.testing.assert_array_equal(
            model.apply(exported, tokens)[0], model.apply(variables, tokens)[0]
        )
    with self.assertRaisesRegex(
        ValueError, "exists; an export never overwrites"
    ):
      checkpoint.export(self.saved_dir, out)
    with self.assertRaisesRegex(ValueError, r"dtype='int8' is invalid"):
      checkpoint.export(self.saved_dir, out + "x", dtype="int8")


class CheckpointMeshTest(absltest.TestCase):
  """Saved sharded on data=8; restored onto other meshes, one device, the
  NNX front end and the other layer layout: each leaf in its target's
  sharding (split across devices where the target splits it) and equal to
  the saved value (its row, across layouts)."""

  def run_worker(self, job):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    job = dict(job, dir=os.path.join(tmp, "ckpt"))
    return workers.run_json("tests.checkpoint_worker", "mesh", json.dumps(job))

  def check(self, job):
    results = self.run_worker(job)
    self.assertLen(results, len(job["targets"]))
    for name, r in results.items():
      with self.subTest(target=name):
        self.assertEqual(r["bad_sharding"], [])
        self.assertEqual(r["bad_value"], [])
        self.assertGreater(r["leaves"], 50)
        if not name.startswith("one device"):
          self.assertGreater(r["split"], 0)  # really split, not replicated

  @heavy
  def test_data_to_other_meshes_front_ends_and_layouts(self):
    self.check({
        "quantization": "fp8",
        "path": "sparse",
        "save_on": "data=8",
        "save_layers": "scanned",
        "targets": [
            ["expert=8", "linen", "scanned"],
            ["data=2,expert=4", "nnx", "unrolled"],
            [None, "linen", "unrolled"],
            [None, "nnx", "scanned"],
        ],
    })


if __name__ == "__main__":
  absltest.main()
