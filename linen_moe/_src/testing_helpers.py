"""What the tests and benchmarks share: small random layers, inputs and
tokens, error measures, a function run with its output captured (the `slow`
mark: `testing_marks`).

Never imported by the library itself (the public face is `linen_moe.testing`).
Shapes: B batch, S sequence, M emb_dim, E num_experts.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import io
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src import config as config_lib
from linen_moe._src import sharding
from linen_moe._src import variables as variables_lib
from linen_moe._src.moe import RoutedMoE
from linen_moe._src.training.data import MarkovData


def rel_err(got: Any, expected: Any) -> float:
  """||got - expected|| / ||expected|| (Frobenius), in float64."""
  got = np.asarray(got, np.float64)
  expected = np.asarray(expected, np.float64)
  return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def max_abs_diff(a: Any, b: Any) -> float:
  """The largest |a - b| over the leaves of two pytrees of one structure
  (0 for trees without leaves), in float64."""
  diffs = [
      float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y))))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  ]
  return max(diffs, default=0.0)


def flat_numpy(tree: Any) -> dict[tuple, np.ndarray]:
  """A nested dict of arrays as {key path: NumPy array}."""
  from flax import traverse_util  # noqa: PLC0415

  return {p: np.asarray(x) for p, x in traverse_util.flatten_dict(tree).items()}


def model_config(
    name: str = "tiny_mixtral",
    quantization: str = "none",
    path: str = "sparse",
    **overrides: Any,
) -> config_lib.ModelConfig:
  """`load_model_config(name)` in a quantization mode on one matmul path
  ("sparse", "dense" or "dense_dropping", see `linen_moe.PATHS`)."""
  return config_lib.load_model_config(
      name, quantization=quantization, **config_lib.PATHS[path], **overrides
  )


def random_inputs(
    emb_dim: int, batch: int = 2, seq: int = 8, seed: int = 3
) -> jax.Array:
  """<float32>[B, S, M] standard normal layer inputs."""
  return jax.random.normal(jax.random.key(seed), (batch, seq, emb_dim))


def moe_variables(
    cfg: config_lib.MoEConfig,
    seed: int = 0,
    bias_scale: float = 0.0,
    scale_range: tuple[float, float] = (0.5, 1.5),
) -> dict:
  """`RoutedMoE(cfg)`'s initialised variables (every collection: params,
  fp8 state, ...), with a per-expert scale (when the config has one) drawn
  uniformly from `scale_range` instead of the initial ones, so that a lost
  scale shows, and, when the config has a routed bias,
  `updated_by_rule/routed_bias` [E] drawn as `bias_scale` times a standard
  normal (0: the initial zeros)."""
  x = jnp.zeros((1, 2, cfg.emb_dim))
  variables = dict(sharding.unbox(RoutedMoE(cfg).init(jax.random.key(seed), x)))
  if cfg.per_expert_scale:
    variables["params"] = dict(variables["params"])
    variables["params"]["per_expert_scale"] = jax.random.uniform(
        jax.random.key(seed + 1),
        (cfg.num_experts,),
        minval=scale_range[0],
        maxval=scale_range[1],
    )
  if cfg.routed_bias:
    bias = bias_scale * jax.random.normal(
        jax.random.key(seed + 2), (cfg.num_experts,)
    )
    variables[variables_lib.UPDATED_BY_RULE] = {"routed_bias": bias}
  return variables


def moe_params(
    cfg: config_lib.MoEConfig,
    seed: int = 0,
    scale_range: tuple[float, float] = (0.5, 1.5),
) -> dict:
  """The "params" collection of `moe_variables(cfg, seed, scale_range=...)`."""
  return moe_variables(cfg, seed, scale_range=scale_range)["params"]


def markov_tokens(
    vocab_size: int, batch: int = 2, seq: int = 8, seed: int = 1
) -> jax.Array:
  """<int32>[B, S]: the first batch of `MarkovData(vocab_size)`'s stream
  `seed`."""
  return jnp.asarray(MarkovData(vocab_size).batch(0, batch, seq, seed))


def run_capturing(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[Any, str, str]:
  """(fn(*args, **kwargs), what it printed to stdout, to stderr)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    result = fn(*args, **kwargs)
  return result, out.getvalue(), err.getvalue()


def read_jsonl(path: str) -> list[dict]:
  """The JSON object of every line of the file at `path`."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]
