"""`linen-moe export --format hf` of every shipped config named after a
Hugging Face family, and the config list of `--help` that says which
configs export (`linen_moe.hf.family_match`: tests/hf/test_hf_family_match.py).

tests/fixtures/hf_export/NAME (scripts/make_export_fixtures.py) holds what
transformers 5.25 loaded: each config trained by `linen-moe train` and
exported by `linen-moe export --format hf`, its `config.json`, its tensors'
names, shapes and dtypes, and what transformers reported (no missing or
unexpected key, logits within 1.5e-6 of ours, `AutoTokenizer`'s ids those
of the kept tokenizer.json, the stop id of generation_config.json). Here:
an export today writes that config.json and those tensors, the tokenizer
gives transformers' ids, and (slow) each config trained and exported by the
command line reads back with the trained logits.
"""

import contextlib
import io
import json
import os
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import checkpoint
from linen_moe import data
from linen_moe import frontend
from linen_moe import hf
from linen_moe import load_model_config
from linen_moe import testing
from linen_moe._src.hf import config_map
from linen_moe._src.hf import layout
from linen_moe._src.hf import tensor_names as tn
from linen_moe._src.testing import helpers
from linen_moe_cli import main as cli
from linen_moe_cli import model_args
from tests import cli_helpers
from tests.hf.test_hf_family_match import EXPORTED

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf_export"
NAMES = ("tiny_mixtral", "tiny_qwen3_moe", "tiny_gemma4_text",
         "tiny_deepseek_v3_mla")  # fmt: skip


def _fixture(name: str, file: str):
  return json.loads((FIXTURES / name / file).read_text())


def _tensors(name: str) -> dict[str, list]:
  """{tensor name: [shape, dtype]} of a float32 export of config `name`."""
  config = load_model_config(name)
  family = config_map.family_for(config)
  params, state = layout.flat_params(config), layout.flat_state(config)
  out = {}
  for flat, sources in (
      (params, tn.sources(family, config)),
      (state, tn.state_sources(family, config)),
  ):
    for path, source in sources.items():
      for key, shape in tn.expected_shapes(source, flat[path].shape).items():
        out[key] = [list(shape), "F32"]
  return out


class PinnedExportTest(parameterized.TestCase):
  """The export transformers loaded is the export written today."""

  @parameterized.parameters(*NAMES)
  def test_config_json_and_tensors(self, name):
    config = load_model_config(name)
    written = config_map.hf_config(config, "float32") | {"eos_token_id": 0}
    self.assertEqual(written, _fixture(name, "config.json"))
    self.assertEqual(_tensors(name), _fixture(name, "tensors.json"))
    report = _fixture(name, "transformers.json")
    self.assertEqual(report["check_hf_roundtrip"], "OK")
    self.assertLessEqual(report["max_abs_logit_difference"], 1e-4)
    self.assertEqual(report["eos_token_id"], 0)

  def test_the_tokenizer_gives_transformers_ids(self):
    # The tokenizer of the fixtures (64 tokens of the license texts, made
    # the same way); transformers' AutoTokenizer read the export's copy.
    path = os.path.join(helpers.tempdir(self), "tokenizer.json")
    data.train_bpe_tokenizer(testing.license_texts(), 64, path)
    for name in NAMES:
      report = _fixture(name, "transformers.json")
      self.assertTrue(report["tokenizer_ids_match"])
      text = "Permission is hereby granted, free of charge, to any person"
      ids = data.load_tokenizer(path).encode(text).ids
      self.assertEqual(ids, report["tokenizer_ids"], name)


class ConfigListTest(absltest.TestCase):

  def test_help_marks_the_configs_that_export(self):
    listed = model_args.config_list()
    for name, model_type in EXPORTED.items():
      self.assertIn(f"{name} [hf: {model_type}]", listed)
    self.assertIn(
        "tiny_deepseek_v3 [no HF form: 2 fields differ from deepseek_v3]",
        listed,
    )
    self.assertIn(
        "tiny_gemma4_26b [no HF form: 8 fields differ from gemma4_text]",
        listed,
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out), self.assertRaises(SystemExit) as done:
      cli.main(["train", "--help"])
    self.assertEqual(done.exception.code, 0)
    self.assertIn(
        "tiny_mixtral [hf: mixtral]", " ".join(out.getvalue().split())
    )


class NoHFFormTest(parameterized.TestCase):
  """A config with no Hugging Face form is refused with the shipped
  configs of its nearest family that export (read from their files)."""

  @parameterized.parameters(
      ("tiny_gemma4_26b", "gemma4_text", "tiny_gemma4_text, gemma4_26b"),
      ("tiny_deepseek_v3", "deepseek_v3",
       "tiny_deepseek_v3_mla, deepseek_v3_671b"),
  )  # fmt: skip
  def test_refusal_names_the_configs_that_export(self, name, family, names):
    config = load_model_config(name, num_layers=1)
    shapes = jax.eval_shape(
        Decoder(config).init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32)
    )
    variables = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    run = helpers.tempdir(self)
    with checkpoint.Checkpoints(run) as ckpts:
      meta = {"model_config": checkpoint.config_dict(config)}
      ckpts.save(1, {frontend.VARIABLES: variables}, meta)
    status, _, err = cli_helpers.cli(
        "export", "--checkpoint-dir", run, "--out", f"{run}/hf", "--format",
        "hf",
    )  # fmt: skip
    self.assertNotEqual(status, 0)
    self.assertIn(
        f"no Hugging Face form: the nearest family, {family}, needs", err
    )
    self.assertIn(f"The shipped configs that export as {family}: {names}.",
                  " ".join(err.split()))  # fmt: skip
    self.assertFalse(os.path.exists(f"{run}/hf"))


@testing.slow
class TrainThenExportTest(parameterized.TestCase):
  """`linen-moe train` (2 steps on text) then `export --format hf` of each
  config: the files transformers loaded (tests/fixtures/hf_export), and
  the weights read back give the trained model's logits."""

  @parameterized.parameters(*NAMES)
  def test_train_then_export(self, name):
    tmp = pathlib.Path(helpers.tempdir(self))
    corpus = tmp / "corpus"
    corpus.mkdir(parents=True)
    for i, path in enumerate(testing.license_texts()[:6]):
      (corpus / f"{i}.txt").write_text(pathlib.Path(path).read_text())
    tokenizer = tmp / "tokenizer.json"
    data.train_bpe_tokenizer(testing.license_texts(), 64, tokenizer)
    run, out = tmp / "run", tmp / "hf"
    for argv in (
        ["train", "--config", name, "--steps", "2", "--batch-size", "2",
         "--seq-len", "8", "--no-progress", "--data", str(corpus),
         "--tokenizer", str(tokenizer), "--checkpoint-dir", str(run)],
        ["export", "--checkpoint-dir", str(run), "--out", str(out),
         "--format", "hf"],
    ):  # fmt: skip
      code, _, err = cli_helpers.cli(*argv)
      self.assertEqual(code, 0, err)
    self.assertEqual(
        json.loads((out / "config.json").read_text()),
        _fixture(name, "config.json"),
    )
    self.assertEqual(
        sorted(p.name for p in out.iterdir()),
        ["config.json", "generation_config.json", "model.safetensors",
         "tokenizer.json", "tokenizer_config.json"],
    )  # fmt: skip
    config, variables, _ = checkpoint.read_variables(run)
    back_config, back = hf.load_checkpoint(out)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 64
    want, _ = jax.jit(Decoder(config).apply)(variables, tokens)
    got, _ = jax.jit(Decoder(back_config).apply)(back, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
