"""The torch peers of the GPU benchmarks, on our weights: `torch._grouped_mm`
alone, a MoE layer built on it as torchtitan builds its own, and
transformers' sparse MoE blocks. Imported only where torch is (the GPU
machine has torch 2.11 and transformers 5.17); torch is no requirement of
the library or of CI.

Our layout (`linen_moe.RoutedMoE`'s params): `gate/kernel` [D, E],
`wi_0` and `wi_1` [E, D, H] (gate and up), `wo` [E, H, D]; the layer
computes, for each token x and each of its top-k experts e with weight p,
p * (silu(x wi_0[e]) * (x wi_1[e])) wo[e], summed over its experts.

`TitanMoE` is that layer written as torchtitan writes its MoE (read in
torchtitan's `models/moe`; our own code): the router in float32 (softmax,
top-k, renormalised where `normalize`), the token-expert pairs sorted by
expert with a stable `argsort`, the rows gathered, each expert's rows
padded to a multiple of `ALIGN` (torchtitan's `TOKEN_GROUP_ALIGN_SIZE_M`
for bf16), three `torch._grouped_mm` calls on weights stored [E, out, in]
and passed transposed (column-major, as torchtitan passes them), the rows
unpadded, weighted by their scores and summed back with `index_add_` in
float32. Its permutation is part of what is timed.
"""

from __future__ import annotations

from typing import Any

# torchtitan pads each expert's rows to a multiple of 8 for bf16
# `torch._grouped_mm` (16 for fp8).
ALIGN = 8


def grouped_mm_call(torch, lhs, rhs, sizes, dout):
  """(a function running `torch._grouped_mm` forward + backward through
  autograd, returning (out, dlhs, drhs)) of host arrays lhs [M, K], rhs
  [G, K, N], sizes [G] and dout [M, N], placed on the GPU as bf16. rhs is
  stored [G, N, K] and passed transposed (the layout torchtitan passes);
  drhs is returned [G, K, N]."""
  dev = _device(torch)
  bf16 = torch.bfloat16
  a = torch.tensor(lhs, dtype=torch.float32, device=dev).to(bf16)
  b = torch.tensor(rhs, dtype=torch.float32, device=dev).to(bf16)
  b = b.transpose(1, 2).contiguous().requires_grad_(True)
  a.requires_grad_(True)
  g = torch.tensor(dout, dtype=torch.float32, device=dev).to(bf16)
  offs = torch.cumsum(
      torch.tensor(sizes, dtype=torch.int32, device=dev), 0, dtype=torch.int32
  )

  def run():
    out = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    da, db = torch.autograd.grad(out, (a, b), g)
    return out, da, db.transpose(1, 2)

  return run


def _device(torch) -> str:
  return "cuda" if torch.cuda.is_available() else "cpu"


def to_torch(torch, tree, dtype=None) -> Any:
  """A nested dict of arrays as torch tensors on the GPU (or CPU)."""
  if isinstance(tree, dict):
    return {k: to_torch(torch, v, dtype) for k, v in tree.items()}
  import numpy as np  # noqa: PLC0415

  t = torch.tensor(np.asarray(tree, np.float32), device=_device(torch))
  return t.to(dtype or torch.bfloat16)


