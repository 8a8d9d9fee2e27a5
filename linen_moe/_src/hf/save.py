"""`save_checkpoint`: the decoder's float weights as a Hugging Face checkpoint.

Writes `config.json` (transformers 5 style) and safetensors in the hub's
names (per-expert tensors, what `save_pretrained` writes by default; float,
or the linear weights in block fp8 beside their `weight_scale_inv`,
`block_fp8.py`), sharded with an index past `max_shard_size`, so that
`transformers.AutoModelForCausalLM.from_pretrained(path)` loads it with no
missing or unexpected key and computes the same logits. Any layout is read
(scanned or unrolled: the tree says which, `layer_stack.plan_of_tree`),
each tensor made from its parameter (one layer's row of a stacked leaf at a
time) and written as it is made. The directory appears whole or not at all:
everything is written into a temporary sibling that is renamed at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
import json
import os
import pathlib
import shutil
from typing import Any
import uuid

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.config import stack_plan
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.variables import PARAMS
from linen_moe._src.config.variables import UPDATED_BY_RULE
from linen_moe._src.hf import block_fp8
from linen_moe._src.hf import config_map
from linen_moe._src.hf import generation_config as generation_config_file
from linen_moe._src.hf import tensor_names as tn
from linen_moe._src.hf.layout import flat_params
from linen_moe._src.hf.layout import flat_state
from linen_moe._src.hf.load import CONFIG_FILE
from linen_moe._src.hf.safetensors_io import Planned
from linen_moe._src.hf.safetensors_io import parse_size
from linen_moe._src.hf.safetensors_io import write_checkpoint
from linen_moe._src.models import layer_stack
from linen_moe._src.parallel import sharding as sharding_lib

Path = tuple[str, ...]
WEIGHT_FORMATS = ("float", "block_fp8")


def _params_of(variables: Any) -> Mapping:
  """The `params` of Linen variables, a checkpoint tree
  (`{"variables": {"params": ...}}`) or a train state (`.params`)."""
  if isinstance(variables, Mapping):
    if PARAMS in variables:
      return variables[PARAMS]
    if "variables" in variables and PARAMS in variables["variables"]:
      return variables["variables"][PARAMS]
  elif hasattr(variables, PARAMS):
    return variables.params
  raise TypeError(
      "variables must be Linen variables ({'params': ...}), a checkpoint "
      "tree or a train state with .params (NNX: nnx_adapter.nnx_to_linen("
      f"model)); got {type(variables).__name__}."
  )


def _rule_state_of(variables: Any) -> Mapping:
  """The `updated_by_rule` collection beside the params (or {})."""
  if isinstance(variables, Mapping):
    if PARAMS in variables:
      return variables.get(UPDATED_BY_RULE, {})
    inner = variables.get("variables", {})
    return inner.get(UPDATED_BY_RULE, {}) if isinstance(inner, Mapping) else {}
  return getattr(variables, "rule_state", {}) or {}


def _check_tree(layers: _Layers, expected: Mapping, what: str) -> None:
  """Raises unless `layers` holds exactly the leaves `expected` names, each
  of its shape."""
  missing = sorted(set(expected) - set(layers.where))
  extra = sorted(set(layers.where) - set(expected))
  wrong = [
      p
      for p in sorted(set(expected) & set(layers.where))
      if tuple(expected[p].shape) != layers.shape(p)
  ]
  if missing or extra or wrong:
    raise ValueError(
        f"variables are not the {what} of this config: missing "
        f"{['/'.join(p) for p in missing[:3]]}, unexpected "
        f"{['/'.join(p) for p in extra[:3]]}, of another shape "
        f"{['/'.join(p) for p in wrong[:3]]}."
    )


class _Layers:
  """Unrolled-path access to the leaves of a tree in any stack layout."""

  def __init__(self, params: Mapping, plan: stack_plan.StackPlan | None = None):
    """`plan`: the tree's layout (default: read off the tree itself; a
    collection that not every layer has, such as the routed biases, takes
    the parameters')."""
    self.flat = traverse_util.flatten_dict(sharding_lib.unbox(dict(params)))
    self.plan = plan or layer_stack.plan_of_tree(self.flat)
    self.where: dict[Path, tuple[Path, int | None]] = {}
    for path in self.flat:
      rows = (
          None if self.plan is None else layer_stack.layer_rows(path, self.plan)
      )
      if rows is None or stack_plan.STACK not in path:
        self.where[path] = (path, None)
        continue
      k = path.index(stack_plan.STACK)
      rest = path[k + 1 :]
      if rest and stack_plan.member_index(rest[0]) is not None:
        rest = rest[1:]
      for r, i in enumerate(rows):
        self.where[(*path[:k], stack_plan.layer_name(i), *rest)] = (path, r)

  def shape(self, path: Path) -> tuple[int, ...]:
    source, row = self.where[path]
    shape = tuple(self.flat[source].shape)
    return shape if row is None else shape[1:]

  def dtype(self, path: Path):
    return np.dtype(self.flat[self.where[path][0]].dtype)

  def get(self, path: Path) -> np.ndarray:
    source, row = self.where[path]
    leaf = self.flat[source]
    return np.asarray(jax.device_get(leaf if row is None else leaf[row]))


