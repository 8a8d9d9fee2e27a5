"""The GPU run's steps, each under its own time limit, and their record.

Run by benchmarks/gpu/one_gpu.sh on the GPU machine (after it installs the
carried wheels), or here with `--cpu-dry-run` (tiny shapes on the CPU, the
same scripts and options otherwise). Each step runs the project's existing
tests or benchmark scripts in child processes, with a time limit of its own
and within the whole call's (`--budget-s`: a device call ends at 10
minutes). Writes, after every step (so a call cut short still returns
what ran):

  $OUT/gpu_run.json      the steps: command lines, exit status, seconds,
                         their JSON results inlined, the log's tail; and the
                         machine (gpu_env.py's env.json)
  $OUT/gpu_run.txt       a short table of the same
  $OUT/gpu_run.tar.gz    every step's folder: its log and files

Three files: the device tool returns at most 8.

  python benchmarks/gpu/gpu_run.py --out DIR [STEP ...]
  python benchmarks/gpu/gpu_run.py --cpu-dry-run --out DIR env kernels
  python benchmarks/gpu/gpu_run.py --list
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from xml.etree import ElementTree

import bench_steps

ROOT = pathlib.Path(__file__).resolve().parents[2]
STANDIN = ROOT / "benchmarks" / "gpu" / "standin"
# What one device call may run (its limit is 600 s), less the wheels'
# install and the interpreter's start.
DEFAULT_BUDGET_S = 570
# A step is skipped, not started, with less than this left of the call.
MIN_STEP_S = 20
# A dry run's limits are this many times the GPU's: tiny shapes, but as
# many compiles, on a CPU host's 2 cores that others share.
DRY_SLACK = 3
# A step's JSON files up to this size are inlined in gpu_run.json.
INLINE_BYTES = 256 * 1024
TAIL_CHARS = 1500
# The default run's three calls (README.md): each fits one device call.
CALLS = (
    ("env", "tests"),
    ("env", "kernels", "layer", "decode"),
    ("env", "mfu", "profile", "vs_torch"),
    # Issue 63's measurements (README.md, "Issue 63").
    ("env", "gmm", "layer_torch", "fp8", "decode_limit"),
    ("mfu", "model_torch"),
)
# The GPU chip checks (tests/gpu_checks.py): where this is "1" they run on
# a CPU (a dry run's rehearsal); their records go to the step's folder.
ON_CPU_ENV = "LINEN_MOE_GPU_CHECKS_ON_CPU"
RECORDS_ENV = "LINEN_MOE_GPU_RECORDS"


@dataclasses.dataclass(frozen=True)
class Context:
  """What a step's command lines are built from."""

  python: str  # the interpreter (the machine's python3)
  out: pathlib.Path  # the step's own folder
  dry: bool  # --cpu-dry-run: tiny shapes on the CPU
  budget_s: int  # its limit (x DRY_SLACK dry), or what the call has left
  has_torch: bool


@dataclasses.dataclass(frozen=True)
class Step:
  """A named step: its time limit, what it runs and what it records."""

  budget_s: int
  what: str
  commands: Callable[[Context], list[list[str]]]
  env: tuple[tuple[str, str], ...] = ()  # child environment additions


def _script(ctx: Context, path: str, *args: str) -> list[str]:
  return [ctx.python, str(ROOT / path), *args]


def _env(ctx: Context) -> list[list[str]]:
  return [_script(ctx, "benchmarks/gpu/gpu_env.py", "--out", str(ctx.out))]


# The test files whose numbers hold on any backend (the grouped matmul's
# routes, the kernels' tests, attention, the layer against the NumPy
# oracle), and the GPU's own chip checks where the suite has them
# (`-k on_gpu`, as TPU has `-k on_tpu`).
# The chip checks first: a step cut short still leaves their records.
ON_GPU_TEST_FILES = (
    "tests/gpu/test_on_gpu_seed.py",
    "tests/gpu/test_on_gpu_routes.py",
    "tests/gpu/test_on_gpu_attention.py",
    "tests/gpu/test_on_gpu_families.py",
    "tests/gpu/test_on_gpu_resume.py",
    "tests/kernels/test_triton_gmm.py",
    "tests/kernels/test_triton_decode.py",
)
GPU_TEST_FILES = (
    *ON_GPU_TEST_FILES,
    "tests/kernels/test_grouped_matmul.py",
    "tests/kernels/test_kernels.py",
    "tests/models/test_attention.py",
    "tests/layer/test_moe.py",
)
# A dry run: the chip checks whole (rehearsed on the CPU where ON_CPU_ENV
# is "1", its default there), and a few of the others.
DRY_TESTS = (
    "on_gpu or matches_numpy_loop or rows_past_total or gpu_without_tokamax"
)


