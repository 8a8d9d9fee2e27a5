"""`linen-moe train`'s flags, one command line per flag group: every flag of
the group set to a value that is not its default, parsed by the real
parser into the `RunOptions` a Python user writes with objects (a tuple
of LoRA targets, a pair of profiled steps, a dict of overrides), and the
flags that are no `RunOptions` field (`--frontend`, the processes' flags)
followed to where `train` hands them (`train_and_report`,
`linen_moe.distributed.initialize`).

The groups are the parser's own: its argument groups (real data,
optimizer, LoRA, multiple processes) and, among the other options, the
model's (`model_args.add_model_args`) and the run's. A completeness test
walks the parser: a new flag no command line here sets, or one whose value
goes nowhere, fails it. Nothing here compiles or trains: each run stops
where `train` would start it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
import contextlib
import dataclasses
import io
import os
import sys
import tempfile
import types
from unittest import mock
import warnings

from absl.testing import absltest

from linen_moe import distributed
from linen_moe.training import RunOptions
from linen_moe_cli import main as cli
from linen_moe_cli import model_args
from linen_moe_cli import options
from linen_moe_cli.commands import train as train_command

# What `distributed.initialize` gets from a command without the processes'
# flags: no process to join, the documented timeouts (300 s, 30 s).
ALONE = ((None, None, None), {"init_timeout_s": 300, "heartbeat_timeout_s": 30})
# Where a one-process run without --checkpoint-dir is told to write.
RUN_DIR = "runs/the-default-run-directory"
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Case:
  """One command line of a flag group and what it must become.

  Attributes:
    flags: the group's flags, each with its value(s): ("--seed", "11").
    expected: the `RunOptions`, written as a Python user would.
    frontend: the front end `train_and_report` gets.
    joined: the arguments (args, kwargs) of `distributed.initialize`.
    support: flags of other groups that the group's values need (e.g. the
      quantization of a frozen serving base); left in when a flag is
      dropped.
  """

  flags: tuple[tuple[str, ...], ...]
  expected: RunOptions
  frontend: str = "linen"
  joined: tuple = ALONE
  support: tuple[str, ...] = ()

  def argv(self, leave_out: int | None = None) -> list[str]:
    """The command line's arguments, without flag `leave_out` if given."""
    kept = [f for i, f in enumerate(self.flags) if i != leave_out]
    return [*self.support, *(token for flag in kept for token in flag)]


def _train_parser() -> argparse.ArgumentParser:
  return cli.build_parser().command_parsers["train"]


def _parse(argv: list[str]) -> argparse.Namespace:
  return cli.build_parser().parse_args(["train", *argv])


def _options(argv: list[str]) -> RunOptions:
  """`options.run_options` of `linen-moe train ARGV`. A deprecation warning
  is an error: `RunOptions` still reads 0.2's strings ("a,b", "A:B") with
  one, and the parser must hand it objects."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    return options.run_options(_parse(argv))


@contextlib.contextmanager
def _item(mapping: dict, key: str, value) -> Iterator[None]:
  """`mapping[key]` is `value` within; then as it was. (`mock.patch.dict`
  would restore a copy of the whole dict, and so drop the modules that
  were first imported within from `sys.modules`.)"""
  old = mapping.get(key, _MISSING)
  mapping[key] = value
  try:
    yield
  finally:
    if old is _MISSING:
      del mapping[key]
    else:
      mapping[key] = old


def _stub_tensorboardx():
  """`RunOptions(tensorboard=...)` checks that tensorboardX imports, and
  the test extra does not install it; nothing here writes an event."""
  return _item(sys.modules, "tensorboardX", types.ModuleType("tensorboardX"))


def _dispatched(argv: list[str]) -> tuple:
  """What `linen-moe train ARGV` hands on, stopped there: (the arguments of
  `distributed.initialize`, the options and the front end given to
  `train_and_report`), or ("error", message) for a rejected command.
  `initialize` says "several processes" when given a coordinator."""
  calls = {}

  def initialize(*args, **kwargs):
    calls["joined"] = (args, kwargs)
    return args[0] is not None

  def train_and_report(opts, frontend, argv, flags):
    del argv, flags  # the resume hint's and the messages'
    calls["train"] = (opts, frontend)
    return 0

  with (
      # The face loads `initialize` (and jax) on first use: set it directly.
      _item(distributed.__dict__, "initialize", initialize),
      mock.patch.object(train_command, "train_and_report", train_and_report),
      mock.patch.object(options, "default_run_dir", lambda name: RUN_DIR),
      contextlib.redirect_stdout(io.StringIO()),  # "run directory: ..."
      _stub_tensorboardx(),
  ):
    try:
      status = train_command.run(_parse(argv))
    except ValueError as e:
      return ("error", str(e))
  assert status == 0, status
  return (calls["joined"], *calls["train"])


def _groups() -> dict[str, list[argparse.Action]]:
  """`train`'s options by flag group: its argument groups by title, and its
  other options split into the model's (those `add_model_args` adds) and
  the run's."""
  model = argparse.ArgumentParser()
  model_args.add_model_args(model)
  model_dests = {a.dest for a in model._actions}  # noqa: SLF001
  parser = _train_parser()
  groups = {}
  for group in parser._action_groups:  # noqa: SLF001 (argparse has no API)
    default = group in (parser._optionals, parser._positionals)  # noqa: SLF001
    for action in group._group_actions:  # noqa: SLF001
      if action.dest == "help":
        continue
      name = group.title
      if default:
        name = "model" if action.dest in model_dests else "run"
      groups.setdefault(name, []).append(action)
  return groups


class FlagGroupsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    tmp = self.enterContext(tempfile.TemporaryDirectory())
    self.path = lambda *parts: os.path.join(tmp, *parts)
    # What `RunOptions` checks before any work: the files exist, a
    # Hugging Face directory has a config.json, a run's directory a step.
    for name in ("rows.bin", "tokenizer.json", "hf/config.json", "run/4/x"):
      os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
      with open(self.path(name), "w") as f:
        f.write("{}")

  def cases(self) -> dict[str, list[Case]]:
    """Every group's command lines, by group (`_groups`' names)."""
    return {
        "model": self.model_cases(),
        "run": self.run_cases(),
        "real data": self.data_cases(),
        "optimizer": self.optimizer_cases(),
        "LoRA and QLoRA": self.lora_cases(),
        "multiple processes": self.process_cases(),
    }

  def assert_case(self, case: Case) -> None:
    with _stub_tensorboardx():
      opts = _options(case.argv())
    self.assertEqual(opts, case.expected)
    # `train` hands the same options on (a one-process run without a
    # directory gets a new one), the front end and the processes' flags.
    if case.expected.checkpoint_dir is None and case.joined == ALONE:
      opts = dataclasses.replace(opts, checkpoint_dir=RUN_DIR)
    self.assertEqual(
        _dispatched(case.argv()), (case.joined, opts, case.frontend)
    )

  def model_cases(self) -> list[Case]:
    return [
        Case(
            flags=(
                ("--config", "tiny_qwen3_moe"),
                ("--quantization", "fp8"),
                ("--no-sparse-matmul",),
                ("--capacity-factor", "1.25"),
                ("--layers", "unrolled"),
                ("--set", "num_layers=1"),
                ("--set", "router_z_loss_weight=1e-3"),
            ),
            expected=RunOptions(
                config="tiny_qwen3_moe",
                overrides={
                    "quantization": "fp8",
                    "sparse_matmul": False,
                    "capacity_factor": 1.25,
                    "scan_layers": False,
                    "num_layers": 1,
                    "router_z_loss_weight": 0.001,
                },
            ),
        ),
        # The other spelling of each two-way flag.
        Case(
            flags=(("--sparse-matmul",), ("--layers", "scanned")),
            expected=RunOptions(
                overrides={"sparse_matmul": True, "scan_layers": True}
            ),
        ),
    ]

  def run_cases(self) -> list[Case]:
    # --init-from-hf and --init-from exclude each other: one line each.
    return [
        Case(
            flags=(
                ("--steps=37",),  # the = spelling too
                ("--batch-size", "6"),
                ("--seq-len", "24"),
                ("--learning-rate", "0.0025"),
                ("--grad-accum", "3"),
                ("--seed", "11"),
                ("--remat", "save_experts"),
                ("--mesh", "data=1,expert=1"),
                ("--frontend", "nnx"),
                ("--max-consecutive-skips", "4"),
                ("--no-progress",),
                ("--log-every", "5"),
                ("--checkpoint-dir", self.path("ckpt")),
                ("--save-every", "9"),
                ("--keep", "2"),
                ("--resume-step", "18"),
                ("--fresh-fp8-state",),
                ("--init-from-hf", self.path("hf")),
                ("--profile-steps", "3:7"),
                ("--tensorboard", self.path("tb")),
                ("--step-timeout", "42.5"),
            ),
            expected=RunOptions(
                steps=37,
                batch_size=6,
                seq_len=24,
                learning_rate=2.5e-3,
                grad_accum=3,
                seed=11,
                overrides={"remat": "save_experts"},
                mesh="data=1,expert=1",
                max_consecutive_skips=4,
                progress=False,
                log_every=5,
                checkpoint_dir=self.path("ckpt"),
                save_every=9,
                keep=2,
                resume_step=18,
                fresh_fp8_state=True,
                init_from_hf=self.path("hf"),
                profile_steps=(3, 7),
                tensorboard=self.path("tb"),
                step_timeout=42.5,
            ),
            frontend="nnx",
        ),
        Case(
            flags=(("--init-from", self.path("run")),),
            expected=RunOptions(init_from=self.path("run")),
        ),
    ]

  def data_cases(self) -> list[Case]:
    return [
        Case(
            flags=(
                ("--data", self.path("rows.bin")),
                ("--tokenizer", self.path("tokenizer.json")),
                ("--data-format", "bin"),
                ("--data-dtype", "uint32"),
                ("--packing", "first_fit"),
                ("--eod-id", "2"),
                ("--eval-every", "5"),
                ("--eval-batches", "3"),
                ("--eval-fraction", "0.25"),
            ),
            expected=RunOptions(
                data=self.path("rows.bin"),
                tokenizer=self.path("tokenizer.json"),
                data_format="bin",
                data_dtype="uint32",
                packing="first_fit",
                eod_id=2,
                eval_every=5,
                eval_batches=3,
                eval_fraction=0.25,
            ),
        )
    ]

  def optimizer_cases(self) -> list[Case]:
    return [
        Case(
            flags=(
                ("--lr-schedule", "linear"),
                ("--warmup-steps", "4"),
                ("--final-lr-ratio", "0.2"),
                ("--weight-decay", "0.05"),
            ),
            expected=RunOptions(
                lr_schedule="linear",
                warmup_steps=4,
                final_lr_ratio=0.2,
                weight_decay=0.05,
            ),
        )
    ]

  def lora_cases(self) -> list[Case]:
    return [
        Case(
            flags=(
                ("--lora-rank", "4"),
                ("--lora-alpha", "8"),
                ("--lora-targets", "experts,attention"),
                ("--lora-dropout", "0.1"),
                ("--frozen-base-serving",),
            ),
            # A frozen serving base is stored in a quantized type.
            support=("--quantization", "int8"),
            expected=RunOptions(
                overrides={"quantization": "int8"},
                lora_rank=4,
                lora_alpha=8.0,
                lora_targets=("experts", "attention"),
                lora_dropout=0.1,
                frozen_base_serving=True,
            ),
        )
    ]

  def process_cases(self) -> list[Case]:
    # No `RunOptions` field: they go to `distributed.initialize`, and the
    # run is the default one (with no run directory of its own).
    return [
        Case(
            flags=(
                ("--coordinator", "10.0.0.1:1234"),
                ("--num-processes", "2"),
                ("--process-id", "1"),
                ("--init-timeout", "60"),
                ("--heartbeat-timeout", "15"),
            ),
            expected=RunOptions(),
            joined=(
                ("10.0.0.1:1234", 2, 1),
                {"init_timeout_s": 60, "heartbeat_timeout_s": 15},
            ),
        )
    ]

  def test_model_flags(self):
    for case in self.model_cases():
      with self.subTest(argv=case.argv()):
        self.assert_case(case)

  def test_run_flags(self):
    for case in self.run_cases():
      with self.subTest(argv=case.argv()):
        self.assert_case(case)

  def test_data_flags(self):
    for case in self.data_cases():
      self.assert_case(case)

  def test_optimizer_flags(self):
    for case in self.optimizer_cases():
      self.assert_case(case)

  def test_lora_flags(self):
    for case in self.lora_cases():
      self.assert_case(case)

  def test_process_flags(self):
    for case in self.process_cases():
      self.assert_case(case)

  def test_every_flag_is_set_by_its_groups_command_line(self):
    cases = self.cases()
    groups = _groups()
    self.assertEqual(sorted(groups), sorted(cases))  # a group without cases
    for name, actions in groups.items():
      parsed = [vars(_parse(case.argv())) for case in cases[name]]
      for action in actions:
        with self.subTest(group=name, flag=action.option_strings[0]):
          self.assertTrue(
              any(args[action.dest] != action.default for args in parsed),
              f"no command line of group {name!r} sets {action.dest}",
          )

  def test_every_flag_reaches_the_run(self):
    # Without any one flag, the command hands on something else: no flag
    # is parsed and then lost.
    for name, cases in self.cases().items():
      for case in cases:
        full = _dispatched(case.argv())
        self.assertNotEqual(full[0], "error", full)
        for i, flag in enumerate(case.flags):
          with self.subTest(group=name, flag=flag[0]):
            self.assertNotEqual(_dispatched(case.argv(leave_out=i)), full)


if __name__ == "__main__":
  absltest.main()