def _planned(srcs, layers: _Layers, dtype) -> list[Planned]:
  """One `Planned` tensor per name on disk, in the sources' order; a fused
  `experts.gate_up_proj` (Gemma-4's only form; GPT-OSS's and Llama-4's
  `Columns`) is made from both of its parameters."""
  out, fused = [], {}
  for path, source in srcs.items():
    shape = layers.shape(path)
    out_dtype = np.dtype(jnp.dtype(dtype)) if dtype else layers.dtype(path)
    if isinstance(source, (tn.FusedExperts, tn.Columns)):
      if source.name not in fused:
        fused[source.name] = []
        disk = tn.expected_shapes(source, shape)[source.name]
        make = _fused_maker(layers, fused[source.name], disk)
        out.append(Planned(source.name, out_dtype, disk, make))
      fused[source.name].append((path, source))
      continue
    for name, disk in tn.expected_shapes(source, shape).items():
      out.append(
          Planned(name, out_dtype, disk, _maker(layers, path, source, name))
      )
  return out


def _fused_maker(layers: _Layers, parts: list, shape: tuple[int, ...]):
  """() -> the fused tensor from its parts (path, source), `parts` filled
  before the tensor is made: rows [row0, row0 + width) of a `FusedExperts`
  [E, rows, in] are part [E, in, width] transposed; a `Columns` part is
  every `step`-th column from `start` on."""

  def make():
    out = None
    for path, source in parts:
      param = layers.get(path)
      if out is None:
        out = np.empty(shape, param.dtype)
      if isinstance(source, tn.Columns):
        n = param.shape[-1]
        stop = source.start + source.step * n
        out[..., source.start : stop : source.step] = param
        continue
      out[:, source.row0 : source.row0 + source.width] = param.transpose(
          0, 2, 1
      )
    return out

  return make


def _maker(layers: _Layers, path: Path, source, name: str):
  """() -> the tensor `name` of `source` made from the parameter `path`."""

  def matrix(kernel: np.ndarray, split: int) -> np.ndarray:
    n_in = int(np.prod(kernel.shape[:split]))
    return kernel.reshape(n_in, -1).T  # W [out, in]

  def make():
    param = layers.get(path)
    if isinstance(source, tn.Copy):
      return param
    if isinstance(source, tn.Reshaped):
      return param.reshape(-1)
    if isinstance(source, tn.Matrix):
      return matrix(param, source.split)
    e = source.names.index(name)
    return matrix(param[e], 1)

  return make


def _block(weight_format: str, block_size) -> tuple[int, int] | None:
  """The fp8 block of `weight_format`, or None for float weights."""
  if weight_format not in WEIGHT_FORMATS:
    raise ValueError(
        f"weight_format={weight_format!r} is invalid: allowed {WEIGHT_FORMATS}."
    )
  if weight_format == "float":
    if block_size is not None:
      raise ValueError(
          f"block_size={block_size!r} is for weight_format='block_fp8'."
      )
    return None
  if block_size is None:
    return block_fp8.DEFAULT_BLOCK
  return block_fp8.check_block(block_size, "block_size")


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION_CONFIG_FILE = generation_config_file.FILE


def _extra_files(
    generation_config: Mapping[str, Any] | None,
    tokenizer_files: Sequence[str | os.PathLike],
) -> dict[str, Callable[[pathlib.Path], None]]:
  """{file name: writes it at a path} of the files beside the weights,
  checked before anything is written."""
  out: dict[str, Callable[[pathlib.Path], None]] = {}
  if generation_config is not None:
    if not isinstance(generation_config, Mapping):
      raise ValueError(
          f"generation_config={generation_config!r} is invalid: expected a "
          "mapping, e.g. {'eos_token_id': 0}."
      )
    text = json.dumps(dict(generation_config), indent=2) + "\n"
    out[GENERATION_CONFIG_FILE] = lambda p: p.write_text(text)
  if isinstance(tokenizer_files, (str, os.PathLike)):
    tokenizer_files = [tokenizer_files]
  for file in tokenizer_files:
    source = pathlib.Path(file)
    if not source.is_file():
      raise ValueError(f"tokenizer_files: {source} does not exist.")
    if source.name in (CONFIG_FILE, GENERATION_CONFIG_FILE) or (
        source.name in out
    ):
      raise ValueError(
          f"tokenizer_files: {source} would overwrite the checkpoint's "
          f"{source.name}."
      )
    out[source.name] = lambda p, s=source: shutil.copyfile(s, p)
  return out


