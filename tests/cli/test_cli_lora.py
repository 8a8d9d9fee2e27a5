"""`linen-moe train`'s LoRA flags (their bad input, named before jax) and
the run banner's LoRA lines; `linen-moe export --format hf` of a QLoRA run
(on a Hugging Face base, chat data) is the merged model, `--format
adapters` its adapters, in PEFT's format where the model has a Hugging Face
form. The LoRA run itself (its fields, its exact resume):
tests/run/test_lora_runs.py."""

from __future__ import annotations

import json
import os
import pathlib
import types

from absl.testing import absltest
import jax
import numpy as np
from safetensors.numpy import load_file

from linen_moe import Decoder
from linen_moe import checkpoint
from linen_moe import frontend
from linen_moe import hf
from linen_moe import load_model_config
from linen_moe import lora
from linen_moe import testing
from linen_moe import training
from linen_moe._src.hf import peft
from linen_moe._src.lora import tree
from linen_moe._src.run import banner
from linen_moe._src.testing import helpers
from linen_moe.sharding import unbox
from linen_moe.testing import slow
from linen_moe.training import RunOptions
from linen_moe_cli import main as cli
from tests import cli_helpers
from tests import lora_runs


class LoRAFlagsTest(absltest.TestCase):
  """One line naming the flag, before jax is imported."""

  def test_bad_flags(self):
    cases = (
        (["--lora-rank", "-1"], r"lora_rank=-1 \(--lora-rank\)"),
        (["--lora-alpha", "8"], r"--lora-alpha.*needs --lora-rank"),
        (
            ["--lora-rank", "4", "--lora-targets", "experts,ffn"],
            r"--lora-targets.*unknown: \['ffn'\]",
        ),
        (
            ["--lora-rank", "4", "--lora-dropout", "1"],
            r"--lora-dropout.*\[0, 1\)",
        ),
        (["--frozen-base-serving"], r"--frozen-base-serving.*a --lora-rank"),
        (
            ["--lora-rank", "4", "--frozen-base-serving"],
            r"--frozen-base-serving.*needs a --quantization",
        ),
    )
    for argv, message in cases:
      with self.subTest(argv=argv):
        status, _, err = cli_helpers.cli("train", *argv)
        self.assertEqual(status, 2, err)
        self.assertRegex(err, message)


@slow
class QLoRAExportTest(absltest.TestCase):
  """`linen-moe export` of a QLoRA run (trained by `training.run`;
  its resume: test_lora_runs.py): `--format hf` is the merged model,
  `--format adapters` its adapters in PEFT's format."""

  def test_export(self):
    tmp = helpers.tempdir(self)
    base, chats = lora_runs.write_inputs(tmp)
    whole = os.path.join(tmp, "whole")
    training.run(lora_runs.options(base, chats, whole), log=lambda _: None)

    config, variables, _ = checkpoint.read_variables(whole)
    self.assertTrue(config.moe.serving and config.moe.lora_rank == 4)
    plain_cfg, plain = lora.merge(config, variables)
    merged = os.path.join(tmp, "merged")
    code, out, err = testing.run_capturing(
        cli.main,
        [
            "export",
            "--checkpoint-dir",
            whole,
            "--out",
            merged,
            "--format",
            "hf",
        ],
    )
    self.assertEqual(code, 0, out + err)
    loaded_cfg, loaded = hf.load_checkpoint(merged)
    ids = np.arange(16, dtype=np.int32).reshape(2, 8) + 3
    want = jax.jit(Decoder(plain_cfg).apply)(plain, ids)[0]
    got = jax.jit(Decoder(loaded_cfg).apply)(loaded, ids)[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)

    out_dir = os.path.join(tmp, "adapters")
    code, out, err = testing.run_capturing(
        cli.main,
        [
            "export",
            "--checkpoint-dir",
            whole,
            "--out",
            out_dir,
            "--format",
            "adapters",
        ],
    )
    self.assertEqual(code, 0, out + err)
    self.assertIn("in PEFT's format", out)
    # PEFT's files (what PEFT reads of them: test_hf_peft.py), for the base
    # the run started from; the same tensors as the library writes.
    meta = json.loads(pathlib.Path(out_dir, "adapter_config.json").read_text())
    self.assertEqual(
        (meta["peft_type"], meta["r"], meta["lora_alpha"]), ("LORA", 4, 8.0)
    )
    self.assertEqual(meta["base_model_name_or_path"], base)
    written = load_file(os.path.join(out_dir, "adapter_model.safetensors"))
    want, _ = peft.peft_tensors(config, variables)
    self.assertEqual(list(written), list(want))
    for name, value in want.items():
      np.testing.assert_array_equal(written[name], value)
    # linen_moe's own files load back.
    own = os.path.join(tmp, "own")
    lora.save_adapters(config, variables, own)
    base_cfg = tree.without_adapters(config)
    _, back = lora.load_adapters(base_cfg, variables, own)
    jax.tree.map(
        np.testing.assert_array_equal,
        lora.split(back["params"])[0],
        lora.split(unbox(variables)["params"])[0],
    )


