"""LoRA adapters in PEFT's format: `save_peft_adapters`.

`peft.PeftModel.from_pretrained(model, directory)` loads what this writes
onto the transformers model of the base checkpoint (`save_checkpoint`'s, or
the one a run started from) and computes the merged model's logits. PEFT
0.21 with transformers 5 adapts each kind of kernel one way, and these are
the names and layouts it reads (proven on fixtures it loaded:
scripts/make_peft_fixtures.py):

  attention    `target_modules` (q_proj, ..., o_proj; DeepSeek's q_a_proj,
               kv_a_proj_with_mqa, ...): `...self_attn.q_proj.lora_A.weight`
               [r, in] and `lora_B.weight` [out, r].
  MLPs         the dense layers' and the shared experts' `gate_proj`,
               `up_proj`, `down_proj` as `target_parameters` on their
               `weight` (PEFT 0.21 rewrites a `target_modules` entry named
               `gate_proj` of a Qwen3-MoE or DeepSeek-V3 model into the
               routed experts', so a module target would adapt the wrong
               kernel): the same two tensors.
  experts      transformers 5 holds the routed experts fused
               (`experts.gate_up_proj` [E, 2H, M], `experts.down_proj`
               [E, M, H]), adapted as `target_parameters`: lora_A
               [E * r, in] (expert-major rows), lora_B [out, r * E]
               (columns rank-major: `reshape(out, r, E)`). Our gate and up
               adapters (A [E, M, r], B [E, r, H] each) become one of rank
               2r, A stacked and B block-diagonal, exactly (PEFT's own
               conversion of a per-expert adapter does the same), with
               `rank_pattern` / `alpha_pattern` keeping alpha / r. With both
               of a module's parameters adapted PEFT nests its wrappers: the
               first declared (`gate_up_proj`) is named
               `experts.base_layer.lora_A.weight`, `down_proj`
               `experts.lora_A.weight`. GPT-OSS's and Llama-4's experts,
               stored as x @ W, have no proven PEFT form: an `experts`
               target of theirs is an error, or, with
               `no_peft_form="linen_moe"` (`linen-moe export --format
               adapters`), left out of PEFT's files and written with every
               other adapter in this library's (`lora.save_adapters`)
               beside them.

PEFT adapts a parameter only without dropout, so a file with parameter
targets says `lora_dropout` 0 (dropout acts in training only: the logits
are the same).
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import os
import pathlib
import uuid

import numpy as np

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.hf import config_map
from linen_moe._src.hf import save
from linen_moe._src.hf import tensor_names as tn
from linen_moe._src.lora import files as lora_files
from linen_moe._src.lora import tree as lora_tree
from linen_moe._src.lora.adapters import SUFFIX_A
from linen_moe._src.lora.adapters import SUFFIX_B

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# What prefixes every tensor name of a causal LM's PEFT model.
PREFIX = "base_model.model."
# The PEFT version whose format this is.
PEFT_VERSION = "0.21.2"

Path = tuple[str, ...]


def _adapter_paths(path: Path) -> tuple[Path, Path]:
  """The `{kernel}_lora_a` / `_lora_b` params beside the kernel `path`."""
  return (*path[:-1], path[-1] + SUFFIX_A), (*path[:-1], path[-1] + SUFFIX_B)


def _matrix(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(lora_A [r, in], lora_B [out, r]) of A [*K, r], B [r, *N]."""
  r = a.shape[-1]
  return a.reshape(-1, r).T, b.reshape(r, -1).T


def _fused(parts: list[tuple[np.ndarray, np.ndarray]], rows: int):
  """(lora_A [E * R, in], lora_B [rows, R * E]) of a fused experts tensor
  [E, rows, in] whose parts (A [E, in, r], B [E, r, width]), in row order,
  are stacked: R = r * len(parts), B block-diagonal."""
  experts, _, r = parts[0][0].shape
  rank = r * len(parts)
  lora_a = np.concatenate([a.transpose(0, 2, 1) for a, _ in parts], axis=1)
  lora_b = np.zeros((experts, rows, rank), np.float32)  # [E, out, R]
  row = 0
  for k, (_, b) in enumerate(parts):
    width = b.shape[-1]
    lora_b[:, row : row + width, k * r : (k + 1) * r] = b.transpose(0, 2, 1)
    row += width
  lora_a = lora_a.reshape(experts * rank, -1)  # rows e * R + k
  lora_b = lora_b.transpose(1, 2, 0).reshape(rows, rank * experts)
  return lora_a, lora_b


