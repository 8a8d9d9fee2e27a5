"""Reading any slice of a parameter from its tensors on disk.

`read(checkpoint, source, shape, index, dtype)` returns `param[index]` for
a parameter of `shape` whose `Source` (`tensor_names`) is on disk, reading
only the rows of W [out, in] that the slice needs (the rows a device owns,
under `jax.make_array_from_callback`), then transposing and casting them in
one copy.
"""

from __future__ import annotations

import math

import numpy as np

from linen_moe._src.hf import tensor_names as tn
from linen_moe._src.hf.safetensors_io import Checkpoint

Index = tuple[slice, ...]


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


def _flat(index: Index, dims: tuple[int, ...]) -> np.ndarray:
  """Flat row-major positions in `dims` of the grid `index` selects."""
  if not dims:
    return np.zeros((1,), np.int64)
  grids = np.meshgrid(
      *(np.arange(s.start, s.stop) for s in index), indexing="ij"
  )
  return np.ravel_multi_index(tuple(g.reshape(-1) for g in grids), dims)


def _transposed(
    ckpt: Checkpoint,
    name: str,
    lead: tuple[int, ...],
    row0: int,
    shape: tuple[int, ...],
    split: int,
    index: Index,
    dtype,
) -> np.ndarray:
  """kernel[index] for kernel = W.T reshaped to `shape` ([*in, *out],
  `split` in-axes), W = rows [row0, row0 + prod(out)) of tensor[lead]."""
  in_dims, out_dims = shape[:split], shape[split:]
  rows = _flat(index[split:], out_dims)
  lo, hi = int(rows.min()), int(rows.max()) + 1
  block = ckpt.read_rows(name, lead, row0 + lo, row0 + hi)  # [hi - lo, in]
  if len(rows) != hi - lo:
    block = block[rows - lo]
  if any(s != slice(0, n) for s, n in zip(index[:split], in_dims, strict=True)):
    block = block[:, _flat(index[:split], in_dims)]
  sizes = tuple(s.stop - s.start for s in index)
  return np.array(block.T, dtype=dtype, order="C").reshape(sizes)


def read(
    ckpt: Checkpoint,
    source: tn.Source,
    shape: tuple[int, ...],
    index,
    dtype,
) -> np.ndarray:
  """`param[index]` in `dtype` for a parameter of `shape` read from
  `source`."""
  index = full_index(index, shape)
  if isinstance(source, tn.Copy):
    if not shape:
      return np.asarray(ckpt.read_rows(source.name, (), 0, 1), dtype)
    rows = ckpt.read_rows(source.name, (), index[0].start, index[0].stop)
    return np.asarray(rows[(slice(None), *index[1:])], dtype)
  if isinstance(source, tn.Matrix):
    return _transposed(
        ckpt, source.name, (), 0, shape, source.split, index, dtype
    )
  experts = range(index[0].start, index[0].stop)
  out = np.empty(tuple(s.stop - s.start for s in index), dtype)
  for k, e in enumerate(experts):
    if isinstance(source, tn.Experts):
      name, lead, row0 = source.names[e], (), 0
    else:
      name, lead, row0 = source.name, (e,), source.row0
    out[k] = _transposed(ckpt, name, lead, row0, shape[1:], 1, index[1:], dtype)
  return out


def nbytes(shape: tuple[int, ...], dtype) -> int:
  return math.prod(shape) * np.dtype(dtype).itemsize
