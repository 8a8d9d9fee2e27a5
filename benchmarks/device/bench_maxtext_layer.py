"""MaxText 0.2.5's MoE layer beside ours on one chip, forward + backward,
same weights and input, in one process, beside a dense gated MLP of the
same FLOPs.

For each shape (B x S tokens, E experts of M x H, top-k; bf16 weights and
activations), every variant computes the gradients of `sum(out * cot)`
(a fixed random cotangent) with respect to the layer's weights and its
input, and is timed in rounds that call each variant once in turn
(medians of --repeats):

  dense               a gated MLP of hidden k * H (`jnp.dot`): the FLOPs
                      the routed experts do, with no routing
  maxtext_megablox    `maxtext.layers.moe.RoutedMoE`, `megablox=True` (its
                      forked megablox kernels, base.yml's tiles)
  maxtext_ragged_dot  the same with `megablox=False`: `jax.lax.ragged_dot`
  maxtext_tokamax     the same with `use_tokamax_gmm=True`: tokamax's
                      `ragged_dot` (Mosaic)
  ours_auto           `linen_moe.RoutedMoE`, `grouped_matmul="auto"` (the
                      gate and up projections paired, as by default)
  ours_ragged_dot     ... `grouped_matmul="ragged_dot"`
  ours_auto_unpaired  ... `"auto"` with the gate and up projections as two
                      kernel calls each way
                      (`accelerator.paired_gate_up(False)`)
  ours_kernel         ... `"kernel"` (not in the default run)
  ours_*_rows_once    ... with `remat_rows=False` (not in the default run;
                      before `_unpaired` where both are asked)

Both layers compute the same function: MaxText's router in float32
(`float32_gate_logits=True`; ours always is), no load-balance loss, and
the routing of the shape: "mixtral" (top-k of the logits, softmax over
them) at 8 experts, "qwen3_moe" with `norm_topk_prob` (softmax, top-k,
renormalised: the same weights) at 128. Each layer's output and gradients
are compared with `ours_ragged_dot`'s (max |difference| / max |value|,
per leaf); bf16 rounding gives ~1e-2.

Printed per variant: ms, useful TFLOP/s (18 T k M H: three matmuls of the
routed tokens, forward and backward) and the fraction of dense (dense ms /
its ms; issue 46's bar for ours: 0.80 at 8 experts, 0.55 at 128). Writes
--out/bench_maxtext_layer.json after each shape.

MaxText is imported only for its variants, with two import-only stand-ins
(the layer calls neither): `jax.experimental.xla_metadata.must_fuse_call`,
which jax 0.10.2 lacks (MaxText's flash attention uses it), and
`maxtext.checkpoint_conversion.utils.load_dynamic` (checkpoint conversion;
it reads transformers' model configs at import). How to install MaxText
on the chip: benchmarks/device/README.md and `one_chip.sh maxtext`.

  python benchmarks/device/bench_maxtext_layer.py --out DIR    # on a TPU
  python benchmarks/device/bench_maxtext_layer.py --interpret --out DIR
      # anywhere: tiny shapes, Pallas (MaxText's megablox, our "kernel")
      # in interpret mode
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import os
import sys
import time
import types
from typing import NamedTuple

import bench_gmm
import jax
import jax.numpy as jnp
import numpy as np

import linen_moe

# The pairing's switch has no public name (benchmarks compare with it on).
from linen_moe._src.kernels import accelerator  # noqa: TID251
from linen_moe._src.planning import costs  # noqa: TID251

BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Shape:
  """One layer shape: B x S tokens, E experts of M x H, top-k."""

  batch: int
  seq: int
  emb: int
  mlp: int
  experts: int
  top_k: int
  routing: str  # our MoEConfig.routing; MaxText's follows (see maxtext_config)
  bar: float  # issue 46's fraction of dense for ours

  @property
  def tokens(self) -> int:
    return self.batch * self.seq


SHAPES = {
    "8x2048x5632": Shape(4, 4096, 2048, 5632, 8, 2, "topk_then_softmax", 0.80),
    "128x2048x768": Shape(
        4, 4096, 2048, 768, 128, 8, "softmax_then_topk", 0.55
    ),
}
# --interpret: the same structure at sizes a CPU runs in seconds.
TINY = {
    "8x2048x5632": Shape(2, 64, 128, 256, 8, 2, "topk_then_softmax", 0.80),
    "128x2048x768": Shape(2, 64, 128, 64, 16, 4, "softmax_then_topk", 0.55),
}
DEFAULT_VARIANTS = (
    "dense",
    "maxtext_megablox",
    "maxtext_ragged_dot",
    "maxtext_tokamax",
    "ours_auto",
    "ours_auto_unpaired",
    "ours_ragged_dot",
)
REFERENCE = "ours_ragged_dot"
# The largest relative difference from REFERENCE that bf16 rounding
# explains (its epsilon is 7.8e-3; the sums differ in order).
BF16_TOLERANCE = 2e-2
# MaxText's config switches of each of its grouped matmuls (base.yml has
# megablox=True, use_tokamax_gmm=False).
MAXTEXT_PATHS = {
    "megablox": {"megablox": True, "use_tokamax_gmm": False},
    "ragged_dot": {"megablox": False, "use_tokamax_gmm": False},
    "tokamax": {"megablox": False, "use_tokamax_gmm": True},
}
OURS_IMPLEMENTATIONS = ("auto", "ragged_dot", "kernel", "blocked")


def useful_flops(shape: Shape) -> float:
  """FLOPs of the routed experts' forward + backward: three [T k, M] x
  [M, H]-sized matmuls, each run three times (out, input and weight
  gradients)."""
  return 3.0 * 3 * 2 * shape.tokens * shape.top_k * shape.emb * shape.mlp


class Variant(NamedTuple):
  """A variant name read: side "dense", "maxtext" or "ours"; ours' options."""

  side: str
  impl: str
  rows_once: bool = False
  paired: bool = True


