"""Quantized serving: convert the trained expert weights once, serve from them.

    serve_config, serve_variables = quantize_weights(config, variables)
    y, aux = RoutedMoE(serve_config).apply(serve_variables, x)

`quantize_weights` takes a `MoEConfig` with `RoutedMoE` or
`RoutedAndSharedMoE` variables, or a `ModelConfig` with the reference
decoder's variables (scanned or unrolled), and returns the serving config
(`serving=True`) and new variables in which every routed and shared expert
kernel (`wi_0`, `wi_1`, `wo`) is stored in the mode's storage type beside its
scales (layout: `quantization/stored_weights.py`). The router, the per-expert
scale, attention, norms and embeddings stay float and untouched. The fp8
training state (`_overwrite_with_gradient`) is folded into the stored scales
and dropped; every other collection is kept. Nothing is modified in place.

Scales, per mode:

  int8       per expert and output channel, AQT's int8 grid
             (`int8_grouped.quantize_int8`), which the training mode uses on
             both paths: the stored int8 values are the ones the training
             forward multiplies.
  fp8,       one scale per kernel (per layer when stacked), Flax's delayed
  nanoo_fp8  scaling. Where the training state holds the kernel's fp8 state,
             the scale is the one its next training-mode forward would use:
             `compute_scale(max(kernel_amax_history), kernel_scale)` (the
             stored `kernel_scale` while the history is all zeros), and the
             input is quantized with the scale derived the same way from the
             input's state. Where there is no fp8 state (weights trained in
             another mode, and always for the shared expert, which training
             never quantizes): the kernel scale is max|kernel| / fp8_max (the
             scale delayed scaling settles on for these weights) and the input
             scale is 1, the value of a fresh fp8 state.

`convert_kernel` converts one kernel on the device; `convert_kernel_host`
makes the same numbers on the host, one matrix at a time (the checkpoint
loader's way). `expert_weight_bytes(variables)` counts the bytes of the
expert kernels and their scales (arrays or `jax.ShapeDtypeStruct`s, e.g.
from `jax.eval_shape`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from flax.linen import fp8_ops
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.config import expert_weights
from linen_moe._src.config import stack_plan
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.moe_config import MoEConfig
from linen_moe._src.config.quantization_modes import MODES
from linen_moe._src.config.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.kernels.int8_grouped import as_float32
from linen_moe._src.kernels.int8_grouped import quantize_int8
from linen_moe._src.kernels.int8_grouped import quantize_int8_host
from linen_moe._src.parallel import sharding
from linen_moe._src.quantization import stored_weights

PyTree = Any
KERNELS = expert_weights.KERNELS
# {params leaf name: (kernel, suffix)} of every leaf an expert kernel may
# occupy, float ("wi_0": ("wi_0", "")) or stored in any mode ("wi_0_scale":
# ("wi_0", "_scale"), ...): the one list of those names, which the byte
# count here and the checkpoint loader read.
KERNEL_LEAVES = {
    kernel + suffix: (kernel, suffix)
    for kernel in KERNELS
    for suffix in stored_weights.SUFFIXES
}
ROUTED, SHARED = "routed", "shared"


def _expert_nodes(params: Mapping, path: tuple[str, ...] = ()):
  """[(path, kind)] of every module in `params` that holds expert kernels,
  found by the layer's own naming wherever it sits: all of `KERNELS` with
  the router beside them is a routed layer [..., E, ...], without it one
  gated MLP (a shared expert, a dense layer's MLP)."""
  if not isinstance(params, Mapping):
    return []
  if all(k in params for k in KERNELS):
    return [(path, ROUTED if expert_weights.ROUTER in params else SHARED)]
  return [
      node
      for key in sorted(params)
      for node in _expert_nodes(params[key], (*path, key))
  ]


def _check_layers(config: ModelConfig, params: Mapping) -> None:
  """The layer subtrees `config.stack_plan` puts in a decoder's params."""
  plan = config.stack_plan
  names = [stack_plan.layer_name(i) for i in plan.before + plan.after]
  if plan.scanned:
    names.append(stack_plan.STACK)
  for name in names:
    _get(params, (name,), "params")


def _kernel_shapes(moe: MoEConfig, kind: str, node: Mapping) -> dict:
  """{name: (rank, expected trailing shape)} of the kernels of a node."""
  m = moe.emb_dim
  if kind == ROUTED:
    shapes = expert_weights.kernel_shapes(m, moe.moe_mlp_dim, moe.num_experts)
    return {k: (expert_weights.ROUTED_RANK, v) for k, v in shapes.items()}
  width = node["wo"].shape[-2]  # a shared expert's or a dense layer's F
  shapes = expert_weights.kernel_shapes(m, width)
  return {k: (expert_weights.MLP_RANK, v) for k, v in shapes.items()}


def _get(tree: Mapping, path: tuple[str, ...], what: str) -> Mapping:
  node = tree
  for i, key in enumerate(path):
    if not isinstance(node, Mapping) or key not in node:
      raise ValueError(
          f"{what} has no {'/'.join(path[: i + 1])}; the config describes "
          "variables that are not these (another model, or scanned vs "
          "unrolled layers?)."
      )
    node = node[key]
  return node


def _check_kernel(path: str, kernel, rank: int, shape) -> None:
  dtype = jnp.dtype(kernel.dtype)
  if stored_weights.converted(dtype):
    raise ValueError(
        f"params/{path} is already converted ({dtype}): quantize_weights "
        "takes float variables and converts them once."
    )
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"params/{path} must be a float kernel; got {dtype}.")
  if tuple(kernel.shape[kernel.ndim - rank :]) != shape:
    raise ValueError(
        f"params/{path} has shape {tuple(kernel.shape)}; the config expects "
        f"{shape} (after any stacked layer axes)."
    )


