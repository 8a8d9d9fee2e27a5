"""Where the train step's time goes on the chip: a `jax.profiler` trace of
a few steps of one of `bench_mfu.py`'s programs (by default Qwen3-30B-A3B's
layer dims, its deeper depth, bf16), reduced where it ran to a table of
the top device operations by time per step and their share, and the
total per group:

  expert matmuls  the grouped matmuls (`wi_0`, `wi_1`, `wo` and their
                  gradients: ragged_dot, our Pallas kernels, int8's
                  quantization inside them)
  attention       projections, rotary, scores and values (splash)
  routing         the router, its top-k, softmax and load-balance loss
  permutation     the sort of the tokens by expert, the gathers and
                  scatters around the grouped matmuls, the combine
  optimizer       the update (the taken branch of the finite check)
  head and loss   embedding, final norm, the vocabulary head and the loss
  norms           the layers' RMS norms
  copies          copy / transpose ops that only move bytes
  other           the rest (the finite check, residual adds, ...)

An op's group comes from its HLO instruction in the compiled program:
its opcode and its `op_name` metadata (the trace names each device op
by its instruction; `group_of` holds the rules). Time is an op's self
time on its device line (a loop or a conditional counts only what its
children do not), averaged over the traced steps.

Writes under --out: profile.txt (the table), profile.json (every op and
group), and the raw trace (`*.trace.json.gz`) where it is under
--max-trace-mb.

  python benchmarks/device/profile_step.py --out DIR     # on the chip
  python benchmarks/device/profile_step.py --tiny --out DIR  # CPU rehearsal
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_mfu  # noqa: E402

GROUPS = (
    "expert matmuls",
    "attention",
    "routing",
    "permutation",
    "optimizer",
    "head and loss",
    "norms",
    "copies",
    "other",
)

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")


def _skip_shape(rest: str) -> str:
  """The text after an instruction's result shape (a tuple shape is in
  parentheses, possibly nested)."""
  if not rest.startswith("("):
    return rest.split(" ", 1)[1] if " " in rest else ""
  depth = 0
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[i + 1 :]
  return ""


def instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
  """{instruction name: (opcode, op_name metadata)} of an HLO module's
  text (`compiled.as_text()`), every computation."""
  out = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, rest = match.groups()
    opcode = _OPCODE.match(_skip_shape(rest).lstrip())
    op_name = _OP_NAME.search(rest)
    out[name] = (
        opcode.group(1) if opcode else "",
        op_name.group(1) if op_name else "",
    )
  return out


# The grouped matmul's call sites (the contraction submodules' names).
_EXPERT_SITES = ("wi_0_dot", "wi_1_dot", "wo_dot", "gate_up_dot")
# The Pallas grouped-matmul kernels' custom calls (`pallas_gmm`).
_MATMUL_CALLS = ("linen_moe_gmm", "linen_moe_tgmm")
_PERMUTE_PRIMITIVES = ("sort", "gather", "scatter", "argsort", "cumsum")
_COPIES = ("copy", "copy-start", "copy-done", "transpose")
_OPTIMIZER = ("cond/branch_1_fun", "apply_updates", "scale_by", "sgd", "adam")
# The permutation's row-gather kernels (and their operands' packing), which
# run inside the gate-and-up checkpoint on a TPU.
_GATHER_CALLS = ("jit(gather_rows)", "jit(gather_scale_dot)")


def is_copy(name: str, opcode: str) -> bool:
  """Whether a device op only moves bytes (a copy or a transpose)."""
  return opcode in _COPIES or name.startswith(("copy", "transpose"))


def is_row_gather(name: str, op_name: str) -> bool:
  """Whether a device op is one of the permutation's row-gather kernels
  (or its operands' packing)."""
  return name.startswith("linen_moe_gather") or any(
      k in op_name for k in _GATHER_CALLS
  )


def is_expert_matmul(op_name: str, name: str = "") -> bool:
  """Whether a device op belongs to a grouped matmul's call site, or is one
  of the grouped-matmul kernels by its instruction `name` (the paired gate
  and up projections run under no call site's name)."""
  return name.startswith(_MATMUL_CALLS) or any(
      k in op_name for k in _EXPERT_SITES
  )


def group_of(name: str, opcode: str, op_name: str) -> str:
  """The `GROUPS` entry of one device op: its instruction name, opcode
  and `op_name` metadata (first rule that matches)."""
  last = op_name.rsplit("/", 1)[-1]
  if is_copy(name, opcode):
    return "copies"
  if any(k in op_name for k in _OPTIMIZER):
    return "optimizer"
  if is_row_gather(name, op_name):
    return "permutation"
  if is_expert_matmul(op_name, name):
    return "expert matmuls"
  if "/moe/" in op_name or op_name.endswith("/moe"):
    if "moe._sparse" not in op_name:
      return "routing"
    if opcode in ("sort", "gather", "scatter") or any(
        last.startswith(k) for k in _PERMUTE_PRIMITIVES
    ):
      return "permutation"
    # the sparse path's own elementwise work: activation, combine weights
    return "permutation" if "gate_and_up" not in op_name else "expert matmuls"
  if "norm" in last or re.search(r"_norm(/|$)", op_name):
    return "head and loss" if "final_norm" in op_name else "norms"
  # Splash's custom calls carry no op_name: their kernels' names say it.
  if "attention" in op_name or name.startswith(("splash", "flash")):
    return "attention"
  if "embed" in op_name or "(Decoder)" not in op_name and "jvp()" in op_name:
    return "head and loss"
  return "other"


def device_op_events(trace: dict, module: str = "jit_step") -> list[dict]:
  """The trace's device op events: on an accelerator the events of its
  "XLA Ops" lines, on a CPU the events that name an HLO op; only those
  of `module` where the event names its module."""
  events = trace.get("traceEvents", [])
  threads = {
      (e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
      for e in events
      if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  op_lines = {k for k, v in threads.items() if v == "XLA Ops"}
  out = []
  for e in events:
    if e.get("ph") != "X":
      continue
    args = e.get("args") or {}
    if op_lines:
      if (e.get("pid"), e.get("tid")) not in op_lines:
        continue
    elif "hlo_op" not in args:
      continue
    owner = args.get("hlo_module")
    if owner and not owner.startswith(module):
      continue
    out.append(e)
  return out


def self_ms(events: list[dict], steps: int) -> collections.Counter:
  """{op name: self milliseconds per step} (`benchmarks/common/profiling`'s
  rule: a child's time is not its parent's)."""
  by_line = collections.defaultdict(list)
  for e in events:
    by_line[e.get("pid"), e.get("tid")].append(e)
  total = collections.Counter()
  for line in by_line.values():
    line.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []
    for e in line:
      name = (e.get("args") or {}).get("hlo_op") or e["name"]
      name = name.lstrip("%")
      while stack and stack[-1][0] <= e["ts"]:
        stack.pop()
      if stack:
        total[stack[-1][1]] -= e["dur"] / 1e3 / steps
      total[name] += e["dur"] / 1e3 / steps
      stack.append((e["ts"] + e["dur"], name))
  return total


def reduce_trace(
    trace: dict,
    hlo_text: str,
    steps: int,
    top: int = 30,
    module="jit_step",
    group=group_of,
    groups=GROUPS,
) -> dict:
  """The trace reduced: per step ms and share of the top ops and of each
  group (`group(name, opcode, op_name)`, one of `groups`).

  Returns:
    {"step_ms": the device ops' total per step, "groups": [{group, ms,
    share}] (every group, largest first), "top": [{op, opcode, group, ms,
    share, op_name}], "ops": how many distinct ops}.
  """
  ops = self_ms(device_op_events(trace, module), steps)
  info = instructions(hlo_text)
  total = sum(ops.values())
  by_group = collections.Counter({g: 0.0 for g in groups})
  rows = []
  for op, ms in ops.most_common():
    opcode, op_name = info.get(op, ("", ""))
    name = group(op, opcode, op_name)
    by_group[name] += ms
    rows.append({
        "op": op,
        "opcode": opcode,
        "group": name,
        "ms": ms,
        "share": ms / total if total else 0.0,
        "op_name": op_name,
    })
  return {
      "step_ms": total,
      "groups": [
          {"group": g, "ms": ms, "share": ms / total if total else 0.0}
          for g, ms in by_group.most_common()
      ],
      "top": rows[:top],
      "ops": len(rows),
      "ops_without_hlo": sum(1 for r in rows if not r["opcode"]),
  }


def table(reduced: dict, title: str, per: str = "step") -> str:
  """`reduced` as text: its groups and top ops, in ms a `per` (a 4-letter
  word: "step", or "call" for a profile of calls)."""
  lines = [
      title,
      (
          f"device ops: {reduced['step_ms']:.2f} ms a {per},"
          f" {reduced['ops']} distinct ops"
      ),
      "",
      f"by group:        ms a {per}   share",
  ]
  for g in reduced["groups"]:
    lines.append(f"  {g['group']:15s} {g['ms']:9.2f}  {g['share']:6.1%}")
  lines += ["", f"top ops:   ms a {per}  share  group           op (opcode)"]
  for r in reduced["top"]:
    lines.append(
        f"  {r['ms']:9.3f}  {r['share']:6.1%}  {r['group']:15s}"
        f" {r['op']} ({r['opcode']}) {r['op_name'][-80:]}"
    )
  return "\n".join(lines)


def trace_file(trace_dir: str) -> str | None:
  found = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
  return found[0] if found else None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--shape", default="qwen3", choices=list(bench_mfu.SHAPES)
  )
  parser.add_argument(
      "--variant", default="bf16", choices=list(bench_mfu.VARIANTS)
  )
  parser.add_argument("--depth", type=int, help="default: the deeper one")
  parser.add_argument("--steps", type=int, default=3, help="steps traced")
  parser.add_argument("--top", type=int, default=30)
  parser.add_argument("--out", default=".")
  parser.add_argument("--max-trace-mb", type=float, default=40)
  parser.add_argument(
      "--tiny", action="store_true", help="bench_mfu's tiny CPU rehearsal"
  )
  args = parser.parse_args(argv)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415

  shapes = bench_mfu.TINY if args.tiny else bench_mfu.SHAPES
  shape = shapes[args.shape]
  seq = 64 if args.tiny else bench_mfu.SEQ
  depth = args.depth or max(shape.depths)
  batch = bench_mfu.batch_of(shape, args.variant)
  mesh = linen_moe.sharding.make_mesh("data=1", jax.devices()[:1])
  cfg = bench_mfu.model_config(shape, depth, args.variant)
  run = bench_mfu.training_run(cfg, mesh)
  start = time.perf_counter()
  compiled = run.lower(
      *bench_mfu.abstract_args(run, mesh, batch, seq)
  ).compile()
  compile_s = time.perf_counter() - start
  hlo_text = compiled.as_text()
  tokens = jax.device_put(
      jnp.asarray(
          np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq)),
          jnp.int32,
      ),
      run.token_sharding(),
  )
  rng = jax.device_put(jax.random.key(1), bench_mfu.replicated(mesh))
  state = run.init(tokens, jax.random.key(0))
  for _ in range(2):  # compiled (the cache of the compile above), warm
    state, metrics = run.step(state, tokens, rng)
    jax.block_until_ready((state, metrics))
  os.makedirs(args.out, exist_ok=True)
  with tempfile.TemporaryDirectory() as trace_dir:
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir):
      for _ in range(args.steps):
        state, metrics = run.step(state, tokens, rng)
        jax.block_until_ready((state, metrics))
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    path = trace_file(trace_dir)
    if path is None:
      print(f"no *.trace.json.gz under the trace: {os.listdir(trace_dir)}")
      return 1
    with gzip.open(path) as f:
      trace = json.load(f)
    if os.path.getsize(path) <= args.max_trace_mb * 2**20:
      shutil.copy(path, os.path.join(args.out, "step.trace.json.gz"))
  reduced = reduce_trace(trace, hlo_text, args.steps, args.top)
  title = (
      f"{cfg_name(shape, args.variant)}, {depth} layer(s), batch {batch} x"
      f" {seq}, {jax.devices()[0].device_kind}, jax {jax.__version__}:"
      f" {args.steps} steps traced, {wall_ms:.1f} ms a step on the host's"
      f" clock (under the profiler), compiled in {compile_s:.0f} s"
  )
  text = table(reduced, title)
  print(text, flush=True)
  pathlib.Path(args.out, "profile.txt").write_text(text + "\n")
  reduced.update(
      title=title,
      shape=args.shape,
      variant=args.variant,
      depth=depth,
      batch=batch,
      seq=seq,
      wall_ms=wall_ms,
      compile_s=compile_s,
      loss=float(metrics["loss"]),
  )
  pathlib.Path(args.out, "profile.json").write_text(
      json.dumps(reduced, indent=1) + "\n"
  )
  with gzip.open(os.path.join(args.out, "step.hlo.txt.gz"), "wt") as f:
    f.write(hlo_text)
  print(f"wrote {args.out}/profile.txt, profile.json", flush=True)
  return 0


def cfg_name(shape, variant: str) -> str:
  remat = bench_mfu.remat_of(shape, variant)
  return f"{shape.config} ({variant}, remat {remat})"


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  sys.exit(main())
