"""benchmarks/gpu's benchmarks of issue 63: their reporting arithmetic
against hand-computed numbers (never a timing), their CPU dry runs, and
the torch peers against a NumPy loop where torch imports."""

import json
import math
import pathlib
import subprocess
import sys
import tempfile
import types

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import testing

GPU = pathlib.Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU))

import bench_gpu_decode  # noqa: E402
import bench_gpu_fp8  # noqa: E402
import bench_gpu_gmm  # noqa: E402
import bench_gpu_model  # noqa: E402
import bench_vs_torch  # noqa: E402
import gpu_run  # noqa: E402
import gpu_timing  # noqa: E402
import torch_moe  # noqa: E402

ISSUE63_STEPS = ("gmm", "layer_torch", "fp8", "decode_limit", "mfu")


class TimingArithmeticTest(absltest.TestCase):

  def test_fractions_and_rates(self):
    ms = {"dense": 2.0, "a": 4.0, "b": 1.0}
    self.assertEqual(
        gpu_timing.fractions(ms), {"dense": 1.0, "a": 0.5, "b": 2.0}
    )
    self.assertEqual(gpu_timing.fractions({"a": 1.0}), {})
    # 6 M K N of M, K, N = 1024, 512, 256: 805,306,368 FLOPs
    self.assertEqual(gpu_timing.grouped_flops(1024, 512, 256), 805306368.0)
    # 1e12 FLOPs in 2 ms: 500 TFLOP/s
    self.assertAlmostEqual(gpu_timing.tflops(1e12, 2.0), 500.0)

  def test_relative_errors(self):
    want = np.array([3.0, -4.0])
    got = np.array([3.0, -3.0])
    err = gpu_timing.relative_errors(got, want)
    self.assertAlmostEqual(err["max"], 1 / 4)  # |diff| 1 over max 4
    self.assertAlmostEqual(err["norm"], 1 / 5)  # ||(0, 1)|| over 5
    self.assertFalse(gpu_timing.agree(err))
    self.assertTrue(gpu_timing.agree({"max": 0.5, "norm": 0.01}))
    with self.assertRaisesRegex(ValueError, "shapes differ"):
      gpu_timing.relative_errors(np.zeros(2), np.zeros(3))

  def test_alternating_rounds_and_a_failing_call(self):
    calls = []

    def ok():
      calls.append("ok")

    def bad():
      raise RuntimeError("out of memory")

    seconds, errors = gpu_timing.alternating_medians(
        {"ok": ok, "bad": bad}, rounds=3
    )
    self.assertEqual(calls, ["ok"] * 4)  # one untimed, three timed
    self.assertEqual(list(seconds), ["ok"])
    self.assertIn("RuntimeError: out of memory", errors["bad"])
    # A deadline already past still times one round.
    calls.clear()
    gpu_timing.alternating_medians({"ok": ok}, 5, gpu_timing.Deadline(-1))
    self.assertLen(calls, 2)
    # `warmup` untimed calls before the rounds.
    calls.clear()
    gpu_timing.alternating_medians({"ok": ok}, rounds=2, warmup=3)
    self.assertLen(calls, 5)

  def test_call_medians_of_jitted_calls(self):
    double = jax.jit(lambda x: 2 * x)
    seconds = gpu_timing.call_medians({"double": (double, (jnp.ones(4),))}, 2)
    self.assertEqual(list(seconds), ["double"])
    self.assertGreater(seconds["double"], 0.0)

    def bad(x):
      raise ValueError("no kernel")

    with self.assertRaisesRegex(RuntimeError, "bad.*ValueError: no kernel"):
      gpu_timing.call_medians({"bad": (bad, (1,))}, 2)


class GmmReportTest(absltest.TestCase):

  def test_summary_best_route_and_bars(self):
    ms = {"dense": 3.0, "blocked": 6.0, "gpu/x": 4.0, "torch_grouped_mm": 8.0}
    s = bench_gpu_gmm.summarise(ms, flops=6e12)
    self.assertAlmostEqual(s["gpu/x"]["of_dense"], 0.75)
    self.assertAlmostEqual(s["gpu/x"]["vs_torch"], 2.0)
    self.assertAlmostEqual(s["gpu/x"]["tflops"], 1500.0)  # 6e12 / 4 ms
    self.assertAlmostEqual(s["torch_grouped_mm"]["of_dense"], 0.375)
    self.assertEqual(bench_gpu_gmm.best_route(s), "gpu/x")
    self.assertIsNone(bench_gpu_gmm.best_route({"dense": s["dense"]}))
    self.assertEqual(bench_gpu_gmm.bar(8), 0.85)
    self.assertEqual(bench_gpu_gmm.bar(128), 0.70)

  def test_every_registered_gpu_route_is_named(self):
    from linen_moe._src.kernels import registry  # noqa: PLC0415, TID251

    calls, missing = bench_gpu_gmm.routes("cpu")
    keys = {e.key for e in registry.entries("gpu")}
    self.assertEqual(keys, (set(calls) | set(missing)) - {"dense", "blocked"})
    self.assertIn("gpu/xla_ragged_dot", calls)