def _implied_scale(state: Mapping | None, role: str, fallback, fp8_max):
  """The scale a training-mode fp8 forward would quantize `role` with, [..., 1].

  `state` is a call site's fp8 state (or None); `fallback` is used without
  one.
  """
  if state is None:
    return fallback
  history = jnp.asarray(state[f"{role}_amax_history"], jnp.float32)
  scale = jnp.asarray(state[f"{role}_scale"], jnp.float32)
  amax = jnp.max(history, axis=-1, keepdims=True)
  return fp8_ops.compute_scale(amax, scale, fp8_max)


def _fp8_max(mode: str) -> np.float32:
  """The largest finite value of the mode's storage type, in float32."""
  dtype = stored_weights.STORAGE_DTYPES[mode]
  return np.float32(fp8_ops.get_fp8_max(dtype, jnp.float32))


def _fp8_scale(mode: str, amax):
  """The scale of a kernel without fp8 state: max|kernel| / fp8_max (1 for
  an all-zero kernel); `amax` [..., 1]."""
  return jnp.where(amax > 0, amax / _fp8_max(mode), 1.0)


def _fp8_values(mode: str, kernel, scale):
  """The stored fp8 values of a float kernel with its (broadcast) scale."""
  dtype = stored_weights.STORAGE_DTYPES[mode]
  return fp8_ops.quantize(kernel, dtype, scale, jnp.float32)


def _amax(kernel, rank: int):
  axes = tuple(range(kernel.ndim - rank, kernel.ndim))
  return jnp.max(jnp.abs(kernel), axis=axes)[..., None]  # [..., 1]


def _state_scales(mode: str, state: Mapping | None, own_scale):
  fp8_max = _fp8_max(mode)
  scale = _implied_scale(state, "kernel", own_scale, fp8_max)
  ones = jnp.ones_like(own_scale)
  return scale, _implied_scale(state, "input", ones, fp8_max)


# The conversion's steps, each jitted on its own (`_int8_parts`: values and
# per-channel scales; `_fp8_scale` of a kernel's max |x|; `_fp8_values` for
# a scale). `convert_kernel_host` is the same arithmetic in NumPy.
_int8_parts = jax.jit(
    lambda kernel: quantize_int8(kernel, axis=kernel.ndim - 2)
)
_fp8_scale_jit = jax.jit(_fp8_scale, static_argnums=0)
_fp8_values_jit = jax.jit(_fp8_values, static_argnums=0)
_amax_jit = jax.jit(_amax, static_argnums=1)
_state_scales_jit = jax.jit(_state_scales, static_argnums=0)


