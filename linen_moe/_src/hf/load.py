"""`load_checkpoint`: a Hugging Face checkpoint straight into the decoder's
variables, tensor by tensor, into the shardings of the run.

Everything is checked before any tensor data is read: config.json (its
`model_type`, every field), the files (readable, complete, the index's
shards present), and every tensor's name, dtype and shape against what the
decoder of that config needs. Then each parameter is made with
`jax.make_array_from_callback`: every device reads only its own slice
(`reading.read`: the rows of W [out, in] it owns), transposed and cast in
one host copy; per-expert tensors land in their rows of `[E, ...]` and
layers in their rows of the scanned stack, so no parameter is ever whole on
the host twice. With `serving=True` the expert kernels are converted to
their storage type as they arrive (`quantization.quantize_weights`' formats and
numbers, one layer's float kernel at a time): a bf16 checkpoint becomes
int8 serving weights with the host holding about the int8 model plus one
layer's float kernel.

A block-fp8 checkpoint (DeepSeek-V3, Qwen3-FP8: `quantization_config`
with `weight_block_size`, fp8 tensors beside `weight_scale_inv`) is read
through `block_fp8.Dequantized`: each slice is dequantized as it is read
(float32 rows, then cast), so the host holds the slice's fp8 bytes and one
float32 copy of them beyond the result; serving conversion reads the same
float matrices one at a time. An MXFP4 checkpoint (GPT-OSS's released
experts, `quant_method: mxfp4`) is read the same way through
`mxfp4.Dequantized`, one expert's matrix at a time.
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Mapping
import functools
import json
import logging
import os
import pathlib
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.config import stack_plan
from linen_moe._src.config.expert_weights import ROUTED_RANK
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import check_serving
from linen_moe._src.config.quantization_modes import MODES
from linen_moe._src.config.variables import PARAMS
from linen_moe._src.config.variables import UPDATED_BY_RULE
from linen_moe._src.hf import block_fp8
from linen_moe._src.hf import config_map
from linen_moe._src.hf import download
from linen_moe._src.hf import mxfp4
from linen_moe._src.hf import reading
from linen_moe._src.hf import tensor_names as tn
from linen_moe._src.hf.layout import SAMPLE_SHAPE
from linen_moe._src.hf.layout import Path
from linen_moe._src.hf.layout import abstract_variables
from linen_moe._src.hf.safetensors_io import FLOAT_CODES
from linen_moe._src.hf.safetensors_io import Checkpoint
from linen_moe._src.models import layer_stack
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.parallel import sharding as sharding_lib
from linen_moe._src.quantization import serving as serving_lib
from linen_moe._src.quantization import stored_weights

CONFIG_FILE = "config.json"
_log = logging.getLogger("linen_moe.hf")


def read_config(directory: pathlib.Path) -> dict[str, Any]:
  """config.json of a checkpoint directory, as a dict."""
  path = directory / CONFIG_FILE
  if not path.is_file():
    raise ValueError(f"{directory} has no {CONFIG_FILE}.")
  try:
    hf = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(hf, dict):
    raise ValueError(f"{path} must hold a JSON object.")
  return hf


def _unrolled_shapes(abstract_params: Mapping, plan) -> dict[Path, Any]:
  """{unrolled params path: leaf with the float parameter's shape} from the
  (scanned, maybe serving) abstract params: a stacked leaf gives each of
  its layers a row; stored kernels' scales are no parameters."""
  flat = traverse_util.flatten_dict(sharding_lib.unbox(dict(abstract_params)))
  out = {}
  for path, leaf in flat.items():
    _, suffix = serving_lib.KERNEL_LEAVES.get(path[-1], (None, ""))
    if suffix:  # a scale
      continue
    rows = layer_stack.layer_rows(path, plan)
    if rows is None or stack_plan.STACK not in path:
      out[path] = leaf
      continue
    for i in rows:
      out[_unrolled(path, i)] = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
  return out


def check_tensors(
    ckpt: Checkpoint,
    srcs: Mapping[Path, tn.Source],
    shapes: Mapping[Path, Any],
    skipped: Collection[str] = (),
) -> None:
  """Raises a ValueError naming the file and the tensor unless the files
  hold exactly the tensors `srcs` read (and the `skipped` ones), float,
  each of its shape."""
  expected: dict[str, tuple[int, ...]] = {}
  for path, source in srcs.items():
    if path not in shapes:
      raise ValueError(f"The decoder has no parameter {'/'.join(path)}.")
    expected |= tn.expected_shapes(source, tuple(shapes[path].shape))
  missing = [n for n in expected if n not in ckpt.tensors]
  if missing:
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    raise ValueError(
        f"Checkpoint {ckpt.directory} is missing the tensor(s) "
        f"{missing[:3]}{more} that the model of its config.json needs."
    )
  extra = sorted(set(ckpt.tensors) - set(expected) - set(skipped))
  if extra:
    info = ckpt.tensors[extra[0]]
    more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
    raise ValueError(
        f"{info.file} holds the tensor {extra[0]!r}{more}, which the model "
        "of its config.json does not have."
    )
  for name, shape in expected.items():
    info = ckpt.tensors[name]
    if info.shape != shape:
      raise ValueError(
          f"{info.file}: tensor {name!r} has shape {list(info.shape)}; the "
          f"model of its config.json needs {list(shape)}."
      )
    if info.dtype not in FLOAT_CODES:
      raise ValueError(
          f"{info.file}: tensor {name!r} is {info.dtype}; expected a float "
          f"dtype {FLOAT_CODES}."
      )


def _unrolled(path: Path, i: int) -> Path:
  """The unrolled params path of layer `i`'s leaf at a (stacked) `path`."""
  for k, part in enumerate(path):
    if part == stack_plan.STACK:
      rest = path[k + 1 :]
      if rest and stack_plan.member_index(rest[0]) is not None:
        rest = rest[1:]
      return (*path[:k], stack_plan.layer_name(i), *rest)
  return path


def _shardings(abstract: Mapping, mesh, rules) -> dict[Path, Any]:
  """{(collection, *path): sharding} of every variable."""
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = traverse_util.flatten_dict(sharding_lib.unbox(dict(abstract)))
    return dict.fromkeys(flat, one)
  rules = sharding_lib.DEFAULT_RULES if rules is None else tuple(rules)
  tree = sharding_lib.logical_shardings(dict(abstract), mesh, rules)
  return traverse_util.flatten_dict(tree)


def _stored_kernel(path: Path, node: Mapping) -> tuple[str, str] | None:
  """(kernel name, suffix) when `path` is a stored kernel's values or
  scales (a serving layer's `wi_0`, `wi_0_scale`, ...), else None."""
  leaf = serving_lib.KERNEL_LEAVES.get(path[-1])
  values = None if leaf is None else node.get(leaf[0])
  if values is None or not stored_weights.converted(values.dtype):
    return None
  return leaf


class _Loader:
  """Makes each variable of the decoder from the checkpoint's tensors."""

  def __init__(self, ckpt, srcs, float_shapes, config, shardings):
    self.ckpt, self.srcs, self.float_shapes = ckpt, srcs, float_shapes
    self.config, self.shardings = config, shardings
    self.plan = config.stack_plan
    self.stored: dict[tuple[Path, str], dict[str, np.ndarray]] = {}

  def _layers(self, path: Path) -> tuple[tuple[int, ...] | None, Path]:
    rows = layer_stack.layer_rows(path, self.plan)
    stacked = rows is not None and stack_plan.STACK in path
    return (rows if stacked else None), path

  def float_param(
      self, path: Path, leaf, collection: str = PARAMS, srcs=None
  ) -> jax.Array:
    """A float variable of `collection` (its sources `srcs`, default the
    parameters'), each device reading its slice."""
    srcs = self.srcs if srcs is None else srcs
    rows, _ = self._layers(path)
    dtype = leaf.dtype

    def callback(index):
      index = reading.full_index(index, leaf.shape)
      out = reading.host_buffer(reading.sizes(index), dtype)
      if rows is None:
        return reading.read_into(self.ckpt, srcs[path], leaf.shape, index, out)
      for k, r in enumerate(range(index[0].start, index[0].stop)):
        src = srcs[_unrolled(path, rows[r])]
        reading.read_into(self.ckpt, src, leaf.shape[1:], index[1:], out[k])
      return out

    sharding = self.shardings[(collection, *path)]
    return jax.make_array_from_callback(leaf.shape, sharding, callback)

  def state(self, abstract: Mapping, srcs: Mapping[Path, tn.Source]) -> dict:
    """The `updated_by_rule` leaves that `srcs` read (the saved buffers);
    {} when none."""
    flat = traverse_util.flatten_dict(sharding_lib.unbox(dict(abstract)))
    out = {}
    for path, leaf in flat.items():
      rows, _ = self._layers(path)
      key = path if rows is None else _unrolled(path, rows[0])
      if key in srcs:
        out[path] = self.float_param(path, leaf, UPDATED_BY_RULE, srcs)
    return out

  def stored_param(self, path: Path, leaf, name: str, suffix: str, node):
    """A stored kernel's values or scales: the whole kernel (every stacked
    layer) converted into host buffers once, one expert's float kernel at
    a time; each device then takes its slice. The host buffers go once
    every leaf of the kernel is made."""
    key = (path[:-1], name)
    if key not in self.stored:
      shapes = {
          n[len(name) :]: (node[n].shape, node[n].dtype)
          for n in stored_weights.stored_names(
              name, self.config.moe.quantization
          )
      }
      self.stored[key] = self._convert((*path[:-1], name), shapes)
    host = self.stored[key].pop(suffix)
    if not self.stored[key]:
      del self.stored[key]
    sharding = self.shardings[(PARAMS, *path)]
    return jax.make_array_from_callback(
        leaf.shape, sharding, lambda index: host[index]
    )

  def _matrix(self, src_path: Path, e: int | None) -> np.ndarray:
    """One float [M, F] matrix of a kernel: expert `e`'s, or the whole MLP
    kernel (e None), in the parameters' dtype (what quantize_weights is
    given after a float load)."""
    shape = tuple(self.float_shapes[src_path].shape)
    index = () if e is None else (slice(e, e + 1),)
    dtype = self.config.moe.param_dtype
    m = reading.read(self.ckpt, self.srcs[src_path], shape, index, dtype)
    return m if e is None else m[0]

  def _convert(self, kernel_path: Path, shapes) -> dict[str, np.ndarray]:
    """{suffix: host array} of a stored kernel (values, scales), every
    layer's (a stacked kernel's) converted by `serving.convert_kernel_host`
    (`quantization.quantize_weights`' numbers) one float [M, F] matrix (an
    expert's, a layer's MLP) read at a time."""
    rows, _ = self._layers(kernel_path)
    out = {k: reading.host_buffer(*v) for k, v in shapes.items()}
    for r, i in enumerate(rows if rows is not None else (None,)):
      src_path = kernel_path if i is None else _unrolled(kernel_path, i)
      float_shape = self.float_shapes[src_path].shape
      routed = len(float_shape) == ROUTED_RANK
      slot = () if i is None else (r,)
      serving_lib.convert_kernel_host(
          self.config.moe.quantization,
          functools.partial(self._matrix, src_path),
          float_shape[0] if routed else None,
          {suffix: buffer[slot] for suffix, buffer in out.items()},
      )
    return out

  def params(self, abstract_params: Mapping) -> dict:
    flat = traverse_util.flatten_dict(sharding_lib.unbox(dict(abstract_params)))
    nodes: dict[Path, dict] = {}  # module path -> {child name: leaf}
    for path, leaf in flat.items():
      nodes.setdefault(path[:-1], {})[path[-1]] = leaf
      for k in range(len(path) - 1):
        nodes.setdefault(path[:k], {}).setdefault(path[k], None)
    out = {}
    for path, leaf in flat.items():
      stored = _stored_kernel(path, nodes[path[:-1]])
      if stored is None:
        out[path] = self.float_param(path, leaf)
      else:
        out[path] = self.stored_param(path, leaf, *stored, nodes[path[:-1]])
    return traverse_util.unflatten_dict(out)


def _fresh_state(config: ModelConfig, abstract: Mapping, shardings) -> dict:
  """The non-parameter collections (fp8 scales and amax histories, the
  routed biases) as `init` makes them; XLA drops the parameters' init."""
  names = [c for c in abstract if c != PARAMS]
  if not names:
    return {}
  flat_shardings = {
      c: traverse_util.unflatten_dict(
          {p[1:]: s for p, s in shardings.items() if p[0] == c}
      )
      for c in names
  }

  def init():
    tokens = jnp.zeros(SAMPLE_SHAPE, jnp.int32)
    variables = sharding_lib.unbox(
        Decoder(config).init(jax.random.key(0), tokens)
    )
    return {c: variables[c] for c in names}

  return jax.jit(init, out_shardings=flat_shardings)()


def _check_arguments(path, scan_layers, dtype, quantization, serving):
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(
        f"path must be a directory path; got {type(path).__name__}."
    )
  if not isinstance(scan_layers, bool):
    raise TypeError(f"scan_layers={scan_layers!r} must be a bool.")
  if dtype is not None and dtype not in config_map.DTYPES:
    raise ValueError(
        f"dtype={dtype!r} is invalid: allowed None (the checkpoint's) or "
        f"{sorted(config_map.DTYPES)}."
    )
  if quantization not in tuple(MODES):
    raise ValueError(
        f"quantization={quantization!r} is invalid: allowed {tuple(MODES)}."
    )
  if not isinstance(serving, bool):
    raise TypeError(f"serving={serving!r} must be a bool.")
  check_serving(serving, quantization)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    scan_layers: bool = True,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
    quantization: str = "none",
    serving: bool = False,
) -> tuple[ModelConfig, dict]:
  """Loads a Hugging Face checkpoint directory into the decoder's variables.

  `Decoder(config).apply(variables, tokens)` then computes transformers'
  logits for the checkpoint (`linen_moe.Decoder`, or the NNX decoder via
  `nnx_adapter.Decoder.from_linen`).

  Args:
    path: a directory with `config.json` and `model.safetensors`, or shards
      named by `model.safetensors.index.json`; a family of
      `linen_moe.hf.MODEL_TYPES`, either config.json style, experts per expert
      (the hub's names) or fused (transformers 5's `gate_up_proj`); float
      tensors, or block fp8 (`quantization_config` with `quant_method`
      "fp8" and `weight_block_size`, the fp8 tensors beside their
      `weight_scale_inv`: DeepSeek-V3's and Qwen3-FP8's released files),
      or GPT-OSS's MXFP4 experts (`quant_method` "mxfp4", `*_blocks`
      beside `*_scales`), dequantized as they are read.
    scan_layers: lay the layers out scanned (`config.stack_plan`) or
      unrolled.
    dtype: the parameters' and the computation's dtype ("float32",
      "bfloat16", "float16"); None: config.json's.
    mesh: place every variable straight into its sharding on this mesh
      (each device reads only its slice); None: the default device.
    rules: the logical-axis rules for `mesh` (default
      `linen_moe.sharding.DEFAULT_RULES`).
    quantization: the config's quantization mode (`linen_moe.quantization.MODES`).
    serving: convert the expert kernels to the mode's storage type as they
      are read (`linen_moe.quantization.quantize_weights`' layout), for a serving
      config; needs a quantized mode.

  Returns:
    A pair (config, variables), the `ModelConfig` (`serving=True` when
    asked) and `{"params": ...}` plus the fresh fp8 state of an fp8 training
    mode and the `updated_by_rule` state of a routing that has one, as
    arrays.

  Raises:
    TypeError: an argument of the wrong type.
    ValueError: a bad argument; or, before anything is loaded, a config.json
      that is missing, of an unsupported `model_type` (the message lists the
      supported ones) or with a field not implemented; a missing, truncated
      or damaged file, an index naming a missing shard; a tensor missing,
      unexpected, not float or of the wrong shape (the message names the
      file and the tensor); a `quantization_config` that is not block fp8,
      an fp8 tensor without its `weight_scale_inv` or whose scales do not
      match its blocks, an MXFP4 `_blocks` without its `_scales` or whose
      scales do not match it (the message names the file and the tensor).
  """
  _check_arguments(path, scan_layers, dtype, quantization, serving)
  directory = pathlib.Path(path)
  if not directory.exists():
    raise ValueError(
        f"path={str(directory)!r} does not exist (relative paths are read "
        f"from {pathlib.Path.cwd()}); {download.download_hint(path)}."
    )
  if not directory.is_dir():
    raise ValueError(
        f"path={str(directory)!r} is a file, not a checkpoint directory "
        "(with config.json and safetensors)."
    )
  hf = read_config(directory)
  on_disk = hf.pop("quantization_config", None)  # the files', not the model's
  block, fp4 = None, mxfp4.is_mxfp4(on_disk)
  if fp4:
    mxfp4.check_config(on_disk, directory / CONFIG_FILE)
  elif on_disk is not None:
    block = block_fp8.block_size(on_disk, directory / CONFIG_FILE)
  family = config_map.family_of(hf)
  config = config_map.model_config(hf)
  changes: dict[str, Any] = {"scan_layers": scan_layers}
  changes["quantization"] = quantization
  if dtype is not None:
    changes |= {"dtype": dtype, "param_dtype": dtype}
  config = config.replace(**changes)
  ckpt = Checkpoint(directory)
  if block is not None:
    ckpt = block_fp8.Dequantized(ckpt, block)
  if fp4:
    ckpt = mxfp4.Dequantized(ckpt)
  srcs = tn.sources(family, config, ckpt.tensors)
  state_srcs = tn.state_sources(family, config, ckpt.tensors)
  skipped = skipped_tensors(family, hf, ckpt.tensors)
  if serving:
    config = config.replace(serving=True)
  abstract = abstract_variables(config)
  plan = config.stack_plan
  float_shapes = _unrolled_shapes(abstract[PARAMS], plan)
  state_shapes = _unrolled_shapes(abstract.get(UPDATED_BY_RULE, {}), plan)
  check_tensors(
      ckpt, {**srcs, **state_srcs}, {**float_shapes, **state_shapes}, skipped
  )
  shardings = _shardings(abstract, mesh, rules)
  loader = _Loader(ckpt, srcs, float_shapes, config, shardings)
  variables = {PARAMS: loader.params(abstract[PARAMS])}
  variables |= _fresh_state(config, abstract, shardings)
  if state_srcs:  # the saved buffers replace their fresh values
    saved = loader.state(abstract[UPDATED_BY_RULE], state_srcs)
    flat = traverse_util.flatten_dict(variables[UPDATED_BY_RULE])
    variables[UPDATED_BY_RULE] = traverse_util.unflatten_dict(flat | saved)
  return config, variables


