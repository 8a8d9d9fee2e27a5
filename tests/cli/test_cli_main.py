"""The shape of the `linen-moe` command line: one module per subcommand,
help that answers without jax, a validated options object for `train`, one
registry of front ends."""

import dataclasses
import os
import subprocess
import sys

from absl.testing import absltest

from linen_moe import training
from linen_moe.training import RunOptions
from linen_moe_cli import commands
from linen_moe_cli import main as cli
from linen_moe_cli import options
from tests import cli_helpers

# nnx_adapter's face loads nothing until a name is used (the front ends'
# names are read without it); its modules import flax.
HEAVY = ("jax", "flax", "optax", "aqt", "orbax")
ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
HF_FIXTURE = os.path.join(
    ROOT, "tests", "fixtures", "hf", "qwen3_moe_dense0_norm"
)


def _run(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, *argv],
      capture_output=True,
      text=True,
      cwd=ROOT,
      timeout=120,
      check=False,
  )


def _imported(importtime_stderr: str) -> list[str]:
  """The modules `python -X importtime` reported importing."""
  return [
      line.rsplit("|", 1)[1].strip()
      for line in importtime_stderr.splitlines()
      if line.startswith("import time:") and "|" in line
  ]


def _heavy(module_names) -> list[str]:
  return sorted({
      m
      for m in module_names
      if m.split(".")[0] in HEAVY or m.startswith("nnx_adapter.")
  })


class HelpImportsNoJaxTest(absltest.TestCase):

  def test_top_level_help(self):
    # `-X importtime` lists every module the process imported, on stderr.
    done = _run("-X", "importtime", "-m", "linen_moe_cli.main", "--help")
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    for name in (c.__name__.rsplit(".", 1)[1] for c in commands.COMMANDS):
      self.assertIn(name, done.stdout)
    imported = _imported(done.stderr)
    self.assertIn("linen_moe_cli.commands.train", imported)
    self.assertEqual(_heavy(imported), [])

  def test_bad_train_flag_is_reported_before_jax(self):
    done = _run(
        "-X", "importtime", "-m", "linen_moe_cli.main", "train", "--steps=0"
    )
    self.assertEqual(done.returncode, 2)
    self.assertIn("linen-moe: error: steps=0 (--steps) is invalid", done.stderr)
    self.assertEqual(_heavy(_imported(done.stderr)), [])

  def test_every_subcommand_help(self):
    script = (
        "import contextlib, io, sys\n"
        "from linen_moe_cli import commands, main\n"
        "for c in commands.COMMANDS:\n"
        "  name = c.__name__.rsplit('.', 1)[1]\n"
        "  with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "      main.main([name, '--help'])\n"
        "    except SystemExit as e:\n"
        "      assert e.code == 0, (name, e.code)\n"
        "  assert 'usage: linen-moe ' + name in out.getvalue(), name\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    done = _run("-c", script)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertEqual(_heavy(done.stdout.split()), [])


class StructureTest(absltest.TestCase):

  def test_each_command_registers_and_runs(self):
    parser = cli.build_parser()
    for command in commands.COMMANDS:
      name = command.__name__.rsplit(".", 1)[1]
      self.assertTrue(callable(command.register), name)
      argv = [name] if name != "launch" else [name, "--local-processes=1"]
      if name == "export":
        argv += ["--checkpoint-dir=a", "--out=b"]
      if name == "tokenizer":
        argv += ["train", "a.txt", "--vocab-size=8", "--out=t.json"]
      self.assertIs(parser.parse_args(argv).run, command.run, name)

  def test_train_options_from_default_flags(self):
    # Every flag set, group by group: test_cli_flag_groups.py.
    args = cli.build_parser().parse_args(["train"])
    opts = options.run_options(args)
    self.assertEqual(opts, RunOptions())
    with self.assertRaises(dataclasses.FrozenInstanceError):
      opts.steps = 8  # pytype: disable=not-writable

  def test_train_options_name_the_flag(self):
    for fields, message in (
        (dict(seed=-1), r"^seed=-1 is invalid"),
        (dict(keep=0), r"^keep=0 is invalid"),
        (dict(save_every=2), r"^save_every=2 is invalid: .*`checkpoint_dir`"),
    ):
      with self.subTest(**fields), self.assertRaisesRegex(ValueError, message):
        RunOptions(**fields)

  def test_version(self):
    import linen_moe  # noqa: PLC0415

    status, out, err = cli_helpers.cli("--version")
    self.assertEqual(
        (status, out, err), (0, f"linen-moe {linen_moe.__version__}\n", "")
    )
    status, out, err = cli_helpers.cli("--version", "train")
    self.assertEqual((status, out), (2, ""))
    self.assertEqual(
        err,
        "linen-moe: error: --version takes no other arguments (got --version"
        " train)\n",
    )

  def test_a_misspelt_flag_shows_its_commands_usage(self):
    status, out, err = cli_helpers.cli("train", "--stpes", "3")
    self.assertEqual((status, out), (2, ""))
    self.assertRegex(err, r"^usage: linen-moe train ")
    self.assertIn(
        "linen-moe train: error: unrecognized arguments: --stpes 3", err
    )

  def test_help_shows_every_default(self):
    status, out, _ = cli_helpers.cli("train", "--help")
    self.assertEqual(status, 0)
    text = " ".join(out.split("options:", 1)[1].split())  # argparse wraps
    # A recipe's field: each recipe's value (the run's start picks one).
    scratch = RunOptions()
    pretrained = RunOptions(init_from_hf=str(HF_FIXTURE))
    lora = RunOptions(lora_rank=4)
    for flag, default in (
        ("--steps", None),
        ("--batch-size", None),
        ("--seq-len", None),
        ("--learning-rate", None),
        ("--seed", scratch.seed),
        ("--log-every", scratch.log_every),
        ("--init-timeout", 300),
        ("--heartbeat-timeout", 30),
    ):
      entry = text[text.index(f"{flag} ") :]
      end = entry.find(" --", 2)
      entry = entry if end < 0 else entry[:end]
      name = flag[2:].replace("-", "_")
      shown = default
      if default is None:
        shown = (
            f"the recipe's: {getattr(scratch, name)} from scratch, "
            f"{getattr(pretrained, name)} from a pretrained model, "
            f"{getattr(lora, name)} with LoRA"
        )
      self.assertIn(f"(default: {shown})", entry, flag)
    self.assertIn(  # --warmup-steps
        "(default: the recipe's: 0 from scratch, 3% of the steps from a "
        "pretrained model, 3% of the steps with LoRA)",
        text,
    )
    self.assertNotIn("DEFAULT_", out)  # a value, not a constant's name

  def test_frontend_help_names_every_front_end(self):
    for name in training.FRONTENDS:
      self.assertIn(f"{name}: ", options.frontend_help())


if __name__ == "__main__":
  absltest.main()