def convert_kernel(mode: str, kernel, rank: int, state: Mapping | None):
  """The stored form of one float kernel, on the device.

  Args:
    mode: a mode that stores weights (`SERVING_MODES`).
    kernel: float [..., K, N]; its last `rank` axes are one kernel (routed
      experts [E, K, N] or one MLP's [K, N]), the axes before them stacked
      layers.
    rank: `expert_weights.ROUTED_RANK` or `expert_weights.MLP_RANK`.
    state: the call site's fp8 state (`{role}_scale`, `{role}_amax_history`
      for roles kernel and input), or None.

  Returns:
    {suffix: array}: the values under "" and the scales under their
    suffixes (`stored_weights.stored_names`), shaped as the module docstring
    of `stored_weights` says.
  """
  kernel = jnp.asarray(kernel, jnp.float32)
  if stored_weights.per_channel(mode):  # int8
    values, scale = _int8_parts(kernel)
    return {"": values, stored_weights.SCALE_SUFFIX: scale}
  own_scale = _fp8_scale_jit(mode, _amax_jit(kernel, rank))
  scale, input_scale = _state_scales_jit(mode, state, own_scale)
  per_element = scale.reshape(scale.shape[:-1] + (1,) * rank)
  return {
      "": _fp8_values_jit(mode, kernel, per_element),
      stored_weights.SCALE_SUFFIX: scale,
      stored_weights.INPUT_SCALE_SUFFIX: input_scale,
  }


def convert_kernel_host(
    mode: str,
    read: Callable[[int | None], np.ndarray],
    num_experts: int | None,
    out: Mapping[str, np.ndarray],
) -> None:
  """`convert_kernel` of one kernel without fp8 state, on the host, one
  float matrix at a time, into buffers: the same numbers, bit for bit
  (tested), with no XLA program to compile per shape and one matrix in
  float32 on the host at a time (the checkpoint loader's way).

  The arithmetic, step for step `convert_kernel`'s: int8 is
  `int8_grouped.quantize_int8_host` of each matrix over K (the twin of
  `quantize_int8`); fp8 scales by max |kernel| times the float32 inverse
  of fp8_max (XLA divides by a constant so), 1 for an all-zero kernel,
  clips to +-fp8_max and rounds to nearest even, input scale 1.

  Args:
    mode: a mode that stores weights (`SERVING_MODES`).
    read: read(e) -> expert e's float [K, N] (any float dtype) of a routed
      kernel [E, K, N]; read(None) -> the [K, N] of an MLP's kernel. fp8
      reads every matrix twice (its scale is the whole kernel's).
    num_experts: E, or None for an MLP's kernel.
    out: {suffix: buffer} of the arrays `convert_kernel` returns for this
      one kernel (no stacked layer axes), of their shapes and dtypes;
      filled in place.
  """
  experts = [None] if num_experts is None else range(num_experts)

  def at(e):
    return () if e is None else (e,)

  values, scale = out[""], out[stored_weights.SCALE_SUFFIX]
  if stored_weights.per_channel(mode):  # int8
    for e in experts:
      values[at(e)], scale[at(e)] = quantize_int8_host(read(e), axis=0)
    return
  amax = np.float32(0)
  for e in experts:
    m = as_float32(read(e))
    amax = max(amax, m.max(), -m.min())
  fp8_max = _fp8_max(mode)
  scale[...] = amax * (np.float32(1) / fp8_max) if amax > 0 else 1
  out[stored_weights.INPUT_SCALE_SUFFIX][...] = 1
  for e in experts:
    scaled = as_float32(read(e)) / scale
    np.clip(scaled, -fp8_max, fp8_max, out=scaled)
    values[at(e)] = scaled.astype(values.dtype)


