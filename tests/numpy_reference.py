"""Independent NumPy oracles: per token for routing and expert math, per row
for grouped matmuls."""

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


def _sigmoid(v: np.ndarray) -> np.ndarray:
  return 1.0 / (1.0 + np.exp(-v))


def _best_first(values) -> list[int]:
  """Indices of `values`, highest first; equal values keep index order."""
  return sorted(range(len(values)), key=lambda i: -values[i])


def allowed_experts(select: np.ndarray, cfg) -> set[int]:
  """Experts of the `topk_routing_group` best groups (a group scores the sum
  of its two highest selection scores); every expert when ungrouped."""
  g = cfg.num_routing_groups
  if g == 1:
    return set(range(cfg.num_experts))
  size = cfg.num_experts // g
  group_scores = [
      sum(sorted(select[i * size : (i + 1) * size])[-2:]) for i in range(g)
  ]
  best = _best_first(group_scores)[: cfg.topk_routing_group]
  return {i * size + j for i in best for j in range(size)}


def route_token(
    logits: np.ndarray,
    cfg,
    scale: np.ndarray | None,
    bias: np.ndarray | None = None,
):
  """(expert ids, weights) for one token's logits [E], by the config's rule:
  selection scores (+ the selection-only `bias`), the allowed groups, the
  top-k, then the weights from the unbiased scores."""
  k = cfg.num_experts_per_tok
  if cfg.routing in ("topk_then_softmax", "topk_then_sigmoid"):
    scores = logits
  elif cfg.routing == "softmax_then_topk":
    scores = _softmax(logits)
  else:
    scores = _sigmoid(logits)
  select = scores if bias is None else scores + bias
  allowed = allowed_experts(select, cfg)
  ids = [e for e in _best_first(select) if e in allowed][:k]
  if cfg.routing == "topk_then_softmax":
    weights = _softmax(logits[ids])
  elif cfg.routing == "topk_then_sigmoid":
    weights = _sigmoid(logits[ids])
    if cfg.norm_topk_prob:
      weights = weights / weights.sum()
  else:
    weights = scores[ids]
    if cfg.norm_topk_prob:
      weights = weights / weights.sum()
  weights = weights * cfg.routed_scaling_factor
  if scale is not None:
    weights = weights * scale[ids]
  return np.array(ids), weights


def z_loss(logits: np.ndarray) -> float:
  """ST-MoE z-loss of logits [T, E]: mean of log(sum(exp(l)))^2."""
  return float(np.mean([np.log(np.sum(np.exp(row))) ** 2 for row in logits]))


def slots(
    ids: np.ndarray,
    weights: np.ndarray,
    num_experts: int,
    capacity: int,
    drop_policy: str = "position",
) -> np.ndarray:
  """<int>[S, k] the expert slot each assignment of one sequence claims, -1
  when dropped; ids and weights are [S, k] (token t's c-th choice).

  Assignments claim slots in priority order: "position" = all first choices
  in token order, then all second choices, ...; "probability" = highest
  weight first, equal weights in "position" order. An expert's slots go
  0, 1, ... in that order; an assignment past its expert's capacity is
  dropped.
  """
  s, k = ids.shape
  order = [(c, t) for c in range(k) for t in range(s)]
  if drop_policy == "probability":
    order = sorted(order, key=lambda ct: -weights[ct[1], ct[0]])
  used = np.zeros(num_experts, int)
  slot = np.full((s, k), -1)
  for c, t in order:
    e = ids[t, c]
    if used[e] < capacity:
      slot[t, c] = used[e]
    used[e] += 1
  return slot


def keep_mask(routes, cfg, capacity: int) -> np.ndarray:
  """<bool>[S, k] the assignments of one sequence that keep a slot
  (`slots`, in the config's drop policy); `routes` holds (ids, weights) per
  token."""
  ids = np.array([r[0] for r in routes])
  weights = np.array([r[1] for r in routes])
  return slots(ids, weights, cfg.num_experts, capacity, cfg.drop_policy) >= 0


def expert(x: np.ndarray, p: dict, e: int, act: str, cfg=None) -> np.ndarray:
  """One expert on one token x [M]; with its biases (`wi_0_bias`, ...)
  when `p` has them, and GPT-OSS's clamped SwiGLU (`cfg`'s alpha and
  limit) for "clamped_swiglu"."""

  def bias(name):
    return p[f"{name}_bias"][e] if f"{name}_bias" in p else 0.0

  gate = x @ p["wi_0"][e] + bias("wi_0")
  up = x @ p["wi_1"][e] + bias("wi_1")
  if act == "clamped_swiglu":
    gate = np.minimum(gate, cfg.swiglu_limit)
    up = np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit) + 1
    h = gate * _sigmoid(cfg.swiglu_alpha * gate) * up
  else:
    h = _act(act, gate) * up
  return h @ p["wo"][e] + bias("wo")


