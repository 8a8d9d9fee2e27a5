"""Attention through fused kernels: `jax.nn.dot_product_attention` (cuDNN's
flash attention on NVIDIA GPUs, XLA's implementation elsewhere) and the
Pallas splash attention kernels on TPU.

Both compute `attention.attend`'s function. What they cannot take is a
`ValueError` naming why, raised while tracing, before any work (never a
quiet fallback):

- "dot_product" on a GPU runs cuDNN (`implementation="cudnn"`): bfloat16 or
  float16 only, a causal mask by index (the keys must be the queries' own
  tokens whose positions count up by one, `self_attention`), a window as
  cuDNN's left window, and no segment ids (jax.nn's cuDNN path takes
  segments only as a dense [S, T] bias, which is what this is meant to
  avoid). Elsewhere it runs XLA's implementation with the exact
  position / window / segment mask (`attention_mask.attention_mask`), so any
  layout works; its scores are [B, N, S, T], as the einsum's.
- "splash" runs only on TPU, with `self_attention` (its causal and local
  masks are by index) and S a multiple of 128; segment ids are the kernel's
  own `SegmentIds`. Under a mesh it runs in `shard_map` over the mesh axes of
  "activation_batch" and "activation_heads".

Both take Dk != Dv (MLA): "dot_product" pads the narrower side with zeros
(zeros add nothing to a dot product and the scale is explicit), and splash
takes a value width of its own.

Chunked attention (Llama-4): XLA's "dot_product" masks by positions as the
others; splash uses jax's `ChunkedCausalMask`, whose chunks count from
index 0, so not beside segment ids; cuDNN has no chunked mask.

Attention sinks (GPT-OSS, a logit per query head in every softmax's
denominator): splash takes them natively (its kernels start each row's
running maximum at the sink); XLA's "dot_product" gets one extra key of
zeros (q . 0 = 0) with a zero value whose bias is the sink; cuDNN has no
such input, so there it is a ValueError.

Shapes as `attention.py`: q [B, S, N, Dk], k [B, T, K, Dk], v [B, T, K, Dv].
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.models.attention_mask import attention_mask
from linen_moe._src.parallel import sharding

CUDNN_DTYPES = ("bfloat16", "float16")
SPLASH_MULTIPLE = 128
# Query and key blocks: the largest of these that divides S; the products
# run on key slices of SPLASH_COMPUTE_BLOCK, and dq, dk, dv come from one
# fused backward kernel. On a TPU v5e (jax 0.10.2, Qwen3-30B-A3B heads, bf16,
# fwd + bwd) this took 15.6 ms at S = 8192 and 5.1 ms at 4096, against 21.7
# and 6.7 with 512 everywhere and separate dq / dkv kernels
# (`benchmarks/model/bench_attention.py accelerator`; benchmarks/device/).
SPLASH_BLOCKS = (1024, 512, 256, 128)
# A block's rows times the head width, at most: the fused backward's
# buffers of 1024-row blocks of Gemma-4's 512-wide heads overflow a TPU
# core's scoped VMEM (libtpu: CompileTimeScopedVmemOom, v5p, S = 8192).
SPLASH_BLOCK_ELEMENTS = 1024 * 256
SPLASH_COMPUTE_BLOCK = 512


def _pad_last(x: jax.Array, width: int) -> jax.Array:
  if x.shape[-1] == width:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def check_dot_product(
    platform: str,
    dtype: jnp.dtype,
    has_segments: bool,
    self_attention: bool,
    has_sinks: bool = False,
    has_chunk: bool = False,
) -> None:
  """Raises a ValueError naming why "dot_product" cannot run this call on
  `platform`."""
  if platform != "gpu":
    return
  if has_chunk:
    raise ValueError(
        "attention='dot_product' on GPU runs cuDNN's fused attention, which "
        "has no chunked mask (ModelConfig.attention_chunk); use 'blockwise' "
        "or 'einsum'."
    )
  if has_sinks:
    raise ValueError(
        "attention='dot_product' on GPU runs cuDNN's fused attention, which "
        "has no attention sinks (ModelConfig.attention_sinks); use "
        "'blockwise' or 'einsum'."
    )
  name = jnp.dtype(dtype).name
  if name not in CUDNN_DTYPES:
    raise ValueError(
        "attention='dot_product' on GPU runs cuDNN's fused attention, which "
        f"takes {CUDNN_DTYPES} only, not dtype={name!r}; use 'blockwise' or "
        "'einsum'."
    )
  if has_segments:
    raise ValueError(
        "attention='dot_product' on GPU (cuDNN) cannot take segment_ids "
        "without a dense [S, T] mask; use 'blockwise' for packed sequences."
    )
  if not self_attention:
    raise ValueError(
        "attention='dot_product' on GPU (cuDNN) masks by index and needs the "
        "queries' own keys (self-attention, not a KV cache)."
    )


def dot_product_attend(
    q,
    k,
    v,
    *,
    positions,
    key_positions,
    window,
    scale,
    dtype,
    segment_ids,
    key_segment_ids,
    self_attention,
    platform,
    sinks=None,
    chunk=0,
):
  """`jax.nn.dot_product_attention` (see the module docstring)."""
  check_dot_product(
      platform,
      dtype,
      segment_ids is not None,
      self_attention,
      sinks is not None,
      chunk > 0,
  )
  dv = v.shape[-1]
  width = max(q.shape[-1], dv)
  q, k, v = (_pad_last(x.astype(dtype), width) for x in (q, k, v))
  if platform == "gpu":
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=True,
        local_window_size=(window - 1, 0) if window > 0 else None,
        implementation="cudnn",
    )
  else:
    visible = attention_mask(
        positions, key_positions, window, segment_ids, key_segment_ids, chunk
    )
    bias = None
    if sinks is not None:  # one more key: q . 0 = 0, bias = the sink, v = 0
      b, t, kv = k.shape[:3]
      zero = jnp.zeros((b, 1, kv, width), dtype)
      k, v = jnp.concatenate([k, zero], 1), jnp.concatenate([v, zero], 1)
      visible = jnp.pad(visible, ((0, 0), (0, 0), (0, 1)), constant_values=True)
      bias = jnp.zeros((1, q.shape[2], 1, t + 1), jnp.float32)
      bias = bias.at[0, :, 0, t].set(sinks.astype(jnp.float32)).astype(dtype)
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=bias,
        mask=visible[:, None],
        scale=scale,
        implementation="xla",
    )
  return out[..., :dv]


def check_splash(
    platform: str,
    s: int,
    t: int,
    self_attention: bool,
    chunk_with_segments: bool = False,
) -> None:
  """Raises a ValueError naming why "splash" cannot run this call."""
  if platform != "tpu":
    raise ValueError(
        "attention='splash' runs the Pallas TPU splash attention kernels; "
        f"the platform here is {platform!r}. Use 'auto', 'blockwise', "
        "'dot_product' or 'einsum'."
    )
  if not self_attention:
    raise ValueError(
        "attention='splash' masks by index and needs the queries' own keys "
        "(self-attention, not a KV cache)."
    )
  if s % SPLASH_MULTIPLE or s != t:
    raise ValueError(
        "attention='splash' needs a sequence length that is a multiple of "
        f"{SPLASH_MULTIPLE}, got S={s} (keys T={t})."
    )
  if chunk_with_segments:
    raise ValueError(
        "attention='splash' counts its chunks from index 0, and packed "
        "documents (segment ids) start theirs at each document's first "
        "token; use 'blockwise' for chunked attention over packed rows."
    )


def at_default_precision(fn):
  """`fn`, its forward and its backward traced at the default matmul
  precision, whatever the caller's `jax.default_matmul_precision`.

  Mosaic rejects a float32 contract precision on 16-bit operands ("Bad lhs
  type"), which a caller's "highest" would ask of splash's products (their
  bf16 products are exact in float32 anyway); the backward's kernels are
  traced when the caller's gradient runs, so the context is set there too.
  """

  def traced(*args):
    with jax.default_matmul_precision("default"):
      return fn(*args)

  def forward(*args):
    with jax.default_matmul_precision("default"):
      return jax.vjp(fn, *args)

  def backward(vjp, cotangent):
    with jax.default_matmul_precision("default"):
      return vjp(cotangent)

  call = jax.custom_vjp(traced)
  call.defvjp(forward, backward)
  return call


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, s: int, window: int, head_dim: int, chunk=0):
  """The splash kernel of these shapes, its mask tables NumPy constants.

  Built in a thread of its own, outside the caller's trace and mesh: built
  while tracing, the tables would be tracers of that trace (and the
  backward, traced again under a caller's remat, would find them escaped);
  built under the caller's `jax.set_mesh`, they would be placed on the
  mesh's devices, which a plan's TPU topology only describes.
  """
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    kernel = pool.submit(
        _build_splash_kernel, heads, s, window, head_dim, chunk
    ).result()
  return kernel


def _build_splash_kernel(
    heads: int, s: int, window: int, head_dim: int, chunk: int = 0
):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # noqa: PLC0415

  if chunk > 0:  # not re-exported by the package in jax 0.12
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,  # noqa: PLC0415
    )

    one = masks.ChunkedCausalMask((s, s), chunk_size=chunk)
  elif window > 0:
    one = sa.LocalMask((s, s), window_size=(window - 1, 0), offset=0)
  else:
    one = sa.CausalMask((s, s))
  block = next(
      (
          b
          for b in SPLASH_BLOCKS
          if s % b == 0 and b * head_dim <= SPLASH_BLOCK_ELEMENTS
      ),
      SPLASH_BLOCKS[-1],
  )
  compute = min(SPLASH_COMPUTE_BLOCK, block)
  sizes = sa.BlockSizes(
      block_q=block,
      block_kv=block,
      block_kv_compute=compute,
      block_q_dkv=block,
      block_kv_dkv=block,
      block_kv_dkv_compute=compute,
      use_fused_bwd_kernel=True,
  )
  kernel = sa.make_splash_mha(
      mask=sa.MultiHeadMask([one] * heads),
      block_sizes=sizes,
      head_shards=1,
      q_seq_shards=1,
  )
  return jax.tree.map(np.asarray, kernel)


def splash_attend(
    q,
    k,
    v,
    *,
    window,
    scale,
    dtype,
    segment_ids,
    self_attention,
    platform,
    sinks=None,
    chunk=0,
):
  """The splash attention kernels (see the module docstring); `sinks`
  <float32>[N] or None; `chunk` > 0: jax's `ChunkedCausalMask` (chunks
  from index 0: no segment ids)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # noqa: PLC0415

  b, s, n, _ = q.shape
  t = k.shape[1]
  check_splash(
      platform, s, t, self_attention, chunk > 0 and segment_ids is not None
  )
  if segment_ids is None:
    segment_ids = jnp.zeros((b, s), jnp.int32)
  q = (q.astype(jnp.float32) * scale).astype(dtype)
  # [B, heads, S, D], as the kernel reads one row's heads
  q, k, v = (jnp.swapaxes(x.astype(dtype), 1, 2) for x in (q, k, v))

  if sinks is None:
    sinks = jnp.full((n,), -jnp.inf, jnp.float32)  # no sink: e^-inf = 0
    with_sinks = False
  else:
    sinks, with_sinks = sinks.astype(jnp.float32), True

  def body(q, k, v, seg, sinks):
    kernel = _splash_kernel(
        q.shape[1], s, window, max(q.shape[-1], v.shape[-1]), chunk
    )

    def one(q, k, v, seg, sinks):
      return kernel(
          q,
          k,
          v,
          segment_ids=sa.SegmentIds(q=seg, kv=seg),
          sinks=sinks if with_sinks else None,
      )

    heads = jax.vmap(one, in_axes=(0, 0, 0, 0, None))
    if jnp.dtype(dtype).itemsize == 2:
      heads = at_default_precision(heads)
    return heads(q, k, v, seg.astype(jnp.int32), sinks)

  mesh = sharding.current_mesh()
  if mesh is None:
    out = body(q, k, v, segment_ids, sinks)
  else:
    batch = sharding.mesh_axes("activation_batch", mesh) or None
    heads = sharding.mesh_axes("activation_heads", mesh) or None
    spec = jax.sharding.PartitionSpec(batch, heads, None, None)
    out = jax.shard_map(
        body,
        in_specs=(
            spec,
            spec,
            spec,
            jax.sharding.PartitionSpec(batch, None),
            jax.sharding.PartitionSpec(heads),
        ),
        out_specs=spec,
        check_vma=False,
    )(q, k, v, segment_ids, sinks)
  return jnp.swapaxes(out, 1, 2)  # [B, S, N, Dv]
