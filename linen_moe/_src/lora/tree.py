"""Adapters in a variable tree: which leaves they are, splitting them from
the frozen base and joining them back, counting them, and merging them into float kernels.

An adapter is a pair of `params` leaves `{kernel}_lora_a`, `{kernel}_lora_b`
beside the kernel they adapt (`adapters.py`), so one `params` tree holds the
base and the adapters in the layout every front end, scan, mesh and
checkpoint already reads; the trainable set is selected by name
(`is_adapter`).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.config.variables import PARAMS
from linen_moe._src.lora.adapters import SUFFIX_A
from linen_moe._src.lora.adapters import SUFFIX_B
from linen_moe._src.lora.adapters import merged_kernel
from linen_moe._src.parallel import sharding
from linen_moe._src.quantization import stored_weights


def is_adapter(path: tuple[str, ...]) -> bool:
  """Whether the `params` leaf at `path` (its dict keys) is an adapter."""
  return bool(path) and str(path[-1]).endswith((SUFFIX_A, SUFFIX_B))


def _flat(params: Mapping) -> dict[tuple[str, ...], Any]:
  return traverse_util.flatten_dict(dict(params), keep_empty_nodes=False)


def has_adapters(params: Mapping) -> bool:
  """Whether a `params` tree holds any adapter."""
  return any(is_adapter(p) for p in _flat(params))


def split(params: Mapping) -> tuple[dict, dict]:
  """(adapters, frozen): the adapter leaves of a `params` tree and the rest,
  each a nested dict in the same layout (`join` puts them back).

  Args:
    params: a `params` collection (boxed or not).

  Returns:
    The pair of trees; the first is empty when there are no adapters.
  """
  flat = _flat(params)
  adapters = {p: v for p, v in flat.items() if is_adapter(p)}
  frozen = {p: v for p, v in flat.items() if not is_adapter(p)}
  return (
      traverse_util.unflatten_dict(adapters),
      traverse_util.unflatten_dict(frozen),
  )


def join(adapters: Mapping, frozen: Mapping) -> dict:
  """The `params` tree of `split`'s two halves."""
  return traverse_util.unflatten_dict({**_flat(frozen), **_flat(adapters)})


def count_trainable(params: Mapping) -> int:
  """The number of adapter parameters in a `params` tree (arrays or
  `jax.ShapeDtypeStruct` leaves, boxed or not)."""
  params = sharding.unbox(dict(params))
  return sum(
      int(np.prod(v.shape)) for p, v in _flat(params).items() if is_adapter(p)
  )


LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")


def without_adapters(config: ModelConfig) -> ModelConfig:
  """`config` with every LoRA field at its default (no adapters): the base
  model's config.

  Args:
    config: a `ModelConfig`, with or without LoRA.

  Returns:
    The config without adapters.
  """
  fields = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
  return config.replace(**{name: fields[name] for name in LORA_FIELDS})


def check_lora(config: ModelConfig, what: str) -> None:
  """Raises unless `config` is a `ModelConfig` with adapters; `what` names
  the caller in the message."""
  if not isinstance(config, ModelConfig):
    raise TypeError(f"config must be a ModelConfig; got {type(config)}.")
  if config.moe.lora is None:
    raise ValueError(
        f"{what} needs a config with adapters: config.moe.lora_rank is 0 "
        "(set lora_rank >= 1, e.g. config.replace(lora_rank=16))."
    )


def _dequantized(node: Mapping, name: str) -> jax.Array:
  """The float32 kernel of a stored kernel `name` in `node` (values times
  scale: int8 per output channel, fp8 per tensor)."""
  values = jnp.asarray(node[name]).astype(jnp.float32)
  scale = jnp.asarray(node[name + stored_weights.SCALE_SUFFIX], jnp.float32)
  if scale.ndim != values.ndim:  # fp8: [*stack, 1] per tensor
    scale = scale.reshape(
        *scale.shape[:-1], *([1] * (values.ndim - scale.ndim + 1))
    )
  return values * scale


def merge(config: ModelConfig, variables: Mapping) -> tuple[ModelConfig, dict]:
  """Folds every adapter into its kernel: W + (alpha / r) A B.

  A serving base (QLoRA: stored int8 / fp8 expert kernels) is dequantized
  first, so the result is a plain float decoder whatever the base was.

  Args:
    config: the adapted decoder's `ModelConfig` (`lora_rank >= 1`).
    variables: its variables, adapters included (boxed or not).

  Returns:
    (config, variables): the config without adapters (and, for a serving
    base, `quantization="none"`, `serving=False`), and variables whose
    `params` hold float kernels in `config.moe.param_dtype` and no adapter;
    every other collection as given.

  Raises:
    ValueError: if `config` has no LoRA, or `params` holds no adapter.
  """
  check_lora(config, "merge")
  variables = sharding.unbox(dict(variables))
  if PARAMS not in variables or not has_adapters(variables[PARAMS]):
    raise ValueError(
        "merge found no adapters (`*_lora_a`, `*_lora_b` params) in "
        "variables: there is nothing to fold in (a checkpoint of a LoRA run "
        "holds them; a base checkpoint does not)."
    )
  moe = config.moe
  scale = moe.lora.scale
  dtype = jnp.dtype(moe.param_dtype)
  serving = moe.serving

  def fold(node):
    if not isinstance(node, Mapping):
      return node
    node = {k: fold(v) for k, v in node.items()}
    out = dict(node)
    if serving:
      for name, value in node.items():
        stored = getattr(value, "dtype", None)
        if stored is not None and stored_weights.converted(stored):
          out[name] = _dequantized(node, name).astype(dtype)
          for suffix in stored_weights.SUFFIXES[1:]:
            out.pop(name + suffix, None)
    for name in node:
      if name.endswith(SUFFIX_A):
        kernel = name[: -len(SUFFIX_A)]
        a, b = out.pop(name), out.pop(kernel + SUFFIX_B)
        out[kernel] = merged_kernel(
            jnp.asarray(out[kernel]).astype(dtype), a, b, scale
        )
    return out

  merged = {**variables, PARAMS: fold(variables[PARAMS])}
  plain = without_adapters(config)
  if serving:
    plain = plain.replace(serving=False, quantization="none")
  return plain, merged
