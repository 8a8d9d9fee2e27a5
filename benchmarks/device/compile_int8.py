"""What the int8 MoE layer asks of a TPU, read from its compiled program.

Compiles the MoE layer's forward + backward ([batch, 4096] bf16 tokens,
gradients of the weights and the input) for a TPU through libtpu, without
the TPU, in bf16 and in int8 (AQT, `quantization="int8"`), at Mixtral-8x7B
and Qwen3-30B-A3B layer dimensions, and reads from each program:

- the compiler's FLOPs and bytes accessed (`cost_analysis()`; the Pallas
  kernels count what their `CostEstimate` says);
- every contraction (XLA dots, and the Pallas grouped matmuls: Mosaic
  custom calls) with its operand element types, so whether int8 reaches the
  matrix unit and where it does not;
- the int8 values it writes (the quantization of activations, cotangents
  and weights): each fusion with an s8 result, largest first;
- the top-level operations by the bytes of their operands and results
  (what each reads and writes at least once), largest first: where the
  bytes go;
- the roofline of each program at the chip's peaks (v5e: 197 bf16 TFLOP/s,
  394 int8 TOP/s, 819 GB/s): FLOPs at the bf16 rate (the int8 program's
  int8 contractions at the int8 rate) against bytes at the HBM rate, and
  the best speed-up int8 could give by that account.

A reason, not a timing: `one_chip.sh mfu` (`--variants bf16 int8`)
measures the steps; this says what the compiler emitted for them.

  python benchmarks/device/compile_int8.py [--target tpu:v5e-1] \\
      [--shapes mixtral qwen3] [--batch 4] [--grouped-matmul auto kernel] \\
      [--json compile_int8.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys

# The layer's int8 grouped matmul has no public name; the layer reaches it
# through `MoEConfig.quantization`.
from linen_moe._src.planning import targets  # noqa: TID251

SEQ = 4096
SHAPES = {"mixtral": "mixtral_8x7b", "qwen3": "qwen3_30b_a3b"}
# TPU v5e: bf16 and int8 matrix-unit peaks, HBM bandwidth.
PEAK_BF16, PEAK_INT8, HBM = 197e12, 394e12, 819e9

_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_KERNEL_NAME = re.compile(r'"name"\s*:\s*"([\w.\-]+)"|kernel_name=([\w.\-]+)')
_ITEMSIZE = {"s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4}


_DEF = re.compile(
    r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\(?[^=]*?)\s+([\w\-]+)\("
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _nbytes(shapes: str) -> int:
  """Bytes of the arrays written in `shapes` (e.g. "(bf16[2,3], s8[4])")."""
  total = 0
  for dtype, dims in _SHAPE.findall(shapes):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _ITEMSIZE.get(dtype, 4)
  return total


def read_program(text: str, top: int = 12) -> dict:
  """From optimised HLO `text`: the element types each contraction and
  each Pallas kernel (a Mosaic custom call) takes, the int8 values written
  (each fusion with an s8 result), and the top-level operations by the
  bytes of their operands and results (what each reads and writes at
  least once), largest first."""
  sizes, kinds, entry, dots, kernels, s8_writes = {}, {}, [], [], [], []
  in_entry = False
  for line in text.splitlines():
    if line.startswith("ENTRY"):
      in_entry = True
    elif line.startswith("}"):
      in_entry = False
    m = _DEF.match(line)
    if not m:
      continue
    name, result, opcode = m.groups()
    sizes[name] = _nbytes(result)
    args = line[m.end() :].split(")", 1)[0]
    operands = re.findall(r"%([\w.\-]+)", args)
    kinds[name] = {t for t, _ in _SHAPE.findall(result)}
    if opcode in ("dot", "convolution", "ragged-dot"):
      dots.append(sorted(set().union(*(kinds.get(o, set()) for o in operands))))
    if "tpu_custom_call" in line:
      constraints = re.search(
          r"operand_layout_constraints=\{(.*?)\}, [a-z_]+=", line
      )
      kernels.append({
          "kernel": name,
          "operand_types": (
              sorted({t for t, _ in _SHAPE.findall(constraints.group(1))})
              if constraints
              else []
          ),
      })
    if opcode == "fusion" and _SHAPE.match(result) and result.startswith("s8"):
      s8_writes.append(sizes[name])
    if in_entry and opcode not in ("parameter", "get-tuple-element", "tuple",
                                   "bitcast", "constant"):  # fmt: skip
      moved = sizes[name] + sum(sizes.get(o, 0) for o in operands)
      op = _OP_NAME.search(line)
      entry.append((moved, opcode, name, op.group(1)[-90:] if op else ""))
  s8_writes.sort(reverse=True)
  entry.sort(reverse=True)
  return {
      "dots": dots,
      "kernels": kernels,
      "s8_writes": s8_writes,
      "entry_gb": sum(e[0] for e in entry) / 1e9,
      "top_ops": [
          {"gb": round(b / 1e9, 3), "opcode": o, "name": n, "op": w}
          for b, o, n, w in entry[:top]
      ],
  }


def roofline(flops: float, int8_flops: float, nbytes: float) -> dict:
  """Seconds of a program at the chip's peaks: its bf16 FLOPs, its int8
  FLOPs, its bytes; the bound is the larger of compute and memory."""
  compute = (flops - int8_flops) / PEAK_BF16 + int8_flops / PEAK_INT8
  memory = nbytes / HBM
  return {
      "compute_ms": 1e3 * compute,
      "memory_ms": 1e3 * memory,
      "bound_ms": 1e3 * max(compute, memory),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="tpu:v5e-1")
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
  parser.add_argument("--batch", type=int, default=4, help="rows of 4096")
  parser.add_argument(
      "--grouped-matmul",
      nargs="+",
      default=["auto"],
      help="MoEConfig.grouped_matmul values to compile each int8 layer with",
  )
  parser.add_argument("--json", help="write the records here")
  args = parser.parse_args(argv)
  for shape in args.shapes:
    if shape not in SHAPES:
      parser.error(f"--shapes {shape!r}: expected one of {sorted(SHAPES)}")
  target = targets.parse_target(args.target)
  targets.prepare_process(target)
  import jax  # noqa: PLC0415
  import tpu_programs  # noqa: PLC0415 (imports jax)

  from linen_moe import load_moe_config  # noqa: PLC0415

  device = targets.target_devices(target)[0]
  print(f"jax {jax.__version__}, {args.target}: {device.device_kind}")
  place = tpu_programs.placer(device)
  records = []
  variants = [("none", "auto")]
  variants += [("int8", g) for g in args.grouped_matmul]
  for shape in args.shapes:
    for quantization, grouped in variants:
      cfg = load_moe_config(
          SHAPES[shape],
          quantization=quantization,
          grouped_matmul=grouped,
          dtype="bfloat16",
          param_dtype="bfloat16",
      )
      x = place((args.batch, SEQ, cfg.emb_dim))
      compiled = tpu_programs.layer_gradients(cfg, x, place)
      cost = compiled.cost_analysis()
      read = read_program(compiled.as_text())
      rec = {
          "shape": shape,
          "quantization": quantization,
          "grouped_matmul": grouped,
          "flops": float(cost.get("flops", 0.0)),
          "bytes": float(cost.get("bytes accessed", 0.0)),
          "xla_dots": len(read["dots"]),
          "xla_dots_s8": sum("s8" in t for t in read["dots"]),
          "kernels": read["kernels"],
          "s8_write_gb": sum(read["s8_writes"]) / 1e9,
          "s8_writes_top": read["s8_writes"][:8],
          "entry_gb": read["entry_gb"],
          "top_ops": read["top_ops"],
      }
      records.append(rec)
      print(
          f"{shape} {quantization} {grouped}: {rec['flops'] / 1e12:.2f} TFLOP,"
          f" {rec['bytes'] / 1e9:.1f} GB accessed; XLA dots"
          f" {rec['xla_dots']} ({rec['xla_dots_s8']} on s8); s8 written"
          f" {rec['s8_write_gb']:.2f} GB; operands + results of the"
          f" top-level ops {rec['entry_gb']:.1f} GB",
          flush=True,
      )
      for k in rec["kernels"]:
        print(f"  kernel {k['kernel']}: {k['operand_types']}")
      for o in rec["top_ops"]:
        print(
            f"  {o['gb']:7.3f} GB {o['opcode']:12s} {o['name']:38s} {o['op']}"
        )
  for shape in args.shapes:
    rows = [r for r in records if r["shape"] == shape]
    bf16 = rows[0]
    # The int8 program's grouped matmuls (forward and input gradient) run
    # at the int8 rate at best: two of the three expert contractions of
    # each projection; its other FLOPs (the quantization) at bf16's.
    fast = roofline(bf16["flops"], 0.0, bf16["bytes"])
    print(
        f"{shape}: roofline bf16 {fast['bound_ms']:.1f} ms (compute"
        f" {fast['compute_ms']:.1f}, memory {fast['memory_ms']:.1f})"
    )
    for int8 in rows[1:]:
      slow = roofline(int8["flops"], 2 / 3 * bf16["flops"], int8["bytes"])
      print(
          f"{shape}: roofline int8 {int8['grouped_matmul']}"
          f" {slow['bound_ms']:.1f} ms (compute {slow['compute_ms']:.1f},"
          f" memory {slow['memory_ms']:.1f}): at best"
          f" {fast['bound_ms'] / slow['bound_ms']:.2f}x bf16; bytes"
          f" {int8['bytes'] / bf16['bytes']:.2f}x"
      )
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(records, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
