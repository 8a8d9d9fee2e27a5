"""Stored (converted) expert kernels: their layout, and the contractions that
read them. Knows nothing of MoE routing.

A serving layer (`MoEConfig.serving`) keeps each expert kernel in its mode's
storage type, beside its scales, in `params` (one kernel per name, no float
copy). For a kernel `name` of shape [..., K, N] (K contracted):

  mode        `name`                  `name_scale`     `name_input_scale`
  int8        <int8>[..., K, N]       <f32>[..., 1, N]  -
  fp8         <float8_e4m3fn>[...]    <f32>[1]          <f32>[1]
  nanoo_fp8   <float8_e4m3fnuz>[...]  <f32>[1]          <f32>[1]

int8 scales are per output channel (and per expert: the leading axes), AQT's
grid (`int8_grouped.quantize_int8`): kernel ~= values * scale. fp8 scales are
per tensor, Flax's delayed-scaling convention: kernel ~= values * scale, and
the contraction's input is quantized as `fp8_ops.quantize(x, e4m3,
input_scale)`. Where the training state held those scales, they are its
(see `linen_moe.quantization.quantize_weights`).

The contractions take a `StoredKernel` where the float layers take a kernel:

  int8   einsum: the training mode's AQT einsum (`quantization.Int8Einsum`)
         given the stored weights as a `QTensor`, AQT's way of serving
         pre-quantized weights: the input is quantized per row exactly as in
         training, the weights are not touched, int32 accumulation. grouped
         matmul:
         `int8_grouped.int8_grouped_matmul_stored`.
  fp8    the input is quantized to e4m3 with `input_scale`; the fp8 input and
         the fp8 kernel go into one dot (float32 accumulation) whose output
         is multiplied by `input_scale * scale`.

Both are forward only: a serving layer is not trained.
"""

from __future__ import annotations

from typing import Any

from aqt.jax.v2 import aqt_tensor
import flax.linen as nn
from flax.linen import fp8_ops
import flax.struct
import jax
import jax.numpy as jnp

from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.config.quantization_modes import MODES
from linen_moe._src.config.quantization_modes import PER_CHANNEL
from linen_moe._src.config.quantization_modes import storage_dtypes
from linen_moe._src.kernels import grouped_matmul as gmm_lib
from linen_moe._src.kernels import int8_grouped
from linen_moe._src.quantization.contractions import Int8Einsum

STORAGE_DTYPES = storage_dtypes()
SCALE_SUFFIX = "_scale"
INPUT_SCALE_SUFFIX = "_input_scale"
# Every suffix a stored kernel's leaves may carry, in any mode: the values
# ("") and the scales (`stored_names` says which a mode has).
SUFFIXES = ("", SCALE_SUFFIX, INPUT_SCALE_SUFFIX)


def converted(dtype: Any) -> bool:
  """`dtype` is one some mode stores kernels in (a converted kernel's)."""
  return dtype in STORAGE_DTYPES.values()


def per_channel(mode: str) -> bool:
  """The mode stores one scale per output channel (int8), not one per tensor
  plus an input scale (fp8)."""
  return MODES[mode].storage_scales == PER_CHANNEL


def scale_shape(mode: str, kernel_shape: tuple[int, ...], rank: int):
  """Shape of the scale of a kernel whose last `rank` axes are one kernel
  (the axes before are stacked layers)."""
  if per_channel(mode):
    return (*kernel_shape[:-2], 1, kernel_shape[-1])
  return (*kernel_shape[: len(kernel_shape) - rank], 1)


def stored_names(name: str, mode: str) -> tuple[str, ...]:
  """The `params` names a stored kernel `name` occupies in `mode`."""
  suffixes = SUFFIXES[:2] if per_channel(mode) else SUFFIXES
  return tuple(name + suffix for suffix in suffixes)


@flax.struct.dataclass
class StoredKernel:
  """A kernel in its storage type and its scales.

  Attributes:
    values: <int8 | float8>[..., K, N], the stored kernel.
    scale: <float32>, `scale_shape` of it: values * scale ~= the kernel.
    input_scale: <float32>[1] for fp8 (the scale the input is quantized
      with), None for int8 (its inputs get a scale per row, on the fly).
    mode: "int8", "fp8" or "nanoo_fp8".
  """

  values: jax.Array
  scale: jax.Array
  input_scale: jax.Array | None = None
  mode: str = flax.struct.field(pytree_node=False, default="int8")

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def dtype(self):
    return self.values.dtype


