"""Reading any slice of a parameter from its tensors on disk.

`read_into(checkpoint, source, shape, index, out)` fills `out` with
`param[index]` for a parameter of `shape` whose `Source` (`tensor_names`)
is on disk, reading only the rows of W [out, in] the slice needs (the rows
a device owns, under `jax.make_array_from_callback`). A norm scale or the
embedding is read straight into `out`; a kernel, W.T, is read a block of
rows at a time and transposed into `out` in tiles of a few rows (NumPy's
whole-array transpose copies run several times slower). `host_buffer`
allocates `out` 64-byte aligned, which lets a CPU device use it as it is
(`jax.device_put` aliases an aligned buffer instead of copying it).
"""

from __future__ import annotations

import math

import numpy as np

from linen_moe._src.hf import tensor_names as tn
from linen_moe._src.hf.safetensors_io import Checkpoint
from linen_moe._src.kernels.int8_grouped import as_float32

Index = tuple[slice, ...]
_ALIGN = 64
_TILE_ROWS = 8  # rows of W transposed per copy: a tile stays in L1


def host_buffer(shape: tuple[int, ...], dtype) -> np.ndarray:
  """A zeroed C-contiguous array, 64-byte aligned, in ordinary pages: NumPy
  asks for transparent huge pages for its large arrays, and where the
  kernel compacts memory to make them (THP defrag "madvise", a common
  default) first touching such an array runs at a fifth of the speed
  (measured here: 0.2 GB/s against 1 GB/s)."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.frombuffer(bytearray(nbytes + _ALIGN), np.uint8)
  start = -raw.ctypes.data % _ALIGN
  return raw[start : start + nbytes].view(dtype).reshape(shape)


def full_index(index, shape: tuple[int, ...]) -> Index:
  """`index` (from `make_array_from_callback`: slices, maybe short) as one
  concrete slice per axis."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  out = []
  for s, n in zip(index, shape, strict=True):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"Strided index {s} is not supported.")
    out.append(slice(start, stop))
  return tuple(out)


def sizes(index: Index) -> tuple[int, ...]:
  return tuple(s.stop - s.start for s in index)


def _flat(index: Index, dims: tuple[int, ...]) -> np.ndarray:
  """Flat row-major positions in `dims` of the grid `index` selects."""
  if not dims:
    return np.zeros((1,), np.int64)
  grids = np.meshgrid(
      *(np.arange(s.start, s.stop) for s in index), indexing="ij"
  )
  return np.ravel_multi_index(tuple(g.reshape(-1) for g in grids), dims)


def _full(index: Index, dims: tuple[int, ...]) -> bool:
  return all(s == slice(0, n) for s, n in zip(index, dims, strict=True))


def _transpose_into(out2d: np.ndarray, block: np.ndarray) -> None:
  """out2d [in, rows] = block [rows, in].T, cast to out2d's dtype."""
  if block.dtype != out2d.dtype:  # contiguous: cheap beside a transpose
    block = as_float32(block) if out2d.dtype == np.float32 else block
    block = block.astype(out2d.dtype, copy=False)
  for i in range(0, block.shape[0], _TILE_ROWS):
    out2d[:, i : i + _TILE_ROWS] = block[i : i + _TILE_ROWS].T


def _transposed_into(
    ckpt: Checkpoint,
    name: str,
    lead: tuple[int, ...],
    row0: int,
    shape: tuple[int, ...],
    split: int,
    index: Index,
    out: np.ndarray,
) -> None:
  """out = kernel[index] for kernel = W.T reshaped to `shape` ([*in, *out],
  `split` in-axes), W = rows [row0, row0 + prod(out)) of tensor[lead]."""
  in_dims, out_dims = shape[:split], shape[split:]
  rows = _flat(index[split:], out_dims)
  lo, hi = int(rows[0]), int(rows[-1]) + 1  # row-major: sorted
  block = ckpt.read_rows(name, lead, row0 + lo, row0 + hi)  # [hi - lo, in]
  if len(rows) != hi - lo:
    block = block[rows - lo]
  if not _full(index[:split], in_dims):
    block = block[:, _flat(index[:split], in_dims)]
  n_in = math.prod(sizes(index[:split]))
  _transpose_into(out.reshape(n_in, -1), block)


def _columns_into(
    ckpt: Checkpoint,
    source: tn.Columns,
    shape: tuple[int, ...],
    index: Index,
    out: np.ndarray,
) -> None:
  """out = param[index] for param = tensor[..., start::step] (`Columns`):
  the rows the slice needs of each leading index's matrix, then its
  columns."""
  last = index[-1]
  cols = source.start + source.step * np.arange(last.start, last.stop)
  if len(shape) == 1:
    block = ckpt.read_rows(source.name, (), 0, source.cols)
    out[...] = (as_float32(block) if out.dtype == np.float32 else block)[cols]
    return
  lead = index[:-2]
  rows = index[-2]
  for at in np.ndindex(*sizes(lead)):
    position = tuple(s.start + i for s, i in zip(lead, at, strict=True))
    block = ckpt.read_rows(source.name, position, rows.start, rows.stop)
    block = as_float32(block) if out.dtype == np.float32 else block
    out[at] = block[:, cols]


def read_into(
    ckpt: Checkpoint,
    source: tn.Source,
    shape: tuple[int, ...],
    index,
    out: np.ndarray,
) -> np.ndarray:
  """Fills `out` (C-contiguous, of the slice's shape) with `param[index]`
  for a parameter of `shape` read from `source`; returns `out`."""
  index = full_index(index, shape)
  if isinstance(source, tn.Copy):
    info = ckpt.tensors[source.name]
    if not shape:
      out[...] = ckpt.read_rows(source.name, (), 0, 1)
    elif _full(index[1:], shape[1:]) and info.np_dtype == out.dtype:
      ckpt.read_rows(source.name, (), index[0].start, index[0].stop, out)
    else:
      rows = ckpt.read_rows(source.name, (), index[0].start, index[0].stop)
      rows = as_float32(rows) if out.dtype == np.float32 else rows
      out[...] = rows[(slice(None), *index[1:])]
    return out
  if isinstance(source, tn.Matrix):
    _transposed_into(ckpt, source.name, (), 0, shape, source.split, index, out)
    return out
  if isinstance(source, tn.Columns):
    _columns_into(ckpt, source, shape, index, out)
    return out
  if isinstance(source, tn.Reshaped):  # a bias: small, read whole
    flat = ckpt.read_rows(source.name, (), 0, math.prod(shape))
    flat = as_float32(flat) if out.dtype == np.float32 else flat
    out[...] = flat.reshape(shape)[index]
    return out
  for k, e in enumerate(range(index[0].start, index[0].stop)):
    if isinstance(source, tn.Experts):
      name, lead, row0 = source.names[e], (), 0
    else:
      name, lead, row0 = source.name, (e,), source.row0
    _transposed_into(ckpt, name, lead, row0, shape[1:], 1, index[1:], out[k])
  return out


def read(
    ckpt: Checkpoint, source: tn.Source, shape, index, dtype
) -> np.ndarray:
  """`param[index]` in `dtype`, in a fresh aligned buffer."""
  index = full_index(index, shape)
  return read_into(ckpt, source, shape, index, host_buffer(sizes(index), dtype))
