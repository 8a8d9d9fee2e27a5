"""`linen-moe export --format adapters` of GPT-OSS and Llama-4 LoRA runs,
whose routed experts (stored as x @ W) have no PEFT form: PEFT's files hold
every other adapter, linen_moe's files beside them hold all of them, and
those load back onto the base into the run's logits.

The PEFT half is checked against PEFT's own formula: a module's delta is
(lora_alpha / r) lora_B @ lora_A [out, in], which must equal the run's
adapter delta (alpha / r) (A B)^T of the same kernel. The default test
builds the run's checkpoint directly (random adapters on the families'
fixtures); the heavy one trains it with `linen-moe train --init-from-hf`.
"""

from __future__ import annotations

import json
import os
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
from safetensors.numpy import load_file

from linen_moe import Decoder
from linen_moe import checkpoint
from linen_moe import frontend
from linen_moe import hf
from linen_moe import lora
from linen_moe._src.hf import peft
from linen_moe._src.lora import tree
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from linen_moe.sharding import unbox
from tests import cli_helpers

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
RANK = 4
# (fixture, {PEFT module or parameter: (its kernel's params path in an
# unrolled stack, axes of the kernel that are the input)}): one attention
# module, and Llama-4's shared expert, a parameter target.
CASES = {
    "gpt_oss_mxfp4": {
        "model.layers.0.self_attn.q_proj": ("layers_0/attention/query/kernel", 1),
        "model.layers.1.self_attn.o_proj": ("layers_1/attention/out/kernel", 2),
    },
    "llama4_text_all_moe": {
        "model.layers.0.self_attn.k_proj": ("layers_0/attention/key/kernel", 1),
        "model.layers.1.feed_forward.shared_expert.gate_proj": (
            "layers_1/moe/shared_experts/wi_0",
            1,
        ),
    },
}  # fmt: skip


def _paths(tree_, prefix=()):
  out = {}
  for k, v in tree_.items():
    if isinstance(v, dict):
      out.update(_paths(v, (*prefix, k)))
    else:
      out[(*prefix, k)] = v
  return out


def _lora_run(base: str, run: str):
  """A LoRA run's checkpoint at step 1 in `run`: the fixture `base`
  (unrolled), default targets, random adapters (B not 0)."""
  config, variables = hf.load_checkpoint(FIXTURES / base, scan_layers=False)
  config = config.replace(lora_rank=RANK)
  shapes = jax.eval_shape(  # the adapters' shapes (init runs eagerly: slow)
      lambda v: lora.init_adapters(config, v, jax.random.key(0)), variables
  )
  adapters = lora.split(unbox(shapes)["params"])[0]
  rng = np.random.default_rng(0)
  adapters = jax.tree.map(
      lambda x: 0.1 * rng.standard_normal(x.shape).astype(x.dtype), adapters
  )
  variables = unbox(variables)
  frozen = lora.split(variables["params"])[1]
  variables = {**variables, "params": lora.join(adapters, frozen)}
  with checkpoint.Checkpoints(run) as ckpts:
    meta = {
        "model_config": checkpoint.config_dict(config),
        "run": {"init_from_hf": str(FIXTURES / base)},
    }
    ckpts.save(1, {frontend.VARIABLES: variables}, meta)
  return config, variables


