"""One run on an accelerator: the matrix, native low-precision GEMMs, the
kernels, and the sparse and dropping paths timed against the device's peak.

`benchmarks/device/run.sh` installs the accelerator build of jax and runs
this; `--cpu-dry-run` runs every step here, on the CPU, at tiny sizes (the
same code paths; its figures mean nothing). Steps, each under a share of
the time budget (a step past the budget is recorded as skipped):

  1. environment: jax, the backend, the device kind and its vendor peaks.
  2. peaks measured here: a dense bf16 matmul and an fp8 one (e4m3 x e4m3
     -> f32), TFLOP/s, and whether the fp8 one ran as a native fp8 GEMM.
  3. the matrix (`linen-moe matrix`, the installed command, one process per
     config and front end): config x quantization x path x front end,
     scanned layers; each cell compiles a train step, checks the quantized
     element types reach its contractions, and trains 2 steps.
  4. native GEMMs: a train step of the sparse and the dense layer in fp8
     and int8; the GEMMs of the compiled program and their operand types. A
     mode is native when some GEMM takes its forward type directly (XLA:CPU
     converts to f32 first, so the dry run says False).
  5. kernels: a sparse `RoutedMoE` with `grouped_matmul="kernel"`
     (Tokamax on GPU, megablox on TPU) against "ragged_dot", output and
     input and weight gradients, half its experts routed no token (empty
     groups, whose weight gradients must be 0); on GPU Tokamax's
     `ragged_dot` called directly too (openxla/tokamax#887 on real
     hardware).
  6. timings: the sparse path with `ragged_dot`, `kernel` and `blocked`,
     and the dropping path, at the medium and gemma-like sizes of
     `layer/bench_moe.py`, bf16 and fp8: useful TFLOP/s (active experts only),
     as a fraction of the bf16 (and fp8) peaks measured in step 2 and of
     the vendor's.

  python benchmarks/device/device_run.py --out benchmarks/reference/x.json
  python benchmarks/device/device_run.py --cpu-dry-run --out /tmp/dry.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import pathlib
import re
import subprocess
import sys
import time
import traceback
from typing import Any
import warnings

import jax
from jax import lax
import jax.numpy as jnp

import linen_moe
from linen_moe import hlo
from linen_moe import testing
from linen_moe.quantization import MODES

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

from common import layer_case

# Vendor dense (no sparsity) peaks, FLOP/s, by device kind substring.
VENDOR_PEAKS = {
    "H200": {"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12},
    "H100": {"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12},
    "TPU v5p": {"bf16": 459e12, "int8": 918e12},
    "TPU v5 lite": {"bf16": 197e12, "int8": 394e12},
    "TPU v6 lite": {"bf16": 918e12, "int8": 1836e12},
}
STEPS = ("matrix", "native", "kernels", "timings")
# The configs of `linen-moe matrix --all`'s product.
TINY_CONFIGS = (
    "tiny_mixtral",
    "tiny_gemma4_26b",
    "tiny_deepseek_v3",
    "tiny_qwen3_moe",
)
BUDGET_S = 480  # of run.sh's ten minutes: installs and start-up take the rest
SHARES = {"peaks": 0.05, "matrix": 0.35, "native": 0.1, "kernels": 0.1}


class Budget:
  """Seconds left of the run; each step may use its share of what is left."""

  def __init__(self, seconds: float):
    self.end = time.monotonic() + seconds

  def left(self) -> float:
    return self.end - time.monotonic()

  def deadline(self, share: float) -> float:
    return time.monotonic() + share * max(self.left(), 0.0)


def _step(results: dict, name: str):
  """Records a step's result or its error (a step never stops the run)."""

  def wrap(fn):
    start = time.monotonic()
    try:
      results[name] = fn()
    except Exception as e:  # noqa: BLE001 (the report says what failed)
      results[name] = {
          "error": f"{type(e).__name__}: {e}"[:2000],
          "traceback": traceback.format_exc()[-4000:],
      }
    results.setdefault("seconds", {})[name] = time.monotonic() - start
    return fn

  return wrap


