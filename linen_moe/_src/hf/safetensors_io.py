"""Safetensors files of a checkpoint directory: checked, read by rows, written.

A Hugging Face checkpoint is `model.safetensors`, or shards named by
`model.safetensors.index.json` (`weight_map`: tensor -> file). `Checkpoint`
opens every file with `safetensors.safe_open` (which rejects a truncated or
malformed file) and keeps each tensor's dtype, shape and byte range, so that
everything about the files is checked before a byte of data is read.

Data is read by rows: `read_rows(name, lead, lo, hi)` reads rows [lo, hi)
of the tensor's sub-array at the leading indices `lead` with one `pread`
into a fresh NumPy buffer: only those bytes, no memory map kept resident
(safetensors' NumPy front end has no bfloat16, and a map's touched pages
would count against the host as long as it is open).

`write_checkpoint` writes tensors in the same format, streamed tensor by
tensor, into shards of at most `max_shard_size` bytes with an index when
there is more than one.

Shapes are tuples of ints; a tensor is `[d0, d1, ...]` in row-major order.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
import dataclasses
import json
import math
import os
import pathlib
import re
import struct

import ml_dtypes
import numpy as np
from safetensors import SafetensorError
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Safetensors dtype codes <-> NumPy dtypes (ml_dtypes for the narrow floats).
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor's bytes are.

  Attributes:
    file: the safetensors file.
    dtype: its safetensors dtype code ("BF16", "F32", ...).
    shape: its shape.
    offset: byte offset of its data in the file.
  """

  file: pathlib.Path
  dtype: str
  shape: tuple[int, ...]
  offset: int

  @property
  def np_dtype(self) -> np.dtype:
    return DTYPES[self.dtype]