def _tests(ctx: Context) -> list[list[str]]:
  junit = ["--junitxml", str(ctx.out / "tests.xml")]
  pytest = [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
  pytest += ["-p", "no:xdist", "-rs"]
  if ctx.dry:
    files = (*ON_GPU_TEST_FILES, "tests/kernels/test_grouped_matmul.py")
    return [[*pytest, *junit, *files, "-k", DRY_TESTS]]
  return [[*pytest, *junit, *GPU_TEST_FILES]]


# M,K,N,G of the layer benchmarks' two shapes (8 experts of 2048 x 5632,
# top-2 of 4 x 4096 tokens; 128 experts of 2048 x 768, top-8).
KERNEL_SHAPES = ((32768, 2048, 5632, 8), (131072, 2048, 768, 128))


def _triton(ctx: Context, name: str) -> list[str]:
  """Our own Pallas-Triton kernel's bench (gpu/triton_*.py) beside dense."""
  rounds = ("--cpu-dry-run",) if ctx.dry else ("--rounds", "5")
  out = ("--out", str(ctx.out))
  return _script(ctx, f"benchmarks/gpu/bench_triton_{name}.py", *rounds, *out)


def _kernels(ctx: Context) -> list[list[str]]:
  path = "benchmarks/layer/bench_grouped_matmul.py"
  if ctx.dry:
    return [
        _script(
            ctx,
            path,
            *("--m", "256", "--k", "64", "--n", "128", "--g", "8"),
            *("--rounds", "1", "--slow_rounds", "1", "--warmup", "0"),
        ),
        _triton(ctx, "gmm"),
    ]
  return [
      _triton(ctx, "gmm"),
      *(
          _script(
              ctx,
              path,
              *("--m", str(m), "--k", str(k), "--n", str(n), "--g", str(g)),
              *("--dtype", "bfloat16", "--rounds", "5", "--slow_rounds", "3"),
          )
          for m, k, n, g in KERNEL_SHAPES
      ),
  ]


def _layer(ctx: Context) -> list[list[str]]:
  path = "benchmarks/device/bench_maxtext_layer.py"
  out = ("--out", str(ctx.out))
  if ctx.dry:
    return [
        _script(
            ctx,
            path,
            "--interpret",
            *("--shapes", "8x2048x5632", "--repeats", "1"),
            *("--variants", "dense", "ours_auto", "ours_ragged_dot"),
            *out,
        )
    ]
  variants = ("dense", "ours_auto", "ours_ragged_dot", "ours_kernel")
  return [_script(ctx, path, "--variants", *variants, "--repeats", "5", *out)]


def _mfu(ctx: Context) -> list[list[str]]:
  path = "benchmarks/device/bench_mfu.py"
  args = ["--chip", "h200", "--out", str(ctx.out)]
  args += ["--budget-s", str(max(ctx.budget_s - 30, 30))]
  if ctx.dry:
    return [_script(ctx, path, "--tiny", "--rounds", "1", *args)]
  variants = ("bf16", "kernel", "no_remat")
  return [_script(ctx, path, "--variants", *variants, *args)]


def _profile(ctx: Context) -> list[list[str]]:
  path = "benchmarks/device/profile_layer.py"
  out = ("--out", str(ctx.out))
  if ctx.dry:
    return [_script(ctx, path, "--interpret", "--shapes", "8x2048x5632", *out)]
  return [_script(ctx, path, *out)]


# bf16 Mixtral layers of 2.4 B parameters in all (one_chip.sh's generate).
DECODE_SET = (
    "num_layers=8",
    "num_heads=16",
    "vocab_size=32000",
    "emb_dim=2048",
    "moe_mlp_dim=5632",
    "dtype=bfloat16",
    "param_dtype=bfloat16",
)


def _decode(ctx: Context) -> list[list[str]]:
  path = "benchmarks/serving/bench_generate.py"
  if ctx.dry:
    tiny = ("--model", "tiny_mixtral", "--batch", "2", "--new", "4")
    prompts = ("--min-prompt", "4", "--max-prompt", "8")
    return [
        _script(ctx, path, *tiny, *prompts, "--rounds", "1", "--steps", "2"),
        _triton(ctx, "decode"),
    ]
  return [
      _triton(ctx, "decode"),
      _script(ctx, path, "--set", *DECODE_SET, "--rounds", "3", "--steps", "8"),
  ]


def _vs_torch(ctx: Context) -> list[list[str]]:
  path = "benchmarks/model/bench_model.py"
  out = ("--out", str(ctx.out / "bench_model.json"))
  # The peer is transformers on torch, on the same GPU (the peer reads
  # LINEN_MOE_PEER_DEVICE); with no torch (this CPU host) ours runs alone.
  peer = ("--peer", ctx.python) if ctx.has_torch else ()
  if ctx.dry:
    tiny = ("--model", "tiny_mixtral", "--batch", "2", "--seq", "32")
    decode = ("--decode-batch", "1", "--prompt", "8", "--new", "4")
    return [_script(ctx, path, *tiny, *decode, "--rounds", "1", *peer, *out)]
  return [_script(ctx, path, "--rounds", "3", *peer, *out)]


STEPS: dict[str, Step] = {
    "env": Step(
        45,
        "the machine: packages (machine's or carried, in pyproject's"
        " range?), devices, CUDA / cuDNN / driver, tokamax and xprof",
        _env,
    ),
    "tests": Step(
        525,
        "the GPU chip checks (their records: on_gpu_*.json) and the tests"
        " on the GPU: "
        + " ".join(GPU_TEST_FILES)
        + " (junit XML)",
        _tests,
    ),
    "kernels": Step(
        200,
        "our Pallas-Triton grouped matmul beside dense (bench_triton_gmm.py),"
        " then the grouped matmul alone (dense, blocked, ragged_dot as XLA"
        " lowers it), fwd and fwd+bwd, ms: bench_grouped_matmul.py",
        _kernels,
    ),
    "layer": Step(
        150,
        "the MoE layer fwd+bwd (ours auto / ragged_dot / kernel beside a"
        " dense MLP of the same FLOPs): bench_maxtext_layer.py",
        _layer,
    ),
    "decode": Step(
        150,
        "our Pallas-Triton decode expert matmul against the weight-read"
        " limit (bench_triton_decode.py), then sampled generation and the"
        " decode step, tokens/s, a bf16 Mixtral shape of 2.4 B parameters:"
        " bench_generate.py",
        _decode,
    ),
    "mfu": Step(
        180,
        "one decoder layer's MFU against the H200's bf16 peak:"
        " bench_mfu.py --chip h200",
        _mfu,
    ),
    "profile": Step(
        100,
        "the MoE layer's top device ops by group (jax.profiler):"
        " profile_layer.py",
        _profile,
        # XLA's GPU profiler needs CUPTI; a trace fails alone, not the run.
    ),
    "vs_torch": Step(
        100,
        "the whole model's train step and greedy decoding beside"
        " transformers on torch on the same GPU: bench_model.py --peer",
        _vs_torch,
        # JAX takes 75 % of the GPU by default: leave torch its share.
        (
            ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45"),
            ("LINEN_MOE_PEER_DEVICE", "cuda"),
        ),
    ),
    # Issue 63 (bench_steps.py builds their command lines).
    "gmm": Step(
        150, bench_steps.WHAT["gmm"], bench_steps.gmm, bench_steps.TORCH_ENV
    ),
    "layer_torch": Step(
        150,
        bench_steps.WHAT["layer_torch"],
        bench_steps.layer_torch,
        bench_steps.TORCH_ENV,
    ),
    "fp8": Step(110, bench_steps.WHAT["fp8"], bench_steps.fp8),
    "decode_limit": Step(
        100, bench_steps.WHAT["decode_limit"], bench_steps.decode_limit
    ),
    "model_torch": Step(
        150,
        bench_steps.WHAT["model_torch"],
        bench_steps.model_torch,
        bench_steps.MODEL_ENV,
    ),
}


def child_env(dry: bool) -> dict[str, str]:
  """The children's environment: the CPU for a dry run, and the xprof
  stand-in where no xprof imports (first on the path in a dry run, which
  rehearses it; last on the machine, where a real one would win)."""
  env = dict(os.environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  env["PYTHONUNBUFFERED"] = "1"
  paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  if dry:
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault(ON_CPU_ENV, "1")  # "0": the chip checks skip
    paths.insert(0, str(STANDIN))
  elif importlib.util.find_spec("xprof") is None:
    paths.append(str(STANDIN))
  env["PYTHONPATH"] = os.pathsep.join(paths)
  return env


def run_command(argv: list[str], log, env: dict, timeout_s: float) -> int:
  """Runs one command, its output to `log`; 124 when it ran out of time
  (its whole process group is ended)."""
  log.write(f"$ {' '.join(argv)}\n")
  log.flush()
  proc = subprocess.Popen(
      argv,
      cwd=ROOT,
      env=env,
      stdout=log,
      stderr=subprocess.STDOUT,
      start_new_session=True,
  )
  try:
    return proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.write(f"\n[gpu_run: killed after {timeout_s:.0f} s]\n")
    return 124


def junit_counts(path: pathlib.Path) -> dict[str, int]:
  """passed / failed / errors / skipped of a pytest junit XML file."""
  suite = ElementTree.parse(path).getroot()
  suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
  get = lambda key: int(suite.get(key, 0))  # noqa: E731
  tests, failed, errors, skipped = (
      get(k) for k in ("tests", "failures", "errors", "skipped")
  )
  return {
      "passed": tests - failed - errors - skipped,
      "failed": failed,
      "errors": errors,
      "skipped": skipped,
  }


def results(folder: pathlib.Path) -> dict:
  """The step's JSON files (inlined when small) and its tests' counts."""
  out = {}
  for path in sorted(folder.rglob("*")):
    name = path.relative_to(folder).as_posix()
    if path.suffix == ".json" and path.stat().st_size <= INLINE_BYTES:
      try:
        out[name] = json.loads(path.read_text())
      except ValueError:
        out[name] = f"unreadable JSON ({path.stat().st_size} B)"
    elif path.suffix == ".xml" and name == "tests.xml":
      out["tests"] = junit_counts(path)
    elif path.is_file() and path.name != "log.txt":
      out[name] = f"{path.stat().st_size} B (in gpu_run.tar.gz)"
  return out


def run_step(name: str, ctx: Context, env: dict, left_s: float) -> dict:
  """Runs a step's commands in turn under what is left of its limit."""
  step = STEPS[name]
  ctx.out.mkdir(parents=True, exist_ok=True)
  env = {**env, **dict(step.env), RECORDS_ENV: str(ctx.out)}
  budget = step.budget_s * (DRY_SLACK if ctx.dry else 1)
  limit = min(budget, left_s)
  record = {"step": name, "budget_s": budget, "what": step.what}
  commands = step.commands(ctx)
  record["commands"] = [" ".join(c) for c in commands]
  start = time.monotonic()
  status = 0
  with open(ctx.out / "log.txt", "w", encoding="utf-8") as log:
    for argv in commands:
      status = run_command(argv, log, env, limit - (time.monotonic() - start))
      if status:
        break
  record["seconds"] = round(time.monotonic() - start, 1)
  record["exit"] = status
  record["status"] = (
      "ok" if status == 0 else "timed_out" if status == 124 else "failed"
  )
  record["results"] = results(ctx.out)
  record["tail"] = (ctx.out / "log.txt").read_text(errors="replace")[
      -TAIL_CHARS:
  ]
  return record


def table(records: list[dict]) -> str:
  """The short table of gpu_run.txt."""
  lines = [f"{'step':10s} {'status':10s} {'s':>6s} {'limit':>6s}  note"]
  for r in records:
    note = r.get("reason", "")
    counts = r.get("results", {}).get("tests")
    if counts:
      note = ", ".join(f"{v} {k}" for k, v in counts.items())
    elif r["step"] == "env" and "env.json" in r.get("results", {}):
      e = r["results"]["env.json"]
      p = e.get("packages", {})
      note = (
          f"{e['devices']['count']} x {e['devices']['kind']}, jax"
          f" {p.get('jax', {}).get('version')}, cuDNN"
          f" {e.get('cuda', {}).get('cudnn', '-')}, outside ranges:"
          f" {e.get('outside_range') or 'none'}"
      )
    lines.append(
        f"{r['step']:10s} {r['status']:10s} {r.get('seconds', 0):6.0f}"
        f" {r['budget_s']:6d}  {note}"
    )
  return "\n".join(lines)


def write(out: pathlib.Path, work: pathlib.Path, head: dict, records) -> None:
  """gpu_run.json, gpu_run.txt and gpu_run.tar.gz (see the docstring)."""
  out.mkdir(parents=True, exist_ok=True)
  text = table(records)
  (out / "gpu_run.txt").write_text(
      f"{head['mode']}, {head['started']}\n{text}\n"
  )
  with open(out / "gpu_run.json", "w", encoding="utf-8") as f:
    json.dump({**head, "steps": records}, f, indent=1, default=str)
  with tarfile.open(out / "gpu_run.tar.gz", "w:gz") as tar:
    tar.add(work, arcname="gpu_run")


def missing_wheels(folder: pathlib.Path) -> list[str]:
  """The wheels in `folder` whose distribution this interpreter lacks
  (one_gpu.sh installs only those: the machine's own packages stay)."""
  import importlib.metadata  # noqa: PLC0415

  out = []
  for wheel in sorted(folder.glob("*.whl")):
    name = wheel.name.split("-", 1)[0]
    try:
      importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
      out.append(str(wheel))
  return out


def has_module(name: str) -> bool:
  return importlib.util.find_spec(name) is not None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "steps", nargs="*", help=f"steps to run (default: {' '.join(CALLS[0])})"
  )
  parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/one_gpu"))
  parser.add_argument(
      "--cpu-dry-run",
      action="store_true",
      help="every step on this host's CPU, at tiny shapes",
  )
  parser.add_argument(
      "--budget-s",
      type=float,
      help=f"the call's seconds (default {DEFAULT_BUDGET_S}; x{DRY_SLACK} dry)",
  )
  parser.add_argument("--list", action="store_true", help="list the steps")
  parser.add_argument(
      "--missing-wheels",
      metavar="DIR",
      help="print the wheels in DIR whose distribution is not installed",
  )
  args = parser.parse_args(argv)
  if args.missing_wheels:
    print("\n".join(missing_wheels(pathlib.Path(args.missing_wheels))))
    return 0
  if args.list:
    for name, step in STEPS.items():
      print(f"{name:9s} {step.budget_s:4d} s  {step.what}")
    return 0
  steps = args.steps or list(CALLS[0])
  unknown = [s for s in steps if s not in STEPS]
  if unknown:
    parser.error(f"unknown steps {unknown}; the steps: {' '.join(STEPS)}")
  if args.budget_s is None:
    args.budget_s = DEFAULT_BUDGET_S * (DRY_SLACK if args.cpu_dry_run else 1)
  out = pathlib.Path(args.out)
  work = pathlib.Path(tempfile.mkdtemp(prefix="gpu_run_"))
  env = child_env(args.cpu_dry_run)
  head = {
      "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
      "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
      "python": sys.executable,
      "budget_s": args.budget_s,
  }
  start = time.monotonic()
  records = []
  for name in steps:
    left = args.budget_s - (time.monotonic() - start)
    if left < MIN_STEP_S:
      records.append({
          "step": name,
          "budget_s": STEPS[name].budget_s,
          "status": "skipped",
          "reason": f"{left:.0f} s left of the call's {args.budget_s:.0f}",
      })
    else:
      print(f"== {name} ({time.strftime('%H:%M:%S')})", flush=True)
      ctx = Context(
          python=sys.executable,
          out=work / name,
          dry=args.cpu_dry_run,
          # What the step may take: its limit, or what is left of the call.
          budget_s=int(
              min(
                  STEPS[name].budget_s * (DRY_SLACK if args.cpu_dry_run else 1),
                  left,
              )
          ),
          has_torch=has_module("torch"),
      )
      records.append(run_step(name, ctx, env, left))
      print(records[-1]["tail"][-600:], flush=True)
      print(f"== {name}: {records[-1]['status']}", flush=True)
    write(out, work, head, records)
  shutil.rmtree(work, ignore_errors=True)  # all of it is in gpu_run.tar.gz
  print(table(records))
  return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
  sys.exit(main())
