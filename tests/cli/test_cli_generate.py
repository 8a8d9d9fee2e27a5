"""`linen-moe generate`'s flags: a model to decode, `--serve` (the weights'
storage) beside `--quantization` (the float weights' contractions). Runs
from checkpoints: test_cli_hf.py; decoding itself: test_decoding.py; timing
float against serving weights: benchmarks/serving/bench_serving.py."""

import contextlib
import io
import json
import pathlib
import shutil
import tempfile

from absl.testing import absltest
import jax
import numpy as np

from linen_moe import checkpoint
from linen_moe import decoding
from linen_moe import frontend
from linen_moe import hf
from linen_moe import testing
from linen_moe.decoding import Sampling
from linen_moe.variables import OVERWRITE_WITH_GRADIENT
from linen_moe.variables import UPDATED_BY_RULE
from linen_moe_cli.commands import generate
from linen_moe_cli.generate_options import GenerateOptions
from linen_moe_cli.main import build_parser
from linen_moe_cli.main import main
from tests import cli_helpers

MIXTRAL = (
    pathlib.Path(__file__).parents[1] / "fixtures" / "hf" / "mixtral_gqa_swa"
)
DEEPSEEK = MIXTRAL.parent / "deepseek_v3_plain_nogroup"


def _error(*argv: str) -> str:
  """The one-line error of `linen-moe generate ARGV` (exit 2)."""
  return cli_helpers.cli_error("generate", *argv)


class GenerateFlagsTest(absltest.TestCase):

  def test_serve_offers_none_and_the_modes_that_store_weights(self):
    parser = build_parser()
    args = parser.parse_args(["generate", "--hf-dir", "d"])
    self.assertEqual(args.serve, "none")  # float weights
    self.assertIsNone(args.quantization)  # no per-command default
    for mode in ("none", "int8", "fp8", "nanoo_fp8"):
      args = parser.parse_args(["generate", "--hf-dir", "d", "--serve", mode])
      self.assertEqual(args.serve, mode)
    with (
        self.assertRaises(SystemExit),
        contextlib.redirect_stderr(io.StringIO()),
    ):
      parser.parse_args(["generate", "--hf-dir", "d", "--serve", "bogus"])

  def test_the_flags_make_one_generate_options(self):
    parser = build_parser()
    model = ["generate", "--hf-dir", str(MIXTRAL), "--prompt-ids", "1,2"]
    job = generate._checked(parser.parse_args(model))
    self.assertEqual(job["sampling"], GenerateOptions())  # the flags' defaults
    args = parser.parse_args(
        model
        + ["--temperature", "0.5", "--top-k", "4", "--top-p", "0.9"]
        + ["--min-p", "0.1", "--seed", "7", "--stop-id", "3", "--stop-id", "5"]
        + ["--max-new-tokens", "6"]
    )
    self.assertEqual(
        generate._checked(args)["sampling"],
        GenerateOptions(
            max_new_tokens=6,
            sampling=Sampling(temperature=0.5, top_k=4, top_p=0.9, min_p=0.1),
            seed=7,
            stop_ids=(3, 5),
        ),
    )

  def test_a_model_is_needed(self):
    err = _error("--prompt-ids", "1,2")
    self.assertIn("needs a model: --hf-dir DIR or --checkpoint-dir DIR", err)
    self.assertIn("bench_serving.py", err)

  def test_quantization_other_than_the_served_mode_is_refused(self):
    d = str(MIXTRAL)
    for argv in (
        ["--serve", "int8", "--quantization", "fp8"],
        ["--serve", "fp8", "--quantization", "none"],
    ):
      with self.subTest(argv=argv):
        err = _error("--hf-dir", d, "--prompt-ids", "1", *argv)
        self.assertRegex(err, r"--quantization \w+ with --serve \w+")


class GenerateModelTest(absltest.TestCase):
  """What each choice loads: the config's mode, serving flag and state."""

  def test_serve_and_quantization_pick_the_model(self):
    for serve, quantization, mode, serving, fp8_state in (
        ("none", None, "none", False, False),
        ("none", "fp8", "fp8", False, True),  # float weights, fp8 dots
        ("int8", None, "int8", True, False),
        ("fp8", "fp8", "fp8", True, False),  # scales in the stored kernels
    ):
      with self.subTest(serve=serve, quantization=quantization):
        model = decoding.load_model(
            MIXTRAL, serve=serve, quantization=quantization
        )
        config, variables = model.config, model.variables
        self.assertEqual(config.moe.quantization, mode)
        self.assertEqual(config.moe.serving, serving)
        self.assertEqual(OVERWRITE_WITH_GRADIENT in variables, fp8_state)

  def test_a_training_checkpoint_keeps_its_routed_biases(self):
    # DeepSeek-V3's routed biases (`updated_by_rule`) choose the experts:
    # float weights without them do not decode.
    config, variables = hf.load_checkpoint(DEEPSEEK)
    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    meta = {"model_config": checkpoint.config_dict(config)}
    with checkpoint.Checkpoints(directory) as ckpts:
      ckpts.save(1, {frontend.VARIABLES: variables}, meta)
    loaded = decoding.load_model(directory).variables
    self.assertEqual(sorted(loaded), ["params", UPDATED_BY_RULE])
    np.testing.assert_array_equal(
        jax.tree.leaves(loaded[UPDATED_BY_RULE]),
        jax.tree.leaves(variables[UPDATED_BY_RULE]),
    )

  def test_float_weights_in_fp8_contractions(self):
    status, out, err = testing.run_capturing(
        main,
        ["generate", "--hf-dir", str(MIXTRAL), "--prompt-ids", "1,2,3"]
        + ["--new-tokens", "2", "--quantization", "fp8"],
    )
    self.assertEqual(status, 0, err)
    self.assertIn("weights: float (in fp8's contractions)", out)
    self.assertRegex(out, r"new ids: \[\d+, \d+\]")