class LoRABannerTest(absltest.TestCase):
  """The banner's LoRA line and step range (no jax computation)."""

  def banner(self, first_step: int = 1, **kwargs) -> str:
    kwargs.setdefault("config", "tiny_mixtral")
    opts = RunOptions(steps=150, batch_size=2, seq_len=8, **kwargs)
    config = load_model_config(opts.config, **opts.overrides)
    settings = {
        "lr_schedule": "constant",
        "warmup_steps": 0,
        "learning_rate": 2e-4,
        "weight_decay": 0.0,
    }
    devices = [types.SimpleNamespace(platform="cpu")]
    return "\n".join(
        banner.lines(opts, config, {}, {}, devices, None, settings, first_step)
    )

  def test_alpha_is_the_effective_one(self):
    # No --lora-alpha: alpha = rank (the config's 0 means it).
    self.assertIn("lora_alpha=4.0,", self.banner(lora_rank=4))
    self.assertNotIn("lora_alpha=0.0", self.banner(lora_rank=4))
    self.assertIn("lora_alpha=8.0,", self.banner(lora_rank=4, lora_alpha=8.0))

  def test_resumed_steps(self):
    text = self.banner(first_step=54, lora_rank=4)
    self.assertIn("  steps 54-150, batch 2 x 8 tokens (1,552 in all)", text)
    self.assertIn("  steps 1-150, batch 2 x 8 tokens (2,400 in all)",
                  self.banner(lora_rank=4))  # fmt: skip

  def test_what_the_adapters_export_as(self):
    for name, model_type in (("tiny_gpt_oss", "gpt_oss"),
                             ("tiny_llama4", "llama4_text")):  # fmt: skip
      self.assertIn(
          f"  Hugging Face: exports as {model_type}, adapters in PEFT's "
          "format but the routed experts' (stored as x @ W: linen_moe's "
          "files hold them)",
          self.banner(config=name, lora_rank=4),
      )
    self.assertIn(
        "  Hugging Face: exports as mixtral, adapters in PEFT's format\n",
        self.banner(config="tiny_mixtral", lora_rank=4),
    )
    # Without the experts as a target, all of it is PEFT's.
    self.assertIn(
        "exports as gpt_oss, adapters in PEFT's format\n",
        self.banner(
            config="tiny_gpt_oss", lora_rank=4, lora_targets=("attention",)
        ),
    )


class AdaptersWithoutHFFormTest(absltest.TestCase):

  def test_export_writes_linen_moe_files(self):
    # tiny_gemma4_26b has no Hugging Face form, so no PEFT form either.
    cfg = load_model_config("tiny_gemma4_26b", lora_rank=2, num_layers=1)
    tokens = np.zeros((1, 4), np.int32)
    variables = unbox(Decoder(cfg).init(jax.random.key(0), tokens))
    run = helpers.tempdir(self)
    with checkpoint.Checkpoints(run) as ckpts:
      meta = {"model_config": checkpoint.config_dict(cfg)}
      ckpts.save(1, {frontend.VARIABLES: variables}, meta)
    out = os.path.join(run, "adapters")
    code, printed, err = testing.run_capturing(
        cli.main,
        ["export", "--checkpoint-dir", run, "--out", out, "--format",
         "adapters"],
    )  # fmt: skip
    self.assertEqual(code, 0, err)
    self.assertRegex(
        printed,
        r"as linen_moe's adapters.safetensors and adapters.json .*not "
        r"PEFT's: this model has no Hugging Face form \(the nearest family, "
        r"gemma4_text, needs qk_norm=True",
    )
    self.assertEqual(
        sorted(os.listdir(out)), ["adapters.json", "adapters.safetensors"]
    )


if __name__ == "__main__":
  absltest.main()
