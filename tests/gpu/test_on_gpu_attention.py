"""On the GPU: attention as `"auto"` runs it equals the einsum reference,
in outputs and in the gradients wrt q, k and v, with a causal mask, a
sliding window and segment ids (packed documents).

On a GPU `"auto"` runs cuDNN's fused attention (`"dot_product"`) for
bfloat16 without segment ids, and blockwise attention otherwise
(`attention.resolve_implementation`); the test checks that the compiled
bfloat16 causal and windowed programs hold a cuDNN custom call there, and
records for every case what ran, its custom calls and its largest
differences. GQA (4 query heads over 2), S = 128, head width 64.
Tolerances: float32 at the highest matmul precision (no TF32) to 1e-4 of
each leaf's largest magnitude; bfloat16 to 0.02 of it (the bound of
tests/models/test_attention.py's bfloat16 checks), against the einsum in float32
of the same bf16-rounded inputs.

Skipped at collection without a GPU (tests/gpu_checks.py); rehearsed on a
CPU with LINEN_MOE_GPU_CHECKS_ON_CPU=1 (where "auto" is the einsum or
blockwise, as the CPU's rule says).
"""

from __future__ import annotations

import functools

from tests import gpu_checks

gpu_checks.skip_unless_asked()

from absl.testing import absltest  # noqa: E402
from absl.testing import parameterized  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe._src.models import attention  # noqa: E402

B, S, N, KV, D = 2, 128, 4, 2, 64
SCALE = D**-0.5
# Row 0: three documents and padding (segment 0); row 1: two documents.
SEGMENTS = np.array(
    [[1] * 40 + [2] * 50 + [3] * 30 + [0] * 8, [1] * 70 + [2] * 58], np.int32
)
MASKS = {"causal": (0, None), "window": (16, None), "segments": (0, SEGMENTS)}
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 0.02}


def _positions(segments) -> np.ndarray:
  """Positions 0.. per row, restarting in each segment."""
  if segments is None:
    return np.broadcast_to(np.arange(S), (B, S)).astype(np.int32)
  pos = np.zeros_like(segments)
  for r, row in enumerate(segments):
    for i in range(1, S):
      pos[r, i] = pos[r, i - 1] + 1 if row[i] == row[i - 1] else 0
  return pos


def _with_grads(fn, qkv):
  """fn(q, k, v) and the gradients of sum(fn * w) wrt q, k, v (w fixed
  and random, so every output counts differently)."""

  def run(*qkv):
    out = fn(*qkv)
    w = jax.random.normal(jax.random.key(3), out.shape, jnp.float32)

    def loss(*a):
      return jnp.sum(fn(*a).astype(jnp.float32) * w)

    return out, jax.grad(loss, (0, 1, 2))(*qkv)

  return jax.jit(run)


class AttentionOnGpuTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f"{mask}_{jnp.dtype(dtype).name}", mask, dtype)
      for mask in MASKS
      for dtype in (jnp.bfloat16, jnp.float32)
  )
  def test_on_gpu_auto_equals_einsum(self, mask, dtype):
    window, segments = MASKS[mask]
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, S, N, D)).astype(dtype)
    k = jax.random.normal(keys[1], (B, S, KV, D)).astype(dtype)
    v = jax.random.normal(keys[2], (B, S, KV, D)).astype(dtype)
    pos = jnp.asarray(_positions(segments))
    kw = dict(positions=pos, key_positions=pos, window=window, scale=SCALE)
    if segments is not None:
      kw.update(segment_ids=segments, key_segment_ids=segments)
    backend = jax.default_backend()
    runs = attention.resolve_implementation(
        "auto",
        platform=backend,
        q_len=S,
        kv_len=S,
        dtype=dtype,
        head_dims=(D, D),
        has_segments=segments is not None,
        self_attention=True,
    )
    auto = functools.partial(
        attention.attend,
        implementation="auto",
        self_attention=True,
        dtype=dtype,
        **kw,
    )
    reference = functools.partial(
        attention.einsum_attend, dtype=jnp.float32, **kw
    )
    wide = tuple(x.astype(jnp.float32) for x in (q, k, v))
    with jax.default_matmul_precision("highest"):
      run = _with_grads(auto, (q, k, v))
      text = run.lower(q, k, v).compile().as_text()
      got = run(q, k, v)
      want = _with_grads(reference, wide)(*wide)
    errors = gpu_checks.relative_errors(("out", "dq", "dk", "dv"), got, want)
    calls = gpu_checks.custom_call_targets(text)
    key = f"{mask}/{jnp.dtype(dtype).name}"
    gpu_checks.record(
        "attention",
        key,
        {"runs": runs, "custom_calls": calls, "relative_error": errors},
    )
    self.assertEqual(got[0].dtype, dtype)
    for part, error in errors.items():
      self.assertLessEqual(error, TOLERANCE[dtype], (key, part))
    if backend == "gpu" and dtype == jnp.bfloat16 and segments is None:
      self.assertEqual(runs, "dot_product", key)
      self.assertTrue(any("cudnn" in c for c in calls), (key, calls))


if __name__ == "__main__":
  absltest.main()
