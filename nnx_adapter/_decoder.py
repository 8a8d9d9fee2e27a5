"""The NNX reference decoder, and weight interchange with the Linen one.

Shapes: B batch, S sequence, M emb_dim, V vocab, L num_layers.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import linen_moe
from linen_moe import ModelConfig
from linen_moe import frontend
from linen_moe import models
from linen_moe import sharding
from linen_moe.frontend import validate_tokens_if_concrete
from linen_moe.variables import CACHE
from linen_moe.variables import rng_dict
from nnx_adapter._adapter import Cache
from nnx_adapter._adapter import EagerToNNX
from nnx_adapter._adapter import warn_if_fp8_frozen

PyTree = dict[str, Any]
# The stacked layer axis carries the logical name "layers" (as under the
# Linen decoder's `nn.scan`), so the partitioning metadata of stacked
# variables has one name per array axis.
LAYERS_AXIS = {nnx.PARTITION_NAME: frontend.LAYERS_AXIS}


class Decoder(nnx.Module):
  """The NNX twin of `linen_moe.Decoder`: same config, same math.

  tokens <int32>[B, S] -> (logits [B, S, V], aux). `aux` is the Linen
  decoder's. The embedding, the blocks, the final norm and the head are the
  Linen decoder's modules (one implementation of the math) behind
  `EagerToNNX`, so the whole state, fp8 included, exists after `__init__`.
  The layers are laid out as `config.stack_plan` says: the stack built by
  `nnx.vmap` under `layers` (leading axis: the stack's rows) and applied
  with `nnx.scan`, every other layer `layers_{i}`. The attribute names are
  the Linen decoder's, so the state paths are its variable paths (see
  `linen_to_nnx`).

  A serving config (`linen_moe.quantization`) builds a serving decoder: its MoE
  layers hold stored kernels; `Decoder.from_linen(serve_config,
  serve_variables)` builds it straight from converted Linen variables.

  Example usage:
    cfg = load_model_config("tiny_mixtral", quantization="fp8")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    logits, aux = model(tokens, rng=jax.random.key(1))

  Args:
    config: the decoder's `ModelConfig`.
    rngs: the initialisation keys.
    sample_shape: [B, S] of the sample inputs of the eager init; no
      parameter depends on it. With `decode`, it is the cache's
      [B, max_len].
    decode: keep a KV cache (`Cache` variables, the Linen decoder's `cache`
      collection) and `index`, the tokens in it: each call appends its
      tokens at the next positions (see `greedy_generate`).
  """

  @classmethod
  def from_linen(
      cls,
      config: ModelConfig,
      variables: PyTree,
      *,
      sample_shape: tuple[int, int] = (1, 8),
  ) -> Decoder:
    """A decoder holding the Linen `variables`, none initialised.

    Built abstractly (`nnx.eval_shape`: no variable is initialised, so none
    is allocated twice) and filled by `linen_to_nnx`.

    Args:
      config: the config the variables are of (a serving config for
        `linen_moe.quantization.quantize_weights`' variables).
      variables: Linen variables of `linen_moe.Decoder(config)`, without
        `cache`.
      sample_shape: as in `Decoder`.

    Returns:
      The NNX `Decoder`.

    Raises:
      ValueError: as `linen_to_nnx`, if a variable is missing, unexpected,
        or of another shape or dtype.
    """
    abstract = nnx.eval_shape(
        lambda: cls(config, rngs=nnx.Rngs(0), sample_shape=sample_shape)
    )
    return linen_to_nnx(variables, abstract)

  def __init__(
      self,
      config: ModelConfig,
      *,
      rngs: nnx.Rngs,
      sample_shape: tuple[int, int] = (1, 8),
      decode: bool = False,
  ):
    self.config = config
    self.decode = decode
    if decode:
      self.index = Cache(jnp.zeros((), jnp.int32))
    moe = config.moe
    tokens = jnp.zeros(sample_shape, jnp.int32)  # [B, S]
    x = jnp.zeros((*sample_shape, moe.emb_dim), moe.dtype)  # [B, S, M]
    positions = jnp.broadcast_to(jnp.arange(sample_shape[1]), sample_shape)
    # The Linen decoder's embedding (initialiser, axis names); input scale
    # in `__call__`.
    self.embed = EagerToNNX(models.embedding(config), tokens, rngs=rngs)
    plan, kinds = config.stack_plan, config.block_kinds
    block_class = models.remat_block(models.DecoderBlock, config, decode)
    for i in plan.before + plan.after:
      block = block_class(config, decode, *kinds[i])
      setattr(
          self,
          frontend.layer_name(i),
          EagerToNNX(block, x, positions, rngs=rngs),
      )
    if plan.scanned:
      body, fields = frontend.stack_body(config, decode)
      body = models.remat_block(body, config, decode)

      @nnx.split_rngs(splits=plan.repeats)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=LAYERS_AXIS)
      def stacked(rngs: nnx.Rngs) -> EagerToNNX:
        return EagerToNNX(body(**fields), x, positions, rngs=rngs)

      setattr(self, frontend.STACK, stacked(rngs))
    self.final_norm = EagerToNNX(models.RMSNorm(config.norm_eps), x, rngs=rngs)
    if not config.tie_embeddings:
      self.logits = EagerToNNX(frontend.output_head(config), x, rngs=rngs)

  def __call__(
      self,
      tokens: jax.Array,
      rng: jax.Array | None = None,
      segment_ids: jax.Array | None = None,
      positions: jax.Array | None = None,
      hidden_only: bool = False,
  ):
    """Runs the decoder on a batch of token ids.

    Args:
      tokens: <int>[B, S] ids in [0, vocab_size).
      rng: feeds every RNG stream the blocks draw from at apply time (AQT
        int8 needs it whenever gradients are taken), split into one key
        per layer; None: no stream (deterministic, no router jitter).
      segment_ids: optional <int>[B, S] packed documents (0 = padding), as
        in `linen_moe.Decoder`.
      positions: optional <int>[B, S] positions >= 0; None: restarting at
        0 in each segment, as in `linen_moe.Decoder`.
      hidden_only: return the final normalized hidden state [B, S, M] in
        place of the logits (the loss applies the head, `output_kernel`,
        chunk by chunk: `linen_moe.training.hidden_decoder_loss`).

    Returns:
      A pair (logits <float32>[B, S, V], aux), the Linen decoder's.

    Raises:
      TypeError: if `tokens` is not an integer array of rank 2.
      ValueError: if a concrete id is outside [0, vocab_size); if
        `segment_ids` or `positions` is not an integer array of the tokens'
        shape or holds a negative value, or is given with `decode`.
    """
    cfg = self.config
    warn_if_fp8_frozen(self)  # a loop of one's own that freezes the scales
    tokens = validate_tokens_if_concrete(tokens, cfg.vocab_size)
    frontend.validate_segments(
        np.shape(tokens), segment_ids, positions, self.decode
    )
    tokens = jnp.asarray(tokens)
    x = frontend.scale_embeddings(self.embed(tokens), cfg)  # [B, S, M]
    start = 0
    if self.decode:
      start = self.index.get_value()
      self.index.set_value(start + tokens.shape[1])
    positions = frontend.resolve_positions(
        tokens.shape, segment_ids, positions, start
    )
    plan = cfg.stack_plan
    keys = None if rng is None else jax.random.split(rng, cfg.num_layers)
    mutable = [CACHE] if self.decode else False

    def apply_block(block, x, key):
      rngs = None if key is None else nnx.Rngs(**rng_dict(key))
      return block(x, positions, segment_ids, rngs=rngs, mutable=mutable)

    def unrolled(x, layers):
      outs = []
      for i in layers:
        key = None if keys is None else keys[i]
        x, out = apply_block(getattr(self, frontend.layer_name(i)), x, key)
        outs.append(out)
      return x, outs

    x, before = unrolled(x, plan.before)
    stacked = None
    if plan.scanned:
      # One key per stack row (a group's members draw from theirs).
      rows = None
      if keys is not None:
        rows = keys[plan.start : plan.start + plan.repeats * plan.period]
        rows = rows[:: plan.period]

      @nnx.scan(
          unroll=frontend.resolved_unroll(cfg.scan_unroll, plan.repeats),
          in_axes=(0, nnx.Carry, 0),
          out_axes=(nnx.Carry, 0),
          transform_metadata=LAYERS_AXIS,
      )
      def scan_blocks(block, x, key):
        return apply_block(block, x, key)

      x, stacked = scan_blocks(getattr(self, frontend.STACK), x, rows)
    x, after = unrolled(x, plan.after)
    per_layer = frontend.per_layer_aux(cfg, before, stacked, after)
    x = self.final_norm(x)
    if hidden_only:
      return x, frontend.layer_aux(per_layer, cfg)
    head = None if cfg.tie_embeddings else self.logits
    logits = frontend.logits_of(cfg, self.embed, head, x)  # [B, S, V]
    return logits, frontend.layer_aux(per_layer, cfg)

  def output_kernel(self) -> jax.Array:
    """The output head as one matrix.

    Returns:
      [M, V], the tied embedding's transpose or the head's kernel (as
      `linen_moe.models.output_kernel`).
    """
    if self.config.tie_embeddings:
      return self.embed.embedding.get_value().T
    return self.logits.kernel.get_value()


def init_decoder(
    config: ModelConfig, rng: jax.Array, sample_shape: tuple[int, int] = (1, 8)
) -> Decoder:
  """The NNX `Decoder(config)` holding exactly the Linen decoder's init.

  That is `linen_moe.Decoder(config).init(rng, tokens)`, so one seed starts
  both front ends at the same weights (`Decoder(config, rngs=...)` draws
  from NNX's own streams). The NNX module is built abstractly
  (`nnx.eval_shape`) and filled by `linen_to_nnx`: nothing is initialised
  twice.

  Args:
    config: the decoder's `ModelConfig`.
    rng: the PRNG key of the Linen init.
    sample_shape: [B, S] as in `Decoder`.

  Returns:
    The NNX `Decoder`.
  """
  model = nnx.eval_shape(
      lambda: Decoder(config, rngs=nnx.Rngs(0), sample_shape=sample_shape)
  )
  tokens = jnp.zeros(sample_shape, jnp.int32)  # [B, S]
  # Compiled like the Linen front end's init (`JitInit`, or inside the
  # caller's `jit_once`): an eager init, or one compiled with other options,
  # rounds some initialisers differently (by an ulp).
  variables = linen_moe.Decoder(config).init(rng, tokens)
  return linen_to_nnx(variables, model)


def _flat_variables(model: nnx.Module):
  """(Linen collection, *path) -> Variable, for every variable of `model`."""
  return {
      (nnx.variable_name_from_type(type(v)), *path): v
      for path, v in nnx.to_flat_state(nnx.state(model))
  }


def nnx_to_linen(model: nnx.Module) -> PyTree:
  """The Linen variables of an NNX model built from `EagerToNNX` modules.

  Its attribute names are the Linen names, so each variable keeps its path,
  and its type names the collection (`nnx.Param` -> `params`, `Fp8State` ->
  `_overwrite_with_gradient`, `RuleState` -> `updated_by_rule`, `Cache` ->
  `cache`).

  Args:
    model: e.g. a `Decoder`.

  Returns:
    ``{collection: {path...: array}}``, what `linen_moe.Decoder.apply`
    takes.
  """
  flat = {k: v.get_value() for k, v in _flat_variables(model).items()}
  return nnx.traversals.unflatten_mapping(flat)


def linen_to_nnx(variables: PyTree, model: nnx.Module) -> nnx.Module:
  """Loads Linen variables into `model` in place, all or nothing.

  Args:
    variables: Linen variables (e.g. from `linen_moe.Decoder.init`), boxed
      or not: every variable of the model with its shape and dtype, and
      nothing else.
    model: an NNX model built from `EagerToNNX` modules (abstract or not).

  Returns:
    `model`, holding the variables.

  Raises:
    ValueError: naming the paths (and both shapes), if a variable is
      missing or unexpected, or of another shape or dtype; nothing is
      loaded then.
  """
  given = nnx.traversals.flatten_mapping(dict(sharding.unbox(variables)))
  wanted = _flat_variables(model)
  missing = sorted(set(wanted) - set(given))
  extra = sorted(set(given) - set(wanted))
  if missing or extra:
    raise ValueError(
        f"Linen variables do not match the NNX model: missing {missing}, "
        f"unexpected {extra}."
    )
  wrong = [
      f"{'/'.join(map(str, key))}: expected "
      f"{var.get_value().dtype}{list(var.get_value().shape)}, got "
      f"{given[key].dtype}{list(given[key].shape)}"
      for key, var in wanted.items()
      if (given[key].shape, given[key].dtype)
      != (var.get_value().shape, var.get_value().dtype)
  ]
  if wrong:  # checked before anything is loaded: all or nothing
    more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
    raise ValueError(
        "Linen variables do not fit the NNX model (another config?): "
        f"{'; '.join(wrong[:3])}{more}."
    )
  for key, var in wanted.items():
    var.set_value(jnp.asarray(given[key]))  # `nnx.state` holds the Variables
  return model
