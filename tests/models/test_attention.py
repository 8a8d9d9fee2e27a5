"""The attention function against a per-query NumPy loop: grouped-query
heads, windows, segment ids (packed documents see only themselves); its
implementations (`ModelConfig.attention`) against the einsum reference, in
outputs and gradients, alone and in the decoders."""

from __future__ import annotations

import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import load_model_config
from linen_moe import testing
from linen_moe._src.models import attention
from linen_moe._src.models import attention_blockwise
from linen_moe._src.models import attention_fused
from linen_moe._src.planning import targets as plan_targets
from linen_moe._src.testing import helpers
from linen_moe.sharding import unbox
import nnx_adapter
from tests import numpy_reference
from tests import workers


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


SEGMENTS = np.array(
    [[1, 1, 1, 2, 2, 2, 2, 3, 3, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 2]],
    np.int32,
)


def _case(
    window=0, segments=None, s=10, query_from=0, seed=0, dk=8, dv=6, scale=0.3
):
  """Inputs and keyword arguments of one attention call: queries at
  positions query_from .. s - 1 over keys 0 .. s - 1 (a KV cache's layout
  when query_from > 0), restarting per segment with segment ids."""
  q, k, v = _inputs(s=s, dk=dk, dv=dv, seed=seed)
  b = q.shape[0]
  pos = (
      np.broadcast_to(np.arange(s), (b, s))
      if segments is None
      else _restarting(segments)
  ).astype(np.int32)
  kw = dict(
      positions=jnp.asarray(pos[:, query_from:]),
      key_positions=jnp.asarray(pos),
      window=window,
      scale=scale,
      dtype=jnp.float32,
  )
  if segments is not None:
    kw.update(
        segment_ids=jnp.asarray(segments[:, query_from:]),
        key_segment_ids=jnp.asarray(segments),
    )
  return (jnp.asarray(q[:, query_from:]), jnp.asarray(k), jnp.asarray(v)), kw


def _with_grads(fn, qkv, seed=3):
  """fn(q, k, v) and the gradients of sum(fn(q, k, v) * w) wrt q, k, v (w
  a fixed random weight, so every output element counts differently)."""

  @jax.jit
  def run(*qkv):
    out = fn(*qkv)
    w = jax.random.normal(jax.random.key(seed), out.shape, jnp.float32)

    def loss(*a):
      return jnp.sum(fn(*a).astype(jnp.float32) * w)

    return out, jax.grad(loss, (0, 1, 2))(*qkv)

  return run(*qkv)


def _close(test, got, want, tol):
  """Each leaf within `tol` of `want`'s largest magnitude (at least 1):
  float32 rounding of sums in another order, relative to their size."""
  del test
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(g, w, rtol=0, atol=tol * scale)


# name, window, segments, block_q, block_k, self_attention, query_from;
# every case has GQA (4 query heads over 2) and Dk = 8 != Dv = 6.
BLOCKWISE_CASES = (
    ("segments_window_shorter_than_a_block", 2, SEGMENTS, 4, 3, True, 0),
    ("window_longer_than_a_block", 7, None, 2, 3, True, 0),
)
SLOW_BLOCKWISE_CASES = (
    ("causal", 0, None, 4, 3, True, 0),
    ("segments_causal", 0, SEGMENTS, 3, 4, True, 0),
    ("window_shorter_than_a_block", 2, None, 4, 4, True, 0),
    ("segments_window_longer", 4, SEGMENTS, 2, 2, True, 0),
    ("one_block", 0, SEGMENTS, 512, 512, True, 0),
    ("cache_layout_no_skipping", 3, None, 2, 4, False, 6),
)


def _blockwise_equals_einsum(test, window, segments, bq, bk, self_attn, start):
  qkv, kw = _case(window, segments, query_from=start)
  blockwise = functools.partial(
      attention_blockwise.attend,
      self_attention=self_attn,
      block_q=bq,
      block_k=bk,
      **kw,
  )
  reference = functools.partial(attention.einsum_attend, **kw)
  _close(test, _with_grads(blockwise, qkv), _with_grads(reference, qkv), 1e-5)


