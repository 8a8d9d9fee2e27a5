"""Checkpoints of a training run through orbax: save, resume anywhere, export.

Step N of a run is the orbax `CheckpointManager` step directory `DIR/N/`,
with two items, and a third for a run on real data:

- `state`: every array of the training state in one tree, the *checkpoint
  tree*: `variables` holds the Linen variables, `{collection: {path...}}`
  (`params`, `_overwrite_with_gradient` with the fp8 scales and amax
  histories, any other collection the layer keeps), exactly what
  `Decoder.apply` takes; beside it every other field of the train state:
  `step`, `opt_state` (optax's state, its parameter-shaped moments in the
  layout of `params`) and whatever else a front end's TrainState holds. The
  NNX state paths equal the Linen variable paths, so a tree written by one
  front end restores in the other. `tree_of` and `state_from` map a Linen
  `TrainState` to the tree and back, leaf by leaf, over whatever fields it
  has; `nnx_adapter` has the NNX pair.
- `meta`: JSON: the model config, the run's RNG key, the data position, and
  whatever else the caller records.
- `data` (when saved with one): the Grain data iterator's state
  (`linen_moe.data.IteratorCheckpointHandler`: one file per process, read
  back on any process count), so a resumed run reads on from the batch it
  would have read next.

Saving is asynchronous (arrays are copied to host memory, then written by a
background thread while training goes on) and atomic (orbax writes into a
temporary directory and renames it when complete, so a killed save leaves
the previous checkpoint the latest; a step is never written twice). A
restore first reads the saved tree's metadata and checks it, and the model
config, against the target, so a checkpoint of another model, a damaged one
or one without the fp8 state the model needs fails, naming the path and the
first mismatched leaf, before any array is read. Each array is read straight
into the sharding of its target (`jax.ShapeDtypeStruct.sharding`), so a
checkpoint saved on one mesh restores onto any other; a scanned checkpoint
restores into unrolled layers and back (converted by the decoder's
converters, compiled with the target shardings).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import logging
import os
from typing import Any

from flax import traverse_util
import jax
import numpy as np
import orbax.checkpoint as ocp

from linen_moe._src.checkpoint.meta import check_model_config
from linen_moe._src.checkpoint.tree import FP8_PREFIX
from linen_moe._src.checkpoint.tree import Path
from linen_moe._src.checkpoint.tree import abstract
from linen_moe._src.checkpoint.tree import layer_plan
from linen_moe._src.checkpoint.tree import relayout_abstract
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.data.checkpointing import IteratorCheckpointHandler
from linen_moe._src.data.checkpointing import IteratorRestore
from linen_moe._src.data.checkpointing import IteratorSave
from linen_moe._src.models import layer_stack

STATE, META, DATA = "state", "meta", "data"
FORMAT_VERSION = 1


# Named after the public module, so users configure it by that name.
_log = logging.getLogger("linen_moe.checkpoint")


# ------------------------------------------------------------ checkpoints ---


def _spec(leaf: Any) -> str:
  return f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"


def _first_mismatch(saved: Mapping[Path, Any], wanted: Mapping[Path, Any]):
  """The first leaf (in path order) that `saved` and `wanted` disagree on,
  described, or None."""
  for path in sorted(set(saved) | set(wanted)):
    s, w, name = saved.get(path), wanted.get(path), "/".join(path)
    if s is None:
      return f"leaf {name} ({_spec(w)} in the model) is not in the checkpoint"
    if w is None:
      return f"leaf {name} ({_spec(s)} in the checkpoint) is not in the model"
    if tuple(s.shape) != tuple(w.shape) or np.dtype(s.dtype) != w.dtype:
      return (
          f"first mismatched leaf {name}: {_spec(s)} in the checkpoint, "
          f"{_spec(w)} in the model"
      )
  return None


class DamagedCheckpointError(ValueError):
  """A checkpoint whose files cannot be read (truncated, damaged, or not a
  linen_moe checkpoint); its message names the step directory."""


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored checkpoint tree.

  Attributes:
    tree: the checkpoint tree, each array in its target's sharding.
    step: the step it was saved at.
    meta: its JSON metadata.
    fresh_fp8_state: True when the checkpoint's fp8 state did not fit the
      model (absent, or of another path or quantization) and the target's
      initial fp8 state was used instead, as asked.
  """

  tree: dict
  step: int
  meta: dict
  fresh_fp8_state: bool = False


