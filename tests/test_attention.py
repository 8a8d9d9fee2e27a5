"""The attention function against a per-query NumPy loop: grouped-query
heads, windows, segment ids (packed documents see only themselves)."""

from __future__ import annotations

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

from linen_moe._src.models import attention
from tests import numpy_reference


def _inputs(b=2, s=10, n=4, kv=2, dk=8, dv=6, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, s, n, dk)).astype(np.float32)
  k = rng.normal(size=(b, s, kv, dk)).astype(np.float32)
  v = rng.normal(size=(b, s, kv, dv)).astype(np.float32)
  return q, k, v


def _restarting(segments: np.ndarray) -> np.ndarray:
  """Positions that restart at 0 in each segment of each row."""
  pos = np.zeros_like(segments)
  for r, row in enumerate(segments):
    for i in range(1, len(row)):
      pos[r, i] = pos[r, i - 1] + 1 if row[i] == row[i - 1] else 0
  return pos


class AttendTest(absltest.TestCase):

  def _check(self, window, segments=None):
    q, k, v = _inputs()
    b, s = q.shape[:2]
    pos = (
        np.broadcast_to(np.arange(s), (b, s))
        if segments is None
        else _restarting(segments)
    ).astype(np.int32)
    got = attention.attend(
        q,
        k,
        v,
        positions=jnp.asarray(pos),
        key_positions=jnp.asarray(pos),
        window=window,
        scale=0.3,
        dtype=jnp.float32,
        segment_ids=None if segments is None else jnp.asarray(segments),
        key_segment_ids=None if segments is None else jnp.asarray(segments),
    )
    want = numpy_reference.attention(
        q, k, v, pos, pos, window, 0.3, segments, segments
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def test_causal_gqa(self):
    self._check(window=0)

  def test_window(self):
    self._check(window=3)

  def test_segments(self):
    segments = np.array(
        [[1, 1, 1, 2, 2, 2, 2, 3, 3, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 2]],
        np.int32,
    )
    self._check(window=0, segments=segments)

  def test_document_in_a_packed_row_equals_it_alone(self):
    q, k, v = _inputs(b=1)
    segments = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 3]], np.int32)
    pos = _restarting(segments)
    kwargs = dict(window=0, scale=0.3, dtype=jnp.float32)
    packed = attention.attend(
        q,
        k,
        v,
        positions=pos,
        key_positions=pos,
        segment_ids=segments,
        key_segment_ids=segments,
        **kwargs,
    )
    alone = attention.attend(
        q[:, 3:7],
        k[:, 3:7],
        v[:, 3:7],
        positions=pos[:, 3:7],
        key_positions=pos[:, 3:7],
        **kwargs,
    )
    np.testing.assert_allclose(packed[:, 3:7], alone, rtol=1e-6, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