def _header(path: pathlib.Path) -> tuple[dict, int]:
  """(the JSON header, the byte offset where the data starts)."""
  with open(path, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
  return header, 8 + size


def _open(path: pathlib.Path) -> dict[str, TensorInfo]:
  """The tensors of one file, after `safe_open` has checked it whole."""
  if not path.is_file():
    raise ValueError(f"{path}: no such safetensors file.")
  try:
    with safe_open(path, "numpy") as f:
      keys = set(f.keys())
  except (SafetensorError, OSError) as e:
    raise ValueError(
        f"{path} is not a readable safetensors file (truncated or "
        f"damaged?): {e}"
    ) from e
  header, start = _header(path)
  header.pop("__metadata__", None)
  out = {}
  for name in sorted(keys):
    entry = header[name]
    if entry["dtype"] not in DTYPES:
      raise ValueError(
          f"{path}: tensor {name!r} has dtype {entry['dtype']}; readable "
          f"dtypes are {sorted(DTYPES)}."
      )
    out[name] = TensorInfo(
        path,
        entry["dtype"],
        tuple(entry["shape"]),
        start + entry["data_offsets"][0],
    )
  return out


class Checkpoint:
  """The tensors of a checkpoint directory, checked, read by rows.

  Raises ValueError (naming the file) for a missing or unreadable file, an
  index that names a file that is not there, or a tensor the index places
  in a file that does not hold it, or held by two files.

  Attributes:
    directory: the checkpoint directory.
    tensors: {name: TensorInfo} of every tensor in its files.
  """

  def __init__(self, directory: str | os.PathLike):
    self.directory = pathlib.Path(directory)
    index = self.directory / INDEX_FILE
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{index} is not a safetensors index (a JSON object with a "
            f"'weight_map'): {e}"
        ) from e
      files = sorted(set(weight_map.values()))
      for name in files:
        if not (self.directory / name).is_file():
          missing = sorted(k for k, v in weight_map.items() if v == name)
          raise ValueError(
              f"{index} names the shard {name!r}, which is not in "
              f"{self.directory} (it holds {len(missing)} tensors, e.g. "
              f"{missing[0]!r})."
          )
    elif (self.directory / SINGLE_FILE).is_file():
      weight_map, files = None, [SINGLE_FILE]
    else:
      raise ValueError(
          f"{self.directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}."
      )
    self.tensors: dict[str, TensorInfo] = {}
    for name in files:
      for key, info in _open(self.directory / name).items():
        if key in self.tensors:
          raise ValueError(
              f"Tensor {key!r} is in both {self.tensors[key].file} and "
              f"{info.file}."
          )
        self.tensors[key] = info
    if weight_map is not None:
      for key, name in sorted(weight_map.items()):
        info = self.tensors.get(key)
        if info is None or info.file.name != name:
          raise ValueError(
              f"{index} places tensor {key!r} in {name!r}, which does not "
              "hold it."
          )

  def read_rows(
      self,
      name: str,
      lead: tuple[int, ...],
      lo: int,
      hi: int,
      out: np.ndarray | None = None,
  ) -> np.ndarray:
    """Rows [lo, hi) of `tensor[lead]`: [hi - lo, *rest] for a tensor
    [*lead_dims, rows, *rest]; a 0-d `tensor[lead]` (lo, hi ignored) is
    returned as it is. Reads only those bytes, into `out` when given (a
    C-contiguous array of that shape and the tensor's dtype)."""
    info = self.tensors[name]
    shape = info.shape
    sub = shape[len(lead) :]
    if not sub:
      lo, hi, row = 0, 1, 1
    else:
      row = math.prod(sub[1:])
    flat_lead = (
        int(np.ravel_multi_index(lead, shape[: len(lead)])) if lead else 0
    )
    first = flat_lead * math.prod(sub) + lo * row
    if out is None:
      shape = (hi - lo, *sub[1:]) if sub else ()
      # Ordinary pages (see `reading.host_buffer`), recycled by malloc.
      out = np.frombuffer(
          bytearray(math.prod(shape) * info.np_dtype.itemsize), info.np_dtype
      ).reshape(shape)
    buffer = memoryview(out.reshape(-1).view(np.uint8))
    with open(info.file, "rb", buffering=0) as f:
      f.seek(info.offset + first * info.np_dtype.itemsize)
      done = 0
      while done < len(buffer):
        n = f.readinto(buffer[done:])
        if not n:
          raise ValueError(f"{info.file}: unexpected end of file in {name!r}.")
        done += n
    return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def parse_size(size: int | str) -> int:
  """Bytes of a `max_shard_size`, checked (as `save_checkpoint` reads it).

  Args:
    size: an int of bytes, or "2GB", "500MB", "1GiB" (decimal units as
      transformers', KiB..TiB binary).

  Returns:
    The bytes, > 0.

  Raises:
    ValueError: `size` is neither, or not positive.
  """
  if isinstance(size, int) and not isinstance(size, bool) and size > 0:
    return size
  match = _SIZE.match(str(size)) if isinstance(size, str) else None
  if not match:
    raise ValueError(
        f"max_shard_size={size!r} is invalid: expected a positive int of "
        "bytes or a string such as '2GB', '500MB', '1GiB'."
    )
  number, unit = float(match.group(1)), match.group(2).upper()
  base = _UNITS[unit[:1] if unit[:1] in "KMGT" else ""]
  if "I" in unit:
    base = 1024 ** ("KMGT".index(unit[0]) + 1)
  value = int(number * base)
  if value <= 0:
    raise ValueError(f"max_shard_size={size!r} must be positive.")
  return value


@dataclasses.dataclass(frozen=True)
class Planned:
  """A tensor to write: its name, dtype, shape, and how to make it.

  Attributes:
    name: the tensor's name.
    dtype: NumPy dtype on disk.
    shape: its shape.
    make: () -> the array (called once, when the tensor is written).
  """

  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  make: Callable[[], np.ndarray]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def _write_file(path: pathlib.Path, tensors: list[Planned]) -> None:
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for t in tensors:
    if t.dtype not in CODES:
      raise ValueError(
          f"Tensor {t.name!r}: no safetensors dtype for {t.dtype}."
      )
    header[t.name] = {
        "dtype": CODES[t.dtype],
        "shape": list(t.shape),
        "data_offsets": [offset, offset + t.nbytes],
    }
    offset += t.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for t in tensors:
      array = np.ascontiguousarray(t.make(), dtype=t.dtype)
      if array.shape != t.shape:
        raise ValueError(
            f"Tensor {t.name!r} came out {array.shape}, planned {t.shape}."
        )
      f.write(array.reshape(-1).view(np.uint8).data)


def write_checkpoint(
    directory: pathlib.Path, tensors: Iterable[Planned], max_shard_size: int
) -> list[pathlib.Path]:
  """Writes `tensors` as `model.safetensors`, or as shards
  `model-0000i-of-0000n.safetensors` of at most `max_shard_size` bytes each
  (a tensor larger than that gets a shard of its own) with
  `model.safetensors.index.json`. Returns the files written."""
  shards: list[list[Planned]] = [[]]
  size = 0
  for t in tensors:
    if shards[-1] and size + t.nbytes > max_shard_size:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += t.nbytes
  if len(shards) == 1:
    names = [SINGLE_FILE]
  else:
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  for name, shard in zip(names, shards, strict=True):
    _write_file(directory / name, shard)
  if len(shards) > 1:
    index = {
        "metadata": {"total_size": sum(t.nbytes for s in shards for t in s)},
        "weight_map": {
            t.name: name
            for name, shard in zip(names, shards, strict=True)
            for t in shard
        },
    }
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
  return [directory / name for name in names]