class Checkpoints:
  """The checkpoints of one run in `directory`, an orbax `CheckpointManager`.

  Example usage:
    with Checkpoints(path, save_every=100, keep=3) as ckpts:
      ckpts.save(step, tree_of(state), {"model_config": config_dict(cfg)})
    restored = Checkpoints(path).restore(tree_of(target_state), config=cfg)
    state = state_from(restored.tree, target_state)

  Args:
    directory: the run's checkpoint directory.
    save_every: N; `save` writes the steps that are multiples of N (and any
      step it is forced to). An int >= 1.
    keep: K; the latest K checkpoints stay, older ones are deleted (None:
      all stay). An int >= 1 or None.
    async_save: write in a background thread (False: `save` blocks).
    create: make `directory` if it does not exist, else refuse.

  Raises:
    ValueError: if `save_every` or `keep` is not an int >= 1, or `create` is
      False and `directory` does not exist.

  Attributes:
    directory: the absolute path of the run's checkpoint directory.
  """

  def __init__(
      self,
      directory: str | os.PathLike,
      *,
      save_every: int = 1,
      keep: int | None = 3,
      async_save: bool = True,
      create: bool = True,
  ):
    for name, value in (("save_every", save_every), ("keep", keep)):
      if value is None and name == "keep":
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"Checkpoints: {name}={value!r} is invalid: expected an int >= 1."
        )
    self.directory = os.path.abspath(os.fspath(directory))
    if not create and not os.path.isdir(self.directory):
      raise ValueError(f"Checkpoint directory {self.directory} does not exist.")
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(
            save_every
        ),
        preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,  # what a killed save left behind
        create=create,
    )
    handlers = {
        STATE: ocp.PyTreeCheckpointHandler(),
        META: ocp.JsonCheckpointHandler(),
        DATA: IteratorCheckpointHandler(),
    }
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_handlers=handlers
    )

  def __enter__(self) -> Checkpoints:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Waits for a save in flight, then releases the manager."""
    self._manager.close()

  def wait_until_finished(self) -> None:
    """Blocks until a save in flight is on disk and committed."""
    self._manager.wait_until_finished()

  def check_for_errors(self) -> None:
    """Raises the error of a background save that ended in failure (orbax's
    exception: the disk full, a write refused, ...); returns at once while
    a save is still running, or when none failed."""
    if not self._manager.is_saving_in_progress():
      self._manager.wait_until_finished()  # joins it; raises its failure
    self._manager.check_for_errors()

  def reload(self) -> None:
    """Reads the list of checkpoints again, after step directories were
    moved or removed by another hand."""
    self._manager.reload()

  def latest_step(self) -> int | None:
    """The latest saved step.

    Returns:
      Its step number, or None when the directory holds no checkpoint.
    """
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The saved steps.

    Returns:
      Every step number with a checkpoint, ascending.
    """
    return sorted(self._manager.all_steps())

  def step_dir(self, step: int) -> str:
    """The directory of step `step` (whether or not it exists).

    Args:
      step: a step number.

    Returns:
      `directory/step`.
    """
    return os.path.join(self.directory, str(step))

  def _step(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None and steps:
      return steps[-1]
    if step is None:
      export = ""
      if os.path.isfile(os.path.join(self.directory, "_CHECKPOINT_METADATA")):
        export = (  # one orbax checkpoint, not a run's folder of steps
            " It is one checkpoint, as `linen-moe export` writes (the"
            " serving variables: linen_moe.checkpoint.load_export reads it);"
            " a run's directory holds a folder a saved step."
        )
      raise ValueError(f"No checkpoint in {self.directory}.{export}")
    if step not in steps:
      raise ValueError(
          f"No checkpoint of step {step} in {self.directory}; it holds "
          f"steps {steps or 'none'}."
      )
    return step

  def _damaged(self, step: int, error: Exception) -> DamagedCheckpointError:
    detail = str(error).strip().splitlines()[0][:300] if str(error) else ""
    return DamagedCheckpointError(
        f"Checkpoint {self.step_dir(step)} cannot be read; it is truncated or "
        f"damaged ({type(error).__name__}: {detail})."
    )

  def save(
      self,
      step: int,
      tree: Mapping,
      meta: Mapping,
      *,
      force=False,
      data: Any = None,
  ):
    """Starts saving `tree` and `meta` as step `step`, if it is due.

    Returns as soon as the arrays are copied to host memory (with
    `async_save`); `check_for_errors` reports a failed background write. A
    step is never written twice.

    Args:
      step: the step number; must be after the latest checkpoint.
      tree: the checkpoint tree (`tree_of` a state) of arrays.
      meta: JSON-serialisable metadata; "format" and "step" are added.
      force: save even when `step` is not a multiple of `save_every`.
      data: a Grain `DatasetIterator` whose state (read now) is saved too,
        as the `data` item (`restore_data` reads it back).

    Returns:
      Whether a save was started.

    Raises:
      ValueError: if `step` is not after the latest saved step.
    """
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
          f"Checkpoint step {step} is not after the latest one ({latest}) in "
          f"{self.directory}; a checkpoint is never overwritten."
      )
    meta = {**meta, "format": FORMAT_VERSION, "step": step}
    args = {
        STATE: ocp.args.PyTreeSave(dict(tree)),
        META: ocp.args.JsonSave(meta),
    }
    if data is not None:
      args[DATA] = IteratorSave(data)
    return self._manager.save(
        step, args=ocp.args.Composite(**args), force=force
    )

  def meta(self, step: int | None = None) -> dict:
    """The JSON metadata of a saved step.

    Args:
      step: the step; default the latest.

    Returns:
      The metadata dict as saved, with "format" and "step".

    Raises:
      ValueError: if there is no checkpoint, or none of `step`.
      DamagedCheckpointError: if the metadata cannot be read or is not of
        this format version.
    """
    step = self._step(step)
    args = ocp.args.Composite(**{META: ocp.args.JsonRestore()})
    try:
      meta = self._manager.restore(step, args=args)[META]
    except Exception as e:  # noqa: BLE001 (any failure to read is damage)
      raise self._damaged(step, e) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
      raise DamagedCheckpointError(
          f"Checkpoint {self.step_dir(step)} has no linen_moe metadata of "
          f"format {FORMAT_VERSION}."
      )
    return meta

  def has_data(self, step: int | None = None) -> bool:
    """Whether a checkpoint holds a data iterator state (the `data` item).

    Args:
      step: the step; default the latest.

    Returns:
      True when it was saved with `save(..., data=iterator)`.

    Raises:
      ValueError: if there is no checkpoint, or none of `step`.
    """
    return os.path.isdir(os.path.join(self.step_dir(self._step(step)), DATA))

  def restore_data(self, iterator: Any, step: int | None = None) -> Any:
    """Moves a data iterator to the state saved with a checkpoint.

    Args:
      iterator: a Grain `DatasetIterator` of the same pipeline (e.g. a new
        `linen_moe.data.DataPipeline.train_iterator()`).
      step: the step; default the latest.

    Returns:
      `iterator`, at the batch after the ones read before the save.

    Raises:
      ValueError: if `step` holds no data state, or one that does not map
        onto this process count (see `linen_moe.data`).
      DamagedCheckpointError: if it cannot be read.
    """
    step = self._step(step)
    if not self.has_data(step):
      raise ValueError(
          f"Checkpoint {self.step_dir(step)} holds no data iterator state (a"
          " run on synthetic data?)."
      )
    args = ocp.args.Composite(**{DATA: IteratorRestore(iterator)})
    try:
      return self._manager.restore(step, args=args)[DATA]
    except ValueError:
      raise
    except Exception as e:  # noqa: BLE001 (any failure to read is damage)
      raise self._damaged(step, e) from e

  def saved_leaves(self, step: int | None = None) -> dict[Path, Any]:
    """The shapes and dtypes of a saved tree, from its metadata (no array read).

    Args:
      step: the step; default the latest.

    Returns:
      A `jax.ShapeDtypeStruct` per saved leaf, by path tuple.

    Raises:
      ValueError: if there is no checkpoint, or none of `step`.
      DamagedCheckpointError: if the metadata cannot be read.
    """
    step = self._step(step)
    try:
      metadata = self._manager.item_metadata(step)[STATE]
      tree = getattr(metadata, "tree", metadata)
      flat = traverse_util.flatten_dict(dict(tree))
      return {
          p: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype)
          for p, m in flat.items()
      }
    except Exception as e:  # noqa: BLE001
      raise self._damaged(step, e) from e

  def read(self, step: int, flat_target: Mapping[Path, Any]) -> dict:
    """Reads some leaves of `step`, each straight into its sharding; no check.

    `restore` is the checked way; this is what it calls.

    Args:
      step: a saved step.
      flat_target: {path tuple: ShapeDtypeStruct with a sharding}; each leaf
        is read cast to its dtype. Saved leaves not named are skipped.

    Returns:
      The nested tree of the arrays read.

    Raises:
      DamagedCheckpointError: if orbax fails to read them (any exception it
        raises is reported as damage).
    """
    item = traverse_util.unflatten_dict(dict(flat_target))
    restore = ocp.args.PyTreeRestore(
        item=item,
        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True,
    )
    try:
      args = ocp.args.Composite(**{STATE: restore})
      return self._manager.restore(step, args=args)[STATE]
    except Exception as e:  # noqa: BLE001
      raise self._damaged(step, e) from e

  def restore(
      self,
      target: Mapping,
      step: int | None = None,
      *,
      config: ModelConfig | None = None,
      fresh_fp8_state: bool = False,
      partial: bool = False,
  ) -> Restored:
    """Restores `step` (default: the latest) into `target`, a checkpoint
    tree of arrays or ShapeDtypeStructs (`tree_of` a state) whose leaves
    give each array's shape, dtype and sharding.

    Checked before any array is read: the model config (if `config` is
    given) and every leaf's path, shape and dtype. The layer layout (scanned
    or unrolled) and the shardings may differ from the saved ones. With
    `fresh_fp8_state`, an fp8 state that does not fit the model (absent,
    or of another path or quantization) is replaced by the target's, which
    must then be arrays (an initial state); `Restored.fresh_fp8_state` says
    so.

    Args:
      target: the checkpoint tree to restore into (arrays or
        ShapeDtypeStructs, each with its sharding).
      step: the step; default the latest.
      config: if given, checked against the saved model config
        (`check_model_config`).
      fresh_fp8_state: replace an fp8 state that does not fit by the
        target's.
      partial: read only the target's top-level entries (e.g. a target
        of `variables` alone: the model without its optimizer state);
        the checkpoint's others are left unread.

    Returns:
      A `Restored` with the tree in the target's layout and shardings.

    Raises:
      ValueError: if there is no checkpoint (or none of `step`), the model
        config differs, the checkpoint holds another number of layers, a
        leaf's path, shape or dtype differs (naming the checkpoint and the
        first mismatched leaf), or `fresh_fp8_state`
        needs the initial fp8 state but `target` holds ShapeDtypeStructs.
      DamagedCheckpointError: (a ValueError) for a damaged checkpoint.
    """
    step = self._step(step)
    where = self.step_dir(step)
    meta = self.meta(step)
    if config is not None:
      check_model_config(meta.get("model_config", {}), config, where)
    saved = self.saved_leaves(step)
    if partial:
      saved = {p: v for p, v in saved.items() if p[0] in target}
    want = traverse_util.flatten_dict(abstract(dict(target)))
    read, convert = want, None
    plans = layer_plan(want), layer_plan(saved)
    if None not in plans and plans[0] != plans[1]:
      if plans[0].num_layers != plans[1].num_layers:
        raise ValueError(
            f"Checkpoint {where} does not fit the model: it holds "
            f"{plans[1].num_layers} layers, the model {plans[0].num_layers}."
        )
      convert = (plans[1], plans[0])  # saved layout -> wanted layout
      read = relayout_abstract(want, plans[0], plans[1])
    fp8 = lambda p: p[:2] == FP8_PREFIX  # noqa: E731
    fresh = False
    if fresh_fp8_state:
      problem = _first_mismatch(
          {p: v for p, v in saved.items() if fp8(p)},
          {p: v for p, v in read.items() if fp8(p)},
      )
      if problem:
        fresh = True
        saved = {p: v for p, v in saved.items() if not fp8(p)}
        read = {p: v for p, v in read.items() if not fp8(p)}
        _log.warning("%s: fresh fp8 state (%s).", where, problem)
    problem = _first_mismatch(saved, read)
    if problem:
      hint = ""
      if "/".join(FP8_PREFIX) in problem:
        hint = (
            " The fp8 state differs: restore with fresh_fp8_state=True "
            "(--fresh-fp8-state) to start it fresh."
        )
      raise ValueError(
          f"Checkpoint {where} does not fit the model: {problem}.{hint}"
      )
    tree = self.read(step, read)
    if convert is not None:
      shardings = {
          p: v.sharding for p, v in want.items() if not (fresh and fp8(p))
      }
      tree = jax.jit(
          lambda t: layer_stack.convert(t, *convert),
          out_shardings=traverse_util.unflatten_dict(shardings),
      )(tree)
    flat = traverse_util.flatten_dict(tree)
    if fresh:
      for path, value in traverse_util.flatten_dict(dict(target)).items():
        if fp8(path):
          if isinstance(value, jax.ShapeDtypeStruct):
            raise ValueError(
                "fresh_fp8_state needs the initial fp8 state: give a target "
                "of arrays (an initialised state), not ShapeDtypeStructs."
            )
          flat[path] = value
    return Restored(traverse_util.unflatten_dict(flat), step, meta, fresh)
