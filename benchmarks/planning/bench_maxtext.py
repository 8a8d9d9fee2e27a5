"""Our plan beside MaxText's `train_compile` for the same model, TPU
slice, batch, sequence and remat policy: the per-device bytes of each
compiled train step, ours over theirs, and whether each fits.

Both compile without running, each in a child process: ours is `linen-moe
plan --json` (`bench_plans.run_case`), theirs `python -m
maxtext.trainers.pre_train.train_compile` in a Python with MaxText and
libtpu (`--maxtext-python`, e.g. a venv with `pip install
'maxtext[tpu]==0.2.5'`), which prints its program's `memory_analysis()`.
MaxText's side is set to what ours compiles: bf16 weights (so bf16 AdamW
moments, which inherit their dtype; its default weights are float32),
bf16 activations, one microbatch, the mesh's axes as ICI parallelism on
one slice. `--layers N` shortens both stacks alike. Each side's command
is printed before it runs.

Both sides must compile with the same libtpu: the compiler's temporaries
depend on its version (the same Qwen3-30B-A3B step, v5p-16, 8 x 4096,
full remat: ours 13.4 GiB of temporaries with libtpu 0.0.50.1, 10.2 GiB
with 0.0.52; MaxText's 19.5 and 9.8). Each Python's libtpu is printed
and recorded, with a warning where they differ; `--libtpu FILE` makes
both load that libtpu.so (`TPU_LIBRARY_PATH`).

Usage:
  python benchmarks/planning/bench_maxtext.py \\
      --case qwen3_30b_a3b,tpu:v5p-16,fsdp=8,8,4096,full \\
      --python ~/venv-tpu/bin/python --maxtext-python ~/venv-maxtext/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_plans  # noqa: E402

GIB = 2**30

# Our config -> MaxText's model_name.
MODELS = {
    "qwen3_30b_a3b": "qwen3-30b-a3b",
    "mixtral_8x7b": "mixtral-8x7b",
    "deepseek_v3_671b": "deepseek3-671b",
}
# Our mesh axis -> MaxText's ICI parallelism.
AXES = {
    "data": "ici_data_parallelism",
    "fsdp": "ici_fsdp_parallelism",
    "expert": "ici_expert_parallelism",
    "tensor": "ici_tensor_parallelism",
}
# Our remat policy -> MaxText's (whole-layer rematerialisation is "full" in
# both; the others save different tensors).
REMAT = {"full": "full"}
# What our plan compiles, in MaxText's terms.
MATCH = (
    "weight_dtype=bfloat16",
    "dtype=bfloat16",
    "gradient_accumulation_steps=1",
    "enable_checkpointing=false",
)

_STATS = re.compile(r"Memory analysis: CompiledMemoryStats\((.*?)\)")
_FIELD = re.compile(r"(\w+)=(\d+)")
_USED = re.compile(r"Used\s+([\d.]+)([KMGT]?)\s+of\s+([\d.]+)([KMGT]?)\s+hbm")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def maxtext_command(
    case: dict,
    python: str,
    layers: int | None,
    out: str,
    extra: tuple[str, ...] = (),
):
  """`train_compile` of `case` (a `bench_plans.parse_case` dict), then
  the `extra` KEY=VALUE options."""
  if case["config"] not in MODELS:
    raise ValueError(f"no MaxText model for {case['config']!r}: {MODELS}")
  if case["remat"] not in REMAT:
    raise ValueError(f"remat {case['remat']!r}: compared only for {REMAT}")
  kind, _, topology = case["target"].partition(":")
  if kind != "tpu":
    raise ValueError(f"target {case['target']!r}: MaxText compiles for TPU")
  sizes = dict(
      (axis, int(n))
      for axis, n in (a.split("=") for a in case["mesh"].split(","))
  )
  devices = math.prod(sizes.values())
  return [
      python,
      "-m",
      "maxtext.trainers.pre_train.train_compile",
      f"model_name={MODELS[case['config']]}",
      f"compile_topology={topology}",
      "compile_topology_num_slices=1",
      f"per_device_batch_size={case['batch'] / devices:g}",
      f"max_target_length={case['seq']}",
      f"remat_policy={REMAT[case['remat']]}",
      *(f"{AXES[axis]}={n}" for axis, n in sizes.items()),
      *MATCH,
      *(
          ()
          if layers is None
          else (
              "override_model_config=true",
              f"base_num_decoder_layers={layers}",
          )
      ),
      *extra,
      f"base_output_directory={out}",
      "run_name=bench_maxtext",
  ]


def run_maxtext(cmd: list[str], timeout: int) -> dict:
  """Bytes per device of MaxText's compiled step (the `memory_analysis()`
  it prints), or what its out-of-memory error says, or its error."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  start = time.perf_counter()
  proc = subprocess.run(
      cmd,
      capture_output=True,
      text=True,
      timeout=timeout,
      env=env,
      cwd=tempfile.gettempdir(),
      check=False,
  )
  out = {"exit_status": proc.returncode, "wall_s": time.perf_counter() - start}
  text = proc.stdout + proc.stderr
  stats = _STATS.search(text)
  if stats:
    got = {k: int(v) for k, v in _FIELD.findall(stats.group(1))}
    out["memory_analysis"] = got
    out["peak_bytes"] = max(
        got["argument_size_in_bytes"]
        + got["output_size_in_bytes"]
        - got["alias_size_in_bytes"]
        + got["temp_size_in_bytes"],
        got.get("peak_memory_in_bytes", 0),
    )
  elif re.search(r"RESOURCE_EXHAUSTED|HbmOom", text):
    used = _USED.search(text)
    out["oom"] = True
    if used:
      out["peak_bytes"] = int(float(used.group(1)) * _UNITS[used.group(2)])
    out["error"] = next(
        line for line in text.splitlines() if "RESOURCE_EXHAUSTED" in line
    )[:300]
  else:
    out["error"] = (text.strip().splitlines() or ["?"])[-1][:300]
  return out


