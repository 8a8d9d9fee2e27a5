"""MXFP4 expert weights on disk: the released GPT-OSS layout.

A checkpoint whose config.json holds `"quantization_config": {"quant_method":
"mxfp4", ...}` stores each routed-experts tensor `X` (transformers holds it
[E, in, out], x @ W) as two uint8 tensors (transformers'
`integrations/mxfp4.py`):

    X_blocks  [E, out, in / 32, 16]  two 4-bit values a byte: value 2j the
                                     low nibble of byte j, 2j + 1 the high
    X_scales  [E, out, in / 32]      one E8M0 exponent per 32 values

    W[e, o, 32 g + i] = FP4[nibble i of block (e, o, g)] * 2 ** (scale - 127)

with FP4 the e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives),
then X = W transposed to [E, in, out]. Every value is a small float times a
power of two, so the dequantized weights are exact in float32 (and in
bfloat16). Which tensors are MXFP4 is read from the files (a `_blocks`
beside its `_scales`); every pair is checked against the other before a
byte of data is read, and a tensor's rows are dequantized as they are read
(`Dequantized.read_rows`), so the loader, serving conversion on load
included, reads it as any float tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import os
from typing import Any

import numpy as np

from linen_moe._src.hf.safetensors_io import Checkpoint

QUANT_METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
VALUES_PER_BLOCK = 32
FP4_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
    np.float32,
)
# quantization_config fields that say nothing about the values on disk.
_INFORMATIONAL = ("quant_method", "modules_to_not_convert", "dequantize")


def is_mxfp4(quantization_config: Any) -> bool:
  return (
      isinstance(quantization_config, Mapping)
      and quantization_config.get("quant_method") == QUANT_METHOD
  )


def check_config(
    quantization_config: Mapping, where: str | os.PathLike = "config.json"
) -> None:
  """Raises a ValueError naming the file and the field for a field of an
  MXFP4 `quantization_config` not known here (it may change the weights)."""
  unknown = sorted(set(quantization_config) - set(_INFORMATIONAL))
  if unknown:
    raise ValueError(
        f"{where}: quantization_config has field(s) {unknown} not known "
        "here for quant_method 'mxfp4'; they may change the weights, so "
        "they are not ignored."
    )


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """float32 [..., G * 32] of uint8 blocks [..., G, 16] and exponents
  [..., G] (transformers' `_convert_moe_packed_tensors` before its
  transpose)."""
  out = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
  out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
  out[..., 1::2] = FP4_VALUES[blocks >> 4]
  out *= np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
  return out.reshape(*scales.shape[:-1], -1)


class Dequantized:
  """The tensors of an MXFP4 checkpoint, each `X_blocks` / `X_scales` pair
  read as the float32 tensor X [..., in, out] it stands for.

  Stands for a `Checkpoint` wherever the loader reads one.

  Attributes:
    directory: the checkpoint directory.
    tensors: {name: TensorInfo}: each pair as X ("F32", [..., in, out]),
      every other tensor as on disk.
  """

  def __init__(self, ckpt: Checkpoint):
    """Checks every pair from the files' headers.

    Raises:
      ValueError: a `_blocks` without its `_scales` or the reverse, a
        tensor of them that is not uint8, blocks whose last axis is not 16
        bytes, or scales whose shape is not the blocks' without it; the
        message names the file and the tensor.
    """
    self.base, self.directory = ckpt, ckpt.directory
    self.pairs: dict[str, tuple[str, str]] = {}
    tensors = dict(ckpt.tensors)
    for name, info in ckpt.tensors.items():
      for suffix, other in ((BLOCKS, SCALES), (SCALES, BLOCKS)):
        if name.endswith(suffix) and name[: -len(suffix)] + other not in (
            ckpt.tensors
        ):
          raise ValueError(
              f"{info.file}: tensor {name!r} is MXFP4, but the checkpoint "
              f"has no {name[: -len(suffix)] + other!r} beside it."
          )
      if not name.endswith(BLOCKS):
        continue
      base = name[: -len(BLOCKS)]
      scales = ckpt.tensors[base + SCALES]
      self._check(name, info, base + SCALES, scales)
      *lead, out, groups, _ = info.shape
      tensors[base] = dataclasses.replace(
          info, dtype="F32", shape=(*lead, groups * VALUES_PER_BLOCK, out)
      )
      del tensors[name], tensors[base + SCALES]
      self.pairs[base] = (name, base + SCALES)
    self.tensors = tensors

  @staticmethod
  def _check(name, info, scale_name, scales) -> None:
    for n, i in ((name, info), (scale_name, scales)):
      if i.dtype != "U8":
        raise ValueError(
            f"{i.file}: tensor {n!r} is {i.dtype}; MXFP4 blocks and scales "
            "are uint8."
        )
    if len(info.shape) < 3 or info.shape[-1] != VALUES_PER_BLOCK // 2:
      raise ValueError(
          f"{info.file}: tensor {name!r} has shape {list(info.shape)}; MXFP4 "
          f"blocks are [..., out, in / {VALUES_PER_BLOCK}, "
          f"{VALUES_PER_BLOCK // 2}] bytes."
      )
    if scales.shape != info.shape[:-1]:
      raise ValueError(
          f"{scales.file}: tensor {scale_name!r} has shape "
          f"{list(scales.shape)}; the blocks {name!r} "
          f"{list(info.shape)} need one scale per block, "
          f"{list(info.shape[:-1])}."
      )

  def read_rows(
      self,
      name: str,
      lead: tuple[int, ...],
      lo: int,
      hi: int,
      out: np.ndarray | None = None,
  ) -> np.ndarray:
    """`Checkpoint.read_rows`; rows [lo, hi) of an MXFP4 tensor's
    `X[lead]` come out float32: of a matrix [in, out] (its rows are its
    input features, 32 to a block across every output row, so its blocks
    and scales are read and dequantized whole), or whole matrices
    [hi - lo, in, out] along the axis before them."""
    pair = self.pairs.get(name)
    if pair is None:
      return self.base.read_rows(name, lead, lo, hi, out)
    shape = self.tensors[name].shape
    if len(lead) == len(shape) - 2:
      rows = np.ascontiguousarray(self._matrix(pair, lead)[lo:hi])
    elif len(lead) == len(shape) - 3:
      rows = np.stack([self._matrix(pair, (*lead, i)) for i in range(lo, hi)])
    else:
      raise ValueError(
          f"{name!r}: an MXFP4 tensor {list(shape)} is read by matrices or "
          f"their rows; got leading indices {lead}."
      )
    if out is None:
      return rows
    out[...] = rows
    return out

  def _matrix(self, pair: tuple[str, str], lead: tuple[int, ...]):
    """The float32 matrix [in, out] of an MXFP4 tensor at `lead`."""
    blocks_name, scales_name = pair
    n_out = self.base.tensors[blocks_name].shape[-3]
    blocks = self.base.read_rows(blocks_name, lead, 0, n_out)
    scales = self.base.read_rows(scales_name, lead, 0, n_out)
    return dequantize(blocks, scales).T  # [out, in] -> [in, out]