def environment() -> dict:
  device = jax.devices()[0]
  peaks = next(
      (p for k, p in VENDOR_PEAKS.items() if k in device.device_kind), {}
  )
  return {
      "date": datetime.date.today().isoformat(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "vendor_peaks": peaks,
  }


def _timed(fn, args, repeats: int = 5) -> float:
  """Median seconds of a compiled call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2]


# An HLO instruction's name and, for a custom call, its target.
_CUSTOM_CALL = re.compile(
    r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*\bcustom_call_target="([^"]*)"',
    re.MULTILINE,
)


def native_gemms(text: str) -> list[dict]:
  """The GEMMs of a compiled program (dots, GEMM custom calls, anywhere,
  fusions included), each with its custom call's target ("" for a dot) and
  the element types of its first two operands."""
  targets = dict(_CUSTOM_CALL.findall(text))
  return [
      {
          "name": c.name,
          "opcode": c.opcode,
          "target": targets.get(c.name, ""),
          "operand_types": [sorted(t) for t in c.operand_types[:2]],
      }
      for c in hlo.contractions(text)
  ]


def _is_native(gemms: list[dict], hlo_type: str) -> bool:
  return any(
      all(hlo_type in t or not t for t in g["operand_types"])
      and any(hlo_type in t for t in g["operand_types"])
      for g in gemms
  )


def peaks(n: int) -> dict:
  """Dense bf16 and fp8 matmul TFLOP/s of [n, n] x [n, n]."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  out = {}
  cases = {
      "bf16": (lambda x, y: x @ y, a, b),
      "fp8": (
          lambda x, y: lax.dot(x, y, preferred_element_type=jnp.float32),
          a.astype(jnp.float8_e4m3fn),
          b.astype(jnp.float8_e4m3fn),
      ),
  }
  for name, (fn, x, y) in cases.items():
    compiled = jax.jit(fn).lower(x, y).compile()
    seconds = _timed(compiled, (x, y))
    gemms = native_gemms(compiled.as_text())
    out[name] = {
        "tflops": 2 * n**3 / seconds / 1e12,
        "native": _is_native(gemms, "bf16" if name == "bf16" else "f8e4m3fn"),
        "gemms": gemms,
    }
  return out


_MATRIX_SUMMARY = re.compile(r"(\d+) passed, (\d+) failed \(matrix cells\)")


def run_matrix(configs, frontends, deadline: float) -> dict:
  """`linen-moe matrix` per config, front end and quantization (its three
  paths; scanned layers, full XLA optimisation, one worker: one process on
  the device at a time) until `deadline`; each one's table, and the cells
  passed and failed."""
  groups, totals = [], {"passed": 0, "failed": 0, "skipped": 0}
  for config, frontend, mode in itertools.product(configs, frontends, MODES):
    group = {"config": config, "frontend": frontend, "quantization": mode}
    left = deadline - time.monotonic()
    if left <= 0:
      groups.append({**group, "skipped": "time budget"})
      totals["skipped"] += len(linen_moe.MATMUL_PATHS)  # cells
      continue
    command = [sys.executable, "-m", "linen_moe_cli.main", "matrix"]
    command += ["--config", config, "--frontend", frontend]
    command += ["--quantization", mode]
    command += ["--layers", "scanned", "--no-fast-compile", "--workers", "1"]
    try:
      done = subprocess.run(
          command, capture_output=True, text=True, timeout=left, check=False
      )
    except subprocess.TimeoutExpired:
      groups.append({**group, "skipped": "time budget (stopped)"})
      totals["skipped"] += len(linen_moe.MATMUL_PATHS)
      continue
    counts = _MATRIX_SUMMARY.search(done.stdout)
    group.update(
        returncode=done.returncode,
        table=done.stdout.strip().splitlines(),
        stderr=done.stderr[-2000:],
    )
    if counts:
      totals["passed"] += int(counts.group(1))
      totals["failed"] += int(counts.group(2))
    else:  # no table: every cell of the row failed
      totals["failed"] += len(linen_moe.MATMUL_PATHS)
    groups.append(group)
  return {"groups": groups, **totals}


def native(size: str, deadline: float) -> dict:
  out = {}
  for mode, path in itertools.product(("fp8", "int8"), ("sparse", "dense")):
    key = f"{mode}/{path}"
    if time.monotonic() > deadline:
      out[key] = {"skipped": "time budget"}
      continue
    case = layer_case.Case(size, path, quantization=mode, dtype="bfloat16")
    compiled, _, _ = layer_case.compiled_step(case)
    text = compiled.as_text()
    gemms = native_gemms(text)
    forward = MODES[mode].hlo_forward_type
    out[key] = {
        "native": _is_native(gemms, forward),
        "forward_type": forward,
        # Each GEMM's operand types, "lhs x rhs", once each.
        "gemm_operand_types": sorted({
            " x ".join(",".join(t) or "?" for t in g["operand_types"])
            for g in gemms
        }),
        "quantized_at_contractions": sorted(
            hlo.quantized_types_at_contractions(text)
        ),
    }
  return out


# What `grouped_matmul="kernel"` runs on each backend (the dry run: megablox
# interpreted on the CPU, `testing.kernels_on_cpu`).
KERNELS = {"gpu": "tokamax ragged_dot", "tpu": "megablox gmm"}


def _max_diff(got, want) -> float:
  return float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want))))


