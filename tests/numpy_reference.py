"""An independent per-token NumPy oracle for routing and expert math."""

from __future__ import annotations

import math

import numpy as np


def _act(name: str, x: np.ndarray) -> np.ndarray:
  if name == "silu":
    return x / (1.0 + np.exp(-x))
  if name == "gelu":
    return (
        0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    )
  if name == "gelu_exact":
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))
  if name == "relu":
    return np.maximum(x, 0)
  raise ValueError(name)


def _softmax(v: np.ndarray) -> np.ndarray:
  e = np.exp(v - v.max())
  return e / e.sum()


def route_token(logits: np.ndarray, cfg, scale: np.ndarray | None):
  """(expert ids, weights) for one token's logits [E], by the config's rule."""
  k = cfg.num_experts_per_tok
  if cfg.routing == "topk_then_softmax":
    ids = np.argsort(-logits, kind="stable")[:k]
    weights = _softmax(logits[ids])
  else:
    probs = _softmax(logits)
    ids = np.argsort(-probs, kind="stable")[:k]
    weights = probs[ids]
    if cfg.norm_topk_prob:
      weights = weights / weights.sum()
  if scale is not None:
    weights = weights * scale[ids]
  return ids, weights


def expert(x: np.ndarray, p: dict, e: int, act: str) -> np.ndarray:
  """One expert on one token x [M]."""
  h = _act(act, x @ p["wi_0"][e]) * (x @ p["wi_1"][e])
  return h @ p["wo"][e]


def moe_reference(
    params: dict,
    x: np.ndarray,
    cfg,
    gate_inputs: np.ndarray | None = None,
    capacity: int | None = None,
):
  """RoutedMoE on x [B, S, M] with a plain loop over tokens.

  With `capacity`, each sequence's assignments claim expert slots in priority
  order (all first choices in token order, then all second choices, ...), and
  assignments past an expert's capacity are dropped. Returns
  (outputs [B, S, M], dropped assignment count).
  """
  p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "gate"}
  gate = np.asarray(params["gate"]["kernel"], np.float64)
  scale = p.get("per_expert_scale")
  router_in = x if gate_inputs is None else gate_inputs
  b, s, m = x.shape
  out = np.zeros((b, s, m))
  dropped = 0
  act = cfg.mlp_activations[0]
  for bi in range(b):
    routes = [
        route_token(router_in[bi, si] @ gate, cfg, scale) for si in range(s)
    ]
    keep = np.ones((s, cfg.num_experts_per_tok), bool)
    if capacity is not None:
      used = np.zeros(cfg.num_experts, int)
      for choice in range(cfg.num_experts_per_tok):
        for si in range(s):
          e = routes[si][0][choice]
          used[e] += 1
          keep[si, choice] = used[e] <= capacity
      dropped += int((~keep).sum())
    for si in range(s):
      ids, weights = routes[si]
      for c, (e, w) in enumerate(zip(ids, weights, strict=True)):
        if keep[si, c]:
          out[bi, si] += w * expert(x[bi, si], p, e, act)
  return out, dropped
