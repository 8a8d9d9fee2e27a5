"""Each process's share of a global batch, and the global array made of them.

A global batch of B rows is placed on a mesh by a sharding; a process
holds the rows of its own devices, one block [lo, hi) of them (`rows`).
The pipeline reads only those rows (`pipeline.DataPipeline.train_dataset`),
and `global_batch` assembles the global `jax.Array` from every process's
block (`linen_moe.distributed.global_array`). The block of each process
follows from the sharding alone, so the rows are the same global rows on
one process or many.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from linen_moe._src.parallel import distributed


def process_rows(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> slice:
  """The rows of a global batch that this process's devices hold.

  Args:
    sharding: the batch's sharding.
    shape: the global batch's shape, [B, ...].

  Returns:
    `slice(lo, hi)`, the rows [lo, hi) of the B rows.

  Raises:
    ValueError: they are not one block of rows (a sharding that gives a
      process rows that are not contiguous).
  """
  batch = shape[0]
  spans = set()
  for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
    rows = index[0] if index else slice(None)
    spans.add((rows.start or 0, batch if rows.stop is None else rows.stop))
  spans = sorted(spans)
  lo, hi, reach = spans[0][0], max(s[1] for s in spans), spans[0][0]
  for start, stop in spans:
    if start > reach:
      raise ValueError(
          f"process {jax.process_index()} holds rows {spans} of the batch of"
          f" {batch}: not one block, which the data pipeline needs."
      )
    reach = max(reach, stop)
  return slice(lo, hi)


def block_of(rows: slice | None, batch_size: int) -> tuple[int, int]:
  """(q, Q): `rows` is block q of Q equal blocks of the global batch.

  Raises:
    ValueError: it is not (its size must divide `batch_size`, and its start
      be a multiple of it).
  """
  if rows is None:
    return 0, 1
  lo, hi = rows.start or 0, rows.stop
  size = hi - lo
  if size < 1 or batch_size % size or lo % size or hi > batch_size:
    raise ValueError(
        f"rows={lo}:{hi} is not an equal block of the global batch of "
        f"{batch_size} rows (its size must divide {batch_size}, its start be"
        " a multiple of its size)."
    )
  return lo // size, batch_size // size


def global_batch(
    local: Mapping[str, np.ndarray],
    rows: slice | None,
    sharding: jax.sharding.Sharding,
    batch_size: int,
) -> dict[str, jax.Array]:
  """The global arrays of a batch from this process's `rows` of it.

  Args:
    local: {name: <...>[hi - lo, ...]} this process's rows (the pipeline's
      batch; every process calls this with its own).
    rows: which rows of the global batch they are (None: all).
    sharding: the sharding of every array of the batch.
    batch_size: B, the global batch.

  Returns:
    A dict of the same names, each a global `jax.Array` [B, ...] in
    `sharding`.
  """
  lo = 0 if rows is None else rows.start or 0
  out = {}
  for name, value in local.items():
    shape = (batch_size, *value.shape[1:])

    def shard(index, value=value):
      first = index[0] if index else slice(None)
      start = (first.start or 0) - lo
      stop = (batch_size if first.stop is None else first.stop) - lo
      return value[(slice(start, stop), *index[1:])]

    out[name] = distributed.global_array(shape, sharding, shard)
  return out
