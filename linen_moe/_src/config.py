"""Frozen, validated configs for the MoE layer and the reference decoders.

A YAML file in `configs/` has two sections, `moe:` (the fields of `MoEConfig`)
and `decoder:` (the other fields of `ModelConfig`). `load_moe_config` returns
the `MoEConfig`; `load_model_config` returns the whole `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
from typing import TYPE_CHECKING
from typing import Any
import warnings

import yaml

# No jax at import: the command line's --help reads QUANTIZATIONS and
# available_configs(). The activations and grouped matmuls (which import
# jax) are read when a config is validated, the layer stack when asked for;
# the quantization modes' table and the traffic model import none.
from linen_moe._src import decoder_fields
from linen_moe._src import ep_traffic
from linen_moe._src.quantization_modes import QUANTIZATIONS
from linen_moe._src.quantization_modes import SERVING_QUANTIZATIONS

if TYPE_CHECKING:
  import jax.numpy as jnp

  from linen_moe._src import layer_stack

ROUTINGS = ("topk_then_softmax", "softmax_then_topk", "sigmoid_then_topk")
DROP_POLICIES = ("position", "probability")
EXPERT_PARALLEL_STRATEGIES = ep_traffic.STRATEGIES
FLOAT_DTYPES = ("float32", "bfloat16", "float16")

# The three matmul paths, as the config overrides that select each one. The
# dropping path's capacity factor of 1 gives every expert its fair share.
PATHS: dict[str, dict[str, Any]] = {
    "sparse": dict(sparse_matmul=True, capacity_factor=0.0),
    "dense": dict(sparse_matmul=False, capacity_factor=0.0),
    "dense_dropping": dict(sparse_matmul=False, capacity_factor=1.0),
}
# The tiny configs that train in seconds (tests, the matrix); the others are
# full-size shapes for shape and FLOP accounting.
TINY_CONFIGS = (
    "tiny_mixtral",
    "tiny_gemma4_26b",
    "tiny_deepseek_v3",
    "tiny_qwen3_moe",
)
# Tiny whole DeepSeek-V3 and Gemma-4 decoders (their attention and blocks,
# which the MoE-layer shapes above lack), derived from the Hugging Face
# fixtures (scripts/make_hf_configs.py).
FAMILY_CONFIGS = ("tiny_deepseek_v3_mla", "tiny_gemma4_text")


# Float fields (ints accepted, stored as floats); all must be finite.
_FLOAT_FIELDS = (
    "capacity_factor",
    "load_balance_loss_weight",
    "routed_scaling_factor",
    "routed_bias_update_rate",
    "router_z_loss_weight",
    "router_jitter",
)
_NON_NEGATIVE_FIELDS = (
    "load_balance_loss_weight",
    "routed_bias_update_rate",
    "router_z_loss_weight",
    "router_jitter",
)


# Old spellings of renamed fields: accepted (with a DeprecationWarning) by the
# constructors, `replace` and YAML files until linen_moe 0.3.
_RENAMED_FIELDS = {
    "weight_dtype": "param_dtype",
    "n_routing_groups": "num_routing_groups",
}


def _renamed(cls: str, old: str) -> str:
  new = _RENAMED_FIELDS[old]
  warnings.warn(
      f"{cls}.{old} is deprecated and goes in linen_moe 0.3; use {new}.",
      DeprecationWarning,
      stacklevel=4,
  )
  return new


def _new_names(cls: str, changes: dict[str, Any]) -> dict[str, Any]:
  return {
      (_renamed(cls, k) if k in _RENAMED_FIELDS else k): v
      for k, v in changes.items()
  }


# A field made with `_run(default)` says how the model is computed or trained,
# not what it is: a resumed run may change it (`run_fields()`). Every other
# field is the model itself (its shapes, routing and state) and must equal
# the checkpoint's, so a field added later counts as the model unless it says
# otherwise here.
def _run(default: Any) -> Any:
  return dataclasses.field(default=default, metadata={"run": True})


def _fail(cls: str, field: str, value: Any, allowed: str) -> None:
  raise ValueError(f"{cls}.{field}={value!r} is invalid: {allowed}.")


def _check_positive_ints(obj: Any, names: tuple[str, ...]) -> None:
  for name in names:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      _fail(type(obj).__name__, name, value, "expected a positive integer")


def _check_choice(obj: Any, name: str, allowed: tuple[str, ...]) -> None:
  value = getattr(obj, name)
  if value not in allowed:
    _fail(type(obj).__name__, name, value, f"allowed values are {allowed}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Every knob `RoutedMoE` reads.

  The fields that say how the layer is computed or trained rather than what
  it is (the path, quantization, dtype, loss weights, ...) are the ones a
  resumed run may change: `run_fields()` lists them. Every field is checked
  at construction.

  Example usage:
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=64,
                    moe_mlp_dim=128, quantization="int8")
    dense = cfg.replace(**PATHS["dense"])

  Raises:
    ValueError: naming the field, its value and what is allowed, for any
      invalid field or combination of fields.

  Attributes:
    num_experts: E, the number of routed experts.
    num_experts_per_tok: k, experts chosen per token (1 <= k <= E).
    emb_dim: M, the model (embedding) width.
    moe_mlp_dim: H, the hidden width of each routed expert.
    mlp_activations: (activated branch, linear branch). Experts compute
      `act(x @ wi_0) * (x @ wi_1) @ wo`; the second entry must be "linear".
      "gelu" is the tanh approximation (`jax.nn.gelu`), "gelu_exact" the erf.
    shared_experts: number of shared experts (0 = none). They are fused into
      one gated MLP of width `shared_experts * shared_mlp_dim`.
    shared_mlp_dim: hidden width of one shared expert.
    routing: "topk_then_softmax" (Mixtral: top-k of the logits, softmax over
      the chosen ones), "softmax_then_topk" (softmax over all experts, then
      top-k, renormalised when `norm_topk_prob`) or "sigmoid_then_topk"
      (DeepSeek-V3: sigmoid of each logit, top-k, the chosen sigmoids
      renormalised when `norm_topk_prob`).
    norm_topk_prob: renormalise the chosen weights to sum to 1 (read by
      "softmax_then_topk" and "sigmoid_then_topk"; "topk_then_softmax"
      always sums to 1).
    routed_scaling_factor: multiplies every routing weight (after
      renormalisation), for every routing; DeepSeek-V3 uses 2.5.
    num_routing_groups: G (was `n_routing_groups`, which still works until
      0.3, with a DeprecationWarning); the experts form G contiguous groups of E / G and
      a token may only choose experts in its `topk_routing_group` best groups,
      a group scoring the sum of its two highest selection scores (1 = off).
    topk_routing_group: the number of groups a token may choose from
      (1 <= topk_routing_group <= num_routing_groups).
    routed_bias: keep a `[E]` selection-only bias `routed_bias` (collection
      `updated_by_rule`, initialised to 0): added to the selection score
      (logits, softmax or sigmoid of the routing) to choose experts, never
      to the weights (aux-loss-free load balancing).
    routed_bias_update_rate: after each optimizer step the train step moves
      the bias by `rate * sign(mean_load - load_e)` (0 = frozen).
    router_z_loss_weight: weight of the ST-MoE router z-loss, the mean over
      tokens of `logsumexp(logits) ** 2` (0 = off).
    router_jitter: eps; the router input is multiplied by uniform noise in
      `[1 - eps, 1 + eps]` drawn from the `router_jitter` RNG stream, only
      when that stream is given (the train steps give it; 0 = off).
    per_expert_scale: learn a `[E]` scale multiplied into routing weights.
    capacity_factor: dense path only; `<= 0` means dropless, else each expert
      takes at most `ceil(capacity_factor * seq * k / E)` tokens per sequence.
    drop_policy: which assignments keep an expert's capacity slots on the
      dropping dense path: "position" (all first choices in token order,
      then all second choices, ...) or "probability" (highest routing weight
      first, ties in "position" order).
    sparse_matmul: True for the sparse (sort + grouped matmul) path, False for
      the dense einsum path.
    grouped_matmul: implementation of the sparse path's grouped matmul.
    expert_parallel: how the sparse path moves tokens to experts under a
      mesh whose expert axes split the batch: "all_gather" (every token to
      every expert shard, outputs reduce-scattered), "ragged_all_to_all"
      (each assignment only to the device holding its expert, and back) or
      "auto" (the one `linen_moe._src.ep_traffic` models as cheaper; always
      "all_gather" on a CPU, where the ragged exchange is emulated). Both
      compute the same outputs and gradients.
    dtype: activation / compute dtype name.
    param_dtype: parameter storage dtype name (was `weight_dtype`, which
      still works until 0.3, with a DeprecationWarning).
    load_balance_loss_weight: weight of the Switch load-balance loss (0 = off).
    quantization: "none", "int8" (AQT), "fp8" or "nanoo_fp8"; what each
      quantizes, stores and needs is `linen_moe._src.quantization_modes`.
    fp8_amax_history_length: length of each fp8 amax history.
    serving: True for a serving layer: the expert kernels are stored converted
      to the storage type of `quantization` (its `storage_dtype`: int8,
      float8_e4m3fn or float8_e4m3fnuz) with their scales, as `linen_moe.serving.
      quantize_weights` returns them (and the config it returns sets this),
      and the layer runs inference from them. Needs a quantized mode.
  """

  num_experts: int
  num_experts_per_tok: int
  emb_dim: int
  moe_mlp_dim: int
  mlp_activations: tuple[str, ...] = ("silu", "linear")
  shared_experts: int = 0
  shared_mlp_dim: int = 0
  routing: str = "topk_then_softmax"
  norm_topk_prob: bool = False
  routed_scaling_factor: float = 1.0
  num_routing_groups: int = 1
  topk_routing_group: int = 1
  routed_bias: bool = False
  routed_bias_update_rate: float = _run(0.0)
  router_z_loss_weight: float = _run(0.0)
  router_jitter: float = _run(0.0)
  per_expert_scale: bool = False
  capacity_factor: float = _run(0.0)
  drop_policy: str = _run("position")
  sparse_matmul: bool = _run(True)
  grouped_matmul: str = _run("auto")
  expert_parallel: str = _run("auto")
  dtype: str = _run("float32")
  param_dtype: str = "float32"
  load_balance_loss_weight: float = _run(0.01)
  quantization: str = _run("none")
  fp8_amax_history_length: int = _run(1024)
  serving: bool = False
  # Deprecated spellings, accepted until 0.3 (see _RENAMED_FIELDS).
  weight_dtype: dataclasses.InitVar[str | None] = None
  n_routing_groups: dataclasses.InitVar[int | None] = None

  def __post_init__(self, weight_dtype=None, n_routing_groups=None):
    cls = type(self).__name__
    for old, value in (
        ("weight_dtype", weight_dtype),
        ("n_routing_groups", n_routing_groups),
    ):
      if value is not None:
        object.__setattr__(self, _renamed(cls, old), value)
    _check_positive_ints(
        self,
        (
            "num_experts",
            "num_experts_per_tok",
            "emb_dim",
            "moe_mlp_dim",
            "fp8_amax_history_length",
        ),
    )
    if self.num_experts_per_tok > self.num_experts:
      _fail(
          cls,
          "num_experts_per_tok",
          self.num_experts_per_tok,
          f"must be <= num_experts={self.num_experts}",
      )
    from linen_moe._src import activations  # noqa: PLC0415 (imports jax)
    from linen_moe._src import grouped_matmul  # noqa: PLC0415 (imports jax)

    acts = tuple(self.mlp_activations)
    object.__setattr__(self, "mlp_activations", acts)
    names = tuple(activations.ACTIVATIONS)
    if len(acts) != 2 or acts[0] not in names or acts[1] != "linear":
      _fail(
          cls,
          "mlp_activations",
          acts,
          f"expected (activation, 'linear') with activation in {names}",
      )
    for name in ("shared_experts", "shared_mlp_dim"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _fail(cls, name, value, "expected a non-negative integer")
    if self.shared_experts > 0 and self.shared_mlp_dim <= 0:
      _fail(
          cls,
          "shared_mlp_dim",
          self.shared_mlp_dim,
          "must be positive when shared_experts > 0",
      )
    _check_choice(self, "routing", ROUTINGS)
    _check_choice(self, "quantization", QUANTIZATIONS)
    _check_choice(self, "grouped_matmul", grouped_matmul.IMPLEMENTATIONS)
    _check_choice(self, "expert_parallel", EXPERT_PARALLEL_STRATEGIES)
    _check_choice(self, "dtype", FLOAT_DTYPES)
    _check_choice(self, "param_dtype", FLOAT_DTYPES)
    for name in _FLOAT_FIELDS:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(cls, name, value, "expected a number")
      if not math.isfinite(value):
        _fail(cls, name, value, "expected a finite number")
      object.__setattr__(self, name, float(value))
    for name in _NON_NEGATIVE_FIELDS:
      if getattr(self, name) < 0:
        _fail(cls, name, getattr(self, name), "expected >= 0")
    for name in (
        "norm_topk_prob",
        "routed_bias",
        "per_expert_scale",
        "sparse_matmul",
        "serving",
    ):
      if not isinstance(getattr(self, name), bool):
        _fail(cls, name, getattr(self, name), "expected a bool")
    if self.serving and self.quantization not in SERVING_QUANTIZATIONS:
      _fail(
          cls,
          "serving",
          self.serving,
          "a serving layer stores its expert weights in a quantized mode "
          f"{SERVING_QUANTIZATIONS}, but quantization={self.quantization!r}",
      )
    self._check_routing()
    if self.sparse_matmul and self.capacity_factor > 0:
      _fail(
          cls,
          "capacity_factor",
          self.capacity_factor,
          "token dropping needs the dense path (sparse_matmul=False); the "
          "sparse path is always dropless, so use capacity_factor <= 0",
      )

  def _check_routing(self) -> None:
    """The routing fields beyond the choice of `routing` (numbers already
    checked to be finite, flags to be bools)."""
    cls = type(self).__name__
    _check_choice(self, "drop_policy", DROP_POLICIES)
    if self.routed_scaling_factor <= 0:
      _fail(
          cls,
          "routed_scaling_factor",
          self.routed_scaling_factor,
          "expected > 0",
      )
    if self.router_jitter >= 1:
      _fail(cls, "router_jitter", self.router_jitter, "expected 0 <= eps < 1")
    if self.routed_bias_update_rate > 0 and not self.routed_bias:
      _fail(
          cls,
          "routed_bias_update_rate",
          self.routed_bias_update_rate,
          "a non-zero rate needs routed_bias=True",
      )
    _check_positive_ints(self, ("num_routing_groups", "topk_routing_group"))
    e, g, t = self.num_experts, self.num_routing_groups, self.topk_routing_group
    if e % g:
      _fail(cls, "num_routing_groups", g, f"must divide num_experts={e}")
    if g > 1 and e // g < 2:
      _fail(
          cls,
          "num_routing_groups",
          g,
          "groups need >= 2 experts each (a group scores its two highest); "
          f"num_experts={e}",
      )
    if t > g:
      _fail(cls, "topk_routing_group", t, f"must be <= num_routing_groups={g}")
    if self.num_experts_per_tok > t * e // g:
      _fail(
          cls,
          "num_experts_per_tok",
          self.num_experts_per_tok,
          "must be <= topk_routing_group * num_experts / num_routing_groups "
          f"= {t * e // g} (the experts of the chosen groups)",
      )

  @property
  def compute_dtype(self) -> jnp.dtype:
    """Deprecated (until 0.3): `jnp.dtype(config.dtype)`."""
    warnings.warn(
        "MoEConfig.compute_dtype is deprecated and goes in linen_moe 0.3; use"
        " jnp.dtype(config.dtype).",
        DeprecationWarning,
        stacklevel=2,
    )
    import jax.numpy as jnp  # noqa: PLC0415

    return jnp.dtype(self.dtype)

  @property
  def dropping(self) -> bool:
    """Whether tokens may be dropped: the dense path, capacity_factor > 0."""
    return not self.sparse_matmul and self.capacity_factor > 0

  @property
  def path(self) -> str:
    """One of "sparse", "dense", "dense_dropping"."""
    if self.sparse_matmul:
      return "sparse"
    return "dense_dropping" if self.dropping else "dense"

  def replace(self, **changes: Any) -> MoEConfig:
    """A copy with some fields changed, validated like a new config.

    Args:
      **changes: field name -> new value (the deprecated names still work,
        with a DeprecationWarning).

    Returns:
      The new `MoEConfig`.

    Raises:
      ValueError: if a key is not a field, or the result is invalid.
    """
    changes = _new_names("MoEConfig", changes)
    _check_keys(type(self), changes)
    return dataclasses.replace(self, **changes)


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
      the layers outside it unrolled (`stack_plan`).
    norm_eps: RMSNorm epsilon.
    num_kv_heads: key/value heads of grouped-query attention (0 =
      num_heads); it divides num_heads, and key/value head j serves the
      consecutive query heads j * G .. j * G + G - 1, G = num_heads /
      num_kv_heads.
    qk_norm: RMS-normalise each query and key head (a learned [head_dim]
      scale each, eps `norm_eps`) before the rotary embedding (Qwen3).
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
    rope_type: "default" or "yarn" (YaRN's frequencies and cos / sin factor,
      transformers' `_compute_yarn_parameters`).
    rope_factor: YaRN's context extension factor (s > 1).
    rope_original_max_len: YaRN: the pretraining context length.
    rope_beta_fast: YaRN: rotations below which a frequency is interpolated.
    rope_beta_slow: YaRN: rotations above which a frequency is kept.
    rope_mscale: YaRN's `mscale` m and
    rope_mscale_all_dim: its `mscale_all_dim` m': cos and sin are multiplied
      by g(m) / g(m') when both are set, else by g(1), g(x) = 0.1 x
      ln(rope_factor) + 1 (0 = not set). MLA also multiplies its softmax
      scale by g(m') ** 2 (DeepSeek's correction).
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
  scan_layers: bool = _run(True)
  norm_eps: float = 1e-6
  num_kv_heads: int = 0
  qk_norm: bool = False
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

  def __post_init__(self):
    if not isinstance(self.moe, MoEConfig):
      raise TypeError(
          f"ModelConfig.moe must be a MoEConfig, got {type(self.moe)}"
      )
    _check_positive_ints(self, ("vocab_size", "num_layers", "num_heads"))
    for name in ("head_dim", "num_kv_heads", "sliding_window", "dense_mlp_dim"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _fail("ModelConfig", name, value, "expected an integer >= 0")
    if self.num_heads % self.resolved_kv_heads:
      _fail(
          "ModelConfig",
          "num_kv_heads",
          self.num_kv_heads,
          f"must divide num_heads={self.num_heads}",
      )
    self._check_dense_layers()
    decoder_fields.check(self, _fail)
    mla = self.kv_lora_rank > 0  # MLA has head widths of its own
    if not mla and self.head_dim == 0 and self.moe.emb_dim % self.num_heads:
      _fail(
          "ModelConfig",
          "num_heads",
          self.num_heads,
          f"must divide emb_dim={self.moe.emb_dim} when head_dim is 0",
      )
    if not mla and self.resolved_head_dim % 2:
      _fail(
          "ModelConfig",
          "head_dim",
          self.resolved_head_dim,
          "RoPE needs an even head_dim",
      )
    for name in (
        "router_input_norm",
        "post_moe_norms",
        "scan_layers",
        "qk_norm",
        "tie_embeddings",
        "scale_embeddings",
    ):
      if not isinstance(getattr(self, name), bool):
        _fail("ModelConfig", name, getattr(self, name), "expected a bool")
    for name, low in (("norm_eps", 0.0), ("rope_max_wavelength", 1.0)):
      value = getattr(self, name)
      if (
          isinstance(value, bool)
          or not isinstance(value, (int, float))
          or not math.isfinite(value)
          or value <= low
      ):
        _fail("ModelConfig", name, value, f"expected a number > {low:g}")

  def _check_dense_layers(self) -> None:
    layers = self.dense_layers
    if not isinstance(layers, (tuple, list)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers
    ):
      _fail("ModelConfig", "dense_layers", layers, "expected layer indices")
    layers = tuple(sorted(set(layers)))
    if len(layers) != len(self.dense_layers) or any(
        not 0 <= i < self.num_layers for i in layers
    ):
      _fail(
          "ModelConfig",
          "dense_layers",
          self.dense_layers,
          f"expected distinct indices in [0, num_layers={self.num_layers})",
      )
    object.__setattr__(self, "dense_layers", layers)
    if layers and self.dense_mlp_dim <= 0:
      _fail(
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
  def stack_plan(self) -> layer_stack.StackPlan:
    """Where each layer's variables sit (`linen_moe._src.layer_stack`):
    scanned (runs of identical blocks stacked) or unrolled, per
    `scan_layers`."""
    from linen_moe._src import layer_stack  # noqa: PLC0415

    return layer_stack.StackPlan.for_kinds(self.block_kinds, self.scan_layers)

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
    changes = _new_names("ModelConfig", changes)
    moe_fields = {f.name for f in dataclasses.fields(MoEConfig)}
    moe_changes = {k: v for k, v in changes.items() if k in moe_fields}
    own = {k: v for k, v in changes.items() if k not in moe_fields}
    _check_keys(ModelConfig, own, extra=moe_fields)
    moe = self.moe.replace(**moe_changes) if moe_changes else self.moe
    return dataclasses.replace(self, moe=moe, **own)


def run_fields() -> frozenset[str]:
  """The `MoEConfig` and `ModelConfig` fields a resumed run may change."""
  return frozenset(
      f.name
      for cls in (MoEConfig, ModelConfig)
      for f in dataclasses.fields(cls)
      if f.metadata.get("run")
  )


def _check_keys(cls: type, changes: dict[str, Any], extra=frozenset()) -> None:
  allowed = {f.name for f in dataclasses.fields(cls)} | set(extra)
  unknown = sorted(set(changes) - allowed)
  if unknown:
    raise ValueError(
        f"Unknown {cls.__name__} key(s) {unknown}; allowed keys are "
        f"{sorted(allowed)}."
    )


def available_configs() -> list[str]:
  """Names of the YAML configs shipped with the package.

  Returns:
    The names, sorted, without ".yml" (what `load_model_config` takes).
  """
  root = importlib.resources.files("linen_moe.configs")
  return sorted(p.name[:-4] for p in root.iterdir() if p.name.endswith(".yml"))


def _read_yaml(name_or_path: str | os.PathLike) -> dict[str, Any]:
  path = os.fspath(name_or_path)
  if os.path.sep in path or path.endswith((".yml", ".yaml")):
    if not os.path.exists(path):
      raise ValueError(f"Config file {path!r} does not exist.")
    with open(path, encoding="utf-8") as f:
      data = yaml.safe_load(f)
  else:
    resource = importlib.resources.files("linen_moe.configs") / f"{path}.yml"
    if not resource.is_file():
      raise ValueError(
          f"Unknown config name {path!r}; available: {available_configs()} "
          "(or pass a path to a .yml file)."
      )
    data = yaml.safe_load(resource.read_text(encoding="utf-8"))
  if not isinstance(data, dict) or "moe" not in data:
    raise ValueError(f"Config {path!r} must be a mapping with a 'moe' section.")
  unknown = sorted(set(data) - {"moe", "decoder"})
  if unknown:
    raise ValueError(
        f"Config {path!r} has unknown section(s) {unknown}; allowed: "
        "['decoder', 'moe']."
    )
  return data


def _moe_from_dict(data: dict[str, Any]) -> MoEConfig:
  data = _new_names("MoEConfig", data)
  _check_keys(MoEConfig, data)
  return MoEConfig(**data)


def load_model_config(
    name_or_path: str | os.PathLike, **overrides: Any
) -> ModelConfig:
  """Reads a YAML config (a shipped name or a path) into a `ModelConfig`.

  Args:
    name_or_path: a name from `available_configs()`, or the path of a .yml /
      .yaml file (anything with a path separator or that suffix).
    **overrides: flat keyword names of `ModelConfig` or `MoEConfig` fields,
      applied after the file.

  Returns:
    The validated `ModelConfig`.

  Raises:
    ValueError: if the file does not exist or the name is unknown, the file
      is not a mapping with a `moe:` section (and at most a `decoder:` one),
      a key is no field (or `decoder:` holds `moe`), or a value is invalid.
    TypeError: as the `ModelConfig` constructor.
  """
  data = _read_yaml(name_or_path)
  moe = _moe_from_dict(dict(data["moe"] or {}))
  decoder = dict(data.get("decoder") or {})
  _check_keys(ModelConfig, decoder)
  if "moe" in decoder:
    raise ValueError("The 'decoder' section may not contain 'moe'.")
  return ModelConfig(moe=moe, **decoder).replace(**overrides)


def load_moe_config(
    name_or_path: str | os.PathLike, **overrides: Any
) -> MoEConfig:
  """Reads the `moe:` section of a YAML config into a validated `MoEConfig`.

  Example usage:
    cfg = load_moe_config("tiny_mixtral", quantization="int8")

  Args:
    name_or_path: a name from `available_configs()`, or a .yml / .yaml path.
    **overrides: `MoEConfig` field names, applied over the file's values.

  Returns:
    The validated `MoEConfig` (the file's decoder section is ignored).

  Raises:
    ValueError: if the file does not exist or the name is unknown, it is not
      a mapping with a `moe:` section, a key is no `MoEConfig` field, or a
      value is invalid.
  """
  data = _read_yaml(name_or_path)
  merged = _new_names("MoEConfig", dict(data["moe"] or {}))
  overrides = _new_names("MoEConfig", overrides)
  _check_keys(MoEConfig, overrides)
  merged.update(overrides)
  return _moe_from_dict(merged)


def load_config(name_or_path: str | os.PathLike, **overrides: Any) -> MoEConfig:
  """Deprecated (until 0.3): `load_moe_config`, under a name too close to
  `load_model_config`'s."""
  warnings.warn(
      "linen_moe.load_config is deprecated and goes in linen_moe 0.3; use"
      " load_moe_config (the MoE layer's config) or load_model_config (the"
      " whole decoder's).",
      DeprecationWarning,
      stacklevel=2,
  )
  return load_moe_config(name_or_path, **overrides)
