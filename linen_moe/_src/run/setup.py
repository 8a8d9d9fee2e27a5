"""What a training run builds before its first step: the model config, the
mesh, the optimizer, the data source and the sharded training
(`set_up`), and a fresh state's weights from a Hugging Face checkpoint
(`load_hf`, `with_variables`), the optimizer settings a resume continues
(`optimizer_settings`) and the run directory's lock (`lock`). No compile
yet.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.checkpoint import manager as ckpt_manager
from linen_moe._src.checkpoint import meta as ckpt_meta
from linen_moe._src.checkpoint import tree as ckpt_tree
from linen_moe._src.config.files import load_model_config
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.parallel import distributed
from linen_moe._src.parallel import sharding
from linen_moe._src.run import init_from
from linen_moe._src.run import schedule
from linen_moe._src.run import sources
from linen_moe._src.run.directory import RunLock
from linen_moe._src.run.options import DEFAULT_CONFIG
from linen_moe._src.run.options import RunOptions
from linen_moe._src.training.frontend import TrainingFrontend


@dataclasses.dataclass
class Setup:
  """What a run builds before its first step (no compile yet).

  Attributes:
    cfg: the `ModelConfig` trained.
    data: its data source (`sources.MarkovSource` or `CorpusSource`).
    fe: the `TrainingFrontend`.
    optimizer: the optax optimizer.
    mesh: the mesh's spec, or None on one device.
    run: the sharded training, or None on one device.
    feed: host batch -> device array.
    device_mesh: the `jax.sharding.Mesh`, or None on one device.
    optimizer_settings: `schedule.settings` (or `resumed`).
    lr_schedule: updates applied -> learning rate (None: the user's own
      optimizer).
  """

  cfg: Any  # ModelConfig
  data: Any  # sources.MarkovSource or CorpusSource
  fe: Any  # TrainingFrontend
  optimizer: Any
  mesh: str | None
  run: Any  # sharded training, or None on one device
  feed: Callable[[np.ndarray], jax.Array]
  device_mesh: Any = None  # jax.sharding.Mesh, or None on one device
  optimizer_settings: dict = dataclasses.field(default_factory=dict)
  lr_schedule: Callable = None  # updates applied -> learning rate


def set_up(
    opts: RunOptions, fe: TrainingFrontend, optimizer_settings: dict
) -> Setup:
  """The model, the mesh, the optimizer and the data of a run (the files
  read and checked: any error comes before any step)."""
  mesh, device_mesh = opts.mesh, None
  if mesh is None and jax.process_count() > 1:
    mesh = f"data={jax.device_count()}"
  if isinstance(mesh, str):
    device_mesh = sharding.make_mesh(mesh)
  elif mesh is not None:  # a jax.sharding.Mesh
    device_mesh = mesh
    mesh = ",".join(f"{k}={v}" for k, v in mesh.shape.items())
  if opts.init_from is not None:
    cfg = init_from.model_config(opts.init_from, opts.overrides)
  elif isinstance(opts.config, ModelConfig):
    cfg = opts.config.replace(**opts.overrides)
  elif opts.init_from_hf is None:
    cfg = load_model_config(opts.config or DEFAULT_CONFIG, **opts.overrides)
  else:
    from linen_moe._src.hf import config_map  # noqa: PLC0415

    base = config_map.model_config(_read_json(opts.init_from_hf))
    cfg = base.replace(**opts.overrides)
  optimizer, lr_schedule = schedule.optimizer(
      optimizer_settings, opts.optimizer
  )
  run, feed = None, jnp.asarray
  if device_mesh is not None:
    run = fe.sharded(cfg, optimizer, device_mesh, opts.grad_accum)
    tokens_sharding = run.token_sharding()
    feed = lambda batch: distributed.global_array(  # noqa: E731
        batch.shape, tokens_sharding, batch
    )
  if opts.data is None:
    source = sources.MarkovSource(cfg, opts, feed)
  else:  # reads and checks the files: any error comes before any step
    source = sources.CorpusSource(cfg, opts, run)
  return Setup(
      cfg=cfg,
      data=source,
      fe=fe,
      optimizer=optimizer,
      mesh=mesh,
      run=run,
      feed=feed,
      device_mesh=device_mesh,
      optimizer_settings=optimizer_settings,
      lr_schedule=lr_schedule,
  )


def load_hf(directory: str, cfg, device_mesh):
  """The variables of the Hugging Face checkpoint in `directory` for the
  run's model `cfg`, loaded straight into the mesh's shardings."""
  from linen_moe._src.hf import load as hf_load  # noqa: PLC0415
  from linen_moe._src.lora import tree as lora_tree  # noqa: PLC0415

  loaded, variables = hf_load.load_checkpoint(
      directory,
      scan_layers=cfg.scan_layers,
      dtype=cfg.moe.param_dtype,
      mesh=device_mesh,
      quantization=cfg.moe.quantization,
      serving=cfg.moe.serving,
  )
  # The checkpoint is the base: the run's config without its adapters.
  base = lora_tree.without_adapters(cfg)
  ckpt_meta.check_model_config(ckpt_meta.config_dict(loaded), base, directory)
  return variables


def _read_json(directory: str) -> dict:
  import json  # noqa: PLC0415

  with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
    return json.load(f)


def with_variables(fe, state, variables):
  """`state` (a fresh one) with its params from `variables`; the fp8 and
  routing state and the optimizer moments stay fresh."""
  from flax import traverse_util  # noqa: PLC0415

  flat = traverse_util.flatten_dict(fe.checkpoint_tree(state))
  for path, value in traverse_util.flatten_dict(
      {ckpt_tree.VARIABLES: {"params": variables["params"]}}
  ).items():
    if path not in flat:
      raise ValueError(f"The loaded checkpoint has no {'/'.join(path)}.")
    flat[path] = value
  return fe.from_checkpoint_tree(traverse_util.unflatten_dict(flat), state)


def run_devices(job: Setup) -> list:
  """The devices a step runs on: the mesh's, or the one default device."""
  if job.device_mesh is not None:
    return list(job.device_mesh.devices.flat)
  return jax.devices()[:1]


def optimizer_settings(opts, ckpts, latest: int | None, log) -> dict:
  """The flags' optimizer settings, or those of the run that checkpoint
  `latest` continues (`schedule.resumed`: the same flags, the schedule's
  first length)."""
  wanted = schedule.settings(opts)
  if latest is None or latest not in ckpts.steps():
    return wanted
  try:
    saved = ckpts.meta(latest).get("run", {})
  except ckpt_manager.DamagedCheckpointError:
    return wanted  # the resume skips it, or names it
  return schedule.resumed(wanted, saved, ckpts.step_dir(latest), log)


def lock(directory: str, log: Callable[[str], None]) -> RunLock | None:
  """Locks `directory` for this run: process 0 alone takes the lock and
  the others follow its decision (they stop too when it fails), before any
  process writes there. Returns process 0's lock (None elsewhere)."""
  if jax.process_count() == 1:
    return RunLock.acquire(directory, log=log)
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = RunLock.acquire(directory, log=log)
    except ValueError as e:
      error = e
  from jax.experimental import multihost_utils  # noqa: PLC0415

  locked = multihost_utils.broadcast_one_to_all(np.int32(error is None))
  if error is not None:
    raise error
  if not int(locked):
    raise ValueError(
        f"process 0 could not lock {os.path.abspath(directory)} (its error "
        "says why); every process stops."
    )
  return lock