def _layer_with_empty_experts(dry: bool):
  """(config, params, x, output cotangent) of a sparse bf16 layer whose odd
  experts no token picks: feature 0 of every token is 8, and row 0 of the
  gate kernel is +1 for an even expert, -1 for an odd one, so an odd
  expert's logit is ~16 below every even one's (the rest of the row is
  noise of std ~1) and top-2 of 8 picks only even experts."""
  e, k, m, h, t = (8, 2, 64, 128, 32) if dry else (8, 2, 1024, 512, 2048)
  cfg = linen_moe.MoEConfig(
      num_experts=e,
      num_experts_per_tok=k,
      emb_dim=m,
      moe_mlp_dim=h,
      dtype="bfloat16",
      param_dtype="bfloat16",
      **linen_moe.MATMUL_PATHS["sparse"],
  )
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (1, t, m), jnp.bfloat16).at[..., 0].set(8)
  dout = jax.random.normal(keys[1], (1, t, m), jnp.bfloat16)
  params = linen_moe.sharding.unbox(linen_moe.RoutedMoE(cfg).init(keys[2], x))[
      "params"
  ]
  sign = jnp.where(jnp.arange(e) % 2 == 0, 1.0, -1.0)
  gate = params["gate"]["kernel"]
  params["gate"]["kernel"] = gate.at[0].set(sign.astype(gate.dtype))
  return cfg, params, x, dout


def kernels(dry: bool) -> dict:
  """The backend's kernel against ragged_dot in the sparse layer, and on a
  GPU Tokamax itself; empty groups get exactly 0."""
  cfg, params, x, dout = _layer_with_empty_experts(dry)
  context = (
      testing.kernels_on_cpu("megablox") if dry else contextlib.nullcontext()
  )

  def fwd_bwd(implementation):
    layer = linen_moe.RoutedMoE(cfg.replace(grouped_matmul=implementation))

    def f(params, x):
      out, vjp = jax.vjp(
          lambda p, x: layer.apply({"params": p}, x)[0], params, x
      )
      return (out, *vjp(dout))

    return jax.jit(f)(params, x)

  want = fwd_bwd("ragged_dot")
  # The experts no token reached: their reference weight gradients are 0.
  weights = ("wi_0", "wi_1", "wo")
  empty = np.all(
      [np.all(np.asarray(want[1][w]) == 0, axis=(1, 2)) for w in weights],
      axis=0,
  )
  with context, warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", linen_moe.KernelFallbackWarning)
    got = fwd_bwd("kernel")
  out = {
      "kernel": KERNELS.get(
          jax.default_backend(), "megablox gmm (interpreted)"
      ),
      "empty_experts": int(empty.sum()),
      "fallbacks": [
          str(w.message)
          for w in caught
          if issubclass(w.category, linen_moe.KernelFallbackWarning)
      ],
      "layer": {
          "out": _max_diff(got[0], want[0]),
          "dlhs": _max_diff(got[2], want[2]),
          "drhs": max(_max_diff(got[1][w], want[1][w]) for w in weights),
          "empty_group_drhs_max": max(
              float(np.max(np.abs(np.asarray(got[1][w], np.float32)[empty])))
              for w in weights
          ),
      },
  }
  if jax.default_backend() == "gpu":  # Tokamax itself, no mask (#887)
    out["tokamax_direct"] = _tokamax_direct()
  return out