def _suffixes(chosen: set[str], every: set[str]) -> list[str]:
  """The shortest names (the last dotted parts) that pick exactly `chosen`
  out of `every` as PEFT matches a target (the name, or `.` + it at the
  end), e.g. ["q_proj", "v_proj"]; the full names when no shorter ones
  do."""

  def picks(short: set[str]) -> set[str]:
    return {
        n for n in every if any(n == s or n.endswith("." + s) for s in short)
    }

  longest = max((len(n.split(".")) for n in chosen), default=0)
  for keep in range(1, longest):
    short = {".".join(n.split(".")[-keep:]) for n in chosen}
    if picks(short) == chosen:
      return sorted(short)
  return sorted(chosen)


def _has_peft_form(source) -> bool:
  """Whether an adapted kernel stored as `source` has a PEFT form: an
  `nn.Linear` weight, or transformers' fused experts [E, rows, in]."""
  return isinstance(source, tn.Matrix | tn.FusedExperts)


def _target(path: Path, source) -> str | None:
  """The `lora_targets` entry that adapts the kernel at `path` (None: no
  adapter, e.g. a norm or the router)."""
  if path[-1] not in ("kernel", "wi_0", "wi_1", "wo"):
    return None  # a bias, a norm, ...
  if isinstance(source, tn.FusedExperts | tn.Columns):
    return "experts"
  if isinstance(source, tn.Copy) and path[-1] != "kernel":
    return "experts"  # GPT-OSS's, Llama-4's down_proj [E, H, M], x @ W
  if not isinstance(source, tn.Matrix):
    return None
  if "attention" in path:
    return "attention"
  if "shared_experts" in path:
    return "shared"
  return "mlp" if "mlp" in path else None


# What `no_peft_form` may say: refuse, or write this library's files too.
NO_PEFT_FORM = ("raise", "linen_moe")


def _no_peft_form_error(model_type: str, name: str) -> ValueError:
  return ValueError(
      f"save_peft_adapters: the routed experts of {model_type} ({name}, "
      "stored as x @ W) have no PEFT form here; leave 'experts' out of "
      "lora_targets, or pass no_peft_form='linen_moe' (what `linen-moe "
      "export --format adapters` does) to write them in this library's "
      "files (lora.save_adapters) beside PEFT's."
  )


def _sources(config: ModelConfig):
  """(family, {params path: tensor source}) of the adapted `config`."""
  base = lora_tree.without_adapters(config).replace(
      quantization="none", serving=False
  )
  family = config_map.family_for(base)
  fused_names = {
      f"{family.prefix}layers.{i}.{'mlp.' if family.moe_module else ''}"
      "experts.gate_up_proj"
      for i in range(config.num_layers)
  }
  return family, tn.sources(family, base, fused_names)


def without_peft_form(config: ModelConfig) -> list[str]:
  """The tensors whose targeted adapters have no PEFT form: GPT-OSS's and
  Llama-4's routed experts (stored as x @ W) when `experts` is a target;
  [] for every other family and target.

  Args:
    config: the adapted decoder's `ModelConfig` (`lora_rank >= 1`), of a
      family `save_checkpoint` writes.

  Returns:
    The hub's names of those tensors, sorted.
  """
  lora_tree.check_lora(config, "save_peft_adapters")
  _, srcs = _sources(config)
  targets = config.moe.lora.targets
  return sorted({
      source.name
      for path, source in srcs.items()
      if _target(path, source) in targets and not _has_peft_form(source)
  })


