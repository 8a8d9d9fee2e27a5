"""Old public paths that answer for one more release, with a warning.

One table of each kind, read by the public faces and by an import finder:

- `MOVED_NAMES`: a name a public face exported in 0.2 that now lives in
  another face, or is private. The face's module `__getattr__` calls
  `moved_name`, so `face.NAME` and `from face import NAME` both work, with a
  `DeprecationWarning` naming the new home.
- `MOVED_MODULES`: modules that were public (0.1's `linen_moe.moe`, 0.2's
  `linen_moe.training.step`, ...) and are private now. `install` puts a
  finder on `sys.meta_path`, so `import linen_moe.moe` and
  `from linen_moe.moe import RoutedMoE` work as well as the attribute
  `linen_moe.moe`; each gives a module that forwards to the private one.

Imports no jax: `import linen_moe` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any
import warnings

from linen_moe._src import hlo

# Names that moved in this release answer through the next one; modules
# private since 0.2 were promised to answer through 0.2.
NAMES_REMOVED_IN = "0.4"
MODULES_REMOVED_IN = "0.3"

# The warning points at the user's line: frames of importlib and of this
# package are skipped.
_SKIP = (
    "<frozen importlib",
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
)

# face -> {old name: (new face, new name)}; a new face of None: private now.
MOVED_NAMES: dict[str, dict[str, tuple[str | None, str]]] = {
    "linen_moe": {
        "CALL_SITES": ("linen_moe.quantization", "CALL_SITES"),
        "QUANTIZATIONS": ("linen_moe.quantization", "MODES"),
        "PATHS": ("linen_moe", "MATMUL_PATHS"),
        "OVERWRITE_WITH_GRADIENT": (
            "linen_moe.variables",
            "OVERWRITE_WITH_GRADIENT",
        ),
        "RNG_STREAMS": ("linen_moe.variables", "RNG_STREAMS"),
        "ROUTER_JITTER_RNG_STREAM": (
            "linen_moe.variables",
            "ROUTER_JITTER_RNG_STREAM",
        ),
        "STATE_COLLECTIONS": ("linen_moe.variables", "STATE_COLLECTIONS"),
        "UPDATED_BY_RULE": ("linen_moe.variables", "UPDATED_BY_RULE"),
        "rng_dict": ("linen_moe.variables", "rng_dict"),
        "MarkovData": ("linen_moe.training", "MarkovData"),
        "ShardedTraining": ("linen_moe.training", "ShardedTraining"),
        "TrainState": ("linen_moe.training", "TrainState"),
        "default_optimizer": ("linen_moe.training", "default_optimizer"),
        "init_train_state": ("linen_moe.training", "init_train_state"),
        "make_train_step": ("linen_moe.training", "make_train_step"),
        "RouterResult": ("linen_moe.routing", "RouterResult"),
        "scan_blocks": ("linen_moe.models", "scan_blocks"),
        "scanned_to_unrolled": ("linen_moe.models", "scanned_to_unrolled"),
        "unrolled_to_scanned": ("linen_moe.models", "unrolled_to_scanned"),
    },
    "linen_moe.testing": {
        **{
            name: ("linen_moe.hlo", name)
            for name in hlo.READING_NAMES + hlo.TRAFFIC_NAMES
        },
        **{
            name: (None, private)
            for private, names in hlo.PRIVATE_NAMES.items()
            for name in names
        },
        "model_config": ("linen_moe.testing", "config_on_path"),
        "SLOW_ATTRIBUTE": (None, "linen_moe._src.testing.marks"),
    },
    "linen_moe.checkpoint": {
        "linen_path": (None, "linen_moe._src.checkpoint.tree"),
        "relayout": (None, "linen_moe._src.checkpoint.tree"),
        "config_from_dict": (None, "linen_moe._src.checkpoint.meta"),
    },
    "linen_moe.training": {
        "combine_overwrite_microbatches": (
            None,
            "linen_moe._src.training.step",
        ),
    },
    "linen_moe.serving": {
        "expert_weight_bytes": (
            "linen_moe.quantization",
            "expert_weight_bytes",
        ),
        "quantize_weights": ("linen_moe.quantization", "quantize_weights"),
    },
    "linen_moe.tokens": {
        "check_tokens": ("linen_moe.tokens", "valid_token_mask"),
    },
}

# old module -> (private module, where to go instead or None)
MOVED_MODULES: dict[str, tuple[str, str | None]] = {
    # Public in 0.1, private since 0.2.
    "linen_moe.activations": ("linen_moe._src.config.activations", None),
    "linen_moe.checkpoint_tree": (
        "linen_moe._src.checkpoint.tree",
        "linen_moe.checkpoint",
    ),
    "linen_moe.config": (
        "linen_moe._src.config.moe_config",
        "linen_moe (MoEConfig, ModelConfig, ...)",
    ),
    "linen_moe.decoder": ("linen_moe._src.models.decoder", "linen_moe.Decoder"),
    "linen_moe.dense": ("linen_moe._src.layer.dense", None),
    "linen_moe.expert": (
        "linen_moe._src.layer.expert",
        "linen_moe.SharedExpert",
    ),
    "linen_moe.expert_parallel": ("linen_moe._src.layer.expert_parallel", None),
    "linen_moe.grouped_matmul": ("linen_moe._src.kernels.grouped_matmul", None),
    "linen_moe.int8_grouped": ("linen_moe._src.kernels.int8_grouped", None),
    "linen_moe.jit_init": (
        "linen_moe._src.layer.jit_init",
        "linen_moe.variables",
    ),
    "linen_moe.moe": ("linen_moe._src.layer.moe", "linen_moe (RoutedMoE, ...)"),
    "linen_moe.permute": ("linen_moe._src.layer.permute", None),
    "linen_moe.scan": ("linen_moe._src.models.scan", "linen_moe.models"),
    "linen_moe.sparse": ("linen_moe._src.layer.sparse", None),
    "linen_moe.stored_weights": (
        "linen_moe._src.quantization.stored_weights",
        "linen_moe.quantization",
    ),
    # 0.1's `linen_moe.quantization` module was the contractions; the name is
    # the public quantization module now, so it is not listed here.
    # 0.1's `linen_moe.hlo` likewise is the public `linen_moe.hlo` now, and
    # 0.1's `linen_moe.variables` the public `linen_moe.variables`.
    # The submodules of 0.1's `linen_moe.training` package.
    "linen_moe.training.data": (
        "linen_moe._src.training.markov_data",
        "linen_moe.training",
    ),
    "linen_moe.training.frontend": (
        "linen_moe._src.training.frontend",
        "linen_moe.training",
    ),
    "linen_moe.training.sharded": (
        "linen_moe._src.training.sharded",
        "linen_moe.training",
    ),
    "linen_moe.training.skip": (
        "linen_moe._src.training.skip",
        "linen_moe.training",
    ),
    "linen_moe.training.step": (
        "linen_moe._src.training.step",
        "linen_moe.training",
    ),
}


def _warn(old: str, advice: str, removed_in: str = NAMES_REMOVED_IN) -> None:
  warnings.warn(
      f"{old} is deprecated and will be removed in linen_moe {removed_in};"
      f" {advice}.",
      DeprecationWarning,
      skip_file_prefixes=_SKIP,
  )


def moved_name(face: str, name: str) -> Any:
  """The object an old public name of `face` stands for, with a warning.

  Args:
    face: the public module asked, e.g. "linen_moe".
    name: the attribute asked for.

  Returns:
    The object at its new home.

  Raises:
    AttributeError: `name` is not a moved name of `face`.
  """
  moved = MOVED_NAMES.get(face, {})
  if name not in moved:
    raise AttributeError(f"module {face!r} has no attribute {name!r}")
  new_face, new_name = moved[name]
  if new_face is None:  # private now: new_name is the private module
    _warn(f"{face}.{name}", "it has no public replacement")
    return getattr(importlib.import_module(new_name), name)
  _warn(f"{face}.{name}", f"use {new_face}.{new_name}")
  return getattr(importlib.import_module(new_face), new_name)


def moved_module_advice(old: str) -> str:
  """Where to go instead of the old public module `old`."""
  private, instead = MOVED_MODULES[old]
  if instead:
    return f"use {instead}"
  return f"it has no public replacement ({private} may change any time)"


class _Forwarding(types.ModuleType):
  """A module that answers every attribute from the private module it
  stands for (never a second copy of that module's state)."""

  def __init__(self, name: str, target: types.ModuleType):
    super().__init__(name, target.__doc__)
    self.__dict__["_target"] = target

  def __getattr__(self, name: str) -> Any:
    return getattr(self.__dict__["_target"], name)

  def __dir__(self) -> list[str]:
    return dir(self.__dict__["_target"])


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds the old public module paths of `MOVED_MODULES`."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname not in MOVED_MODULES:
      return None
    return importlib.machinery.ModuleSpec(fullname, self)

  def create_module(self, spec):
    _warn(spec.name, moved_module_advice(spec.name), MODULES_REMOVED_IN)
    target = importlib.import_module(MOVED_MODULES[spec.name][0])
    return _Forwarding(spec.name, target)

  def exec_module(self, module):
    del module  # `create_module` built it whole


def install() -> None:
  """Puts the finder of old module paths on `sys.meta_path` (once)."""
  if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
