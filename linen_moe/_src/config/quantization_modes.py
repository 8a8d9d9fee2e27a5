"""The quantization modes' facts, in one table. Imports no jax (the command
line's --help reads it): element types are held by name, as numpy spells
them, and made dtypes when asked for.

Every module that needs to know what a mode is reads it here: the config
(which names exist, which can serve), the contraction factory, the stored
kernels of a serving layer, the HLO reader and the matrix (which element
types a compiled step must hold), and the tests.

  mode        forward    gradient     storage          RNG  state  grouped
              (lhs, rhs) (dlhs)       (serving)                    operands
  none        -          -            -                no   no     float
  int8        int8       int8         int8             yes  no     int8
  fp8         e4m3fn     e5m2         e4m3fn           no   yes    float
  nanoo_fp8   e4m3fnuz   e5m2fnuz     e4m3fnuz         no   yes    float

- forward / gradient: the element types the expert contractions quantize to,
  forward (both operands) and in the backward's input gradient (the
  cotangent; the weight gradient stays float in every mode). In the compiled
  program they appear under their HLO names (`s8`, `f8e4m3fn`, ...).
- storage: the type a serving layer keeps its expert kernels in, with scales
  per output channel (int8) or per tensor plus an input scale (fp8).
- RNG: the gradient needs an RNG in the `AQT_RNG_STREAM` stream (AQT's
  einsums, on the dense paths, round the int8 cotangent stochastically; the
  sparse path's int8 grouped matmul rounds to nearest).
- state: each contraction keeps delayed-scaling scales and amax histories in
  the `OVERWRITE_WITH_GRADIENT` collection.
- grouped operands: the element type the grouped matmul of the training mode
  receives: fp8 is quantized-dequantized around a float contraction, int8
  feeds int8 operands (int32 accumulation) to it. Accelerator kernels that
  take only float operands (megablox) fall back for int8, see
  `linen_moe._src.kernels.grouped_matmul`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# Per-output-channel scales (int8) or one scale per tensor plus the scale the
# input is quantized with (fp8): `QuantizationMode.storage_scales`.
PER_CHANNEL = "per_channel"
PER_TENSOR = "per_tensor"


def _dtype(name: str | None):
  if name is None:
    return None
  import jax.numpy as jnp  # noqa: PLC0415 (no jax at import)

  return jnp.dtype(name)


def hlo_type_name(dtype: Any) -> str:
  """The HLO element-type name of a dtype or dtype name: int8 -> "s8",
  float8_e4m3fn -> "f8e4m3fn", bfloat16 -> "bf16", float32 -> "f32"."""
  name = dtype if isinstance(dtype, str) else _dtype_name(dtype)
  if name == "bool":
    return "pred"
  if name == "bfloat16":
    return "bf16"
  if name.startswith("float8_"):
    return "f8" + name[len("float8_") :]
  match = re.fullmatch(r"(uint|int|float|complex)(\d+)", name)
  if match is None:
    raise ValueError(f"No HLO element-type name is known for dtype {name!r}.")
  prefix = {"uint": "u", "int": "s", "float": "f", "complex": "c"}
  return prefix[match.group(1)] + match.group(2)


def _dtype_name(dtype: Any) -> str:
  import jax.numpy as jnp  # noqa: PLC0415 (no jax at import)

  return jnp.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class QuantizationMode:
  """What one value of `MoEConfig.quantization` does (see the module table).

  Element types are numpy names ("int8", "float8_e4m3fn"); the `*_dtype`
  properties give them as dtypes.

  Attributes:
    name: the config value.
    forward: element type both operands of an expert contraction are
      quantized to in the forward; None when unquantized.
    gradient: element type of the quantized cotangent in the input
      gradient; None when the backward is float.
    storage: element type a serving layer stores expert kernels in; None
      when the mode cannot serve converted weights.
    storage_scales: `PER_CHANNEL` or `PER_TENSOR` (with an input scale);
      None without storage.
    needs_rng: taking a gradient (of its einsums) needs an RNG in
      `AQT_RNG_STREAM`.
    keeps_state: contractions keep fp8 delayed-scaling state in
      `OVERWRITE_WITH_GRADIENT`.
    grouped_operand: element type the training mode's grouped matmul is
      given; None for the float compute dtype.
  """

  name: str
  forward: str | None = None
  gradient: str | None = None
  storage: str | None = None
  storage_scales: str | None = None
  needs_rng: bool = False
  keeps_state: bool = False
  grouped_operand: str | None = None

  @property
  def forward_dtype(self):
    return _dtype(self.forward)

  @property
  def gradient_dtype(self):
    return _dtype(self.gradient)

  @property
  def storage_dtype(self):
    return _dtype(self.storage)

  @property
  def grouped_operand_dtype(self):
    return _dtype(self.grouped_operand)

  @property
  def quantized(self) -> bool:
    return self.forward is not None

  @property
  def serves(self) -> bool:
    """A serving layer can store its kernels converted in this mode."""
    return self.storage is not None

  @property
  def hlo_forward_type(self) -> str | None:
    """HLO name of `forward` ("s8", "f8e4m3fn", ...)."""
    return _hlo_or_none(self.forward)

  @property
  def hlo_gradient_type(self) -> str | None:
    return _hlo_or_none(self.gradient)

  @property
  def hlo_storage_type(self) -> str | None:
    return _hlo_or_none(self.storage)

  @property
  def hlo_types(self) -> frozenset[str]:
    """The quantized HLO element types a compiled training step of this mode
    feeds its contractions (forward and gradient); empty when unquantized."""
    types = (self.hlo_forward_type, self.hlo_gradient_type)
    return frozenset(t for t in types if t is not None)


def _hlo_or_none(dtype) -> str | None:
  return None if dtype is None else hlo_type_name(dtype)


def _fp8(name: str, e4m3: str, e5m2: str) -> QuantizationMode:
  """A delayed-scaling fp8 mode: e4m3 forward and storage, e5m2 gradient."""
  return QuantizationMode(
      name,
      forward=e4m3,
      gradient=e5m2,
      storage=e4m3,
      storage_scales=PER_TENSOR,
      keeps_state=True,
  )


MODES: dict[str, QuantizationMode] = {
    mode.name: mode
    for mode in (
        QuantizationMode("none"),
        QuantizationMode(
            "int8",
            forward="int8",
            gradient="int8",
            storage="int8",
            storage_scales=PER_CHANNEL,
            needs_rng=True,
            grouped_operand="int8",
        ),
        _fp8("fp8", "float8_e4m3fn", "float8_e5m2"),
        _fp8("nanoo_fp8", "float8_e4m3fnuz", "float8_e5m2fnuz"),
    )
}

QUANTIZED = tuple(n for n, m in MODES.items() if m.quantized)
# Modes that store their expert weights converted when `MoEConfig.serving`.
SERVING_MODES = tuple(n for n, m in MODES.items() if m.serves)
# Modes with fp8 delayed-scaling state.
FP8_MODES = tuple(n for n, m in MODES.items() if m.keeps_state)


def storage_dtypes() -> dict[str, Any]:
  """{mode: the dtype a serving layer stores its expert kernels in}."""
  return {n: m.storage_dtype for n, m in MODES.items() if m.serves}


def get_mode(name: str) -> QuantizationMode:
  """The `QuantizationMode` called `name`.

  Args:
    name: a mode of `MODES`.

  Returns:
    Its facts.

  Raises:
    ValueError: `name` is no mode.
  """
  if name not in MODES:
    raise ValueError(f"Unknown quantization {name!r}; allowed: {tuple(MODES)}.")
  return MODES[name]
