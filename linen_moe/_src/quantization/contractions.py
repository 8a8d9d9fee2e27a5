"""Contraction modules, one pair per quantization mode. Knows nothing of MoE.

Each mode offers two Linen modules with the same call signature across modes:

  einsum module:          module(eqn, lhs, rhs) -> einsum(eqn, lhs, rhs)
  grouped matmul module:  module(lhs [M, K], rhs [G, K, N], group_sizes [G])

`contraction_modules(mode)` is the one factory that picks them:

  "none"       plain einsum / grouped matmul.
  "int8"       einsum: AQT `AqtEinsum` in training mode, int8 forward and int8
               input gradient (dlhs) with int32 accumulation, float weight
               gradient (drhs); per-channel absmax scales, computed on the fly.
               grouped matmul: `kernels/int8_grouped.py` (per-expert,
               per-output-channel weight scales; same int8 fwd/dlhs split).
  "fp8"        Flax delayed scaling (`flax.linen.fp8_ops`): lhs and rhs are
               quantized-dequantized to float8_e4m3fn, the output gradient to
               float8_e5m2, each with a scale and an amax history.
  "nanoo_fp8"  the same with float8_e4m3fnuz / float8_e5m2fnuz.

The element types, and which modes need an RNG or keep state, are read from
`linen_moe._src.config.quantization_modes`.

What `apply` needs, per mode:

  int8   An RNG in the `AQT_RNG_STREAM` ("params") stream whenever gradients
         are taken: AQT rounds the dlhs cotangent stochastically. Pass
         `rngs={"params": key}` (a fresh key per step) to `apply` in the train
         step. A forward-only `apply` needs no RNG. AQT in training mode keeps
         no variables.
  fp8,   Six variables per contraction in the `OVERWRITE_WITH_GRADIENT`
  nanoo  collection: `input_scale`, `kernel_scale`, `output_grad_scale` (1,)
         and `input_amax_history`, `kernel_amax_history`,
         `output_grad_amax_history` (amax_history_length,). Differentiate the
         loss with respect to this collection too; its "gradient" is the new
         value, which the train step writes back (never into the optimizer).
         A non-finite amax is never recorded (`finite_amax_history`).

Quantization state never lives in `params`, so one `params` tree loads into
every mode.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

from aqt.jax.v2 import config as aqt_config
from aqt.jax.v2.flax import aqt_flax
import flax.linen as nn
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp

from linen_moe._src.config.quantization_modes import FP8_MODES
from linen_moe._src.config.quantization_modes import MODES
from linen_moe._src.config.quantization_modes import get_mode
from linen_moe._src.config.variables import AQT_RNG_STREAM
from linen_moe._src.config.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.kernels import blocked
from linen_moe._src.kernels import grouped_matmul as gmm_lib
from linen_moe._src.kernels.int8_grouped import int8_grouped_matmul

# (forward, output-gradient) fp8 types of each fp8 mode.
FP8_DTYPES = {
    name: (MODES[name].forward_dtype, MODES[name].gradient_dtype)
    for name in FP8_MODES
}
_OPTIONS = ("implementation", "amax_history_length")


class _Contraction(nn.Module):
  """Base of the float-contraction modules; `_wrap` is the quantization hook."""

  def _wrap(self, contract: Callable, lhs: jax.Array, rhs: jax.Array):
    """Runs `contract(lhs, rhs)`; quantizing subclasses wrap it."""
    return contract(lhs, rhs)


def _einsum(eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """`jnp.einsum` in the operands' dtype, accumulated in float32 when that is
  a narrower float (`blocked.float32_accumulation`): more accurate,
  and on XLA:CPU 2.5x faster than a bf16 dot (measured forward+backward,
  [8, 8, 160, 512] x [8, 512, 1024])."""
  dtype = jnp.result_type(lhs, rhs)
  a, b, acc = blocked.float32_accumulation(lhs, rhs)
  return jnp.einsum(eqn, a, b, preferred_element_type=acc).astype(dtype)


class Einsum(_Contraction):
  """Unquantized einsum in the dtype of its operands: module(eqn, lhs, rhs)."""

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    return self._wrap(functools.partial(_einsum, eqn), lhs, rhs)


class GroupedMatmul(_Contraction):
  """Unquantized grouped matmul: module(lhs [M, K], rhs [G, K, N], sizes [G]).

  Attributes:
    implementation: see `kernels/grouped_matmul.py`'s `IMPLEMENTATIONS`.
    max_group_size: a static bound on every group's size the caller knows,
      or None (see `blocked.blocked_grouped_matmul`).
  """

  implementation: str = "auto"
  max_group_size: int | None = None

  def _matmul(self, lhs, rhs, group_sizes) -> jax.Array:
    return gmm_lib.grouped_matmul(
        lhs,
        rhs,
        group_sizes,
        implementation=self.implementation,
        max_group_size=self.max_group_size,
    )

  @nn.compact
  def __call__(
      self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array
  ) -> jax.Array:
    return self._wrap(lambda a, b: self._matmul(a, b, group_sizes), lhs, rhs)


def _int8_aqt_config() -> aqt_config.DotGeneral:
  """AQT int8 training config: 8-bit fwd and dlhs, int32 accumulation.

  Stored (serving) weights come in as a `QTensor`; AQT would poison their
  backward, but a frozen int8 base under trained adapters (QLoRA) needs the
  gradient of the input through it. The weights' own gradient is never
  asked for (the train step closes over a frozen base)."""
  cfg = aqt_config.config_v4(
      fwd_bits=8,
      dlhs_bits=8,
      drhs_bits=None,
      fwd_accumulator_dtype=jnp.int32,
      dlhs_accumulator_dtype=jnp.int32,
  )
  cfg.fwd.allow_dummy_gradient_into_qtensor = True
  return cfg


def _forward_only(out: jax.Array, where: str) -> jax.Array:
  """Identity whose gradient is a `ValueError`: an int8 einsum applied
  without the RNG its backward needs (raised while the gradient is traced,
  before AQT's own backward would fail on an assertion)."""

  @jax.custom_vjp
  def identity(out):
    return out

  def fwd(out):
    return out, None

  def bwd(_, g):
    raise ValueError(
        f"{where}: rngs has no {AQT_RNG_STREAM!r} key, but the gradient of "
        "an int8 (AQT) einsum rounds stochastically and needs one: pass "
        f'rngs={{"{AQT_RNG_STREAM}": key}} to apply (a fresh key per step; '
        "under NNX, rngs=key to the EagerToNNX call or rng=key to "
        "nnx_adapter.Decoder); a forward-only apply needs none."
    )

  identity.defvjp(fwd, bwd)
  return identity(out)


class Int8Einsum(nn.Module):
  """AQT int8 einsum in training mode; keeps no variables.

  Reads the `AQT_RNG_STREAM` RNG when one is passed to `apply` (needed for
  gradients: stochastic rounding of the cotangent); without one the forward
  still runs, and taking a gradient is a `ValueError` saying to pass it.
  """

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    stream = AQT_RNG_STREAM if self.has_rng(AQT_RNG_STREAM) else None
    aqt = aqt_flax.AqtEinsum(
        cfg=_int8_aqt_config(), prng_name=stream, name="aqt"
    )
    out = aqt(eqn, lhs, rhs)
    if stream is None:
      where = "/".join(self.scope.path) or type(self).__name__
      out = _forward_only(out, f"int8 einsum {where}")
    return out


class Int8GroupedMatmul(GroupedMatmul):
  """Int8 grouped matmul, see `kernels/int8_grouped.py`; keeps no variables."""

  def _matmul(self, lhs, rhs, group_sizes) -> jax.Array:
    return int8_grouped_matmul(
        lhs, rhs, group_sizes, self.implementation, self.max_group_size
    )


@jax.custom_vjp
def finite_amax_history(history: jax.Array) -> jax.Array:
  """Identity on an amax history whose "gradient" holds only finite values.

  Flax's `fp8_ops.in_qdq`/`out_qdq` return the new history as the cotangent of
  the old one: rolled left by one, with the newest amax (max |x| of the input,
  or of the output gradient) at index 0. An `inf` or `nan` there would stay in
  the window for `amax_history_length` steps, and Flax keeps the old scale
  while the window holds a non-finite value: scaling would freeze. The
  backward here records every non-finite entry as 0 instead, the neutral
  element of the maximum that both the scale (max over the window) and the
  combination of microbatches and devices (element-wise max) take: a
  non-finite amax is ignored, the finite ones stay, and a history restored
  with a non-finite entry is cleaned on the next step.

  Args:
    history: <float32>[amax_history_length].

  Returns:
    `history`, unchanged.
  """
  return history


def _finite_amax_history_fwd(history):
  return history, None


def _finite_amax_history_bwd(_, new_history):
  return (jnp.where(jnp.isfinite(new_history), new_history, 0.0),)


finite_amax_history.defvjp(_finite_amax_history_fwd, _finite_amax_history_bwd)


def _check_fp8_state(module: nn.Module, name: str) -> None:
  """Raises a ValueError naming the collection and the guide when an fp8
  contraction is applied without its state (flax would raise
  `ScopeCollectionNotFound`, which names neither)."""
  if module.is_initializing() or module.has_variable(
      OVERWRITE_WITH_GRADIENT, name
  ):
    return
  if module.is_mutable_collection(OVERWRITE_WITH_GRADIENT):
    return  # created now, as `init` would
  raise ValueError(
      f"The fp8 contraction {'/'.join(module.scope.path)} has no "
      f"{name!r}: the variables applied hold no {OVERWRITE_WITH_GRADIENT!r} "
      "collection (its fp8 scales and amax histories). Apply every "
      "collection that init made, e.g. {'params': params, "
      f"{OVERWRITE_WITH_GRADIENT!r}: fp8_state}} (a TrainState's "
      "`fp8_state`), and train it with linen_moe.training.make_train_step "
      "(it writes the new state back); see docs/guides/quantization.md."
  )


class _Fp8(_Contraction):
  """Delayed-scaling fp8 around the contraction (Flax `fp8_ops` qdq).

  lhs and rhs are quantized-dequantized to `e4m3_dtype` with the scale derived
  from their amax history (the current amax only enters the history: delayed
  scaling); the output's cotangent is quantized-dequantized to `e5m2_dtype`.
  The contraction itself runs in the operands' float dtype on the qdq values.

  Variables (collection `OVERWRITE_WITH_GRADIENT`, Flax's names): scales
  `input_scale`, `kernel_scale`, `output_grad_scale` <float32>[1], initialised
  to 1; histories `input_amax_history`, `kernel_amax_history`,
  `output_grad_amax_history` <float32>[amax_history_length], initialised to 0.
  A non-finite amax (an `inf` input, a `nan` gradient) is recorded as 0, so
  it never enters a history and the scales keep adapting
  (`finite_amax_history`); finite values are recorded as Flax does.

  Attributes:
    amax_history_length: length of each amax history.
    e4m3_dtype: forward (lhs and rhs) fp8 type.
    e5m2_dtype: output-gradient fp8 type.
  """

  amax_history_length: int = 1024
  e4m3_dtype: Any = FP8_DTYPES["fp8"][0]
  e5m2_dtype: Any = FP8_DTYPES["fp8"][1]

  def _qdq(self, qdq_fn, role: str, q_dtype, x: jax.Array) -> jax.Array:
    """`fp8_ops.in_qdq` or `out_qdq` of `x` with the `role`'s scale/history."""
    _check_fp8_state(self, f"{role}_scale")
    scale = self.variable(
        OVERWRITE_WITH_GRADIENT, f"{role}_scale", jnp.ones, (1,), jnp.float32
    )
    history = self.variable(
        OVERWRITE_WITH_GRADIENT,
        f"{role}_amax_history",
        jnp.zeros,
        (self.amax_history_length,),
        jnp.float32,
    )
    return qdq_fn(
        x.dtype, q_dtype, x, scale.value, finite_amax_history(history.value)
    )

  def _wrap(self, contract: Callable, lhs: jax.Array, rhs: jax.Array):
    dtype = jnp.result_type(lhs, rhs)
    q_lhs = self._qdq(
        fp8_ops.in_qdq, "input", self.e4m3_dtype, lhs.astype(dtype)
    )
    q_rhs = self._qdq(
        fp8_ops.in_qdq, "kernel", self.e4m3_dtype, rhs.astype(dtype)
    )
    out = contract(q_lhs, q_rhs)
    return self._qdq(fp8_ops.out_qdq, "output_grad", self.e5m2_dtype, out)


class Fp8Einsum(_Fp8, Einsum):
  """fp8 (or NANOO fp8) einsum: module(eqn, lhs, rhs); see `_Fp8`.

  Unlike `flax.linen.Fp8Einsum`, it really uses `e4m3_dtype`/`e5m2_dtype`.
  """


class Fp8GroupedMatmul(_Fp8, GroupedMatmul):
  """fp8 (or NANOO fp8) grouped matmul: module(lhs, rhs, group_sizes)."""


@dataclasses.dataclass(frozen=True)
class ContractionModules:
  """The Linen module classes a quantization mode contracts with."""

  einsum: type[nn.Module]
  grouped_matmul: type[nn.Module]
  einsum_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  grouped_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@functools.cache
def contraction_modules(mode: str, **options: Any) -> ContractionModules:
  """The one factory: einsum and grouped-matmul module classes for `mode`.

  Options: `implementation` (grouped matmul), `amax_history_length` (fp8).
  Built once per (mode, options); the result is shared, so never mutate it.
  """
  facts = get_mode(mode)
  unknown = sorted(set(options) - set(_OPTIONS))
  if unknown:
    raise ValueError(f"Unknown option(s) {unknown}; allowed: {_OPTIONS}.")
  grouped = {"implementation": options.get("implementation", "auto")}
  if not facts.quantized:
    return ContractionModules(Einsum, GroupedMatmul, grouped_kwargs=grouped)
  if not facts.keeps_state:  # int8: AQT, computed on the fly
    return ContractionModules(
        Int8Einsum, Int8GroupedMatmul, grouped_kwargs=grouped
    )
  e4m3, e5m2 = FP8_DTYPES[mode]
  fp8 = {
      "amax_history_length": options.get("amax_history_length", 1024),
      "e4m3_dtype": e4m3,
      "e5m2_dtype": e5m2,
  }
  return ContractionModules(
      Fp8Einsum, Fp8GroupedMatmul, fp8, {**fp8, **grouped}
  )