def parse_variant(name: str) -> Variant:
  """The `Variant` of a name (see the module docstring)."""
  if name == "dense":
    return Variant("dense", "")
  side, _, impl = name.partition("_")
  unpaired = impl.endswith("_unpaired")
  impl = impl.removesuffix("_unpaired")
  paired = not unpaired
  rows_once = impl.endswith("_rows_once")
  impl = impl.removesuffix("_rows_once")
  if (
      side == "maxtext"
      and impl in MAXTEXT_PATHS
      and not (rows_once or unpaired)
  ):
    return Variant(side, impl)
  if side == "ours" and impl in OURS_IMPLEMENTATIONS:
    return Variant(side, impl, rows_once, paired)
  raise ValueError(
      f"unknown variant {name!r}: dense, maxtext_{{{','.join(MAXTEXT_PATHS)}}}"
      f" or ours_{{{','.join(OURS_IMPLEMENTATIONS)}}}[_rows_once][_unpaired]"
  )


def fractions(ms: dict[str, float]) -> dict[str, float]:
  """{variant: dense ms / its ms} (empty without dense)."""
  if "dense" not in ms:
    return {}
  return {name: ms["dense"] / t for name, t in ms.items()}


# -- the operands ------------------------------------------------------------


def our_layer(shape: Shape, impl: str, rows_once: bool = False):
  cfg = linen_moe.MoEConfig(
      num_experts=shape.experts,
      num_experts_per_tok=shape.top_k,
      emb_dim=shape.emb,
      moe_mlp_dim=shape.mlp,
      routing=shape.routing,
      norm_topk_prob=shape.routing == "softmax_then_topk",
      grouped_matmul=impl,
      dtype="bfloat16",
      param_dtype="bfloat16",
      load_balance_loss_weight=0.0,
  )
  return linen_moe.RoutedMoE(cfg, remat_rows=not rows_once)