class BlockwiseTest(parameterized.TestCase):
  """Blockwise == einsum to 1e-5 (float32) in outputs and in the gradients
  wrt q, k and v. S = 10 with blocks that do not divide it."""

  @parameterized.named_parameters(*BLOCKWISE_CASES)
  def test_equals_einsum(self, *case):
    _blockwise_equals_einsum(self, *case)

  def test_blocks_outside_the_window_are_skipped_not_masked(self):
    # NaN in the values of blocks a query block cannot see: a masked block
    # would turn them into 0 * NaN = NaN; a skipped one is never read.
    (q, k, v), kw = _case(window=2, s=12)
    v = v.at[:, :4].set(jnp.nan)  # key blocks 0, 1 (block_k = 2)
    out = attention_blockwise.attend(
        q, k, v, self_attention=True, block_q=4, block_k=2, **kw
    )
    self.assertTrue(np.isfinite(np.asarray(out[:, 8:])).all())  # block 2
    self.assertTrue(np.isnan(np.asarray(out[:, :4])).all())


@testing.slow
class SlowBlockwiseTest(parameterized.TestCase):

  @parameterized.named_parameters(*SLOW_BLOCKWISE_CASES)
  def test_equals_einsum(self, *case):
    _blockwise_equals_einsum(self, *case)

  def test_bfloat16_within_its_bound(self):
    # bf16 keeps 8 significant bits: the einsum rounds its logits to bf16
    # before the float32 softmax while blockwise accumulates them in
    # float32, and both round the probabilities to bf16 before the values.
    # Bound: 0.02 of each output's / gradient's largest magnitude; measured
    # 0.0054-0.0056 (0.0078-0.016 absolute on magnitudes 1.4-4.8).
    (q, k, v), kw = _case(window=0, segments=SEGMENTS)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    kw["dtype"] = jnp.bfloat16
    got = _with_grads(
        functools.partial(
            attention_blockwise.attend,
            self_attention=True,
            block_q=4,
            block_k=3,
            **kw,
        ),
        (q, k, v),
    )
    want = _with_grads(
        functools.partial(attention.einsum_attend, **kw), (q, k, v)
    )
    self.assertEqual(got[0].dtype, jnp.bfloat16)
    _close(self, got, want, 0.02)

  def test_blocks_above_the_diagonal_are_skipped(self):
    (q, k, v), kw = _case(window=0, s=12)
    v = v.at[:, 10:].set(jnp.nan)  # key block 5 (block_k = 2)
    out = attention_blockwise.attend(
        q, k, v, self_attention=True, block_q=4, block_k=2, **kw
    )
    self.assertTrue(np.isfinite(np.asarray(out[:, :8])).all())
    self.assertTrue(np.isnan(np.asarray(out[:, 10:])).all())


class DotProductTest(absltest.TestCase):

  def test_equals_einsum_on_cpu(self):
    # XLA's implementation with the exact mask: segments, a window, and
    # Dk != Dv (the values padded to Dk).
    qkv, kw = _case(window=4, segments=SEGMENTS)
    got = _with_grads(
        functools.partial(
            attention.attend,
            implementation="dot_product",
            self_attention=True,
            **kw,
        ),
        qkv,
    )
    want = _with_grads(functools.partial(attention.einsum_attend, **kw), qkv)
    _close(self, got, want, 1e-5)


def _splash_equals_einsum(test, dtype, tol, window=0, segments=None, dv=128):
  """attention="splash" against the einsum, both at the highest matmul
  precision (a TPU multiplies float32 in one bf16 pass by default)."""
  # S = 2048: two of splash's 1024-blocks a side
  qkv, kw = _case(
      window, segments, 2048, seed=1, dk=128, dv=dv, scale=128**-0.5
  )
  qkv = tuple(x.astype(dtype) for x in qkv)
  kw["dtype"] = dtype
  # "highest" for bf16 too: the kernel must take a caller's precision.
  with jax.default_matmul_precision("highest"):
    got = _with_grads(
        functools.partial(
            attention.attend, implementation="splash", self_attention=True, **kw
        ),
        qkv,
    )
    want = _with_grads(functools.partial(attention.einsum_attend, **kw), qkv)
  test.assertEqual(got[0].dtype, dtype)
  _close(test, got, want, tol)


