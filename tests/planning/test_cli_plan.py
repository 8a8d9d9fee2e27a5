"""`linen-moe plan` and `linen_moe.planning`: a compiled (never run) step's
bytes per device, FLOPs and verdict, and the command's one-line errors.

One child process runs `linen-moe plan --config tiny_mixtral --target
cpu:8 --json` (the device count must be set before jax starts) with a
device memory too small for the step, so that it also shows the plan that
does not fit (exit 1, one line naming the biggest consumer). The FLOPs are
checked against the count written out by hand from the config's fields,
the parameter bytes against its parameter count, the attention pairs of a
sliding-window config against an explicit mask. CI runs the fitting plan
(`.ci/run`).
"""

import functools
import json
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from linen_moe import load_model_config
from linen_moe import planning
from linen_moe import testing
from linen_moe._src.planning import flops
from linen_moe._src.planning import plan as plan_lib
from linen_moe._src.planning import targets as targets_lib
from tests import cli_helpers
from tests import workers

PLAN_KEYS = (
    "target",
    "devices",
    "per_device",
    "device_memory_bytes",
    "fits",
    "flops_per_step",
    "tokens_per_step",
    "estimated_step_s",
    "estimated_mfu",
)
PER_DEVICE_KEYS = ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes")
B, S = 16, 32  # linen-moe train's default batch and sequence


_cli = cli_helpers.cli


def tiny_mixtral_train_flops(batch: int, seq: int) -> int:
  """Model FLOPs of a tiny_mixtral train step, from its YAML fields by
  hand: 6 B S (active matmul parameters) + 3 (forward attention)."""
  m, heads, head_dim, layers = 64, 4, 16, 2
  experts, top_k, mlp, vocab = 8, 2, 128, 256
  per_layer = (
      4 * m * heads * head_dim  # query, key, value, out
      + m * experts  # router
      + top_k * 3 * m * mlp  # two of eight gated experts: wi_0, wi_1, wo
  )
  active = layers * per_layer + vocab * m  # logits by the tied embedding
  pairs = seq * (seq + 1) // 2  # causal
  attention = layers * 2 * batch * pairs * heads * (2 * head_dim)
  return 6 * batch * seq * active + 3 * attention


def tiny_mixtral_parameters() -> int:
  m, heads, head_dim, layers = 64, 4, 16, 2
  experts, mlp, vocab = 8, 128, 256
  per_layer = 4 * m * heads * head_dim + m * experts + 3 * experts * m * mlp
  return vocab * m + layers * (per_layer + 2 * m) + m  # + norms


@functools.cache
def _plan_run():
  """(status, plan JSON, stderr) of the child `linen-moe plan` that does
  not fit in 1 MiB per device."""
  proc = workers.run(
      "linen_moe_cli.main",
      "plan",
      "--config",
      "tiny_mixtral",
      "--target",
      "cpu:8",
      "--json",
      "--device-memory-gib",
      str(1 / 1024),
  )
  lines = proc.stdout.strip().splitlines()
  if not lines:
    raise AssertionError(f"linen-moe plan printed nothing:\n{proc.stderr}")
  return proc.returncode, json.loads(lines[-1]), proc.stderr


