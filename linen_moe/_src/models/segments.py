"""Packed rows: segment ids, the positions they imply, and their checks.

A packed row holds several documents side by side. `segment_ids`
<int32>[B, S] says which: 1, 2, ... for the documents of a row (each a
contiguous run of equal ids), 0 for padding. A query attends only to keys
of its own segment (`attention.attend`), rotary positions restart at 0 in
each segment (`segment_positions`), and the loss never counts a target that
crosses into the next segment, nor one in padding (`same_segment_targets`).

Shapes: B batch, S sequence.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Positions that restart at 0 where the segment id changes.

  Example: segment ids [1, 1, 1, 2, 2, 0, 0] -> positions
  [0, 1, 2, 0, 1, 0, 1] (padding counts on as a segment of its own).

  Args:
    segment_ids: <int>[B, S]; each run of equal ids is one segment.

  Returns:
    <int32>[B, S], each token's offset from the start of its run.
  """
  segment_ids = jnp.asarray(segment_ids)
  s = segment_ids.shape[-1]
  index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
  starts = jnp.concatenate(
      [
          jnp.ones(segment_ids.shape[:-1] + (1,), jnp.bool_),
          segment_ids[..., 1:] != segment_ids[..., :-1],
      ],
      axis=-1,
  )  # [B, S], True where a run begins
  start = jax.lax.cummax(jnp.where(starts, index, 0), axis=index.ndim - 1)
  return index - start


def same_segment_targets(segment_ids: jax.Array) -> jax.Array:
  """<bool>[B, S - 1]: the target at t + 1 of the prediction at t stays in
  one document (segment ids equal at t and t + 1, and not padding).

  Args:
    segment_ids: <int>[B, S], 0 = padding.

  Returns:
    <bool>[B, S - 1], False at the last token of each segment and in
    padding.
  """
  segment_ids = jnp.asarray(segment_ids)
  here, after = segment_ids[:, :-1], segment_ids[:, 1:]
  return (here == after) & (here != 0)


def _check_int_matrix(value: Any, name: str, shape: tuple[int, ...]) -> None:
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    dtype = np.asarray(value).dtype
  got = tuple(np.shape(value))
  if got != tuple(shape) or not np.issubdtype(dtype, np.integer):
    raise ValueError(
        f"{name} must be integers of the tokens' shape {list(shape)}; got "
        f"{np.dtype(dtype)}{list(got)}."
    )


def _concrete(value: Any) -> bool:
  if isinstance(value, jax.core.Tracer):
    return False
  return not (isinstance(value, jax.Array) and not value.is_fully_addressable)


def validate_segments(
    shape: tuple[int, ...],
    segment_ids: Any = None,
    positions: Any = None,
    decode: bool = False,
) -> None:
  """Checks a decoder's `segment_ids` and `positions` before any work.

  Shapes and dtypes are checked always (also when traced); the values
  (no negative segment id or position) when they are concrete.

  Args:
    shape: the tokens' shape [B, S].
    segment_ids: None, or <int>[B, S] ids >= 0 (0 = padding).
    positions: None, or <int>[B, S] positions >= 0.
    decode: the decoder keeps a KV cache (its positions follow the cache;
      neither argument applies).

  Raises:
    ValueError: naming the argument, if one is not an integer array of
      `shape`, holds a negative value, or is given with `decode`.
  """
  for name, value in (("segment_ids", segment_ids), ("positions", positions)):
    if value is None:
      continue
    if decode:
      raise ValueError(
          f"{name} is not supported by a decoding decoder (decode=True): "
          "its positions follow the KV cache; pass None."
      )
    _check_int_matrix(value, name, tuple(shape))
    if _concrete(value):
      array = np.asarray(value)
      if array.size and array.min() < 0:
        where = tuple(int(i) for i in np.argwhere(array < 0)[0])
        raise ValueError(
            f"{name}[{where[0]}, {where[1]}]={int(array[where])} is "
            f"negative; {name} must be >= 0."
        )


def resolve_positions(
    shape: tuple[int, ...],
    segment_ids: jax.Array | None,
    positions: jax.Array | None,
    start: Any = 0,
) -> jax.Array:
  """The positions a decoder runs at.

  Args:
    shape: the tokens' shape [B, S].
    segment_ids: None or <int>[B, S].
    positions: None or <int>[B, S], used as given.
    start: the first position when neither is given (the KV cache's
      index when decoding).

  Returns:
    <int32>[B, S], `positions` if given, else `segment_positions` of the
    segment ids if given, else start, start + 1, ... in every row.
  """
  if positions is not None:
    return jnp.asarray(positions, jnp.int32)
  if segment_ids is not None:
    return segment_positions(segment_ids)
  b, s = shape
  return jnp.broadcast_to(start + jnp.arange(s, dtype=jnp.int32), (b, s))