def moe_reference(
    params: dict,
    x: np.ndarray,
    cfg,
    gate_inputs: np.ndarray | None = None,
    capacity: int | None = None,
    routed_bias: np.ndarray | None = None,
):
  """RoutedMoE on x [B, S, M] with a plain loop over tokens.

  With `capacity`, each sequence's assignments claim expert slots in the
  config's `drop_policy` order (`keep_mask`), and assignments past an
  expert's capacity are dropped. `routed_bias` [E] is the selection-only
  bias. With `weights_on_input` (Llama-4) a weight scales its expert's
  input instead of its output. Returns (outputs [B, S, M], dropped
  assignment count).
  """
  p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "gate"}
  gate = np.asarray(params["gate"]["kernel"], np.float64)
  gate_bias = np.asarray(params["gate"].get("bias", 0.0), np.float64)
  scale = p.get("per_expert_scale")
  bias = None if routed_bias is None else np.asarray(routed_bias, np.float64)
  router_in = x if gate_inputs is None else gate_inputs
  b, s, m = x.shape
  out = np.zeros((b, s, m))
  dropped = 0
  act = cfg.mlp_activations[0]
  for bi in range(b):
    routes = [
        route_token(router_in[bi, si] @ gate + gate_bias, cfg, scale, bias)
        for si in range(s)
    ]
    keep = np.ones((s, cfg.num_experts_per_tok), bool)
    if capacity is not None:
      keep = keep_mask(routes, cfg, capacity)
      dropped += int((~keep).sum())
    for si in range(s):
      ids, weights = routes[si]
      for c, (e, w) in enumerate(zip(ids, weights, strict=True)):
        if not keep[si, c]:
          continue
        if getattr(cfg, "weights_on_input", False):
          out[bi, si] += expert(w * x[bi, si], p, e, act, cfg)
        else:
          out[bi, si] += w * expert(x[bi, si], p, e, act, cfg)
  return out, dropped


def router_probs(logits: np.ndarray, cfg) -> np.ndarray:
  """[E] one token's distribution over the experts, the load-balance loss
  input: the softmax of its logits, or its sigmoids normalised to sum to 1
  ("sigmoid_then_topk", DeepSeek-V3's balance-loss affinities, and
  "topk_then_sigmoid")."""
  if cfg.routing in ("sigmoid_then_topk", "topk_then_sigmoid"):
    s = _sigmoid(logits)
    return s / s.sum()
  return _softmax(logits)


def aux_reference(params: dict, router_in: np.ndarray, cfg):
  """(expert fraction [E], unweighted load-balance loss) of the router on
  router_in [B, S, M]: f_e = (assignments to expert e) / (T * k), counted
  from the chosen experts; P_e = mean over tokens of `router_probs`; the
  Switch loss E * sum_e f_e * P_e."""
  gate = np.asarray(params["gate"]["kernel"], np.float64)
  logits = np.asarray(router_in, np.float64).reshape(-1, gate.shape[0]) @ gate
  scale = params.get("per_expert_scale")
  scale = None if scale is None else np.asarray(scale, np.float64)
  ids = np.concatenate([route_token(row, cfg, scale)[0] for row in logits])
  e = cfg.num_experts
  fraction = np.bincount(ids, minlength=e) / ids.size
  mean_prob = np.mean([router_probs(row, cfg) for row in logits], axis=0)
  return fraction, e * float(np.sum(fraction * mean_prob))


def grouped_matmul(lhs, rhs, group_sizes, dout):
  """Row-by-row loop in float64: (out, dlhs, drhs) of the grouped matmul
  [M, K] x [G, K, N] -> [M, N] whose cotangent is `dout` [M, N]; rows past
  sum(group_sizes) (and past M) are zero, and so are their gradients."""
  lhs, rhs, dout = (np.asarray(a, np.float64) for a in (lhs, rhs, dout))
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  dlhs = np.zeros_like(lhs)
  drhs = np.zeros_like(rhs)
  row = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    for _ in range(size):
      if row < lhs.shape[0]:
        out[row] = lhs[row] @ rhs[g]
        dlhs[row] = rhs[g] @ dout[row]
        drhs[g] += np.outer(lhs[row], dout[row])
      row += 1
  return out, dlhs, drhs


def attention(
    q,
    k,
    v,
    positions,
    key_positions,
    window,
    scale,
    segments=None,
    key_segments=None,
    sinks=None,
    chunk=0,
):
  """Causal grouped-query attention, one query and head at a time: q [B, S,
  N, Dk], k [B, T, K, Dk], v [B, T, K, Dv] -> [B, S, N, Dv]. Query (b, i)
  sees key (b, j) iff 0 <= pos_i - pos_j (< window when window > 0) and,
  with segments, both are in the same segment, and with a chunk C > 0 both
  positions are in one chunk of C (Llama-4). `sinks` [N]: head h's sink
  logit joins each of its softmaxes, with no value (GPT-OSS)."""
  b, s, n, _ = q.shape
  t, kv = k.shape[1], k.shape[2]
  out = np.zeros((b, s, n, v.shape[-1]))
  for r in range(b):
    for i in range(s):
      seen = []
      for j in range(t):
        d = positions[r, i] - key_positions[r, j]
        ok = d >= 0 and (window <= 0 or d < window)
        if chunk > 0:
          ok = ok and positions[r, i] // chunk == key_positions[r, j] // chunk
        if segments is not None:
          ok = ok and segments[r, i] == key_segments[r, j]
        if ok:
          seen.append(j)
      for h in range(n):
        g = h // (n // kv)
        logits = np.array([q[r, i, h] @ k[r, j, g] for j in seen]) * scale
        if sinks is not None:
          logits = np.append(logits, sinks[h])
        p = _softmax(logits)[: len(seen)]
        out[r, i, h] = sum(
            pj * v[r, j, g] for pj, j in zip(p, seen, strict=True)
        )
  return out