def _check_given(module: nn.Module, name: str, shape, mode: str) -> None:
  """Converted weights of this mode and shape, or a ValueError that says
  what is there instead."""

  def path(stored):
    return "/".join(("params", *module.scope.path, stored))

  storage = STORAGE_DTYPES[mode]
  if module.has_variable("params", name):
    values = nn.unbox(module.get_variable("params", name))
    if values.dtype != storage:
      what = (
          "weights converted for another mode"
          if converted(values.dtype)
          else "float weights"
      )
      raise ValueError(
          f"{path(name)} holds {what} ({values.dtype}), but a serving "
          f"layer with quantization={mode!r} reads {storage} weights: "
          "convert the float variables for this mode with "
          "linen_moe.quantization.quantize_weights."
      )
  expected = {
      name: shape,
      name + SCALE_SUFFIX: scale_shape(mode, shape, len(shape)),
      name + INPUT_SCALE_SUFFIX: (1,),
  }
  for stored in stored_names(name, mode):
    if not module.has_variable("params", stored):
      raise ValueError(
          f"A serving layer (quantization={mode!r}) reads converted expert"
          f" weights, but there is no {path(stored)}: convert the float"
          " variables with linen_moe.quantization.quantize_weights and apply"
          " the serving config it returns to the variables it returns."
      )
    got = tuple(nn.unbox(module.get_variable("params", stored)).shape)
    if got != tuple(expected[stored]):
      raise ValueError(
          f"{path(stored)} has shape {got}; this serving config expects "
          f"{expected[stored]}."
      )


def stored_kernel(
    module: nn.Module,
    name: str,
    shape: tuple[int, ...],
    axis_names: tuple[str | None, ...],
    config: MoEConfig,
) -> StoredKernel:
  """Declares (at init: zeros and unit scales, to be overwritten by converted
  weights) or reads and checks the stored kernel `name` of `module`.

  `config` is a serving config, so its mode stores weights: `MoEConfig`
  checks that at construction (`moe_config.check_serving`).

  Raises:
    ValueError: outside init, when the params hold no converted weights, or
      float ones, or ones of another mode or shape.
  """
  mode = config.quantization
  if not module.is_initializing():
    _check_given(module, name, shape, mode)
  zeros, ones = nn.initializers.zeros, nn.initializers.ones

  def param(suffix, init, param_shape, dtype, names):
    boxed = nn.with_logical_partitioning(init, names)
    return module.param(name + suffix, boxed, param_shape, dtype)

  scale_names = (*axis_names[:-2], None, axis_names[-1])
  if not per_channel(mode):
    scale_names = (None,)
  values = param("", zeros, shape, STORAGE_DTYPES[mode], axis_names)
  scale = param(
      SCALE_SUFFIX,
      ones,
      scale_shape(mode, shape, len(shape)),
      jnp.float32,
      scale_names,
  )
  input_scale = None
  if not per_channel(mode):
    input_scale = param(INPUT_SCALE_SUFFIX, ones, (1,), jnp.float32, (None,))
  return StoredKernel(values, scale, input_scale, mode)


def _fp8_input(lhs: jax.Array, rhs: StoredKernel) -> jax.Array:
  """lhs quantized as the training-mode fp8 forward quantizes it."""
  return fp8_ops.quantize(lhs, rhs.dtype, rhs.input_scale, lhs.dtype)


def _fp8_rescale(out: jax.Array, rhs: StoredKernel, dtype) -> jax.Array:
  return (out * (rhs.input_scale * rhs.scale)).astype(dtype)


def _check_operand(rhs: Any) -> StoredKernel:
  if not isinstance(rhs, StoredKernel):
    raise TypeError(
        "A stored-kernel contraction takes a StoredKernel rhs; got "
        f"{type(rhs).__name__}."
    )
  return rhs


class StoredEinsum(nn.Module):
  """module(eqn, lhs, rhs: StoredKernel) -> einsum(eqn, lhs, kernel), from
  the stored kernel (see the module docstring); keeps no variables."""

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: StoredKernel):
    rhs = _check_operand(rhs)
    if per_channel(rhs.mode):  # int8: AQT's einsum
      qt = aqt_tensor.QTensor(
          qvalue=rhs.values,
          scale=[rhs.scale.astype(lhs.dtype)],
          scale_t=None,
          bias=[],
          dequant_dtype=lhs.dtype,
      )
      # The training mode's AQT einsum, given the stored weights.
      return Int8Einsum(name="int8")(eqn, lhs, qt)
    out = jnp.einsum(
        eqn,
        _fp8_input(lhs, rhs),
        rhs.values,
        preferred_element_type=jnp.float32,
    )
    return _fp8_rescale(out, rhs, lhs.dtype)


class StoredGroupedMatmul(nn.Module):
  """module(lhs [M, K], rhs: StoredKernel [G, K, N], group_sizes [G]) ->
  [M, N], from the stored kernel; keeps no variables.

  Attributes:
    implementation: see `kernels/grouped_matmul.py`'s `IMPLEMENTATIONS`.
    max_group_size: a static bound on every group's size the caller knows,
      or None (see `blocked.blocked_grouped_matmul`).
  """

  implementation: str = "auto"
  max_group_size: int | None = None

  @nn.compact
  def __call__(self, lhs: jax.Array, rhs: StoredKernel, group_sizes):
    rhs = _check_operand(rhs)
    if per_channel(rhs.mode):  # int8
      return int8_grouped.int8_grouped_matmul_stored(
          lhs,
          rhs.values,
          rhs.scale,
          group_sizes,
          self.implementation,
          self.max_group_size,
      )
    out = gmm_lib.grouped_matmul(
        _fp8_input(lhs, rhs),
        rhs.values,
        group_sizes,
        implementation=self.implementation,
        preferred_element_type=jnp.float32,
        max_group_size=self.max_group_size,
    )
    return _fp8_rescale(out, rhs, lhs.dtype)
