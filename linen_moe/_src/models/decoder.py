"""A reference Linen decoder small enough for tests: embedding, N blocks of
(RMSNorm, causal attention with RoPE, RMSNorm, MoE), final norm, tied logits.

Shapes: B batch, S sequence, M emb_dim, N heads, D head_dim, V vocab.
"""

from __future__ import annotations

from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_moe._src import routing
from linen_moe._src import sharding
from linen_moe._src.config import ModelConfig
from linen_moe._src.expert import SharedExpert
from linen_moe._src.jit_init import JitInit
from linen_moe._src.moe import RoutedAndSharedMoE
from linen_moe._src.moe import RoutedMoE
from linen_moe._src.scan import scan_blocks
from linen_moe._src.tokens import TokenEmbed
from linen_moe._src.tokens import validate_tokens_if_concrete
from linen_moe._src.variables import CACHE


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) over the last axis, computed in float32."""
  x32 = x.astype(jnp.float32)
  scale = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (x32 * scale).astype(x.dtype)


class RMSNorm(nn.Module):
  """RMSNorm with a learned `scale` [M] initialised to 1."""

  eps: float = 1e-6

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param(
        "scale",
        nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        (x.shape[-1],),
    )
    return rms_normalize(x, self.eps) * scale.astype(x.dtype)


def apply_rope(
    x: jax.Array, positions: jax.Array, max_wavelength: float
) -> jax.Array:
  """Rotary embedding of x [B, S, N, D] at integer positions [B, S]."""
  half = x.shape[-1] // 2
  freq = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[..., None].astype(jnp.float32) * freq  # [B, S, D/2]
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Projection(nn.Module):
  """`einsum(eqn, x, kernel)` with a named kernel: an `nn.DenseGeneral` whose
  kernel carries logical axis names (DenseGeneral initialises a flattened
  kernel, which a mesh cannot constrain with the kernel's names).

  Attributes:
    eqn: the einsum, e.g. "BSM,MND->BSND".
    shape: the kernel shape.
    names: its logical axis names.
    fan_in_axes: kernel axes the input contracts (for the init's fan-in).
    dtype: compute dtype.
    param_dtype: kernel dtype.
  """

  eqn: str
  shape: tuple[int, ...]
  names: tuple[str, ...]
  fan_in_axes: tuple[int, ...]
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    out_axes = tuple(
        i for i in range(len(self.shape)) if i not in self.fan_in_axes
    )
    init = nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", self.fan_in_axes, out_axes
    )  # lecun_normal over the contracted axes, as DenseGeneral's
    kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(init, self.names),
        self.shape,
        self.param_dtype,
    )
    return jnp.einsum(self.eqn, x.astype(self.dtype), kernel.astype(self.dtype))


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention with RoPE, and a KV cache in decode mode.

  Query i attends to the keys at positions <= positions[:, i]. With `decode`,
  the keys and values live in the `cache` collection (`cached_key`,
  `cached_value`: [B, max_len, N, D], created by `init` on a [B, max_len]
  sample): a call writes its S new ones at positions[0, 0] .. + S - 1 (every
  row of the batch at the same positions) and attends over the whole cache.
  The parameters are the same in both modes.

  Attributes:
    config: the `ModelConfig`.
    decode: keep and extend a KV cache.
  """

  config: ModelConfig
  decode: bool = False

  def _cached(self, k: jax.Array, v: jax.Array, positions: jax.Array):
    """(keys, values, key positions [B, T]) after writing k, v to the cache."""
    initialized = self.has_variable(CACHE, "cached_key")
    cached_k = self.variable(CACHE, "cached_key", jnp.zeros, k.shape, k.dtype)
    cached_v = self.variable(CACHE, "cached_value", jnp.zeros, v.shape, v.dtype)
    if not initialized:  # init: the cache is shaped after the sample
      return k, v, positions
    start = (0, positions[0, 0], 0, 0)
    cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, start)
    cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, start)
    b, max_len = k.shape[0], cached_k.value.shape[1]
    key_positions = jnp.broadcast_to(jnp.arange(max_len), (b, max_len))
    return cached_k.value, cached_v.value, key_positions

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    cfg = self.config
    n, d, m = cfg.num_heads, cfg.resolved_head_dim, cfg.moe.emb_dim
    dt, pdt = cfg.moe.dtype, cfg.moe.param_dtype
    bsnd = sharding.BSM[:2] + ("activation_heads", "activation_kv")

    def project(name):  # [B, S, M] -> [B, S, N, D]
      p = Projection(
          "BSM,MND->BSND",
          (m, n, d),
          ("embed", "heads", "kv"),
          (0,),
          dt,
          pdt,
          name=name,
      )
      return sharding.constrain(p(x), bsnd)

    q = apply_rope(project("query"), positions, cfg.rope_max_wavelength)
    k = apply_rope(project("key"), positions, cfg.rope_max_wavelength)
    v = project("value")
    key_positions = positions
    if self.decode:
      k, v, key_positions = self._cached(k, v, positions)
    logits = jnp.einsum("BSND,BTND->BNST", q, k).astype(jnp.float32)
    logits = logits * d**-0.5
    causal = key_positions[:, None, :] <= positions[:, :, None]  # [B, S, T]
    logits = jnp.where(causal[:, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    attended = jnp.einsum("BNST,BTND->BSND", probs, v)
    out = Projection(
        "BSND,NDM->BSM",
        (n, d, m),
        ("heads", "kv", "embed"),
        (0, 1),
        dt,
        pdt,
        name="out",
    )
    return out(attended)


class DecoderBlock(nn.Module):
  """One block; returns `(x, aux)`, `aux` the dict of `layer_aux`'s fields
  for this block (`expert_load` <float32>[E]).

  Gemma-4 style options (`router_input_norm`, `post_moe_norms`) are config
  fields. Shared experts without post-MoE norms are added DeepSeek / Qwen
  style by `RoutedAndSharedMoE` (variables under `moe/routed_experts/` and
  `moe/shared_experts/`); with `post_moe_norms` the block normalises the
  routed and the shared output (`moe/`, `shared_experts/`) before adding.
  The signature fits `nn.scan` (carry, broadcast positions).
  `decode` keeps a KV cache in the attention (see `CausalSelfAttention`).
  """

  config: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array):
    cfg, moe_cfg = self.config, self.config.moe
    h = RMSNorm(cfg.norm_eps, name="pre_attention_norm")(x)
    attention = CausalSelfAttention(cfg, self.decode, name="attention")
    x = x + attention(h, positions)
    h = RMSNorm(cfg.norm_eps, name="pre_moe_norm")(x)
    gate_inputs = None
    if cfg.router_input_norm:
      router_scale = self.param(
          "router_input_scale",
          nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
          (moe_cfg.emb_dim,),
      )
      gate_inputs = (
          rms_normalize(x, cfg.norm_eps) * router_scale * moe_cfg.emb_dim**-0.5
      )
    if cfg.shared_in_moe:
      mlp_out, aux = RoutedAndSharedMoE(moe_cfg, name="moe")(h, gate_inputs)
    else:
      routed, aux = RoutedMoE(moe_cfg, name="moe")(h, gate_inputs)
      if cfg.post_moe_norms:
        routed = RMSNorm(cfg.norm_eps, name="post_routed_norm")(routed)
      mlp_out = routed
      if moe_cfg.shared_experts > 0:
        shared = SharedExpert(moe_cfg, name="shared_experts")(h)
        if cfg.post_moe_norms:
          shared = RMSNorm(cfg.norm_eps, name="post_shared_norm")(shared)
        mlp_out = routed + shared
    x = sharding.constrain(x + mlp_out.astype(x.dtype), sharding.BSM)
    return x, {
        "load_balance_loss": aux.load_balance_loss,
        "router_z_loss": aux.router_z_loss,
        "dropped_fraction": aux.dropped_fraction,
        "expert_load": aux.expert_fraction,
    }


def layer_aux(per_layer: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The decoder's `aux` from its blocks' aux stacked on a leading layer axis:
  `load_balance_loss` and `router_z_loss` summed over layers (both join the
  training loss), `dropped_fraction` their mean, and `expert_load`
  <float32>[L, E], each layer's share of routed assignments per expert."""
  return {
      "load_balance_loss": jnp.sum(per_layer["load_balance_loss"]),
      "router_z_loss": jnp.sum(per_layer["router_z_loss"]),
      "dropped_fraction": jnp.mean(per_layer["dropped_fraction"]),
      "expert_load": per_layer["expert_load"],
  }


def routed_bias_rule(rule_state: dict, expert_load: jax.Array, rate: float):
  """The `updated_by_rule` variables of a decoder after one step: every
  layer's `routed_bias` moved by `routing.routed_bias_update` from its row of
  `expert_load` <float32>[L, E] (scanned: `layers/.../routed_bias` [L, E];
  unrolled: `layers_{i}/.../routed_bias` [E]). Other leaves are kept."""
  flat = traverse_util.flatten_dict(rule_state)
  for path, value in flat.items():
    if path[-1] != "routed_bias":
      continue
    if path[0] == "layers":
      load = expert_load
    else:
      load = expert_load[int(path[0].removeprefix("layers_"))]
    flat[path] = routing.routed_bias_update(value, load, rate)
  return traverse_util.unflatten_dict(flat)


def embedding(cfg: ModelConfig, **kwargs) -> TokenEmbed:
  """The token embedding, `embedding` [V, M] named ("vocab", "embed").

  Rows of unit norm keep the tied logits O(1) at init; the decoders scale
  the input back up by sqrt(emb_dim) so the residual stream has unit RMS.
  An id outside [0, V) embeds as NaN (`linen_moe.tokens`).
  """
  return TokenEmbed(
      cfg.vocab_size,
      cfg.moe.emb_dim,
      embedding_init=nn.with_logical_partitioning(
          nn.initializers.normal(cfg.moe.emb_dim**-0.5), ("vocab", "embed")
      ),
      param_dtype=cfg.moe.param_dtype,
      **kwargs,
  )


def scale_embeddings(x: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Embedded tokens [B, S, M] scaled by sqrt(emb_dim), in the compute dtype:
  the unit-norm embedding rows then give the residual stream unit RMS."""
  return (x * cfg.moe.emb_dim**0.5).astype(cfg.moe.dtype)


class Decoder(JitInit, nn.Module):
  """The reference decoder: tokens <int32>[B, S] -> (logits [B, S, V], aux).

  `aux` is the dict of `layer_aux`: `load_balance_loss` and `router_z_loss`
  (summed over layers), `dropped_fraction` (mean over layers) and
  `expert_load` [L, E]. With `config.scan_layers` the blocks' variables are
  stacked on a leading layer axis under `layers/`; unrolled, they live under
  `layers_0/`, `layers_1/`, ...

  With `decode`, each attention keeps a KV cache and the decoder the number
  of tokens already in it (`cache/index`); each call appends its tokens at
  the next positions (prefill with the prompt, then one token at a time; see
  `linen_moe.decoding`). `init` on a [B, max_len] sample sizes the cache.

  Example usage:
    cfg = load_model_config("tiny_mixtral")
    model = Decoder(cfg)
    variables = model.init(jax.random.key(0), tokens)
    logits, aux = model.apply(variables, tokens)
  """

  config: ModelConfig
  decode: bool = False

  def _positions(self, tokens: jax.Array) -> jax.Array:
    """[B, S] positions of `tokens`: 0.. S-1, or after the cached ones."""
    b, s = tokens.shape
    start = 0
    if self.decode:
      initialized = self.has_variable(CACHE, "index")
      index = self.variable(CACHE, "index", jnp.zeros, (), jnp.int32)
      if initialized:
        start = index.value
        index.value = start + s
    return jnp.broadcast_to(start + jnp.arange(s, dtype=jnp.int32), (b, s))

  @nn.compact
  def __call__(self, tokens: jax.Array):
    cfg = self.config
    validate_tokens_if_concrete(tokens, cfg.vocab_size)
    embed = embedding(cfg, name="embed")
    x = scale_embeddings(embed(tokens), cfg)
    x = sharding.constrain(x, sharding.BSM)
    positions = self._positions(tokens)
    if cfg.scan_layers:
      scanned = scan_blocks(
          DecoderBlock, cfg.num_layers, in_axes=(nn.broadcast,)
      )
      x, per_layer = scanned(cfg, self.decode, name="layers")(x, positions)
    else:
      outs = []
      for i in range(cfg.num_layers):
        block = DecoderBlock(cfg, self.decode, name=f"layers_{i}")
        x, out = block(x, positions)
        outs.append(out)
      per_layer = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
    x = RMSNorm(cfg.norm_eps, name="final_norm")(x)
    logits = embed.attend(x.astype(jnp.float32))  # [B, S, V], tied weights
    logits = sharding.constrain(
        logits, sharding.BSM[:2] + ("activation_vocab",)
    )
    return logits, layer_aux(per_layer)


def scanned_to_unrolled(variables: dict, num_layers: int) -> dict:
  """Converts scanned decoder variables (`layers/` stacked on axis 0) into the
  unrolled layout (`layers_0/`, `layers_1/`, ...), in every collection."""
  out = {}
  for collection, collection_tree in variables.items():
    tree = dict(collection_tree)
    stacked = tree.pop("layers", None)
    if stacked is not None:
      for i in range(num_layers):
        tree[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    out[collection] = tree
  return out


def unrolled_to_scanned(variables: dict, num_layers: int) -> dict:
  """The inverse of `scanned_to_unrolled`."""
  out = {}
  for collection, collection_tree in variables.items():
    tree = dict(collection_tree)
    layers = [
        tree.pop(f"layers_{i}")
        for i in range(num_layers)
        if f"layers_{i}" in tree
    ]
    if layers:
      if len(layers) != num_layers:
        raise ValueError(
            f"Collection {collection!r} has {len(layers)} of {num_layers} "
            "unrolled layers."
        )
      tree["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    out[collection] = tree
  return out
