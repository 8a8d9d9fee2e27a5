"""Block-fp8 weights on disk: the DeepSeek-V3 / Qwen3-FP8 layout.

A checkpoint whose config.json holds

    "quantization_config": {"quant_method": "fp8",
                            "weight_block_size": [bm, bn], ...}

stores some weights W [rows, cols] (a fused expert tensor: [E, rows, cols])
as float8_e4m3fn, each beside `{name}_scale_inv`, float
[ceil(rows / bm), ceil(cols / bn)] (the same leading axes). Block (i, j)
covers rows [i bm, (i + 1) bm) and columns [j bn, (j + 1) bn), clipped to
the tensor (the last row and column of blocks may be partial), and

    W[block (i, j)] = fp8[block (i, j)] * scale_inv[i, j]

(transformers' `integrations/finegrained_fp8.py`: `FP8Linear` allocates
the scales so, `_dequantize_fp8_weight` multiplies so). transformers
quantizes every `nn.Linear` but `lm_head` and `modules_to_not_convert`;
the routers, norms, embeddings and `e_score_correction_bias` stay float.
The loader does not rely on that list: which tensors are fp8 is read from
the files.

`block_size(quantization_config)` checks the config; `Dequantized(ckpt,
block)` checks every fp8 tensor against its scales before a byte of data
is read and then reads an fp8 tensor's rows as float32, dequantized (only
the scale rows those rows need); `quantize(matrix, block)` makes the pair
back, and `planned` writes it, for `save_checkpoint` (which quantizes what
transformers would: every linear layer's weight but lm_head and the
routers, listed in `modules_to_not_convert`).
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Iterable
from collections.abc import Mapping
import dataclasses
import functools
import math
import os
from typing import Any

import ml_dtypes
import numpy as np

from linen_moe._src.config import expert_weights
from linen_moe._src.hf import tensor_names as tn
from linen_moe._src.hf.safetensors_io import FLOAT_CODES
from linen_moe._src.hf.safetensors_io import Checkpoint
from linen_moe._src.hf.safetensors_io import Planned
from linen_moe._src.kernels.int8_grouped import as_float32

Path = tuple[str, ...]

QUANT_METHOD = "fp8"
FP8_CODE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)  # FineGrainedFP8Config's default
FP8_MAX = np.float32(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
# Every float8_e4m3fn byte's float32 value (two NaNs).
_E4M3_TABLE = (
    np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype("f4")
)
# quantization_config fields read here, and the values each may take
# (None: absent or null). Any other field may change the weights, so it is
# an error rather than ignored.
_ALLOWED = {
    "activation_scheme": (None, "dynamic"),  # static needs activation scales
    "fmt": (None, "e4m3", "float8_e4m3fn"),  # MiniMax-M2 writes the latter
    "scale_fmt": (None, "float", "ue8m0"),  # ue8m0: powers of two, stored F32
    "expert_dtype": (None, "fp8"),
}
_INFORMATIONAL = ("modules_to_not_convert", "ignored_layers", "dequantize")


def _error(where: str, field: str, value: Any, allowed: str) -> ValueError:
  return ValueError(
      f"{where}: quantization_config.{field}={value!r} is not supported: "
      f"{allowed}."
  )


def block_size(
    quantization_config: Any, where: str | os.PathLike = "config.json"
) -> tuple[int, int]:
  """The [bm, bn] weight block of a block-fp8 `quantization_config`.

  Args:
    quantization_config: config.json's `quantization_config`.
    where: the file it came from, for the messages.

  Returns:
    (bm, bn): rows and columns of W [out, in] per scale;
    `DEFAULT_BLOCK` when `weight_block_size` is absent (transformers').

  Raises:
    ValueError: not a mapping, a `quant_method` other than "fp8", a
      `weight_block_size` that is not two positive ints (null: per-tensor
      fp8, not read), static activation scales, fp4 experts, fp8
      embeddings (`modules_to_convert`) or a field not known here; the
      message names the file and the field.
  """
  where = str(where)
  if not isinstance(quantization_config, Mapping):
    raise ValueError(
        f"{where}: quantization_config={quantization_config!r} is not "
        "supported: expected a JSON object."
    )
  method = quantization_config.get("quant_method")
  if method != QUANT_METHOD:
    raise _error(
        where,
        "quant_method",
        method,
        f"only {QUANT_METHOD!r} is read (block fp8 with `weight_scale_inv`, "
        "the DeepSeek-V3 / Qwen3-FP8 layout); dequantize the checkpoint "
        "first",
    )
  known = {"quant_method", "weight_block_size", "modules_to_convert"}
  unknown = sorted(
      set(quantization_config) - known - set(_ALLOWED) - set(_INFORMATIONAL)
  )
  if unknown:
    raise ValueError(
        f"{where}: quantization_config has field(s) {unknown} not known "
        "here; they may change the weights, so they are not ignored."
    )
  for field, allowed in _ALLOWED.items():
    value = quantization_config.get(field)
    if value not in allowed:
      raise _error(where, field, value, f"allowed {list(allowed)}")
  if quantization_config.get("modules_to_convert"):
    raise _error(
        where,
        "modules_to_convert",
        quantization_config["modules_to_convert"],
        "fp8 embeddings are not read",
    )
  block = quantization_config.get("weight_block_size", DEFAULT_BLOCK)
  if block is None:
    raise _error(where, "weight_block_size", None, "per-tensor fp8 is not read")
  return check_block(block, f"{where}: quantization_config.weight_block_size")


def check_block(block: Any, what: str) -> tuple[int, int]:
  """`block` as (bm, bn), or a ValueError naming `what`."""
  if (
      not isinstance(block, (list, tuple))
      or len(block) != 2
      or not all(type(b) is int and b > 0 for b in block)
  ):
    raise ValueError(f"{what}={block!r} is invalid: expected two ints > 0.")
  return int(block[0]), int(block[1])


def scale_shape(
    shape: tuple[int, ...], block: tuple[int, int]
) -> tuple[int, ...]:
  """The scale tensor's shape of a tensor [*lead, rows, cols] of fp8."""
  *lead, rows, cols = shape
  return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def _orphan(name: str, tensors: Mapping) -> str | None:
  """The weight `name` scales, when it is a scale name of no fp8 tensor."""
  if not name.endswith(SCALE_SUFFIX):
    return None
  weight = name[: -len(SCALE_SUFFIX)]
  info = tensors.get(weight)
  return None if info is not None and info.dtype == FP8_CODE else weight


class Dequantized:
  """The tensors of a block-fp8 checkpoint, its fp8 ones read as float32.

  Stands for a `Checkpoint` wherever the loader reads one. Every fp8
  tensor and its scales are checked when it is made, from the files'
  headers alone.

  Attributes:
    directory: the checkpoint directory.
    tensors: {name: TensorInfo}: the fp8 tensors as the float32 tensors
      they read as ("F32"), the scales left out, every other tensor as on
      disk.
  """

  def __init__(self, ckpt: Checkpoint, block: tuple[int, int]):
    """Checks `ckpt`'s fp8 tensors against their scales.

    Args:
      ckpt: the checkpoint's files.
      block: (bm, bn) from `block_size`.

    Raises:
      ValueError: an fp8 tensor of rank < 2 or with no scale tensor, a
        scale tensor that is not float or whose shape does not match its
        tensor's blocks, or a scale tensor of no fp8 tensor; the message
        names the file and the tensor.
    """
    self.base, self.block, self.directory = ckpt, block, ckpt.directory
    self.scales: dict[str, str] = {}
    tensors = dict(ckpt.tensors)
    for name, info in ckpt.tensors.items():
      weight = _orphan(name, ckpt.tensors)
      if weight is not None:
        raise ValueError(
            f"{info.file}: tensor {name!r} is a block scale, but "
            f"{weight!r} is not a float8_e4m3fn tensor of the checkpoint."
        )
      if info.dtype != FP8_CODE:
        continue
      self._check(name, info, ckpt.tensors)
      self.scales[name] = name + SCALE_SUFFIX
      tensors[name] = dataclasses.replace(info, dtype="F32")
      del tensors[name + SCALE_SUFFIX]
    self.tensors = tensors

  def _check(self, name: str, info, tensors: Mapping) -> None:
    scale = name + SCALE_SUFFIX
    if len(info.shape) < 2:
      raise ValueError(
          f"{info.file}: tensor {name!r} is float8_e4m3fn of shape "
          f"{list(info.shape)}; block fp8 stores matrices (rank >= 2)."
      )
    if scale not in tensors:
      raise ValueError(
          f"{info.file}: tensor {name!r} is float8_e4m3fn, but the "
          f"checkpoint has no {scale!r}, its scales (one per "
          f"{list(self.block)} block)."
      )
    s = tensors[scale]
    if s.dtype not in FLOAT_CODES:
      raise ValueError(
          f"{s.file}: tensor {scale!r} is {s.dtype}; block scales are "
          f"float {FLOAT_CODES}."
      )
    want = scale_shape(info.shape, self.block)
    if s.shape != want:
      raise ValueError(
          f"{s.file}: tensor {scale!r} has shape {list(s.shape)}; "
          f"{name!r} {list(info.shape)} in blocks of {list(self.block)} "
          f"(quantization_config.weight_block_size) needs {list(want)}, one "
          "scale per block with partial blocks at the edges."
      )

  def read_rows(
      self,
      name: str,
      lead: tuple[int, ...],
      lo: int,
      hi: int,
      out: np.ndarray | None = None,
  ) -> np.ndarray:
    """`Checkpoint.read_rows`; an fp8 tensor's rows [lo, hi) of
    `tensor[lead]` (its rows axis: the one before the last) come out
    float32, dequantized, reading only the scale rows they need."""
    scale = self.scales.get(name)
    if scale is None:
      return self.base.read_rows(name, lead, lo, hi, out)
    shape = self.base.tensors[name].shape
    if len(lead) != len(shape) - 2:
      raise ValueError(
          f"{name!r}: rows of a block-fp8 tensor {list(shape)} are read "
          f"with {len(shape) - 2} leading indices; got {lead}."
      )
    if hi <= lo:
      rows = np.zeros((0, shape[-1]), np.float32)
    else:
      values = self.base.read_rows(name, lead, lo, hi)
      bm = self.block[0]
      scales = self.base.read_rows(scale, lead, lo // bm, (hi - 1) // bm + 1)
      rows = dequantize(values, scales, self.block, lo)
    if out is None:
      return rows
    out[...] = rows
    return out


def dequantize(
    values: np.ndarray,
    scales: np.ndarray,
    block: tuple[int, int],
    row0: int = 0,
) -> np.ndarray:
  """float32 [r, c] = values * the scale of each element's block.

  Args:
    values: float8_e4m3fn [r, c], rows [row0, row0 + r) of a tensor.
    scales: float [n, ceil(c / bn)], the tensor's scale rows from
      row0 // bm on (n >= the blocks those rows touch).
    block: (bm, bn).
    row0: the first row's index in the tensor.

  Returns:
    The dequantized rows, a new float32 array.
  """
  r, _ = values.shape
  bm, bn = block
  # A table read of each byte: several times faster than ml_dtypes' cast.
  out = _E4M3_TABLE[values.view(np.uint8)]
  rows = (row0 + np.arange(r)) // bm - row0 // bm
  per_row = as_float32(scales)[rows]  # [r, ceil(c / bn)]
  for j in range(per_row.shape[1]):
    out[:, j * bn : (j + 1) * bn] *= per_row[:, j : j + 1]
  return out


def quantize(
    matrix: np.ndarray, block: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
  """Block fp8 of a float [*lead, rows, cols]: the pair `dequantize` reads.

  Each block's scale is max |block| / 448 (float32; 1 for an all-zero
  block); its values are block / scale, clipped to +-448 and rounded to
  the nearest float8_e4m3fn (ties to even).

  Args:
    matrix: float [*lead, rows, cols].
    block: (bm, bn).

  Returns:
    (values float8_e4m3fn [*lead, rows, cols], scales float32
    [*lead, ceil(rows / bm), ceil(cols / bn)]).
  """
  m = as_float32(np.asarray(matrix))
  *lead, rows, cols = m.shape
  bm, bn = block
  shape = scale_shape(m.shape, block)
  values = np.empty(m.shape, ml_dtypes.float8_e4m3fn)
  scales = np.empty(shape, np.float32)
  for *e, i in np.ndindex(*shape[:-1]):
    at = (*e, slice(i * bm, (i + 1) * bm))
    part = m[at]  # [h, cols]
    padded = np.zeros((part.shape[0], shape[-1] * bn), np.float32)
    np.abs(part, out=padded[:, :cols])
    amax = padded.reshape(part.shape[0], shape[-1], bn).max(axis=(0, 2))
    inv = np.where(amax > 0, amax / FP8_MAX, np.float32(1)).astype(np.float32)
    scaled = part / np.repeat(inv, bn)[:cols]
    np.clip(scaled, -FP8_MAX, FP8_MAX, out=scaled)
    values[at] = scaled.astype(ml_dtypes.float8_e4m3fn)
    scales[(*e, i)] = inv
  return values, scales


def _float_kernel(path: Path) -> bool:
  """Whether transformers keeps the kernel at `path` float in an fp8
  model: lm_head (its default skip) and the routers."""
  return path == ("logits", "kernel") or expert_weights.ROUTER in path


def quantized_names(srcs: Mapping[Path, tn.Source]) -> list[str]:
  """The tensors `save_checkpoint` writes as block fp8: every matrix of a
  linear layer (attention, MLPs, experts) but lm_head and the routers."""
  names = {}
  for path, source in srcs.items():
    if not isinstance(source, tn.Copy) and not _float_kernel(path):
      names |= dict.fromkeys(tn.tensor_names({path: source}))
  return list(names)


def float_modules(srcs: Mapping[Path, tn.Source]) -> list[str]:
  """`modules_to_not_convert`: lm_head and every router's module, the
  linear layers whose weights stay float."""
  out = {"lm_head": None}
  for path, source in srcs.items():
    if isinstance(source, tn.Matrix) and _float_kernel(path):
      out[source.name.removesuffix(".weight")] = None
  return list(out)


def hf_quantization_config(
    srcs: Mapping[Path, tn.Source], block: tuple[int, int]
) -> dict[str, Any]:
  """config.json's `quantization_config` of the files `save_checkpoint`
  writes in blocks of `block`."""
  return {
      "activation_scheme": "dynamic",
      "fmt": "e4m3",
      "modules_to_not_convert": float_modules(srcs),
      "quant_method": QUANT_METHOD,
      "weight_block_size": list(block),
  }


def planned(
    tensors: Iterable[Planned], names: Collection[str], block: tuple[int, int]
) -> list[Planned]:
  """`tensors` with each of `names` written as block fp8: its values, then
  its `_scale_inv`, both from one `quantize` of the float tensor when the
  values are written (the writer keeps the order)."""
  out = []
  for t in tensors:
    if t.name not in names:
      out.append(t)
      continue
    made: dict[str, np.ndarray] = {}

    def make(part, t=t, made=made):
      if part not in made:
        made["values"], made["scales"] = quantize(t.make(), block)
      return made.pop(part)

    out.append(
        Planned(
            t.name,
            np.dtype(ml_dtypes.float8_e4m3fn),
            t.shape,
            functools.partial(make, "values"),
        )
    )
    out.append(
        Planned(
            t.name + SCALE_SUFFIX,
            np.dtype(np.float32),
            scale_shape(t.shape, block),
            functools.partial(make, "scales"),
        )
    )
  return out
