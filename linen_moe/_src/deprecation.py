"""Old public paths that answer for one more release, with a warning.

One table of each kind, read by the public faces, the configs and an
import finder, and one warning (`warn`):

- `MOVED_NAMES`: a name a public face exported in 0.2 that now lives in
  another face, or is private. The face's module `__getattr__` calls
  `moved_name`, so `face.NAME` and `from face import NAME` both work, with a
  `DeprecationWarning` naming the new home.
- `MOVED_MODULES`: modules that were public (0.1's `linen_moe.moe`, 0.2's
  `linen_moe.training.step`, ...) and are private now. `install` puts a
  finder on `sys.meta_path`, so `import linen_moe.moe` and
  `from linen_moe.moe import RoutedMoE` work as well as the attribute
  `linen_moe.moe`; each gives a module that forwards to the private one.

- `RENAMED_FIELDS`: config fields with a new name; the old one is accepted
  (`renamed_field`).

Imports nothing of the package and no jax: the lowest layer, and
`import linen_moe` stays cheap.
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

# face -> {old name: (new face, new name)}; a new face of None: private now,
# and the new name is the private module ("module:name" when renamed).
MOVED_NAMES: dict[str, dict[str, tuple[str | None, str]]] = {
    "linen_moe": {
        "CALL_SITES": ("linen_moe.quantization", "CALL_SITES"),
        "default_optimizer": ("linen_moe.training", "default_optimizer"),
        "init_train_state": ("linen_moe.training", "init_train_state"),
        "load_config": ("linen_moe", "load_moe_config"),
        "make_train_step": ("linen_moe.training", "make_train_step"),
        "MarkovData": ("linen_moe.training", "MarkovData"),
        "OVERWRITE_WITH_GRADIENT": (
            "linen_moe.variables",
            "OVERWRITE_WITH_GRADIENT",
        ),
        "PATHS": ("linen_moe", "MATMUL_PATHS"),
        "QUANTIZATIONS": ("linen_moe.quantization", "MODES"),
        "rng_dict": ("linen_moe.variables", "rng_dict"),
        "RNG_STREAMS": ("linen_moe.variables", "RNG_STREAMS"),
        "ROUTER_JITTER_RNG_STREAM": (None, "linen_moe._src.config.variables"),
        "RouterResult": ("linen_moe.routing", "RouterResult"),
        "scan_blocks": ("linen_moe.models", "scan_blocks"),
        "scanned_to_unrolled": ("linen_moe.models", "scanned_to_unrolled"),
        "ShardedTraining": ("linen_moe.training", "ShardedTraining"),
        "STATE_COLLECTIONS": ("linen_moe.variables", "STATE_COLLECTIONS"),
        "TrainState": ("linen_moe.training", "TrainState"),
        "unrolled_to_scanned": ("linen_moe.models", "unrolled_to_scanned"),
        "UPDATED_BY_RULE": ("linen_moe.variables", "UPDATED_BY_RULE"),
    },
    # 0.1's `linen_moe.config` module (`MOVED_MODULES`) held these too.
    "linen_moe.config": {
        "available_configs": ("linen_moe", "available_configs"),
        "load_config": ("linen_moe", "load_moe_config"),
        "load_model_config": ("linen_moe", "load_model_config"),
        "load_moe_config": ("linen_moe", "load_moe_config"),
        "ModelConfig": ("linen_moe", "ModelConfig"),
        "run_fields": (None, "linen_moe._src.config.model_config"),
    },
    "linen_moe.checkpoint": {
        "check_model_config": (None, "linen_moe._src.checkpoint.meta"),
        "config_from_dict": (None, "linen_moe._src.checkpoint.meta"),
        "key_name": (None, "linen_moe._src.checkpoint.tree"),
        "linen_path": (None, "linen_moe._src.checkpoint.tree"),
        "relayout": (None, "linen_moe._src.checkpoint.tree"),
        "Restored": (None, "linen_moe._src.checkpoint.manager"),
        "rng_from_json": (None, "linen_moe._src.checkpoint.meta"),
        "rng_to_json": (None, "linen_moe._src.checkpoint.meta"),
        "RUN_FIELDS": (None, "linen_moe._src.checkpoint.meta"),
        "state_from": ("linen_moe.frontend", "state_from"),
        "tree_of": ("linen_moe.frontend", "tree_of"),
        "VARIABLES": ("linen_moe.frontend", "VARIABLES"),
    },
    "linen_moe.data": {
        "CHAT_PACKINGS": (None, "linen_moe._src.data.chat_rows"),
        "chat_step_mask": (None, "linen_moe._src.data.chat_rows"),
        "ChatSequences": (None, "linen_moe._src.data.chat_rows"),
        "encode_conversation": (None, "linen_moe._src.data.chat"),
        "end_of_document_id": (None, "linen_moe._src.data.tokenization"),
        "find_files": (None, "linen_moe._src.data.sources"),
        "find_tokenizer": (None, "linen_moe._src.data.tokenization"),
        "first_fit": (None, "linen_moe._src.data.packing"),
        "first_fit_rows": (None, "linen_moe._src.data.packing"),
        "IteratorCheckpointHandler": (
            None,
            "linen_moe._src.data.checkpointing",
        ),
        "IteratorRestore": (None, "linen_moe._src.data.checkpointing"),
        "IteratorSave": (None, "linen_moe._src.data.checkpointing"),
        "loss_mask_of": (None, "linen_moe._src.data.chat"),
        "pack": (None, "linen_moe._src.data.packing"),
        "pad": (None, "linen_moe._src.data.packing"),
        "read_conversations": (None, "linen_moe._src.data.chat"),
        "ROLES": (None, "linen_moe._src.data.chat"),
        "Sequences": (None, "linen_moe._src.data.packing"),
    },
    "linen_moe.decoding": {
        "filter_logits": (None, "linen_moe._src.models.sampling"),
    },
    "linen_moe.distributed": {
        "check_port_free": (None, "linen_moe._src.parallel.distributed"),
        "cluster_launcher": (None, "linen_moe._src.parallel.distributed"),
        "free_port": (None, "linen_moe._src.parallel.distributed"),
        "GroupResult": (None, "linen_moe._src.parallel.launcher"),
        "parse_coordinator": (None, "linen_moe._src.parallel.distributed"),
    },
    "linen_moe.hlo": {
        "all_gather_shapes": (None, "linen_moe._src.hlo.reading"),
        "Collective": (None, "linen_moe._src.hlo.reading"),
        "collective_counts": (None, "linen_moe._src.hlo.reading"),
        "Contraction": (None, "linen_moe._src.hlo.reading"),
        "crosses_processes": (None, "linen_moe._src.hlo.reading"),
        "quantized_types_in_hlo": (None, "linen_moe._src.hlo.reading"),
    },
    "linen_moe.lora": {
        "AdaptedKernel": (None, "linen_moe._src.lora.adapters"),
        "has_adapters": (None, "linen_moe._src.lora.tree"),
        "is_adapter": ("linen_moe.frontend", "is_adapter"),
        "LoRAConfig": (None, "linen_moe._src.config.lora"),
        "without_adapters": (None, "linen_moe._src.lora.tree"),
    },
    "linen_moe.models": {
        "layer_aux": ("linen_moe.frontend", "layer_aux"),
        "layer_name": ("linen_moe.frontend", "layer_name"),
        "LAYERS_AXIS": ("linen_moe.frontend", "LAYERS_AXIS"),
        "logits_of": ("linen_moe.frontend", "logits_of"),
        "output_head": ("linen_moe.frontend", "output_head"),
        "per_layer_aux": ("linen_moe.frontend", "per_layer_aux"),
        "resolve_positions": ("linen_moe.frontend", "resolve_positions"),
        "resolved_unroll": ("linen_moe.frontend", "resolved_unroll"),
        "same_segment_targets": (None, "linen_moe._src.models.segments"),
        "scale_embeddings": ("linen_moe.frontend", "scale_embeddings"),
        "STACK": ("linen_moe.frontend", "STACK"),
        "stack_body": ("linen_moe.frontend", "stack_body"),
        "validate_segments": ("linen_moe.frontend", "validate_segments"),
    },
    "linen_moe.planning": {
        "attention_flops": (None, "linen_moe._src.planning.flops"),
        "Chip": (None, "linen_moe._src.planning.chips"),
        "chip_of": (None, "linen_moe._src.planning.chips"),
        "matmul_parameters": (None, "linen_moe._src.planning.flops"),
        "PerDevice": (None, "linen_moe._src.planning.plan"),
        "Target": (None, "linen_moe._src.planning.targets"),
    },
    "linen_moe.quantization": {
        "get_mode": (None, "linen_moe._src.config.quantization_modes"),
        "QuantizationMode": (None, "linen_moe._src.config.quantization_modes"),
    },
    "linen_moe.routing": {
        "expert_assignment_fraction": (None, "linen_moe._src.layer.routing"),
        "group_limited_mask": (None, "linen_moe._src.layer.routing"),
        "jitter": (None, "linen_moe._src.layer.routing"),
        "select_experts": (None, "linen_moe._src.layer.routing"),
    },
    "linen_moe.serving": {
        "expert_weight_bytes": (
            "linen_moe.quantization",
            "expert_weight_bytes",
        ),
        "quantize_weights": ("linen_moe.quantization", "quantize_weights"),
    },
    "linen_moe.sharding": {
        "current_mesh": (None, "linen_moe._src.parallel.sharding"),
        "current_rules": (None, "linen_moe._src.parallel.sharding"),
        "mesh_axes": (None, "linen_moe._src.parallel.sharding"),
        "named": (None, "linen_moe._src.parallel.sharding"),
        "parse_mesh_spec": (None, "linen_moe._src.parallel.sharding"),
        "replicated": (None, "linen_moe._src.parallel.sharding"),
    },
    "linen_moe.hf": {
        "MODEL_TYPES": (None, "linen_moe._src.hf.families"),
        "parse_size": (None, "linen_moe._src.hf.safetensors_io"),
    },
    "linen_moe.testing": {
        "is_slow": (None, "linen_moe._src.testing.marks"),
        "all_gather_shapes": (None, "linen_moe._src.hlo.reading"),
        "Collective": (None, "linen_moe._src.hlo.reading"),
        "collective_bytes": (None, "linen_moe._src.hlo.traffic"),
        "collective_counts": (None, "linen_moe._src.hlo.reading"),
        "collective_summary": ("linen_moe.hlo", "collective_summary"),
        "CollectiveBytes": (None, "linen_moe._src.hlo.traffic"),
        "collectives": ("linen_moe.hlo", "collectives"),
        "COLLECTIVES": (None, "linen_moe._src.hlo.reading"),
        "config_on_path": (None, "linen_moe._src.testing.helpers"),
        "Contraction": (None, "linen_moe._src.hlo.reading"),
        "contractions": ("linen_moe.hlo", "contractions"),
        "CONTRACTIONS": (None, "linen_moe._src.hlo.reading"),
        "crosses_processes": (None, "linen_moe._src.hlo.reading"),
        "flat_numpy": (None, "linen_moe._src.testing.helpers"),
        "Instruction": (None, "linen_moe._src.hlo.reading"),
        "markov_tokens": (None, "linen_moe._src.testing.helpers"),
        "max_abs_diff": (None, "linen_moe._src.testing.helpers"),
        "model_config": (None, "linen_moe._src.testing.helpers:config_on_path"),
        "moe_params": (None, "linen_moe._src.testing.helpers"),
        "moe_variables": (None, "linen_moe._src.testing.helpers"),
        "parse_hlo": (None, "linen_moe._src.hlo.reading"),
        "QUANTIZED_TYPES": (None, "linen_moe._src.hlo.reading"),
        "quantized_types_at_contractions": (
            "linen_moe.hlo",
            "quantized_types_at_contractions",
        ),
        "quantized_types_in_hlo": (None, "linen_moe._src.hlo.reading"),
        "random_inputs": (None, "linen_moe._src.testing.helpers"),
        "read_jsonl": (None, "linen_moe._src.testing.helpers"),
        "rel_err": (None, "linen_moe._src.testing.helpers"),
        "sent_bytes": ("linen_moe.hlo", "sent_bytes"),
        "SLOW_ATTRIBUTE": (None, "linen_moe._src.testing.marks"),
    },
    "linen_moe.tokens": {
        "check_tokens": ("linen_moe.tokens", "valid_token_mask"),
        "validate_tokens_if_concrete": (
            "linen_moe.frontend",
            "validate_tokens_if_concrete",
        ),
    },
    "linen_moe.training": {
        "kept_files": (None, "linen_moe._src.run.tokenizer_files"),
        "accumulate_gradients": ("linen_moe.frontend", "accumulate_gradients"),
        "all_finite": ("linen_moe.frontend", "all_finite"),
        "combine_overwrite_microbatches": (
            None,
            "linen_moe._src.training.step",
        ),
        "decays": (None, "linen_moe._src.training.optimizer"),
        "DEFAULT_FINAL_LR_RATIO": (None, "linen_moe._src.config.schedules"),
        "hidden_decoder_loss": ("linen_moe.frontend", "hidden_decoder_loss"),
        "keep_if_finite": ("linen_moe.frontend", "keep_if_finite"),
        "loss_weights": ("linen_moe.frontend", "loss_weights"),
        "overwrite_with_gradient": (
            "linen_moe.frontend",
            "overwrite_with_gradient",
        ),
        "routed_bias_rule": ("linen_moe.frontend", "routed_bias_rule"),
        "ShardedRun": ("linen_moe.frontend", "ShardedRun"),
        "train_batch": ("linen_moe.frontend", "train_batch"),
        "variables_of": ("linen_moe.frontend", "variables_of"),
        "vocab_chunk_size": (None, "linen_moe._src.training.chunked_loss"),
    },
    "linen_moe.variables": {
        "AQT_RNG_STREAM": (None, "linen_moe._src.config.variables"),
        "compiled_init": ("linen_moe.frontend", "compiled_init"),
        "jit_once": ("linen_moe.frontend", "jit_once"),
        "ROUTER_JITTER_RNG_STREAM": (None, "linen_moe._src.config.variables"),
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


# Config fields renamed: the old spelling is accepted by the constructors,
# `replace` and YAML files, with a warning (`renamed_field`).
FIELDS_REMOVED_IN = "0.3"
RENAMED_FIELDS = {
    "weight_dtype": "param_dtype",
    "n_routing_groups": "num_routing_groups",
}


def warn(old: str, advice: str, removed_in: str = NAMES_REMOVED_IN) -> None:
  """The one deprecation warning: `old` goes in `removed_in`; `advice`
  says what to use instead. Points at the user's line."""
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
  if new_face is None:  # private now: new_name is "module" or "module:name"
    warn(f"{face}.{name}", "it has no public replacement")
    module, _, attr = new_name.partition(":")
    return getattr(importlib.import_module(module), attr or name)
  warn(f"{face}.{name}", f"use {new_face}.{new_name}")
  return getattr(importlib.import_module(new_face), new_name)


