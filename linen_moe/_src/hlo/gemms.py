"""How a compiled GPU program runs each of its contractions.

`reading.contractions` says which quantized element types feed a
contraction; on a GPU the question is also what runs it and on which types:

  route       "cublas" (`__cublas$gemm`), "cublaslt" (`__cublas$lt$matmul`),
              "cublaslt_fp8" (`__cublas$lt$matmul$f8`), "cudnn" (a cuDNN
              GEMM custom call), "triton" (a dot inside a fusion that XLA
              emits with Triton: `"kind":"__triton..."` in its backend
              config), "ragged-dot" (XLA's ragged dot, not expanded), "dot"
              (a dot outside all of those: XLA's own emitter, or a CPU/TPU
              program), "custom" (another GEMM custom call).
  native      both operands of the GEMM are quantized types (s8, f8...):
              the tensor cores multiply them as such.
  converted   a quantized type feeds the GEMM but reaches it as a float:
              "fusion" where the convert runs inside the GEMM's own fusion
              (in registers, no float copy in memory), "memory" where an op
              before it writes the float copy.
  scales      the scalar operands of the GEMM's call (a cuBLASLt fp8 call's
              scales, or a Triton fusion's): the scales fused into it.

Reads optimised HLO text (`jax.jit(f).lower(...).compile().as_text()`), as
`reading` does; imports no jax.

Example:
  text = compiled.as_text()
  [g.route for g in gemms(text) if g.native]   # e.g. ["cublaslt_fp8", ...]
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from linen_moe._src.hlo import reading

ROUTES = (
    "cublas",
    "cublaslt",
    "cublaslt_fp8",
    "cudnn",
    "triton",
    "ragged-dot",
    "dot",
    "custom",
)
_TRITON_KIND = re.compile(r'"kind"\s*:\s*"__triton')
_TYPE = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]"
)
_DOT_DIMS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
# Where the walk back inside a fusion stops looking for a convert.
_MAX_DEPTH = 16


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One contraction of a compiled program and what runs it.

  Attributes:
    name: the contraction's instruction (a dot, or a GEMM custom call).
    op_name: the JAX op path of its metadata; "transpose(" in it marks a
      backward contraction.
    route: one of `ROUTES`.
    call: the fusion or custom call that runs it ("" for a plain dot).
    operand_types: the element types of lhs and rhs as the GEMM multiplies
      them (e.g. ("f8e4m3fn", "f8e4m3fn"), or ("bf16", "bf16")).
    native: both are quantized types (`reading.QUANTIZED_TYPES`).
    quantized_inputs: the quantized types found walking back from its
      operands (`reading.contractions`).
    converted: "" (no quantized input reaches it as a float), "fusion" or
      "memory" (see the module docstring).
    scales: the scalar operands of its call.
    flops: 2 x the result's elements x the contracted size (0 where the
      text does not say the contracting dimensions).
  """

  name: str
  op_name: str
  route: str
  call: str
  operand_types: tuple[str, ...]
  native: bool
  quantized_inputs: frozenset[str]
  converted: str
  scales: int
  flops: int

  @property
  def backward(self) -> bool:
    """Whether it is a backward (transposed) contraction."""
    return "transpose(" in self.op_name


def _route_of_target(target: str) -> str:
  if target == "__cublas$lt$matmul$f8":
    return "cublaslt_fp8"
  if target.startswith("__cublas$lt$matmul"):
    return "cublaslt"
  if target.startswith("__cublas$"):
    return "cublas"
  if "cudnn" in target.lower():
    return "cudnn"
  return "custom"


def _shapes(text: str) -> dict[str, tuple[str, tuple[int, ...]]]:
  """(element type, dimensions) of every array-valued instruction."""
  shapes = {}
  for line in text.splitlines():
    match = _TYPE.match(line)
    if match:
      name, dtype, dims = match.groups()
      shapes[name] = (dtype, tuple(int(d) for d in dims.split(",") if d))
  return shapes


def _flops(line: str, lhs: tuple[int, ...], out: tuple[int, ...]) -> int:
  dims = _DOT_DIMS.search(line) or _GEMM_DIMS.search(line)
  if dims is None or not lhs:
    return 0
  contracted = [int(d) for d in re.findall(r"\d+", dims.group(1))]
  if any(d >= len(lhs) for d in contracted):
    return 0
  return 2 * math.prod(out) * math.prod(lhs[d] for d in contracted)


def _converts_inside(
    instructions: dict[str, reading.Instruction], name: str
) -> bool:
  """Whether a convert from a quantized type feeds `name` within its own
  computation (walking back to the computation's parameters)."""
  computation = instructions[name].computation
  todo, seen = [(name, 0)], set()
  while todo:
    current, depth = todo.pop()
    inst = instructions.get(current)
    if inst is None or current in seen or depth > _MAX_DEPTH:
      continue
    seen.add(current)
    if inst.computation != computation or inst.parameter is not None:
      continue
    for operand in inst.operands:
      source = instructions.get(operand)
      if source is None:
        continue
      if inst.opcode == "convert" and source.types & reading.QUANTIZED_TYPES:
        return True
      todo.append((operand, depth + 1))
  return False


