"""Reading compiled programs: which quantized element types reach their
contractions, and which collectives they hold.

Reads the text of `jax.jit(f).lower(...).compile().as_text()` (optimised HLO).
Backends differ in how they run a quantized matmul: a GPU may feed `s8` or
`f8e4m3fn` straight into a dot, while XLA CPU converts them up inside a fusion
first, and a grouped matmul may run its dots inside `while` loops. So for each
contraction (`dot`, `convolution`, `ragged-dot`) we walk back from its
operands through element-wise and data-movement ops, into and out of fusions
and loops (following tuple elements), and collect the quantized element types
we meet.

Collectives (`collective_counts`, `all_gather_shapes`) are read from the
same text, for the sharding tests and benchmarks, and so are the device groups
each collective joins (`collectives`): with the processes of the devices,
`crosses_processes` tells which collectives go between processes (hosts).

Example:
  text = jax.jit(step).lower(*args).compile().as_text()
  assert quantized_types_at_contractions(text) == {"s8"}
"""

from __future__ import annotations

import collections
import dataclasses
import re

from linen_moe._src.config.quantization_modes import MODES

# Every mode's forward, gradient and storage types, and the other narrow
# types a backend may use (u8, 4-bit, other fp8 flavours).
QUANTIZED_TYPES = frozenset().union(
    *(m.hlo_types | ({m.hlo_storage_type} - {None}) for m in MODES.values()),
    {"u8", "s4", "u4", "f8e4m3b11fnuz", "f8e4m3", "f8e3m4"},
)
CONTRACTIONS = frozenset({"dot", "convolution", "ragged-dot"})
# Custom calls that are GEMMs: what XLA:GPU rewrites dots into (cuBLAS,
# cuBLASLt, its fp8 matmul, cuDNN's); they count as contractions.
_GEMM_TARGET = re.compile(r"gemm|matmul", re.IGNORECASE)
# The walk stops at these: they do not pass an operand's type through.
_OPAQUE = CONTRACTIONS | {
    "reduce",
    "reduce-window",
    "sort",
    "conditional",
    "call",
    "custom-call",
    "rng",
    "rng-bit-generator",
}
_MAX_DEPTH = 24

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ELEMENT_TYPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[")
_NAME = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction, reduced to what the walk needs.

  Attributes:
    name: the instruction name, unique in the module.
    opcode: e.g. "dot", "fusion", "get-tuple-element".
    types: element types of the result (empty for a tuple).
    operands: the names of its operands.
    called: the computations a fusion or a while loop calls.
    computation: the computation it belongs to.
    is_root: whether it is its computation's ROOT.
    parameter: the parameter number of a `parameter` op, else None.
    index: the element a `get-tuple-element` takes, else None.
    op_name: the JAX op path from the metadata, "" when absent.
    target: a custom call's `custom_call_target`, else "".
  """

  name: str
  opcode: str
  types: frozenset[str]  # element types of the result (empty for tuples)
  operands: tuple[str, ...]
  called: tuple[str, ...]  # computations a fusion or a while loop calls
  computation: str
  is_root: bool
  parameter: int | None  # the parameter number, for `parameter` ops
  index: int | None  # the element a `get-tuple-element` takes
  op_name: str  # the JAX op path from the metadata, "" when absent
  target: str = ""  # a custom call's custom_call_target


def _matching_paren(text: str, open_index: int, pair: str = "()") -> int:
  depth = 0
  for i in range(open_index, len(text)):
    depth += {pair[0]: 1, pair[1]: -1}.get(text[i], 0)
    if depth == 0:
      return i
  return len(text)


def _parse_instruction(line: str, computation: str) -> Instruction | None:
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, rest = match.groups()
  if rest.startswith("("):  # a tuple type
    type_end = _matching_paren(rest, 0) + 1
  else:
    type_end = rest.find(" ")
  type_text, rest = rest[:type_end], rest[type_end:].lstrip()
  opcode, paren, _ = rest.partition("(")
  if not paren or not re.fullmatch(r"[\w\-]+", opcode):
    return None
  close = _matching_paren(rest, len(opcode))
  args, attributes = rest[len(opcode) + 1 : close], rest[close:]
  op_name = re.search(r'op_name="([^"]*)"', attributes)
  target = re.search(r'custom_call_target="([^"]*)"', attributes)
  index = re.search(r"\bindex=(\d+)", attributes)
  is_tuple = type_text.startswith("(")
  return Instruction(
      name=name,
      opcode=opcode,
      types=frozenset()
      if is_tuple
      else frozenset(_ELEMENT_TYPE.findall(type_text)),
      operands=tuple(_NAME.findall(args)),
      called=tuple(
          re.findall(r"\b(?:calls|body|condition)=%?([\w.\-]+)", attributes)
      ),
      computation=computation,
      is_root=line.lstrip().startswith("ROOT"),
      parameter=int(args) if opcode == "parameter" else None,
      index=int(index.group(1))
      if index and opcode == "get-tuple-element"
      else None,
      op_name=op_name.group(1) if op_name else "",
      target=target.group(1) if target else "",
  )


def is_contraction(inst: Instruction) -> bool:
  """A dot, convolution or ragged-dot, or a custom call that is a GEMM."""
  if inst.opcode == "custom-call":
    return bool(_GEMM_TARGET.search(inst.target))
  return inst.opcode in CONTRACTIONS


def parse_hlo(text: str) -> dict[str, Instruction]:
  """Every instruction of an HLO module text, by (module-unique) name.

  Args:
    text: HLO module text, e.g. `jax.jit(f).lower(...).compile().as_text()`.

  Returns:
    Each `Instruction` by its name; lines that are not instructions are
    skipped.
  """
  instructions, computation = {}, ""
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header and " = " not in line:
      computation = header.group(1)
      continue
    instruction = _parse_instruction(line, computation)
    if instruction is not None:
      instructions[instruction.name] = instruction
  return instructions


@dataclasses.dataclass(frozen=True)
class Contraction:
  """A dot, convolution, ragged-dot or GEMM custom call, and what feeds it.

  Attributes:
    name: the HLO instruction name.
    opcode: "dot", "convolution", "ragged-dot" or "custom-call" (a GEMM
      target: cuBLAS, cuBLASLt, cuDNN).
    op_name: the JAX op path from the metadata ("" when XLA dropped it), e.g.
      ".../RoutedMoE.contract/wo_dot/..."; "transpose(" in it marks a backward
      contraction.
    quantized_inputs: the quantized element types found walking back from
      its operands.
    operand_types: the element types of each operand, as passed to it (e.g.
      (frozenset({"f32"}), frozenset({"f32"})) for a float32 dot).
    result_types: the element types of its result.
  """

  name: str
  opcode: str
  op_name: str
  quantized_inputs: frozenset[str]
  operand_types: tuple[frozenset[str], ...] = ()
  result_types: frozenset[str] = frozenset()


def contractions(text: str) -> list[Contraction]:
  """Every contraction of the program, with the quantized types feeding it.

  Args:
    text: compiled HLO module text.

  Returns:
    One `Contraction` per dot, convolution, ragged-dot or GEMM custom call,
    in program order.
  """
  instructions = parse_hlo(text)
  roots, callers = {}, {}
  for inst in instructions.values():
    if inst.is_root:
      roots[inst.computation] = inst.name
    for computation in inst.called:
      callers.setdefault(computation, []).append(inst)

  def producers(inst: Instruction, index: int | None):
    """(name, tuple index) pairs whose values `inst` passes on."""
    if inst.opcode == "get-tuple-element":
      return [(inst.operands[0], inst.index)]
    if inst.opcode == "tuple" and index is not None:
      return [(inst.operands[index], None)]
    if inst.opcode in ("fusion", "while"):  # the called computation's result
      found = [(roots[c], index) for c in inst.called[-1:] if c in roots]
      if inst.opcode == "while":  # and the loop's initial value
        found.append((inst.operands[0], index))
      return found
    if inst.parameter is not None:  # a fusion's operand or a loop's value
      found = []
      for caller in callers.get(inst.computation, []):
        if caller.opcode == "while":
          found.append((caller.name, index))
        elif inst.parameter < len(caller.operands):
          found.append((caller.operands[inst.parameter], index))
      return found
    return [(operand, None) for operand in inst.operands]

  def visit(name: str, index: int | None, depth: int, seen: set) -> set[str]:
    inst = instructions.get(name)
    if inst is None or (name, index) in seen or depth > _MAX_DEPTH:
      return set()
    seen.add((name, index))
    found = set(inst.types & QUANTIZED_TYPES)
    if found or inst.opcode in _OPAQUE:
      return found
    for producer, producer_index in producers(inst, index):
      found |= visit(producer, producer_index, depth + 1, seen)
    return found

  return [
      Contraction(
          name=inst.name,
          opcode=inst.opcode,
          op_name=inst.op_name,
          quantized_inputs=frozenset(
              set().union(*(visit(op, None, 0, set()) for op in inst.operands))
          ),
          operand_types=tuple(
              instructions[op].types if op in instructions else frozenset()
              for op in inst.operands
          ),
          result_types=inst.types,
      )
      for inst in instructions.values()
      if is_contraction(inst)
  ]


def quantized_types_at_contractions(text: str) -> set[str]:
  """Quantized element types that feed any contraction of the program.

  Args:
    text: compiled HLO module text.

  Returns:
    HLO type names from `QUANTIZED_TYPES`, e.g. {"s8"}; empty if none.
  """
  return set().union(*(c.quantized_inputs for c in contractions(text)))


def quantized_types_in_hlo(text: str) -> set[str]:
  """Quantized element types that appear anywhere in the program text.

  Args:
    text: HLO module text.

  Returns:
    HLO type names from `QUANTIZED_TYPES`.
  """
  return set(_ELEMENT_TYPE.findall(text)) & QUANTIZED_TYPES


COLLECTIVES = (
    "all-to-all",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "collective-permute",
)


def collective_counts(hlo_text: str) -> dict[str, int]:
  """How many ops of each kind in `COLLECTIVES` a compiled HLO module holds.

  Args:
    hlo_text: compiled HLO module text.

  Returns:
    The count of each op of `COLLECTIVES`, by op name (an async `-start`
    counts once).
  """
  return {
      op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo_text))
      for op in COLLECTIVES
  }


def all_gather_shapes(hlo_text: str) -> list[tuple[int, ...]]:
  """Result shapes of every all-gather in a compiled HLO module.

  Args:
    hlo_text: compiled HLO module text.

  Returns:
    One dimension tuple per array result, in program order (a tuple-typed
    all-gather gives one per element).
  """
  shapes = []
  for line in hlo_text.splitlines():
    match = re.search(r"=\s*(.*?)\sall-gather(?:-start)?\(", line)
    if match:
      for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", match.group(1)):
        shapes.append(tuple(int(d) for d in dims.split(",") if d))
  return shapes


# Which devices each collective joins, and whether a group spans processes.

_COLLECTIVE = re.compile(rf"\s({'|'.join(COLLECTIVES)})(?:-start)?\(")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
)
_LIST_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op and the device groups it communicates within.

  Device numbers index the program's device assignment (for a step jitted
  on a mesh: `mesh.devices.flat`).

  Attributes:
    name: the HLO instruction name.
    opcode: one of `COLLECTIVES`.
    groups: the device groups, each a tuple of device numbers; None when the
      op joins every device.
    axes: the mesh axes it runs over, when the HLO names them, else None.
  """

  name: str
  opcode: str
  groups: tuple[tuple[int, ...], ...] | None
  axes: tuple[str, ...] | None


def _int_list(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v.strip()]


def _mesh_groups(sizes_text: str, axes_text: str):
  """`mesh['data'=2,'expert'=4] {'expert'}`: devices varying on `expert`."""
  names, sizes = [], []
  for item in sizes_text.split(","):
    match = re.fullmatch(r"\s*'([^']+)'=(\d+)\s*", item)
    if not match:
      raise ValueError(f"Unparsed mesh replica group item {item!r}.")
    names.append(match.group(1))
    sizes.append(int(match.group(2)))
  axes = tuple(re.findall(r"'([^']+)'", axes_text))
  unknown = set(axes) - set(names)
  if unknown:
    raise ValueError(f"Replica group axes {sorted(unknown)} not in {names}.")
  # Row-major device numbers over the mesh; a group fixes the other axes.
  strides = [1] * len(sizes)
  for i in range(len(sizes) - 2, -1, -1):
    strides[i] = strides[i + 1] * sizes[i + 1]
  inner = [i for i, n in enumerate(names) if n in axes]
  outer = [i for i, n in enumerate(names) if n not in axes]

  def positions(dims):
    out = [0]
    for d in dims:
      out = [p + k * strides[d] for p in out for k in range(sizes[d])]
    return out

  groups = tuple(
      tuple(sorted(base + offset for offset in positions(inner)))
      for base in positions(outer)
  )
  return groups, axes


def _iota_groups(shape_text, dims_text, perm_text):
  """`[G,S]<=[dims]T(perm)`: iota over dims, transposed, cut into G groups."""
  shape, dims = _int_list(shape_text), _int_list(dims_text)
  perm = _int_list(perm_text) if perm_text else list(range(len(dims)))
  total = 1
  for d in dims:
    total *= d
  strides = [1] * len(dims)
  for i in range(len(dims) - 2, -1, -1):
    strides[i] = strides[i + 1] * dims[i + 1]
  order = [0]
  for axis in perm:  # row-major walk over the transposed array
    order = [p + k * strides[axis] for p in order for k in range(dims[axis])]
  size = shape[-1] if shape else total
  return tuple(tuple(order[i : i + size]) for i in range(0, len(order), size))


def _list_groups(line: str, start: int):
  """`{{0,1},{2,3}}` from `start` (the outer brace); `{}` is None."""
  body = line[start : _matching_paren(line, start, "{}") + 1]
  groups = tuple(
      tuple(_int_list(g)) for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])
  )
  return groups or None


