"""Bad input gets a clear error, before any work: one test per kind.

Each error names the argument, the value and what is allowed. The CLI prints
it on one line (`linen-moe: error: ...`, exit status 2), never a traceback.
"""

import contextlib
import io
import json
import os
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import load_model_config
from linen_moe import tokens as tokens_lib
from linen_moe._src.models.decoder import Decoder
from linen_moe.training import MarkovData
from linen_moe_cli import bench_report
from linen_moe_cli import main as cli
from linen_moe_cli import options
from linen_moe_cli import train_job
from linen_moe_cli.commands import train as train_command
import nnx_adapter

V = 256  # tiny_mixtral's vocabulary


def _cli(*argv) -> tuple[int, str]:
  """(exit status, stderr) of `linen-moe argv`."""
  err = io.StringIO()
  with (
      contextlib.redirect_stderr(err),
      contextlib.redirect_stdout(io.StringIO()),
  ):
    status = cli.main(list(argv))
  return status, err.getvalue()


class TrainOptionsTest(parameterized.TestCase):

  @parameterized.parameters(
      (["--steps", "0"], r"steps=0 \(--steps\) is invalid: .*integer >= 1"),
      (["--batch-size", "0"], r"batch_size=0 .*integer >= 1"),
      (["--seq-len", "1"], r"seq_len=1 \(--seq-len\) .*integer >= 2"),
      (["--learning-rate", "0"], r"learning_rate=0.0 .*finite number > 0"),
      (["--learning-rate=-1e-3"], r"learning_rate=-0.001 .*> 0"),
      (["--learning-rate", "nan"], r"learning_rate=nan .*finite number > 0"),
      (["--grad-accum", "0"], r"grad_accum=0 .*integer >= 1"),
      (
          ["--max-consecutive-skips", "0"],
          r"max_consecutive_skips=0 \(--max-consecutive-skips\) .*>= 1",
      ),
      (
          ["--batch-size", "4", "--grad-accum", "3"],
          r"grad_accum=3 .*divisor of batch_size=4 \(\[1, 2, 4\]\)",
      ),
  )
  def test_bad_flag_is_one_line_before_any_work(self, argv, message):
    with mock.patch.object(train_job, "train") as train:
      status, err = _cli("train", *argv)
    train.assert_not_called()  # checked before the job (and jax) starts
    self.assertEqual(status, 2)
    self.assertRegex(err, "^linen-moe: error: " + message)
    self.assertEqual(err.count("\n"), 1, err)

  def test_python_entry_point_checks_the_same(self):
    with self.assertRaisesRegex(ValueError, r"seq_len=1 \(--seq-len\)"):
      options.TrainOptions("tiny_mixtral", {}, steps=1, seq_len=1)
    with self.assertRaisesRegex(ValueError, r"steps=True"):
      options.TrainOptions(steps=True, batch_size=1, seq_len=2)


class TokensTest(absltest.TestCase):

  def test_validate_tokens(self):
    good = np.zeros((2, 8), np.int32)
    self.assertIs(tokens_lib.validate_tokens(good, V), good)
    for bad_id in (-1, V, 10**6):
      bad = good.copy()
      bad[1, 5] = bad_id
      with self.assertRaisesRegex(
          ValueError,
          rf"^tokens\[1, 5\]={bad_id} is invalid: token ids must be in "
          rf"\[0, vocab_size={V}\) \(1 of 16 ids",
      ):
        tokens_lib.validate_tokens(bad, V)
    with self.assertRaisesRegex(
        TypeError, r"integer token ids .*float32\[2, 8\]"
    ):
      tokens_lib.validate_tokens(good.astype(np.float32), V)
    with self.assertRaisesRegex(TypeError, r"int32\[16\]"):
      tokens_lib.validate_tokens(good.reshape(-1), V)
    with self.assertRaisesRegex(TypeError, "traced.*checked"):
      jax.jit(lambda t: tokens_lib.validate_tokens(t, V))(good)

  def test_train_data_path_rejects_bad_batch_before_its_step(self):
    def batches(self, batch_size, seq_len, seed=1, start=0):
      del self, seed, start
      yield np.full((batch_size, seq_len), V, np.int32)

    with (
        mock.patch.object(MarkovData, "batches", batches),
        mock.patch.object(train_job, "get_frontend") as frontend,
    ):
      with self.assertRaisesRegex(
          ValueError, rf"batch\[0, 0\]={V} is invalid: .*vocab_size={V}"
      ):
        train_job.train(options.TrainOptions(steps=1, batch_size=2, seq_len=4))
    frontend.return_value.init.assert_not_called()  # no model was built

  def test_inside_jit_bad_ids_embed_as_nan_and_checked_mode_raises(self):
    cfg = load_model_config("tiny_mixtral", num_layers=1)
    model = Decoder(cfg)
    good = jnp.ones((1, 4), jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(0), good)
    apply = jax.jit(model.apply)
    self.assertTrue(np.isfinite(apply(variables, good)[0]).all())
    for bad_id in (-1, V):  # -1 would wrap to the last row in nn.Embed
      bad = good.at[0, 2].set(bad_id)
      logits = np.asarray(apply(variables, bad)[0])
      self.assertTrue(np.isnan(logits[0, 2]).all())  # so the loss is NaN
      with self.assertRaisesRegex(
          ValueError,
          rf"^tokens\[0, 2\]={bad_id} is invalid: token ids must be in "
          rf"\[0, vocab_size={V}\)\.$",
      ):
        tokens_lib.checked(apply)(variables, bad)
    logits, _ = tokens_lib.checked(apply)(variables, good)
    self.assertTrue(np.isfinite(logits).all())


