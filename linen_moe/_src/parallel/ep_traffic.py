"""The bytes each device moves per MoE layer under each expert-parallel
strategy, and the choice `expert_parallel="auto"` makes from them.

Shapes: T tokens per device, M emb_dim, k experts per token, D devices over
the expert axes that also split the batch (the "EP" of expert parallelism),
E_l experts per device, b bytes per activation element.

all_gather (`linen_moe._src.layer.expert_parallel`): the forward all-gathers the
tokens [T, M] and their routing (int32 indices, float32 weights [T, k]) and
reduce-scatters the outputs; the backward all-gathers the output cotangent
and reduce-scatters the token and routing-weight cotangents. Bandwidth-
optimal collectives send and receive (D - 1) / D of the gathered buffer:

  forward   (D - 1) * T * (2 * M * b + 8 * k)
  backward  (D - 1) * T * (2 * M * b + 4 * k)

ragged_all_to_all (`linen_moe._src.layer.ragged_experts`): each assignment goes to
the device holding its expert and its result comes back, so with routing
spread evenly over the D devices a device sends T * k * (D - 1) / D rows each
way (the rows for its own experts stay local); the forward also all-gathers
the [D, E_l] int32 counts, and the backward (the transposed exchanges) sends
the same rows again (and jax's transpose of the op all-to-alls its two
[D] int32 offset arrays):

  forward   2 * T * k * (D - 1) / D * M * b + (D - 1) * D * E_l * 4
  backward  2 * T * k * (D - 1) / D * M * b + 4 * (D - 1) * 4

so all_gather / ragged ~= D / k: the all-gather wins below D = k, the ragged
exchange above it. The ragged figure is an expectation: skewed routing sends
more to some devices (the all-gather is the same whatever the routing), and
the receive buffer is sized for the worst case (memory, not traffic).
Emulated on a CPU (`linen_moe._src.kernels.ragged_collectives`), each exchange
all-to-alls its whole padded buffer instead: the dispatch's T * k rows and
the return's D * T * min(k, E_l) rows, each (D - 1) / D of them leaving,
and all-to-alls its [D] output offsets.

`choose` picks ragged_all_to_all where its modelled bytes (forward plus
backward) are below the all-gather's by `RAGGED_MARGIN`: the model counts
bytes only, and the ragged exchange adds a local permutation of what arrives,
latency of D-way messages, and skew, so it must save a quarter of the bytes
to be worth it.
"""

from __future__ import annotations

import dataclasses

STRATEGIES = ("all_gather", "ragged_all_to_all", "auto")
RAGGED_MARGIN = 1.25
_INDEX_BYTES = 4  # int32 routing indices and counts
_WEIGHT_BYTES = 4  # float32 routing weights


@dataclasses.dataclass(frozen=True)
class Problem:
  """One MoE layer on one device of an expert-parallel mesh.

  Attributes:
    tokens: T, tokens per device.
    emb: M.
    k: experts per token.
    ep: D, devices over the exchanged expert axes.
    act_bytes: b, bytes per activation element (2 for bf16).
    experts_per_device: E_l.
  """

  tokens: int
  emb: int
  k: int
  ep: int
  act_bytes: int = 2
  experts_per_device: int = 1


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes one device sends and receives per MoE layer.

  Attributes:
    strategy: "all_gather" or "ragged_all_to_all".
    forward: bytes sent (= received, evenly routed) in the forward.
    backward: bytes sent (= received) in the backward.
  """

  strategy: str
  forward: float
  backward: float

  @property
  def total(self) -> float:
    return self.forward + self.backward

  def seconds(self, bytes_per_second: float) -> tuple[float, float]:
    """(forward, backward) seconds at `bytes_per_second` per direction of
    each device's links (full duplex: sending and receiving overlap)."""
    return self.forward / bytes_per_second, self.backward / bytes_per_second


def all_gather_traffic(p: Problem) -> Traffic:
  """The all-gather + reduce-scatter strategy's `Traffic` (module docstring)."""
  rows = (p.ep - 1) * p.tokens
  row = 2 * p.emb * p.act_bytes
  forward = rows * (row + p.k * (_INDEX_BYTES + _WEIGHT_BYTES))
  backward = rows * (row + p.k * _WEIGHT_BYTES)
  return Traffic("all_gather", float(forward), float(backward))


def ragged_traffic(p: Problem, emulated: bool = False) -> Traffic:
  """The ragged all-to-all strategy's `Traffic`: real (evenly routed) or,
  with `emulated`, the CPU emulation's padded buffers."""
  row = p.emb * p.act_bytes
  counts = (p.ep - 1) * p.ep * p.experts_per_device * _INDEX_BYTES
  offsets = (p.ep - 1) * _INDEX_BYTES  # one all_to_all of [D] offsets
  leaving = (p.ep - 1) / p.ep
  if emulated:  # each exchange sends its whole buffer to every device
    dispatch = p.tokens * p.k
    back = p.ep * p.tokens * min(p.k, p.experts_per_device)
    exchange = (dispatch + back) * leaving * row * p.ep
    # Each call all_to_alls its output offsets; autodiff reuses them.
    return Traffic(
        "ragged_all_to_all", exchange + counts + 2 * offsets, exchange
    )
  exchange = 2 * p.tokens * p.k * leaving * row
  # jax's transpose of the op all_to_alls both offset arrays.
  return Traffic(
      "ragged_all_to_all", exchange + counts, exchange + 2 * 2 * offsets
  )


def traffic(p: Problem, strategy: str, emulated: bool = False) -> Traffic:
  """`Traffic` of "all_gather" or "ragged_all_to_all" for `p`."""
  if strategy == "all_gather":
    return all_gather_traffic(p)
  if strategy == "ragged_all_to_all":
    return ragged_traffic(p, emulated)
  raise ValueError(
      f"strategy must be 'all_gather' or 'ragged_all_to_all'; got {strategy!r}."
  )


def choose(p: Problem, emulated: bool = False) -> str:
  """ "ragged_all_to_all" where the model says it moves `RAGGED_MARGIN` times
  fewer bytes than the all-gather, else "all_gather" (also for ep <= 1)."""
  if p.ep <= 1:
    return "all_gather"
  ragged = ragged_traffic(p, emulated)
  if ragged.total * RAGGED_MARGIN < all_gather_traffic(p).total:
    return "ragged_all_to_all"
  return "all_gather"