class LayerReportTest(absltest.TestCase):

  def test_verdicts(self):
    shape = bench_vs_torch.layer_bench.SHAPES["128x2048x768"]
    ms = {
        "dense": 10.0,
        "ours_auto": 16.0,
        "torch_titan": 24.0,
        "hf_grouped_mm": 20.0,
        "hf_eager": 80.0,
    }
    v = bench_vs_torch.verdicts(ms, shape)
    self.assertAlmostEqual(v["of_dense"]["ours_auto"], 0.625)
    self.assertEqual(v["fastest_torch"], "hf_grouped_mm")
    self.assertAlmostEqual(v["ours_over_fastest_torch"]["ours_auto"], 1.25)
    self.assertEqual(v["bar_of_dense"], 0.55)
    self.assertEqual(v["bar_over_torch"], 1.3)
    none = bench_vs_torch.verdicts({"dense": 1.0, "ours_auto": 2.0}, shape)
    self.assertIsNone(none["fastest_torch"])
    self.assertEqual(none["ours_over_fastest_torch"], {})

  def test_families_and_batched_mm_bytes(self):
    shapes = bench_vs_torch.layer_bench.SHAPES
    self.assertEqual(bench_vs_torch.family(shapes["8x2048x5632"]), "mixtral")
    self.assertEqual(bench_vs_torch.family(shapes["128x2048x768"]), "qwen3_moe")
    # 16,384 tokens x top-8 pairs, each a bf16 [2048, 2 x 768] copy.
    self.assertEqual(
        bench_vs_torch.batched_mm_bytes(shapes["128x2048x768"]),
        16384 * 8 * 2048 * 1536 * 2,
    )


def _contraction(op_name, operands, quantized=()):
  return types.SimpleNamespace(
      opcode="dot",
      op_name=op_name,
      operand_types=tuple(frozenset(t) for t in operands),
      quantized_inputs=frozenset(quantized),
  )


class Fp8ReportTest(absltest.TestCase):

  def test_native_and_converted_contractions(self):
    found = bench_gpu_fp8.native_summary([
        _contraction("jit/RoutedMoE/wi_0_dot/dot", [{"f8e4m3fn"}] * 2),
        _contraction(
            "jit/transpose(jvp(RoutedMoE/wo_dot))/dot",
            [{"f8e5m2"}, {"f8e4m3fn"}],
        ),
        _contraction(
            "jit/RoutedMoE/wi_1_dot/dot", [{"bf16"}] * 2, {"f8e4m3fn"}
        ),
        _contraction("jit/Decoder/logits/dot", [{"bf16"}] * 2),
    ])
    self.assertEqual(found["native_fp8"], 2)
    self.assertEqual(found["fp8_converted_first"], 1)
    self.assertEqual(found["total"], 4)
    self.assertEqual(
        found["contractions"]["wo/backward"], {"dot: f8e5m2 x f8e4m3fn": 1}
    )
    self.assertEqual(
        found["contractions"]["wi_0/forward"], {"dot: f8e4m3fn x f8e4m3fn": 1}
    )
    self.assertIn("head/forward", found["contractions"])

  def test_ratios_and_one_layer(self):
    step_ms = {1: {"bf16": 30.0, "fp8": 25.0}, 2: {"bf16": 50.0, "fp8": 37.0}}
    got = bench_gpu_fp8.layer_ratio(step_ms, (1, 2))
    self.assertEqual(got["layer_ms"], {"bf16": 20.0, "fp8": 12.0})
    self.assertAlmostEqual(got["layer_ratio"]["fp8"], 20 / 12)
    self.assertAlmostEqual(bench_gpu_fp8.ratios(step_ms[1])["fp8"], 1.2)
    self.assertEqual(bench_gpu_fp8.layer_ratio({1: {}}, (1, 2)), {})