def operands(shape: Shape, sharding=None) -> dict:
  """{"params": the layer's weights (ours initialised them; MaxText's get
  the same), "dense": the dense MLP's, "x": [B, S, M], "cot": [B, S, M]};
  with a `sharding`, their `jax.ShapeDtypeStruct`s placed by it (to
  compile for a target without running)."""
  if sharding is not None:
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        jax.eval_shape(lambda: operands(shape)),
    )
  kx, kc, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (shape.batch, shape.seq, shape.emb), BF16)
  cot = jax.random.normal(kc, x.shape, BF16)
  variables = jax.jit(our_layer(shape, "ragged_dot").init)(jax.random.key(1), x)
  params = linen_moe_unbox(variables["params"])
  hidden = shape.top_k * shape.mlp
  k0, k1, k2 = jax.random.split(kd, 3)
  dense = {
      "wi_0": jax.random.normal(k0, (shape.emb, hidden), BF16) / shape.emb**0.5,
      "wi_1": jax.random.normal(k1, (shape.emb, hidden), BF16) / shape.emb**0.5,
      "wo": jax.random.normal(k2, (hidden, shape.emb), BF16) / hidden**0.5,
  }
  return {"params": params, "dense": dense, "x": x, "cot": cot}


def linen_moe_unbox(tree):
  """The arrays of a Linen variable tree (logical-partitioning boxes
  removed)."""
  import flax.linen as nn  # noqa: PLC0415

  return nn.meta.unbox(tree)


def _loss_and_grads(apply):
  """jit of (weights, x, cot) -> (out, weight grads, x grad) of
  `sum(apply(weights, x) * cot)`."""

  def loss(weights, x, cot):
    out = apply(weights, x)
    return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

  grad = jax.grad(loss, argnums=(0, 1), has_aux=True)

  @jax.jit
  def step(weights, x, cot):
    (dw, dx), out = grad(weights, x, cot)
    return out, dw, dx

  return step


def dense_step():
  def apply(w, x):
    h = jax.nn.silu(jnp.dot(x, w["wi_0"])) * jnp.dot(x, w["wi_1"])
    return jnp.dot(h, w["wo"])

  return _loss_and_grads(apply)


def our_step(shape: Shape, impl: str, rows_once: bool):
  layer = our_layer(shape, impl, rows_once)
  return _loss_and_grads(lambda p, x: layer.apply({"params": p}, x)[0])


# -- MaxText -----------------------------------------------------------------


def _raises(name: str):
  def stand_in(*args, **kwargs):
    del args, kwargs
    raise NotImplementedError(f"{name}: an import-only stand-in")

  return stand_in


def import_maxtext() -> types.SimpleNamespace:
  """MaxText's modules the bench uses, after the import-only stand-ins."""
  from jax.experimental import xla_metadata  # noqa: PLC0415

  if not hasattr(xla_metadata, "must_fuse_call"):
    xla_metadata.must_fuse_call = _raises("must_fuse_call")
  name = "maxtext.checkpoint_conversion.utils.load_dynamic"
  if name not in sys.modules:
    stand_in = types.ModuleType(name)

    def attribute(attr):
      if attr.startswith("__"):
        raise AttributeError(attr)
      return _raises(f"{name}.{attr}")

    stand_in.__getattr__ = attribute
    sys.modules[name] = stand_in
  # pylint: disable=import-outside-toplevel
  from flax import nnx  # noqa: PLC0415
  from flax.linen import partitioning  # noqa: PLC0415
  from maxtext.configs import pyconfig  # noqa: PLC0415
  from maxtext.layers import initializers  # noqa: PLC0415
  from maxtext.layers import moe  # noqa: PLC0415
  from maxtext.utils import globals as mt_globals  # noqa: PLC0415
  from maxtext.utils import maxtext_utils  # noqa: PLC0415

  return types.SimpleNamespace(
      nnx=nnx,
      partitioning=partitioning,
      pyconfig=pyconfig,
      initializers=initializers,
      moe=moe,
      configs_dir=mt_globals.MAXTEXT_CONFIGS_DIR,
      maxtext_utils=maxtext_utils,
  )