def peft_tensors(
    config: ModelConfig, variables: Mapping, *, skip_no_peft_form=False
) -> tuple[dict[str, np.ndarray], dict]:
  """The adapters of `variables` as PEFT's tensors and config.

  Args:
    config: the adapted decoder's `ModelConfig` (`lora_rank >= 1`), of a
      family `save_checkpoint` writes.
    variables: its variables (scanned or unrolled; a serving base too).
    skip_no_peft_form: leave out the adapters `without_peft_form` names
      (False: they are an error).

  Returns:
    ({PEFT tensor name: float32 array}, the adapter config's targets:
    `target_modules`, `target_parameters`, `rank_pattern`,
    `alpha_pattern`).

  Raises:
    ValueError: `config` has no adapters or no Hugging Face form, or an
      adapter of its targets (`lora_targets`) is missing from `variables`
      (the message names it).
  """
  lora_tree.check_lora(config, "save_peft_adapters")
  family, srcs = _sources(config)
  lora = config.moe.lora
  layers = save._Layers(save._params_of(variables))  # noqa: SLF001
  tensors: dict[str, np.ndarray] = {}
  modules, params, fused = set(), set(), {}
  # Every module and parameter a target could pick (PEFT matches targets
  # against all of them).
  every_module = {
      s.name.removesuffix(".weight")
      for s in srcs.values()
      if isinstance(s, tn.Matrix)
  }
  every_param = {
      s.name
      for s in srcs.values()
      if isinstance(s, tn.Matrix | tn.Copy | tn.FusedExperts | tn.Columns)
  }
  for path, source in srcs.items():
    a_path, b_path = _adapter_paths(path)
    if _target(path, source) not in lora.targets:
      continue
    if not _has_peft_form(source):  # GPT-OSS's, Llama-4's experts: x @ W
      if skip_no_peft_form:
        continue
      raise _no_peft_form_error(family.model_type, source.name)
    if a_path not in layers.where:
      raise ValueError(
          f"save_peft_adapters: variables hold no adapter {'/'.join(a_path)}"
          f" of the kernel {'/'.join(path)} (lora_targets={lora.targets})."
      )
    a = np.asarray(layers.get(a_path), np.float32)
    b = np.asarray(layers.get(b_path), np.float32)
    if isinstance(source, tn.FusedExperts):
      fused.setdefault(source.name, (source.rows, []))[1].append((a, b))
      params.add(source.name)
      continue
    if not isinstance(source, tn.Matrix):
      raise ValueError(f"save_peft_adapters: {path} has no PEFT form.")
    module = source.name.removesuffix(".weight")
    if ".self_attn." in module:
      modules.add(module)
    else:  # an MLP's weight: a parameter target (the module docstring)
      params.add(source.name)
    lora_a, lora_b = _matrix(a, b)
    tensors[f"{PREFIX}{module}.lora_A.weight"] = lora_a
    tensors[f"{PREFIX}{module}.lora_B.weight"] = lora_b
  nested = {}
  for name, (rows, parts) in fused.items():
    container, _, leaf = name.rpartition(".")
    wrapped = sorted(n for n in fused if n.rpartition(".")[0] == container)
    # PEFT wraps a module's parameters in their declared order, each
    # wrapper around the last: the first (gate_up_proj) is innermost.
    order = ["gate_up_proj", "down_proj"]
    wrapped.sort(key=lambda n: order.index(n.rpartition(".")[2]))
    depth = len(wrapped) - 1 - wrapped.index(name)
    at = container + ".base_layer" * depth
    lora_a, lora_b = _fused(parts, rows)
    tensors[f"{PREFIX}{at}.lora_A.weight"] = lora_a
    tensors[f"{PREFIX}{at}.lora_B.weight"] = lora_b
    nested[leaf] = len(parts)
  targets = {
      "target_modules": _suffixes(modules, every_module),
      "target_parameters": _suffixes(params, every_param),
      "rank_pattern": {
          leaf: lora.rank * n for leaf, n in nested.items() if n > 1
      },
      "alpha_pattern": {
          leaf: lora.alpha * n for leaf, n in nested.items() if n > 1
      },
  }
  # C order: safetensors writes an array's buffer as it lies in memory.
  tensors = {k: np.ascontiguousarray(v) for k, v in sorted(tensors.items())}
  return tensors, targets


