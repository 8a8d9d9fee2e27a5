"""The layout a Hugging Face checkpoint is read into and written from: the
decoder's abstract variables, and its float parameters and rule-updated
state flattened by path (the unrolled float decoder, whatever the config's
scan and serving)."""

from __future__ import annotations

from flax import traverse_util
import jax
import jax.numpy as jnp

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.variables import CACHE
from linen_moe._src.config.variables import PARAMS
from linen_moe._src.config.variables import UPDATED_BY_RULE
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.parallel import sharding as sharding_lib

Path = tuple[str, ...]
SAMPLE_SHAPE = (1, 2)  # [B, S] tokens that size nothing


def abstract_variables(config: ModelConfig) -> dict:
  """The decoder's variables as boxed `ShapeDtypeStruct`s (no cache)."""
  sample = jax.ShapeDtypeStruct(SAMPLE_SHAPE, jnp.int32)
  shapes = jax.eval_shape(
      lambda t: Decoder(config).init(jax.random.key(0), t), sample
  )
  return {k: v for k, v in shapes.items() if k != CACHE}


def flat_params(config: ModelConfig) -> dict[Path, jax.ShapeDtypeStruct]:
  """Flat unboxed params of the unrolled float decoder of `config`."""
  unrolled = config.replace(scan_layers=False, serving=False)
  params = sharding_lib.unbox(abstract_variables(unrolled)[PARAMS])
  return traverse_util.flatten_dict(params)


def flat_state(config: ModelConfig) -> dict[Path, jax.ShapeDtypeStruct]:
  """Flat `updated_by_rule` leaves of the unrolled float decoder."""
  unrolled = config.replace(scan_layers=False, serving=False)
  state = sharding_lib.unbox(abstract_variables(unrolled).get(UPDATED_BY_RULE))
  return traverse_util.flatten_dict(state or {})