def _tokamax_direct() -> dict:
  """`tokamax.ragged_dot` against `jax.lax.ragged_dot` on operands with
  empty groups, forward and both gradients (no wrapper of ours)."""
  import tokamax  # noqa: PLC0415

  m, k, n = 4096, 1024, 512
  sizes = jnp.array([m // 5, 0, m // 2, 0, m // 5, 0], jnp.int32)
  keys = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  rhs = jax.random.normal(keys[1], (sizes.shape[0], k, n), jnp.bfloat16)
  dout = jax.random.normal(keys[2], (m, n), jnp.bfloat16)

  def fwd_bwd(matmul):
    def f(lhs, rhs, dout):
      out, vjp = jax.vjp(lambda a, b: matmul(a, b, sizes), lhs, rhs)
      return (out, *vjp(dout))

    return jax.jit(f)(lhs, rhs, dout)

  want, got = fwd_bwd(jax.lax.ragged_dot), fwd_bwd(tokamax.ragged_dot)
  out = {
      what: _max_diff(g, w)
      for what, g, w in zip(("out", "dlhs", "drhs"), got, want, strict=True)
  }
  empty = np.asarray(sizes) == 0
  out["empty_group_drhs_max"] = float(
      np.max(np.abs(np.asarray(got[2], np.float32)[empty]))
  )
  return out


def timings(sizes, deadline: float, peak: dict, vendor: dict, dry: bool):
  rows = []
  implementations = ("ragged_dot", "kernel", "blocked")
  cases = [
      (size, "sparse", impl, mode)
      for size in sizes
      for mode in ("none", "fp8")
      for impl in implementations
  ] + [
      (size, "dense_dropping", "auto", mode)
      for size in sizes
      for mode in ("none", "fp8")
  ]

  def context():  # a fresh one per case: a context manager runs once
    return (
        testing.kernels_on_cpu("megablox") if dry else contextlib.nullcontext()
    )

  for size, path, impl, mode in cases:
    row = {"size": size, "path": path, "implementation": impl, "mode": mode}
    if time.monotonic() > deadline:
      rows.append({**row, "skipped": "time budget"})
      continue
    case = layer_case.Case(
        size, path, quantization=mode, implementation=impl, dtype="bfloat16"
    )
    try:
      with context():
        compiled, args, compile_s = layer_case.compiled_step(case)
      seconds = _timed(compiled, args)
    except Exception as e:  # noqa: BLE001 (one case's failure is reported)
      rows.append({**row, "error": f"{type(e).__name__}: {e}"[:500]})
      continue
    flops = case.useful_flops() / seconds
    kind = "fp8" if mode == "fp8" else "bf16"
    rows.append({
        **row,
        "step_s": seconds,
        "compile_s": compile_s,
        "useful_tflops": flops / 1e12,
        "fraction_of_measured_bf16": flops / (peak["bf16"]["tflops"] * 1e12),
        "fraction_of_measured_peak": flops / (peak[kind]["tflops"] * 1e12),
        "fraction_of_vendor_peak": (
            flops / vendor[kind] if kind in vendor else None
        ),
    })
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument(
      "--cpu-dry-run",
      action="store_true",
      help="every step on the CPU at tiny sizes (its figures mean nothing)",
  )
  parser.add_argument("--budget-s", type=float, default=BUDGET_S)
  parser.add_argument(
      "--steps",
      nargs="*",
      default=list(STEPS),
      choices=STEPS,
      help="the steps to run (default: all); peaks always run",
  )
  args = parser.parse_args(argv)
  dry = args.cpu_dry_run
  if not dry and jax.default_backend() == "cpu":
    parser.error("no accelerator here: pass --cpu-dry-run to rehearse")
  budget = Budget(args.budget_s)
  results: dict[str, Any] = {"dry_run": dry}
  results["environment"] = environment()
  vendor = results["environment"]["vendor_peaks"]
  print(json.dumps(results["environment"]), flush=True)

  _step(results, "peaks")(lambda: peaks(512 if dry else 8192))
  configs = ("tiny_mixtral",) if dry else TINY_CONFIGS
  frontends = ("linen",) if dry else ("linen", "nnx")
  if "matrix" in args.steps:
    _step(results, "matrix")(
        lambda: run_matrix(
            configs, frontends, budget.deadline(SHARES["matrix"])
        )
    )
  size = "tiny" if dry else "medium"
  if "native" in args.steps:
    _step(results, "native")(
        lambda: native(size, budget.deadline(SHARES["native"]))
    )
  if "kernels" in args.steps:
    _step(results, "kernels")(lambda: kernels(dry))
  peak = results.get("peaks", {})
  if "error" not in peak and "timings" in args.steps:
    sizes = ("tiny",) if dry else ("medium", "gemma_like")
    _step(results, "timings")(
        lambda: timings(sizes, budget.deadline(1.0), peak, vendor, dry)
    )
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1, default=str)
  failed = [
      k for k, v in results.items() if isinstance(v, dict) and "error" in v
  ]
  print(f"wrote {args.out}; steps with errors: {failed or 'none'}", flush=True)
  for name in ("peaks", "native"):
    print(name, json.dumps(_summary(results.get(name))), flush=True)
  for row in results.get("timings", []):
    print("timing", json.dumps(row), flush=True)
  matrix_result = results.get("matrix", {})
  print(
      "matrix",
      {k: matrix_result.get(k) for k in ("passed", "failed", "skipped")},
      flush=True,
  )
  return 0


def _summary(step):
  if not isinstance(step, dict):
    return step
  return {
      k: (
          {kk: vv for kk, vv in v.items() if kk != "gemms"}
          if isinstance(v, dict)
          else v
      )
      for k, v in step.items()
  }


if __name__ == "__main__":
  raise SystemExit(main())