def gemms(text: str) -> list[Gemm]:
  """Every contraction of a compiled program, with what runs it.

  Args:
    text: optimised HLO module text.

  Returns:
    One `Gemm` per dot, ragged-dot, convolution or GEMM custom call, in
    program order.
  """
  instructions = reading.parse_hlo(text)
  lines = {}
  for line in text.splitlines():
    match = reading._INSTRUCTION.match(line)  # noqa: SLF001 (same package)
    if match:
      lines[match.group(1)] = line
  shapes = _shapes(text)
  fusions = {}  # called computation -> the fusion that calls it
  for inst in instructions.values():
    if inst.opcode == "fusion":
      for computation in inst.called:
        fusions[computation] = inst
  found = []
  for c in reading.contractions(text):
    inst = instructions[c.name]
    line = lines.get(c.name, "")
    operands = [o for o in inst.operands if o in shapes]
    types = tuple(shapes[o][0] for o in operands[:2])
    call, route, caller = "", "dot", None
    if inst.opcode == "custom-call":
      call, route, caller = inst.name, _route_of_target(inst.target), inst
    elif inst.opcode == "ragged-dot":
      route = "ragged-dot"
    elif inst.computation in fusions:
      fusion = fusions[inst.computation]
      if _TRITON_KIND.search(lines.get(fusion.name, "")):
        call, route, caller = fusion.name, "triton", fusion
    native = len(types) == 2 and set(types) <= reading.QUANTIZED_TYPES
    converted = ""
    if c.quantized_inputs and not native:
      # In the fusion only where the fusion reads every quantized input as
      # such (no float copy of one was written before it).
      read = set()
      if caller is not None and caller.opcode == "fusion":
        read = {shapes[o][0] for o in caller.operands if o in shapes}
      inside = c.quantized_inputs <= read and _converts_inside(
          instructions, inst.name
      )
      converted = "fusion" if inside else "memory"
    scales = 0
    if caller is not None:
      scales = sum(
          1
          for o in caller.operands
          if o in shapes and math.prod(shapes[o][1]) == 1
      )
    lhs_dims = shapes[operands[0]][1] if operands else ()
    out_dims = _result_dims(line, shapes.get(c.name))
    found.append(
        Gemm(
            name=c.name,
            op_name=c.op_name,
            route=route,
            call=call,
            operand_types=types,
            native=native,
            quantized_inputs=c.quantized_inputs,
            converted=converted,
            scales=scales,
            flops=_flops(line, lhs_dims, out_dims),
        )
    )
  return found


def _result_dims(line: str, shape) -> tuple[int, ...]:
  """The result's dimensions; a GEMM custom call's result is a tuple
  (output, workspace): its first element."""
  if shape is not None:
    return shape[1]
  match = re.search(r"=\s*\(\s*[a-z]+\d*[a-z0-9]*\[([\d,]*)\]", line)
  return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def kernel_calls(text: str) -> dict[str, int]:
  """The custom calls that are not GEMMs (Pallas kernels, e.g. Triton's
  `__gpu$xla.gpu.triton`), counted by "target:operand types" (each type
  once, sorted).

  Args:
    text: optimised HLO module text.

  Returns:
    e.g. {"__gpu$xla.gpu.triton:bf16,s32": 9}.
  """
  instructions = reading.parse_hlo(text)
  counts: dict[str, int] = {}
  for inst in instructions.values():
    if inst.opcode != "custom-call" or reading.is_contraction(inst):
      continue
    types = set()
    for operand in inst.operands:
      if operand in instructions:
        types |= instructions[operand].types
    key = f"{inst.target}:{','.join(sorted(types))}"
    counts[key] = counts.get(key, 0) + 1
  return dict(sorted(counts.items()))


def summary(found: list[Gemm]) -> dict[str, int]:
  """Counts of `found` by "route:lhs x rhs[:converted]" (JSON-ready).

  Args:
    found: from `gemms`.

  Returns:
    e.g. {"triton:f8e4m3fn x f8e4m3fn": 6, "triton:bf16 x bf16:memory": 2}.
  """
  counts: dict[str, int] = {}
  for g in found:
    key = f"{g.route}:{' x '.join(g.operand_types)}"
    if g.converted:
      key += f":{g.converted}"
    counts[key] = counts.get(key, 0) + 1
  return dict(sorted(counts.items()))


def to_json(found: list[Gemm]) -> list[dict]:
  """`found` as JSON-ready dicts (sets sorted, `backward` included)."""
  rows = []
  for g in found:
    row = dataclasses.asdict(g)
    row["quantized_inputs"] = sorted(g.quantized_inputs)
    row["operand_types"] = list(g.operand_types)
    row["backward"] = g.backward
    rows.append(row)
  json.dumps(rows)  # fails here, not in the caller's writer
  return rows