class InterchangeTest(absltest.TestCase):

  def test_variables_of_another_config(self):
    cfg = load_model_config("tiny_mixtral", num_layers=1)
    model = nnx_adapter.Decoder(cfg, rngs=nnx.Rngs(0))
    before = nnx_adapter.nnx_to_linen(model)
    other = Decoder(cfg.replace(moe_mlp_dim=2 * cfg.moe.moe_mlp_dim))
    shapes = jax.eval_shape(
        other.init, jax.random.key(0), jnp.ones((1, 4), int)
    )
    variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    m, h = cfg.moe.emb_dim, cfg.moe.moe_mlp_dim
    e = cfg.moe.num_experts
    with self.assertRaisesRegex(
        ValueError,
        rf"another config.*params/layers/moe/wi_0: expected "
        rf"float32\[1, {e}, {m}, {h}\], got float32\[1, {e}, {m}, {2 * h}\]",
    ):
      nnx_adapter.linen_to_nnx(variables, model)
    # Nothing was loaded: the check runs before the first variable is set.
    jax.tree.map(
        np.testing.assert_array_equal, nnx_adapter.nnx_to_linen(model), before
    )


class OptionalDependencyTest(absltest.TestCase):

  def test_bench_without_matplotlib_writes_json_and_says_how(self):
    fake = {
        "step_s": 1e-3,
        "compile_s": 1.0,
        "tokens_per_s": 1.0,
        "useful_gflops": 1.0,
        "gflops": 2.0,
        "max_rss_mib": 1.0,
    }
    with (
        tempfile.TemporaryDirectory() as out,
        mock.patch.dict(sys.modules, {"matplotlib": None}),
        mock.patch.object(
            bench_report, "run_case_subprocess", return_value=fake
        ) as run_case,
    ):
      status, err = _cli("bench", "--sweep", "capacity", "--out", out)
      self.assertEqual(status, 0)
      self.assertGreater(run_case.call_count, 1)
      self.assertEqual(sorted(os.listdir(out)), ["bench.json"])
      with open(os.path.join(out, "bench.json"), encoding="utf-8") as f:
        self.assertLen(json.load(f)["rows"], run_case.call_count - 1)
    self.assertRegex(
        err,
        r"^linen-moe bench: matplotlib is not installed, so the chart "
        r"\(bench.png\) is skipped; .* pip install 'linen_moe\[bench\]'",
    )

  def test_bench_bad_repeats(self):
    status, err = _cli("bench", "--repeats", "0")
    self.assertEqual((status, err.count("\n")), (2, 1))
    self.assertIn("repeats=0 (--repeats) is invalid", err)

  def test_missing_module_anywhere_is_one_line(self):
    # A module that is installed nowhere (tokamax, the example this used,
    # is now in the test extra).
    name = "linen_moe_optional_example"
    missing = ModuleNotFoundError(f"No module named {name!r}", name=name)
    with mock.patch.object(train_command, "run", side_effect=missing):
      status, err = _cli("train")
    self.assertEqual(status, 2)
    self.assertEqual(
        err,
        f"linen-moe: error: {name} is not installed, so this command stops; "
        f"install it with pip install {name}.\n",
    )


if __name__ == "__main__":
  absltest.main()