def maxtext_config(mt, shape: Shape, path: str, platform: str):
  """MaxText's config of the layer on `platform` ("tpu", "cpu"): base.yml,
  then the shape, bf16, its router in float32 and `path`'s grouped
  matmul."""
  if shape.routing == "topk_then_softmax":
    routing = {"decoder_block": "mixtral"}
  elif shape.routing == "softmax_then_topk":
    routing = {"decoder_block": "qwen3_moe", "norm_topk_prob": True}
  else:
    raise ValueError(f"no MaxText routing for {shape.routing!r}")
  return mt.pyconfig.initialize(
      [None, os.path.join(mt.configs_dir, "base.yml")],
      run_name="bench_maxtext_layer",
      enable_checkpointing=False,
      skip_jax_distributed_system=True,
      log_config=False,
      hardware="tpu" if platform == "tpu" else "cpu",
      num_experts=shape.experts,
      num_experts_per_tok=shape.top_k,
      base_emb_dim=shape.emb,
      base_mlp_dim=shape.mlp,
      base_moe_mlp_dim=shape.mlp,
      per_device_batch_size=shape.batch,
      max_target_length=shape.seq,
      dtype="bfloat16",
      weight_dtype="bfloat16",
      float32_gate_logits=True,
      sparse_matmul=True,
      capacity_factor=-1.0,
      load_balance_loss_weight=0.0,
      **routing,
      **MAXTEXT_PATHS[path],
  )


@contextlib.contextmanager
def _maxtext_context(mt, cfg, mesh):
  with jax.set_mesh(mesh), mt.partitioning.axis_rules(cfg.logical_axis_rules):
    yield


def maxtext_step(mt, shape: Shape, path: str, device=None):
  """(jitted step over our weight layout, the context to trace it in); on
  `device` (one of a target's, to compile for) or else MaxText's mesh of
  this process's devices."""
  platform = jax.default_backend() if device is None else device.platform
  cfg = maxtext_config(mt, shape, path, platform)
  if device is None:
    devices = mt.maxtext_utils.create_device_mesh(cfg)
    building = _maxtext_context(
        mt, cfg, jax.sharding.Mesh(devices, cfg.mesh_axes)
    )
  else:  # its weights built here, not on the target
    devices = np.array([device]).reshape([1] * len(cfg.mesh_axes))
    building = mt.partitioning.axis_rules(cfg.logical_axis_rules)
  mesh = jax.sharding.Mesh(devices, cfg.mesh_axes)
  with building:
    layer = mt.moe.RoutedMoE(
        config=cfg,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        mesh=mesh,
        kernel_init=mt.initializers.nd_dense_init(
            1.0, "fan_in", "truncated_normal"
        ),
        kernel_axes=("embed", None),
        intermediate_dim=cfg.moe_mlp_dim,
        dtype=cfg.dtype,
        weight_dtype=cfg.weight_dtype,
        rngs=mt.nnx.Rngs(params=0),
    )
  graph, state, rest = mt.nnx.split(layer, mt.nnx.Param, ...)
  # Only its structure: every weight is replaced by ours (its own random
  # ones freed now, not held by the step).
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
  del layer

  def apply(params, x):
    # Our layout {gate: {kernel}, wi_0, wi_1, wo} is MaxText's too.
    weights = jax.tree.map(lambda a: a, state)
    mt.nnx.replace_by_pure_dict(weights, params)
    out, _, _ = mt.nnx.merge(graph, weights, rest)(x)
    return out

  return _loss_and_grads(apply), _maxtext_context(mt, cfg, mesh)


# -- timing and comparing ----------------------------------------------------


