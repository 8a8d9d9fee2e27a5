"""Serving exports of a training checkpoint: write, read back, read in place.

`export` writes a checkpoint's `variables` (no optimizer state, floating
params optionally cast) as an orbax directory that `load_export` reads;
`read_variables` reads the model of a training checkpoint directly, with its
config.
"""

from __future__ import annotations

import os

from flax import traverse_util
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from linen_moe._src.checkpoint.manager import Checkpoints
from linen_moe._src.checkpoint.meta import config_from_dict
from linen_moe._src.checkpoint.tree import VARIABLES
from linen_moe._src.checkpoint.tree import abstract
from linen_moe._src.checkpoint.tree import layer_plan
from linen_moe._src.config.model_config import ModelConfig

EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def export(
    checkpoint_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    step: int | None = None,
) -> int:
  """Writes the serving variables of a training checkpoint to `out`.

  They are the checkpoint's `variables` (`params`, the fp8 scales and amax
  histories, every other collection), what `Decoder.apply` takes: no
  optimizer state, no step. With `dtype` (one of `EXPORT_DTYPES`) the
  floating `params` are cast to it as they are read; fp8 state stays as
  saved. `out` becomes an orbax checkpoint directory (`load_export` reads
  it) whose metadata holds the model config and the step.

  Args:
    checkpoint_dir: a `Checkpoints` directory.
    out: the export directory to create; must not exist.
    dtype: cast the floating `params` to it (one of `EXPORT_DTYPES`); None
      keeps them as saved.
    step: the step to export; default the latest.

  Returns:
    The step exported.

  Raises:
    ValueError: if `dtype` is not in `EXPORT_DTYPES`, `out` exists,
      `checkpoint_dir` does not exist or holds no checkpoint (of `step`).
    DamagedCheckpointError: if the checkpoint cannot be read.
  """
  if dtype is not None and dtype not in EXPORT_DTYPES:
    raise ValueError(
        f"export: dtype={dtype!r} is invalid: allowed {EXPORT_DTYPES}."
    )
  out = os.path.abspath(os.fspath(out))
  if os.path.exists(out):
    raise ValueError(f"export: out={out} exists; an export never overwrites.")
  variables, meta, step = _read_variables(checkpoint_dir, dtype, step)
  checkpointer = ocp.StandardCheckpointer()
  info = {
      "model_config": meta.get("model_config"),
      "step": step,
      "source": meta["source"],
      "params_dtype": dtype,
  }
  checkpointer.save(out, variables, custom_metadata=info)
  checkpointer.wait_until_finished()
  checkpointer.close()
  return step


def _read_variables(checkpoint_dir, dtype: str | None, step: int | None):
  """(variables on the default device, meta + "source", step) of a
  training checkpoint; floating params cast to `dtype` as they are read."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with Checkpoints(checkpoint_dir, create=False) as ckpts:
    step = ckpts._step(step)  # noqa: SLF001
    meta = {**ckpts.meta(step), "source": ckpts.step_dir(step)}
    target = {}
    for path, leaf in ckpts.saved_leaves(step).items():
      if path[0] != VARIABLES:
        continue
      cast = dtype and path[1] == "params"
      cast = cast and jnp.issubdtype(leaf.dtype, jnp.floating)
      target[path] = jax.ShapeDtypeStruct(
          leaf.shape, dtype if cast else leaf.dtype, sharding=device
      )
    variables = ckpts.read(step, target)[VARIABLES]
  return variables, meta, step


def read_variables(
    checkpoint_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    step: int | None = None,
) -> tuple[ModelConfig, dict, int]:
  """The model of a training checkpoint: `(config, variables, step)`.

  Args:
    checkpoint_dir: a `Checkpoints` directory.
    dtype: cast the floating `params` to it as they are read (one of
      `EXPORT_DTYPES`; the config's `param_dtype` follows); None keeps them.
    step: the step to read; default the latest.

  Returns:
    A triple (config, variables, step), the saved `ModelConfig` with
    `scan_layers` set to the saved layer layout, the checkpoint's variables
    (`params`, fp8 state, every other collection: what `Decoder.apply`
    takes) on the default device, and the step read.

  Raises:
    ValueError: if `dtype` is not in `EXPORT_DTYPES`, the directory does not
      exist or holds no checkpoint (of `step`), or the checkpoint is
      damaged (`DamagedCheckpointError`).
  """
  if dtype is not None and dtype not in EXPORT_DTYPES:
    raise ValueError(
        f"read_variables: dtype={dtype!r} is invalid: allowed {EXPORT_DTYPES}."
    )
  variables, meta, step = _read_variables(checkpoint_dir, dtype, step)
  config = config_from_dict(meta.get("model_config", {}))
  plan = layer_plan(
      traverse_util.flatten_dict(abstract(variables.get("params", {})))
  )
  if plan is not None:
    config = config.replace(scan_layers=plan.scanned)
  if dtype is not None:
    config = config.replace(param_dtype=dtype)
  return config, variables, step


def load_export(path: str | os.PathLike) -> tuple[dict, dict]:
  """Reads a checkpoint written by `export`, onto the default device.

  Args:
    path: the export directory.

  Returns:
    A pair (variables, metadata), the Linen variables (by collection) that
    `Decoder.apply` takes and the export's metadata dict ("model_config",
    "step", "source", "params_dtype").

  Raises:
    ValueError: if `path` cannot be read as an export.
  """
  path = os.path.abspath(os.fspath(path))
  checkpointer = ocp.StandardCheckpointer()
  try:
    metadata = checkpointer.metadata(path)
    shapes = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
        metadata.item_metadata.tree,
    )
    variables = checkpointer.restore(path, abstract(shapes))
  except Exception as e:  # noqa: BLE001
    raise ValueError(
        f"Export {path} cannot be read ({type(e).__name__})."
    ) from e
  finally:
    checkpointer.close()
  return variables, dict(metadata.custom_metadata or {})
