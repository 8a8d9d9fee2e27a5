"""Where the MoE layer's own time goes on the chip: a `jax.profiler` trace of
a few forward + backward calls of `bench_maxtext_layer.py`'s programs (the
layer alone, 4 x 4096 tokens, bf16; by default ours with
`grouped_matmul="auto"` beside the dense gated MLP of the same FLOPs),
reduced where it ran to the top device operations by time per call and
their share, and the total per group (`GROUPS`, `group_of`).

The train step's profile (`profile_step.py`) holds a layer among
attention, the head and the optimizer, under the decoder's remat; this
one is the layer as `bench_maxtext_layer.py` times it against its dense
equivalent, so what separates the two (issue 46: 0.80 of dense at 8
experts, 0.55 at 128) is the table's groups other than the matmuls.

Writes under --out, per shape and variant, `<shape>.<variant>.txt` (the
table) and all of them in profile_layer.json.

  python benchmarks/device/profile_layer.py --out DIR           # on a TPU
  python benchmarks/device/profile_layer.py --interpret --out DIR  # a CPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import sys
import tempfile
import time
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_maxtext_layer as layer_bench  # noqa: E402
import jax  # noqa: E402
import profile_step  # noqa: E402

GROUPS = ("matmuls", "routing", "permutation", "activation", "copies", "other")


def group_of(name: str, opcode: str, op_name: str) -> str:
  """The `GROUPS` entry of one of the layer's device ops (first rule that
  matches):

    matmuls      the grouped matmuls (`wi_0`, `wi_1`, `wo` and their
                 gradients) or the dense MLP's dots
    routing      the router (`gate`), its top-k and softmax: RoutedMoE's
                 ops outside its sparse path
    permutation  the sparse path's other ops: the sort, the row gathers
                 (XLA's or the DMA kernels), scatters, the combine and its
                 weighting, the product of the gate and up projections
    activation   the gate's activation and its gradient
    copies       copy / transpose ops that only move bytes
  """
  if profile_step.is_copy(name, opcode):
    return "copies"
  if profile_step.is_row_gather(name, op_name):
    return "permutation"
  if profile_step.is_expert_matmul(op_name, name):
    return "matmuls"
  if "silu" in op_name or "gelu" in op_name:
    return "activation"
  if "_sparse" in op_name:
    return "permutation"
  if "RoutedMoE" in op_name:
    return "routing"
  if op_name.endswith("dot_general"):
    return "matmuls"
  return "other"


def profile_one(compiled, call_args, calls: int, top: int) -> dict:
  """`profile_step.reduce_trace` of `calls` traced calls of `compiled`
  (after two warm ones), with the host's ms a call under the profiler."""
  for _ in range(2):
    jax.block_until_ready(compiled(*call_args))
  with tempfile.TemporaryDirectory() as trace_dir:
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir):
      for _ in range(calls):
        jax.block_until_ready(compiled(*call_args))
    wall_ms = (time.perf_counter() - start) * 1e3 / calls
    path = profile_step.trace_file(trace_dir)
    if path is None:
      raise RuntimeError(f"no trace under {os.listdir(trace_dir)}")
    with gzip.open(path) as f:
      trace = json.load(f)
  reduced = profile_step.reduce_trace(
      trace,
      compiled.as_text(),
      calls,
      top,
      module="jit_step",
      group=group_of,
      groups=GROUPS,
  )
  reduced["wall_ms"] = wall_ms
  return reduced


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--shapes",
      nargs="+",
      default=list(layer_bench.SHAPES),
      choices=list(layer_bench.SHAPES),
  )
  parser.add_argument(
      "--variants",
      nargs="+",
      default=["dense", "ours_auto"],
      help="bench_maxtext_layer.py's names (dense, ours_*)",
  )
  parser.add_argument("--calls", type=int, default=3, help="calls traced")
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--out", default=".")
  parser.add_argument(
      "--interpret", action="store_true", help="tiny shapes (a CPU rehearsal)"
  )
  args = parser.parse_args(argv)
  for name in args.variants:
    if layer_bench.parse_variant(name)[0] == "maxtext":
      parser.error(f"--variants: {name!r} needs MaxText; profile ours")
  os.makedirs(args.out, exist_ok=True)
  table = layer_bench.TINY if args.interpret else layer_bench.SHAPES
  build_args = types.SimpleNamespace(
      interpret=args.interpret, workers=os.cpu_count(), device=None
  )
  results = []
  for label in args.shapes:
    shape = table[label]
    ops = layer_bench.operands(shape)
    compiled, errors, call_args = layer_bench.build(
        args.variants, shape, ops, build_args
    )
    if errors:
      print(f"  not profiled: {errors}", flush=True)
    for name, program in compiled.items():
      reduced = profile_one(program, call_args[name], args.calls, args.top)
      title = (
          f"{label} {name}: {shape.batch} x {shape.seq} tokens, forward +"
          f" backward, {jax.devices()[0].device_kind}, jax"
          f" {jax.__version__}; {args.calls} calls traced,"
          f" {reduced['wall_ms']:.2f} ms a call on the host's clock"
      )
      text = profile_step.table(reduced, title, per="call")
      print(text + "\n", flush=True)
      pathlib.Path(args.out, f"{label}.{name}.txt").write_text(text + "\n")
      results.append({"shape": label, "variant": name, **reduced})
    pathlib.Path(args.out, "profile_layer.json").write_text(
        json.dumps(results, indent=1) + "\n"
    )
  print(f"wrote {args.out}/profile_layer.json", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
