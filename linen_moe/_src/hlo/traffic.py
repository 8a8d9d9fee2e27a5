"""The bytes each device sends through the collectives of a compiled
program, read from its HLO text (`jax.jit(f).lower(...).compile().as_text()`).

For a collective over groups of G devices whose result is R bytes on each
device, a bandwidth-optimal algorithm (ring or its equivalents) makes each
device send:

  all-gather          R * (G - 1) / G     (R is the gathered result)
  reduce-scatter      R * (G - 1)         (R is one device's shard)
  all-reduce          2 * R * (G - 1) / G
  all-to-all          R * (G - 1) / G     (the tuple's parts summed)
  collective-permute  R

and receive as much. Synchronous collectives only, as XLA:CPU writes them;
`ragged-all-to-all`, whose traffic depends on the data, is not counted (its
buffers bound it).
"""

from __future__ import annotations

import dataclasses
import re

from linen_moe._src.hlo import reading as hlo

_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _bytes_per_element(type_name: str) -> float:
  if type_name == "pred":
    return 1
  bits = re.match(r"[a-z]+(\d+)", type_name)
  if bits is None:
    raise ValueError(f"Unknown HLO element type {type_name!r}.")
  return int(bits.group(1)) / 8


def _result_bytes(line: str, opcode: str) -> float:
  """Bytes of the arrays in the result type of a collective's line."""
  result = line.split("=", 1)[1].split(f" {opcode}", 1)[0]
  total = 0.0
  for type_name, dims in _ARRAY.findall(result):
    count = 1
    for d in dims.split(","):
      count *= int(d) if d else 1
    total += count * _bytes_per_element(type_name)
  return total


_SENT = {
    "all-gather": lambda r, g: r * (g - 1) / g,
    "reduce-scatter": lambda r, g: r * (g - 1),
    "all-reduce": lambda r, g: 2 * r * (g - 1) / g,
    "all-to-all": lambda r, g: r * (g - 1) / g,
    "collective-permute": lambda r, g: r,
}


@dataclasses.dataclass(frozen=True)
class CollectiveBytes:
  """One collective and the bytes it makes each device send.

  Attributes:
    opcode: "all-gather", "reduce-scatter", ... (`hlo.COLLECTIVES`).
    op_name: the JAX op path of its metadata ("" when absent).
    group_size: G, the devices of each group.
    result_bytes: R, its result on one device.
    sent_bytes: what each device sends (the module docstring's table).
  """

  opcode: str
  op_name: str
  group_size: int
  result_bytes: float
  sent_bytes: float


def collective_bytes(text: str, num_devices: int) -> list[CollectiveBytes]:
  """Every collective of a compiled HLO module, with its per-device bytes.

  Args:
    text: compiled HLO module text (synchronous collectives only).
    num_devices: the group size of a collective whose groups the HLO leaves
      implicit (it joins every device).

  Returns:
    One `CollectiveBytes` per collective, in program order; a group of one
    device sends 0 bytes.

  Raises:
    ValueError: on an asynchronous collective (`...-start`), an element type
      whose width cannot be read, or a replica group `hlo.collectives` cannot
      parse.
  """
  found = []
  for line in text.splitlines():
    op = hlo.collective_of_line(line)
    if op is None:
      continue
    if f" {op.opcode}-start(" in line:
      raise ValueError(
          f"{op.name} is asynchronous ({op.opcode}-start): its result tuple "
          "holds its operands too, which this reader does not separate."
      )
    size = len(op.groups[0]) if op.groups else num_devices
    result = _result_bytes(line, op.opcode)
    name = _OP_NAME.search(line)
    found.append(
        CollectiveBytes(
            opcode=op.opcode,
            op_name=name.group(1) if name else "",
            group_size=size,
            result_bytes=result,
            sent_bytes=_SENT[op.opcode](result, size) if size > 1 else 0.0,
        )
    )
  return found


def sent_bytes(
    text: str, num_devices: int, op_name_part: str = ""
) -> dict[str, float]:
  """The bytes each device sends through some collectives, forward and backward.

  Args:
    text: compiled HLO module text.
    num_devices: as in `collective_bytes`.
    op_name_part: count only the collectives whose op path contains it (e.g.
      "shard_map", the expert-parallel body); "" counts all.

  Returns:
    ``{"forward": bytes, "backward": bytes}``; a collective whose op path holds
    "transpose(" (the backward of a gradient) counts as backward.

  Raises:
    ValueError: as `collective_bytes`.
  """
  out = {"forward": 0.0, "backward": 0.0}
  for c in collective_bytes(text, num_devices):
    if op_name_part in c.op_name:
      out[
          "backward" if "transpose(" in c.op_name else "forward"
      ] += c.sent_bytes
  return out
