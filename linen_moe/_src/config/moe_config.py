"""The MoE layer's frozen, validated config, and the facts configs share.

`MoEConfig` is the layer's config; the reference decoder's `ModelConfig`
(`model_config.py`) holds one; `config_files.py` reads both from YAML. Here
too: the choices a field may take (`ROUTINGS`, `MATMUL_PATHS`, `TINY_CONFIGS`, ...)
and the checks and renames both configs use.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING
from typing import Any

# No jax at import or validation: the command line's --help reads
# MODES, available_configs() and which config has a Hugging Face
# form. The activation and grouped-matmul names come from modules that
# import no jax (the functions load it on first use), the layer stack when
# asked for; the quantization modes' table and the traffic model import
# none.
from linen_moe._src import deprecation
from linen_moe._src.config import activations
from linen_moe._src.config import lora as lora_config
from linen_moe._src.config.checks import check_choice
from linen_moe._src.config.checks import check_keys
from linen_moe._src.config.checks import check_positive_ints
from linen_moe._src.config.checks import fail
from linen_moe._src.config.checks import new_names
from linen_moe._src.config.checks import run_field
from linen_moe._src.config.quantization_modes import MODES
from linen_moe._src.config.quantization_modes import SERVING_MODES
from linen_moe._src.deprecation import renamed_field
from linen_moe._src.kernels import implementations
from linen_moe._src.parallel import ep_traffic

if TYPE_CHECKING:
  import jax.numpy as jnp


ROUTINGS = (
    "topk_then_softmax",
    "softmax_then_topk",
    "sigmoid_then_topk",
    "topk_then_sigmoid",
)
DROP_POLICIES = ("position", "probability")
EXPERT_PARALLEL_STRATEGIES = ep_traffic.STRATEGIES
FLOAT_DTYPES = ("float32", "bfloat16", "float16")

# The three matmul paths, as the config overrides that select each one. The
# dropping path's capacity factor of 1 gives every expert its fair share.
MATMUL_PATHS: dict[str, dict[str, Any]] = {
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
# Tiny whole decoders of the Hugging Face families (their attention and
# blocks, which the MoE-layer shapes above lack), derived from the Hugging
# Face fixtures (scripts/make_hf_configs.py).
FAMILY_CONFIGS = (
    "tiny_deepseek_v3_mla",
    "tiny_gemma4_text",
    "tiny_gpt_oss",
    "tiny_llama4",
    "tiny_glm4_moe",
    "tiny_minimax_m2",
)


# Float fields (ints accepted, stored as floats); all must be finite.
_FLOAT_FIELDS = (
    "capacity_factor",
    "load_balance_loss_weight",
    "routed_scaling_factor",
    "routed_bias_update_rate",
    "router_z_loss_weight",
    "router_jitter",
    "swiglu_alpha",
    "swiglu_limit",
)
_NON_NEGATIVE_FIELDS = (
    "load_balance_loss_weight",
    "routed_bias_update_rate",
    "router_z_loss_weight",
    "router_jitter",
)


def check_serving(serving: bool, quantization: str, owner: str = "") -> None:
  """The serving rule, checked here only: a serving layer stores its expert
  kernels converted to its mode's storage type, so `serving=True` needs a
  mode that has one (`SERVING_MODES`).

  `MoEConfig` checks its fields with it at construction; code that takes the
  two as arguments (e.g. `load_checkpoint`) asks it before any work.

  Args:
    serving: the `serving` flag.
    quantization: a mode name (a key of `MODES`).
    owner: whose fields they are in the message ("MoEConfig" names
      `MoEConfig.serving`); "" for a function's arguments.

  Raises:
    ValueError: naming `serving`, its value and the modes allowed with it,
      when `serving` is true and `quantization` stores no weights.
  """
  if serving and quantization not in SERVING_MODES:
    field = f"{owner}.serving" if owner else "serving"
    raise ValueError(
        f"{field}={serving!r} is invalid: a serving layer stores its expert "
        f"weights in a quantized mode {SERVING_MODES}, but "
        f"quantization={quantization!r}."
    )


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
    dense = cfg.replace(**MATMUL_PATHS["dense"])

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
      "gelu" is the tanh approximation (`jax.nn.gelu`), "gelu_exact" the erf;
      "clamped_swiglu" is GPT-OSS's g * sigmoid(alpha g) * (u + 1) with g
      clamped to <= limit and u to [-limit, limit] (`swiglu_alpha`,
      `swiglu_limit`).
    swiglu_alpha: "clamped_swiglu"'s sigmoid gain (1 for any other).
    swiglu_limit: "clamped_swiglu"'s clamp, > 0 (0 for any other).
    shared_experts: number of shared experts (0 = none). They are fused into
      one gated MLP of width `shared_experts * shared_mlp_dim`.
    shared_mlp_dim: hidden width of one shared expert.
    routing: "topk_then_softmax" (Mixtral: top-k of the logits, softmax over
      the chosen ones), "softmax_then_topk" (softmax over all experts, then
      top-k, renormalised when `norm_topk_prob`) or "sigmoid_then_topk"
      (DeepSeek-V3: sigmoid of each logit, top-k, the chosen sigmoids
      renormalised when `norm_topk_prob`) or "topk_then_sigmoid" (Llama-4:
      top-k of the logits, the sigmoid of each chosen one, renormalised
      when `norm_topk_prob`).
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
    router_bias: the router has a bias `gate/bias` [E], added to its logits
      (so to the choice and the weights alike; GPT-OSS).
    weights_on_input: the routing weight multiplies the expert's input
      instead of its output (Llama-4: expert(w x), not w expert(x)); needs
      one expert per token.
    expert_bias: each routed expert's projections have biases:
      `wi_0_bias`, `wi_1_bias` [E, H] and `wo_bias` [E, M], added after
      each contraction (the down bias inside the routing weight's product,
      as the expert's output).
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
      "auto" (the one `linen_moe._src.parallel.ep_traffic` models as cheaper; always
      "all_gather" on a CPU, where the ragged exchange is emulated). Both
      compute the same outputs and gradients.
    dtype: activation / compute dtype name.
    param_dtype: parameter storage dtype name (was `weight_dtype`, which
      still works until 0.3, with a DeprecationWarning).
    load_balance_loss_weight: weight of the Switch load-balance loss (0 = off).
    quantization: "none", "int8" (AQT), "fp8" or "nanoo_fp8"; what each
      quantizes, stores and needs is `linen_moe._src.config.quantization_modes`.
    fp8_amax_history_length: length of each fp8 amax history.
    serving: True for a serving layer: the expert kernels are stored converted
      to the storage type of `quantization` (its `storage_dtype`: int8,
      float8_e4m3fn or float8_e4m3fnuz) with their scales, as
      `linen_moe.quantization.quantize_weights` returns them (and the config it returns sets this),
      and the layer runs inference from them. Needs a mode that stores
      weights (`SERVING_MODES`; the rule is `check_serving`).
    lora_rank: r >= 1 puts low-rank adapters on the `lora_targets` kernels
      (`linen_moe.lora`); 0 (the default): none. At most the smaller side
      of every adapted kernel.
    lora_alpha: the adapters' scale is lora_alpha / lora_rank (0 = rank).
    lora_targets: what gets adapters, names from `linen_moe.lora.TARGETS`:
      "experts" (the routed experts), "shared" (the shared experts), "mlp"
      (the dense layers' MLP), "attention" (every attention projection).
    lora_dropout: dropout rate on the adapters' input, in [0, 1), drawn
      from the "params" RNG stream (training only).
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
  routed_bias_update_rate: float = run_field(0.0)
  router_z_loss_weight: float = run_field(0.0)
  router_jitter: float = run_field(0.0)
  per_expert_scale: bool = False
  router_bias: bool = False
  weights_on_input: bool = False
  expert_bias: bool = False
  swiglu_alpha: float = 1.0
  swiglu_limit: float = 0.0
  capacity_factor: float = run_field(0.0)
  drop_policy: str = run_field("position")
  sparse_matmul: bool = run_field(True)
  grouped_matmul: str = run_field("auto")
  expert_parallel: str = run_field("auto")
  dtype: str = run_field("float32")
  param_dtype: str = "float32"
  load_balance_loss_weight: float = run_field(0.01)
  quantization: str = run_field("none")
  fp8_amax_history_length: int = run_field(1024)
  serving: bool = False
  lora_rank: int = 0
  lora_alpha: float = 0.0
  lora_targets: tuple[str, ...] = lora_config.TARGETS
  lora_dropout: float = run_field(0.0)
  # Deprecated spellings, accepted until 0.3 (`deprecation.RENAMED_FIELDS`).
  weight_dtype: dataclasses.InitVar[str | None] = None
  n_routing_groups: dataclasses.InitVar[int | None] = None

  def __post_init__(self, weight_dtype=None, n_routing_groups=None):
    cls = type(self).__name__
    for old, value in (
        ("weight_dtype", weight_dtype),
        ("n_routing_groups", n_routing_groups),
    ):
      if value is not None:
        object.__setattr__(self, renamed_field(cls, old), value)
    check_positive_ints(
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
      fail(
          cls,
          "num_experts_per_tok",
          self.num_experts_per_tok,
          f"must be <= num_experts={self.num_experts}",
      )
    acts = tuple(self.mlp_activations)
    object.__setattr__(self, "mlp_activations", acts)
    names = activations.NAMES
    if len(acts) != 2 or acts[0] not in names or acts[1] != "linear":
      fail(
          cls,
          "mlp_activations",
          acts,
          f"expected (activation, 'linear') with activation in {names}",
      )
    for name in ("shared_experts", "shared_mlp_dim"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        fail(cls, name, value, "expected a non-negative integer")
    if self.shared_experts > 0 and self.shared_mlp_dim <= 0:
      fail(
          cls,
          "shared_mlp_dim",
          self.shared_mlp_dim,
          "must be positive when shared_experts > 0",
      )
    check_choice(self, "routing", ROUTINGS)
    check_choice(self, "quantization", tuple(MODES))
    check_choice(self, "grouped_matmul", implementations.IMPLEMENTATIONS)
    check_choice(self, "expert_parallel", EXPERT_PARALLEL_STRATEGIES)
    check_choice(self, "dtype", FLOAT_DTYPES)
    check_choice(self, "param_dtype", FLOAT_DTYPES)
    for name in _FLOAT_FIELDS:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(cls, name, value, "expected a number")
      if not math.isfinite(value):
        fail(cls, name, value, "expected a finite number")
      object.__setattr__(self, name, float(value))
    for name in _NON_NEGATIVE_FIELDS:
      if getattr(self, name) < 0:
        fail(cls, name, getattr(self, name), "expected >= 0")
    for name in (
        "norm_topk_prob",
        "routed_bias",
        "per_expert_scale",
        "router_bias",
        "weights_on_input",
        "expert_bias",
        "sparse_matmul",
        "serving",
    ):
      if not isinstance(getattr(self, name), bool):
        fail(cls, name, getattr(self, name), "expected a bool")
    check_serving(self.serving, self.quantization, cls)
    self._check_swiglu()
    self._check_routing()
    self._check_lora()
    if self.sparse_matmul and self.capacity_factor > 0:
      fail(
          cls,
          "capacity_factor",
          self.capacity_factor,
          "token dropping needs the dense path (sparse_matmul=False); the "
          "sparse path is always dropless, so use capacity_factor <= 0",
      )

  def _check_swiglu(self) -> None:
    """`swiglu_alpha` and `swiglu_limit`: read by "clamped_swiglu" only,
    so at their defaults with any other activation."""
    cls = type(self).__name__
    if self.mlp_activations[0] == "clamped_swiglu":
      for name in ("swiglu_alpha", "swiglu_limit"):
        if getattr(self, name) <= 0:
          fail(cls, name, getattr(self, name), "expected > 0")
      return
    for name, default in (("swiglu_alpha", 1.0), ("swiglu_limit", 0.0)):
      if getattr(self, name) != default:
        fail(
            cls,
            name,
            getattr(self, name),
            f"read only by the 'clamped_swiglu' activation; {default:g} "
            f"with {self.mlp_activations[0]!r}",
        )

  def _check_routing(self) -> None:
    """The routing fields beyond the choice of `routing` (numbers already
    checked to be finite, flags to be bools)."""
    cls = type(self).__name__
    check_choice(self, "drop_policy", DROP_POLICIES)
    if self.routed_scaling_factor <= 0:
      fail(
          cls,
          "routed_scaling_factor",
          self.routed_scaling_factor,
          "expected > 0",
      )
    if self.router_jitter >= 1:
      fail(cls, "router_jitter", self.router_jitter, "expected 0 <= eps < 1")
    if self.routed_bias_update_rate > 0 and not self.routed_bias:
      fail(
          cls,
          "routed_bias_update_rate",
          self.routed_bias_update_rate,
          "a non-zero rate needs routed_bias=True",
      )
    if self.weights_on_input and self.num_experts_per_tok != 1:
      fail(
          cls,
          "weights_on_input",
          self.weights_on_input,
          "the weight scales the one chosen expert's input: needs "
          f"num_experts_per_tok=1, not {self.num_experts_per_tok}",
      )
    check_positive_ints(self, ("num_routing_groups", "topk_routing_group"))
    e, g, t = self.num_experts, self.num_routing_groups, self.topk_routing_group
    if e % g:
      fail(cls, "num_routing_groups", g, f"must divide num_experts={e}")
    if g > 1 and e // g < 2:
      fail(
          cls,
          "num_routing_groups",
          g,
          "groups need >= 2 experts each (a group scores its two highest); "
          f"num_experts={e}",
      )
    if t > g:
      fail(cls, "topk_routing_group", t, f"must be <= num_routing_groups={g}")
    if self.num_experts_per_tok > t * e // g:
      fail(
          cls,
          "num_experts_per_tok",
          self.num_experts_per_tok,
          "must be <= topk_routing_group * num_experts / num_routing_groups "
          f"= {t * e // g} (the experts of the chosen groups)",
      )

  def _check_lora(self) -> None:
    """The LoRA fields (`lora_config.check`), and a rank no larger than the
    smaller side of an adapted expert kernel."""
    cls = type(self).__name__
    targets = self.lora_targets
    if isinstance(targets, list):
      targets = tuple(targets)
      object.__setattr__(self, "lora_targets", targets)
    rank = self.lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
      fail(cls, "lora_rank", rank, "an integer >= 0 (0 = no adapters)")
    if rank == 0:
      return
    lora_config.check(
        rank, self.lora_alpha, targets, self.lora_dropout, cls, "lora_"
    )
    kernels = {}
    if "experts" in targets:
      kernels["the routed experts' wi_0"] = (self.emb_dim, self.moe_mlp_dim)
    if "shared" in targets and self.shared_experts:
      width = self.shared_experts * self.shared_mlp_dim
      kernels["the shared experts' wi_0"] = (self.emb_dim, width)
    lora_config.check_rank(rank, kernels, cls)

  @property
  def lora(self) -> lora_config.LoRAConfig | None:
    """The adapters' `LoRAConfig`, or None when `lora_rank` is 0."""
    if not self.lora_rank:
      return None
    return lora_config.LoRAConfig(
        self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_dropout
    )

  def lora_on(self, target: str) -> lora_config.LoRAConfig | None:
    """The adapters of one target.

    Args:
      target: a name in `linen_moe.lora.TARGETS`.

    Returns:
      `lora` when `target` is among `lora_targets`, else None.
    """
    lora = self.lora
    return lora if lora is not None and target in lora.targets else None

  @property
  def compute_dtype(self) -> jnp.dtype:
    """Deprecated (until 0.3): `jnp.dtype(config.dtype)`."""
    deprecation.warn(
        "MoEConfig.compute_dtype", "use jnp.dtype(config.dtype)", "0.3"
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
    changes = new_names("MoEConfig", changes)
    check_keys(type(self), changes)
    return dataclasses.replace(self, **changes)