class _ExportChecks(parameterized.TestCase):

  def check_export(self, base: str, run: str) -> None:
    """`export --format adapters` of the LoRA run in `run` on `base`:
    what it writes, and that it loads back into the run's logits."""
    config, variables, _ = checkpoint.read_variables(run)
    self.assertEqual(config.moe.lora.targets, lora.TARGETS)  # the default
    out = os.path.join(run, "adapters")
    printed = cli_helpers.cli_output(
        "export", "--checkpoint-dir", run, "--out", out, "--format",
        "adapters",
    )  # fmt: skip
    self.assertRegex(
        printed,
        r"in PEFT's format all but the routed experts' \(the routed experts "
        r"of \w+ are stored as x @ W and have no PEFT form; .*linen_moe's "
        r"adapters.safetensors and adapters.json hold every adapter",
    )
    self.assertEqual(
        sorted(os.listdir(out)),
        [
            "adapter_config.json",
            "adapter_model.safetensors",
            "adapters.json",
            "adapters.safetensors",
        ],
    )
    # linen_moe's files: onto the base, the run's logits.
    base_vars = {
        **unbox(variables),
        "params": lora.split(unbox(variables)["params"])[1],
    }
    back_cfg, back = lora.load_adapters(
        tree.without_adapters(config), base_vars, out
    )
    self.assertEqual(back_cfg.moe.lora, config.moe.lora)
    ids = np.load(FIXTURES / base / "input_ids.npy")
    apply = jax.jit(Decoder(config).apply)  # back_cfg is config
    want = np.asarray(apply(variables, ids)[0])
    got = np.asarray(apply(back, ids)[0])
    np.testing.assert_array_equal(got, want)
    # The adapters matter: transformers' logits of the base are far off.
    plain = np.load(FIXTURES / base / "logits.npy")
    self.assertGreater(float(np.abs(want - plain).max()), 1e-2)

    # PEFT's files: no routed expert's tensor; each module's delta by
    # PEFT's formula equals the run's.
    meta = json.loads(pathlib.Path(out, "adapter_config.json").read_text())
    tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
    self.assertFalse([n for n in tensors if ".experts." in n])
    self.assertFalse(
        [t for t in meta["target_parameters"] if "experts.gate_up" in t]
    )
    self.assertTrue(meta["target_modules"])
    flat = _paths(unbox(variables)["params"])
    params = {"/".join(k): v for k, v in flat.items()}
    scale = config.moe.lora.alpha / config.moe.lora.rank
    for module, (kernel, in_axes) in CASES[base].items():
      a = np.asarray(params[kernel + "_lora_a"], np.float64)
      b = np.asarray(params[kernel + "_lora_b"], np.float64)
      ours = scale * (a.reshape(-1, RANK) @ b.reshape(RANK, -1)).T
      lora_a = tensors[f"base_model.model.{module}.lora_A.weight"]
      lora_b = tensors[f"base_model.model.{module}.lora_B.weight"]
      theirs = (meta["lora_alpha"] / meta["r"]) * (
          lora_b.astype(np.float64) @ lora_a.astype(np.float64)
      )
      self.assertEqual(theirs.shape[1], int(np.prod(a.shape[:in_axes])))
      np.testing.assert_allclose(theirs, ours, rtol=1e-6, atol=1e-9)


class ExportAdaptersTest(_ExportChecks):

  @parameterized.parameters(*CASES)
  def test_export_and_load_back(self, base):
    run = helpers.tempdir(self)
    _lora_run(base, run)
    self.check_export(base, run)

  def test_library_refuses_without_the_option(self):
    config, variables = _lora_run("gpt_oss_mxfp4", helpers.tempdir(self))
    out = pathlib.Path(helpers.tempdir(self))
    with self.assertRaisesRegex(
        ValueError, r"gpt_oss \(model.layers.0.mlp.experts.gate_up_proj, "
        r"stored as x @ W\) have no PEFT form here.*no_peft_form='linen_moe'"
    ):  # fmt: skip
      hf.save_peft_adapters(config, variables, out / "a")
    with self.assertRaisesRegex(
        ValueError, r"no_peft_form='own' is invalid: expected one of"
    ):
      hf.save_peft_adapters(config, variables, out / "b", no_peft_form="own")
    # Every routed expert kernel is named, down_proj too (stored whole).
    self.assertEqual(
        peft.without_peft_form(config),
        [
            f"model.layers.{i}.mlp.experts.{name}"
            for i in range(config.num_layers)
            for name in ("down_proj", "gate_up_proj")
        ],
    )
    # The experts alone: nothing for PEFT, linen_moe's files only.
    experts = config.replace(lora_targets=("experts",))
    files = hf.save_peft_adapters(
        experts, variables, out / "c", no_peft_form="linen_moe"
    )
    self.assertEqual(
        [f.name for f in files], ["adapters.safetensors", "adapters.json"]
    )
    self.assertFalse((out / "a").exists() or (out / "b").exists())


@heavy
class TrainThenExportAdaptersTest(_ExportChecks):
  """The issue's command lines: train from the fixture, then export."""

  @parameterized.parameters(*CASES)
  def test_export_and_load_back(self, base):
    run = os.path.join(helpers.tempdir(self), "run")
    cli_helpers.cli_output(
        "train", "--init-from-hf", str(FIXTURES / base), "--lora-rank",
        str(RANK), "--layers", "unrolled", "--learning-rate", "1e-2",
        "--steps", "2", "--batch-size", "2", "--seq-len", "8",
        "--no-progress", "--checkpoint-dir", run,
    )  # fmt: skip
    self.check_export(base, run)


if __name__ == "__main__":
  absltest.main()