def renamed_field(cls: str, old: str) -> str:
  """The new name of config field `old` of class `cls`, with a warning."""
  new = RENAMED_FIELDS[old]
  warn(f"{cls}.{old}", f"use {new}", FIELDS_REMOVED_IN)
  return new


def moved_module_advice(old: str) -> str:
  """Where to go instead of the old public module `old`."""
  private, instead = MOVED_MODULES[old]
  if instead:
    return f"use {instead}"
  return f"it has no public replacement ({private} may change any time)"


class _Forwarding(types.ModuleType):
  """A module that answers every attribute from the private module it
  stands for (never a second copy of that module's state), or, for a name
  that moved away from it (`MOVED_NAMES` of the old module), from its new
  home with a warning."""

  def __init__(self, name: str, target: types.ModuleType):
    super().__init__(name, target.__doc__)
    self.__dict__["_target"] = target

  def __getattr__(self, name: str) -> Any:
    if name in MOVED_NAMES.get(self.__name__, {}):
      return moved_name(self.__name__, name)
    return getattr(self.__dict__["_target"], name)

  def __dir__(self) -> list[str]:
    return dir(self.__dict__["_target"])


class _CallableForwarding(_Forwarding):
  """0.1's module `linen_moe.training.frontend`, whose path is now the
  function `linen_moe.training.frontend(name)`: importing the old path
  puts this module there, so it answers as the function too."""

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    module, _, name = _CALLABLE_MODULES[self.__name__].partition(":")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


# Old module paths that are a function's name now (`_CallableForwarding`):
# old path -> "module:function" it answers as.
_CALLABLE_MODULES = {
    "linen_moe.training.frontend": "linen_moe._src.training.registry:frontend",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds the old public module paths of `MOVED_MODULES`."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname not in MOVED_MODULES:
      return None
    return importlib.machinery.ModuleSpec(fullname, self)

  def create_module(self, spec):
    warn(spec.name, moved_module_advice(spec.name), MODULES_REMOVED_IN)
    target = importlib.import_module(MOVED_MODULES[spec.name][0])
    if spec.name in _CALLABLE_MODULES:
      return _CallableForwarding(spec.name, target)
    return _Forwarding(spec.name, target)

  def exec_module(self, module):
    del module  # `create_module` built it whole


def install() -> None:
  """Puts the finder of old module paths on `sys.meta_path` (once)."""
  if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
