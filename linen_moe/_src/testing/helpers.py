"""What the tests and benchmarks share: small random layers, inputs and
tokens, error measures, a function run with its output captured (the `slow`
mark: `testing_marks`).

Never imported by the library itself (the public face is `linen_moe.testing`).
Shapes: B batch, S sequence, M emb_dim, E num_experts.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import io
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.config import files as config_files
from linen_moe._src.config import moe_config as config_lib
from linen_moe._src.config import variables as variables_lib
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.layer.moe import RoutedMoE
from linen_moe._src.parallel import sharding
from linen_moe._src.training.markov_data import MarkovData
from linen_moe._src.training.metric_names import TIMING_METRICS


def rel_err(got: Any, expected: Any) -> float:
  """The relative error of `got` against `expected`, norm-wise.

  Args:
    got: an array (any shape).
    expected: the reference, of the same shape.

  Returns:
    `norm(got - expected) / norm(expected)` (Frobenius norms, in float64);
    against an all-zero `expected`, `norm(got) / 1e-30` (0 when `got` is zero
    too).
  """
  got = np.asarray(got, np.float64)
  expected = np.asarray(expected, np.float64)
  scale = max(float(np.linalg.norm(expected)), 1e-30)
  return float(np.linalg.norm(got - expected) / scale)


def max_abs_diff(a: Any, b: Any) -> float:
  """The largest absolute difference between two pytrees.

  Args:
    a: a pytree of arrays.
    b: a pytree of the same structure and shapes.

  Returns:
    `max(abs(a - b))` over every element of every leaf, in float64; 0 for
    trees without leaves.
  """
  diffs = [
      float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y))))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  ]
  return max(diffs, default=0.0)


def flat_numpy(tree: Any) -> dict[tuple, np.ndarray]:
  """A nested dict of arrays, flattened.

  Args:
    tree: nested dicts whose leaves are arrays.

  Returns:
    Each leaf as a NumPy array, keyed by its path (a tuple of keys).
  """
  from flax import traverse_util  # noqa: PLC0415

  return {p: np.asarray(x) for p, x in traverse_util.flatten_dict(tree).items()}


def config_on_path(
    name: str = "tiny_mixtral",
    quantization: str = "none",
    path: str = "sparse",
    **overrides: Any,
) -> ModelConfig:
  """A shipped config in a quantization mode on one matmul path.

  Args:
    name: a shipped config name (or a YAML path), as `load_model_config`
      takes it.
    quantization: a mode of `linen_moe.quantization.MODES`.
    path: "sparse", "dense" or "dense_dropping" (a key of
      `linen_moe.MATMUL_PATHS`).
    **overrides: other `ModelConfig` / `MoEConfig` fields.

  Returns:
    The `ModelConfig`.
  """
  return config_files.load_model_config(
      name,
      quantization=quantization,
      **config_lib.MATMUL_PATHS[path],
      **overrides,
  )


def random_inputs(
    emb_dim: int, batch: int = 2, seq: int = 8, seed: int = 3
) -> jax.Array:
  """Standard normal layer inputs.

  Args:
    emb_dim: M.
    batch: B.
    seq: S.
    seed: the seed of the draw.

  Returns:
    <float32>[B, S, M].
  """
  return jax.random.normal(jax.random.key(seed), (batch, seq, emb_dim))


def moe_variables(
    cfg: config_lib.MoEConfig,
    seed: int = 0,
    bias_scale: float = 0.0,
    scale_range: tuple[float, float] = (0.5, 1.5),
) -> dict:
  """`RoutedMoE(cfg)`'s initialised variables, made non-trivial.

  Args:
    cfg: the layer's `MoEConfig`.
    seed: the seed of the init (and, plus 1 and 2, of the scale and bias).
    bias_scale: the routed bias is `bias_scale` times a standard normal
      (0: the initial zeros); only when the config has one.
    scale_range: the per-expert scale is drawn uniformly from it instead of
      the initial ones (so that a lost scale shows); only when the config
      has one.

  Returns:
    Every collection of the init (params, fp8 state, ...), unboxed, with
    `params/per_expert_scale` [E] and `updated_by_rule/routed_bias` [E] as
    above.
  """
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
  """The "params" collection of `moe_variables`.

  Args:
    cfg: the layer's `MoEConfig`.
    seed: as `moe_variables` takes it.
    scale_range: as `moe_variables` takes it.

  Returns:
    The params (gate/kernel [M, E], wi_0 and wi_1 [E, M, H], wo [E, H, M],
    and per_expert_scale [E] when the config has one).
  """
  return moe_variables(cfg, seed, scale_range=scale_range)["params"]


def markov_tokens(
    vocab_size: int, batch: int = 2, seq: int = 8, seed: int = 1
) -> jax.Array:
  """Token ids from the synthetic Markov data.

  Args:
    vocab_size: V.
    batch: B.
    seq: S.
    seed: the data stream (see `MarkovData.batch`).

  Returns:
    <int32>[B, S], batch 0 of `MarkovData(vocab_size)`'s stream `seed`.
  """
  return jnp.asarray(MarkovData(vocab_size).batch(0, batch, seq, seed))


def run_capturing(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[Any, str, str]:
  """Calls `fn` with its output captured (e.g. a command line's `main`).

  Args:
    fn: the function.
    *args: its positional arguments.
    **kwargs: its keyword arguments.

  Returns:
    (what `fn` returned, what it printed to stdout, what to stderr).
  """
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    result = fn(*args, **kwargs)
  return result, out.getvalue(), err.getvalue()


def read_jsonl(path: str) -> list[dict]:
  """A JSON Lines file.

  Args:
    path: the file (e.g. a run's metrics.jsonl).

  Returns:
    The JSON object of each line, in order.
  """
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def tempdir(test: Any) -> str:
  """A new directory, removed when `test` ends.

  pytest does not parse absl's flags, so absltest's `create_tempdir`
  cannot be used.

  Args:
    test: the running `absltest.TestCase` (its `addCleanup` removes it).

  Returns:
    The directory's path.
  """
  directory = tempfile.mkdtemp()
  test.addCleanup(shutil.rmtree, directory, ignore_errors=True)
  return directory


class TempDirMixin:
  """For an `absltest.TestCase`: `self.tempdir()`, a new directory removed
  when the test ends (`tempdir`)."""

  def tempdir(self) -> str:
    return tempdir(self)


def run_metrics(
    directory: str,
    leave_out: tuple[str, ...] = (),
    recipe_steps: bool = True,
) -> list[dict]:
  """A run's DIR/metrics.jsonl without the step times' metrics.

  A step run again computes the same row, but not in the same time, so the
  throughput metrics (`tokens_per_s`, `model_tflops_per_s`, `mfu`) are left
  out, and so is every key of `leave_out`.

  Args:
    directory: the run's directory (`--checkpoint-dir`).
    leave_out: more top-level keys to leave out of each row.
    recipe_steps: False leaves out the steps the run was started for (the
      first row's `recipe`): a stopped run and the one it is compared with
      are started for other step counts.

  Returns:
    Each row's metrics, in order.
  """
  rows = read_jsonl(os.path.join(directory, "metrics.jsonl"))
  skip = (*TIMING_METRICS, *leave_out)
  out = []
  for row in rows:
    kept = {k: v for k, v in row.items() if k not in skip}
    if not recipe_steps and "recipe" in kept:
      kept["recipe"] = {k: v for k, v in kept["recipe"].items() if k != "steps"}
    out.append(kept)
  return out


def jaxpr_equations(jaxpr: Any) -> Iterator[Any]:
  """Every equation of `jaxpr` and of the sub-jaxprs in its equations'
  parameters (scan and cond bodies, custom_vjp rules, ...), depth first.

  Args:
    jaxpr: a `jax.extend.core.Jaxpr` or `ClosedJaxpr` (`jax.make_jaxpr`).

  Yields:
    The equations, each before those of its sub-jaxprs.
  """
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
          yield from jaxpr_equations(sub)