def libtpu_version(python: str) -> str:
  """The libtpu that `python` loads: `TPU_LIBRARY_PATH` where set, else
  its installed package's version ("-" where it has none)."""
  if os.environ.get("TPU_LIBRARY_PATH"):
    return os.environ["TPU_LIBRARY_PATH"]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run(
      [
          python,
          "-c",
          "import importlib.metadata as m; print(m.version('libtpu'))",
      ],
      capture_output=True,
      text=True,
      env=env,
      check=False,
  )
  return proc.stdout.strip() if proc.returncode == 0 else "-"


def _gib(n: int | None) -> str:
  return "-" if n is None else f"{n / GIB:.1f}"


def row(case: dict, layers: int | None, ours: dict, theirs: dict) -> str:
  """One Markdown row of `HEADER`."""
  also = ", ".join(theirs.get("options", ()))
  head = (
      f"| {case['config']}{f' (MaxText: {also})' if also else ''} | "
      f"{case['target']} | {case['mesh']} | "
      f"{case['batch']} x {case['seq']} | {case['remat']} | "
      f"{layers or 'all'} |"
  )
  d = ours.get("per_device", {})
  m = theirs.get("memory_analysis", {})
  mine, their = d.get("peak_bytes"), theirs.get("peak_bytes")
  memory = ours.get("device_memory_bytes")
  if "per_device" not in ours:
    mine_fits = f"error: {ours.get('error')}"
  else:
    mine_fits = "yes" if ours["fits"] else "no"
  if theirs.get("oom"):
    their_fits = "no (out of memory)"
  elif "memory_analysis" not in theirs:
    their_fits = f"error: {theirs.get('error')}"
  else:
    their_fits = "-" if memory is None else ("yes" if their <= memory else "no")
  ratio = f"{mine / their:.2f}" if mine and their else "-"
  return (
      f"{head} {_gib(d.get('argument_bytes'))} / {_gib(d.get('temp_bytes'))} "
      f"/ **{_gib(mine)}** | {_gib(m.get('argument_size_in_bytes'))} / "
      f"{_gib(m.get('temp_size_in_bytes'))} / **{_gib(their)}** | "
      f"{ratio} | {_gib(memory)} | {mine_fits} | {their_fits} | "
      f"{ours.get('compile_s', 0):.0f} s / {theirs['wall_s']:.0f} s |"
  )


