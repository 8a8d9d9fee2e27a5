"""Fresh LoRA adapters for a decoder's loaded variables: `init_adapters`.

The adapters' names and shapes are whatever the decoder's modules create
(`linen_moe._src.lora.adapters`), so they are read off an initialisation of
the decoder itself; the tree operations (split, join, merge) are
`linen_moe._src.lora.tree`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.variables import PARAMS
from linen_moe._src.lora import tree as lora_tree
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.parallel import sharding


def init_adapters(
    config: ModelConfig,
    variables: Mapping,
    rng: jax.Array,
    seq_len: int = 2,
) -> dict:
  """`variables` (a decoder's, without adapters: e.g. loaded from a Hugging
  Face checkpoint) with fresh adapters for `config` beside their kernels:
  A drawn from `rng`, B zero, so the logits are the base's.

  Args:
    config: the `ModelConfig` with `lora_rank >= 1`; otherwise the
      variables' own (its layout, quantization and serving flag).
    variables: `{"params": ..., ...}` with no adapters.
    rng: the PRNG key of the A matrices.
    seq_len: the sample length the decoder is traced at (any).

  Returns:
    A new variables dict: every collection as given, and `params` with the
    adapters added (unboxed).

  Raises:
    ValueError: if `config` has no LoRA, or `variables` already holds
      adapters.
  """
  lora_tree.check_lora(config, "init_adapters")
  variables = sharding.unbox(dict(variables))
  if lora_tree.has_adapters(variables[PARAMS]):
    raise ValueError("variables already hold adapters (`*_lora_a`).")
  tokens = jnp.zeros((1, seq_len), jnp.int32)

  @jax.jit
  def fresh(rng):  # the base's init is dead code once only A, B are kept
    init = Decoder(config).init(rng, tokens)
    return lora_tree.split(sharding.unbox(init)[PARAMS])[0]

  return {**variables, PARAMS: lora_tree.join(fresh(rng), variables[PARAMS])}
