"""Compile, never run, a config's train (or decode) step for a target, and
read what a run there would need: `plan`.

The step is the one `linen-moe train` runs on a mesh (a front end's
`ShardedRun`: the same optimizer, grad accumulation, shardings), lowered
with sharded `jax.ShapeDtypeStruct`s of its state and batch (from
`jax.eval_shape`: nothing is allocated) and compiled for the target's
devices. The compiler's `memory_analysis()` gives the bytes per device;
the config gives the model FLOPs (`flops.model_flops`), cross-checked
against the compiler's `cost_analysis()`; the chip's table entry
(`chips.CHIPS`) gives a roofline step time and MFU.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from linen_moe._src import deprecation
from linen_moe._src.config.checks import check_int as _check_int
from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.variables import CACHE
from linen_moe._src.models import decoding
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.parallel import sharding
from linen_moe._src.planning import costs
from linen_moe._src.planning import flops as flops_lib
from linen_moe._src.planning import targets as targets_lib

# The mesh axes a batch is split over (`sharding.DEFAULT_RULES`'
# "activation_batch").
BATCH_AXES = ("data", "fsdp", "expert")

STEPS = ("train", "decode")


@dataclasses.dataclass(frozen=True)
class PerDevice:
  """Bytes on each device, from the compiled step.

  The first five are the compiler's (`compiled.memory_analysis()`); the
  rest split the step's arguments by what they are (from the shardings of
  the state, before compiling).

  Attributes:
    argument_bytes: the step's inputs (state and batch).
    output_bytes: its outputs (the new state, the metrics).
    alias_bytes: outputs that reuse a donated input's buffer.
    temp_bytes: activations and every other temporary.
    peak_bytes: arguments + outputs - aliased + temporaries (the
      compiler's own peak where it reports a larger one).
    parameter_bytes: the parameters.
    optimizer_state_bytes: the optimizer's moments, its step counters
      (train; 0 for decode).
    model_state_bytes: fp8 scales and amax histories, routed biases.
    cache_bytes: the KV cache (decode; 0 for train).
    batch_bytes: the tokens.
    host_bytes: what the compiled step keeps in host memory (offloaded
      arguments and temporaries; 0 without offloading).
  """

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  peak_bytes: int
  parameter_bytes: int = 0
  optimizer_state_bytes: int = 0
  model_state_bytes: int = 0
  cache_bytes: int = 0
  batch_bytes: int = 0
  host_bytes: int = 0

  def consumers(self) -> dict[str, int]:
    """What fills a device, by name.

    Returns:
      The bytes of each non-empty consumer by name, biggest first (the
      temporaries include outputs that do not reuse an input's buffer).
    """
    named = {
        "parameters": self.parameter_bytes,
        "optimizer state": self.optimizer_state_bytes,
        "fp8 and routing state": self.model_state_bytes,
        "KV cache": self.cache_bytes,
        "batch": self.batch_bytes,
        "activations and temporaries": (
            self.temp_bytes + max(0, self.output_bytes - self.alias_bytes)
        ),
    }
    ranked = sorted(named.items(), key=lambda kv: -kv[1])
    return {k: v for k, v in ranked if v > 0}


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a step needs on a target, read from its compiled program.

  Attributes:
    target: the target's name, e.g. "tpu:v5p-64" or "gpu:h100-8".
    devices: its device count.
    mesh: the mesh's axis sizes.
    step: "train" or "decode".
    batch_size: B, sequences per step (decode: rows).
    seq_len: S (decode: the KV cache length).
    grad_accum: microbatches per train step.
    per_device: the bytes on each device (`PerDevice`).
    device_memory_bytes: one device's memory.
    fits: whether `per_device.peak_bytes` fits in it.
    biggest_consumer: the name of `per_device`'s biggest consumer.
    flops_per_step: model FLOPs of one step, all devices
      (`linen_moe.planning.model_flops`).
    compiler_flops_per_step: the compiler's count (`cost_analysis`),
      all devices, or None where it gives none. It counts what the
      program executes (recomputation, the optimizer, every expert of a
      grouped matmul) but a loop's body once: a scanned stack of more
      than 4 layers counts about one layer, `grad_accum` microbatches one
      of them; no FLOPs inside Pallas kernels.
    tokens_per_step: tokens one step trains on (decode: generates).
    estimated_step_s: the roofline time of a step: the slower of the
      model FLOPs (never the compiler's count) at the chip's peak and the
      bytes the step reads and writes (the compiler's count, at least
      every argument, output and temporary once) at its memory
      bandwidth, per device, no communication (a lower bound); None
      without the chip's figures (CPU) or a compiled step.
    estimated_mfu: model FLOPs over the devices' peak in that time (an
      upper bound: 1.0 when the step is compute-bound); None likewise.
    chip: the chip's name, or None.
    compile_s: seconds the compile took.
    note: what else to know (e.g. the compiler's out-of-memory message).
    roofline_bound: what bounds `estimated_step_s`: "compute" (the model
      FLOPs at the peak) or "memory" (the bytes at the bandwidth); None
      without a roofline.
    compiler_flops_note: why `compiler_flops_per_step` is None (e.g. a
      GPU compiled without one has no cost analysis); None when it is not.
  """

  target: str
  devices: int
  mesh: dict[str, int]
  step: str
  batch_size: int
  seq_len: int
  grad_accum: int
  per_device: PerDevice
  device_memory_bytes: int
  fits: bool
  biggest_consumer: str
  flops_per_step: int
  compiler_flops_per_step: float | None
  tokens_per_step: int
  estimated_step_s: float | None
  estimated_mfu: float | None
  chip: str | None = None
  compile_s: float = 0.0
  note: str | None = None
  roofline_bound: str | None = None
  compiler_flops_note: str | None = None

  def to_json(self) -> dict[str, Any]:
    """The plan as JSON.

    Returns:
      A dict of every field (JSON-able), `per_device` a dict too, with its
      `consumers` by name.
    """
    out = dataclasses.asdict(self)
    out["per_device"]["consumers"] = self.per_device.consumers()
    return out


def _shard_bytes(leaf: Any) -> int:
  """Bytes of one device's shard of a sharded ShapeDtypeStruct (or array)."""
  shape = leaf.shape
  sharding_ = getattr(leaf, "sharding", None)
  if sharding_ is not None:
    shape = sharding_.shard_shape(shape)
  dtype = leaf.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    itemsize = jax.random.key_data(jax.random.key(0)).nbytes
  else:
    itemsize = jnp.dtype(dtype).itemsize
  return math.prod(shape) * itemsize


def _tree_bytes(tree: Any) -> int:
  return sum(_shard_bytes(x) for x in jax.tree.leaves(tree))


# libtpu's out-of-memory messages: "... the total memory required for HLO
# temporaries (44.15G) exceeds available HBM (15.75G)", or "Used 123.45G of
# 95.74G hbm. Exceeded hbm capacity by ...". Both figures are everything
# the program needs, arguments and outputs included (`x * 2` of a 20 GiB
# argument, not donated, reads "HLO temporaries (40.00G)" for a v5e).
_SIZE = r"([\d.]+)([KMGT]?)"
_OOM_TOTAL = re.compile(rf"HLO temporaries \({_SIZE}\) exceeds available HBM")
_OOM_USED = re.compile(rf"Used\s+{_SIZE}\s+of\s+{_SIZE}\s+hbm")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(match, group: int = 1) -> int:
  return int(float(match.group(group)) * _UNITS[match.group(group + 1)])


@dataclasses.dataclass(frozen=True)
class _OutOfMemory:
  """What a compile that ran out of device memory reported."""

  message: str  # its first line
  used_bytes: int | None = None  # everything it needed, arguments included


def _out_of_memory(error: Exception) -> _OutOfMemory | None:
  """What the error of a compile that ran out of device memory says, or
  None for any other error. A kernel whose blocks overflow a TPU core's
  scoped VMEM (libtpu's CompileTimeScopedVmemOom) is a compile error of
  the program, whatever the slice's memory: not a plan that does not fit."""
  text = str(error)
  if not re.search(r"RESOURCE_EXHAUSTED|HbmOom|[Oo]ut of memory", text):
    return None
  if "VmemOom" in text:
    return None
  first = text.strip().splitlines()[0][:400] if text.strip() else ""
  used = _OOM_TOTAL.search(text) or _OOM_USED.search(text)
  return _OutOfMemory(first, used_bytes=_bytes(used) if used else None)


def _default_frontend():
  from linen_moe._src.training.frontend import LinenFrontend  # noqa: PLC0415

  return LinenFrontend


def _sharded_step(fe, factory) -> Callable[..., Any]:
  """`(config, optimizer, mesh, grad_accum) -> ShardedRun`: the front end's
  own, or the deprecated `sharded_training` factory, with a warning."""
  if factory is None:
    return fe.sharded
  deprecation.warn(
      "plan(sharded_training=...)",
      "pass frontend=, whose sharded() is the sharded step",
  )
  return lambda cfg, opt, mesh, accum: factory(cfg, opt, mesh, grad_accum=accum)


def _compile_train(
    cfg, mesh, batch_size, seq_len, grad_accum, optimizer, sharded, fe
):
  """(compiled or the out-of-memory error, PerDevice's argument split)."""
  run = sharded(cfg, optimizer, mesh, grad_accum)
  tokens = jax.ShapeDtypeStruct(
      (batch_size, seq_len), jnp.int32, sharding=run.token_sharding()
  )
  key = jax.eval_shape(lambda: jax.random.key(0))
  rng = jax.ShapeDtypeStruct(
      key.shape, key.dtype, sharding=sharding.replicated(mesh)
  )
  state = run.abstract_state(tokens, rng)
  tree = fe.checkpoint_tree(state)
  variables = dict(tree.get("variables", {}))
  params = variables.pop("params", {})
  split = {
      "parameter_bytes": _tree_bytes(params),
      "model_state_bytes": _tree_bytes(variables),
      "optimizer_state_bytes": _tree_bytes(
          {k: v for k, v in tree.items() if k != "variables"}
      ),
      "batch_bytes": _shard_bytes(tokens),
  }
  return run.lower(state, tokens, rng), split


def _cache_sharding(leaf, mesh, batch_shards: int, batch_axes):
  if leaf.ndim >= 2 and leaf.shape[0] % batch_shards == 0:
    return NamedSharding(mesh, P(batch_axes))
  return sharding.replicated(mesh)


def _compile_decode(cfg, mesh, batch_size, seq_len):
  """The decode step of `linen_moe.decoding.decode_step`: one token per row
  against a cache of `seq_len` positions, the layers unrolled."""
  ucfg = decoding.unrolled_config(cfg)
  rules = sharding.DEFAULT_RULES
  with sharding.mesh_context(mesh, rules):
    boxed = jax.eval_shape(
        lambda: Decoder(ucfg, decode=True).init(
            jax.random.key(0), jnp.zeros((batch_size, seq_len), jnp.int32)
        )
    )
    shardings = sharding.logical_shardings(boxed, mesh, rules)
  plain = sharding.unbox(boxed)
  batch_axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1) or None
  batch_shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
  cache = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          x.shape,
          x.dtype,
          sharding=_cache_sharding(x, mesh, batch_shards, batch_axes),
      ),
      plain[CACHE],
  )
  variables = {
      name: jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
          plain[name],
          shardings[name],
      )
      for name in plain
      if name != CACHE
  }
  token = jax.ShapeDtypeStruct(
      (batch_size,),
      jnp.int32,
      sharding=NamedSharding(
          mesh, P(batch_axes if batch_size % batch_shards == 0 else None)
      ),
  )

  def step(variables, cache, token):
    return decoding.extend(ucfg, variables, cache, token[:, None])

  other = {k: v for k, v in variables.items() if k != "params"}
  split = {
      "parameter_bytes": _tree_bytes(variables.get("params", {})),
      "model_state_bytes": _tree_bytes(other),
      "cache_bytes": _tree_bytes(cache),
      "batch_bytes": _shard_bytes(token),
  }
  jitted = jax.jit(step, donate_argnums=1)
  with sharding.mesh_context(mesh, rules):
    return jitted.lower(variables, cache, token), split


