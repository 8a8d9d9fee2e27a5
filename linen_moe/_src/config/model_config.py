"""The reference decoder's frozen, validated config: `ModelConfig`.

It holds the MoE layer's `MoEConfig` (`config.py`) and the decoder's own
fields (attention, norms, the layer stack); `run_fields` names the fields of
both that a resumed run may change. No jax at import (the command line's
--help reads the configs).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import ClassVar

from linen_moe._src.config import decoder_fields
from linen_moe._src.config import lora as lora_config
from linen_moe._src.config.checks import check_keys
from linen_moe._src.config.checks import check_positive_ints
from linen_moe._src.config.checks import fail
from linen_moe._src.config.checks import new_names
from linen_moe._src.config.checks import run_field
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.config.stack_plan import StackPlan

# `ModelConfig.remat`: what each block keeps for the backward pass
# (`linen_moe._src.models.remat` says which tensors each policy saves).
REMAT_POLICIES = (
    "none",
    "full",
    "save_experts",
    "save_attention_experts",
    "offload",
)


def check_remat(remat: Any, name: str = "remat", flag: str = "") -> None:
  """The one check of a remat value: one of `REMAT_POLICIES`.

  Args:
    remat: the value.
    name: what the error calls it ("ModelConfig.remat", "remat").
    flag: the command-line flag that set it, if any ("--remat").

  Raises:
    ValueError: naming `name` (and `flag`), the value and the policies.
  """
  if not isinstance(remat, str) or remat not in REMAT_POLICIES:
    where = f"{name}={remat!r}" + (f" ({flag})" if flag else "")
    raise ValueError(f"{where} is invalid: allowed {REMAT_POLICIES}.")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The reference decoder: embedding, N blocks, final norm, logits.

  Attributes:
    moe: the MoE layer in every block.
    vocab_size: V.
    num_layers: number of decoder blocks.
    num_heads: attention heads; head_dim = moe.emb_dim // num_heads unless set.
    head_dim: width of one attention head (0 = emb_dim // num_heads).
    rope_max_wavelength: RoPE base.
    router_input_norm: Gemma-4 style router input: the router reads
      `rms_norm(x) * learned_scale * emb_dim ** -0.5` (no norm weight), while
      the experts read their own RMS-normalised input.
    post_moe_norms: Gemma-4 style: the routed output and the shared expert
      output are each RMS-normalised before they are added.
    scan_layers: True to scan the blocks with `nn.scan`, False to unroll. A
      stack that mixes dense and MoE layers scans as a repeated group with
      the layers outside it unrolled (`stack_plan`). A scanned stack keeps
      each weight as one [L, ...] array, and on a TPU the Pallas grouped
      matmul cannot read a layer's slice of it in place: each step copies
      every layer's expert weights out of the stack and their gradients
      back (a v5e, Mixtral-8x7B layer dims: 17 ms a layer of 237, and
      2.6 GiB held at 2 layers). Unrolled, that layer ran at 54 % MFU
      (benchmarks/device/README.md), for a compile time that grows with
      the depth.
    scan_unroll: how many layers one iteration of the scanned stack's loop
      runs (`nn.scan`'s `unroll`), an int >= 1; 0 (the default) compiles a
      stack of at most 4 layers with no loop (faster steps, as fast a
      compile) and a longer one a layer per iteration (a compile time flat
      in depth). It changes the compiled program only, never the
      variables' layout.
    remat: what each block keeps for the backward pass
      (`REMAT_POLICIES`): "none" keeps every activation; "full" only each
      layer's input, recomputing the rest of the layer in the backward
      pass; "save_experts" also the router logits, the expert matmuls'
      outputs and the MLP output (the MoE is not recomputed);
      "save_attention_experts" those and the attention's q, k, v and
      output; "offload" keeps each layer's input in host memory (pinned
      host) instead of the device's. It changes the compiled program only
      (memory against time), never the numbers or the variables.
    remat_moe_rows: under a `remat` other than "none", the MoE layers
      still gather their sorted rows [T k, M] again for their own
      backward (True, the default) or keep them from the block's
      recompute (False: one row gather fewer a layer; one layer's rows,
      and what XLA schedules with them, held in its backward: compiled
      for a TPU v5e, +1.17 GiB at Qwen3-30B-A3B's 8 x 4096 tokens,
      +1.50 GiB at Mixtral-8x7B's 2 x 4096, which then no longer fits).
      Without remat the layers always gather them again. Never the
      numbers.
    norm_eps: RMSNorm epsilon.
    num_kv_heads: key/value heads of grouped-query attention (0 =
      num_heads); it divides num_heads, and key/value head j serves the
      consecutive query heads j * G .. j * G + G - 1, G = num_heads /
      num_kv_heads.
    qk_norm: RMS-normalise each query and key head (a learned [head_dim]
      scale each, eps `norm_eps`) before the rotary embedding (Qwen3).
    qk_norm_over_heads: with `qk_norm`, one RMS over all the query (key)
      heads' dims at once, a learned [num_heads * head_dim] scale
      (MiniMax-M2), instead of one per head.
    tie_embeddings: the logits are the final hidden state times the
      embedding (True) or a separate `logits` kernel [M, V] (False).
    scale_embeddings: multiply the embedded tokens by sqrt(emb_dim).
    sliding_window: W > 0: query i sees key j only when 0 <= i - j < W (W
      keys, itself included), in every layer; 0 = causal over the whole
      sequence.
    dense_layers: indices of the layers whose MLP is a dense gated MLP of
      width `dense_mlp_dim` instead of the MoE layer (Qwen3's
      `mlp_only_layers` and `decoder_sparse_step`, DeepSeek's first dense
      layers).
    dense_mlp_dim: F, the hidden width of the dense layers' MLP.
    kv_lora_rank: R > 0: multi-head latent attention (DeepSeek-V2/V3,
      `linen_moe._src.models.mla`): keys and values expand from a normed
      latent of width R that, with one rotary key head, is all the KV cache
      keeps; 0: the attention of `attention.py`.
    q_lora_rank: MLA: the query through a normed low-rank latent of this
      width (0 = one projection).
    qk_nope_head_dim: MLA: the query / key dims without position.
    qk_rope_head_dim: MLA: the rotary query / key dims (one key head shared
      by every head).
    v_head_dim: MLA: the value head width.
    rope_interleave: rotate the adjacent lanes (2i, 2i + 1) of a head
      together (DeepSeek's `rope_interleave`) instead of (i, i + D/2).
    rope_type: "default", "yarn" (YaRN's frequencies and cos / sin factor,
      transformers' `_compute_yarn_parameters`) or "llama3" (the low
      frequencies divided by `rope_factor`, a smooth ramp between
      `rope_low_freq_factor` and `rope_high_freq_factor` of
      `rope_original_max_len`: `_compute_llama3_parameters`).
    rope_factor: YaRN's context extension factor (s > 1).
    rope_original_max_len: YaRN: the pretraining context length.
    rope_beta_fast: YaRN: rotations below which a frequency is interpolated.
    rope_beta_slow: YaRN: rotations above which a frequency is kept.
    rope_mscale: YaRN's `mscale` m and
    rope_mscale_all_dim: its `mscale_all_dim` m': cos and sin are multiplied
      by g(m) / g(m') when both are set, else by g(1), g(x) = 0.1 x
      ln(rope_factor) + 1 (0 = not set). MLA also multiplies its softmax
      scale by g(m') ** 2 (DeepSeek's correction).
    rope_truncate: YaRN: floor and ceil the ends of the correction range
      (transformers' default); False keeps them fractional (GPT-OSS's
      `truncate: false`).
    rope_low_freq_factor: "llama3": wavelengths above original / low are
      divided by the factor (1 for any other rope_type).
    rope_high_freq_factor: "llama3": wavelengths below original / high keep
      their frequency (4 for any other rope_type).
    rotary_dim: R > 0: only the first R dims of each query and key head
      rotate (pairs (i, i + R/2), frequencies base ** (-2i / R)), the rest
      pass through (GLM-4.5's `partial_rotary_factor`, MiniMax-M2's
      `rotary_dim`); 0 = the whole head.
    attention_scale: the softmax scale of the attention logits (0 = one
      over the square root of the query / key head width, with MLA's YaRN
      correction).
    full_attention_layers: the layers that attend over the whole causal past
      while the others keep `sliding_window` (Gemma-4's "full_attention"
      layers), each with the geometry of the `full_` fields.
    full_head_dim: the head width of the full-attention layers (0 = head_dim).
    full_kv_heads: their key / value heads (0 = the other layers').
    full_rope_base: their RoPE base (0 = rope_max_wavelength).
    full_rope_fraction: their rotary share: Gemma-4's "proportional" RoPE,
      frequencies base ** (-2i / D) for i < int(fraction * D / 2) and 0 (no
      rotation) above, D the head width (1 = every pair rotates).
    full_k_eq_v: the full-attention layers have no value projection: the
      values are the raw key projection (before its norm and the rotary
      embedding).
    value_norm: RMS-normalise each value head, without a weight (Gemma-4).
    post_attention_norm: RMS-normalise the attention output before the
      residual (`post_attention_norm`).
    post_mlp_norm: RMS-normalise a block's MLP output (routed + shared)
      before the residual (`post_mlp_norm`).
    shared_pre_norm: with `post_moe_norms`, the shared experts read their own
      pre-norm of the residual (`pre_shared_norm`; Gemma-4's dense MLP
      beside the experts) instead of the routed experts'.
    layer_scalar: multiply each block's output stream by a saved scalar
      `layer_scalar` [1] (collection `updated_by_rule`, never trained, as
      Gemma-4's buffer).
    final_logit_softcap: c > 0: logits = c * tanh(logits / c) (0 = off).
    attention_sinks: a learned logit per query head (`attention/sinks`
      [N], float32) joins every softmax's denominator with no value: each
      row's probabilities sum to less than 1 (GPT-OSS).
    attention_qkv_bias: the query, key and value projections have biases
      (`bias` [heads, D] beside each `kernel`).
    attention_out_bias: the output projection has a bias (`out/bias` [M]).
    attention_chunk: C > 0: the layers other than `full_attention_layers`
      attend in chunks (Llama-4): query i sees key j iff 0 <= i - j and
      both positions are in the same chunk of C (floor(i / C) = floor(j /
      C)); their KV cache keeps the last C positions. Not with a
      `sliding_window`.
    full_nope: the full-attention layers have no rotary embedding (NoPE,
      Llama-4's `no_rope_layers`).
    qk_norm_after_rope: RMS-normalise each query and key head without a
      weight (eps `norm_eps`) after the rotary embedding, on the layers
      that have one (Llama-4's `use_qk_norm`).
    attention_temperature_floor: F > 0: the full-attention layers multiply
      the query at position p by log1p(floor((p + 1) / F)) *
      `attention_temperature_scale` + 1 (Llama-4's temperature tuning of
      its NoPE layers); 0 = off.
    attention_temperature_scale: that scale (0 without a floor).
    attention: how attention is computed (the same function each way; a
      run field): "auto" (by platform and shape), "einsum" (the whole score
      matrix, the reference), "blockwise" (key / value blocks with an
      online softmax, memory linear in the sequence), "dot_product"
      (`jax.nn.dot_product_attention`, cuDNN on GPU) or "splash" (Pallas
      splash attention, TPU). See `linen_moe._src.models.attention`.

  Example usage:
    cfg = load_model_config("tiny_mixtral", scan_layers=False)
    bigger = cfg.replace(num_layers=4, num_experts=16)

  Raises:
    TypeError: if `moe` is not a `MoEConfig`.
    ValueError: naming the field, its value and what is allowed: e.g. a
      non-positive `vocab_size`, `num_layers` or `num_heads`, a negative
      width, a `num_kv_heads` that does not divide `num_heads`, a `num_heads`
      that does not divide `emb_dim` (when `head_dim` is 0), an odd head
      width, `dense_layers` out of range or repeated (or without a
      `dense_mlp_dim`), a flag that is not a bool, or a non-positive
      `norm_eps` / `rope_max_wavelength` <= 1.
  """

  moe: MoEConfig
  vocab_size: int = 256
  num_layers: int = 2
  num_heads: int = 4
  head_dim: int = 0
  rope_max_wavelength: float = 10_000.0
  router_input_norm: bool = False
  post_moe_norms: bool = False
  scan_layers: bool = run_field(True)
  scan_unroll: int = run_field(0)
  remat: str = run_field("none")
  remat_moe_rows: bool = run_field(True)
  REMAT_POLICIES: ClassVar[tuple[str, ...]] = REMAT_POLICIES
  norm_eps: float = 1e-6
  num_kv_heads: int = 0
  qk_norm: bool = False
  qk_norm_over_heads: bool = False
  tie_embeddings: bool = True
  scale_embeddings: bool = True
  sliding_window: int = 0
  dense_layers: tuple[int, ...] = ()
  dense_mlp_dim: int = 0
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleave: bool = False
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_original_max_len: int = 0
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_mscale: float = 0.0
  rope_mscale_all_dim: float = 0.0
  attention_scale: float = 0.0
  full_attention_layers: tuple[int, ...] = ()
  full_head_dim: int = 0
  full_kv_heads: int = 0
  full_rope_base: float = 0.0
  full_rope_fraction: float = 1.0
  full_k_eq_v: bool = False
  value_norm: bool = False
  post_attention_norm: bool = False
  post_mlp_norm: bool = False
  shared_pre_norm: bool = False
  layer_scalar: bool = False
  final_logit_softcap: float = 0.0
  rope_truncate: bool = True
  rotary_dim: int = 0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  attention_chunk: int = 0
  full_nope: bool = False
  qk_norm_after_rope: bool = False
  attention_temperature_floor: int = 0
  attention_temperature_scale: float = 0.0
  attention_sinks: bool = False
  attention_qkv_bias: bool = False
  attention_out_bias: bool = False
  attention: str = run_field("auto")

  def __post_init__(self):
    if not isinstance(self.moe, MoEConfig):
      raise TypeError(
          f"ModelConfig.moe must be a MoEConfig, got {type(self.moe)}"
      )
    check_positive_ints(self, ("vocab_size", "num_layers", "num_heads"))
    for name in (
        "head_dim",
        "num_kv_heads",
        "sliding_window",
        "dense_mlp_dim",
        "scan_unroll",
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        fail("ModelConfig", name, value, "expected an integer >= 0")
    if self.num_heads % self.resolved_kv_heads:
      fail(
          "ModelConfig",
          "num_kv_heads",
          self.num_kv_heads,
          f"must divide num_heads={self.num_heads}",
      )
    check_remat(self.remat, "ModelConfig.remat")
    self._check_dense_layers()
    decoder_fields.check(self, fail)
    mla = self.kv_lora_rank > 0  # MLA has head widths of its own
    if not mla and self.head_dim == 0 and self.moe.emb_dim % self.num_heads:
      fail(
          "ModelConfig",
          "num_heads",
          self.num_heads,
          f"must divide emb_dim={self.moe.emb_dim} when head_dim is 0",
      )
    if not mla and self.resolved_head_dim % 2:
      fail(
          "ModelConfig",
          "head_dim",
          self.resolved_head_dim,
          "RoPE needs an even head_dim",
      )
    for name in (
        "router_input_norm",
        "post_moe_norms",
        "scan_layers",
        "remat_moe_rows",
        "qk_norm",
        "tie_embeddings",
        "scale_embeddings",
    ):
      if not isinstance(getattr(self, name), bool):
        fail("ModelConfig", name, getattr(self, name), "expected a bool")
    for name, low in (("norm_eps", 0.0), ("rope_max_wavelength", 1.0)):
      value = getattr(self, name)
      if (
          isinstance(value, bool)
          or not isinstance(value, (int, float))
          or not math.isfinite(value)
          or value <= low
      ):
        fail("ModelConfig", name, value, f"expected a number > {low:g}")
    self._check_lora_rank()

  def _check_lora_rank(self) -> None:
    """A LoRA rank no larger than the smaller side of an adapted attention
    or dense-MLP kernel (the experts' are `MoEConfig`'s check)."""
    moe = self.moe
    m, kernels = moe.emb_dim, {}
    if moe.lora_on("mlp") and self.dense_layers:
      kernels["the dense MLP's wi_0"] = (m, self.dense_mlp_dim)
    if moe.lora_on("attention"):
      if self.kv_lora_rank:
        dq = self.qk_nope_head_dim + self.qk_rope_head_dim
        r, dr = self.kv_lora_rank, self.qk_rope_head_dim
        kernels["MLA's kv_a"] = (m, r + dr)
        kernels["MLA's kv_b"] = (
            r,
            self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
        )
        kernels["MLA's out"] = (self.num_heads * self.v_head_dim, m)
        if self.q_lora_rank:
          kernels["MLA's query_a"] = (m, self.q_lora_rank)
          kernels["MLA's query_b"] = (self.q_lora_rank, self.num_heads * dq)
        else:
          kernels["MLA's query"] = (m, self.num_heads * dq)
      else:
        d, kv = self.resolved_head_dim, self.resolved_kv_heads
        kernels["attention's key"] = (m, kv * d)
        kernels["attention's query"] = (m, self.num_heads * d)
        if self.full_attention_layers:
          fd = self.full_head_dim or d
          fkv = self.full_kv_heads or kv
          kernels["full attention's key"] = (m, fkv * fd)
    if kernels:
      lora_config.check_rank(moe.lora_rank, kernels, "ModelConfig")

  def _check_dense_layers(self) -> None:
    layers = self.dense_layers
    if not isinstance(layers, (tuple, list)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers
    ):
      fail("ModelConfig", "dense_layers", layers, "expected layer indices")
    layers = tuple(sorted(set(layers)))
    if len(layers) != len(self.dense_layers) or any(
        not 0 <= i < self.num_layers for i in layers
    ):
      fail(
          "ModelConfig",
          "dense_layers",
          self.dense_layers,
          f"expected distinct indices in [0, num_layers={self.num_layers})",
      )
    object.__setattr__(self, "dense_layers", layers)
    if layers and self.dense_mlp_dim <= 0:
      fail(
          "ModelConfig",
          "dense_mlp_dim",
          self.dense_mlp_dim,
          "must be positive when dense_layers is not empty",
      )

  @property
  def resolved_head_dim(self) -> int:
    """The attention head width: `head_dim`, or emb_dim // num_heads if 0."""
    return self.head_dim or self.moe.emb_dim // self.num_heads

  @property
  def resolved_kv_heads(self) -> int:
    """The key/value heads: `num_kv_heads`, or `num_heads` if 0."""
    return self.num_kv_heads or self.num_heads

  @property
  def block_kinds(self) -> tuple[tuple[str, bool], ...]:
    """Each layer's (MLP kind, full attention): what makes its block's
    variables differ from another's (`stack_plan` stacks equal ones)."""
    full = set(self.full_attention_layers)
    return tuple((k, i in full) for i, k in enumerate(self.layer_kinds))

  @property
  def layer_kinds(self) -> tuple[str, ...]:
    """Each layer's block: "dense" (a dense MLP) or "moe"."""
    dense = set(self.dense_layers)
    return tuple(
        "dense" if i in dense else "moe" for i in range(self.num_layers)
    )

  @property
  def stack_plan(self) -> StackPlan:
    """Where each layer's variables sit (`linen_moe._src.config.stack_plan`):
    scanned (runs of identical blocks stacked) or unrolled, per
    `scan_layers`."""
    return StackPlan.for_kinds(self.block_kinds, self.scan_layers)

  @property
  def shared_in_moe(self) -> bool:
    """Whether a block's `moe` is a `RoutedAndSharedMoE` (shared experts
    without post-MoE norms, DeepSeek / Qwen: `moe/routed_experts/`,
    `moe/shared_experts/`), rather than the routed layer itself beside the
    block's own `shared_experts/` (Gemma-4's post-MoE norms, or none)."""
    return self.moe.shared_experts > 0 and not self.post_moe_norms

  def replace(self, **changes: Any) -> ModelConfig:
    """Overrides fields of this config or of its `moe` (flat keyword names).

    Args:
      **changes: field name -> new value, for `ModelConfig` and `MoEConfig`
        fields alike (the deprecated names still work, with a warning).

    Returns:
      The new `ModelConfig`, validated.

    Raises:
      ValueError: if a key is no field of either config, or the result is
        invalid.
      TypeError: as the `ModelConfig` constructor.
    """
    changes = new_names("ModelConfig", changes)
    moe_fields = {f.name for f in dataclasses.fields(MoEConfig)}
    moe_changes = {k: v for k, v in changes.items() if k in moe_fields}
    own = {k: v for k, v in changes.items() if k not in moe_fields}
    check_keys(ModelConfig, own, extra=moe_fields)
    moe = self.moe.replace(**moe_changes) if moe_changes else self.moe
    return dataclasses.replace(self, moe=moe, **own)

  @staticmethod
  def run_fields() -> frozenset[str]:
    """The fields a resumed run may change (learning rate, steps, ...).

    Returns:
      The names of the `ModelConfig` and `MoEConfig` fields marked as run
      fields; every other field is the model, fixed by its checkpoint.
    """
    return frozenset(
        f.name
        for cls in (MoEConfig, ModelConfig)
        for f in dataclasses.fields(cls)
        if f.metadata.get("run")
    )


run_fields = ModelConfig.run_fields
