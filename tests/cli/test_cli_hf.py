"""`linen-moe` with Hugging Face checkpoints: train --init-from-hf, export
--format hf, generate --hf-dir / --checkpoint-dir."""

import pathlib
import shutil

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import checkpoint
from linen_moe import hf
from linen_moe import training
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from linen_moe.training import RunOptions
from tests import cli_helpers

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
QWEN = FIXTURES / "qwen3_moe_dense0_norm"
MIXTRAL = FIXTURES / "mixtral_gqa_swa"


_cli = cli_helpers.cli_output
_error = cli_helpers.cli_error


class TrainAndExportTest(absltest.TestCase):

  @heavy
  def test_fine_tune_from_hf_then_export_for_transformers(self):
    tmp = pathlib.Path(helpers.tempdir(self))
    opts = RunOptions(
        init_from_hf=str(QWEN),
        steps=1,
        batch_size=4,
        seq_len=8,
        progress=False,
        checkpoint_dir=str(tmp / "run"),
    )
    logs = []
    result = training.run(opts, log=logs.append)
    # A pretrained start trains with the fine-tuning recipe (the sizes
    # given here win), says so first and records it in the first row.
    self.assertIn("fine-tune recipe", logs[0])
    self.assertIn("learning rate 2e-05 (cosine)", "\n".join(logs))
    first = helpers.read_jsonl(tmp / "run" / "metrics.jsonl")[0]
    self.assertEqual(
        first["recipe"],
        {
            "name": "fine-tune",
            "steps": 1,
            "batch_size": 4,
            "seq_len": 8,
            "learning_rate": 2e-5,
            "lr_schedule": "cosine",
            "warmup_steps": 0,
            "final_lr_ratio": 0.1,
            "weight_decay": 0.0,
        },
    )
    self.assertAlmostEqual(first["learning_rate"], 2e-5, delta=1e-12)
    # The first step's loss is the loaded model's on the first batch.
    config, variables = hf.load_checkpoint(QWEN)
    batch = next(
        training.MarkovData(config.vocab_size).batches(4, 8, opts.seed + 1)
    )
    logits, aux = jax.jit(Decoder(config).apply)(variables, jnp.asarray(batch))
    loss = training.decoder_loss(logits, aux, jnp.asarray(batch))[1]
    self.assertAlmostEqual(
        result.losses[0], float(loss["cross_entropy"]), places=4
    )
    # Export the trained step as a Hugging Face checkpoint.
    out = tmp / "hf"
    _cli(
        "export",
        "--checkpoint-dir",
        str(tmp / "run"),
        "--out",
        str(out),
        "--format",
        "hf",
    )
    trained_config, trained, step = checkpoint.read_variables(tmp / "run")
    self.assertEqual(step, 1)
    back_config, back = hf.load_checkpoint(out)
    self.assertEqual(back_config.dense_layers, trained_config.dense_layers)
    for a, b in zip(
        jax.tree.leaves(back["params"]),
        jax.tree.leaves(trained["params"]),
        strict=True,
    ):
      np.testing.assert_array_equal(a, b)
    # The same step with the linear weights in block fp8: each weight
    # within e4m3's rounding (3 mantissa bits) of the trained one.
    _cli(
        "export", "--checkpoint-dir", str(tmp / "run"), "--out",
        str(tmp / "fp8"), "--format", "hf-fp8",
    )  # fmt: skip
    fp8_config, fp8 = hf.load_checkpoint(tmp / "fp8")
    self.assertEqual(fp8_config, back_config)
    for a, b in zip(
        jax.tree.leaves(fp8["params"]),
        jax.tree.leaves(trained["params"]),
        strict=True,
    ):
      np.testing.assert_allclose(a, b, rtol=2.0**-4, atol=1e-6)
    # And decode from the run's checkpoint.
    out = _cli(
        "generate", "--checkpoint-dir", str(tmp / "run"), "--prompt-ids",
        "1,2,3", "--new-tokens", "2",
    )  # fmt: skip
    self.assertRegex(out, r"prompt ids: \[1, 2, 3\]\nnew ids: \[\d+, \d+\]")
    # Its float weights decode in the mode it trained in (none) or none.
    self.assertRegex(
        _error(
            "generate", "--checkpoint-dir", str(tmp / "run"), "--prompt-ids",
            "1", "--quantization", "fp8",
        ),
        r"quantization='fp8' \(--quantization\) is invalid: .* trained in "
        r"'none'.* --serve fp8",
    )  # fmt: skip

  def test_bad_flags(self):
    with self.assertRaisesRegex(
        ValueError, r"^init_from_hf=.* is invalid: it does not exist"
    ):
      RunOptions(init_from_hf=str(FIXTURES / "nowhere"))
    with self.assertRaisesRegex(
        ValueError, r"^init_from_hf=.*with config.json"
    ):
      RunOptions(init_from_hf=str(FIXTURES))
    with self.assertRaisesRegex(
        ValueError, r"fixes the model, so \['num_layers'\] cannot"
    ):
      RunOptions(init_from_hf=str(QWEN), overrides={"num_layers": 2})
    RunOptions(init_from_hf=str(QWEN), overrides={"quantization": "fp8"})


class GenerateTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.expected = np.load(MIXTRAL / "generate.npy")[0]  # prompt 5, new 8

  def test_prompt_ids_give_transformers_tokens(self):
    ids = ",".join(map(str, self.expected[:5]))
    out = _cli(
        "generate", "--hf-dir", str(MIXTRAL), "--prompt-ids", ids,
        "--new-tokens", "8",
    )  # fmt: skip
    self.assertIn(f"new ids: {self.expected[5:].tolist()}", out)
    self.assertIn("weights: float", out)

  def test_text_prompt_through_tokenizer_json(self):
    from tokenizers import Tokenizer  # noqa: PLC0415
    from tokenizers.models import WordLevel  # noqa: PLC0415
    from tokenizers.pre_tokenizers import Whitespace  # noqa: PLC0415

    d = pathlib.Path(helpers.tempdir(self)) / "model"
    shutil.copytree(MIXTRAL, d)
    vocab = {f"w{i}": i for i in range(64)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(d / "tokenizer.json"))
    prompt = " ".join(f"w{i}" for i in self.expected[:5])
    out = _cli(
        "generate", "--hf-dir", str(d), "--prompt", prompt, "--new-tokens", "8"
    )
    self.assertIn(f"new ids: {self.expected[5:].tolist()}", out)
    words = " ".join(f"w{i}" for i in self.expected[5:])
    self.assertIn(f"text: {words}", out)

  def test_serving_weights_and_bad_flags(self):
    ids = ",".join(map(str, self.expected[:5]))
    out = _cli(
        "generate", "--hf-dir", str(MIXTRAL), "--prompt-ids", ids,
        "--new-tokens", "2", "--serve", "int8",
    )  # fmt: skip
    self.assertIn("weights: int8", out)
    d = str(MIXTRAL)
    cases = [
        (
            ["--hf-dir", d],
            r"needs --prompt TEXT, --prompt-ids 1,2,3 or --prompts-file",
        ),
        (["--hf-dir", d, "--prompt", "hi"], r"--prompt needs a tokenizer"),
        (["--hf-dir", d, "--prompt-ids", "1,x"], r"--prompt-ids '1,x' is inv"),
        (
            ["--hf-dir", d, "--prompt-ids", "1", "--serve", "int8"]
            + ["--quantization", "fp8"],
            r"--quantization fp8 with --serve int8",
        ),
        (["--prompt-ids", "1,2"], r"needs a model: --hf-dir DIR or --check"),
        (["--hf-dir", d, "--prompt-ids", "1,99"], r"prompt.*99"),
    ]
    for argv, pattern in cases:
      with self.subTest(argv=argv):
        self.assertRegex(_error("generate", *argv), pattern)


if __name__ == "__main__":
  absltest.main()