def save_checkpoint(
    config: ModelConfig,
    variables: Any,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_size: int | str = "2GB",
    weight_format: str = "float",
    block_size: tuple[int, int] | None = None,
    generation_config: Mapping[str, Any] | None = None,
    tokenizer_files: Sequence[str | os.PathLike] = (),
) -> list[pathlib.Path]:
  """Writes the float weights of `variables` as a Hugging Face checkpoint.

  Args:
    config: the decoder's `ModelConfig`, one a Hugging Face family
      expresses (Mixtral; Qwen3-MoE with `qk_norm`; DeepSeek-V3 with
      multi-head latent attention; Gemma-4 with its post-MoE norms); not a
      serving config.
    variables: Linen variables (`{"params": ...}`, scanned or unrolled,
      fp8-trained ones too: the float `params` are written, and the saved
      buffers of `updated_by_rule`, DeepSeek-V3's `routed_bias` and
      Gemma-4's `layer_scalar`), a checkpoint tree, or a train state; for
      an NNX decoder, `nnx_adapter.nnx_to_linen(model)`.
    path: the directory to create; it must not exist, or be empty.
    dtype: the tensors' dtype on disk ("float32", "bfloat16", "float16");
      None: each parameter's.
    max_shard_size: the largest shard, in bytes or as "2GB", "500MB", ...;
      past it the tensors go into shards with `model.safetensors.index.json`.
    weight_format: "float", or "block_fp8": the linear layers' weights (all
      but lm_head and the routers) as float8_e4m3fn, each beside a float32
      `weight_scale_inv` with one scale per block, and config.json's
      `quantization_config` saying so (the DeepSeek-V3 / Qwen3-FP8
      layout, which `load_checkpoint` and transformers read); every other
      tensor in `dtype`.
    block_size: "block_fp8"'s [rows, cols] of W [out, in] per scale;
      default (128, 128), the released checkpoints'.
    generation_config: written as `generation_config.json` (e.g.
      `{"eos_token_id": 0}`); its `bos_token_id`, `eos_token_id` and
      `pad_token_id` go into config.json too. None: no such file, and
      config.json's ids are null.
    tokenizer_files: files copied into the directory as they are named
      (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`,
      ...), for `transformers.AutoTokenizer`.

  Returns:
    The safetensors files written.

  Raises:
    TypeError: `config` is no `ModelConfig`, or `variables` holds no params.
    ValueError: a config no family expresses (the message names the
      nearest family and what it needs), a serving config, parameters that
      are not the config's, a bad `dtype`, `max_shard_size`,
      `weight_format` or `block_size`, a `generation_config` that is not a
      mapping, a tokenizer file that does not exist, or a `path` that
      holds files.

  The directory and its files get the modes a new folder and file get
  (the process umask's, as `save_pretrained` writes them): never a
  private temporary folder's.
  """
  if not isinstance(config, ModelConfig):
    raise TypeError(
        f"config must be a ModelConfig; got {type(config).__name__}."
    )
  if config.moe.serving:
    raise ValueError(
        "save_checkpoint writes float weights; config is a serving config "
        "(its expert kernels are converted): save the float variables."
    )
  if dtype is not None and dtype not in config_map.DTYPES:
    raise ValueError(
        f"dtype={dtype!r} is invalid: allowed None or"
        f" {sorted(config_map.DTYPES)}."
    )
  extra = _extra_files(generation_config, tokenizer_files)
  limit = parse_size(max_shard_size)
  block = _block(weight_format, block_size)
  family = config_map.family_for(config)
  target = pathlib.Path(path)
  if target.exists() and (not target.is_dir() or any(target.iterdir())):
    raise ValueError(f"{target} exists and is not an empty directory.")
  layers = _Layers(_params_of(variables))
  _check_tree(layers, flat_params(config), "parameters")
  srcs = tn.sources(family, config)
  state_srcs = tn.state_sources(family, config)
  planned = _planned(srcs, layers, dtype)
  if state_srcs:  # the saved buffers, in their own dtype (float32)
    state = _Layers(_rule_state_of(variables), layers.plan)
    wanted = flat_state(config)
    _check_tree(
        state, {p: wanted[p] for p in state_srcs}, f"{UPDATED_BY_RULE} state"
    )
    planned += _planned(state_srcs, state, None)
  disk_dtype = dtype or str(config.moe.param_dtype)
  hf = config_map.hf_config(config, disk_dtype)
  for key in _TOKEN_IDS:
    if generation_config and generation_config.get(key) is not None:
      hf[key] = generation_config[key]
  if block is not None:
    planned = block_fp8.planned(planned, block_fp8.quantized_names(srcs), block)
    hf["quantization_config"] = block_fp8.hf_quantization_config(srcs, block)
  target.parent.mkdir(parents=True, exist_ok=True)
  # A folder made as any other (mode 0o777 less the umask), not
  # `tempfile.mkdtemp`'s 0o700: the checkpoint is for others to read.
  staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}"
  staging.mkdir()
  try:
    (staging / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    files = write_checkpoint(staging, planned, limit)
    for name, write in extra.items():
      write(staging / name)
    if target.exists():
      target.rmdir()
    os.replace(staging, target)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return [target / f.name for f in files]