class TitanMoE:
  """The MoE layer on `torch._grouped_mm`, torchtitan's way (see the module
  docstring), as a function of (weights, x) with its weights leaves that
  autograd differentiates.

  Args:
    torch: the torch module.
    params: our layer's params (host arrays): gate/kernel [D, E], wi_0,
      wi_1 [E, D, H], wo [E, H, D].
    top_k: experts per token.
    normalize: renormalise the top-k probabilities to sum to one.
  """

  def __init__(self, torch, params, top_k: int, normalize: bool = True):
    t = to_torch(torch, params)
    self.torch, self.top_k, self.normalize = torch, top_k, normalize
    # Stored [E, out, in], as torchtitan's w1 / w3 / w2, and as leaves.
    self.weights = {
        "gate": t["gate"]["kernel"].float().contiguous(),
        "w1": t["wi_0"].transpose(1, 2).contiguous(),
        "w3": t["wi_1"].transpose(1, 2).contiguous(),
        "w2": t["wo"].transpose(1, 2).contiguous(),
    }
    for w in self.weights.values():
      w.requires_grad_(True)

  def __call__(self, x):
    """[T, D] bf16 -> [T, D] bf16."""
    torch, w, k = self.torch, self.weights, self.top_k
    tokens, experts = x.shape[0], w["w1"].shape[0]
    probs = torch.softmax(x.float() @ w["gate"], dim=-1)
    scores, chosen = torch.topk(probs, k, dim=-1)
    if self.normalize:
      scores = scores / scores.sum(dim=-1, keepdim=True)
    # The permutation: pairs sorted by expert (stable: token order kept).
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    rank = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
    rows = padded_starts[flat[order]] + rank  # each pair's padded row
    capacity = flat.numel() + experts * (ALIGN - 1)  # static bound
    routed = x.new_zeros((capacity, x.shape[1]))
    routed = routed.index_copy(0, rows, x[token_of])
    offs = torch.cumsum(padded, 0, dtype=torch.int32)
    mm = torch._grouped_mm
    h = torch.nn.functional.silu(
        mm(routed, w["w1"].transpose(-2, -1), offs=offs)
    ) * mm(routed, w["w3"].transpose(-2, -1), offs=offs)
    y = mm(h, w["w2"].transpose(-2, -1), offs=offs)[rows]
    y = y.float() * scores.reshape(-1)[order, None]
    out = torch.zeros(
        (tokens, x.shape[1]), dtype=torch.float32, device=x.device
    )
    return out.index_add(0, token_of, y).to(x.dtype)

  def grads_as_ours(self, grads: dict) -> dict:
    """{gate/kernel, wi_0, wi_1, wo} of gradients of `weights`, in our
    layout."""
    return {
        "gate": {"kernel": grads["gate"]},
        "wi_0": grads["w1"].transpose(1, 2),
        "wi_1": grads["w3"].transpose(1, 2),
        "wo": grads["w2"].transpose(1, 2),
    }


def hf_block(torch, transformers, family: str, params, top_k: int, impl: str):
  """transformers' own sparse MoE block on our weights: "mixtral"
  (`MixtralSparseMoeBlock`) or "qwen3_moe" (`Qwen3MoeSparseMoeBlock`,
  `norm_topk_prob=True`), its experts run by `impl` (its
  `_experts_implementation`: "eager", "grouped_mm", "batched_mm").

  Returns:
    (the block, on the GPU in bf16, in training mode, {name: its
    parameter} in our layout's order: gate, gate_up, down).
  """
  gate = params["gate"]["kernel"]
  d, e = gate.shape
  h = params["wi_0"].shape[2]
  if family == "mixtral":
    cfg = transformers.MixtralConfig(
        hidden_size=d,
        intermediate_size=h,
        num_local_experts=e,
        num_experts_per_tok=top_k,
        router_jitter_noise=0.0,
    )
    cls = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
  elif family == "qwen3_moe":
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=d,
        moe_intermediate_size=h,
        num_experts=e,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    cls = (
        transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    )
  else:
    raise ValueError(f"family must be mixtral or qwen3_moe; got {family!r}.")
  cfg._experts_implementation = impl  # noqa: SLF001 (its documented switch)
  block = cls(cfg)
  t = to_torch(torch, params)
  with torch.no_grad():
    block.gate.weight.copy_(t["gate"]["kernel"].T)
    block.experts.gate_up_proj.copy_(
        torch.cat([t["wi_0"], t["wi_1"]], dim=2).transpose(1, 2)
    )
    block.experts.down_proj.copy_(t["wo"].transpose(1, 2))
  block = block.to(device=_device(torch), dtype=torch.bfloat16).train()
  return block


def hf_grads_as_ours(block, hidden: int) -> dict:
  """The block's parameter gradients in our layout."""
  gu = block.experts.gate_up_proj.grad.transpose(1, 2)  # [E, D, 2H]
  return {
      "gate": {"kernel": block.gate.weight.grad.T},
      "wi_0": gu[..., :hidden],
      "wi_1": gu[..., hidden:],
      "wo": block.experts.down_proj.grad.transpose(1, 2),
  }


def layer_step(torch, layer, x_host, cot_host):
  """(a function running `layer` forward + backward of sum(out * cot),
  returning (out, {weight grads as ours}, x grad)): `layer` is a
  `TitanMoE` or an `hf_block` (called on [B, S, D])."""
  x = to_torch(torch, x_host).requires_grad_(True)
  cot = to_torch(torch, cot_host)
  if isinstance(layer, TitanMoE):
    leaves = dict(layer.weights)

    def run():
      out = layer(x.reshape(-1, x.shape[-1])).reshape(x.shape)
      grads = torch.autograd.grad(out, [*leaves.values(), x], cot)
      named = dict(zip(leaves, grads[:-1], strict=True))
      return out, layer.grads_as_ours(named), grads[-1]

    return run
  hidden = layer.experts.down_proj.shape[2]

  def run_block():
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x)
    out.backward(cot)
    return out, hf_grads_as_ours(layer, hidden), x.grad

  return run_block
