"""The data iterator's state in an orbax checkpoint, on any process count.

Grain's orbax handler (`grain.checkpoint.CheckpointHandler`) writes one
file per process, `process_<i>-of-<n>.json`, with that process's iterator
state, and restores only from the file of the same process index and
count. A `pipeline.DataPipeline` iterator's state is the number of global
batches read, the same on every process, so it maps onto any other number
of processes: `IteratorCheckpointHandler` saves as Grain does, and restores
from this process's own file when there is one, else from the saved ones
when they all hold the same state (a resumed run on another process count
with the same global batch). Saved states that differ between processes
do not map and are an error.

Use `IteratorSave(iterator)` / `IteratorRestore(iterator)` as the item's
args in an orbax `CheckpointManager` or `CompositeCheckpointHandler`
(`linen_moe.checkpoint.Checkpoints` does, as its `data` item).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from etils import epath
import grain
import jax
import orbax.checkpoint as ocp


class IteratorCheckpointHandler(grain.checkpoint.CheckpointHandler):
  """Grain's orbax handler, restoring onto any process count (see the
  module's docstring)."""

  def restore(
      self,
      directory: epath.Path,
      item: Any = None,
      args: Any = None,
  ) -> Any:
    """Moves an iterator to the state saved in `directory`.

    Args:
      directory: the item's directory in a checkpoint.
      item: the Grain `DatasetIterator` to move (or give it in `args`).
      args: an `IteratorRestore` (orbax's way of passing `item`).

    Returns:
      The iterator, moved, its read-ahead started.

    Raises:
      ValueError: if `directory` holds no state, or states that differ
        between the processes that saved them while this process's own file
        is not there.
    """
    item = item if item is not None else args.item
    index, count = jax.process_index(), jax.process_count()
    if (directory / f"process_{index}-of-{count}.json").exists():
      return super().restore(directory, item=item)
    saved = sorted(directory.glob("process_*-of-*.json"))
    if not saved:
      raise ValueError(f"{directory} holds no data iterator state.")
    states = {f.name: json.loads(f.read_text()) for f in saved}
    distinct = {json.dumps(s, sort_keys=True) for s in states.values()}
    if len(distinct) != 1:
      raise ValueError(
          f"{directory}: the data iterators of the {len(saved)} processes "
          f"that saved it were in different states ({sorted(distinct)}), "
          f"which do not map onto {count} processes; resume on "
          f"{saved[0].name.split('-of-')[1].removesuffix('.json')} processes."
      )
    item.set_state(json.loads(distinct.pop()))
    item.start_prefetch()
    return item


@ocp.args.register_with_handler(IteratorCheckpointHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  """Saves a Grain iterator's state, read at save time.

  Attributes:
    item: the `DatasetIterator`.
  """

  item: Any


@ocp.args.register_with_handler(IteratorCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  """Moves a Grain iterator to the saved state.

  Attributes:
    item: the `DatasetIterator`.
  """

  item: Any