class DecodeReportTest(absltest.TestCase):

  def test_expected_experts(self):
    self.assertAlmostEqual(bench_gpu_decode.expected_experts(8, 2, 1), 2.0)
    # 8 (1 - (6/8)^8) = 7.19910...
    self.assertAlmostEqual(
        bench_gpu_decode.expected_experts(8, 2, 8), 8 * (1 - 0.75**8)
    )
    self.assertAlmostEqual(bench_gpu_decode.expected_experts(4, 4, 1), 4.0)

  def test_step_bytes_and_the_limit(self):
    nbytes = bench_gpu_decode.step_bytes(
        params_bytes=1000,
        expert_bytes=800,
        embed_bytes=100,
        emb_dim=10,
        embed_itemsize=2,
        experts=8,
        top_k=2,
        batch=1,
        cache_bytes_per_row=30,
    )
    # the rest 100, one embedding row 20, 2 of 8 experts 200, cache 30
    self.assertEqual(nbytes, {"routed": 350.0, "all": 1030})
    fig = bench_gpu_decode.limit_figures(0.5, 1, {"routed": 350.0}, 1000.0)
    # least seconds 0.35 of a 0.5 s step; the limit 1 / 0.35 tokens/s
    self.assertAlmostEqual(fig["tokens_per_s"], 2.0)
    self.assertAlmostEqual(fig["fraction_of_routed"], 0.7)
    self.assertAlmostEqual(fig["limit_routed_tokens_per_s"], 1 / 0.35)


class ModelReportTest(absltest.TestCase):

  def test_speedups(self):
    got = bench_gpu_model.speedups({
        "train_step_s": 0.5,
        "peer_train_step_s": 1.5,
        "b8_generate_s": 2.0,
        "peer_b8_generate_s": 5.0,
        "b1_first_generate_s": 9.0,
        "b1_generate_s": 1.0,
    })
    self.assertEqual(got, {"train": 3.0, "b8_decode": 2.5})


class StepsTest(absltest.TestCase):

  def test_issue63_calls_fit_the_device_calls(self):
    first, second = gpu_run.CALLS[-2], gpu_run.CALLS[-1]  # the last two
    self.assertEqual(
        {*first, *second} - {"env", "model_torch"}, set(ISSUE63_STEPS)
    )
    for call in (first, second):
      total = sum(gpu_run.STEPS[s].budget_s for s in call)
      self.assertLessEqual(total, gpu_run.DEFAULT_BUDGET_S, call)

  def test_a_script_stops_before_its_steps_limit(self):
    for name in ISSUE63_STEPS[:4] + ("model_torch",):
      step = gpu_run.STEPS[name]
      ctx = gpu_run.Context("py", pathlib.Path("o"), False, step.budget_s, 1)
      (argv,) = step.commands(ctx)
      budget = float(argv[argv.index("--budget-s") + 1])
      self.assertLess(budget, step.budget_s, name)
      self.assertNotIn("--cpu-dry-run", argv)