def build(names, shape: Shape, ops: dict, args):
  """({variant: compiled step}, {variant: error text}, {variant: its
  arguments}); for `args.device`, a target's, when it is set."""
  interpret, workers, device = args.interpret, args.workers, args.device
  ours_mesh = contextlib.nullcontext
  if device is not None:
    mesh = jax.sharding.Mesh(np.array([device]), ("data",))
    ours_mesh = functools.partial(jax.set_mesh, mesh)
  mt = None
  lowered, errors, call_args = {}, {}, {}
  for name in names:
    side, impl, rows_once, paired = parse_variant(name)
    call_args[name] = (
        ops["dense"] if side == "dense" else ops["params"],
        ops["x"],
        ops["cot"],
    )
    try:
      if side == "dense":
        step, context = dense_step(), ours_mesh()
      elif side == "ours":
        step = our_step(shape, impl, rows_once)
        context = ours_mesh()
        if interpret and impl == "kernel":
          context = accelerator.kernels_on_cpu("pallas")
        if not paired:
          context = _both(context, accelerator.paired_gate_up(False))
      else:
        mt = mt or import_maxtext()
        step, context = maxtext_step(mt, shape, impl, device)
      with context:
        lowered[name] = step.lower(*call_args[name])
    except Exception as e:  # noqa: BLE001 (a variant that fails is a result)
      errors[name] = f"{type(e).__name__}: {e}"[:600]
  start = time.perf_counter()

  def compile_one(item):
    name, low = item
    try:
      return name, low.compile()
    except Exception as e:  # noqa: BLE001
      return name, e

  compiled = {}
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    for name, result in pool.map(compile_one, lowered.items()):
      if isinstance(result, Exception):
        errors[name] = f"{type(result).__name__}: {result}"[:600]
      else:
        compiled[name] = result
  print(f"  compiled {len(compiled)} in {time.perf_counter() - start:.1f} s")
  for name, text in errors.items():
    print(f"  {name}: not run: {text}", flush=True)
  return compiled, errors, call_args


@contextlib.contextmanager
def _both(first, second):
  with first, second:
    yield


@jax.jit
def _relative(got, want):
  return jax.tree.map(
      lambda g, w: jnp.max(
          jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))
      )
      / jnp.max(jnp.abs(w.astype(jnp.float32))),
      got,
      want,
  )


def differences(calls: dict, args: dict) -> dict:
  """{variant: {leaf: max |its - reference| / max |reference|}} of each
  layer variant's (out, weight grads, x grad) against REFERENCE's (else
  the first layer variant's)."""
  layers = [n for n in calls if n != "dense"]
  if len(layers) < 2:
    return {}
  ref = REFERENCE if REFERENCE in layers else layers[0]
  want = calls[ref](*args[ref])
  out = {}
  for name in layers:
    if name == ref:
      continue
    got = calls[name](*args[name])
    rel = _relative(
        {"out": got[0], "grad": got[1], "x_grad": got[2]},
        {"out": want[0], "grad": want[1], "x_grad": want[2]},
    )
    flat = jax.tree_util.tree_flatten_with_path(rel)[0]
    out[name] = {
        "/".join(str(getattr(k, "key", k)) for k in path): float(v)
        for path, v in flat
    }
    worst = max(out[name], key=out[name].get)
    verdict = "agree" if out[name][worst] <= BF16_TOLERANCE else "DIFFER"
    print(
        f"  {name} against {ref}: max relative difference "
        f"{out[name][worst]:.2e} ({worst}); out {out[name]['out']:.2e}: "
        f"{verdict} (bf16: {BF16_TOLERANCE:.0e})",
        flush=True,
    )
  del want
  return {"reference": ref, "variants": out}