class PlanCommandTest(parameterized.TestCase):

  def test_json_keys_and_bytes(self):
    _, plan, _ = _plan_run()
    for key in PLAN_KEYS:
      self.assertIn(key, plan)
    self.assertEqual(plan["target"], "cpu:8")
    self.assertEqual(plan["devices"], 8)
    self.assertEqual(plan["mesh"]["data"], 8)  # the default mesh
    device = plan["per_device"]
    for key in PER_DEVICE_KEYS:
      self.assertGreater(device[key], 0, key)
    self.assertGreaterEqual(
        device["peak_bytes"], device["argument_bytes"] + device["temp_bytes"]
    )
    # data=8 replicates the float32 parameters; AdamW keeps two moments.
    self.assertEqual(device["parameter_bytes"], 4 * tiny_mixtral_parameters())
    self.assertGreaterEqual(
        device["optimizer_state_bytes"], 2 * device["parameter_bytes"]
    )
    self.assertLessEqual(
        device["parameter_bytes"] + device["optimizer_state_bytes"],
        device["argument_bytes"],
    )

  def test_flops_and_tokens(self):
    _, plan, _ = _plan_run()
    self.assertEqual(plan["tokens_per_step"], B * S)
    self.assertEqual(plan["flops_per_step"], tiny_mixtral_train_flops(B, S))
    # XLA:CPU counts every expert of the grouped matmul, and the optimizer.
    self.assertGreater(plan["compiler_flops_per_step"], plan["flops_per_step"])
    self.assertIsNone(plan["estimated_step_s"])  # no peak for a CPU
    self.assertIsNone(plan["estimated_mfu"])

  def test_a_plan_that_does_not_fit(self):
    status, plan, err = _plan_run()
    self.assertEqual(status, 1, err)
    self.assertFalse(plan["fits"])
    self.assertEqual(plan["device_memory_bytes"], 2**20)
    self.assertEqual(err.count("\n"), 1, err)
    self.assertNotIn("Traceback", err)
    self.assertRegex(
        err,
        "^linen-moe: error: the train step does not fit on cpu:8: .* the "
        "biggest consumer is the activations and temporaries",
    )

  @parameterized.parameters(
      (["--target", "tpu:v9-8"], r"target='tpu:v9-8' is invalid: .*v5p-"),
      (["--target", "cpu:0"], r"target='cpu:0' is invalid: expected cpu:N"),
      (["--target", "gpu:h100-6"], r"target='gpu:h100-6' is invalid: .*h100"),
      (
          ["--target", "cpu:8", "--mesh", "data=2,expert=2"],
          r"mesh='data=2,expert=2' has 4 devices, but target 'cpu:8' has 8",
      ),
  )
  def test_bad_target_or_mesh_is_one_line_before_any_work(self, argv, line):
    with (
        mock.patch.object(planning, "prepare_process") as prepare,
        mock.patch.object(planning, "plan") as plan,
    ):
      status, out, err = _cli("plan", *argv)
    prepare.assert_not_called()  # nothing reached jax's backends
    plan.assert_not_called()
    self.assertEqual((status, out), (2, ""))
    self.assertRegex(err, "^linen-moe: error: " + line)
    self.assertEqual(err.count("\n"), 1, err)

  def test_gpus_without_the_cuda_plugin_is_one_line(self):
    with (
        mock.patch.object(planning, "prepare_process"),
        mock.patch.object(
            targets_lib, "cuda_plugin_available", return_value=False
        ),
    ):
      status, out, err = _cli("plan", "--target", "gpu:h100-8")
    self.assertEqual((status, out), (2, ""))
    self.assertRegex(
        err,
        r"^linen-moe: error: target='gpu:h100-8' needs jax's CUDA plugin .*"
        r"pip install '\.\[gpu-plan\]'",
    )
    self.assertEqual(err.count("\n"), 1, err)