def _dry_run(script: str, out: str, *args: str) -> dict:
  done = subprocess.run(
      [sys.executable, str(GPU / script), "--cpu-dry-run", "--out", out, *args],
      capture_output=True,
      text=True,
      timeout=900,
      check=False,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  name = script.replace(".py", ".json")
  return json.loads(pathlib.Path(out, name).read_text())


class DryRunTest(absltest.TestCase):

  def test_gmm(self):
    with tempfile.TemporaryDirectory() as out:
      r = _dry_run("bench_gpu_gmm.py", out, "--shapes", "64,32,16,4")
    (shape,) = r["shapes"]
    skewed = shape["layouts"]["skewed"]
    self.assertEqual(skewed["group_sizes"], [32, 16, 16, 0])
    self.assertIn("gpu/xla_ragged_dot", skewed["routes"])
    for name, leaves in skewed["differences"].items():
      for leaf, err in leaves.items():
        self.assertLess(err["norm"], 2e-2, (name, leaf))

  @testing.slow
  def test_layer(self):
    with tempfile.TemporaryDirectory() as out:
      r = _dry_run("bench_vs_torch.py", out, "--shapes", "8x2048x5632")
    shape = r["shapes"]["8x2048x5632"]
    self.assertIn("ours_blocked", shape["ms"])
    diffs = shape["differences"]["ours_blocked"]
    self.assertTrue(diffs["agree"], diffs)
    self.assertLess(max(e["norm"] for e in diffs["leaves"].values()), 2e-2)

  @testing.slow
  def test_fp8_decode_and_model(self):
    with tempfile.TemporaryDirectory() as out:
      fp8 = _dry_run("bench_gpu_fp8.py", out)
      decode = _dry_run("bench_gpu_decode.py", out)
      model = _dry_run("bench_gpu_model.py", out, "--no-timing")
    self.assertEqual(set(fp8["layer_ms"]), {"bf16", "fp8"})
    self.assertGreater(fp8["depths"][0]["programs"]["fp8"]["total"], 0)
    self.assertEqual(set(decode["batches"]), {"1", "8"})
    self.assertIn("int8_over_bf16", decode["batches"]["1"])
    self.assertGreater(model["params"], 0)


def _torch():
  torch = gpu_timing.torch_or_none()
  if torch is None:
    raise absltest.SkipTest("torch does not import here")
  return torch


def _bf16(torch, a):
  t = torch.tensor(np.asarray(a), dtype=torch.float32).bfloat16()
  return t.float().numpy().astype(np.float64)


def _oracle(x, p, k):
  """The layer by the formula, token by token (softmax, top-k, renormalised,
  SiLU-gated experts)."""
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    logits = x[t] @ p["gate"]["kernel"]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    top = np.argsort(-probs)[:k]
    for e, w in zip(top, probs[top] / probs[top].sum(), strict=True):
      a = x[t] @ p["wi_0"][e]
      h = a / (1 + np.exp(-a)) * (x[t] @ p["wi_1"][e])
      out[t] += w * (h @ p["wo"][e])
  return out


class TorchPeersTest(absltest.TestCase):

  def test_titan_layer_and_blocks_match_the_formula(self):
    torch = _torch()
    rng = np.random.default_rng(0)
    t, d, h, e, k = 48, 16, 8, 4, 2
    p = {
        "gate": {"kernel": _bf16(torch, rng.normal(size=(d, e)))},
        "wi_0": _bf16(torch, rng.normal(size=(e, d, h)) / 4),
        "wi_1": _bf16(torch, rng.normal(size=(e, d, h)) / 4),
        "wo": _bf16(torch, rng.normal(size=(e, h, d)) / 3),
    }
    x = _bf16(torch, rng.normal(size=(1, t, d)))
    cot = _bf16(torch, rng.normal(size=(1, t, d)))
    want = _oracle(x[0], p, k)
    layer = torch_moe.TitanMoE(torch, p, k)
    out, grads, _ = torch_moe.layer_step(torch, layer, x, cot)()
    err = gpu_timing.relative_errors(out[0], want)
    self.assertLess(err["max"], 2e-2)
    try:
      import transformers  # noqa: PLC0415
    except ImportError:
      return
    for impl in ("eager", "grouped_mm"):
      block = torch_moe.hf_block(torch, transformers, "qwen3_moe", p, k, impl)
      out2, grads2, _ = torch_moe.layer_step(torch, block, x, cot)()
      self.assertLess(gpu_timing.relative_errors(out2[0], want)["max"], 2e-2)
      for name in ("wi_0", "wi_1", "wo"):
        err = gpu_timing.relative_errors(grads2[name], grads[name])
        self.assertLess(err["norm"], 2e-2, (impl, name))

  def test_grouped_mm_with_empty_groups(self):
    torch = _torch()
    rng = np.random.default_rng(1)
    sizes = [20, 0, 28, 0]
    lhs, rhs = rng.normal(size=(48, 16)), rng.normal(size=(4, 16, 8))
    dout = rng.normal(size=(48, 8))
    out, dlhs, drhs = torch_moe.grouped_mm_call(torch, lhs, rhs, sizes, dout)()
    a, b, g = (_bf16(torch, v) for v in (lhs, rhs, dout))
    want = np.concatenate([a[:20] @ b[0], a[20:] @ b[2]])
    want_drhs = np.stack([
        a[:20].T @ g[:20],
        np.zeros((16, 8)),
        a[20:].T @ g[20:],
        np.zeros((16, 8)),
    ])
    self.assertLess(gpu_timing.relative_errors(out, want)["max"], 2e-2)
    self.assertLess(gpu_timing.relative_errors(drhs, want_drhs)["max"], 2e-2)
    want_dlhs = np.concatenate([g[:20] @ b[0].T, g[20:] @ b[2].T])
    self.assertLess(gpu_timing.relative_errors(dlhs, want_dlhs)["max"], 2e-2)
    self.assertTrue(math.isfinite(float(out.float().sum())))


if __name__ == "__main__":
  absltest.main()