def bench_shape(label: str, shape: Shape, args) -> dict:
  print(
      f"== {label}: {shape.batch} x {shape.seq} tokens, {shape.experts}"
      f" experts of {shape.emb} x {shape.mlp}, top-{shape.top_k},"
      f" {shape.routing} (bf16)",
      flush=True,
  )
  sharding = None
  if args.device is not None:
    sharding = jax.sharding.SingleDeviceSharding(args.device)
  ops = operands(shape, sharding)
  calls, errors, call_args = build(args.variants, shape, ops, args)
  result = {"shape": dataclasses.asdict(shape), "errors": errors}
  if args.device is not None:
    result["compiled"] = compiled_sizes(calls, shape)
    return result
  if not calls:
    return result
  seconds = bench_gmm.alternating_medians(calls, call_args, args.repeats)
  ms = {name: s * 1e3 for name, s in seconds.items()}
  flops = useful_flops(shape)
  frac = fractions(ms)
  result["ms"] = ms
  result["tflops"] = {name: flops / t / 1e9 for name, t in ms.items()}
  result["fraction_of_dense"] = frac
  for name in calls:
    line = (
        f"  {name:>22}: {ms[name]:9.3f} ms, "
        f"{result['tflops'][name]:7.1f} TFLOP/s"
    )
    if name in frac:
      line += f", {frac[name]:.2f} of dense"
      if name.startswith("ours") and name != "ours_ragged_dot":
        line += f" (bar {shape.bar:.2f})"
    print(line, flush=True)
  result["differences"] = differences(calls, call_args)
  return result


def compiled_sizes(calls: dict, shape: Shape) -> dict:
  """{variant: its compiled program's temporaries, arguments (GiB) and
  FLOPs over the useful ones}, printed: a target's compile, not run.
  A GPU compiled without one has no cost analysis: its FLOPs are None
  ("no compiler FLOPs")."""
  out = {}
  for name, call in calls.items():
    mem = call.memory_analysis()
    flops = costs.compiled_cost(call).get("flops")
    out[name] = {
        "temp_gib": mem.temp_size_in_bytes / 2**30,
        "argument_gib": mem.argument_size_in_bytes / 2**30,
        "flops_over_useful": (
            None if flops is None else float(flops) / useful_flops(shape)
        ),
    }
    counted = (
        "no compiler FLOPs"
        if flops is None
        else f"FLOPs {out[name]['flops_over_useful']:.2f} of the useful"
    )
    print(
        f"  {name:>22}: temp {out[name]['temp_gib']:.2f} GiB, arguments "
        f"{out[name]['argument_gib']:.2f} GiB, {counted}",
        flush=True,
    )
  return out


def _version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "-"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES)
  )
  parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument(
      "--workers", type=int, default=os.cpu_count(), help="compile threads"
  )
  parser.add_argument("--out", default=".", help="where to write the JSON")
  parser.add_argument(
      "--interpret",
      action="store_true",
      help="tiny shapes, Pallas in interpret mode (a CPU rehearsal)",
  )
  parser.add_argument(
      "--target",
      help=(
          "compile for this target (e.g. tpu:v5e-1, through libtpu) and"
          " print each program's sizes; nothing runs"
      ),
  )
  args = parser.parse_args(argv)
  # tokamax reads absl flags, which parse sys.argv on first use and refuse
  # this script's own options (the chip's first run: "Unknown command line
  # flag 'out'"): parse none of them there.
  try:
    from absl import flags as absl_flags  # noqa: PLC0415
  except ImportError:
    absl_flags = None
  if absl_flags is not None and not absl_flags.FLAGS.is_parsed():
    absl_flags.FLAGS(sys.argv[:1])
  args.device = None
  if args.target:
    from linen_moe import planning  # noqa: PLC0415

    target = planning.parse_target(args.target)
    planning.prepare_process(target)
    args.device = planning.target_devices(target)[0]
  for name in args.variants:
    parse_variant(name)
  table = TINY if args.interpret else SHAPES
  head = {
      "device": (args.device or jax.devices()[0]).device_kind,
      "jax": jax.__version__,
      "maxtext": _version("maxtext"),
      "flax": _version("flax"),
      "interpret": args.interpret,
      "repeats": args.repeats,
  }
  print(", ".join(f"{k} {v}" for k, v in head.items()), flush=True)
  os.makedirs(args.out, exist_ok=True)
  results = {}
  for label in args.shapes:
    results[label] = bench_shape(label, table[label], args)
    path = os.path.join(args.out, "bench_maxtext_layer.json")
    with open(path, "w", encoding="utf-8") as f:
      json.dump({**head, "shapes": results}, f, indent=1)
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