def collectives(text: str) -> list[Collective]:
  """Every collective op of a compiled HLO module, with its device groups.

  Reads the three ways HLO writes groups: mesh axes
  (`replica_groups=mesh['data'=2,'expert'=4] {'data'}`), an iota list
  (`replica_groups=[2,4]<=[8]`) and explicit lists (`replica_groups=
  {{0,1},{2,3}}`, a collective-permute's `source_target_pairs`).

  Args:
    text: compiled HLO module text.

  Returns:
    One `Collective` per collective op, in program order.

  Raises:
    ValueError: if a mesh replica group cannot be parsed or names an axis
      that is not in its mesh.
  """
  return [c for c in map(collective_of_line, text.splitlines()) if c]


def collective_of_line(line: str) -> Collective | None:
  """The collective one line of HLO text holds, or None."""
  op = _COLLECTIVE.search(line)
  if not op:
    return None
  name = line.split("=", 1)[0].strip().lstrip("%").removeprefix("ROOT ")
  groups, axes = None, None
  if mesh := _MESH_GROUPS.search(line):
    groups, axes = _mesh_groups(mesh.group(1), mesh.group(2))
  elif iota := _IOTA_GROUPS.search(line):
    groups = _iota_groups(*iota.groups())
  elif listed := _LIST_GROUPS.search(line):
    groups = _list_groups(line, listed.end() - 1)
  return Collective(name, op.group(1), groups, axes)


def crosses_processes(op: Collective, process_of: list[int]) -> bool:
  """Whether any group of `op` joins devices of different processes.

  Args:
    op: a `Collective` from `collectives`.
    process_of: `process_of[d]` is the process of device number d of the
      assignment, e.g. `[dev.process_index for dev in mesh.devices.flat]`.

  Returns:
    True if some group holds devices of two or more processes (a group of
    None is every device).
  """
  groups = op.groups or (tuple(range(len(process_of))),)
  return any(len({process_of[d] for d in group}) > 1 for group in groups)


def collective_summary(
    text: str, process_of: list[int]
) -> list[tuple[str, str, bool, int]]:
  """The collectives of a compiled HLO module, counted by kind, axes and reach.

  Args:
    text: compiled HLO module text.
    process_of: the process of each device number (see `crosses_processes`).

  Returns:
    Sorted (opcode, mesh axes joined by ",", crosses processes, count)
    tuples; the axes are "?" where the HLO names none.

  Raises:
    ValueError: as `collectives`.
  """
  counts = collections.Counter(
      (
          op.opcode,
          ",".join(op.axes or ("?",)),
          crosses_processes(op, process_of),
      )
      for op in collectives(text)
  )
  return [(*key, n) for key, n in sorted(counts.items())]