def _copy(tree: Mapping) -> dict:
  return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def quantize_weights(
    config: MoEConfig | ModelConfig, variables: Mapping
) -> tuple[MoEConfig | ModelConfig, dict]:
  """Converts the expert kernels of `variables` for serving in
  `config.quantization` (see the module docstring).

  Args:
    config: a `MoEConfig` (variables of `RoutedMoE` or `RoutedAndSharedMoE`)
      or a `ModelConfig` (variables of `linen_moe.Decoder`, laid out as
      `config.stack_plan` says), in a quantized mode and not serving.
    variables: `{"params": ..., ...}` as `init` returns them (boxed or not)
      or a train state's params and fp8 state; float expert kernels.

  Returns:
    A pair (serve_config, serve_variables), `config` with `serving=True`
    and new variables with the stored kernels and their scales in `params`,
    without the fp8 training state, every other collection as given
    (unboxed).

  Raises:
    TypeError: `config` is neither config type, or `variables` no mapping.
    ValueError: the mode stores no weights ("none": nothing to convert to;
      the config's serving rule, `moe_config.check_serving`), the config is
      already a serving config, a layer the config's stack plan names is
      missing, `params` holds no routed experts, or the kernels are already
      converted, not float, or of another shape than the config says.
  """
  if not isinstance(config, (MoEConfig, ModelConfig)):
    raise TypeError(
        f"config must be a MoEConfig or a ModelConfig; got {type(config)}."
    )
  moe = config.moe if isinstance(config, ModelConfig) else config
  if moe.serving:
    raise ValueError(
        "config is already a serving config (serving=True): its weights are "
        "converted; quantize_weights converts float weights once."
    )
  try:  # the config's serving rule: the mode must store weights
    serve_config = config.replace(serving=True)
  except ValueError as e:
    raise ValueError(f"quantize_weights makes a serving config: {e}") from e
  if not isinstance(variables, Mapping) or "params" not in variables:
    raise TypeError(
        "variables must be a mapping with a 'params' collection, as init "
        f"returns; got {type(variables).__name__}."
    )
  variables = sharding.unbox(variables)
  params = _copy(variables["params"])
  fp8_state = variables.get(OVERWRITE_WITH_GRADIENT, {})
  mode = moe.quantization
  if isinstance(config, ModelConfig):
    _check_layers(config, params)
  nodes = _expert_nodes(params)
  if not any(kind == ROUTED for _, kind in nodes):
    raise ValueError(
        "params holds no routed experts (a module with "
        f"{(expert_weights.ROUTER, *KERNELS)}); nothing to convert."
    )
  checked = []
  for path, kind in nodes:
    node = _get(params, path, "params")
    shapes = _kernel_shapes(moe, kind, node)
    for name in KERNELS:
      rank, shape = shapes[name]
      _check_kernel("/".join((*path, name)), node[name], rank, shape)
    checked.append((node, path, kind, shapes))
  for node, path, kind, shapes in checked:
    for name in KERNELS:
      state = None
      if kind == ROUTED and MODES[mode].keeps_state:
        site = (*path, f"{name}_dot")
        state = _find(fp8_state, site)
      stored = convert_kernel(mode, node.pop(name), shapes[name][0], state)
      for suffix, value in stored.items():
        node[name + suffix] = value
  serve_variables = {
      collection: tree
      for collection, tree in variables.items()
      if collection not in ("params", OVERWRITE_WITH_GRADIENT)
  }
  serve_variables["params"] = params
  return serve_config, serve_variables


def _find(tree: Mapping, path: tuple[str, ...]) -> Mapping | None:
  for key in path:
    if not isinstance(tree, Mapping) or key not in tree:
      return None
    tree = tree[key]
  return tree


def expert_weight_bytes(variables: Mapping) -> int:
  """Bytes of the expert kernels (`wi_0`, `wi_1`, `wo`, float or stored).

  Counted with their scales, under any module of `variables["params"]`
  (routed and shared experts, dense layers' MLPs alike): every leaf named
  `wi_0`, `wi_1` or `wo`, or one of those with a scale suffix.

  Args:
    variables: `{"params": ...}` of arrays or ShapeDtypeStructs (e.g.
      from `jax.eval_shape`), boxed or not.

  Returns:
    The total bytes (size times item size, summed).
  """
  total = 0
  flat = jax.tree_util.tree_flatten_with_path(
      sharding.unbox(variables)["params"]
  )[0]
  for path, leaf in flat:
    if str(getattr(path[-1], "key", path[-1])) in KERNEL_LEAVES:
      total += leaf.size * jnp.dtype(leaf.dtype).itemsize
  return total