def _model_dir(test, eos=None) -> pathlib.Path:
  """The Mixtral fixture with a word-level tokenizer (w0 .. w63), a chat
  template that renders words (a turn's header: w10 system, w11 user, w12
  assistant, the generation prompt), and `eos` as generation_config's
  eos_token_id."""
  from tokenizers import Tokenizer  # noqa: PLC0415
  from tokenizers.models import WordLevel  # noqa: PLC0415
  from tokenizers.pre_tokenizers import Whitespace  # noqa: PLC0415

  root = pathlib.Path(tempfile.mkdtemp())
  test.addCleanup(shutil.rmtree, root, ignore_errors=True)
  d = root / "model"
  shutil.copytree(MIXTRAL, d)
  tok = Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
  tok.pre_tokenizer = Whitespace()
  tok.save(str(d / "tokenizer.json"))
  template = (
      "{% for m in messages %}{{ {'system': 'w10', 'assistant': 'w12'}"
      ".get(m.role, 'w11') }} {{ m.content }} {% endfor %}"
      "{% if add_generation_prompt %}w12{% endif %}"
  )
  (d / "tokenizer_config.json").write_text(
      json.dumps({"chat_template": template})
  )
  if eos is not None:
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
  return d


def _words(ids) -> str:
  return " ".join(f"w{i}" for i in ids)


class GenerateRunTest(absltest.TestCase):
  """Streaming one prompt, a prompts file, chat, stop ids (small runs on
  the Mixtral fixture; its greedy tokens are transformers')."""

  def setUp(self):
    super().setUp()
    self.expected = np.load(MIXTRAL / "generate.npy")[0]  # prompt 5, new 8

  def test_streams_text_and_stops_at_the_eos_of_generation_config(self):
    new = self.expected[5:].tolist()
    eos = new[2]
    d = _model_dir(self, eos=[63, eos] if eos != 63 else eos)
    status, out, err = testing.run_capturing(
        main,
        ["generate", "--hf-dir", str(d), "--prompt", _words(self.expected[:5])],
    )
    self.assertEqual(status, 0, err)
    stopped = new[: new.index(eos) + 1]
    self.assertIn(f"text: {_words(stopped)}\n", out)
    self.assertIn(f"new ids: {stopped}", out)
    self.assertIn("finish: stop", out)
    self.assertRegex(
        out,
        rf"{len(stopped)} new tokens in [\d.]+ s: the first after [\d.]+ s "
        r"\(prefill and compile\), then ([\d.]+|nan) tokens/s",
    )
    # --stop-id overrides generation_config.json; --chat wraps the prompt
    # (6 ids + 7 new: the cache of the first run, one decode step program).
    status, out, err = testing.run_capturing(
        main,
        ["generate", "--hf-dir", str(d), "--prompt", "w1 w2", "--chat"]
        + ["--system", "w3", "--stop-id", "5", "--max-new-tokens", "7"],
    )
    self.assertEqual(status, 0, err)
    self.assertIn("prompt ids: [10, 3, 11, 1, 2, 12]", out)
    self.assertRegex(out, r"finish: (stop|length)")

  def test_prompts_file_writes_jsonl(self):
    d = _model_dir(self)
    prompts = d / "prompts.txt"
    prompts.write_text(
        _words(self.expected[:5])
        + "\n\n"
        + json.dumps({"prompt_ids": [1, 2, 3]})
        + "\n"
    )
    results = d / "out.jsonl"
    status, out, err = testing.run_capturing(
        main,
        ["generate", "--hf-dir", str(d), "--prompts-file", str(prompts)]
        + ["--output", str(results), "--max-new-tokens", "8"],
    )
    self.assertEqual(status, 0, err)
    self.assertRegex(out, r"2 prompts, \d+ new tokens in .* tokens/s")
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    self.assertLen(rows, 2)
    self.assertEqual(rows[0]["new_ids"], self.expected[5:].tolist())
    self.assertEqual(rows[0]["text"], _words(self.expected[5:]))
    self.assertEqual(rows[1]["prompt_ids"], [1, 2, 3])
    self.assertEqual(rows[1]["finish_reason"], "length")

  def test_bad_sampling_flags(self):
    d = str(MIXTRAL)
    for argv, pattern in (
        (["--top-p", "0"], r"top_p=0.0 \(--top-p\) is invalid: .*\(0, 1\]"),
        (
            ["--temperature", "-1"],
            r"temperature=-1.0 \(--temperature\) is invalid: .* >= 0",
        ),
        (["--min-p", "2"], r"min_p=2.0 \(--min-p\) is invalid: .*\[0, 1\]"),
        (["--system", "hi"], r"--system needs --chat"),
        (["--output", "x"], r"--output is for --prompts-file"),
    ):
      with self.subTest(argv=argv):
        self.assertRegex(
            _error("--hf-dir", d, "--prompt-ids", "1", *argv), pattern
        )


if __name__ == "__main__":
  absltest.main()