@absltest.skipUnless(
    targets_lib.cuda_plugin_available(),
    "needs jax's CUDA plugin: pip install '.[gpu-plan]'",
)
class GpuPlanTest(absltest.TestCase):
  """A plan for 8 H100s, compiled through the CUDA plugin's topology
  without a GPU (in a venv with the `gpu-plan` extra; skipped elsewhere)."""

  def test_tiny_mixtral_on_eight_h100s(self):
    proc = workers.run(
        "linen_moe_cli.main",
        "plan",
        "--config",
        "tiny_mixtral",
        "--target",
        "gpu:h100-8",
        "--json",
    )
    self.assertEqual(proc.returncode, 0, proc.stderr)
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    self.assertEqual(plan["target"], "gpu:h100-8")
    self.assertEqual(plan["devices"], 8)
    self.assertEqual(plan["chip"], "h100")
    self.assertEqual(
        plan["device_memory_bytes"], planning.CHIPS["h100"].memory_bytes
    )
    self.assertTrue(plan["fits"])
    device = plan["per_device"]
    for key in PER_DEVICE_KEYS:
      self.assertGreater(device[key], 0, key)
    self.assertEqual(device["parameter_bytes"], 4 * tiny_mixtral_parameters())
    self.assertEqual(plan["flops_per_step"], tiny_mixtral_train_flops(B, S))
    self.assertIsNone(plan["compiler_flops_per_step"])  # no cost analysis
    self.assertEqual(
        plan["compiler_flops_note"],
        "XLA:GPU gives no cost analysis without the GPU",
    )
    self.assertGreater(plan["estimated_step_s"], 0)

  def test_one_h200_says_it_has_no_compiler_flops(self):
    proc = workers.run(
        "linen_moe_cli.main",
        "plan",
        "--config",
        "tiny_mixtral",
        "--target",
        "gpu:h200-1",
    )
    self.assertEqual(proc.returncode, 0, proc.stderr)
    self.assertIn(
        "on gpu:h200-1 (1 devices, mesh 1), batch 16 x seq 32", proc.stdout
    )
    self.assertIn(
        "(no compiler FLOPs: XLA:GPU gives no cost analysis without the GPU)",
        proc.stdout,
    )
    self.assertIn("roofline (h200): >= ", proc.stdout)
    self.assertNotIn("MFU <= 100", proc.stdout)


@absltest.skipUnless(
    targets_lib.libtpu_available(),
    "needs libtpu to compile for a TPU: pip install '.[tpu-plan]'",
)
class UsableMemoryOnTpuTest(parameterized.TestCase):
  """Each TPU chip's `usable_bytes` is libtpu's own limit: a program 16 MiB
  under it compiles for one chip, one 16 MiB over it does not (libtpu
  0.0.50.1 and 0.0.52 differ by about 1 MiB). Skipped without libtpu."""

  @parameterized.parameters("tpu:v5e-1", "tpu:v5p-8", "tpu:v6e-1")
  def test_limit(self, target):
    proc = workers.run("tests.hbm_tpu_worker", target, str(16 * 2**20))
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    self.assertEqual(result, {"below": True, "above": False})