HEADER = (
    "| config | target | mesh | batch x seq | remat | layers | ours: args / "
    "temp / peak GiB | MaxText: args / temp / peak GiB | ours / MaxText | "
    "device GiB | ours fits | MaxText fits | compile (ours / MaxText run) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
      "--case",
      action="append",
      required=True,
      help="config,target,mesh,batch,seq,remat (repeatable)",
  )
  p.add_argument(
      "--layers",
      type=int,
      default=None,
      help="decoder layers on both sides (default: the config's)",
  )
  p.add_argument(
      "--python", default=sys.executable, help="the Python of our plan"
  )
  p.add_argument(
      "--checkout",
      default=None,
      help=(
          "plan with the library in this directory (e.g. a `git archive` of "
          "a commit) instead of the installed one"
      ),
  )
  p.add_argument(
      "--maxtext-python",
      required=True,
      help="a Python with maxtext and libtpu installed",
  )
  p.add_argument(
      "--maxtext-set",
      action="append",
      default=[],
      metavar="KEY=VALUE",
      help="one more MaxText option (repeatable), e.g. num_vocab_tiling=16",
  )
  p.add_argument(
      "--libtpu",
      default=None,
      metavar="FILE",
      help=(
          "a libtpu.so both sides load (TPU_LIBRARY_PATH), e.g. MaxText's: "
          "temporaries differ between libtpu versions"
      ),
  )
  p.add_argument("--timeout", type=int, default=3600, help="seconds a side")
  p.add_argument("--jsonl", default=None, help="append both sides here")
  args = p.parse_args(argv)
  jsonl = args.jsonl and os.path.abspath(args.jsonl)
  if args.libtpu:
    os.environ["TPU_LIBRARY_PATH"] = os.path.abspath(args.libtpu)
  libtpu = {
      "ours": libtpu_version(args.python),
      "maxtext": libtpu_version(args.maxtext_python),
  }
  print(f"libtpu: ours {libtpu['ours']}, MaxText {libtpu['maxtext']}")
  if libtpu["ours"] != libtpu["maxtext"]:
    print(
        "warning: the two sides load different libtpus; their temporaries "
        "are not comparable (--libtpu FILE loads one in both)",
        file=sys.stderr,
        flush=True,
    )
  if args.checkout:  # `python -m` looks in the working directory first
    os.environ["PYTHONPATH"] = os.path.abspath(args.checkout)
    os.chdir(args.checkout)
  extra = () if args.layers is None else ("--set", f"num_layers={args.layers}")
  rows = []
  for case in map(bench_plans.parse_case, args.case):
    with tempfile.TemporaryDirectory() as out:
      theirs_cmd = maxtext_command(
          case, args.maxtext_python, args.layers, out, tuple(args.maxtext_set)
      )
      ours_cmd = bench_plans.command(case, args.python, extra)
      where = f"cd {os.getcwd()} && " if args.checkout else ""
      print("ours:   ", where + shlex.join(ours_cmd), flush=True)
      ours = bench_plans.run_case(case, args.python, args.timeout, extra)
      # (less its output directory: a temporary one)
      print("MaxText:", shlex.join(theirs_cmd[:-2]), flush=True)
      theirs = run_maxtext(theirs_cmd, args.timeout)
      theirs["options"] = args.maxtext_set
    if jsonl:
      with open(jsonl, "a", encoding="utf-8") as f:
        f.write(
            json.dumps({
                "layers": args.layers,
                "libtpu": libtpu,
                "ours": ours,
                "maxtext": theirs,
            })
        )
        f.write("\n")
    rows.append(row(case, args.layers, ours, theirs))
    print(rows[-1], flush=True)
  print(HEADER, *rows, sep="\n")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  sys.exit(main())