def skipped_tensors(
    family, hf: Mapping[str, Any], names: Collection[str]
) -> list[str]:
  """The tensors on disk that are no part of the text decoder, each kind
  said once in a warning: a multimodal checkpoint's towers, and the
  multi-token-prediction layers DeepSeek-V3 keeps past `num_hidden_layers`
  (transformers builds neither)."""
  prefixes = family.skipped_prefixes
  towers = [n for n in names if prefixes and n.startswith(prefixes)]
  if towers:
    _log.warning(
        "Skipping %d tensors of the multimodal towers (%s...): only the "
        "text decoder is loaded.",
        len(towers),
        ", ".join(sorted({p.strip(".").split(".")[-1] for p in prefixes})),
    )
  mtp = []
  if family.codec is not None and hasattr(family.codec, "mtp_layers"):
    layers = hf.get("num_hidden_layers", 0)
    extra = range(layers, layers + family.codec.mtp_layers(hf))
    heads = tuple(f"{family.prefix}layers.{i}." for i in extra)
    mtp = [n for n in names if heads and n.startswith(heads)]
    if mtp:
      _log.warning(
          "Skipping the %d tensors of the multi-token-prediction layer(s) "
          "%s past num_hidden_layers=%d: the decoder predicts the next "
          "token only (as transformers' model).",
          len(mtp),
          list(extra),
          layers,
      )
  return towers + mtp