def _packed_rows(s: int) -> np.ndarray:
  """Row 0: three documents (one across the block boundary at s / 2) and
  padding; row 1: two documents."""
  row0 = [1] * 600 + [2] * 800 + [3] * 520 + [0] * (s - 1920)
  row1 = [1] * 1400 + [2] * (s - 1400)
  return np.array([row0, row1], np.int32)


@absltest.skipUnless(
    jax.default_backend() == "tpu", "the Pallas splash kernels need a TPU"
)
class SplashOnTpuTest(absltest.TestCase):
  """attention="splash" on a TPU equals the einsum in outputs and in the
  gradients wrt q, k and v: GQA (4 query heads over 2), S = 2048 in two
  blocks, packed documents, a sliding window, Dk != Dv. Runs where a TPU
  is (benchmarks/device/README.md); CI has none. float32 to 1e-4 of each
  leaf's largest magnitude, bfloat16 to 0.02 (the bound of blockwise's
  bf16 test above)."""

  def test_causal_gqa(self):
    _splash_equals_einsum(self, jnp.float32, 1e-4)

  def test_packed_documents_and_a_window(self):
    _splash_equals_einsum(
        self, jnp.float32, 1e-4, window=200, segments=_packed_rows(2048)
    )

  def test_value_width_of_its_own(self):
    _splash_equals_einsum(self, jnp.float32, 1e-4, dv=64)

  def test_bfloat16(self):
    _splash_equals_einsum(self, jnp.bfloat16, 0.02, segments=_packed_rows(2048))

  def test_decoder_logits_and_gradients(self):
    # Gemma-4 text: sliding and full layers of their own head widths.
    _decoder_equals_einsum(
        self,
        "tiny_gemma4_text",
        True,
        "linen",
        implementation="splash",
        seq=128,
        tol=1e-4,
        num_layers=2,
        full_attention_layers=(1,),
    )


@absltest.skipUnless(
    plan_targets.libtpu_available(),
    "needs libtpu to compile for a TPU: pip install '.[tpu-plan]'",
)
class SplashCompilesForTpuTest(parameterized.TestCase):
  """Splash's forward and backward compile for TPU slices through libtpu's
  topology (no TPU; skipped without libtpu): with Gemma-4's 512-wide
  heads, 1024-row blocks overflowed a core's scoped VMEM
  (CompileTimeScopedVmemOom), which made its plans at 8192 fail."""

  @parameterized.product(target=("tpu:v5p-8", "tpu:v5e-4"), width=(256, 512))
  def test_wide_heads(self, target, width):
    proc = workers.run(
        "tests.splash_tpu_worker", target, "2048", str(width), str(width)
    )
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])


class SplashInterpretedTest(absltest.TestCase):
  """The splash path off a TPU, its kernels in Pallas's interpreter: under
  a mesh (shard_map), bf16 at a caller's "highest" precision, inside the
  caller's `jax.checkpoint` (the backward traces the forward again: the
  kernel's mask tables must not be tracers of the first trace, as they
  were until the device run of plan_vs_run.py found it)."""

  def test_under_remat_and_a_mesh(self):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa  # noqa: PLC0415

    from linen_moe import sharding  # noqa: PLC0415

    segments = np.array(
        [[1] * 75 + [2] * 100 + [3] * 65 + [0] * 16, [1] * 175 + [2] * 81],
        np.int32,
    )
    qkv, kw = _case(0, segments, 256, seed=1, dk=128, dv=128, scale=0.1)
    qkv = tuple(x.astype(jnp.bfloat16) for x in qkv)
    kw["dtype"] = jnp.bfloat16
    interpreted = functools.partial(sa.make_splash_mha, interpret=True)
    # Kernels are cached by shape: none built before or after the mock.
    attention_fused._splash_kernel.cache_clear()
    self.addCleanup(attention_fused._splash_kernel.cache_clear)
    mesh = sharding.make_mesh("data=1", jax.devices()[:1])
    with (
        mock.patch.object(sa, "make_splash_mha", interpreted),
        mock.patch.object(attention_fused, "check_splash", lambda *a: None),
        sharding.mesh_context(mesh),
        jax.default_matmul_precision("highest"),
    ):
      splash = functools.partial(
          attention.attend, implementation="splash", self_attention=True, **kw
      )
      got = _with_grads(jax.checkpoint(splash), qkv)
      want = _with_grads(functools.partial(attention.einsum_attend, **kw), qkv)
    _close(self, got, want, 0.02)


SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)  # one per query head


def _with_sink_grads(fn, qkv, sinks, seed=3):
  """`_with_grads` with the sinks differentiated too."""

  @jax.jit
  def run(q, k, v, sinks):
    out = fn(q, k, v, sinks=sinks)
    w = jax.random.normal(jax.random.key(seed), out.shape, jnp.float32)

    def loss(*a):
      return jnp.sum(fn(*a[:3], sinks=a[3]).astype(jnp.float32) * w)

    return out, jax.grad(loss, (0, 1, 2, 3))(q, k, v, sinks)

  return run(*qkv, jnp.asarray(sinks))


def _interpreted_splash(test, with_grads, qkv, **kw):
  """`with_grads` of attention="splash" with jax's kernels interpreted (so
  on a CPU), its platform check off."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # noqa: PLC0415

  interpreted = functools.partial(sa.make_splash_mha, interpret=True)
  attention_fused._splash_kernel.cache_clear()
  test.addCleanup(attention_fused._splash_kernel.cache_clear)
  with (
      mock.patch.object(sa, "make_splash_mha", interpreted),
      mock.patch.object(attention_fused, "check_splash", lambda *a: None),
  ):
    splash = functools.partial(
        attention.attend, implementation="splash", self_attention=True, **kw
    )
    return with_grads(splash, qkv)


class SinksTest(parameterized.TestCase):
  """Attention sinks (GPT-OSS: a logit per query head in each softmax's
  denominator) against the NumPy loop, in every implementation that runs
  here; their gradients (the sinks' too) against the einsum's."""

  @parameterized.parameters("einsum", "blockwise", "dot_product")
  def test_equals_numpy_and_einsum_gradients(self, implementation):
    qkv, kw = _case(window=3, segments=SEGMENTS)
    with (
        mock.patch.object(attention_blockwise, "BLOCK_Q", 4),
        mock.patch.object(attention_blockwise, "BLOCK_K", 3),
    ):
      fn = functools.partial(
          attention.attend,
          implementation=implementation,
          self_attention=True,
          **kw,
      )
      got = _with_sink_grads(fn, qkv, SINKS)
    pos = np.asarray(kw["positions"])
    seg = np.asarray(kw["segment_ids"])
    want = numpy_reference.attention(
        *qkv, pos, pos, 3, 0.3, seg, seg, sinks=SINKS
    )
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    reference = functools.partial(attention.einsum_attend, **kw)
    _close(self, got, _with_sink_grads(reference, qkv, SINKS), 1e-5)
    self.assertGreater(float(jnp.abs(got[1][3]).min()), 0.0)  # d sinks

  def test_cudnn_cannot_take_sinks(self):
    with self.assertRaisesRegex(ValueError, r"cuDNN.*no attention sinks"):
      attention_fused.check_dot_product("gpu", jnp.bfloat16, False, True, True)
    resolve = functools.partial(
        attention.resolve_implementation,
        "auto",
        platform="gpu",
        q_len=256,
        kv_len=256,
        dtype=jnp.bfloat16,
        head_dims=(64, 64),
        has_segments=False,
        self_attention=True,
    )
    self.assertEqual(resolve(has_sinks=True), "blockwise")
    self.assertEqual(resolve(has_sinks=False), "dot_product")

  @testing.slow
  def test_splash_interpreted(self):
    qkv, kw = _case(0, None, 256, seed=1, dk=128, dv=128, scale=0.1)
    grads = functools.partial(_with_sink_grads, sinks=SINKS)
    got = _interpreted_splash(self, grads, qkv, **kw)
    reference = functools.partial(attention.einsum_attend, **kw)
    _close(self, got, grads(reference, qkv), 1e-4)


class ChunkTest(parameterized.TestCase):
  """Chunked attention (Llama-4: a query sees the keys of its own chunk of C
  positions, chunks counted in each document's positions) against the
  NumPy loop in every implementation that runs here; blockwise's values
  and gradients against the einsum's, its block skipping by the chunk."""

  @parameterized.product(
      implementation=("einsum", "blockwise", "dot_product"),
      segments=(None, SEGMENTS),
  )
  def test_equals_numpy_and_einsum_gradients(self, implementation, segments):
    qkv, kw = _case(segments=segments)
    with (
        mock.patch.object(attention_blockwise, "BLOCK_Q", 4),
        mock.patch.object(attention_blockwise, "BLOCK_K", 3),
    ):
      fn = functools.partial(
          attention.attend,
          implementation=implementation,
          self_attention=True,
          chunk=3,
          **kw,
      )
      got = _with_grads(fn, qkv)
    pos = np.asarray(kw["positions"])
    seg = None if segments is None else np.asarray(kw["segment_ids"])
    want = numpy_reference.attention(*qkv, pos, pos, 0, 0.3, seg, seg, chunk=3)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    reference = functools.partial(attention.einsum_attend, chunk=3, **kw)
    _close(self, got, _with_grads(reference, qkv), 1e-5)

  def test_what_cannot_take_chunks(self):
    with self.assertRaisesRegex(ValueError, r"cuDNN.*no chunked mask"):
      attention_fused.check_dot_product(
          "gpu", jnp.bfloat16, False, True, has_chunk=True
      )
    with self.assertRaisesRegex(ValueError, r"splash.*chunks from index 0"):
      attention_fused.check_splash("tpu", 256, 256, True, True)
    resolve = functools.partial(
        attention.resolve_implementation,
        "auto",
        q_len=256,
        kv_len=256,
        dtype=jnp.bfloat16,
        head_dims=(64, 64),
        self_attention=True,
        has_chunk=True,
    )
    self.assertEqual(resolve(platform="gpu", has_segments=False), "blockwise")
    self.assertEqual(resolve(platform="tpu", has_segments=False), "splash")
    self.assertEqual(resolve(platform="tpu", has_segments=True), "blockwise")

  @testing.slow
  def test_splash_interpreted(self):
    qkv, kw = _case(0, None, 256, seed=1, dk=128, dv=128, scale=0.1)
    got = _interpreted_splash(self, _with_grads, qkv, chunk=128, **kw)
    reference = functools.partial(attention.einsum_attend, chunk=128, **kw)
    _close(self, got, _with_grads(reference, qkv), 1e-4)


class BadImplementationTest(absltest.TestCase):

  def _attend(self, implementation, **extra):
    qkv, kw = _case()
    kw.update(extra)
    return attention.attend(*qkv, implementation=implementation, **kw)

  def test_unknown(self):
    with self.assertRaisesRegex(ValueError, r"attention='flash'.*allowed"):
      self._attend("flash")

  def test_splash_needs_a_tpu(self):
    with self.assertRaisesRegex(ValueError, r"splash.*TPU.*'cpu'"):
      attention_fused.check_splash("cpu", 256, 256, True)
    if jax.default_backend() == "cpu":
      with self.assertRaisesRegex(ValueError, r"splash.*TPU.*'cpu'"):
        self._attend("splash", self_attention=True)

  def test_cudnn_takes_half_precision_only(self):
    with self.assertRaisesRegex(ValueError, r"cuDNN.*dtype='float32'"):
      attention_fused.check_dot_product("gpu", jnp.float32, False, True)
    with self.assertRaisesRegex(ValueError, r"cuDNN.*segment_ids"):
      attention_fused.check_dot_product("gpu", jnp.bfloat16, True, True)

  def test_config(self):
    cfg = load_model_config("tiny_mixtral")
    self.assertEqual(cfg.attention, "auto")
    self.assertIn("attention", cfg.run_fields())
    with self.assertRaisesRegex(
        ValueError, r"ModelConfig.attention='flash'.*blockwise"
    ):
      cfg.replace(attention="flash")

  def test_auto_rule(self):
    resolve = functools.partial(
        attention.resolve_implementation,
        "auto",
        dtype=jnp.bfloat16,
        head_dims=(128, 128),
        has_segments=False,
        self_attention=True,
    )
    long = attention.CPU_BLOCKWISE_FROM
    self.assertEqual(resolve(platform="cpu", q_len=256, kv_len=256), "einsum")
    self.assertEqual(
        resolve(platform="cpu", q_len=long, kv_len=long), "blockwise"
    )
    self.assertEqual(
        resolve(platform="gpu", q_len=256, kv_len=256), "dot_product"
    )
    self.assertEqual(resolve(platform="tpu", q_len=256, kv_len=256), "splash")
    self.assertEqual(
        resolve(platform="tpu", q_len=200, kv_len=200), "blockwise"
    )


# Small blocks, so that the decoders' 16 positions make several.
_SMALL_BLOCKS = (
    mock.patch.object(attention_blockwise, "BLOCK_Q", 4),
    mock.patch.object(attention_blockwise, "BLOCK_K", 3),
)


def _decoder_equals_einsum(
    test,
    name,
    scan,
    frontend,
    implementation="blockwise",
    seq=12,
    tol=1e-5,
    **changes,
):
  base = load_model_config(name, scan_layers=scan).replace(**changes)
  tokens = helpers.markov_tokens(base.vocab_size, 1, seq, 1)
  variables = unbox(Decoder(base).init(jax.random.key(0), tokens))

  def run(implementation):
    cfg = base.replace(attention=implementation)

    def logits(params, *_):
      tree = {**variables, "params": params}
      if frontend == "linen":
        return Decoder(cfg).apply(tree, tokens)[0]
      return nnx_adapter.Decoder.from_linen(cfg, tree)(tokens)[0]

    out, grads = _with_grads(logits, (variables["params"], None, None))
    return out, grads[0]

  with (
      _SMALL_BLOCKS[0],
      _SMALL_BLOCKS[1],
      jax.default_matmul_precision("highest"),
  ):
    got = run(implementation)
    want = run("einsum")
  _close(test, got, want, tol)


@testing.slow
class DecoderBlockwiseTest(absltest.TestCase):
  """The decoders with attention="blockwise" equal "einsum": logits and the
  gradient of sum(logits * w) wrt every parameter, to 1e-5 of each
  gradient's largest magnitude. Gemma-4 text: sliding layers and full
  layers of their own head width and KV heads with k_eq_v, q/k and value
  norms, in a scanned (sliding, full) group. Slow: 1-2 minutes on a
  loaded 2-core machine; the default run has the same decoders' logits
  against transformers' in tests/hf/test_hf.py and the gradients of the
  attention alone above."""

  def test_gemma4_linen_scanned(self):
    _decoder_equals_einsum(
        self,
        "tiny_gemma4_text",
        True,
        "linen",
        num_layers=2,
        full_attention_layers=(1,),
    )


@testing.slow
class SlowDecoderBlockwiseTest(parameterized.TestCase):

  @parameterized.product(
      name=("tiny_gemma4_text", "tiny_deepseek_v3_mla", "tiny_qwen3_moe"),
      scan=(True, False),
      frontend=("linen", "nnx"),
  )
  def test_equals_einsum(self, name, scan, frontend):
    _decoder_equals_einsum(self, name, scan, frontend)


if __name__ == "__main__":
  absltest.main()