def plan(
    config: ModelConfig,
    target: str | targets_lib.Target,
    *,
    mesh: str | Mapping[str, int] | None = None,
    batch_size: int = 16,
    seq_len: int = 32,
    grad_accum: int = 1,
    decode: bool = False,
    optimizer: Any = None,
    sharded_training: Callable[..., Any] | None = None,
    frontend: Any = None,
    device_memory_bytes: int | None = None,
) -> Plan:
  """Compiles (never runs) a step of `config` for `target`; its plan.

  The train step is the one `linen-moe train` runs on a mesh: the front
  end's sharded step (`frontend.sharded`, by default the Linen
  `linen_moe.training.ShardedTraining`) with AdamW (`optimizer`, default
  `linen_moe.training.default_optimizer()`) and `grad_accum`
  microbatches, its inputs sharded `jax.ShapeDtypeStruct`s of the state and
  the batch: nothing is allocated, on any device. With `decode`, the
  decode step (`linen_moe.decoding.decode_step`: B tokens against a
  cache of `seq_len` positions, the layers unrolled) instead.

  For `cpu:N` this process must have N CPU devices (`prepare_process`
  before jax starts); a TPU slice needs libtpu (the `tpu-plan` extra:
  `pip install '.[tpu-plan]'` from a checkout), NVIDIA GPUs jax's CUDA
  plugin (`gpu-plan`; no autotuning, and no cost analysis: the plan has
  no compiler FLOPs, says why in `compiler_flops_note`, and its roofline
  uses the model FLOPs and the compiled bytes). A step that
  cannot fit a TPU's memory fails to compile there: the plan then says so
  (`fits` False, the compiler's message in `note`, the bytes it reported
  used as the peak).

  Args:
    config: the decoder's config (quantization, remat and layer mode as
      it says).
    target: "cpu:N", "tpu:<slice>" or "gpu:<gpu>-N" (`parse_target`), or
      a `Target`.
    mesh: a mesh spec over `linen_moe.sharding.MESH_AXES`, e.g.
      "fsdp=16,expert=4" (default: "data=<devices>", as `linen-moe train`
      over several processes); its sizes multiply to the target's devices.
    batch_size: B, divisible by the mesh's batch axes (data, fsdp, expert)
      and by `grad_accum`.
    seq_len: S >= 2 (decode: the cache length, >= 1).
    grad_accum: microbatches per train step.
    decode: plan the decode step instead of the train step.
    optimizer: the optax transformation of the train step.
    sharded_training: deprecated (until 0.4): the front end's own
      `sharded` is its sharded step.
    frontend: the `TrainingFrontend` whose sharded step is planned (and
      whose state is read as a checkpoint tree); default
      `linen_moe.training.LinenFrontend`.
    device_memory_bytes: one device's memory (default: the chip's, or for
      `cpu:N` the host's memory over N).

  Returns:
    The `Plan`.

  Raises:
    TypeError: `config` is not a `ModelConfig`.
    ValueError: an unknown target, a mesh whose sizes do not multiply to
      the target's devices, a batch the mesh or `grad_accum` does not
      divide, a bad size; before any compile.
  """
  if not isinstance(config, ModelConfig):
    raise TypeError(f"config must be a ModelConfig, got {type(config)}.")
  if not isinstance(target, targets_lib.Target):
    target = targets_lib.parse_target(target)
  sizes = targets_lib.check_mesh(mesh, target)
  _check_int("batch_size", batch_size, 1)
  _check_int("seq_len", seq_len, 1 if decode else 2)
  _check_int("grad_accum", grad_accum, 1)
  if batch_size % grad_accum:
    raise ValueError(
        f"grad_accum={grad_accum} is invalid: expected a divisor of "
        f"batch_size={batch_size}."
    )
  shards = math.prod(sizes[a] for a in BATCH_AXES)
  if (batch_size // grad_accum) % shards:
    raise ValueError(
        f"batch_size={batch_size} is invalid: each of its {grad_accum} "
        f"microbatches is split over the mesh's batch axes {BATCH_AXES} "
        f"({shards} ways), so it must be a multiple of {shards * grad_accum}."
    )
  if device_memory_bytes is not None:
    _check_int("device_memory_bytes", device_memory_bytes, 1)
  memory = device_memory_bytes or target.device_memory_bytes

  device_mesh = sharding.make_mesh(sizes, targets_lib.target_devices(target))
  if decode:
    lowered, split = _compile_decode(config, device_mesh, batch_size, seq_len)
  else:
    fe = frontend or _default_frontend()
    if optimizer is None:
      from linen_moe._src.training.optimizer import default_optimizer  # noqa: PLC0415

      optimizer = default_optimizer()
    lowered, split = _compile_train(
        config,
        device_mesh,
        batch_size,
        seq_len,
        grad_accum,
        optimizer,
        _sharded_step(fe, sharded_training),
        fe,
    )
  start = time.perf_counter()
  note = None
  try:
    compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001 (only out-of-memory is a plan)
    oom = _out_of_memory(e)
    if oom is None:
      raise
    note = oom.message
    compiled = None
  compile_s = time.perf_counter() - start

  arguments = sum(split.values())
  if compiled is not None:
    stats = compiled.memory_analysis()
    per_device = _per_device(stats, split)
    cost = costs.compiled_cost(compiled)
  else:  # the compiler's figures, where its message has them
    temp = 0
    if oom.used_bytes is not None:
      temp = max(0, oom.used_bytes - arguments)
    per_device = PerDevice(
        argument_bytes=arguments,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=temp,
        peak_bytes=max(arguments + temp, memory + 1),
        **split,
    )
    cost = {}
  devices = target.num_devices
  flops = flops_lib.model_flops(config, batch_size, seq_len, decode=decode)
  compiler_flops = cost.get("flops")
  flops_note = None
  if compiler_flops is not None and compiler_flops >= 0:
    compiler_flops = float(compiler_flops) * devices
  else:
    compiler_flops = None
    flops_note = costs.no_compiler_flops(target, compiled)
  step_s = mfu = bound = None
  chip = target.chip
  if chip is not None and compiled is not None:
    # The compiler's count takes a loop's body once (a scanned stack's
    # layers): at least every argument, output and temporary once.
    moved = max(
        cost.get("bytes accessed") or 0,
        per_device.argument_bytes
        + per_device.output_bytes
        + per_device.temp_bytes,
    )
    step_s, mfu, bound = costs.roofline(flops / devices, moved, chip)
  consumers = per_device.consumers()
  return Plan(
      target=target.name,
      devices=devices,
      mesh=dict(sizes),
      step="decode" if decode else "train",
      batch_size=batch_size,
      seq_len=seq_len,
      grad_accum=1 if decode else grad_accum,
      per_device=per_device,
      device_memory_bytes=memory,
      fits=compiled is not None and per_device.peak_bytes <= memory,
      biggest_consumer=next(iter(consumers), "nothing"),
      flops_per_step=flops,
      compiler_flops_per_step=compiler_flops,
      tokens_per_step=batch_size * (1 if decode else seq_len),
      estimated_step_s=step_s,
      estimated_mfu=mfu,
      chip=None if chip is None else chip.name,
      compile_s=compile_s,
      note=note,
      roofline_bound=bound,
      compiler_flops_note=flops_note,
  )


def _per_device(stats, split: dict[str, int]) -> PerDevice:
  if stats is None:  # a backend without memory analysis
    arguments = sum(split.values())
    return PerDevice(arguments, 0, 0, 0, arguments, **split)
  argument = int(stats.argument_size_in_bytes)
  output = int(stats.output_size_in_bytes)
  alias = int(stats.alias_size_in_bytes)
  temp = int(stats.temp_size_in_bytes)
  # The compiler's own peak where it is larger (XLA:CPU's is not a bound).
  peak = max(
      argument + output - alias + temp,
      int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
  )
  host = sum(
      int(getattr(stats, f"host_{k}_size_in_bytes", 0) or 0)
      for k in ("argument", "temp")
  )
  return PerDevice(
      argument_bytes=argument,
      output_bytes=output,
      alias_bytes=alias,
      temp_bytes=temp,
      peak_bytes=peak,
      host_bytes=host,
      **split,
  )