@testing.slow
class FrontEndsAndDecodeTest(absltest.TestCase):
  """The NNX front end's train step plans the bytes of the Linen one's
  state; the decode step holds the KV cache in place of the optimizer."""

  def _plan(self, *argv) -> dict:
    proc = workers.run(
        "linen_moe_cli.main",
        "plan",
        "--target",
        "cpu:2",
        "--mesh",
        "fsdp=2",
        "--json",
        *argv,
    )
    self.assertEqual(proc.returncode, 0, proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])

  def test_nnx_and_decode(self):
    linen = self._plan()["per_device"]
    nnx = self._plan("--frontend", "nnx")["per_device"]
    for key in ("parameter_bytes", "optimizer_state_bytes", "batch_bytes"):
      self.assertEqual(nnx[key], linen[key], key)
    decode = self._plan("--serve", "--batch-size", "4", "--seq-len", "64")
    self.assertEqual(decode["step"], "decode")
    self.assertEqual(decode["tokens_per_step"], 4)
    device = decode["per_device"]
    self.assertEqual(device["parameter_bytes"], linen["parameter_bytes"])
    self.assertEqual(device["optimizer_state_bytes"], 0)
    # Keys and values [B, 64, K, D] per layer, float32, the batch split in 2.
    kv = 2 * 2 * (4 // 2) * 64 * 4 * 16 * 4
    self.assertEqual(device["cache_bytes"] // kv, 1)  # and the index
    cfg = load_model_config("tiny_mixtral")
    self.assertEqual(
        decode["flops_per_step"],
        planning.model_flops(cfg, 4, 64, decode=True),
    )
    # `--serve int8`: the expert kernels stored as int8, as `generate --serve
    # int8` serves them: 3 of their 4 float32 bytes gone (the kernels split
    # over fsdp=2, which shards `embed`), less the int8 scales, one float32
    # per output channel: wi_0's and wi_1's [E, 1, mlp] have no `embed` axis
    # and are whole on each device (counted twice here), wo's [E, 1, embed]
    # is split.
    served = self._plan(
        "--serve", "int8", "--batch-size", "4", "--seq-len", "64"
    )
    moe = cfg.moe
    kernel = moe.num_experts * 3 * moe.emb_dim * moe.moe_mlp_dim
    scales = moe.num_experts * (2 * moe.moe_mlp_dim * 2 + moe.emb_dim)
    saved = cfg.num_layers * (3 * kernel - 4 * scales) // 2
    self.assertEqual(
        device["parameter_bytes"] - served["per_device"]["parameter_bytes"],
        saved,
    )

  def test_serve_mode_and_quantization_must_agree(self):
    status, out, err = _cli(
        "plan", "--serve", "int8", "--quantization", "fp8", "--target", "cpu:2"
    )
    self.assertEqual((status, out), (2, ""))
    self.assertIn("--quantization fp8 with --serve int8", err)


class OutOfMemoryTest(absltest.TestCase):
  """A TPU compile that runs out of memory is a plan that does not fit:
  the bytes come from libtpu's message (as libtpu 0.0.50.1 wrote it for
  qwen3_30b_a3b's first two layers, batch 8 x 4096, on tpu:v5e-1)."""

  def test_libtpu_messages(self):
    text = (
        "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on "
        "HBM, the total memory required for HLO temporaries (44.15G) exceeds "
        "available HBM (15.75G). HLO module: jit_step.\nmore lines"
    )
    oom = plan_lib._out_of_memory(RuntimeError(text))
    # Everything the program needs: libtpu counts the arguments in it.
    self.assertEqual(oom.used_bytes, int(44.15 * 2**30))
    self.assertEqual(oom.message, text.splitlines()[0])
    oom = plan_lib._out_of_memory(
        RuntimeError("RESOURCE_EXHAUSTED: Used 123.5G of 95.74G hbm.")
    )
    self.assertEqual(oom.used_bytes, int(123.5 * 2**30))
    self.assertIsNone(plan_lib._out_of_memory(RuntimeError("INTERNAL: x")))
    # A kernel's blocks too large for VMEM (Gemma-4's splash before
    # bb685c1) is the program's error, not the chip's memory.
    vmem = "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: ..."
    self.assertIsNone(plan_lib._out_of_memory(RuntimeError(vmem)))

  def test_the_plan_of_a_refused_step_needs_what_libtpu_said(self):
    # libtpu's figure holds the arguments already (for `x * 2` of a 20 GiB
    # argument a v5e's compile says "HLO temporaries (40.00G)"): the plan's
    # peak is that figure, not that figure plus the arguments.
    message = (
        "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on "
        "HBM, the total memory required for HLO temporaries (1.50G) exceeds "
        "available HBM (1.00G)."
    )
    with mock.patch.object(
        jax.stages.Lowered, "compile", side_effect=RuntimeError(message)
    ):
      plan = planning.plan(
          load_model_config("tiny_mixtral"),
          "cpu:1",
          batch_size=2,
          seq_len=8,
          device_memory_bytes=2**30,
      )
    self.assertFalse(plan.fits)
    device = plan.per_device
    self.assertEqual(device.peak_bytes, int(1.5 * 2**30))
    self.assertEqual(
        device.temp_bytes, int(1.5 * 2**30) - device.argument_bytes
    )
    self.assertGreater(device.argument_bytes, 0)


class FlopsTest(absltest.TestCase):

  def test_attention_pairs_of_a_sliding_window_match_the_mask(self):
    cfg = load_model_config("tiny_gemma4_text")  # sliding and full layers
    self.assertGreater(cfg.sliding_window, 0)
    self.assertNotEqual(cfg.full_head_dim, cfg.resolved_head_dim)
    seq = 3 * cfg.sliding_window + 5
    i, j = np.meshgrid(np.arange(seq), np.arange(seq), indexing="ij")
    causal = j <= i
    windowed = causal & (i - j < cfg.sliding_window)
    expected = 0
    for layer in range(cfg.num_layers):
      full = layer in cfg.full_attention_layers
      heads = cfg.num_heads
      width = cfg.full_head_dim if full else cfg.resolved_head_dim
      pairs = int((causal if full else windowed).sum())
      expected += 2 * 3 * pairs * heads * 2 * width
    self.assertEqual(flops.attention_flops(cfg, 3, seq), expected)

  def test_attention_pairs_of_chunks_match_the_mask(self):
    cfg = load_model_config("tiny_llama4")  # chunked and NoPE full layers
    c = cfg.attention_chunk
    seq = 3 * c + 2
    i, j = np.meshgrid(np.arange(seq), np.arange(seq), indexing="ij")
    causal = j <= i
    chunked = causal & (i // c == j // c)
    width = cfg.resolved_head_dim
    expected = 0
    for layer in range(cfg.num_layers):
      full = layer in cfg.full_attention_layers
      pairs = int((causal if full else chunked).sum())
      expected += 2 * 3 * pairs * cfg.num_heads * 2 * width
    self.assertEqual(flops.attention_flops(cfg, 3, seq), expected)

  def test_decode_counts_one_token_per_row(self):
    cfg = load_model_config("tiny_mixtral")
    _, active = flops.matmul_parameters(cfg)
    seq = 40
    attention = cfg.num_layers * 2 * B * seq * cfg.num_heads * 2 * 16
    self.assertEqual(
        planning.model_flops(cfg, B, seq, decode=True),
        round(2 * B * active + attention),
    )

  def test_counts_do_not_need_the_targets_kernels_here(self):
    # A TPU plan of grouped_matmul="kernel" or attention="splash" counts
    # its parameters on the host, whose CPU has neither.
    cfg = load_model_config("tiny_mixtral")
    kernels = cfg.replace(grouped_matmul="kernel", attention="splash")
    self.assertEqual(
        flops.matmul_parameters(kernels), flops.matmul_parameters(cfg)
    )

  def test_chips_have_their_figures(self):
    for name in ("v5e", "v5p", "v6e", "h100", "h200"):
      chip = planning.CHIPS[name]
      self.assertGreater(chip.peak_flops, 1e14)
      self.assertGreater(chip.memory_bytes, 1e10)
      self.assertGreater(chip.memory_bandwidth, 5e11)
      self.assertTrue(chip.source.startswith("https://"))

  def test_tpu_memory_is_what_libtpu_allows_not_the_vendors_decimal(self):
    for name in ("v5e", "v5p", "v6e"):
      chip = planning.CHIPS[name]
      self.assertGreater(chip.usable_bytes, chip.memory_bytes)
      self.assertLess(chip.usable_bytes, 1.1 * chip.memory_bytes)
    self.assertEqual(
        planning.parse_target("tpu:v5p-8").device_memory_bytes,
        planning.CHIPS["v5p"].usable_bytes,
    )

  def test_tpu_slices_count_chips(self):
    self.assertEqual(planning.parse_target("tpu:v5p-64").num_devices, 32)
    self.assertEqual(planning.parse_target("tpu:v5p-64").topology, "v5p:2x4x4")
    self.assertEqual(planning.parse_target("tpu:v5e-256").num_devices, 256)
    self.assertEqual(planning.parse_target("tpu:v6e-8").topology, "v6e:2x4")
    with self.assertRaisesRegex(ValueError, r"target='tpu:v5p-6' is invalid"):
      planning.parse_target("tpu:v5p-6")

  def test_gpu_targets_count_gpus(self):
    target = planning.parse_target("gpu:h100-8")
    self.assertEqual(
        (target.platform, target.num_devices, target.topology),
        ("gpu", 8, "1x1x8"),
    )
    self.assertEqual(target.device_memory_bytes, 80 * 10**9)
    target = planning.parse_target("gpu:h200-32")
    self.assertEqual((target.num_devices, target.topology), (32, "1x4x8"))
    self.assertEqual(target.chip.name, "h200")
    self.assertEqual(planning.parse_target("gpu:h200-2").topology, "1x1x2")
    for name in ("gpu:h100-12", "gpu:a100-8", "gpu:h100-0"):
      with self.assertRaisesRegex(ValueError, f"target='{name}' is invalid"):
        planning.parse_target(name)


if __name__ == "__main__":
  absltest.main()