def save_peft_adapters(
    config: ModelConfig,
    variables: Mapping,
    out: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    no_peft_form: str = "raise",
) -> list[pathlib.Path]:
  """Writes the LoRA adapters of `variables` in PEFT's format.

  `peft.PeftModel.from_pretrained(model, out)` then loads them onto the
  transformers model of the base checkpoint, giving the logits of the
  merged model (`linen_moe.lora.merge`, then `save_checkpoint`). Routed
  experts, attention, dense MLPs and shared experts are all adapted (see
  the module docstring for PEFT's names and layouts), except GPT-OSS's and
  Llama-4's routed experts, stored as x @ W, which have no PEFT form here
  (`no_peft_form` says what then).

  Example usage:

    config, variables = ...  # a LoRA run (`linen-moe train --lora-rank 8`)
    hf.save_peft_adapters(
        config, variables, "out/adapter", base_model_name_or_path="base"
    )

  Args:
    config: the adapted decoder's `ModelConfig` (`lora_rank >= 1`), of a
      family `save_checkpoint` writes.
    variables: its variables, adapters included (scanned or unrolled; a
      QLoRA run's serving base too: only the adapters are read).
    out: the directory to create; it must not exist.
    base_model_name_or_path: the base checkpoint (a hub id or a folder),
      as PEFT records it; None when unknown.
    no_peft_form: what to do when a targeted adapter has no PEFT form
      (`without_peft_form`): "raise" a ValueError, or "linen_moe": leave
      those out of PEFT's files and write every adapter, theirs too, in
      this library's files beside them (`adapters.safetensors`,
      `adapters.json`: `lora.load_adapters` reads the whole adapted model
      back); with no adapter in PEFT's form left, only this library's.

  Returns:
    The files written, `adapter_config.json` (PEFT's `LoraConfig` of a
    LORA adapter for CAUSAL_LM: r, lora_alpha, the targets) and
    `adapter_model.safetensors`, then this library's when written.

  Raises:
    TypeError: `config` is not a `ModelConfig`.
    ValueError: `config` has no adapters or no Hugging Face form (the
      message names the nearest family and what it needs), an adapter has
      no PEFT form and `no_peft_form` is "raise", `variables` lack an
      adapter of its targets, `no_peft_form` is not one of `NO_PEFT_FORM`,
      or `out` exists.
  """
  if no_peft_form not in NO_PEFT_FORM:
    raise ValueError(
        f"save_peft_adapters: no_peft_form={no_peft_form!r} is invalid: "
        f"expected one of {NO_PEFT_FORM}."
    )
  out = pathlib.Path(out)
  if out.exists():
    raise ValueError(
        f"save_peft_adapters: out={out} exists; it never overwrites."
    )
  own = no_peft_form == "linen_moe" and bool(without_peft_form(config))
  tensors, targets = peft_tensors(
      config, dict(variables), skip_no_peft_form=own
  )
  lora = config.moe.lora
  dropout = 0.0 if targets["target_parameters"] else lora.dropout
  adapter_config = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "peft_version": PEFT_VERSION,
      "base_model_name_or_path": base_model_name_or_path,
      "r": lora.rank,
      "lora_alpha": lora.alpha,
      "lora_dropout": dropout,
      **targets,
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "init_lora_weights": True,
      "inference_mode": True,
      "modules_to_save": None,
      "layers_to_transform": None,
      "layers_pattern": None,
  }
  from safetensors.numpy import save  # noqa: PLC0415

  out.parent.mkdir(parents=True, exist_ok=True)
  staging = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}"
  staging.mkdir()  # the umask's mode, as the weights' export
  names = []
  try:
    if tensors:
      (staging / CONFIG_FILE).write_text(
          json.dumps(adapter_config, indent=2) + "\n"
      )
      # Written as any new file (the umask's mode; safetensors' save_file
      # makes it private).
      (staging / WEIGHTS_FILE).write_bytes(
          save(tensors, metadata={"format": "pt"})
      )
      names += [CONFIG_FILE, WEIGHTS_FILE]
    if own:
      for path in lora_files.save_adapters(config, variables, staging / "own"):
        os.replace(path, staging / os.path.basename(path))
        names.append(os.path.basename(path))
      (staging / "own").rmdir()
    os.replace(staging, out)
  except BaseException:
    import shutil  # noqa: PLC0415

    shutil.rmtree(staging, ignore_errors=True)
    raise
  return [out / name for name in names]
