"""Rotary position embeddings, as transformers computes them.

A head's dims i and i + D/2 rotate together by the angle `position *
inv_freq[i]` (the half-split layout, transformers' `rotate_half`), the
angles and the rotation in float32, cos and sin times an attention factor.
What differs between the families is `inv_freq` and the factor:

  "default"       base ** (-2i / D)                            (Mixtral, Qwen3)
  "yarn"          YaRN: the low frequencies divided by the factor s, a
                  linear ramp between beta_fast and beta_slow rotations,
                  cos and sin times YaRN's attention factor (DeepSeek-V3)
  "proportional"  base ** (-2i / D) for i < int(fraction * D / 2), else 0:
                  the rest pass through (Gemma-4's full-attention layers)
  "llama3"        base ** (-2i / D) with wavelengths above original / low
                  divided by the factor, below original / high kept, and
                  a smooth ramp between (Llama-3's and Llama-4's)

and, with `interleave` (DeepSeek's `rope_interleave`), the lanes (2i,
2i + 1) are read as the pair i: the output is written half-split, as
transformers' `apply_rotary_pos_emb_interleave` writes it (a common
permutation of the query's and the key's lanes, which leaves q . k as a
true interleaved rotation gives it).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

KINDS = ("default", "yarn", "proportional", "llama3")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when
  factor <= 1): transformers' `get_mscale`."""
  if factor <= 1:
    return 1.0
  return 0.1 * mscale * math.log(factor) + 1.0


def inverse_frequencies(head_dim: int, base: float) -> jax.Array:
  """<float32>[D/2]: base ** (-2i / D), i < D/2."""
  return 1.0 / base ** (
      jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  )


@dataclasses.dataclass(frozen=True)
class Rope:
  """The rotary embedding of one kind of layer.

  Attributes:
    dim: D, the rotated width (even): a head's first D lanes.
    base: the RoPE base (theta).
    kind: one of `KINDS`.
    factor: YaRN's extension factor s.
    original_max_len: YaRN's pretraining context length.
    beta_fast: YaRN: rotations below which a frequency is interpolated.
    beta_slow: YaRN: rotations above which a frequency is kept.
    mscale: YaRN's `mscale` (0 = not set).
    mscale_all_dim: YaRN's `mscale_all_dim` (0 = not set).
    fraction: "proportional": the share of the pairs that rotate.
    interleave: read the pairs as adjacent lanes (2i, 2i + 1).
    truncate: YaRN: floor / ceil the correction range's ends (False: keep
      them fractional, transformers' `truncate: false`).
    low_freq_factor: "llama3": wavelengths above original_max_len / it are
      divided by `factor`.
    high_freq_factor: "llama3": wavelengths below original_max_len / it
      keep their frequency.
  """

  dim: int
  base: float
  kind: str = "default"
  factor: float = 1.0
  original_max_len: int = 0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  fraction: float = 1.0
  interleave: bool = False
  truncate: bool = True
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Rope.kind={self.kind!r}; allowed {KINDS}.")
    if self.dim < 2 or self.dim % 2:
      raise ValueError(f"Rope.dim={self.dim} must be even and >= 2.")

  @property
  def scale(self) -> float:
    """The factor on cos and sin: YaRN's attention factor, transformers'
    g(mscale) / g(mscale_all_dim) when both are set, else g(1)."""
    if self.kind != "yarn":
      return 1.0
    if self.mscale and self.mscale_all_dim:
      return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
          self.factor, self.mscale_all_dim
      )
    return yarn_mscale(self.factor)

  def inverse_frequencies(self) -> jax.Array:
    """<float32>[D/2], one per rotated pair."""
    d = self.dim
    if self.kind == "default":
      return inverse_frequencies(d, self.base)
    if self.kind == "proportional":
      angles = int(self.fraction * d // 2)
      freq = inverse_frequencies(d, self.base)
      return jnp.where(jnp.arange(d // 2) < angles, freq, 0.0)
    if self.kind == "llama3":
      return self._llama3()
    return self._yarn()

  def _llama3(self) -> jax.Array:
    """transformers' `_compute_llama3_parameters`, in float32."""
    freq = inverse_frequencies(self.dim, self.base)
    original, factor = self.original_max_len, self.factor
    low, high = self.low_freq_factor, self.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = jnp.where(wavelen > original / low, freq / factor, freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return jnp.where(medium, smoothed, scaled)

  def _yarn(self) -> jax.Array:
    """transformers' `_compute_yarn_parameters` (the correction range
    truncated unless `truncate` is False), in float32 as it computes it."""
    d, base = self.dim, self.base

    def correction_dim(rotations: float) -> float:
      return (
          d * math.log(self.original_max_len / (rotations * 2 * math.pi))
      ) / (2 * math.log(base))

    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
      high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (self.factor * pos_freqs)
    ramp = jnp.clip(
        (jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0, 1
    )
    keep = 1 - ramp  # the share of each pair that keeps its frequency
    return interpolation * (1 - keep) + extrapolation * keep

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, S, N, D] rotated at integer positions [B, S], in x's dtype:
    its first `dim` lanes (D >= dim; the others pass through, GLM-4.5's and
    MiniMax-M2's partial rotary)."""
    if x.shape[-1] < self.dim:
      raise ValueError(f"Rope of dim {self.dim} applied to {x.shape}.")
    if x.shape[-1] > self.dim:
      rotated = self(x[..., : self.dim], positions)
      return jnp.concatenate([rotated, x[..., self.dim :]], axis=-1)
    freq = self.inverse_frequencies()  # [D/2]
    angle = positions[..., None].astype(jnp.float32) * freq  # [B, S, D/2]
    scale = self.scale
    sin = (jnp.sin(angle) * scale)[:, :, None, :]
    cos = (jnp.cos(angle) * scale)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if self.interleave:
      x1, x2 = x32[..., 0::2], x32[..., 1::2]  # [B, S, N, D/2]
    else:
      x1, x2 = jnp.split(x32, 2, axis=-1)  # [B, S, N, D/2]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """The default rotary embedding of x [B, S, N, D] at positions [B, S]."""
  return Rope(x.shape[-1], base)(x, positions)


def rope_of(config, dim: int, full: bool = False) -> Rope:
  """The `Rope` of a layer of `config` (a `ModelConfig`) of head width
  `dim` (rotating its first `rotary_dim` lanes when set): a full-attention layer's (`full_rope_base`, "proportional" with
  `full_rope_fraction`), or the others' (`rope_type`, YaRN's fields,
  `rope_interleave`); a full-attention layer without a base or share of
  its own takes the others' (GPT-OSS's YaRN on both kinds)."""
  if full and (config.full_rope_base or config.full_rope_fraction < 1):
    fraction = config.full_rope_fraction
    return Rope(
        dim,
        config.full_rope_base or config.rope_max_wavelength,
        "proportional" if fraction < 1 else "default",
        fraction=fraction,
        interleave=config.rope_interleave,
    )
  return Rope(
      config.rotary_dim or dim,
      config.rope_max_wavelength,
      config.rope_type,
      factor=config.rope_factor,
      original_max_len=config.rope_original_max_len,
      beta_fast=config.rope_beta_fast,
      beta_slow=config.rope_beta_slow,
      mscale=config.rope_mscale,
      mscale_all_dim=config.rope_mscale_all_dim,
      interleave=config.rope_interleave,
      truncate=config.rope_truncate,
      low_freq_factor=config.rope_low_freq_factor,
      high_freq_factor=config.rope_high_freq_factor,
  )
