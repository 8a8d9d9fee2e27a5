"""The command line's front ends by name: one registry, read without jax.

A front end is a decoder and its train step in one framework. Each entry
says what it is (for `--help`) and loads, when first asked, its
`linen_moe.training.TrainingFrontend` and its sharded training (an object
with `init`, `abstract_state`, `token_sharding` and `step`, as
`linen_moe.training.ShardedTraining`). `--frontend` offers exactly these
names, and `train`, `matrix` and the tests build both from here.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any


def _linen() -> tuple[Any, Callable[..., Any]]:
  from linen_moe import training  # noqa: PLC0415 (imports jax)
  from linen_moe._src.models.decoder import Decoder  # noqa: PLC0415

  def sharded(cfg, optimizer, mesh, *, grad_accum: int = 1):
    return training.ShardedTraining(
        Decoder(cfg), optimizer, mesh, grad_accum=grad_accum
    )

  return training.LinenFrontend, sharded


def _nnx() -> tuple[Any, Callable[..., Any]]:
  import nnx_adapter  # noqa: PLC0415 (optional front end, imports flax.nnx)

  return nnx_adapter.NNXFrontend, nnx_adapter.ShardedNNXTraining


@dataclasses.dataclass(frozen=True)
class FrontEnd:
  """One registered front end.

  Attributes:
    name: what `--frontend` calls it.
    description: one line for `--help`.
    load: () -> (its `TrainingFrontend`, its sharded-training factory
      `(model_config, optimizer, mesh, *, grad_accum=1)`); imports its
      framework.
  """

  name: str
  description: str
  load: Callable[[], tuple[Any, Callable[..., Any]]]


_REGISTRY = {
    fe.name: fe
    for fe in (
        FrontEnd("linen", "the Linen decoder (linen_moe.Decoder)", _linen),
        FrontEnd("nnx", "the NNX decoder (nnx_adapter.Decoder)", _nnx),
    )
}
FRONTENDS = tuple(_REGISTRY)


def help_text() -> str:
  """ "linen: ..., nnx: ..." for a `--frontend` flag."""
  return "; ".join(f"{fe.name}: {fe.description}" for fe in _REGISTRY.values())


def check(name: str) -> str:
  """`name` if it is a registered front end; else a `ValueError`."""
  if name not in _REGISTRY:
    raise ValueError(f"Unknown front end {name!r}; allowed: {FRONTENDS}.")
  return name


def _loaded(name: str) -> tuple[Any, Callable[..., Any]]:
  return _REGISTRY[check(name)].load()


def frontend(name: str) -> Any:
  """The `linen_moe.training.TrainingFrontend` called `name`."""
  return _loaded(name)[0]


def sharded_training(
    name: str, model_config, optimizer, mesh, grad_accum: int = 1
) -> Any:
  """The sharded init and step of front end `name`'s decoder on `mesh`."""
  make = _loaded(name)[1]
  return make(model_config, optimizer, mesh, grad_accum=grad_accum)
